"""Straggling rates from the workers' own timings (malleus.md §1.2, made robust).

An active device reports, per iteration, the seconds it was busy computing and the work the plan
gave it, in t0 units (blocks × micro-batches × the TP shrink factor α of its group, scaled by
tokens). Its unit time u = busy / work is comparable across devices whatever their share of the
plan. A device's rate is the median of its last `window` unit times, after dropping outliers, over
the healthy unit time. The healthy unit time is calibrated once while the cluster is known
healthy (`calibrate()`, like the authors' T_ref measured in advance), so any number of stragglers
is measured right; before calibration it is the median over devices, which assumes that at least
half of them are healthy.

A device without work (suspended) runs a fixed probe; its rate is its probe time over its own
probe baseline (measured while it was known healthy).

The authors' code keeps two of every three samples and no outlier rejection; here a window median
with MAD rejection keeps ±20% timing noise well inside the re-plan hysteresis band.
"""
from __future__ import annotations

import statistics
from collections import defaultdict, deque
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkSample:
    device: int
    busy_seconds: float   # the device's own compute time this iteration (not waiting for peers)
    work: float           # expected work in t0 units under the plan in force


def _robust_median(values: list[float], mad_limit: float) -> float:
    """Median after dropping values more than `mad_limit` median absolute deviations away."""
    med = statistics.median(values)
    mad = statistics.median(abs(v - med) for v in values)
    if mad > 0:
        values = [v for v in values if abs(v - med) <= mad_limit * mad] or values
    return statistics.median(values)


class RateEstimator:
    def __init__(self, window: int = 5, mad_limit: float = 3.0):
        if window < 1:
            raise ValueError(f"window must be >= 1 iteration, got {window}")
        self.window = window
        self.mad_limit = mad_limit
        self._unit: dict[int, deque[float]] = defaultdict(lambda: deque(maxlen=window))
        self._probe: dict[int, deque[float]] = defaultdict(lambda: deque(maxlen=window))
        self._probe_baseline: dict[int, float] = {}
        self._reference: float | None = None

    def observe(self, samples: list[WorkSample]) -> None:
        """One iteration's timings of the active devices."""
        for s in samples:
            if s.work > 0 and s.busy_seconds > 0:
                self._unit[s.device].append(s.busy_seconds / s.work)
                self._probe.pop(s.device, None)  # active again: its probe history is stale

    def set_probe_baseline(self, device: int, seconds: float) -> None:
        """A device's probe time while known healthy (measured at start-up, before any straggling)."""
        if seconds > 0:
            self._probe_baseline[device] = seconds

    def observe_probe(self, device: int, seconds: float) -> None:
        """A probe's time on a device without work."""
        if seconds > 0:
            self._probe[device].append(seconds)

    def forget(self, device: int) -> None:
        """Drop a device's history (its role changed, or it left)."""
        self._unit.pop(device, None)
        self._probe.pop(device, None)

    def _unit_medians(self) -> dict[int, float]:
        return {d: _robust_median(list(us), self.mad_limit) for d, us in self._unit.items() if us}

    def calibrate(self) -> float | None:
        """Freeze the healthy unit time at the current median (call while all devices are healthy)."""
        medians = self._unit_medians()
        if medians:
            self._reference = statistics.median(medians.values())
        return self._reference

    @property
    def healthy_unit_seconds(self) -> float | None:
        if self._reference is not None:
            return self._reference
        medians = self._unit_medians()
        return statistics.median(medians.values()) if medians else None

    def rates(self) -> dict[int, float]:
        """device -> straggling rate (>= 1.0) for every device with enough history."""
        out: dict[int, float] = {}
        ref = self.healthy_unit_seconds
        if ref:
            out.update({d: max(1.0, u / ref) for d, u in self._unit_medians().items()})
        for d, ps in self._probe.items():
            base = self._probe_baseline.get(d)
            if ps and base and d not in out:
                out[d] = max(1.0, _robust_median(list(ps), self.mad_limit) / base)
        return out
