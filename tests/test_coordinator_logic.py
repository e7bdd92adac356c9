"""The coordinator's logic without Ray: a fake cluster (tests/_fake_workers.py) whose per-device
timings the test controls, the real coordinator, policies and planner. The test drives the
training loop's iterations itself; `grace` is large so that each round's decision is in before
the next iteration (deterministic)."""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from _fake_workers import FakeWorkers
from malleus_svc.config.job import JobConfig
from malleus_svc.control.coordinator import JobCoordinator, MalleusError
from malleus_svc.control.hooks import Delays
from malleus_svc.control.state import RoundState

REPO = Path(__file__).resolve().parent.parent


def coordinator(**kwargs) -> JobCoordinator:
    d = yaml.safe_load((REPO / "examples/tiny_job.yaml").read_text())
    d["metrics"], d["train"]["steps"] = {"enabled": False}, 200
    c = JobCoordinator(JobConfig.from_dict(d), workers=FakeWorkers, grace=1000.0, **kwargs)
    c.setup()
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


def test_a_straggler_is_planned_around_and_a_heal_takes_it_back():
    c = coordinator()
    run(c, 8)
    assert c.measurement.calibrated and outcomes(c) == [("initial", "initial plan")]
    c.emulate({3: 3.0})
    run(c, 6)      # the window median turns after 3 of 5 slow iterations, then one to plan and apply
    applied = [h for h in c.get_history() if h["outcome"] == "applied"]
    assert len(applied) == 1 and "device 3" in applied[0]["reason"], outcomes(c)
    assert applied[0]["decision"]["predicted_gain_seconds"] > 0
    assert 3 not in c.plan.active_devices and c.group.plan is c.plan     # the cluster runs the plan in force
    c.emulate({3: 1.0})
    run(c, 8)
    settle(c)
    assert 3 in c.plan.active_devices, outcomes(c)
    last = [h for h in c.get_history() if h["outcome"] == "applied"][-1]
    assert "device 3" in last["reason"] and "-> 1.00" in last["reason"]


def test_a_forced_replan_moves_when_keeping_is_predicted_cheaper():
    # a migration predicted to cost a day: the policy keeps the plan unless forced
    c = coordinator(migration_overhead_s=86400.0)
    run(c, 8)
    c.set_rates({3: 3.0})
    settle(c)
    assert [o for o, _ in outcomes(c)] == ["initial", "kept"] and 3 in c.plan.active_devices
    c.replan("maintenance", force=True)
    settle(c)
    last = c.get_history()[-1]
    assert last["outcome"] == "applied" and last["decision"]["option"] in ("replan", "rebalance"), outcomes(c)
    assert last["decision"]["predicted_gain_seconds"] < 0    # forced: worse than keeping, by prediction
    assert c.group.migrated and c.group.plan is c.plan


def test_requests_during_a_round_are_coalesced_into_one_more_round():
    c = coordinator(delays=Delays(plan_s=0.5))
    run(c, 4)
    first = c.set_rates({3: 3.0})["request"]
    assert c.rounds.state is RoundState.PLANNING
    later = [c.replan(f"during planning {i}")["request"] for i in range(2)]
    assert [r["id"] for r in c.status()["pending_requests"]] == later
    settle(c)
    rounds = [h for h in c.get_history() if h["outcome"] != "initial"]
    assert [[r["id"] for r in h["requests"]] for h in rounds] == [[first], later], outcomes(c)


def test_static_never_replans():
    c = coordinator(static=True)
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
    c = coordinator()
    run(c, 4)
    c.exclude([2])
    settle(c)
    assert 2 in c.plan.excluded and c.get_history()[-1]["outcome"] == "applied", outcomes(c)
    c.include([2])
    settle(c)
    assert 2 not in c.plan.excluded, outcomes(c)
