"""`malleus bench lengths`: the quick bench runs, its plans are exactly-once and never lose to the
oblivious baselines on their shared cost model, and the analytic cost coefficients scale as they should."""
from __future__ import annotations

import dataclasses
import itertools
import math

import pytest

from _host import Section
from benchmarks import BENCHES
from benchmarks import lengths as bl
from malleus_svc.config.presets import preset
from malleus_svc.costmodel.analytic import DeviceSpec, block_seconds
from malleus_svc.lengths import PipelineSpec, StageSpec, predicted_time


# ------------------------------------------------------------------ the quick bench, run once
@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    d = tmp_path_factory.mktemp("bench_lengths")
    md, png = d / "BENCHMARKS.md", d / "lengths.png"
    md.write_text("# Benchmarks\n\n## Another section\n\n<!-- bench:other -->\nkeep me\n<!-- /bench:other -->\n")
    with Section() as run:
        configs, text = bl.execute(bl.parse_args(["--quick", "--write", str(md), "--plot", str(png)]))
    return configs, text, md, png, run


def test_quick_bench_runs_and_writes(quick):
    configs, text, md, png, run = quick
    assert "lengths" in BENCHES
    # 70b-64gpu, both distributions, healthy and straggler, 3 iterations each.
    assert {(c.dist, c.straggler) for c in configs} == {(d, s) for d in bl.DISTS for s in (False, True)}
    assert all(len(c.iterations) == 3 for c in configs)
    assert png.exists() and png.stat().st_size > 10_000
    body = md.read_text()
    assert "keep me" in body and body.count("<!-- bench:lengths -->") == 1 and "| configuration |" in body
    assert "Command: `malleus bench lengths --quick" in body
    # Writing again replaces the section, it does not append a second one.
    bl.write_markdown("replaced", md)
    body = md.read_text()
    assert body.count("<!-- bench:lengths -->") == 1 and "replaced" in body and "| configuration |" not in body
    assert "keep me" in body
    run.require_pace()  # planning is timed on the wall clock: judged only where this process had its core
    for c in configs:   # planning is well below the iteration time
        assert c.planning_ratio() < 0.2, (c.name, c.planning_ratio())


def test_aware_never_slower_than_oblivious_on_its_cost_model(quick):
    configs, *_ = quick
    for c in configs:
        for k, it in enumerate(c.iterations):
            best_oblivious = min(it.iter_s("sampler"), it.iter_s("ffd"))
            assert it.iter_s("aware") <= best_oblivious * (1 + 1e-9), (c.name, k)
            # The MILP is started from the greedy answer and can only improve it, time limit or not.
            assert it.objective <= it.greedy_objective * (1 + 1e-12)
            if it.ilp_status == "optimal":   # then it also beats the oblivious assignment's own estimate
                assert it.objective <= it.lb_oblivious * (1 + 1e-3) + 1e-12, (c.name, k)
            # Stage 1 is a lower bound on what stage 2 achieves.
            assert it.objective <= it.iter_s("aware") * (1 + 1e-9)


def test_gap_of_aware_below_oblivious_on_average(quick):
    configs, *_ = quick
    for c in configs:
        mean = {m: sum(c.gaps(m)) / len(c.iterations) for m in bl.METHODS}
        assert mean["aware"] <= mean["sampler"] and mean["aware"] <= mean["ffd"], (c.name, mean)


def test_exactly_once_check_catches_broken_plans():
    lengths = [100, 200, 300, 400]
    pipes = [PipelineSpec.uniform(2, 1, max_tokens=bl.CONTEXT)] * 2
    bl.check_exactly_once([[[0, 1]], [[2], [3]]], lengths, pipes, "ok")
    for broken in ([[[0, 1]], [[2]]],                 # 3 missing
                   [[[0, 1], [1]], [[2], [3]]],       # 1 twice
                   [[[0, 1, 4]], [[2], [3]]],         # unknown index
                   [[[0, 1], []], [[2], [3]]]):       # empty micro-batch
        with pytest.raises(AssertionError):
            bl.check_exactly_once(broken, lengths, pipes, "broken")
    with pytest.raises(AssertionError, match="over-capacity"):
        bl.check_exactly_once([[[0, 1, 2, 3]], []], [bl.CONTEXT, 1, 1, 1], pipes, "too big")


def test_time_limited_dispatch_keeps_the_greedy_bound():
    """With a (near) zero MILP time limit the answer is still exactly-once and no worse than the greedy."""
    setup = bl.SETUPS["70b-64gpu-dp4"]
    cost = bl.length_cost(preset(setup.model), [setup.tp])
    pipes = bl.pipelines_for(setup, straggler=True)
    data, _ = bl.dataset_lengths("synthetic")
    lengths = bl.TokenBudgetSampler(data, setup.tokens_per_iteration(2), seed=5).next_batch()
    aw = bl.aware_plan(lengths, pipes, cost, ilp_time_limit=0.01, pack_time_limit=0.1, pack_total=0.3)
    bl.check_exactly_once(aw.plan, lengths, pipes, "time-limited")
    assert aw.ilp_status in ("time_limit", "optimal")
    assert aw.objective <= aw.greedy_objective * (1 + 1e-12)
    times = bl.pipeline_times(aw.plan, lengths, pipes, cost)
    for j, (t, lb) in enumerate(zip(times, aw.stage1_times)):
        assert lb <= t * (1 + 1e-9) + 1e-12, j
    for variant in ("sampler", "ffd"):
        obl = bl.oblivious_plan(lengths, pipes, variant)
        bl.check_exactly_once(obl, lengths, pipes, variant)
        assert max(times) <= max(bl.pipeline_times(obl, lengths, pipes, cost)) * (1 + 1e-9)


# ------------------------------------------------------------------ cost coefficients
def test_coefficients_reproduce_the_analytic_block_time():
    dev = DeviceSpec()
    for name, tp in (("llama-32b", 2), ("llama-70b", 8), ("gpt-1.3b", 1)):
        shape = preset(name)
        co = bl.analytic_coeffs(shape, tp, dev, recompute=False, kernels=0, collective_latency_s=0.0)
        for length in (512, 4096, 32768):
            want = block_seconds(shape, tp, 1, dev, seq_len=length)
            assert math.isclose(co.a * length ** 2 + co.b * length + co.c, want, rel_tol=1e-12), (name, length)


def test_coefficients_scale_as_expected():
    dev = DeviceSpec()
    f = dev.flops_per_second
    s70 = preset("llama-70b")
    base = bl.analytic_coeffs(s70, 1)
    assert base.a > 0 and base.b > 0 and base.c > 0 and base.d == 0
    # a is the causal attention term, 6·h FLOPs per token², × 4/3 for the recomputed forward.
    assert math.isclose(base.a, 4 / 3 * 6 * s70.hidden / f, rel_tol=1e-12)
    assert math.isclose(bl.analytic_coeffs(s70, 1).a / bl.analytic_coeffs(s70, 1, recompute=False).a, 4 / 3)
    # TP divides the compute; communication only adds to b, and only for t > 1.
    for t in (2, 4, 8):
        co = bl.analytic_coeffs(s70, t)
        assert math.isclose(co.a * t, base.a, rel_tol=1e-12)
        assert co.b * t > base.b
        assert co.b < base.b                        # still faster per token than one device
    assert math.isclose(base.b, 4 / 3 * 6 * (s70.block_params() - 2 * s70.hidden) / f, rel_tol=1e-12)
    # a ∝ h at a fixed TP degree; b ∝ block params ∝ h²: the crossover length b/a grows with the hidden
    # size (a/b falls: a wider model spends a smaller share on attention at a given length).
    wide = ["gpt-1.3b", "gpt-32l", "llama-32b", "llama-70b"]
    ratios = [bl.analytic_coeffs(preset(n), 8).b / bl.analytic_coeffs(preset(n), 8).a for n in wide]
    assert ratios == sorted(ratios) and ratios[-1] > 2 * ratios[0], ratios
    s32 = preset("llama-32b")
    assert math.isclose(bl.analytic_coeffs(s70, 8).a / bl.analytic_coeffs(s32, 8).a, s70.hidden / s32.hidden)
    for n, lo, hi in (("llama-32b", 60_000, 100_000), ("llama-70b", 90_000, 140_000)):
        co = bl.analytic_coeffs(preset(n), 8)
        assert lo < co.b / co.a < hi, (n, co.b / co.a)
    # c is a small launch overhead: a few % of a 4K-token sequence's block time at TP 8.
    co = bl.analytic_coeffs(s70, 8)
    assert co.c < 0.05 * (co.a * 4096 ** 2 + co.b * 4096)


def test_coefficients_against_hydraulis_published_fit():
    """LLaMA-32B ⟨8,1⟩ (Hydraulis's published a, b per 60-layer stage in ms, A800): same order, a within 25%."""
    a_theirs, b_theirs = 2.12548718e-6 / 60 * 1e-3, 0.141411593 / 60 * 1e-3     # s per layer
    co = bl.analytic_coeffs(preset("llama-32b"), 8, recompute=False)
    assert 0.8 < co.a / a_theirs < 1.25, co.a / a_theirs
    assert 1.0 < co.b / b_theirs < 2.0, co.b / b_theirs


# ------------------------------------------------------------------ setups, memory, baselines, sampler
def test_every_setup_holds_a_full_micro_batch_and_the_replan_is_minimal():
    for s in bl.SETUPS.values():
        shape = preset(s.model)
        for strag in (False, True):
            pipes = bl.pipelines_for(s, strag)
            assert len(pipes) == s.dp
            for p in pipes:
                layers = [st.layers for st in p.stages]
                assert sum(layers) == shape.layers and min(bl.stage_max_tokens(s, layers)) >= bl.CONTEXT
        slow = bl.pipelines_for(s, True)[0]
        rates = [st.rate for st in slow.stages]
        got = max(st.weight for st in slow.stages)
        best = min(max(r * x for r, x in zip(rates, comp))
                   for comp in _compositions(shape.layers, len(rates)))
        assert math.isclose(got, best), (s.name, got, best)
        assert best > shape.layers / s.pp   # the re-planned pipeline stays slower: uneven pipelines


def _compositions(total, parts):
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield [bounds[i + 1] - bounds[i] for i in range(parts)]


def test_sampler_and_distributions():
    for dist in bl.DISTS:
        data, desc = bl.dataset_lengths(dist)
        assert data.min() >= 1 and data.max() == bl.CONTEXT and desc
        assert 1000 < float(sorted(data)[len(data) // 2]) < 4000         # long-tailed: median ~1.7K
        s = bl.TokenBudgetSampler(data, 131072, seed=1)
        for _ in range(12):                                              # crosses an epoch for python
            batch = s.next_batch()
            assert sum(batch) == 131072 and max(batch) <= bl.CONTEXT and min(batch) >= 1


def test_oblivious_baselines():
    lengths = [30000, 5000, 4000, 20000, 12000, 700, 32768, 1000, 900, 15000]
    pipes = bl.pipelines_for(bl.SETUPS["70b-64gpu"], straggler=False)
    plan = bl.oblivious_plan(lengths, pipes, "sampler")
    # Contiguous slices in sampler order, micro-batch counts as even as possible.
    assert [i for mbs in plan for mb in mbs for i in mb] == list(range(len(lengths)))
    assert abs(len(plan[0]) - len(plan[1])) <= 1
    assert all(sum(lengths[i] for i in mb) <= bl.CONTEXT for mbs in plan for mb in mbs)
    ffd = bl.oblivious_plan(lengths, pipes, "ffd")
    bl.check_exactly_once(ffd, lengths, pipes, "ffd")
    # With a straggler, the slower pipeline gets fewer micro-batches (Malleus's speed-proportional split).
    slow = bl.pipelines_for(bl.SETUPS["70b-64gpu"], straggler=True)
    counts = bl.split_counts(20, slow)
    assert sum(counts) == 20 and counts[0] < counts[1]
    assert bl.split_counts(7, pipes) == [4, 3]
    # The stage-1 estimate of a pipeline never exceeds its packed time.
    cost = bl.length_cost(preset("llama-70b"), [8])
    for mbs, p in zip(plan, pipes):
        packed = cost.pipeline_time([[lengths[i] for i in mb] for mb in mbs], p.stages)
        assert predicted_time([lengths[i] for mb in mbs for i in mb], p, cost) <= packed * (1 + 1e-12)


# ------------------------------------------------------------------ event-simulator scoring
def _sim_setup(pp, layers, rates=None, dp=1):
    """A 70B setup with hand-made pipelines (memory not checked: timing only)."""
    setup = bl.Setup("t", "llama-70b", nodes=dp * pp, dp=dp, tp=8, pp=pp)
    cost = bl.length_cost(preset(setup.model), [8])
    rates = rates or [1.0] * pp
    pipes = [PipelineSpec(tuple(StageSpec(n, r, 8) for n, r in zip(layers, rates)), bl.CONTEXT) for _ in range(dp)]
    return setup, pipes, cost, bl.sim_setup(setup, pipes, cost)


def test_single_stage_simulation_equals_the_formula():
    """One stage: the 1F1B timeline is the sum of the micro-batches, exactly the formula; then the gradient
    reduction (blocks held by both pipelines) and the optimizer step, as the simulator charges them."""
    setup, pipes, cost, ss = _sim_setup(1, [80], dp=2)
    lengths = [30000, 2000, 700, 5000, 12000, 32768, 100]
    plan = [[[0, 1], [2, 3]], [[4, 6], [5]]]
    after = dataclasses.replace(ss, options=dataclasses.replace(ss.options, overlap_grad_reduce=False))
    it, ends = bl.simulate_plan(plan, lengths, after)
    formula = bl.pipeline_times(plan, lengths, pipes, cost)
    assert ends == pytest.approx(formula, rel=1e-12)
    sync = ss.problem.comm.grad_sync_per_block * 80 / 8          # every block held by both pipelines, TP 8
    step = ss.problem.optimizer_per_block * 80
    assert sync > 0 and step > 0
    assert it == pytest.approx(max(formula) + sync + step, rel=1e-12)
    # behind the last backward (the default): at least the first block's reduction is left after it
    behind, ends = bl.simulate_plan(plan, lengths, ss)
    assert ends == pytest.approx(formula, rel=1e-12)
    assert max(formula) + sync / 80 + step <= behind + 1e-9 and behind < it
    # A straggling single stage scales the same way.
    setup, pipes, cost, ss = _sim_setup(1, [80], rates=[2.5])
    it, ends = bl.simulate_plan([[[0, 1, 2], [3]]], lengths[:4], ss)
    assert ends[0] == pytest.approx(bl.pipeline_times([[[0, 1, 2], [3]]], lengths[:4], pipes, cost)[0], rel=1e-12)


def test_two_uneven_stages_by_hand():
    """Stages of 30 and 50 layers, micro-batches of work a then b (per layer), no p2p, no step:
    s0 F0[0,10a] F1[10a,10a+10b]; s1 F0 from 10a, B0 ends 60a; s1 F1 from 60a (10b <= 50a), B1 ends 60a+50b;
    s0 B0 [60a, 80a]; s0 B1 ends max(60a+50b, 80a) + 20b. The formula charges the larger micro-batch's fill."""
    from malleus_svc.planner.problem import CommCosts
    from malleus_svc.simulate import SimOptions
    setup, pipes, cost, ss = _sim_setup(2, [30, 50])
    ss = dataclasses.replace(ss, problem=dataclasses.replace(ss.problem, comm=CommCosts()),
                             options=SimOptions(optimizer_per_block=0.0))
    lengths = [16000, 4000, 9000, 20000]
    plan = [[[0, 1], [2, 3]]]
    a, b = (ss.coeffs.micro_batch([lengths[i] for i in mb]) for mb in plan[0])
    assert 10 * b <= 50 * a and b > a
    want = max(60 * a + 50 * b, 80 * a) + 20 * b
    it, ends = bl.simulate_plan(plan, lengths, ss)
    assert it == pytest.approx(want, rel=1e-12) and ends == [pytest.approx(want, rel=1e-12)]
    formula = bl.pipeline_times(plan, lengths, pipes, cost)[0]
    assert formula == pytest.approx(50 * a + 50 * b + 30 * b, rel=1e-12)   # Σ max + fill of the larger
    # With the analytic p2p back (two nodes: InfiniBand), every boundary crossing adds to the critical path.
    _, _, _, ss_p2p = _sim_setup(2, [30, 50])
    assert ss_p2p.problem.comm.p2p_inter_node > 0
    assert bl.simulate_plan(plan, lengths, ss_p2p)[0] > it


def test_empty_pipeline_is_simulated_as_one_empty_micro_batch():
    setup, pipes, cost, ss = _sim_setup(2, [40, 40], dp=2)
    it, ends = bl.simulate_plan([[[0]], []], [1000], ss)
    assert ends[1] == 0.0 and ends[0] > 0 and it > ends[0]


def test_quick_bench_simulates_every_plan(quick):
    configs, text, md, png, _ = quick
    assert "The same plans replayed in the event simulator" in text and "Event simulator" in text
    for c in configs:
        for it in c.iterations:
            assert set(it.sim_iter) == set(bl.METHODS) and all(len(v) == c.setup.dp for v in it.sim_times.values())
            for m in bl.METHODS:
                # the simulator can beat the formula's fill (it times the real order), never the bottleneck's work
                assert it.iter_s(m, True) >= max(it.sim_times[m])
                assert 0.7 < it.iter_s(m, True) / it.iter_s(m) < 1.5, (c.name, m)
        # length-aware balances pipelines in the simulator too
        mean = {m: sum(c.gaps(m, True)) / len(c.iterations) for m in bl.METHODS}
        assert mean["aware"] < mean["sampler"] and mean["aware"] < mean["ffd"], (c.name, mean)


def test_one_f_one_b_stalls_on_mixed_sizes_the_formula_does_not_see():
    """Why sampler-order loses more in the simulator than in the formula: in 1F1B's steady state a stage
    runs the forward of micro-batch k + S − s − 1 beside the backward of k, so long micro-batches between
    short ones stall it; slowest first (how `pack` and FFD order them) the timeline meets the formula."""
    from malleus_svc.planner.problem import CommCosts
    from malleus_svc.simulate import SimOptions
    setup, pipes, cost, ss = _sim_setup(4, [20, 20, 20, 20])
    ss = dataclasses.replace(ss, problem=dataclasses.replace(ss.problem, comm=CommCosts()),
                             options=SimOptions(optimizer_per_block=0.0))
    lengths = [24000, 4000, 4000, 24000, 4000, 4000, 24000, 4000]
    mixed = [[[i] for i in range(len(lengths))]]
    slowest_first = [[[i] for i in sorted(range(len(lengths)), key=lambda i: -lengths[i])]]
    f_mixed, f_sorted = (bl.pipeline_times(p, lengths, pipes, cost)[0] for p in (mixed, slowest_first))
    assert f_mixed == pytest.approx(f_sorted, rel=1e-12)          # the formula does not see the order
    s_mixed, s_sorted = (bl.simulate_plan(p, lengths, ss)[0] for p in (mixed, slowest_first))
    assert s_sorted == pytest.approx(f_sorted, rel=1e-9)
    assert s_mixed > 1.1 * s_sorted
