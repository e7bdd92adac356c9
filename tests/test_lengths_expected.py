"""lengths.expected: the planner's per-micro-batch time, communication and memory under an observed
length distribution, and `planner.build.build_problem(scenario, lengths=...)` taking it (planner integration)."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from malleus_svc.config import ConfigError, Scenario
from malleus_svc.lengths import LengthCost, LengthError, LengthHistogram, LengthProfile, expected_micro_batch
from malleus_svc.lengths.expected import analytic_cost
from malleus_svc.planner import evaluate, plan
from malleus_svc.plan import RECOMPUTE
from malleus_svc.planner.problem import CommCosts, MemoryProfile, PlannerProblem
from malleus_svc.simulate.scenarios import paper_scenario
from malleus_svc.planner.build import build_problem, length_profile


def lognormal(seq_len: int, n: int = 5000, seed: int = 0) -> list[int]:
    """Long-tailed: median ~seq_len/10, mean ~seq_len/4, clipped to seq_len."""
    rng = np.random.default_rng(seed)
    x = rng.lognormal(math.log(seq_len / 4) - 1.3 ** 2 / 2, 1.3, n)
    return np.clip(np.round(x), 8, seq_len).astype(int).tolist()


# ------------------------------------------------------------------ the profile
def test_profile_by_hand():
    # B = 2 × 8 = 16 tokens; FFD of [8, 4, 4, 2]: {8, 4, 4} and {2}. Per micro-batch a·Σl² + b·Σl + d·n + c with
    # a, b, c, d = 1, 10, 5, 1: fixed {8, 8} = 2·(64 + 80 + 1) + 5 = 295; {8, 4, 4} = 96 + 160 + 3 + 5 = 264;
    # {2} = 4 + 20 + 1 + 5 = 30. Two micro-batches for the planner's two slots (4 samples / 2).
    cost = LengthCost.single(a=1.0, b=10.0, c=5.0, d=1.0)
    p = expected_micro_batch([8, 4, 4, 2], cost, micro_batch_size=2, seq_len=8, global_batch=4)
    assert p.count_ratio == 1.0 and p.time_ratio == pytest.approx((264 + 30) / 2 / 295)
    assert p.work_ratio == pytest.approx(294 / 590)
    assert p.token_ratio == pytest.approx(18 / 32)
    assert p.memory_tokens == 16 and p.memory_ratio == 1.0 and p.samples == 4
    # The median packed micro-batch holds 2 tokens, but the longest sequence (8) must still fit.
    half = expected_micro_batch([8, 4, 4, 2], cost, micro_batch_size=2, seq_len=8, global_batch=4, quantile=0.5)
    assert half.memory_tokens == 8 and half.memory_ratio == 0.5
    # A sample longer than seq_len trains on seq_len tokens; a bigger global batch packs its short samples tighter.
    assert expected_micro_batch([20, 8, 8, 8], cost, micro_batch_size=2, seq_len=8, global_batch=4).is_fixed
    short = expected_micro_batch([2] * 8, cost, micro_batch_size=1, seq_len=8, global_batch=8)
    assert short.count_ratio == 2 / 8 and short.token_ratio == 0.25


def test_fixed_lengths_are_exactly_the_planner_assumption():
    cost = LengthCost.single(a=3e-9, b=2e-5, c=1e-3, d=1e-4)
    for observed in ([4096] * 1000, LengthHistogram.of([4096] * 1000)):
        for mbs, gb in ((1, 64), (4, 64), (3, 9999)):
            p = expected_micro_batch(observed, cost, micro_batch_size=mbs, seq_len=4096, global_batch=gb)
            assert p.is_fixed and (p.time_ratio, p.count_ratio, p.token_ratio, p.memory_ratio) == (1, 1, 1, 1)
    sc = paper_scenario("70b-64gpu", "severe")
    prof = length_profile(sc, [sc.shape.seq_len] * 100)
    assert prof.is_fixed and build_problem(sc, lengths=prof) == build_problem(sc)


def test_long_tail_cheaper_per_slot_and_histogram_agrees_with_lengths():
    sc = paper_scenario("70b-64gpu", "healthy")
    lens = lognormal(sc.shape.seq_len)
    p = length_profile(sc, lens)
    h = length_profile(sc, LengthHistogram.of(lens))
    # Fewer tokens per sample (mean ~L/4) and cheaper tokens (less attention): a slot costs ~a fifth of t0.
    assert 0.15 < p.work_ratio < 0.3 and p.token_ratio < 0.3 and p.count_ratio < 0.3
    assert p.time_ratio < 1.0 and p.work_ratio < p.token_ratio       # short sequences: less attention per token
    assert p.memory_tokens == sc.micro_batch * sc.shape.seq_len     # 64 samples fill whole micro-batches
    for k in ("work_ratio", "token_ratio", "time_ratio"):            # histogram quantiles are within a bucket
        assert getattr(h, k) == pytest.approx(getattr(p, k), rel=0.02)
    # The analytic cost is the scenario's own t0 model: one sequence of seq_len tokens is t0.
    co = analytic_cost(sc.shape, sc.tp).at(sc.tp)
    from malleus_svc.costmodel.analytic import DeviceSpec, block_seconds
    assert co.micro_batch([sc.shape.seq_len]) == pytest.approx(block_seconds(sc.shape, sc.tp, 1, DeviceSpec()))


def test_inputs_checked_and_nothing_observed():
    cost = LengthCost.single(a=1.0, b=1.0)
    assert expected_micro_batch([], cost, micro_batch_size=1, seq_len=8, global_batch=4) is None
    assert expected_micro_batch(LengthHistogram(), cost, micro_batch_size=1, seq_len=8, global_batch=4) is None
    with pytest.raises(LengthError, match="global_batch"):
        expected_micro_batch([4], cost, micro_batch_size=2, seq_len=8, global_batch=3)
    with pytest.raises(LengthError, match="quantile"):
        expected_micro_batch([4], cost, micro_batch_size=1, seq_len=8, global_batch=4, quantile=0.0)
    # A cost fitted for one TP degree is used for another (only ratios are taken); two degrees: must match.
    assert expected_micro_batch([4], cost, micro_batch_size=1, seq_len=8, global_batch=1, tp=8) is not None
    two = LengthCost({1: cost.at(), 2: cost.at()})
    with pytest.raises(LengthError, match="tp"):
        expected_micro_batch([4], two, micro_batch_size=1, seq_len=8, global_batch=1, tp=8)
    only_layers = Scenario.from_dict({"cluster": {"nodes": 1, "gpus_per_node": 2}, "model": {"layers": 4},
                                      "parallel": {"dp": 1, "tp": 1, "pp": 2}, "batch": {"global": 4},
                                      "profile": {"tp_alpha": [1], "layer_memory_mb": [100, 50],
                                                  "embedding_memory_mb": 10}})
    with pytest.raises(ConfigError, match="length cost"):
        length_profile(only_layers, [4])
    assert length_profile(only_layers, [4, 8], cost, seq_len=8).token_ratio == pytest.approx(0.75)


# ------------------------------------------------------------------ what it does to the planner's problem
def test_apply_rescales_time_communication_and_memory():
    base = PlannerProblem(num_nodes=1, gpus_per_node=8, num_layers=8, dp=2, tp=2, pp=2, num_micro_batches=8,
                          micro_batch_size=2, rates=(1.0,) * 8, tp_alpha=(1.0, 2.0),
                          memory=MemoryProfile((400.0, 300.0, 200.0), 50.0, 100.0, 10.0, 1000.0),
                          comm=CommCosts(0.1, 0.4, 2.0), t0_seconds=0.02, optimizer_per_block=0.06)
    prof = LengthProfile(time_ratio=0.8, count_ratio=0.5, token_ratio=0.3, memory_tokens=4, token_budget=8,
                         samples=16)
    p = prof.apply(base)
    assert p.t0_seconds == pytest.approx(0.02 * 0.4)
    # p2p bytes follow the tokens (0.3), in the new unit (÷ 0.4); the reduction and the optimizer step
    # are per iteration (÷ 0.4).
    assert (p.comm.p2p_intra_node, p.comm.p2p_inter_node, p.comm.grad_sync_per_block) == pytest.approx(
        (0.1 * 0.75, 0.4 * 0.75, 2.0 / 0.4))
    assert p.optimizer_per_block == pytest.approx(0.06 / 0.4)
    # K[d] = 100 + 100·d (d = 3, 2, 1): activations halve, states stay: 250, 200, 150. Embedding untouched.
    assert p.memory.layer_mb == pytest.approx((250.0, 200.0, 150.0)) and p.memory.embedding_mb == 50.0
    assert p.memory.per_layer_mb(4) == pytest.approx(300.0)           # extrapolated with the halved step
    assert (p.rates, p.tp_alpha, p.num_micro_batches) == (base.rates, base.tp_alpha, base.num_micro_batches)


def test_long_tail_changes_the_planners_prediction_and_decision():
    """70B on 64 GPUs, one device at 5×. Under a long-tailed distribution (mean ~L/4) an iteration of the
    same 64 samples is ~5× less compute. 'paper' objective: the same plan, predicted ~5× faster (exactly
    the work ratio). 'full' objective: the gradient reduction, the same bytes whatever the lengths, now
    weighs ~5× more against compute, so the planner trades data parallelism for depth (fewer pipelines
    reducing gradients), and that plan is better than the fixed-length one under the observed lengths."""
    sc = paper_scenario("70b-64gpu", "severe")
    prof = length_profile(sc, lognormal(sc.shape.seq_len))
    fixed_prof = length_profile(sc, [sc.shape.seq_len] * 64)

    paper = plan(build_problem(sc, objective="paper")).plan
    paper_lt = plan(build_problem(sc, objective="paper", lengths=prof)).plan
    assert paper_lt.plan_id == paper.plan_id
    assert paper_lt.predicted_iteration_seconds == pytest.approx(paper.predicted_iteration_seconds * prof.work_ratio)

    full_problem, full_lt_problem = build_problem(sc, objective="full"), build_problem(sc, objective="full", lengths=prof)
    full = plan(full_problem).plan
    full_lt = plan(full_lt_problem).plan
    assert plan(build_problem(sc, objective="full", lengths=fixed_prof)).plan.plan_id == full.plan_id
    assert len(full_lt.pipelines) < len(full.pipelines)
    assert full_lt.predicted_iteration_seconds < 0.5 * full.predicted_iteration_seconds
    assert evaluate(full_lt_problem, full_lt) < evaluate(full_lt_problem, full)
    assert evaluate(full_problem, full) <= evaluate(full_problem, full_lt)   # and the converse at fixed lengths


def test_few_tokens_per_iteration_lower_the_memory_rows():
    """32 samples per iteration, 8 per micro-batch (a budget of 8·L tokens). Quarter-length samples
    fill 4 whole micro-batches: memory as planned. Samples of L/32 all fit in one micro-batch of L
    tokens: every stage needs an eighth of the activation memory, and can hold more blocks."""
    spec = {"cluster": {"nodes": 1, "gpus_per_node": 8, "gpu_memory_mb": 81252},
            "model": "llama-32b", "parallel": {"dp": 1, "tp": 2, "pp": 4}, "batch": {"global": 32, "micro": 8}}
    sc = Scenario.from_dict(spec)
    L = sc.shape.seq_len
    assert length_profile(sc, [L // 4] * 32).memory_ratio == 1.0
    prof = length_profile(sc, [L // 32] * 32)
    assert prof.memory_tokens == L and prof.memory_ratio == 1 / 8 and prof.count_ratio == 1 / 4
    base, lt = build_problem(sc), build_problem(sc, lengths=prof)
    for d in range(1, 5):
        assert lt.memory.per_layer_mb(d) < base.memory.per_layer_mb(d)
    from malleus_svc.planner.lower import layer_caps
    caps = [sum(layer_caps([1.0] * 4, sc.num_layers, p.memory)) for p in (base, lt)]
    assert caps[1] > caps[0], caps
    # An eighth of the tokens is what a micro-batch of one sample holds: each recompute mode prices a
    # block as that micro-batch's model does (what recomputation frees shrinks with the activations).
    one = build_problem(Scenario.from_dict({**spec, "batch": {"global": 32, "micro": 1}}))
    for mode in RECOMPUTE:
        for h, d in itertools.product((1, 2), range(1, 5)):
            assert lt.memory.block_mb(h, d, mode) == pytest.approx(one.memory.block_mb(h, d, mode)), (mode, h, d)
