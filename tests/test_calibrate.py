"""`malleus bench calibrate` without Ray: the fits recover known coefficients from synthetic
timings, and the hand-built profiling/validation plans are valid for the `small` model."""
from __future__ import annotations

import random

import pytest

from malleus_svc.bench import BENCHES
from malleus_svc.bench.calibrate import (LAYERS, ComputeFit, build_problem, calibrate_from, fit_compute, fit_scalar,
                                         profile_plans, sim_seconds, slope, validation_plans)
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
    """'Measurements' made by the simulator (+ D) with known coefficients are fitted back exactly."""
    true = ComputeFit(**TRUE, residual_rms=0.0)
    p2p, sync = 0.2 * TRUE["t2"], 0.1 * TRUE["t2"]
    prof = {name: (kind, plan, sim_seconds(plan, true, 1, 128, p2p_s=p2p, sync_s=sync) + true.dispatch)
            for name, (kind, plan) in profile_plans().items()}
    fit, got_p2p, got_sync = calibrate_from(prof, 1, 128, constant=True)
    for k, v in TRUE.items():
        assert getattr(fit, k) == pytest.approx(v, rel=1e-6)
    assert got_p2p == pytest.approx(p2p, rel=1e-4)
    assert got_sync == pytest.approx(sync, rel=1e-4)


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


def test_fit_scalar_least_squares_through_origin():
    assert fit_scalar([2.0, 4.0, 6.0], [1.0, 2.0, 3.0]) == pytest.approx(2.0)
    assert fit_scalar([1.0, 3.0], [1.0, 1.0]) == pytest.approx(2.0)
    assert fit_scalar([-1.0], [1.0]) == 0.0          # a cost is never negative
    with pytest.raises(ValueError):
        fit_scalar([1.0], [0.0])


def test_p2p_fit_recovers_simulated_coefficient():
    """Residual of a 'measured' PP2 run simulated with a known p2p, over the simulator's slope."""
    fit = ComputeFit(**TRUE, residual_rms=0.0)
    plan = profile_plans()["PP2 3/5 m=4"][1]
    p2p = 0.3 * TRUE["t2"]
    measured = sim_seconds(plan, fit, 1, 128, p2p_s=p2p) + fit.dispatch
    got = fit_scalar([measured - fit.dispatch - sim_seconds(plan, fit, 1, 128)], [slope(plan, fit, 1, 128, "p2p")])
    assert got == pytest.approx(p2p, rel=1e-6)


def test_problem_carries_fitted_coefficients():
    fit = ComputeFit(**TRUE, residual_rms=0.0)
    problem, opts = build_problem(fit, 1, 128, p2p_s=0.001, sync_s=0.002)
    assert problem.t0_seconds == pytest.approx(TRUE["t2"])
    assert problem.tp_alpha == pytest.approx((1.0, TRUE["t1"] / TRUE["t2"]))
    assert problem.comm.p2p_intra_node == pytest.approx(0.001 / TRUE["t2"])
    assert problem.comm.grad_sync_per_block == pytest.approx(0.002 / TRUE["t2"])
    assert opts.optimizer_per_block == pytest.approx(TRUE["opt_per_block"] / TRUE["t2"])
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


def test_registered():
    assert "calibrate" in BENCHES
