"""The coordinator's client surface: the calls `control/client.py`, `malleus status|replan|rates|
stop` and drivers make on the job's actor. Every argument is checked first (requests.py) and a
refused call changes nothing; what passed is handed to the coordinator's mechanism."""
from __future__ import annotations

from typing import Any, Mapping

from . import requests as check
from .requests import MalleusError
from .state import JobState, RequestKind
from .status import status, summary


class ClientAPI:
    """Mixed into JobCoordinator (which provides the state and `_submit`); under its lock."""

    def replan(self, reason: str = "user request", force: bool = False, urgent: bool = False) -> dict:
        """Ask for a re-plan (coalesced with any in flight). force: adopt the planner's plan even if
        keeping the current one is predicted to finish sooner; it waits, like the rate trigger, until
        `min_interval` iterations have passed since the last plan change, unless `urgent`."""
        self.calls.take()
        reason = check.check_reason(reason)
        with self._lock:
            self._check_running(RequestKind.REQUEST)
            hold = bool(force) and not urgent and not self.policy.due(self.step, self.policy.last_change_step)
            req = self._submit(RequestKind.REQUEST, reason, bool(force), hold=hold)
            cur = self.rounds.current
            return {"request": req.id, "pending": [r.id for r in self.rounds.pending], "round": cur.id if cur else None}

    def set_rates(self, rates: Mapping[Any, Any]) -> dict:
        """External health signals (DCGM/NVML, an operator): device -> straggling rate >= 1.0.
        They take precedence over measured rates for those devices until cleared with None."""
        self.calls.take()
        clean = check.check_rates(rates, self.job.num_devices, self.job.name)
        with self._lock:
            self._check_running()
            self.measurement.set_external(clean)
            detail = ", ".join(f"{d}={'cleared' if r is None else r}" for d, r in sorted(clean.items()))
            req = self._submit(RequestKind.EXTERNAL_RATES, detail)
            return {"external": dict(self.measurement.external), "request": req.id if req else None}

    def clear_rates(self) -> dict:
        with self._lock:
            if not self.measurement.external:
                return {"external": {}, "request": None}
            return self.set_rates({d: None for d in list(self.measurement.external)})

    def exclude(self, devices: Any) -> dict:
        self.calls.take()
        devs = check.check_devices(devices, "exclude", self.job.num_devices, self.job.name)
        with self._lock:
            self._check_running()
            check.check_exclude(devs, self.excluded, self.gone(), self.job.num_devices, self.job.name)
            self._check_running(RequestKind.MEMBERSHIP)
            self.excluded |= set(devs)
            req = self._submit(RequestKind.MEMBERSHIP, f"exclude {devs}")
            return {"excluded": sorted(self.excluded), "request": req.id}

    def include(self, devices: Any) -> dict:
        self.calls.take()
        devs = check.check_devices(devices, "include", self.job.num_devices, self.job.name)
        with self._lock:
            self._check_running()
            check.check_include(devs, self.excluded, self.gone())
            self._check_running(RequestKind.MEMBERSHIP)
            self.excluded -= set(devs)
            req = self._submit(RequestKind.MEMBERSHIP, f"include {devs}")
            return {"excluded": sorted(self.excluded), "request": req.id}

    def emulate(self, factors: Mapping[int, float] | None = None, jitter: float | None = None) -> dict:
        """EMULATION ONLY (demos/tests): slow devices from the next iteration on (1.0 = off), and/or
        set the per-step jitter. The coordinator never reads these factors to estimate rates. Only
        for jobs whose file has an `emulate` section: a production job never slows its devices."""
        if not self.job.emulation_allowed:
            raise MalleusError(f"job {self.job.name!r} does not emulate stragglers: emulation is for demos and "
                               "tests, and a job enables it with an `emulate` section in its job file")
        self.calls.take()
        clean, jitter = check.check_emulation(factors, jitter, self.job.num_devices, self.job.name)
        with self._lock:
            return self.hooks.emulation.set(clean, jitter)

    def release_delay(self, phase: str) -> None:
        """TESTS ONLY: end the planning ("plan") or migration ("migrate") phase that a test delay
        holds (`launch(plan_delay_s=..., migrate_delay_s=...)`), or the next one if none is held."""
        self.hooks.delays.release(phase)

    def _check_running(self, kind: RequestKind | None = None) -> None:
        """(lock held) Refuse requests before start, after the end, and those the policy never takes."""
        if self.plan is None:
            raise MalleusError(f"job {self.job.name!r} has not started yet (state {self.state.value})")
        if self.state in (JobState.FAILED, JobState.STOPPED):
            raise MalleusError(f"job {self.job.name!r} is {self.state.value}; it takes no requests")
        if kind is not None and not self.policy.replans:
            what = "it does not re-plan" if kind is RequestKind.REQUEST else "membership cannot change"
            raise MalleusError(f"job {self.job.name!r} runs a fixed plan (--static): {what}")

    # ------------------------------------------------------------------ read-only calls
    def rates(self) -> dict:
        with self._lock:
            m = self.measurement
            return {"measured": m.measured(), "external": dict(m.external), "effective": m.effective(self.basis),
                    "unmeasured": m.pace.unmeasured(),
                    "basis": dict(self.basis), "calibrated": m.calibrated,
                    "healthy_unit_seconds": m.estimator.healthy_unit_seconds}

    def current_plan(self) -> dict | None:
        with self._lock:
            return self.plan.to_dict() if self.plan else None

    def get_history(self) -> list[dict]:
        with self._lock:
            return list(self.history.entries)

    def metrics(self, since: int = 0) -> list[dict]:
        """Metrics lines of steps >= `since` (after a restart the first lines are the resumed steps)."""
        with self._lock:
            return [r for r in self.history.records if r["step"] >= since]

    def job_info(self) -> dict:
        import ray
        ctx = ray.get_runtime_context()
        return {"job": self.job.name, "ray_job_id": self.origin["ray_job_id"], "submission_id": self.origin["submission_id"],
                "actor_job_id": ctx.get_job_id(), "node_id": ctx.get_node_id(), "state": self.state.value}

    def status(self) -> dict:
        with self._lock:
            return status(self)

    def summary(self) -> dict:
        with self._lock:
            return summary(self)

