"""Rate estimation and the re-plan trigger (the Malleus paper's rules and the worked trigger examples), without Ray."""
import random

import pytest

from malleus_svc.control.measure import Measurement, RateEstimator, WorkSample
from malleus_svc.control.policy import MigrationCost, Observation, Option, Planner, ReplanPolicy, StaticPolicy, choose
from malleus_svc.plan import Plan
from malleus_svc.planner.build import build_problem
from malleus_svc.runtime.device_clock import Pace


def feed(est, true_rates, work, steps, jitter, rng, t0=0.01):
    for _ in range(steps):
        est.observe([WorkSample(d, t0 * work[d] * x * (1 + rng.uniform(-jitter, jitter)), work[d])
                     for d, x in true_rates.items()])


def test_rates_are_fair_across_uneven_work():
    """Devices with very different shares of the plan get their true rate back."""
    rng = random.Random(0)
    true = {0: 1.0, 1: 1.0, 2: 3.0, 3: 1.0, 4: 1.0, 5: 2.0, 6: 1.0, 7: 1.0}
    work = {0: 32.0, 1: 8.0, 2: 4.0, 3: 64.0, 4: 16.0, 5: 24.0, 6: 40.0, 7: 12.0}
    est = RateEstimator()
    feed(est, true, work, 5, 0.0, rng)
    rates = est.rates()
    for d, x in true.items():
        assert rates[d] == pytest.approx(x, rel=1e-9)


def test_noise_stays_inside_the_hysteresis_band():
    """±20% random jitter with no real change never moves a rate by the band (0.3)."""
    rng = random.Random(1)
    true = {d: 1.0 for d in range(8)}
    work = {d: 10.0 + d for d in range(8)}
    est, policy = RateEstimator(), ReplanPolicy()
    feed(est, true, work, 5, 0.2, rng)
    planned = est.rates()
    for _ in range(200):
        feed(est, true, work, 1, 0.2, rng)
        assert policy.rate_trigger(planned, est.rates(), set(true), set()) is None


def test_a_slowed_device_is_detected_within_the_window():
    rng = random.Random(2)
    true = {d: 1.0 for d in range(8)}
    work = {d: 10.0 for d in range(8)}
    est, policy = RateEstimator(window=5), ReplanPolicy()
    feed(est, true, work, 5, 0.1, rng)
    planned = est.rates()
    true[3] = 3.0
    fired_after = None
    for i in range(1, 6):
        feed(est, true, work, 1, 0.1, rng)
        if policy.rate_trigger(planned, est.rates(), set(true), set()):
            fired_after = i
            break
    assert fired_after is not None and fired_after <= 3
    feed(est, true, work, 5, 0.1, rng)
    assert est.rates()[3] == pytest.approx(3.0, rel=0.15)


def test_the_warm_up_keeps_its_ops_costs_after_its_cold_first_iteration_and_refits_before_any_is_measured():
    """A CPU job's pace: its ops' costs kept from the warm-up's second iteration, refitted at the
    boundary before the first measured one; counted from where training starts (a checkpoint's
    step); nothing without a pace (GPUs keep their own time) or a warm-up of under two iterations."""
    m = Measurement(skip=3)
    assert [m.pace_refit(s) for s in range(6)] == [None] * 6
    m.device_pace = Pace(1e9, 1e9, 1e-3)
    m.begin_at(10)
    assert [m.pace_refit(s) for s in range(9, 15)] == [None, None, "keep", None, "refit", None]
    assert not m.measures(12) and m.measures(13)
    short = Measurement(skip=1)
    short.device_pace = m.device_pace
    assert [short.pace_refit(s) for s in range(4)] == [None] * 4


def test_outliers_are_rejected():
    est = RateEstimator(window=5)
    work = {0: 10.0, 1: 10.0, 2: 10.0, 3: 10.0}
    for step in range(5):
        spike = 20.0 if step == 2 else 1.0  # one 20x hiccup on device 0
        est.observe([WorkSample(d, 0.1 * (spike if d == 0 else 1.0), w) for d, w in work.items()])
    assert est.rates()[0] == pytest.approx(1.0)


def test_probes_give_rates_of_suspended_devices():
    est = RateEstimator()
    est.set_probe_baseline(5, 0.2)
    for _ in range(3):
        est.observe_probe(5, 0.6)
    assert est.rates()[5] == pytest.approx(3.0)
    est.observe([WorkSample(5, 1.0, 10.0)])  # back at work: the probe history no longer applies
    assert 5 not in est._probe


@pytest.mark.parametrize("planned, current, suspended, fires", [
    ({10: 2.0}, {10: 2.2}, set(), False),    # |Δ| = 0.2 < 0.3
    ({10: 2.0}, {10: 2.4}, set(), True),     # re-plan
    ({5: 8.0}, {5: 3.0}, {5}, False),        # suspended, slow before and after
    ({5: 8.0}, {5: 1.1}, {5}, True),         # suspended device healed
    ({}, {3: 3.0}, set(), True),             # a healthy device slowed
])
def test_trigger_vectors(planned, current, suspended, fires):
    """The worked trigger examples, with our confirmation: a shift under twice the band fires on its second check."""
    active = set(range(16)) - suspended
    policy = ReplanPolicy()
    first = policy.rate_trigger(planned, current, active, suspended) is not None
    second = policy.rate_trigger(planned, current, active, suspended) is not None
    large = any(abs(max(x, 1.2) - max(planned.get(d, 1.0), 1.2)) >= 0.6 for d, x in current.items())
    assert second == fires
    assert first == (fires and large)


def test_a_reading_past_the_band_once_does_not_fire():
    policy = ReplanPolicy()
    assert policy.rate_trigger({2: 1.0}, {2: 1.31}, {2}, set()) is None      # noise, once
    assert policy.rate_trigger({2: 1.0}, {2: 1.05}, {2}, set()) is None      # gone again: streak reset
    assert policy.rate_trigger({2: 1.0}, {2: 1.35}, {2}, set()) is None
    assert policy.rate_trigger({2: 1.0}, {2: 1.4}, {2}, set()) is not None   # persisted: fire


def test_min_interval_prevents_thrashing():
    p = ReplanPolicy(min_interval=3)
    assert p.due(10, None) and not p.due(11, 10) and p.due(13, 10)


def test_choose_weighs_gain_against_migration():
    keep, reb, rep = Option("keep", 2.0, 0.0), Option("rebalance", 1.5, 0.0), Option("replan", 1.1, 30.0)
    assert choose([keep, reb, rep], remaining_iterations=10).name == "rebalance"   # 15 < 41 < 20
    assert choose([keep, reb, rep], remaining_iterations=100).name == "replan"     # 140 < 150
    assert choose([keep, rep], remaining_iterations=5).name == "keep"
    with pytest.raises(ValueError, match="keep"):
        choose([rep], 3)


def test_calibration_measures_a_majority_of_stragglers():
    """Without calibration the median assumes a healthy majority; calibrated, 5 of 8 slow devices are right."""
    rng = random.Random(3)
    work = {d: 10.0 for d in range(8)}
    est = RateEstimator()
    feed(est, {d: 1.0 for d in range(8)}, work, 5, 0.0, rng)
    assert est.calibrate() == pytest.approx(0.01)
    slow = {d: (2.0 if d < 5 else 1.0) for d in range(8)}
    feed(est, slow, work, 5, 0.0, rng)
    assert [round(est.rates()[d], 6) for d in range(8)] == [2.0] * 5 + [1.0] * 3


def test_the_optimizer_step_is_priced_from_the_updates_the_devices_timed():
    """The healthy seconds per update byte, frozen at calibration (a device 3x slow then is outvoted),
    over a block's state against the healthy unit time: the planner's optimizer term, in t0 units."""
    from malleus_svc.costmodel.analytic import UPDATE_BYTES_PER_PARAM
    from malleus_svc.runtime.trainer import make_plan
    from malleus_svc.control.workload import t0_flops

    job = _job()
    plan = make_plan(job)
    unit, per_byte = 0.02, 2e-9            # seconds per t0 of work, per update byte, on a healthy device
    rates = {d: 3.0 if d == min(plan.roles()) else 1.0 for d in plan.roles()}
    flops = t0_flops(job.scenario, plan, job.data.seq_len)
    m = Measurement()
    m.begin_at(0)
    for step in range(m.skip + m.calibrate):
        assert m.optimizer_per_block(1000) is None
        reports = {d: {"compute_seconds": unit * 10 * x, "flops": 10 * flops,
                       "update_seconds": per_byte * 1e6 * x, "update_bytes": 1e6} for d, x in rates.items()}
        if m.measures(step):
            m.observe_step(plan, job, reports, [])
        m.calibrate_if_due(step + 1, [{"iteration_seconds": 1.0, "tokens": 100}])
    assert m.calibrated
    params = job.scenario.shape.block_params()
    assert m.optimizer_per_block(params) == pytest.approx(per_byte * UPDATE_BYTES_PER_PARAM * params / unit)


def test_calibration_waits_for_a_measured_iteration_when_a_plan_change_forgot_every_device():
    """A plan change at the warm-up's end (a node lost: every device's role changed) leaves nothing
    to calibrate on when calibration falls due; it waits for the first iteration measured after."""
    from malleus_svc.runtime.trainer import make_plan
    from malleus_svc.control.workload import t0_flops

    job = _job()
    plan = make_plan(job)
    flops = t0_flops(job.scenario, plan, job.data.seq_len)
    m = Measurement()
    m.begin_at(0)
    due = m.skip + m.calibrate
    reports = {d: {"compute_seconds": 0.02 * 10, "flops": 10 * flops} for d in plan.roles()}
    for step in range(due + m.skip_after_migration + 1):
        if step == due - 2:
            m.restart_after(step, plan.roles())
        if m.measures(step):
            m.observe_step(plan, job, reports, [])
        calibrated = m.calibrate_if_due(step + 1, [{"iteration_seconds": 1.0, "tokens": 100}])
        assert calibrated == (step == due - 2 + m.skip_after_migration), step
        assert m.calibrated == (step >= due - 2 + m.skip_after_migration)
    assert m.estimator.healthy_unit_seconds == pytest.approx(0.02)
    assert m.healthy_tokens_per_second == pytest.approx(100)


# --------------------------------------------------------------------------- decide, without Ray


def _job():
    import yaml
    from pathlib import Path

    from malleus_svc.config.job import JobConfig
    d = yaml.safe_load((Path(__file__).resolve().parent.parent / "examples/tiny_job.yaml").read_text())
    return JobConfig.from_dict(d)


def _observe(job, rates, remaining=1000, **kw):
    from malleus_svc.runtime.trainer import make_plan
    policy = ReplanPolicy()
    problem = build_problem(job.scenario, rates=policy.snap(rates))
    return Observation(make_plan(job), problem, remaining, 0.01, problem.state_sizes, **kw)


def test_migration_cost_starts_conservative_and_learns_from_migrations():
    m = MigrationCost(overhead_s=2.0, seconds_per_byte=1e-8)
    assert m.predict(1e8) == pytest.approx(3.0)
    m.observe(0, 0.5)          # a migration that moved nothing: the fixed cost
    m.observe(1e8, 1.5)        # 1 s for 1e8 bytes beyond it
    assert m.predict(2e8) == pytest.approx(0.5 + 2.0)


def test_decide_replans_around_a_straggler_and_keeps_when_moving_costs_too_much():
    job = _job()
    planner = Planner.default()
    d = ReplanPolicy().decide(_observe(job, {3: 3.0}), planner)
    assert d.option in ("replan", "rebalance") and d.plan is not None
    assert d.options[d.option]["time_to_finish"] < d.options["keep"]["time_to_finish"]
    costly = ReplanPolicy(migration=MigrationCost(overhead_s=1e9))
    assert costly.decide(_observe(job, {3: 3.0}), planner).option == "keep"
    forced = costly.decide(_observe(job, {3: 3.0}, forced=True), planner)
    assert forced.option != "keep" and forced.plan is not None           # the override
    assert costly.decide(_observe(job, {3: 1.1}), planner).option == "keep"   # below the threshold: healthy


def test_static_policy_never_replans():
    job, static = _job(), StaticPolicy()
    assert static.decide(_observe(job, {3: 3.0}, forced=True), Planner.default()).plan is None
    plan = _observe(job, {}).current
    assert static.trigger({}, {3: 3.0}, plan, 100, None) is None and not static.replans


def test_trigger_waits_for_min_interval_after_a_change():
    job = _job()
    plan: Plan = _observe(job, {}).current
    policy = ReplanPolicy(min_interval=3)
    assert policy.trigger({}, {3: 3.0}, plan, step=10, last_replan_step=9) is None
    assert policy.trigger({}, {3: 3.0}, plan, step=12, last_replan_step=9) is not None


def test_failure_policy_restores_from_replicas_else_checkpoint_else_says_why():
    from malleus_svc.control.failure import FailurePolicy, Restore
    from malleus_svc.control.requests import MalleusError
    from malleus_svc.runtime.cluster import RecoveryReport
    f = FailurePolicy(rejoin_check_s=60)
    assert f.restore_from(RecoveryReport([1], "replicas", 0.1), False, None) is Restore.REPLICAS
    assert f.restore_from(RecoveryReport([1], "none", 0.1), True, "no replica") is Restore.CHECKPOINT
    with pytest.raises(MalleusError, match="no checkpoint"):
        f.restore_from(RecoveryReport([1], "none", 0.1), False, "no replica")
    assert FailurePolicy.planned_around(RecoveryReport([1], "replicas", 0.1, [1], "p2"), "p1")
    assert not f.rejoin_due(set()) and f.rejoin_due({1}) and not f.rejoin_due({1})   # then every 60 s


def test_the_control_section_parses_with_defaults_and_names_a_bad_field():
    from malleus_svc.config import ConfigError
    from malleus_svc.config.job import ControlConfig, JobConfig
    job = _job()
    assert job.control == ControlConfig(window=3, band=0.3)        # the example shows the defaults
    d = {"name": "x", "cluster": {"nodes": 1, "gpus_per_node": 4}, "model": "tiny",
         "parallel": {"dp": 2, "tp": 1, "pp": 2}, "batch": {"global": 8, "micro": 2}}
    assert JobConfig.from_dict({**d, "control": {"band": 0.5}}).control.band == 0.5
    for bad, field in (({"band": 0}, "control.band"), ({"windows": 3}, "control.windows"),
                       ({"threshold": "x"}, "control.threshold")):
        with pytest.raises(ConfigError, match=field):
            JobConfig.from_dict({**d, "control": bad})
