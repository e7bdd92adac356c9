"""The simulator against hand-computed 1F1B timelines, the cost model's memory, and the baselines.

Hand timelines give each stage 3 blocks (c = 3 t0 per micro-batch: forward 1, backward 2), so
every start and end is an integer that can be checked on paper (see each test).
"""
from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings, strategies as st

from malleus_svc.config import Scenario
from malleus_svc.plan import Pipeline, Plan, Stage, StateSizes
from malleus_svc.planner.problem import CommCosts, MemoryProfile, PlannerProblem
from malleus_svc.simulate import (Costs, Phase, SimOptions, Trace, make_systems, memory_report, migration_seconds,
                                  one_f_one_b, run_trace, simulate, simulate_cli)
from malleus_svc.simulate.baselines import data_only_plan, restart_plan, static_plan, straggler_nodes
from malleus_svc.simulate.memory import device_peak_mb
from malleus_svc.planner.build import build_problem
from malleus_svc.planner.organize import p2p_extras

NO_OPT = SimOptions(optimizer_per_block=0.0, record_ops=True)
MEM = MemoryProfile(layer_mb=(1500, 1270, 1040, 810), embedding_mb=600, reserved_mb=4500,
                    safety_margin_mb=4096, gpu_memory_mb=40536)


def problem(num_devices=8, gpn=8, tp=1, rates=None, comm=CommCosts(), alpha=(1.0, 2.0, 4.0, 8.0), layers=6,
            M=4, dp=1, pp=2, sizes=StateSizes()) -> PlannerProblem:
    return PlannerProblem(num_nodes=num_devices // gpn, gpus_per_node=gpn, num_layers=layers, dp=dp, tp=tp, pp=pp,
                          num_micro_batches=M, micro_batch_size=1, rates=tuple(rates or (1.0,) * num_devices),
                          tp_alpha=alpha, memory=MEM, comm=comm, state_sizes=sizes)


def chain(stages, m, num_devices=8, gpn=8, layers=None) -> Plan:
    """One pipeline; `stages` = [(devices, blocks)]."""
    out, start = [], 0
    for devs, n in stages:
        out.append(Stage(tuple(devs), (start, start + n)))
        start += n
    used = {d for devs, _ in stages for d in devs}
    return Plan(num_devices, layers or start, 1, (Pipeline(tuple(out), m),),
                tuple(d for d in range(num_devices) if d not in used), (), gpn)


def times(sim) -> dict:
    return {(lab[0], lab[2], lab[3]): (s, e) for lab, s, e in sim.ops if lab[0] not in ("sync", "step")}


# ----------------------------------------------------------------------------- 1F1B timelines
def test_one_f_one_b_order():
    assert one_f_one_b(4, 0, 5) == [("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0), ("F", 4), ("B", 1),
                                    ("B", 2), ("B", 3), ("B", 4)]
    assert one_f_one_b(4, 3, 2) == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]
    assert one_f_one_b(4, 0, 2) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]   # fewer micro-batches than warm-up


def test_uniform_two_stages_by_hand():
    # Stage 0: F0[0,1] F1[1,2] B0[4,6] F2[6,7] B1[7,9] B2[10,12]; stage 1: F0[1,2] B0[2,4] F1[4,5] B1[5,7]
    # F2[7,8] B2[8,10]. End 12 = (m + S - 1)·c = 4·3.
    p = problem(layers=6)
    sim = simulate(chain([((0,), 3), ((1,), 3)], 3), p, options=NO_OPT)
    t = times(sim)
    assert [t[("F", 0, k)] for k in range(3)] == [(0, 1), (1, 2), (6, 7)]
    assert [t[("B", 0, k)] for k in range(3)] == [(4, 6), (7, 9), (10, 12)]
    assert [t[("F", 1, k)] for k in range(3)] == [(1, 2), (4, 5), (7, 8)]
    assert [t[("B", 1, k)] for k in range(3)] == [(2, 4), (5, 7), (8, 10)]
    assert sim.iteration_t0 == 12


def test_uneven_stages_by_hand():
    # c = 3 on stage 0 (3 blocks), 6 on stage 1 (6 blocks): s0 F0[0,1] F1[1,2]; s1 F0[1,3] B0[3,7];
    # s0 B0[7,9]; s1 F1[7,9] B1[9,13]; s0 B1[13,15].
    sim = simulate(chain([((0,), 3), ((1,), 6)], 2), problem(layers=9), options=NO_OPT)
    t = times(sim)
    assert t[("F", 1, 0)] == (1, 3) and t[("B", 1, 0)] == (3, 7) and t[("B", 0, 0)] == (7, 9)
    assert t[("F", 1, 1)] == (7, 9) and t[("B", 1, 1)] == (9, 13) and t[("B", 0, 1)] == (13, 15)
    assert sim.iteration_t0 == 15


def test_per_micro_batch_work_by_hand():
    # Uneven stages (c = 3, 6) as above, micro-batch 0 at work 1/3 and micro-batch 1 at work 2:
    # s0 F0[0,1/3] F1[1/3,2.33]; s1 F0[1/3,1] B0[1,2.33]; s0 B0[2.33,3]; s1 F1[2.33,6.33] B1[6.33,14.33];
    # s0 B1[14.33,18.33]. Work 1 everywhere is the default (test_uneven_stages_by_hand: 15).
    sim = simulate(chain([((0,), 3), ((1,), 6)], 2), problem(layers=9), options=NO_OPT, work=[[1 / 3, 2.0]])
    t = times(sim)
    assert t[("B", 1, 0)] == pytest.approx((1, 1 + 4 / 3)) and t[("B", 0, 0)] == pytest.approx((7 / 3, 3))
    assert t[("F", 1, 1)] == pytest.approx((7 / 3, 19 / 3)) and t[("B", 0, 1)] == pytest.approx((43 / 3, 55 / 3))
    assert sim.iteration_t0 == pytest.approx(55 / 3)
    same = simulate(chain([((0,), 3), ((1,), 6)], 2), problem(layers=9), options=NO_OPT, work=[[1.0, 1.0]])
    assert same.iteration_t0 == 15
    with pytest.raises(ValueError, match="work"):
        simulate(chain([((0,), 3), ((1,), 6)], 2), problem(layers=9), work=[[1.0]])
    with pytest.raises(ValueError, match="volume"):
        simulate(chain([((0,), 3), ((1,), 6)], 2), problem(layers=9), volume=[[1.0, -1.0]])


def test_per_micro_batch_volume_scales_p2p_by_hand():
    # One micro-batch, c = 3 per stage, inter-node p2p 0.5 per micro-batch (0.25 per direction) at volume 2:
    # s0 F[0,1] sF[1,1.5]; s1 F[1.5,2.5] B[2.5,4.5] sB[4.5,5]; s0 B[5,7]. At volume 1: 6.5.
    p = problem(num_devices=2, gpn=1, layers=6, comm=CommCosts(p2p_inter_node=0.5))
    plan = chain([((0,), 3), ((1,), 3)], 1, num_devices=2, gpn=1)
    assert simulate(plan, p, options=NO_OPT, volume=[[2.0]]).iteration_t0 == pytest.approx(7.0)
    assert simulate(plan, p, options=NO_OPT).iteration_t0 == pytest.approx(6.5)
    # Overlapped links: the transfer is off the compute streams, 0.5 each way: s1 F[1.5,2.5] ... s0 B[5,7].
    over = SimOptions(optimizer_per_block=0.0, p2p="overlapped")
    assert simulate(plan, p, options=over, volume=[[2.0]]).iteration_t0 == pytest.approx(7.0)


def test_straggler_and_tp_alpha_scale_a_stage():
    # Stage 1 is a group of 1 at tp=2 (alpha 2) with a device at rate 1.5: c = 1 block · 2 · 1.5 = 3;
    # stage 0 (full group, healthy) c = 1. F0: s0 [0, 1/3], s1 [1/3, 4/3]; B0: s1 [4/3, 10/3], s0 [10/3, 4].
    p = problem(tp=2, rates=(1.0, 1.0, 1.5) + (1.0,) * 5, layers=2, alpha=(1.0, 2.0))
    sim = simulate(chain([((0, 1), 1), ((2,), 1)], 1), p, options=NO_OPT)
    assert sim.pipelines[0].stages[1].compute_per_mb == pytest.approx(3.0)   # 1 block · α 2 · rate 1.5 (t0)
    t = times(sim)
    assert t[("F", 1, 0)] == pytest.approx((1 / 3, 1 / 3 + 1.0)) and sim.iteration_t0 == pytest.approx(1 + 3)


def test_p2p_blocking_by_hand():
    # Devices 0 and 1 on different nodes, inter-node p2p 2 (1 per direction), c = 3, m = 2.
    # s0: F0[0,1] sF0[1,2] F1[2,3] sF1[3,4] B0[6,8] B1[10,12]; s1: F0[2,3] B0[3,5] sB0[5,6] F1[6,7]
    # B1[7,9] sB1[9,10]. End 12.
    p = problem(num_devices=2, gpn=1, layers=6, comm=CommCosts(p2p_inter_node=2.0, p2p_intra_node=0.1))
    sim = simulate(chain([((0,), 3), ((1,), 3)], 2, num_devices=2, gpn=1), p, options=NO_OPT)
    t = times(sim)
    assert t[("sendF", 0, 0)] == (1, 2) and t[("F", 1, 0)] == (2, 3) and t[("sendB", 1, 0)] == (5, 6)
    assert t[("F", 1, 1)] == (6, 7) and t[("B", 0, 0)] == (6, 8) and t[("B", 0, 1)] == (10, 12)
    assert sim.iteration_t0 == 12
    # Same stages on one node: intra-node 0.1 per micro-batch, 0.05 per direction. s0 F0[0,1] sF0
    # [1,1.05] F1[1.05,2.05] sF1[2.05,2.1]; s1 F0[1.05,2.05] B0[2.05,4.05] sB0[4.05,4.1] F1[4.1,5.1]
    # B1[5.1,7.1] sB1[7.1,7.15]; s0 B0[4.1,6.1] B1[7.15,9.15].
    same = simulate(chain([((0,), 3), ((1,), 3)], 2), problem(layers=6, comm=p.comm), options=NO_OPT)
    assert same.iteration_t0 == pytest.approx(9.15)


def test_a_boundary_between_tp_groups_sends_each_ranks_rows_at_once_by_hand():
    """TP2 to TP2 across nodes (sequence parallelism: two transfers of half the tensor at once):
    each direction takes the inter-node 2 x its share / 2, 1/2 on links of each device's own
    (a datasheet), as measured (0.8) where a job timed pairs at once; the planner's stage terms
    say the same."""
    for shares, per_direction in ((None, 0.5), ((("inter", 2, 0.8),), 0.8)):
        p = problem(num_devices=4, gpn=2, tp=2, layers=6,
                    comm=CommCosts(p2p_inter_node=2.0, p2p_intra_node=0.1, p2p_shares=shares))
        sim = simulate(chain([((0, 1), 3), ((2, 3), 3)], 2, num_devices=4, gpn=2), p, options=NO_OPT)
        start, end = times(sim)[("sendF", 0, 0)]
        assert end - start == pytest.approx(per_direction)
        assert p2p_extras(p, [0, 1], [2, 2]) == pytest.approx((per_direction, per_direction))


def test_p2p_overlapped_by_hand():
    # Links carry the transfers, compute goes on: s0 F0[0,1] F1[1,2]; link F: [1,2] [2,3]; s1 F0[2,3]
    # B0[3,5]; link B [5,6]; s1 F1[5,6] B1[6,8]; link B [8,9]; s0 B0[6,8] B1[9,11]. End 11.
    p = problem(num_devices=2, gpn=1, layers=6, comm=CommCosts(p2p_inter_node=2.0))
    sim = simulate(chain([((0,), 3), ((1,), 3)], 2, num_devices=2, gpn=1), p,
                   options=replace(NO_OPT, p2p="overlapped"))
    t = times(sim)
    assert t[("F", 0, 1)] == (1, 2) and t[("sendF", 0, 1)] == (2, 3) and t[("F", 1, 1)] == (5, 6)
    assert t[("B", 0, 1)] == (9, 11) and sim.iteration_t0 == 11


def test_handoff_on_every_crossing_of_a_balanced_pipeline_by_hand():
    # c = 3 per stage (F 1, B 2), m = 3, hand-off 0.5 per direction (a delay on no stream).
    # s0 F0[0,1] →1.5, F1[1,2] →2.5; s1 F0[1.5,2.5] B0[2.5,4.5] →5; s1 F1[4.5,5.5] B1[5.5,7.5] →8;
    # s0 B0[5,7] F2[7,8] →8.5 B1[8,10]; s1 F2[8.5,9.5] B2[9.5,11.5] →12; s0 B2[12,14].
    # End 14 = 12 without hand-off + 4 crossings on the critical path (F0, B0, F2, B2) x 0.5.
    opts = replace(NO_OPT, handoff=(0.5, 0.5))
    sim = simulate(chain([((0,), 3), ((1,), 3)], 3), problem(layers=6), options=opts)
    t = times(sim)
    assert [t[("F", 1, k)] for k in range(3)] == [(1.5, 2.5), (4.5, 5.5), (8.5, 9.5)]
    assert [t[("B", 0, k)] for k in range(3)] == [(5, 7), (8, 10), (12, 14)]
    assert t[("handoffF", 0, 2)] == (8, 8.5) and t[("handoffB", 1, 0)] == (4.5, 5)
    assert sim.iteration_t0 == 14
    # Forward and backward latencies are separate: (0.5, 0.25) → 12 + 2·0.5 + 2·0.25.
    sim = simulate(chain([((0,), 3), ((1,), 3)], 3), problem(layers=6), options=replace(NO_OPT, handoff=(0.5, 0.25)))
    assert sim.iteration_t0 == pytest.approx(13.5)


def test_handoff_hides_behind_the_heavy_stage_by_hand():
    # c = 3 on stage 0, 6 on stage 1 (F 2, B 4), m = 2, hand-off 0.5: s0 F0[0,1] →1.5 F1[1,2] →2.5;
    # s1 F0[1.5,3.5] B0[3.5,7.5] →8 F1[7.5,9.5] (its input arrived at 2.5: hidden) B1[9.5,13.5] →14;
    # s0 B0[8,10] B1[14,16]. End 16 = 15 + the first and the last crossing only.
    sim = simulate(chain([((0,), 3), ((1,), 6)], 2), problem(layers=9), options=replace(NO_OPT, handoff=(0.5, 0.5)))
    t = times(sim)
    assert t[("F", 1, 0)] == (1.5, 3.5) and t[("F", 1, 1)] == (7.5, 9.5) and t[("B", 0, 1)] == (14, 16)
    assert sim.iteration_t0 == 16


def test_handoff_follows_a_blocking_send():
    # Inter-node p2p 2 (1 per direction, on the sender's stream), hand-off 0.5 after it: the
    # activation of F0 arrives at 1 + 1 + 0.5 (compare test_p2p_blocking_by_hand: s1 F0 at 2).
    p = problem(num_devices=2, gpn=1, layers=6, comm=CommCosts(p2p_inter_node=2.0))
    sim = simulate(chain([((0,), 3), ((1,), 3)], 2, num_devices=2, gpn=1), p,
                   options=replace(NO_OPT, handoff=(0.5, 0.5)))
    t = times(sim)
    assert t[("sendF", 0, 0)] == (1, 2) and t[("handoffF", 0, 0)] == (2, 2.5) and t[("F", 1, 0)] == (2.5, 3.5)


def test_corun_slowdown_by_hand():
    # Two one-stage pipelines on one node (devices 0, 1), 3 blocks; device 1 at rate 2 (c 6: F 2,
    # B 4), device 0 healthy (c 3: F 1, B 2), m = 2 and 1, κ = 0.5: while both compute each runs at
    # 1/1.5. p0 F0 done at 1.5 (p1 F0 has 1 of 2 left) → p1 F0 at 3 (p0 B0 has 1 left) → p0 B0 at
    # 4.5 (p1 B0: 3 of 4 left) → p0 F1 [4.5, 6] (p1 B0: 2 left) → p0 B1 (2) and p1 B0 (2 left) share
    # the rest and both end at 6 + 2·1.5 = 9. Without κ: max(2·3, 1·6) = 6.
    p = problem(num_devices=2, gpn=2, layers=3, rates=(1.0, 2.0), dp=2, pp=1)
    plan = Plan(2, 3, 1, (Pipeline((Stage((0,), (0, 3)),), 2), Pipeline((Stage((1,), (0, 3)),), 1)), (), (), 2)
    assert simulate(plan, p, options=NO_OPT).iteration_t0 == 6
    sim = simulate(plan, p, options=replace(NO_OPT, corun_slowdown=0.5))
    t = {(lab[0], lab[1], lab[3]): (s, e) for lab, s, e in sim.ops if lab[0] in "FB"}
    assert t[("F", 0, 0)] == pytest.approx((0, 1.5)) and t[("F", 1, 0)] == pytest.approx((0, 3))
    assert t[("B", 0, 0)] == pytest.approx((1.5, 4.5)) and t[("F", 0, 1)] == pytest.approx((4.5, 6))
    assert t[("B", 1, 0)] == pytest.approx((3, 9)) and t[("B", 0, 1)] == pytest.approx((6, 9))
    assert sim.iteration_t0 == pytest.approx(9)
    assert sim.pipelines[0].stages[0].busy == 6          # busy counts work, not stretched time
    # An op re-timed mid-way from shared to alone: m = 1 each. p0 F0 [0, 1.5]; p1 F0 ends at 3
    # (p0 B0: 1 of 2 left) → p0 B0 ends at 4.5 (p1 B0: 3 of 4 left) → p1 B0 alone, ends at 7.5.
    one = replace(plan, pipelines=(replace(plan.pipelines[0], micro_batches=1), plan.pipelines[1]))
    sim = simulate(one, p, options=replace(NO_OPT, corun_slowdown=0.5))
    t = {(lab[0], lab[1], lab[3]): (s, e) for lab, s, e in sim.ops if lab[0] in "FB"}
    assert t[("B", 0, 0)] == pytest.approx((1.5, 4.5)) and t[("B", 1, 0)] == pytest.approx((3, 7.5))
    # Devices on different nodes do not interfere; nor do the members of one TP group.
    apart = replace(plan, gpus_per_node=1)
    assert simulate(apart, replace(p, num_nodes=2, gpus_per_node=1),
                    options=replace(NO_OPT, corun_slowdown=0.5)).iteration_t0 == 6
    tp2 = chain([((0, 1), 3)], 2, num_devices=2, gpn=2)
    p2 = problem(num_devices=2, gpn=2, layers=3, tp=2, alpha=(1.0, 2.0), pp=1)
    assert simulate(tp2, p2, options=replace(NO_OPT, corun_slowdown=0.5)).iteration_t0 == 6


def test_corun_slowdown_in_a_pipeline_by_hand():
    # Two stages of one pipeline on one node, c = 3 (F 1, B 2), m = 2, κ = 0.5: s0 F0[0,1] alone;
    # s0 F1 and s1 F0 share → both end at 2.5; s1 B0 [2.5, 4.5] alone; s0 B0 and s1 F1 share from
    # 4.5: s1 F1 ends at 6 (s0 B0: 1 left); s1 B1 joins: s0 B0 ends at 7.5 (s1 B1: 1 left), then
    # s1 B1 alone ends at 8.5; s0 B1 [8.5, 10.5]. Without κ: 9. On two nodes: 9 again.
    opts = replace(NO_OPT, corun_slowdown=0.5)
    sim = simulate(chain([((0,), 3), ((1,), 3)], 2, num_devices=2, gpn=2), problem(num_devices=2, gpn=2, layers=6),
                   options=opts)
    t = times(sim)
    assert t[("F", 0, 1)] == pytest.approx((1, 2.5)) and t[("F", 1, 0)] == pytest.approx((1, 2.5))
    assert t[("B", 1, 0)] == pytest.approx((2.5, 4.5)) and t[("F", 1, 1)] == pytest.approx((4.5, 6))
    assert t[("B", 0, 0)] == pytest.approx((4.5, 7.5)) and t[("B", 1, 1)] == pytest.approx((6, 8.5))
    assert t[("B", 0, 1)] == pytest.approx((8.5, 10.5)) and sim.iteration_t0 == pytest.approx(10.5)
    apart = simulate(chain([((0,), 3), ((1,), 3)], 2, num_devices=2, gpn=1),
                     problem(num_devices=2, gpn=1, layers=6), options=opts)
    assert apart.iteration_t0 == 9


def test_corun_slowdown_stretches_the_optimizer_step():
    # Same node, two one-stage pipelines with equal work (3 blocks, m = 1): compute 3 · 1.5 = 4.5,
    # both steps (0.1 · 3 blocks = 0.3 each) run together: 0.3 · 1.5 → 4.95.
    p = problem(num_devices=2, gpn=2, layers=3, dp=2, pp=1)
    plan = Plan(2, 3, 1, (Pipeline((Stage((0,), (0, 3)),), 1), Pipeline((Stage((1,), (0, 3)),), 1)), (), (), 2)
    sim = simulate(plan, p, options=SimOptions(optimizer_per_block=0.1, corun_slowdown=0.5))
    assert sim.iteration_t0 == pytest.approx(4.95)


def test_new_options_are_checked():
    with pytest.raises(ValueError):
        SimOptions(handoff=(-1.0, 0.0))
    with pytest.raises(ValueError):
        SimOptions(corun_slowdown=-0.1)


@settings(max_examples=40, deadline=None)
@given(S=st.integers(1, 4), m=st.integers(1, 8), blocks=st.integers(1, 3), lat_f=st.floats(0.0, 2.0),
       lat_b=st.floats(0.0, 2.0))
def test_uniform_stages_with_handoff(S, m, blocks, lat_f, lat_b):
    """Uniform stages, hand-off λF down and λB up. The path of micro-batch 0 down, every pair on the
    last stage, and the last backward up crosses each boundary once each way, so the iteration is
    at least (m + S - 1)·z + (S - 1)·(λF + λB); no path crosses more than all 2·(S - 1)·m
    boundaries. Two stages exactly: every pair of micro-batches pays one round trip,
    (m + 1)·z + ⌈m/2⌉·(λF + λB) (the 1F1B of stage 0 runs one micro-batch ahead)."""
    p = problem(num_devices=8, layers=S * blocks)
    plan = chain([((j,), blocks) for j in range(S)], m)
    base = (m + S - 1) * blocks
    sim = simulate(plan, p, options=replace(NO_OPT, handoff=(lat_f, lat_b))).iteration_t0
    assert base + (S - 1) * (lat_f + lat_b) - 1e-9 <= sim <= base + (S - 1) * m * (lat_f + lat_b) + 1e-9
    if S == 2:
        assert sim == pytest.approx(base + -(-m // 2) * (lat_f + lat_b))


@settings(max_examples=25, deadline=None)
@given(S=st.integers(1, 6), m=st.integers(1, 12), blocks=st.integers(1, 4))
def test_uniform_stages_match_closed_form(S, m, blocks):
    """(m + S - 1)·z for uniform stages without communication: the planner's 'bubble' form."""
    p = problem(num_devices=8, layers=S * blocks)
    sim = simulate(chain([((j,), blocks) for j in range(S)], m), p, options=NO_OPT)
    assert sim.iteration_t0 == pytest.approx((m + S - 1) * blocks)


def test_gradient_reduction_and_step():
    # Two pipelines of one stage (4 blocks, c = 4, m = 2 → compute ends at 8). Pipeline 1's group is
    # half size (α 2 → ends at 16); reduction waits for it and runs at the smallest holder's shard:
    # 4 blocks · g / 1 device = 4 · 0.5 = 2. Step: 0.1 · 4 blocks · (2/1) · rate 1 = 0.8 on the small group.
    p = problem(num_devices=4, gpn=4, tp=2, layers=4, alpha=(1.0, 2.0), comm=CommCosts(grad_sync_per_block=0.5), dp=2,
                pp=1)
    plan = Plan(4, 4, 1, (Pipeline((Stage((0, 1), (0, 4)),), 2), Pipeline((Stage((2,), (0, 4)),), 2)), (3,), (), 4)
    sim = simulate(plan, p, options=SimOptions(optimizer_per_block=0.1, overlap_grad_reduce=False))
    s0, s1 = sim.pipelines[0].stages[0], sim.pipelines[1].stages[0]
    assert s0.last_backward_end == 8 and s1.last_backward_end == 16
    assert s0.sync_start == s1.sync_start == 16 and s0.sync_end == s1.sync_end == 18
    assert s0.step_end == pytest.approx(18.4) and sim.iteration_t0 == pytest.approx(18.8)
    # Behind the last backward (the default, as the runtime does it): pipeline 1's last backward runs
    # [16 - 16/3, 16] and passes a block every 4/3, the last block first (at 12): each reduction (0.5)
    # starts as the slower holder passes its block, and only the first block's is left after 16.
    sim = simulate(plan, p, options=SimOptions(optimizer_per_block=0.1))
    s0, s1 = sim.pipelines[0].stages[0], sim.pipelines[1].stages[0]
    assert s1.last_backward_end == pytest.approx(16)
    assert s0.sync_start == s1.sync_start == pytest.approx(12) and s0.sync_end == s1.sync_end == pytest.approx(16.5)
    assert sim.iteration_t0 == pytest.approx(16.5 + 0.8)
    # One pipeline: no reduction at all.
    solo = simulate(chain([((0,), 4)], 2, num_devices=4, gpn=4), replace(p, tp=1, tp_alpha=(1.0,)), options=NO_OPT)
    assert solo.iteration_t0 == 8


def test_rates_argument_overrides_problem_rates():
    p = problem(layers=2)
    plan = chain([((0,), 1), ((1,), 1)], 3)
    assert simulate(plan, p, rates={1: 2.0}, options=NO_OPT).iteration_t0 == pytest.approx(simulate(
        plan, replace(p, rates=(1.0, 2.0) + (1.0,) * 6), options=NO_OPT).iteration_t0)
    with pytest.raises(ValueError, match="entries"):
        simulate(plan, p, rates=[1.0, 1.0])


# ----------------------------------------------------------------------------- memory
def test_memory_peaks_follow_cost_model():
    # 4 stages, h = tp/|g|: stage 1 is a half-size group. In flight = min(m, S - j).
    p = problem(num_devices=8, tp=2, layers=8, alpha=(1.0, 2.0), pp=4)
    plan = chain([((0, 1), 2), ((2,), 1), ((3, 4), 2), ((5, 6), 3)], 6)
    sim = simulate(plan, p)
    rep = memory_report(plan, p, sim)
    assert [s.in_flight for s in rep.stages] == [4, 3, 2, 1]
    expect = [1 * (1500 * 2 + 600) + 4500, 2 * (1270 * 1) + 4500, 1 * (1040 * 2) + 4500, 1 * (810 * 3 + 600) + 4500]
    assert [s.peak_mb for s in rep.stages] == pytest.approx(expect)
    assert not rep.oom and not rep.over_budget
    short = simulate(replace(plan, pipelines=(replace(plan.pipelines[0], micro_batches=2),)), p)
    assert [s.max_in_flight for s in short.stages()] == [2, 2, 2, 1]      # min(m, S - j)
    big = chain([((0,), 40), ((1,), 2)], 4)     # 40 blocks · 1040 MB + 600 + 4500 > 40536 MB
    rep = memory_report(big, problem(layers=42), simulate(big, problem(layers=42)))
    assert [s.stage for s in rep.oom] == [0] and rep.peak_mb == pytest.approx(device_peak_mb(
        problem(layers=42), 1, 40, 2, (True, False))) == pytest.approx(40 * 1040 + 600 + 4500)


# ----------------------------------------------------------------------------- baselines
def small_scenario(rates, nodes=2) -> Scenario:
    return Scenario.from_dict({
        "cluster": {"nodes": nodes, "gpus_per_node": 8, "gpu_memory_mb": 40536}, "model": "gpt-1.3b",
        "parallel": {"dp": nodes, "tp": 4, "pp": 2}, "batch": {"global": 16 * nodes, "micro": 1},
        "rates": rates, "planner": {"objective": "full"}}, source="test")


def test_static_and_data_only_plans():
    p = build_problem(small_scenario({3: 5.0}))
    base = static_plan(p)
    assert [[s.devices for s in pp.stages] for pp in base.pipelines] == [[(0, 1, 2, 3), (4, 5, 6, 7)],
                                                                         [(8, 9, 10, 11), (12, 13, 14, 15)]]
    data = data_only_plan(p)
    assert [pp.stages for pp in data.pipelines] == [pp.stages for pp in base.pipelines]
    assert data.pipelines[0].micro_batches < data.pipelines[1].micro_batches and data.global_batch == 32
    assert simulate(data, p).iteration_t0 < simulate(base, p).iteration_t0


def test_restart_drops_straggler_nodes_and_pays_once():
    sc = small_scenario({3: 5.0}, nodes=4)
    p = build_problem(sc)
    assert straggler_nodes(p) == {0}
    new = restart_plan(p)
    assert not {d for d in new.active_devices if d < 8} and new.active_devices and new.global_batch == 64
    restart = make_systems(Costs(restart_seconds=100, checkpoint_interval_seconds=60), names=("restart",))[0]
    d = restart.decide(p, static_plan(p))
    assert d.plan.plan_id == new.plan_id and d.stall_seconds == 100 and d.lost_seconds == 30
    again = restart.decide(p, d.plan)
    assert again.plan.plan_id == new.plan_id and again.stall_seconds == 0
    # Stragglers on every node: nothing to restart on, the static plan keeps running.
    everywhere = build_problem(small_scenario({3: 5.0, 12: 5.0}))
    assert restart_plan(everywhere).plan_id == static_plan(everywhere).plan_id


def test_migration_seconds_by_hand():
    # Two single-device stages swap their 2 + 2 blocks of 1 GB: each device sends and receives 2 GB.
    sizes = StateSizes(block=1e9)
    a = chain([((0,), 2), ((1,), 2)], 4, num_devices=2, gpn=2)
    b = chain([((1,), 2), ((0,), 2)], 4, num_devices=2, gpn=2)
    p = problem(num_devices=2, gpn=2, layers=4, sizes=sizes)
    assert migration_seconds(a, a, p) == 0.0
    assert migration_seconds(a, b, p, Costs(intra_node_gbps=200)) == pytest.approx(2e9 / 200e9)
    a1, b1 = replace(a, gpus_per_node=1), replace(b, gpus_per_node=1)
    p1 = replace(p, num_nodes=2, gpus_per_node=1)
    assert migration_seconds(a1, b1, p1, Costs(inter_node_gbps=25)) == pytest.approx(2e9 / 25e9)


def test_authors_and_ours_migrate_from_the_plan_in_force():
    p = build_problem(small_scenario({5: 8.0, 10: 2.0, 13: 5.0}))
    base = static_plan(p)
    for s in make_systems(names=("authors", "malleus")):
        d = s.decide(p, base)
        assert d.plan.plan_id != base.plan_id and d.stall_seconds > 0 and d.planning_seconds > 0
        assert d.stall_seconds == pytest.approx(migration_seconds(base, d.plan, p))
        assert 5 in d.plan.suspended and not memory_report(d.plan, p, simulate(d.plan, p)).oom


GRID = [{}, {5: 8.0, 10: 2.0, 13: 5.0}, {3: 1.5}, {3: 5.0}, {0: 12.53, 9: 2.57},
        {d: 2.0 for d in range(8, 16)}]  # a whole slow node


@pytest.mark.parametrize("rates", GRID)
def test_ours_never_slower_than_any_baseline(rates):
    p = build_problem(small_scenario(rates))
    base = static_plan(p)
    t = {s.name: simulate(s.decide(p, base).plan, p).iteration_t0 for s in make_systems()}
    assert all(t["malleus"] <= v * (1 + 1e-9) for v in t.values()), t


# ----------------------------------------------------------------------------- traces and CLI
def test_trace_charges_switches():
    sc = small_scenario({})
    trace = Trace("t", (Phase(600, {}), Phase(3600, {3: 5.0})))
    costs = Costs(restart_seconds=300, checkpoint_interval_seconds=600)
    res = {s.name: run_trace(sc, trace, s, costs) for s in make_systems(costs)}
    assert res["static"].switches == 0 and res["static"].stall_seconds == 0
    healthy_s = simulate(static_plan(build_problem(sc)), build_problem(sc)).iteration_seconds
    slow_s = simulate(static_plan(build_problem(sc)), build_problem(sc, rates={3: 5.0})).iteration_seconds
    assert res["static"].samples == pytest.approx(600 / healthy_s * 32 + 3600 / slow_s * 32)
    assert res["restart"].stall_seconds == 300 and res["restart"].lost_samples == pytest.approx(300 / healthy_s * 32)
    assert res["malleus"].switches == 1 and 0 < res["malleus"].stall_seconds < 60
    assert res["malleus"].throughput > res["data-only"].throughput > res["static"].throughput


def test_simulate_cli(capsys):
    assert simulate_cli(["paper-fig4-16gpu", "--system", "static"]) == 0
    out = capsys.readouterr().out
    assert "pipeline 1: 32 micro-batches" in out and "iteration" in out
    assert simulate_cli(["no-such-scenario"]) == 2
    assert "no such file" in capsys.readouterr().err


def test_a_plan_file_is_checked_against_the_scenario_before_it_is_simulated(tmp_path, capsys):
    """A plan the scenario cannot price (a 16-device stage across two 8-device nodes, where the
    scenario's TP groups are 4, 2 or 1 devices) is one line naming the stage; the planner's own plan
    of the scenario, read back from a file, simulates."""
    from malleus_svc.config import load_scenario
    from malleus_svc.config.scenario import find_scenario
    from malleus_svc.planner import plan as solve

    problem = build_problem(load_scenario(find_scenario("paper-fig4-16gpu")))
    good = solve(problem).plan
    good.save(tmp_path / "good.json")
    assert simulate_cli(["paper-fig4-16gpu", "--plan", str(tmp_path / "good.json"), "--brief"]) == 0
    assert good.plan_id in capsys.readouterr().out
    whole = Pipeline((Stage(tuple(range(16)), (0, problem.num_layers)),), problem.num_micro_batches)
    Plan(16, problem.num_layers, problem.micro_batch_size, (whole,)).save(tmp_path / "wide.json")
    assert simulate_cli(["paper-fig4-16gpu", "--plan", str(tmp_path / "wide.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not fit the scenario" in err, err
    assert "pipeline 0 stage 0 has 16 devices on node(s) [0, 1]" in err and "4 or 2 or 1 devices on one node" in err, err


def test_a_recomputing_stage_runs_one_more_forward_in_each_backward():
    """Two stages of 3 blocks, 4 micro-batches, no communication; the second recomputes: its backward
    takes 3 · (2/3 + 1/3) = 3 instead of 2, and the planner's evaluation agrees with the simulation."""
    from malleus_svc.costmodel.profile import RECOMPUTE_TIME_FACTOR
    from malleus_svc.planner import evaluate

    p = replace(problem(layers=6, M=4), objective="full")
    plain = chain([((0,), 3), ((1,), 3)], 4)
    pipe = plain.pipelines[0]
    rc = replace(plain, pipelines=(replace(pipe, stages=(pipe.stages[0], replace(pipe.stages[1], recompute="full"))),))
    t = times(simulate(rc, p, options=NO_OPT))
    assert t[("B", 1, 0)][1] - t[("B", 1, 0)][0] == pytest.approx(3.0)
    assert t[("F", 1, 0)][1] - t[("F", 1, 0)][0] == pytest.approx(1.0)
    sims = [simulate(x, p, options=NO_OPT).iteration_t0 for x in (plain, rc)]
    assert sims[1] > sims[0]
    # the slower stage bounds the steady state: 4 micro-batches of 3 · 4/3, plus the other's fill and drain
    assert sims[1] == pytest.approx(4 * 3 * RECOMPUTE_TIME_FACTOR + 3)
    assert evaluate(p, rc) == pytest.approx(sims[1])
