"""Hooks the coordinator is given: straggler emulation and test delays (demos and tests only).

Neither is read to decide anything: an emulated slowdown is a rate on the device's clock and
reaches the straggling rates only through the device time the worker reports, and delays only
hold the planner and migration phases (to exercise request coalescing and faults mid-phase)."""
from __future__ import annotations

import random
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable


class EmulationSchedule:
    """Which devices are slowed at which step, from a job's `emulate` entries.

    Each entry is (device, factor, at_step, until_step): the device runs at `factor` for steps
    at_step <= step < until_step (until_step None = to the end). Overlapping entries for one device:
    the last listed wins.
    """

    def __init__(self, entries=()):
        self.entries = tuple(entries)

    def factors_at(self, step: int, devices) -> dict[int, float]:
        out = {d: 1.0 for d in devices}
        for e in self.entries:
            if e.device in out and e.at_step <= step and (e.until_step is None or step < e.until_step):
                out[e.device] = e.factor
        return out


class Emulation:
    """Slowdown factors per device: a schedule by step, manual factors (the `emulate` call) over
    it, and an optional per-step jitter (each factor x U(1, 1 + 2 jitter)). Called under the
    coordinator's lock; picklable, so a driver can hand one to the coordinator actor."""

    def __init__(self, schedule: Iterable = (), jitter: float = 0.0, seed: int = 0):
        self.schedule = EmulationSchedule(tuple(schedule))
        self.jitter = float(jitter)
        self.manual: dict[int, float] = {}
        self._rng = random.Random(seed)
        self._applied: dict[int, float] = {}

    def set(self, factors: dict[int, float], jitter: float | None) -> dict:
        self.manual.update(factors)
        if jitter is not None:
            self.jitter = jitter
        return {"factors": dict(self.manual), "jitter": self.jitter}

    def changes(self, step: int, num_devices: int) -> dict[int, float]:
        """Before an iteration: the factors the workers must be told (those that changed)."""
        want = {**self.schedule.factors_at(step, range(num_devices)), **self.manual}
        if self.jitter > 0:
            want = {d: f * (1.0 + self._rng.uniform(0.0, 2.0 * self.jitter)) for d, f in want.items()}
        changed = {d: f for d, f in want.items() if self._applied.get(d, 1.0) != f}
        self._applied.update(changed)
        return changed

    def forget(self, devices: Iterable[int]) -> None:
        """Fresh workers start unslowed: re-apply their factors."""
        for d in devices:
            self._applied.pop(d, None)


class Delays:
    """A slow planner and a slow migration (tests only): each planning (migration) phase is held
    for `plan_s` (`migrate_s`) seconds, or until a test releases it (`release`), so that a test can
    act inside a phase however slow the host, and end it when it is done. A release made before the
    phase starts ends the next one at once. Only the durations travel to a coordinator actor, not
    releases made before it was launched."""

    PHASES = ("plan", "migrate")

    def __init__(self, plan_s: float = 0.0, migrate_s: float = 0.0):
        self.plan_s, self.migrate_s = float(plan_s), float(migrate_s)
        self._released = {phase: threading.Semaphore(0) for phase in self.PHASES}

    def __getstate__(self) -> dict:      # a driver hands the delays to the coordinator actor
        return {"plan_s": self.plan_s, "migrate_s": self.migrate_s}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)

    def before_plan(self) -> None:
        self._hold("plan", self.plan_s)

    def before_migrate(self) -> None:
        self._hold("migrate", self.migrate_s)

    def release(self, phase: str) -> None:
        if phase not in self.PHASES:
            raise ValueError(f"phase must be one of {self.PHASES}, got {phase!r}")
        self._released[phase].release()

    def _hold(self, phase: str, seconds: float) -> None:
        if seconds > 0:
            self._released[phase].acquire(timeout=seconds)


@dataclass
class Hooks:
    """What the coordinator is given rather than decides: the cluster (a worker-group factory,
    job -> group), the planner, and the demo/test hooks."""
    workers: Callable[[Any], Any]
    planner: Any
    emulation: Emulation
    delays: Delays
