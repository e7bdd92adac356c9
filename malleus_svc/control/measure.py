"""Straggling rates from the workers' own timings (the Malleus straggling rate, made robust).

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

Common-mode correction (optional, `common_mode_quantile`): when the whole machine slows down for
an iteration (other processes, thermal limits, cores shared by more workers than cores), every
device's unit time rises together. Rates are relative (a uniformly slower cluster gets the same
plan), so after calibration each iteration's unit times are divided by m = max(1, the given
quantile of that iteration's unit/reference ratios). With the lower quartile, stragglers are
measured right as long as about a quarter of the devices reporting in an iteration are healthy;
a straggler never lowers m below 1, so it cannot hide itself.
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
    def __init__(self, window: int = 5, mad_limit: float = 3.0, common_mode_quantile: float | None = None):
        if window < 1:
            raise ValueError(f"window must be >= 1 iteration, got {window}")
        if common_mode_quantile is not None and not 0.0 <= common_mode_quantile <= 1.0:
            raise ValueError(f"common_mode_quantile must be in [0, 1] or None, got {common_mode_quantile}")
        self.window = window
        self.mad_limit = mad_limit
        self.common_mode_quantile = common_mode_quantile
        self.last_common_mode = 1.0   # m of the last iteration observed (1.0: no correction)
        self._unit: dict[int, deque[float]] = defaultdict(lambda: deque(maxlen=window))
        self._probe: dict[int, deque[float]] = defaultdict(lambda: deque(maxlen=window))
        self._probe_baseline: dict[int, float] = {}
        self._reference: float | None = None

    def observe(self, samples: list[WorkSample]) -> None:
        """One iteration's timings of the active devices."""
        units = {s.device: s.busy_seconds / s.work for s in samples if s.work > 0 and s.busy_seconds > 0}
        m = 1.0
        if self.common_mode_quantile is not None and self._reference and len(units) >= 4:
            ratios = sorted(u / self._reference for u in units.values())
            pos = self.common_mode_quantile * (len(ratios) - 1)
            lo = int(pos)
            hi = min(lo + 1, len(ratios) - 1)
            m = max(1.0, ratios[lo] + (ratios[hi] - ratios[lo]) * (pos - lo))
        self.last_common_mode = m
        for d, u in units.items():
            self._unit[d].append(u / m)
            self._probe.pop(d, None)  # active again: its probe history is stale

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
