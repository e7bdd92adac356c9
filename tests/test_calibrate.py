"""`malleus bench calibrate` without Ray: the fits recover known coefficients from synthetic
timings (made by the simulator itself where the fit goes through it), the hand-off ping-pong's
one-way times and line fit, and the hand-built profiling/validation plans are valid for `small`."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from benchmarks import BENCHES
from benchmarks.calibrate import (LAYERS, ComputeFit, Handoff, Samples, Terms, boundary_bytes, calibrated_problem,
                                  calibrate_from, fit_compute, fit_corun, fit_handoff, fit_line, fit_monotone,
                                  measure_rounds, model_floats, one_way, pace_delta, pace_group, pace_plan, parser,
                                  pp2, profile_plans, rank_agreement, rescore, sim_seconds, table, validation_plans)
from malleus_svc.config.presets import PRESETS
from malleus_svc.plan import Plan
from malleus_svc.runtime.data import split_for_plan
from malleus_svc.runtime.engine import validate_plan_for_model
from malleus_svc.simulate.timeline import simulate

TRUE = dict(t1=0.015, t2=0.011, opt_per_block=0.002, dispatch=0.04)


def synthetic_rows(noise: float = 0.0, seed: int = 0):
    rng = random.Random(seed)
    rows = []
    for g in (1, 2):
        for m in (2, 4, 6):
            t = TRUE["t1"] if g == 1 else TRUE["t2"]
            T = m * LAYERS * t + TRUE["opt_per_block"] * LAYERS * 2 / g + TRUE["dispatch"]
            rows.append((g, LAYERS, m, T * (1 + noise * rng.uniform(-1, 1))))
    return rows


def test_fit_compute_recovers_exact_coefficients():
    fit = fit_compute(synthetic_rows())
    for k, v in TRUE.items():
        assert getattr(fit, k) == pytest.approx(v, rel=1e-9, abs=1e-12)
    assert fit.residual_rms == pytest.approx(0.0, abs=1e-12)


def test_fit_compute_without_constant_folds_nothing_away():
    rows = [(g, L, m, T - TRUE["dispatch"]) for g, L, m, T in synthetic_rows()]
    fit = fit_compute(rows, constant=False)
    assert fit.dispatch == 0.0
    for k in ("t1", "t2", "opt_per_block"):
        assert getattr(fit, k) == pytest.approx(TRUE[k], rel=1e-9)


def test_calibrate_from_recovers_all_coefficients():
    """'Measurements' made by the simulator (+ D) with known coefficients are fitted back: compute
    exactly, κ by the 1-D search with the measured hand-off and grad sync in place."""
    true = ComputeFit(**TRUE, residual_rms=0.0)
    handoff = (0.0004, 0.0003)
    terms = Terms(handoff=handoff, corun=0.17, sync=0.1 * TRUE["t2"])
    prof = {name: (kind, plan, sim_seconds(plan, true, 1, 128, terms) + true.dispatch)
            for name, (kind, plan) in profile_plans().items()}
    fit, got = calibrate_from(prof, 1, 128, constant=True, handoff=handoff, sync=terms.sync)
    for k, v in TRUE.items():
        assert getattr(fit, k) == pytest.approx(v, rel=1e-6)
    assert got.handoff == handoff and got.sync == terms.sync
    assert got.corun == pytest.approx(0.17, abs=1e-4)
    assert {k for k, _ in profile_plans().values()} == {"single", "corun"}


def test_corun_is_what_separates_balanced_from_uneven_pipelines():
    """With κ > 0 a balanced PP2 (both stages busy all through the steady state) pays more than an
    uneven one per unit of work; the fit from the two uneven profiling runs predicts the balanced one."""
    fit = ComputeFit(**{**TRUE, "dispatch": 0.0}, residual_rms=0.0)
    terms = Terms(corun=0.2)
    runs = [(pp2(s, m), sim_seconds(pp2(s, m), fit, 1, 128, terms)) for s, m in ((3, 4), (5, 6))]
    k = fit_corun(runs, fit, 1, 128, Terms())
    assert k == pytest.approx(0.2, abs=1e-4)
    stretch = {s: sim_seconds(pp2(s, 8), fit, 1, 128, terms) / sim_seconds(pp2(s, 8), fit, 1, 128) for s in (2, 4)}
    assert stretch[4] > stretch[2] > 1.0


def test_fit_monotone_finds_interior_and_end_minima():
    assert fit_monotone(lambda x: (x - 1.3) ** 2) == pytest.approx(1.3, abs=1e-4)
    assert fit_monotone(lambda x: (x + 1.0) ** 2) == 0.0          # κ is never negative
    assert fit_monotone(lambda x: (x - 9.0) ** 2, hi=4.0) == 4.0


def test_handoff_one_way_times_and_line_fit():
    """Both peers' (post, done) marks on one clock: 0 → 1 is done₁ − post₀, 1 → 0 is done₀ − post₁."""
    fixed, bw = (50e-6, 80e-6), (4e9, 2e9)
    marks = {0: {}, 1: {}}
    for n in (32768, 131072, 524288):
        t, m0, m1 = 10.0, [], []
        for k in range(8):
            there = t + fixed[0] + n / bw[0] + (1e-3 if k == 7 else 0.0)   # one slow wake-up
            back = there + fixed[1] + n / bw[1]
            m0.append((t, back))
            m1.append((there, there))
            t = back + 1e-3
        marks[0][n], marks[1][n] = m0, m1
    one = one_way(marks)
    assert one[131072][0][0] == pytest.approx(fixed[0] + 131072 / bw[0])
    assert one[131072][1][0] == pytest.approx(fixed[1] + 131072 / bw[1])
    h = fit_handoff(one)
    assert h.fixed == pytest.approx(fixed, rel=1e-6) and h.bandwidth == pytest.approx(bw, rel=1e-6)
    nb = boundary_bytes(1, 128, 256)
    assert nb == 131072
    assert h.seconds(nb) == pytest.approx((fixed[0] + nb / bw[0], fixed[1] + nb / bw[1]))
    assert fit_line([1, 2], [3.0, 2.0])[1] == float("inf")           # no bandwidth term when time falls with size
    assert Handoff((1e-4, -1.0), (float("inf"), 1e9)).seconds(1000) == (1e-4, 0.0)
    with pytest.raises(ValueError):
        fit_line([1, 1], [1.0, 2.0])


def test_fit_compute_is_least_squares_under_noise():
    fit = fit_compute(synthetic_rows(noise=0.01, seed=3))
    assert fit.t1 == pytest.approx(TRUE["t1"], rel=0.05)
    assert fit.t2 == pytest.approx(TRUE["t2"], rel=0.05)
    assert fit.residual_rms > 0


def test_fit_compute_rejects_underdetermined_runs():
    with pytest.raises(ValueError):
        fit_compute([(1, LAYERS, 2, 1.0), (1, LAYERS, 4, 2.0)])   # no TP2 run
    with pytest.raises(ValueError):
        fit_compute([(3, LAYERS, 2, 1.0)] * 4)


def test_model_floats_count_the_whole_gradient():
    shape = PRESETS["small"]
    block = 4 * 256 * 256 + 3 * 704 * 256 + 2 * 256          # wq wk wv wo, gate up down, two norms
    assert model_floats(shape) == 8 * block + 2 * 256 * 256 + 256   # + embedding, head, final norm


def test_problem_carries_fitted_coefficients():
    fit = ComputeFit(**TRUE, residual_rms=0.0)
    problem, opts = calibrated_problem(fit, 1, 128, Terms(handoff=(0.0004, 0.0002), corun=0.3, sync=0.002))
    assert problem.t0_seconds == pytest.approx(TRUE["t2"])
    assert problem.tp_alpha == pytest.approx((1.0, TRUE["t1"] / TRUE["t2"]))
    assert problem.comm.p2p_intra_node == 0.0
    assert problem.comm.grad_sync_per_block == pytest.approx(0.002 / TRUE["t2"])
    assert problem.optimizer_per_block == pytest.approx(TRUE["opt_per_block"] / TRUE["t2"])
    assert opts.handoff == pytest.approx((0.0004 / TRUE["t2"], 0.0002 / TRUE["t2"]))
    assert opts.corun_slowdown == 0.3
    # A single-stage TP1 run is exactly m·L·t1 + optimizer (2 x per block at TP1) in the simulator.
    plan = validation_plans()["split: TP1 + 1 suspended (8 blocks, m=8)"]
    want = 8 * LAYERS * TRUE["t1"] + TRUE["opt_per_block"] * LAYERS * 2
    assert simulate(plan, problem, options=opts).iteration_seconds == pytest.approx(want)


def test_plans_are_valid_for_the_small_model():
    shape = PRESETS["small"]
    plans = [p for _, p in profile_plans().values()] + list(validation_plans().values())
    assert len(validation_plans()) == 5
    for plan in plans:
        assert isinstance(plan, Plan)
        validate_plan_for_model(shape, plan)
        assert plan.num_devices == 2 and plan.num_layers == shape.layers == LAYERS
        ids = list(range(plan.global_batch))
        assert sum(len(mb) for pipe in split_for_plan(ids, plan) for mb in pipe) == plan.global_batch
    kinds = {n: p for n, p in validation_plans().items()}
    assert [s.num_layers for s in kinds["uneven layers PP2 (2/6 blocks, m=8)"].pipelines[0].stages] == [2, 6]
    assert [p.micro_batches for p in kinds["uneven data DP2 (m=5/3)"].pipelines] == [5, 3]
    assert kinds["split: TP1 + 1 suspended (8 blocks, m=8)"].suspended == (1,)
    assert kinds["TP2 group (8 blocks, m=8)"].pipelines[0].stages[0].tp == 2


def test_samples_and_table():
    s = Samples(times=[0.5, 0.4, 0.45, 0.6], loads=[1.0, 2.0, 1.5, 1.2], cpu=[0.3, 0.2, 0.25, 0.3])
    assert s.stat("min") == 0.4 and s.stat("q25") == pytest.approx(0.4375) and s.stat("median") == 0.475
    assert s.stat() == s.stat("q10") == pytest.approx(0.415)     # the fit's estimator: between the two fastest
    assert s.summary()["cpu_at_min_s"] == 0.2 and s.summary()["load1_max"] == 2.0
    c = {"t1_s": 0.015, "t2_s": 0.011, "tp_alpha": [1, 1.36], "t0_seconds": 0.011, "optimizer_per_block_s": 0.001,
         "dispatch_s": 0.0, "handoff_s": [1e-4, 1e-4], "corun_slowdown": 0.12, "grad_sync_per_block_s": 0.004,
         "fit_rms_s": 0.005}
    coeffs = {"simulator_terms": c, "with_constant": dict(c, dispatch_s=-0.05), "profile": {"x": s.summary()},
              "handoff": {"boundary_bytes": 131072, "fixed_s": [4e-5, 5e-5], "bandwidth_Bps": [4e9, float("inf")],
                          "sizes": [32768, 131072], "median_s": [[1e-4, 2e-4], [1e-4, 3e-3]],
                          "at_boundary_s": [7e-5, 5e-5]}}
    row = {"plan": "p", "measured_s": 0.4, "min_s": 0.38, "median_s": 0.47, "load1_min": 1.0, "load1_max": 2.0,
           "predicted_s": 0.42, "error": 0.05, "error_by_min": 0.08, "error_without_handoff_corun": -0.1,
           "predicted_with_constant_s": 0.3, "error_with_constant": -0.25}
    md = table(coeffs, [row])
    assert "κ = 0.120" in md and "| p | 0.400 | 0.380 |" in md and "+5.0% | +8.0% | -10.0% |" in md
    assert "| yes |" in md and "x: 0.415 s (min 0.400" in md
    assert "fit B: optimizer and D within 3x the fit RMS" in md      # 8 ms < 3 · 5 ms; D negative
    assert "Clock: host" in md and md.splitlines()[-3].endswith("| yes | – |")
    pace = {"flops_per_second": 2e10, "bytes_per_second": 3e9, "sized_under": "DP2 m=1/1", "ops": 400, "held": 0.99}
    md = table(dict(coeffs, pace=pace), [dict(row, pace_held=0.98)])
    assert "Clock: device" in md and "20.00 GFLOP/s, 3.00 GB/s" in md and "99.0% of 400 paced ops" in md
    assert "| yes | 98.0% |" in md


def test_rank_agreement_over_validation_and_all_plans_and_its_line():
    valid = [(0.77, 0.78), (1.03, 1.05), (0.89, 0.88), (1.12, 1.10), (1.35, 1.35)]   # same order
    fitted = [(0.40, 0.50), (0.50, 0.40)]                                            # one swapped pair
    r = rank_agreement(valid, fitted)
    assert r["validation"] == {"plans": 5, "spearman": pytest.approx(1.0), "kendall": pytest.approx(1.0)}
    assert r["all"]["plans"] == 7 and r["all"]["kendall"] == pytest.approx((20 - 1) / 21)
    c = {"t1_s": 0.015, "t2_s": 0.011, "tp_alpha": [1, 1.36], "t0_seconds": 0.011, "optimizer_per_block_s": 0.001,
         "dispatch_s": 0.0, "handoff_s": [1e-4, 1e-4], "corun_slowdown": 0.0, "grad_sync_per_block_s": 0.004,
         "fit_rms_s": 0.005}
    coeffs = {"simulator_terms": c, "with_constant": c, "profile": {}, "ranks": r,
              "handoff": {"boundary_bytes": 131072, "fixed_s": [4e-5, 5e-5], "bandwidth_Bps": [4e9, 4e9],
                          "sizes": [131072], "median_s": [[1e-4], [1e-4]], "at_boundary_s": [7e-5, 5e-5]}}
    assert "Spearman +1.00, Kendall +1.00 over the 5 validation plans; +0.96 / +0.90 over all 7" in table(coeffs, [])


def test_measure_rounds_interleaves_and_skips_the_warm_up():
    """A stand-in WorkerGroup: every plan in every round (odd rounds backwards), one warm-up step
    dropped per apply, the busiest device's compute CPU kept beside each time."""
    class Rec:
        def __init__(self, t):
            self.iteration_seconds, self.devices = t, {0: {"compute_seconds": t / 2}, 1: {"compute_seconds": None}}

    class Group:
        def __init__(self):
            self.log, self.t = [], 0.0

        def apply_plan(self, plan, shape, seed, optim):
            self.log.append(plan.pipelines[0].micro_batches)

        def step(self, ids):
            self.t += 1.0
            return Rec(self.t)

    class Sampler:
        def next_index(self):
            return 0

    plans = {"a": pp2(4, 2), "b": pp2(4, 3)}
    g = Group()
    out = measure_rounds(g, plans, None, Sampler(), rounds=3, steps=2, optim=None)
    assert g.log == [2, 3, 3, 2, 2, 3]
    assert out["a"].times == [2.0, 3.0, 11.0, 12.0, 14.0, 15.0] and out["b"].times == [5.0, 6.0, 8.0, 9.0, 17.0, 18.0]
    assert out["a"].cpu == [t / 2 for t in out["a"].times] and len(out["a"].loads) == 6


def test_registered():
    assert "calibrate" in BENCHES


RUNS = Path(__file__).resolve().parent.parent / "benchmarks" / "calibrate"


@pytest.mark.parametrize("run, which", [("run9", "min"), ("run16", "q10")])
def test_rescoring_a_recorded_run_with_its_own_statistic_gives_its_recorded_errors(run, which):
    """run 9 was measured with the minimum, run 16 with the 10th percentile: refitting either from the
    step times its JSON keeps must give back the errors the bench printed (BENCHMARKS.md's tables)."""
    recorded = [r["error"] for r in json.loads((RUNS / f"{run}.json").read_text())["rows"]]
    assert rescore(RUNS / f"{run}.json", which) == pytest.approx(recorded, abs=1e-9)
    assert rescore(RUNS / f"{run}.json", "median") != pytest.approx(recorded, abs=1e-3)


def test_rescoring_a_run_without_step_times_says_so(tmp_path):
    old = tmp_path / "run5.json"
    old.write_text(json.dumps({"coefficients": {"profile": {}}, "rows": [{"plan": "p", "measured_s": 0.4}]}))
    with pytest.raises(ValueError, match="keeps every step time"):
        rescore(old, "q10")


def test_clock_defaults_to_the_device_clock():
    assert parser().parse_args([]).clock == "device"
    assert parser().parse_args(["--clock", "host"]).clock == "host"
    with pytest.raises(SystemExit):
        parser().parse_args(["--clock", "wall"])


def test_pace_group_paces_once_under_the_pace_plan():
    """The pace is sized from one micro-batch's tokens after the pace plan is applied."""
    calls = []

    class Group:
        def apply_plan(self, plan, shape, seed, optim):
            calls.append(("apply", plan))

        def pace(self, tokens):
            calls.append(("pace", tokens))
            return "pace"

    assert pace_group(Group(), pace_plan(2), None, 2 * 128, None) == "pace"
    assert calls == [("apply", pace_plan(2)), ("pace", 256)]
    assert [p.micro_batches for p in pace_plan().pipelines] == [1, 1]      # both devices compute


def test_pace_delta_counts_each_devices_ops_since_its_last_report():
    last = {}
    assert pace_delta(last, {0: {"pace_ops": 10, "pace_on": 9}, 1: {"pace_ops": 4, "pace_on": 4}}) == (14, 13)
    assert pace_delta(last, {0: {"pace_ops": 15, "pace_on": 13}}) == (5, 4)          # device 1 suspended
    assert pace_delta(last, {0: {"pace_ops": 15, "pace_on": 13}, 1: {"pace_ops": 6, "pace_on": 5}}) == (2, 1)
    assert pace_delta({}, {0: {"compute_seconds": 0.1}}) == (0, 0)                  # unpaced: no counts


def test_kappa_fits_to_zero_when_compute_does_not_depend_on_corunning():
    """On the device clock a device's compute time does not depend on the other one: 'measurements'
    made by the simulator with κ = 0 (hand-off and grad sync in place) must fit back κ ≈ 0."""
    true = ComputeFit(**{**TRUE, "dispatch": 0.0}, residual_rms=0.0)
    terms = Terms(handoff=(0.0004, 0.0003), corun=0.0, sync=0.002)
    prof = {name: (kind, plan, sim_seconds(plan, true, 1, 128, terms))
            for name, (kind, plan) in profile_plans().items()}
    fit, got = calibrate_from(prof, 1, 128, constant=False, handoff=terms.handoff, sync=terms.sync)
    assert got.corun == pytest.approx(0.0, abs=1e-4)
    for name, plan in validation_plans().items():
        assert sim_seconds(plan, fit, 1, 128, got) == pytest.approx(sim_seconds(plan, true, 1, 128, terms), rel=1e-3)
