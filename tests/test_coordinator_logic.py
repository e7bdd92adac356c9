"""The coordinator's logic without Ray: a fake cluster (tests/_fake_workers.py) whose per-device
timings the test controls, the real coordinator, policies and planner. The test drives the
training loop's iterations itself; `grace` is large so that each round's decision is in before
the next iteration (deterministic)."""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from _fake_workers import LINKS, SECONDS_PER_UPDATE_BYTE, UNIT, FakeWorkers, plan_work
from malleus_svc.config.job import JobConfig
from malleus_svc.control.coordinator import JobCoordinator, MalleusError
from malleus_svc.control.hooks import Delays
from malleus_svc.control.state import RoundState
from malleus_svc.costmodel.profile import CommCosts

REPO = Path(__file__).resolve().parent.parent


CALIBRATED = 6    # the tiny job's skip (3) and warm-up (3) iterations: then rates are measured


def coordinator(priced: bool = True, **kwargs) -> JobCoordinator:
    """The tiny job's coordinator on the fake cluster; `priced`: past calibration and the one
    re-plan that prices the links (kept: the fake's links are cheap)."""
    d = yaml.safe_load((REPO / "examples/tiny_job.yaml").read_text())
    d["metrics"], d["train"]["steps"] = {"enabled": False}, 200
    kwargs.setdefault("workers", FakeWorkers)
    c = JobCoordinator(JobConfig.from_dict(d), grace=1000.0, **kwargs)
    c.setup()
    if priced:
        run(c, CALIBRATED)
        settle(c)
    return c


def run(c: JobCoordinator, iterations: int) -> None:
    for _ in range(iterations):
        c._iteration()


def settle(c: JobCoordinator, limit: int = 20) -> None:
    """Iterate until no round is in flight and none is pending."""
    for _ in range(limit):
        if c.rounds.state is RoundState.IDLE and not c.rounds.pending:
            return
        c._iteration()
        time.sleep(0.01)
    raise AssertionError(f"rounds never settled: {c.status()['planning']}, {c.status()['pending_requests']}")


def outcomes(c):
    return [(h["outcome"], h["reason"]) for h in c.get_history()]


def after_pricing(c):
    """The rounds after the initial plan and the links' round."""
    history = c.get_history()
    assert [h["outcome"] for h in history[:2]] == ["initial", "kept"] and history[1]["reason"].startswith("links:")
    return history[2:]


def test_the_links_and_the_optimizer_step_are_priced_from_calibration_on_in_units_of_the_measured_t0():
    from malleus_svc.costmodel.analytic import UPDATE_BYTES_PER_PARAM

    c = coordinator(priced=False)
    before = c._problem({}, ())
    assert c.measurement.links == LINKS and before.comm == CommCosts() and before.optimizer_per_block == 0.0
    run(c, CALIBRATED)
    settle(c)
    assert c.measurement.calibrated
    tp, params = c.job.scenario.tp, c.job.scenario.shape.block_params()
    after = c._problem({}, ())
    assert after.comm == LINKS.comm_costs(UNIT / tp)       # the fake's device time per t0
    assert after.optimizer_per_block == pytest.approx(SECONDS_PER_UPDATE_BYTE * UPDATE_BYTES_PER_PARAM * params / UNIT)
    reason = c.get_history()[1]["reason"]
    assert after_pricing(c) == [] and "gradient all-reduce 0.5 ms per block" in reason and "optimizer step" in reason


def test_a_job_planned_under_paper_asks_no_links_round():
    d = yaml.safe_load((REPO / "examples/tiny_job.yaml").read_text())
    d["metrics"], d["planner"] = {"enabled": False}, {"objective": "paper"}
    c = JobCoordinator(JobConfig.from_dict(d), grace=1000.0, workers=FakeWorkers)
    c.setup()
    run(c, CALIBRATED + 2)
    assert c.measurement.calibrated and outcomes(c) == [("initial", "initial plan")]


def test_a_straggler_is_planned_around_and_a_heal_takes_it_back():
    c = coordinator()
    run(c, 2)
    assert c.measurement.calibrated and after_pricing(c) == []
    c.emulate({3: 3.0})
    run(c, 6)      # the window median turns after 2 of 3 slow iterations, then one to plan and apply
    applied = [h for h in c.get_history() if h["outcome"] == "applied"]
    assert len(applied) == 1 and "device 3" in applied[0]["reason"], outcomes(c)
    assert applied[0]["decision"]["predicted_gain_seconds"] > 0
    work = plan_work(c.plan)       # the straggler gets less work than any healthy device, or none
    assert work.get(3, 0) < min(w for d, w in work.items() if d != 3) and c.group.plan is c.plan   # the plan in force
    c.emulate({3: 1.0})
    run(c, 8)
    settle(c)
    assert 3 in c.plan.active_devices, outcomes(c)
    last = [h for h in c.get_history() if h["outcome"] == "applied"][-1]
    assert "device 3" in last["reason"] and "-> 1.00" in last["reason"]


def test_a_device_whose_ops_miss_their_pace_has_no_rate_and_starts_no_round():
    """Host noise on a paced CPU worker: 40% of device 2's ops overran, so its device time reads
    1.6x. It is unmeasured: no rate, no round, its plan's rate kept; a straggler on pace still is."""
    c = coordinator()
    c.group.overrun[2] = (0.4, 1.6)
    run(c, 8)
    settle(c)
    assert after_pricing(c) == [], outcomes(c)
    assert c.status()["unmeasured"] == {"2": pytest.approx(0.6)}
    assert 2 not in c.measurement.measured() and c.effective_rates()[2] == 1.0 and c.rates()["unmeasured"] == {2: 0.6}
    assert c.measurement.estimator.rates()[2] == pytest.approx(1.6)    # what its overruns would have read
    from malleus_svc.service.commands import format_status
    text = format_status(c.status())
    assert "2=1.00?" in text and "device 2 kept pace on 60% of its ops" in text, text
    c.emulate({3: 3.0})
    run(c, 6)
    settle(c)
    applied = [h for h in after_pricing(c) if h["outcome"] == "applied"]
    assert len(applied) == 1 and "device 3" in applied[0]["reason"] and "device 2" not in applied[0]["reason"]
    c.group.overrun.pop(2)         # its ops keep pace again: measured again once its window has
    run(c, 6)
    assert c.status()["unmeasured"] == {} and c.measurement.measured()[2] == pytest.approx(1.0)


def test_calibration_leaves_out_the_devices_whose_ops_missed_their_pace():
    """Half the devices overran through the warm-up (their times read 3x): the healthy unit time is
    the others' median, so a real straggler later reads 3x, not the 1.5x an inflated one gives."""
    c = coordinator(priced=False)
    for d in (0, 1):
        c.group.overrun[d] = (0.5, 3.0)
    run(c, CALIBRATED)
    assert c.measurement.calibrated and set(c.status()["unmeasured"]) == {"0", "1"}
    c.group.overrun.clear()
    c.emulate({3: 3.0})
    run(c, 6)
    assert c.measurement.estimator.rates()[3] == pytest.approx(3.0)


def test_a_forced_replan_moves_when_keeping_is_predicted_cheaper():
    # a migration predicted to cost a day: the policy keeps the plan unless forced
    c = coordinator(migration_overhead_s=86400.0)
    run(c, 8)
    c.set_rates({3: 3.0})
    settle(c)
    assert [h["outcome"] for h in after_pricing(c)] == ["kept"] and 3 in c.plan.active_devices
    c.replan("maintenance", force=True)
    settle(c)
    last = c.get_history()[-1]
    assert last["outcome"] == "applied" and last["decision"]["option"] in ("replan", "rebalance"), outcomes(c)
    assert last["decision"]["predicted_gain_seconds"] < 0    # forced: worse than keeping, by prediction
    assert c.group.migrated and c.group.plan is c.plan


def test_requests_during_a_round_are_coalesced_into_one_more_round():
    delays = Delays(plan_s=60)    # each planning phase held until released
    delays.release("plan")        # the links' round at calibration goes through
    c = coordinator(delays=delays)
    run(c, 4)
    first = c.set_rates({3: 3.0})["request"]
    assert c.rounds.state is RoundState.PLANNING
    later = [c.replan(f"during planning {i}")["request"] for i in range(2)]
    assert [r["id"] for r in c.status()["pending_requests"]] == later
    for _ in range(2):            # this round, and the one the pending requests make
        delays.release("plan")
    settle(c)
    assert [[r["id"] for r in h["requests"]] for h in after_pricing(c)] == [[first], later], outcomes(c)


def test_static_never_replans():
    c = coordinator(static=True, priced=False)
    run(c, 8)
    c.emulate({3: 3.0})
    assert c.set_rates({2: 3.0})["request"] is None
    run(c, 8)
    assert outcomes(c) == [("initial", "initial plan")] and c.rounds.state is RoundState.IDLE
    assert c.measurement.effective()[3] > 2.5          # it still measures
    for call in (lambda: c.replan("x"), lambda: c.exclude([1])):
        with pytest.raises(MalleusError, match="fixed plan"):
            call()


def test_an_exclusion_plans_the_device_out_and_an_inclusion_back_in():
    """And the links are timed again whenever the devices that talk change: the next round prices
    the links the plan in force uses."""
    c = coordinator()
    run(c, 4)
    assert c.group.links_timed == 1                   # at start
    c.exclude([2])
    settle(c)
    assert 2 in c.plan.excluded and c.get_history()[-1]["outcome"] == "applied", outcomes(c)
    run(c, 1)
    assert c.group.links_timed == 2 and not c.measurement.links_stale
    assert any(e["kind"] == "links" and "timed again" in e["text"] for e in c.status()["events"])
    c.include([2])
    settle(c)
    assert 2 not in c.plan.excluded, outcomes(c)
    run(c, 1)
    assert c.group.links_timed == 3
    c.replan("same devices", force=True)              # a plan over the same devices: nothing to re-time
    settle(c)
    run(c, 1)
    assert c.group.links_timed == 3


class _NodeComesBack(FakeWorkers):
    """Devices 2 and 3 cannot be placed at start; their node is back from the third iteration."""

    def __init__(self, job):
        super().__init__(job)
        self.gone, self.calls = {2, 3}, 0

    def rejoinable(self) -> list[int]:
        self.calls += 1
        return sorted(self.gone) if self.calls >= 3 else []

    def rejoin(self, devices, plan_for) -> list[int]:
        self.gone -= set(devices)
        self.plan = plan_for(frozenset(self.gone))
        return sorted(devices)


def test_a_planner_failure_when_devices_rejoin_keeps_the_job_and_its_plan():
    """The planner raises on the re-plan with the devices back (fault injected into the real
    planner): the job keeps training on the plan it had, says why, and plans them in later."""
    from malleus_svc.control.policy import Planner

    real = Planner.default()
    fail = {"on": False}

    def replan(problem, previous):
        if fail["on"]:
            raise RuntimeError("injected planner fault")
        return real.replan(problem, previous)
    c = coordinator(workers=_NodeComesBack, planner=Planner(real.evaluate, real.rebalance, replan), rejoin_check_s=0.0,
                    priced=False)
    before = c.plan
    assert {2, 3} <= set(before.excluded)
    fail["on"] = True
    run(c, 4)
    assert c.group.gone == set() and c.plan.plan_id == before.plan_id and c.status()["error"] is None
    events = str(c.status()["events"])
    assert "injected planner fault" in events and f"plan {before.plan_id} kept" in events, events
    fail["on"] = False
    c.replan("the rejoined devices", force=True)
    settle(c)
    assert not {2, 3} & set(c.plan.excluded) and {2, 3} <= set(c.plan.roles()), outcomes(c)


@pytest.mark.parametrize("extra, applied", [
    ({"external_rates": {"1": 2.0}, "excluded": [2]}, True),
    ({"external_rates": {"1": 1e308}}, False),                    # finite, >= 1, and no plan survives it
    ({"external_rates": {"9": 2.0}}, False),                      # no such device
    ({"excluded": [0, 1, 2, 3]}, False),                          # nothing left to train on
    ({"external_rates": {"1": "2"}, "excluded": [0.5]}, False),
])
def test_a_checkpoints_rates_and_exclusions_pass_the_client_checks(extra, applied):
    """What a checkpoint carries besides the model is input too: resumed through the same checks
    as set_rates and exclude, and refused as a whole (with the reason in the events) if any fails."""
    from types import SimpleNamespace

    c = coordinator()
    ckpt = SimpleNamespace(manifest=SimpleNamespace(extra={"records": [], **extra}), path=Path("step-00000004"),
                           skipped=[])
    with c._lock:
        c._resume_from(ckpt, 4)
    st = c.status()
    if applied:
        assert st["external_rates"] == {"1": 2.0} and st["excluded"] == [2]
    else:
        assert st["external_rates"] == {} and st["excluded"] == []
        assert "not applied" in str(st["events"]), st["events"]


def test_a_loop_of_client_calls_is_refused_past_the_budget_and_refusals_change_nothing():
    c = coordinator()
    run(c, 4)
    accepted, refused = 0, []
    for i in range(100):
        try:
            c.set_rates({1: 2.0 if i % 2 else None})
            accepted += 1
        except MalleusError as e:
            refused.append(str(e))
    assert 20 <= accepted <= 22 and len(refused) == 100 - accepted, (accepted, refused[:1])
    assert "changing calls per second" in refused[0] and "retry in" in refused[0]
    last = 2.0 if (accepted - 1) % 2 else None         # the last accepted call's value
    assert c.status()["external_rates"] == ({"1": 2.0} if last else {})
    assert len(c.status()["pending_requests"]) <= accepted


def test_a_forced_replan_waits_for_min_interval_unless_urgent():
    c = coordinator()
    run(c, 4)
    c.exclude([2])
    settle(c)
    changed = c.policy.last_change_step
    c.replan("again", force=True)                       # right after a plan change: held
    assert c.rounds.state is RoundState.IDLE and len(c.rounds.pending) == 1
    assert "held until a re-plan is due" in str(c.status()["events"])
    while c.step < changed + c.policy.min_interval - 1:
        c._iteration()
        assert c.rounds.pending, "started before min_interval"
    settle(c)
    assert not c.rounds.pending and c.get_history()[-1]["reason"].endswith("again"), outcomes(c)
    c.include([2])
    settle(c)
    c.replan("now", force=True, urgent=True)            # urgent: a round starts at once
    assert c.rounds.state is not RoundState.IDLE or c.get_history()[-1]["reason"].endswith("now")


def test_emulation_is_refused_unless_the_job_file_enables_it():
    d = yaml.safe_load((REPO / "examples/tiny_job.yaml").read_text())
    d["metrics"], d["train"]["steps"] = {"enabled": False}, 200
    del d["emulate"]
    c = JobCoordinator(JobConfig.from_dict(d), workers=FakeWorkers, grace=1000.0)
    c.setup()
    with pytest.raises(MalleusError, match="does not emulate stragglers.*`emulate` section"):
        c.emulate({3: 3.0})
    assert c.hooks.emulation.manual == {} and c.hooks.emulation.changes(0, 4) == {}
    assert coordinator().emulate({3: 3.0})["factors"] == {3: 3.0}     # the example's file has `emulate: []`


def test_only_the_owner_key_starts_or_shuts_down_the_coordinator():
    c = coordinator(owner="k" * 32)
    for call in (lambda: c.start(5), lambda: c.start(5, owner="x" * 32), lambda: c.shutdown(owner=None),
                 lambda: c.shutdown(owner=["k" * 32])):
        with pytest.raises(MalleusError, match="only the driver that launched job 'tiny' may .*malleus stop tiny"):
            call()
    assert c.state.value == "ready" and not c.training.started and c.group is not None
    c.shutdown(owner="k" * 32)
    assert c.state.value == "stopped"


class _NodeLeaves(FakeWorkers):
    """Devices 2 and 3 leave for good during the fourth step (the survivors hold every layer)."""

    def __init__(self, job):
        super().__init__(job)
        self.steps = 0

    def step(self, sample_ids, assignment=None, lr=None):
        from malleus_svc.runtime.cluster import WorkerGroupError
        self.steps += 1
        if self.steps == 4:
            raise WorkerGroupError("devices [2, 3] lost (injected)")
        return super().step(sample_ids, assignment, lr)

    def recover(self, plan_for=None):
        from malleus_svc.runtime.cluster import RecoveryReport
        self.gone = {2, 3}
        self.plan = plan_for(frozenset(self.gone))
        return RecoveryReport(lost=[2, 3], source="replicas", seconds=0.1, gone=[2, 3], plan_id=self.plan.plan_id)


def test_a_planner_failure_when_devices_are_lost_falls_back_and_the_job_goes_on():
    """The running plan cannot stay once devices are gone; a planner that fails then (fault
    injected) gives way to the fallback planner: the job trains on without them, and says why."""
    from malleus_svc.control.policy import Planner

    real = Planner.default()

    def replan(problem, previous):
        if problem.excluded:
            raise RuntimeError("injected planner fault")
        return real.replan(problem, previous)
    c = coordinator(workers=_NodeLeaves, planner=Planner(real.evaluate, real.rebalance, replan, real.fallback),
                    priced=False)
    before = c.plan
    run(c, 6)
    assert c.status()["error"] is None and c.step == 5            # the failed step was redone
    assert {2, 3} <= set(c.plan.excluded) and not {2, 3} & set(c.plan.roles()) and c.plan.plan_id != before.plan_id
    events = str(c.status()["events"])
    assert "injected planner fault" in events and "fallback planner" in events, events
    assert outcomes(c)[-1][0] == "membership"
    without = Planner(real.evaluate, real.rebalance, replan)      # no fallback: the fault is the job's error
    c = coordinator(workers=_NodeLeaves, planner=without, priced=False)
    with pytest.raises(RuntimeError, match="injected planner fault"):
        run(c, 6)


class _GpuWorkers(FakeWorkers):
    """The fake cluster as a job on GPUs presents it: its length sweep runs on one of its devices."""

    def __init__(self, job):
        super().__init__(job)
        self.use_gpu, self.sweeps = True, []

    def length_sweep(self, shape, tps, seq_len, link_gbps):
        from malleus_svc.lengths import Coeffs, LengthCost
        self.sweeps.append((shape, list(tps), seq_len, link_gbps))
        return LengthCost({t: Coeffs(1e-9, 1e-6, 1e-4, 1e-5) for t in tps}), {t: {"test_max_abs_error": 0.05} for t in tps}


def test_a_job_on_gpus_sweeps_lengths_on_its_own_device_not_on_the_head(monkeypatch):
    import malleus_svc.runtime.length_sweep as sweep
    monkeypatch.setattr(sweep, "run_sweeps", lambda *a, **k: pytest.fail("the head swept a GPU job's lengths"))
    d = yaml.safe_load((REPO / "examples/tiny_job.yaml").read_text())
    d["metrics"], d["data"]["assignment"], d["parallel"] = {"enabled": False}, "length-aware", {"dp": 2, "tp": 2, "pp": 1}
    job = JobConfig.from_dict(d)
    c = JobCoordinator(job, grace=1000.0, workers=_GpuWorkers)
    c.setup()
    assert c.group.sweeps == [(job.shape, [1, 2], job.data.seq_len, job.scenario.device.intra_node_gbps)]
    assert c.lengths.cost is not None and sorted(c.lengths.cost.coeffs) == [1, 2]
    assert any(e["kind"] == "lengths" and "TP1 5.0%, TP2 5.0%" in e["text"] for e in c.status()["events"])


@pytest.mark.parametrize("workers, written, sharded", [(FakeWorkers, None, False), (_GpuWorkers, None, True),
                                                       (_GpuWorkers, False, False), (FakeWorkers, True, True)],
                         ids=["cpu", "gpu", "gpu-replicated-as-written", "cpu-sharded-as-written"])
def test_the_optimizer_state_is_sharded_by_default_on_gpu_workers(workers, written, sharded):
    """Unless the job file says, the optimizer's state is sharded (ZeRO-1) where the workers are
    GPUs and replicated on CPU workers: the engines get it, and the planner's problem for every
    re-plan prices it (the first plan assumed the larger, replicated state)."""
    d = yaml.safe_load((REPO / "examples/tiny_job.yaml").read_text())
    d["metrics"] = {"enabled": False}
    if written is not None:
        d["parallel"]["shard_optimizer"] = written
    c = JobCoordinator(JobConfig.from_dict(d), grace=1000.0, workers=workers)
    c.setup()
    assert c.group.optim.shard_optimizer is sharded
    problem = c._problem({}, set())
    assert problem.memory.sharded is sharded and problem.state_sizes.sharded is sharded
    assert any("sharded" in e["text"] for e in c.status()["events"]) is (sharded and written is None)
