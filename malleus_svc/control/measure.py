"""Straggling rates from the workers' own timings (the Malleus straggling rate, made robust).

An active device reports, per iteration, the seconds it was busy computing and the work the plan
gave it, in t0 units (blocks × micro-batches × the TP shrink factor α of its group, scaled by
tokens). Its unit time u = busy / work is comparable across devices whatever their share of the
plan. A device's rate is the median of its last `window` unit times, after dropping outliers, over
the healthy unit time. The healthy unit time is calibrated once while the cluster is known
healthy (`calibrate()`, like the authors' T_ref measured in advance), so any number of stragglers
is measured right; before calibration it is the median over devices, which assumes that at least
half of them are healthy.

The optimizer step is timed too: each device's update seconds per byte it moved, whose median
over the devices is frozen at calibration as well. Over a block's state against the healthy unit
time it is the planner's `optimizer_per_block` (`Measurement.optimizer_per_block`); a straggler's
update is slower by its rate, as its compute is.

A device without work (suspended) runs a fixed probe; its rate is its probe time over its own
probe baseline (measured while it was known healthy).

The authors' code keeps two of every three samples and no outlier rejection; here a window median
with MAD rejection keeps ±20% timing noise well inside the re-plan hysteresis band.

A rate is used only where it was measured. A CPU worker's device time is its paced clock's only
while the host keeps that pace; an op that overran reports the host's own time (device_clock.py),
which only ever adds. Over the same window as its rate, each device's iterations are kept as clean
(every op kept its pace) or not (`PaceWindow`, from the counts the workers report). With most of
them clean, the window's median unit time is a clean one, exact; otherwise the device is
*unmeasured*: it has no measured rate, starts no re-planning round, and is left out of calibration,
until its ops keep pace again. (On a GPU every op counts as kept: CUDA events time the device.)

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
from typing import Mapping

import numpy as np

from malleus_svc.config.device import DeviceSpec
from malleus_svc.config.job import ControlConfig
from malleus_svc.costmodel.analytic import UPDATE_BYTES_PER_PARAM

from .workload import busy_seconds, device_work


PACE_FLOOR = 0.95   # below this share of a run's ops on pace, the run says its host was too busy


def pace_warning(held: float | None) -> str | None:
    """One line for a run whose CPU workers kept pace on less than PACE_FLOOR of their ops (`held`,
    the share over the run so far), else None."""
    if held is None or held >= PACE_FLOOR:
        return None
    return (f"warning: only {held:.1%} of ops kept pace (< {PACE_FLOOR:.0%}): the host was busy with other work, "
            "so device times carry its load, and a device whose ops overran has no measured rate until they "
            "keep pace again (`malleus status` lists it as unmeasured); close other programs or set a slower "
            "emulate.device")


class PaceWindow:
    """Per device, its paced ops and those that kept pace in each of its last `window` observed
    iterations, from the cumulative counts a worker reports with each step or probe (`pace_ops`,
    `pace_on`)."""

    def __init__(self, window: int = ControlConfig.window):
        self._last: dict[int, tuple[int, int]] = {}
        self._window: dict[int, deque[tuple[int, int]]] = defaultdict(lambda: deque(maxlen=window))

    def observe(self, device: int, report: dict) -> None:
        ops, on = report.get("pace_ops"), report.get("pace_on")
        if ops is None or on is None:     # a clock that paces nothing: no verdict
            return
        last, self._last[device] = self._last.get(device), (int(ops), int(on))
        if last is not None and ops >= last[0]:   # else its first report since a rebase, or a fresh worker's
            self._window[device].append((int(ops) - last[0], int(on) - last[1]))

    def shares(self) -> dict[int, float]:
        """device -> share of its ops in the window that kept pace (devices that timed ops)."""
        out = {}
        for d, win in self._window.items():
            ops = sum(n for n, _ in win)
            if ops:
                out[d] = sum(k for _, k in win) / ops
        return out

    def unmeasured(self) -> dict[int, float]:
        """Devices most of whose iterations in the window had an op that overran, with their share
        of ops that kept pace."""
        shares = self.shares()
        return {d: shares.get(d, 0.0) for d, win in self._window.items()
                if win and 2 * sum(on == ops for ops, on in win) <= len(win)}

    def forget(self, device: int) -> None:
        self._window.pop(device, None)
        self._last.pop(device, None)   # a fresh worker's counts start again

    def rebase(self) -> None:
        """Count from each device's next report: the iterations skipped since (new engines warming
        up after a plan change) are not judged, as their times are not measured."""
        self._last.clear()


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
    def __init__(self, window: int = ControlConfig.window, mad_limit: float = 3.0,
                 common_mode_quantile: float | None = None):
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
            m = max(1.0, float(np.quantile([u / self._reference for u in units.values()], self.common_mode_quantile)))
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

    def calibrate(self, exclude=frozenset()) -> float | None:
        """Freeze the healthy unit time at the current median (call while all devices are healthy),
        of every device but those in `exclude` (not measured); None if none is left."""
        medians = {d: u for d, u in self._unit_medians().items() if d not in exclude}
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


class Measurement:
    """The coordinator's measuring, fed once per iteration and asked for rates.

    Skips the first `skip` iterations (and `skip_after_migration` after every plan change: new
    engines warm up too), calibrates the healthy unit time over the next `calibrate`, keeps the
    seconds per planner objective unit (to turn a plan's objective into seconds), and lets
    external rates (set_rates) take precedence over measured ones, device by device. Emulation
    factors are never read: rates come from timings only. What setup measured of the devices
    themselves lives here too: the pace of CPU stand-ins and the links the workers timed.
    """

    def __init__(self, window: int = ControlConfig.window, skip: int = ControlConfig.skip,
                 calibrate: int = ControlConfig.calibrate,
                 skip_after_migration: int = ControlConfig.skip_after_migration):
        # common-mode correction: a machine-wide slowdown of one iteration is not a straggler
        self.estimator = RateEstimator(window=window, common_mode_quantile=0.25)
        self.pace = PaceWindow(window)
        self.skip, self.calibrate, self.skip_after_migration = skip, calibrate, skip_after_migration
        self.calibrated = False
        self.healthy_tokens_per_second: float | None = None   # throughput over the calibration iterations
        self.external: dict[int, float] = {}
        self.unit_seconds: deque[float] = deque(maxlen=5)
        self.device_pace = None   # the emulated accelerator's speed (device_clock.Pace), when CPU workers are paced
        self.links = None         # the job's links as its workers timed them (costmodel.profile.LinkTimes)
        self.links_stale = False  # the devices that talk changed since: time them again
        self._update_per_byte: dict[int, deque[float]] = defaultdict(lambda: deque(maxlen=window))
        self.update_seconds_per_byte: float | None = None   # a healthy device's, frozen at calibration
        self._start_step, self._measure_from = 0, skip

    def begin_at(self, step: int) -> None:
        """Training starts at `step` (0, or a checkpoint's): warm-up counts from here."""
        self._start_step, self._measure_from = step, step + self.skip

    def pace_refit(self, step: int) -> str | None:
        """What the warm-up does with the CPU workers' pace before iteration `step`: "keep" its
        ops' costs (from the second iteration: the first runs cold), "refit" the pace on them (the
        last unmeasured iteration done), or None. Rates are measured on the refitted pace only."""
        if self.device_pace is None or self.skip < 2:
            return None
        return {self._start_step + 1: "keep", self._start_step + self.skip: "refit"}.get(step)

    def restart_after(self, step: int, devices=()) -> None:
        """The plan or the workers changed at `step`: skip the warm-up, forget `devices`' history."""
        self._measure_from = max(self._measure_from, step + self.skip_after_migration)
        self.pace.rebase()
        for d in devices:
            self.estimator.forget(d)
            self.pace.forget(d)
            self._update_per_byte.pop(d, None)

    def measures(self, step: int) -> bool:
        return step >= self._measure_from

    def observe(self, samples: list[WorkSample], probes: dict[int, float]) -> None:
        """One iteration: the active devices' work samples and the idle devices' probe seconds."""
        self.estimator.observe(samples)
        m = self.estimator.last_common_mode   # the same machine-wide factor applies to the probes
        for d, s in probes.items():
            self.estimator.observe_probe(d, s / m)

    def observe_step(self, plan, job, devices: dict[int, dict], probes: list[dict]) -> None:
        """One iteration's per-device reports (active: busy over work in t0 units) and probes."""
        work = device_work(plan, job.scenario, devices, job.data.seq_len, self.device_pace)
        self.observe([WorkSample(d, busy_seconds(s), work[d]) for d, s in devices.items() if d in work],
                     {r["device"]: busy_seconds(r) for r in probes})
        for d, s in devices.items():
            self.pace.observe(d, s)
            if (s.get("update_bytes") or 0) > 0 and (s.get("update_seconds") or 0) > 0:
                self._update_per_byte[d].append(s["update_seconds"] / s["update_bytes"])
        for r in probes:
            self.pace.observe(r["device"], r)

    def observe_unit(self, iteration_seconds: float, objective: float) -> None:
        if self.calibrated and objective > 0:
            self.unit_seconds.append(iteration_seconds / objective)

    def seconds_per_unit(self) -> float | None:
        return statistics.median(self.unit_seconds) if self.unit_seconds else None

    def peak_flops_per_second(self, device: DeviceSpec) -> float:
        """One device's peak for MFU: the emulated accelerator's pace on CPU workers, else the
        scenario's `device.peak_tflops`."""
        pace = self.device_pace
        return pace.flops_per_second if pace is not None else device.peak_tflops * 1e12

    def calibrate_if_due(self, next_step: int, records: list[dict]) -> bool:
        """Freeze the healthy unit time once the calibrating iterations were measured, from the
        devices measured (all of them if none was: a host too busy for its pace then leaves every rate low,
        and unused until measured), and the healthy throughput over them (`records`: metrics
        lines); True when it did. Where nothing was measured yet (a failure or a plan change at the
        warm-up's end restarted it and forgot the devices' history), at the first step that was."""
        if self.calibrated or next_step < self._start_step + self.skip + self.calibrate:
            return False
        unmeasured = set(self.pace.unmeasured())
        if self.estimator.calibrate(exclude=unmeasured) is None and self.estimator.calibrate() is None:
            return False
        per_byte = [statistics.median(v) for d, v in self._update_per_byte.items() if v and d not in unmeasured]
        self.update_seconds_per_byte = statistics.median(per_byte) if per_byte else None
        self.calibrated = True
        recent = records[-self.calibrate:]
        secs = sum(r["iteration_seconds"] for r in recent)
        self.healthy_tokens_per_second = sum(r["tokens"] for r in recent) / secs if secs > 0 else None
        return True

    def t0_seconds(self, tp: int) -> float | None:
        """t0 on the workers' clock: one block's forward and backward for one micro-batch on a
        healthy group of `tp` devices, as the healthy unit time (a whole block's FLOPs on one
        device) split over the group; the group's TP collectives, which the clock leaves out, are
        not in it. None before anything was measured."""
        unit = self.estimator.healthy_unit_seconds
        return unit / tp if unit else None

    def optimizer_per_block(self, block_params: int) -> float | None:
        """One block's optimizer step on a healthy full-size group, in t0 units: a block's update
        bytes at the healthy device's seconds per byte, over the healthy unit time (both whole
        blocks on one device: a TP group splits them alike). None until calibrated."""
        unit = self.estimator.healthy_unit_seconds
        if self.update_seconds_per_byte is None or not unit or not self.calibrated:
            return None
        return self.update_seconds_per_byte * UPDATE_BYTES_PER_PARAM * block_params / unit

    def set_probe_baselines(self, baselines: dict[int, float]) -> None:
        for d, s in baselines.items():
            self.estimator.set_probe_baseline(d, s)

    def set_external(self, rates: dict[int, float | None]) -> None:
        for d, r in rates.items():
            if r is None:
                self.external.pop(d, None)
            else:
                self.external[d] = r

    def measured(self) -> dict[int, float]:
        """The rates of the devices whose ops kept pace (`PaceWindow`), once calibrated."""
        unmeasured = self.pace.unmeasured()
        return {d: r for d, r in self.estimator.rates().items() if d not in unmeasured} if self.calibrated else {}

    def effective(self, basis: Mapping[int, float] | None = None) -> dict[int, float]:
        """Measured rates with external ones taking precedence; an unmeasured device keeps its rate
        in `basis` (what the plan in force was made from): no evidence that it changed."""
        held = {d: basis.get(d, 1.0) for d in self.pace.unmeasured()} if basis is not None and self.calibrated else {}
        return {**held, **self.measured(), **self.external}
