"""Length-aware assignment in the real runtime: each global batch is dealt to pipelines and packed
into micro-batches by predicted time (control/assign.py), the workers train exactly what they
are given, and because the loss is weighted by tokens the training is the same as under the
plan's fixed split: equal losses step by step, every sample used once per step (the group checks
every assignment)."""
from __future__ import annotations

import json

import pytest

from malleus_svc.config import ConfigError
from malleus_svc.config.job import JobConfig

pytestmark = [pytest.mark.ray, pytest.mark.slow]

STEPS = 6


def job(name: str, assignment: str) -> JobConfig:
    return JobConfig.from_dict({
        "name": name, "cluster": {"nodes": 1, "gpus_per_node": 4, "gpu_memory_mb": 16000}, "model": "tiny",
        "parallel": {"dp": 2, "tp": 1, "pp": 2}, "batch": {"global": 16, "micro": 2},
        "data": {"source": "synthetic", "seq_len": 64, "num_samples": 256, "vocab": 256, "assignment": assignment},
        "train": {"steps": STEPS, "lr": 1e-3}, "metrics": {"enabled": False}})


def test_length_aware_assignment_trains_exactly_like_the_fixed_split(ray_cluster, tmp_path):
    from malleus_svc.train import run_through_coordinator

    lines = {}
    for mode in ("fixed", "length-aware"):
        out = tmp_path / f"{mode}.jsonl"
        assert run_through_coordinator(job(f"la-{mode}", mode), None, STEPS, metrics_out=str(out), static=True,
                                       say=lambda m: None) == 0
        lines[mode] = [json.loads(x) for x in out.read_text().splitlines()]
    fixed, aware = lines["fixed"], lines["length-aware"]
    assert [x["step"] for x in aware] == list(range(STEPS))
    for a, f in zip(aware, fixed):
        assert a["loss"] == pytest.approx(f["loss"], rel=1e-5), (a["step"], a["loss"], f["loss"])
        assert (a["samples"], a["tokens"], a["sampler_position"]) == (f["samples"], f["tokens"], f["sampler_position"])


def test_length_aware_needs_packed_rows():
    with pytest.raises(ConfigError) as e:
        JobConfig.from_dict({"name": "x", "cluster": {"nodes": 1, "gpus_per_node": 2}, "model": "tiny",
                             "parallel": {"dp": 2, "tp": 1, "pp": 1}, "batch": {"global": 4, "micro": 1},
                             "data": {"mode": "pad", "assignment": "length-aware"}})
    assert e.value.field == "data.assignment"


def test_assign_deals_every_sequence_once_and_balances_time():
    """No Ray: `assign` on a long-tailed batch, two pipelines of which one has a 3x straggler."""
    import random

    from _plans import make_plan
    from malleus_svc.control.assign import assign
    from malleus_svc.lengths import LengthCost, PipelineSpec
    from malleus_svc.runtime.data import check_assignment, split_for_plan

    plan = make_plan([([((0,), (0, 2)), ((1,), (2, 4))], 4), ([((2,), (0, 2)), ((3,), (2, 4))], 4)],
                     num_devices=4, layers=4, gpn=4, mbs=2)
    rng = random.Random(0)
    ids = list(range(100, 116))
    lengths = {i: min(64, max(4, int(rng.lognormvariate(3.0, 0.8)))) for i in ids}
    rates = {2: 3.0}
    cost = LengthCost.single(a=2e-6, b=1e-4, c=1e-3)
    budget = 2 * 64
    out = assign(ids, [lengths[i] for i in ids], plan, cost, rates, budget)
    check_assignment(ids, out, plan)                              # every id once, no empty pipeline
    assert all(sum(lengths[i] for i in mb) <= budget for pipe in out for mb in pipe)

    def predicted(split):
        return max(cost.pipeline_time([[lengths[i] for i in mb] for mb in pipe],
                                      PipelineSpec.from_plan(p, rates).stages) for pipe, p in zip(split, plan.pipelines))

    fixed = split_for_plan(ids, plan)
    assert predicted(out) < 0.8 * predicted(fixed), (predicted(out), predicted(fixed))
    tokens = [sum(lengths[i] for mb in pipe for i in mb) for pipe in out]
    assert tokens[1] < tokens[0]                                  # the straggling pipeline gets less


def test_a_drift_of_the_sampled_lengths_asks_for_a_re_plan():
    """The coordinator's length statistics: a stable distribution asks nothing; when the tail
    doubles, a 'lengths' request is queued and the new distribution becomes the reference."""
    import random

    from malleus_svc.control.coordinator import JobCoordinator

    cfg = job("drift", "fixed")
    c = JobCoordinator(cfg)    # not set up: no plan in force, so requests stay queued for inspection
    rng = random.Random(0)
    for _ in range(20):
        c._observe_lengths([int(rng.lognormvariate(3.0, 0.5)) + 1 for _ in range(16)])
    assert not c.rounds.pending and c.lengths.last_drift is None
    for _ in range(8):
        c._observe_lengths([2 * int(rng.lognormvariate(3.0, 0.5)) + 1 for _ in range(16)])
    kinds = [r.kind.value for r in c.rounds.pending]
    assert kinds == ["lengths"], kinds
    drift = c.lengths.last_drift
    assert drift["drifted"] and ("p90" in drift["reason"] or "p99" in drift["reason"])
