"""A scenario -> the planner's input: the one place a `PlannerProblem` is made from a user's file."""
from __future__ import annotations

from typing import Any, Mapping

from ..config.errors import ConfigError
from ..config.scenario import Scenario, validate_rates
from ..costmodel.scenario import scenario_costs
from ..lengths.expected import LengthProfile, analytic_cost, expected_micro_batch
from .problem import PlannerProblem


def build_problem(sc: Scenario, rates: Mapping[int, float] | None = None, excluded=None,
                  lengths: LengthProfile | None = None, **overrides: Any) -> PlannerProblem:
    """The planner's input under these (or the scenario's) rates and exclusions; with `lengths` (see
    `length_profile`), its per-micro-batch time, communication and memory terms follow that length
    distribution instead of fixed-length micro-batches (`LengthProfile.apply`). `overrides` replace
    planner settings or problem fields (e.g. `objective="full"`)."""
    if rates is not None:
        rates = validate_rates(rates, sc.num_devices)
    costs = scenario_costs(sc)
    kw: dict[str, Any] = dict(sc.planner)
    kw.update(overrides)
    problem = PlannerProblem(
        num_nodes=sc.nodes, gpus_per_node=sc.gpus_per_node, num_layers=sc.num_layers,
        dp=sc.dp, tp=sc.tp, pp=sc.pp, num_micro_batches=sc.num_micro_batches,
        micro_batch_size=sc.micro_batch, rates=sc.rate_vector(rates),
        excluded=frozenset(sc.excluded if excluded is None else excluded), tp_weight=sc.profile.tp_weight,
        **{"tp_alpha": costs.tp_alpha, "memory": costs.memory, "comm": costs.comm,
           "t0_seconds": costs.t0_seconds, "state_sizes": costs.state_sizes,
           "optimizer_per_block": costs.optimizer_per_block, **kw})
    return problem if lengths is None else lengths.apply(problem)


def length_profile(sc: Scenario, observed, cost=None, *, seq_len: int | None = None,
                   quantile: float = 1.0) -> LengthProfile | None:
    """`lengths.expected.expected_micro_batch` of the observed lengths (a `LengthHistogram` or a list)
    for this scenario's batch: micro-batches of `micro` samples of `seq_len` tokens (default: the
    model's), `global` samples per iteration. `cost` (a `LengthCost`) defaults to the analytic block
    time the scenario's own t0 comes from. None when nothing was observed."""
    if sc.shape is None and (cost is None or seq_len is None):
        raise ConfigError("model", sc.num_layers, "a model shape, or both a length cost and seq_len, to "
                                                  "price variable-length micro-batches")
    cost = cost or analytic_cost(sc.shape, sc.tp, sc.device)
    return expected_micro_batch(observed, cost, micro_batch_size=sc.micro_batch,
                                seq_len=seq_len or sc.shape.seq_len, global_batch=sc.global_batch,
                                tp=sc.tp, quantile=quantile)
