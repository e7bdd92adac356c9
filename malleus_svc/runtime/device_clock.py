"""Device time: how long a compute op occupies its accelerator, waiting for peers left out.

The coordinator turns device time into straggling rates, so every worker reads it from one
interface, `DeviceClock`:

  * `PacedClock` makes a CPU worker behave like an accelerator of its own. An op computes for real
    (results stay exact), then waits until `rate × nominal(op)` has passed, where nominal(op) is
    its FLOPs over the emulated device's FLOP/s (bytes over its bandwidth for memory-bound ops)
    plus a fixed time per block it runs through: an accelerator's launches cost the same whatever
    a kernel's size, which is what makes small ops slow on a GPU and on a host alike.
    A straggler is a rate on this clock: a device at rate 3 takes three times as long per op
    whatever the host is doing, and it waits without using a core, as a slow GPU would leave the
    other GPUs alone. As long as the host keeps pace (every op's real compute ends before its
    deadline) device time is exactly `rate × nominal`; an op that overruns is counted, and its
    device time is what it really took.
  * `CudaClock` times ops with CUDA events on the compute stream, read once per step (one
    synchronisation, none per op). An emulated rate is a `torch.cuda._sleep` kernel queued
    inside the op, sized from the op's last measured time.

On both, time inside a TP collective (`collective()`) is excluded: a healthy member of a TP group
with a slow peer waits in the collective, and that wait is not its own compute.
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Protocol

import numpy as np


def check_rate(rate: float) -> float:
    rate = float(rate)
    if not math.isfinite(rate) or rate < 1.0:
        raise ValueError(f"a device rate must be a finite number >= 1.0 (1.0 = healthy), got {rate!r}")
    return rate


@dataclass(frozen=True)
class Pace:
    """An emulated accelerator's speed: FLOP/s for compute-bound ops, bytes/s for memory-bound ones."""

    flops_per_second: float
    bytes_per_second: float
    block_seconds: float = 0.0   # fixed time of an op per block it runs through (launches, dispatch)

    def __post_init__(self) -> None:
        for name in ("flops_per_second", "bytes_per_second"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a positive number, got {v!r}")
        if not (math.isfinite(self.block_seconds) and self.block_seconds >= 0):
            raise ValueError(f"block_seconds must be a number >= 0, got {self.block_seconds!r}")

    def nominal(self, flops: float = 0.0, nbytes: float = 0.0, blocks: int = 0) -> float:
        """Seconds one op takes on a healthy device. The fixed time counts per block, so that a
        stage's time stays proportional to its blocks, as the planner's time model has it."""
        return blocks * self.block_seconds + flops / self.flops_per_second + nbytes / self.bytes_per_second


@dataclass
class HostCost:
    """What the host really spent on the ops, to size a pace it can hold (`auto`)."""

    flops: float = 0.0
    flop_cpu_seconds: float = 0.0      # thread CPU time of compute-bound ops
    nbytes: float = 0.0
    byte_cpu_seconds: float = 0.0      # thread CPU time of memory-bound ops
    flop_wall_seconds: float = 0.0     # their wall time (collectives left out): the host's load shows here
    byte_wall_seconds: float = 0.0

    def add(self, other: "HostCost") -> None:
        for name, value in vars(other).items():
            setattr(self, name, getattr(self, name) + value)


@dataclass(frozen=True)
class OpCost:
    """One op as the host ran it (a rehearsal's, unpaced, or a step's on its pace): its work and
    what it cost."""

    kind: str
    flops: float
    nbytes: float
    blocks: int
    cpu_seconds: float      # thread CPU time
    wall_seconds: float     # wall time, collectives left out: the host's load shows here


@dataclass
class PaceCount:
    """Ops timed so far, and how many computed within their device time (cumulative, never reset)."""

    ops: int = 0
    on_pace: int = 0


# Of a host's cores, the share that paced ops may keep busy when every device computes at once;
# the rest is left to transfers, collectives, Ray and the driver, so that ops keep pace.
AUTO_UTILIZATION = 0.75


@functools.cache
def host_cores() -> int:
    """The cores this process may compute on (`allowed_cores` of this machine's cgroup), read once:
    status calls ask it on every poll."""
    return allowed_cores(Path("/sys/fs/cgroup"))


def allowed_cores(cgroup: Path) -> int:
    """The CPU affinity, capped by a container's CPU quota under `cgroup` (v2 `cpu.max`, or v1
    `cpu.cfs_quota_us` over `cpu.cfs_period_us`), which the affinity and `os.cpu_count()` both
    ignore: a pace sized for cores the container will not give is missed."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        quota, period = (cgroup / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        try:
            quota, period = ((cgroup / "cpu" / f"cpu.cfs_{name}_us").read_text().strip()
                             for name in ("quota", "period"))
        except OSError:
            return cores
    if quota in ("max", "-1") or float(period) <= 0:
        return cores
    return max(1, min(cores, int(float(quota) / float(period))))


def pace_for(costs: list[HostCost], cores: int, workers: int, utilization: float = AUTO_UTILIZATION) -> Pace:
    """The fastest pace that every device of a host can hold while all of them compute at once: a
    unit of work (a FLOP, or a byte of a memory-bound op) is given 1/`utilization` of the time it
    takes the costliest device, which is its CPU cost spread over its share of the cores,
    `min(1, cores / workers)` (a worker computes on one thread), or, when longer, the wall time it
    took in a rehearsal where all devices computed at once (a host busy with other work shows there)."""
    share = min(1.0, cores / max(1, workers))

    def slowest(work: str, cpu: str, wall: str) -> float:
        per_unit = [max(getattr(c, cpu) / share, getattr(c, wall)) / getattr(c, work)
                    for c in costs if getattr(c, work) > 0 and getattr(c, cpu) > 0]
        if not per_unit:
            raise ValueError("no rehearsal measured both compute-bound and memory-bound ops: cannot size a pace")
        return max(per_unit)

    return Pace(utilization / slowest("flops", "flop_cpu_seconds", "flop_wall_seconds"),
                utilization / slowest("nbytes", "byte_cpu_seconds", "byte_wall_seconds"))


def fit_pace(devices: list[list[OpCost]], cores: int, workers: int, utilization: float = AUTO_UTILIZATION,
             flops_per_second: float | None = None, bytes_per_second: float | None = None,
             block_seconds: float | None = None) -> Pace:
    """The fastest pace every device of a host holds on every op it rehearsed, while all of them
    compute at once (what is given is kept). An op needs its CPU time spread over its device's
    share of the cores, `min(1, cores / workers)`, or its wall time when longer, over `utilization`
    (`pace_for`'s rule, per op). Each device rehearses its ops at two sizes and once through its
    first block alone (`Engine.rehearse`):
      * the seconds per FLOP are the steepest growth of any op between its two sizes;
      * the time per block is the most any compute op needs beyond its FLOPs, per block: the
        one-block op, whose fixed cost (the stage's own work besides its blocks) has one block to
        carry, sets it, so a stage the planner cuts to one block keeps its pace too;
      * the bytes per second are the least any memory-bound op gets through in its time."""
    share = min(1.0, cores / max(1, workers))

    def need(op: OpCost) -> float:
        return max(op.cpu_seconds / share, op.wall_seconds) / utilization

    same: dict[tuple, list[float]] = {}    # the median of an op's repeats: a one-off stall is noise
    for d, ops in enumerate(devices):
        for op in ops:
            same.setdefault((d, op.kind, op.blocks, op.flops, op.nbytes), []).append(need(op))
    needs = {k: statistics.median(v) for k, v in same.items()}
    compute = {k: v for k, v in needs.items() if k[3] > 0}
    memory = {k: v for k, v in needs.items() if k[3] == 0 and k[4] > 0}
    if not compute or not memory:
        raise ValueError("no rehearsal measured both compute-bound and memory-bound ops: cannot size a pace")
    if flops_per_second is None:
        sizes: dict[tuple, list[tuple[float, float]]] = {}
        for (d, kind, blocks, flops, _), v in compute.items():
            sizes.setdefault((d, kind, blocks), []).append((flops, v))
        slopes = [(max(s)[1] - min(s)[1]) / (max(s)[0] - min(s)[0]) for s in sizes.values() if len(s) > 1]
        slope = max(slopes, default=0.0)
        if slope <= 0:   # one size only, or noise above the growth: the op's whole time per FLOP
            slope = max(v / k[3] for k, v in compute.items())
        flops_per_second = 1.0 / slope
    if block_seconds is None:
        block_seconds = max([(v - k[3] / flops_per_second) / k[2] for k, v in compute.items() if k[2]] + [0.0])
    if bytes_per_second is None:
        bytes_per_second = min(k[4] / v for k, v in memory.items())
    return Pace(flops_per_second, bytes_per_second, block_seconds)


# The share of a refit's ops whose wall time over their fitted CPU cost sets the host's contention;
# the utilization's headroom covers the ops above it.
REFIT_QUANTILE = 0.9


def refit_pace(pace: Pace, devices: list[list[OpCost]], utilization: float = AUTO_UTILIZATION,
               keep: tuple[bool, bool, bool] = (False, False, False)) -> Pace:
    """`pace` slowed where a host's devices did not hold it on their own ops, as they ran on it
    (the job's warm-up iterations: real micro-batches, the whole step's work, the pipeline's
    contention), never made faster; `keep` marks the terms (FLOP/s, bytes/s, block time) to leave
    as they are (given by the job). A rehearsal's ops are cheaper than the step's (no loss, no
    gradient accumulation, one document per micro-batch) and all start at once, so a pace sized
    from them alone may be held on anything from half to all of the ops.
      * An op's CPU cost is fitted as `blocks × a + FLOPs × b` (compute-bound ops) by least squares
        over the ops, whose micro-batches spread their FLOPs; a memory-bound op's as its bytes times
        the median CPU seconds per byte. CPU time is what the host's load changes least.
      * The host's contention is how much longer than its fitted CPU cost an op took on the wall,
        at the REFIT_QUANTILE of the ops (other workers computing at once, Ray, the driver).
      * Each op is then given its fitted CPU cost times that contention, over `utilization`."""
    compute = [op for ops in devices for op in ops if op.flops > 0 and op.cpu_seconds > 0]
    memory = [op for ops in devices for op in ops if op.flops == 0 and op.nbytes > 0 and op.cpu_seconds > 0]
    flops_per_second, bytes_per_second, block_seconds = pace.flops_per_second, pace.bytes_per_second, pace.block_seconds
    if len(compute) >= 2:
        per_block, per_flop = _cpu_fit(compute)
        stretch = [op.wall_seconds / (op.blocks * per_block + op.flops * per_flop) for op in compute]
        contention = float(np.quantile(stretch, REFIT_QUANTILE)) / utilization
        if per_flop > 0 and not keep[0]:
            flops_per_second = min(flops_per_second, 1.0 / (contention * per_flop))
        if not keep[2]:
            block_seconds = max(block_seconds, contention * per_block)
    if memory and not keep[1]:
        per_byte = statistics.median(op.cpu_seconds / op.nbytes for op in memory)
        stretch = [op.wall_seconds / (op.nbytes * per_byte) for op in memory]
        contention = float(np.quantile(stretch, REFIT_QUANTILE)) / utilization
        bytes_per_second = min(bytes_per_second, 1.0 / (contention * per_byte))
    return Pace(flops_per_second, bytes_per_second, block_seconds)


def _cpu_fit(ops: list[OpCost]) -> tuple[float, float]:
    """(CPU seconds per block, per FLOP) fitting `ops` by least squares, neither below zero."""
    bb = sum(op.blocks ** 2 for op in ops)
    bf = sum(op.blocks * op.flops for op in ops)
    ff = sum(op.flops ** 2 for op in ops)
    bc = sum(op.blocks * op.cpu_seconds for op in ops)
    fc = sum(op.flops * op.cpu_seconds for op in ops)
    det = bb * ff - bf * bf
    if det > 1e-9 * bb * ff:
        per_block, per_flop = (bc * ff - fc * bf) / det, (fc * bb - bc * bf) / det
        if per_block >= 0 and per_flop >= 0:
            return per_block, per_flop
    if bb > 0 and bc * bc / bb >= fc * fc / ff:   # one term alone: the one that explains more
        return bc / bb, 0.0
    return 0.0, fc / ff


class DeviceClock(Protocol):
    rate: float
    pace_count: PaceCount

    def op(self, kind: str, flops: float = 0.0, nbytes: float = 0.0,
           blocks: int = 0) -> contextlib.AbstractContextManager: ...
    def collective(self) -> contextlib.AbstractContextManager: ...
    def read(self) -> dict[str, float]: ...
    def finished(self) -> int: ...


@dataclass
class PacedClock:
    """Device time for a CPU worker standing in for an accelerator (see the module docstring).

    Without a pace (`pace=None`) ops are not held back and device time is their wall time less
    collectives: that is how the host's own cost is measured before a pace is chosen.

    `hold=False` keeps the device time but not the wall: an op on pace returns as soon as it has
    computed. For a reader whose wall time no peer waits on (a length sweep): a core left idle
    until the deadline runs the next op cold, and the smallest ops then cost the host 2-6 times
    their CPU time and overrun.
    """

    pace: Pace | None = None
    rate: float = 1.0
    hold: bool = True
    pace_count: PaceCount = field(default_factory=PaceCount)
    host: HostCost = field(default_factory=HostCost)
    op_costs: list[OpCost] | None = None   # while a list, every op's cost is kept in it
    _device: dict[str, float] = field(default_factory=dict)
    _collective_seconds: float = 0.0
    _finished: int = 0

    @contextlib.contextmanager
    def op(self, kind: str, flops: float = 0.0, nbytes: float = 0.0, blocks: int = 0) -> Iterator[None]:
        rate = self.rate   # read once: the control thread may change it meanwhile
        start, cpu0, coll0 = time.perf_counter(), time.thread_time(), self._collective_seconds
        yield
        cpu = time.thread_time() - cpu0
        collectives = self._collective_seconds - coll0
        own = time.perf_counter() - start - collectives
        self.host.add(HostCost(flops=flops, flop_cpu_seconds=cpu, flop_wall_seconds=own) if flops else
                      HostCost(nbytes=nbytes, byte_cpu_seconds=cpu, byte_wall_seconds=own))
        if self.op_costs is not None:
            self.op_costs.append(OpCost(kind, flops, nbytes, blocks, cpu, own))
        if self.pace is None:
            seconds = own
        else:
            target = rate * self.pace.nominal(flops, nbytes, blocks)
            self.pace_count.ops += 1
            if own <= target:
                self.pace_count.on_pace += 1
                if self.hold:
                    _sleep_until(start + collectives + target)
                seconds = target
            else:
                seconds = own
        self._device[kind] = self._device.get(kind, 0.0) + seconds
        self._finished += 1

    def finished(self) -> int:
        """Ops finished so far (the watchdog's progress): on CPU an op is done when it returns."""
        return self._finished

    @contextlib.contextmanager
    def collective(self) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self._collective_seconds += time.perf_counter() - start

    def read(self) -> dict[str, float]:
        """Device seconds per op kind since the last read."""
        out, self._device = self._device, {}
        return out


def _sleep_until(deadline: float) -> None:
    while True:
        left = deadline - time.perf_counter()
        if left <= 0:
            return
        time.sleep(left)


@dataclass
class _TimedOp:
    kind: str
    start: object
    computed: object = None     # the op's own work done (before an emulated straggler's sleep)
    end: object = None
    collectives: list = field(default_factory=list)


class CudaClock:
    """Device time from CUDA events on the current stream (see the module docstring).

    `events` makes an event (`torch.cuda.Event(enable_timing=True)` by default) and `sleep_kernel`
    queues a busy-wait of a number of GPU cycles (`torch.cuda._sleep`); both are arguments so that
    CPU tests can run this class against a fake that keeps CUDA's rules.
    """

    def __init__(self, events=None, sleep_kernel=None, cycles_per_second: float | None = None):
        if events is None:
            import torch
            events = lambda: torch.cuda.Event(enable_timing=True)   # noqa: E731
            sleep_kernel = sleep_kernel or torch.cuda._sleep
        self._event, self._sleep = events, sleep_kernel
        self._cycles_per_second = cycles_per_second
        self.rate = 1.0
        self.pace_count = PaceCount()
        self._ops: list[_TimedOp] = []
        self._read_ops = 0                    # ops read (and so finished) before those in _ops
        self._open: _TimedOp | None = None
        self._last: dict[str, float] = {}     # mean device seconds of each op kind, last read

    @contextlib.contextmanager
    def op(self, kind: str, flops: float = 0.0, nbytes: float = 0.0, blocks: int = 0) -> Iterator[None]:
        rate = self.rate
        timed = _TimedOp(kind, self._record())
        self._open = timed
        try:
            yield
        finally:
            self._open = None
            timed.computed = self._record()
            if rate > 1.0 and kind in self._last:    # the emulated straggler: the device stays busy longer
                self._sleep(int((rate - 1.0) * self._last[kind] * self.cycles_per_second()))
            timed.end = self._record()
            self._ops.append(timed)
            self.pace_count.ops += 1
            self.pace_count.on_pace += 1

    @contextlib.contextmanager
    def collective(self) -> Iterator[None]:
        start = self._record()
        try:
            yield
        finally:
            if self._open is not None:
                self._open.collectives.append((start, self._record()))

    def read(self) -> dict[str, float]:
        """Device seconds per op kind since the last read: one synchronisation, on the last event."""
        if not self._ops:
            return {}
        self._ops[-1].end.synchronize()
        self._read_ops += len(self._ops)
        out: dict[str, float] = {}
        own: dict[str, list[float]] = {}
        for op in self._ops:
            waited = sum(a.elapsed_time(b) for a, b in op.collectives)
            out[op.kind] = out.get(op.kind, 0.0) + (op.start.elapsed_time(op.end) - waited) / 1e3
            own.setdefault(op.kind, []).append((op.start.elapsed_time(op.computed) - waited) / 1e3)
        self._ops.clear()
        self._last = {k: sum(v) / len(v) for k, v in own.items()}   # what an emulated sleep is sized from
        return out

    def finished(self) -> int:
        """Ops the GPU has finished so far, from any thread and without waiting (the watchdog's
        progress). A snapshot of the owner's list: a read racing it may count some twice or miss
        some once, which only looks like progress (any change does)."""
        done = self._read_ops
        for op in list(self._ops):
            if not op.end.query():
                break
            done += 1
        return done

    def cycles_per_second(self) -> float:
        """GPU cycles the sleep kernel spins per second, measured once."""
        if self._cycles_per_second is None:
            cycles = 10_000_000
            a = self._record()
            self._sleep(cycles)
            b = self._record()
            b.synchronize()
            self._cycles_per_second = cycles / (a.elapsed_time(b) / 1e3)
        return self._cycles_per_second

    def _record(self):
        e = self._event()
        e.record()
        return e


def make_clock(use_gpu: bool) -> DeviceClock:
    return CudaClock() if use_gpu else PacedClock()
