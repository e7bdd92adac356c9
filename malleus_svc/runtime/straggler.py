"""Straggler emulation: make chosen devices slower on purpose. For demos, tests and benchmarks ONLY.

Nothing in the training path reads this module except through the worker's explicit
`set_slowdown` control, and the factor is 1.0 (off) unless a caller sets it. A slowed device, after
every compute (the Engine's `after_compute` hook), sleeps ``(factor - 1) x`` the compute time it
just measured, so its wall time grows by the factor while its measured compute time (what the
coordinator turns into straggling rates on CPU, see NOTES.md) stays what the work really cost.
Sleeping rather than spinning matters on a machine with fewer cores than workers: a spinning
straggler would steal CPU from healthy workers and slow them too.

The factor is a plain float attribute: the worker's control thread writes it while the training
thread reads it between computes. A single attribute store/load is atomic under the GIL, so no lock
is needed and a change takes effect at the next compute.
"""
from __future__ import annotations

import math
import time


class Slowdown:
    """A mutable slowdown factor (>= 1.0) and the hook that applies it."""

    def __init__(self, factor: float = 1.0):
        self.factor = 1.0
        self.slept_seconds = 0.0  # total injected delay, so tests and benchmarks can report it
        self.set(factor)

    def set(self, factor: float) -> float:
        factor = float(factor)
        if not math.isfinite(factor) or factor < 1.0:
            raise ValueError(f"slowdown factor must be a finite number >= 1.0 (1.0 = off), got {factor!r}")
        self.factor = factor
        return factor

    def __call__(self, compute_seconds: float) -> None:
        """The Engine's after_compute hook: sleep so that this compute took `factor` times longer."""
        f = self.factor  # read once: the control thread may change it meanwhile
        if f > 1.0 and compute_seconds > 0.0:
            delay = (f - 1.0) * compute_seconds
            time.sleep(delay)
            self.slept_seconds += delay


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
