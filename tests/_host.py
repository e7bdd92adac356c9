"""What a test may read of host time, and when: only where the host kept pace.

A CPU worker's device time is exact while the host keeps its paced clock's pace (device_clock.py);
an op that overran reports the host's own wall time instead. A verdict that reads such times, or the
wall clock, is given only once the test has shown that the host kept pace; otherwise the test is
inconclusive: skipped with the measured figure, never passed or failed. A bound on how much work
something does reads CPU time, which other processes do not stretch.
"""
from __future__ import annotations

import time

import pytest

from malleus_svc.control.measure import PACE_FLOOR

INCONCLUSIVE = "inconclusive: the host did not keep pace"


def idle_cores(seconds: float = 1.0) -> float:
    """Cores that no process used over the next `seconds` (from /proc/stat's idle and iowait time);
    every core where /proc/stat cannot be read."""
    import os

    def totals() -> tuple[int, int] | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        return fields[3] + fields[4], sum(fields[:8])    # idle + iowait; user..steal

    cores, first = os.cpu_count() or 1, totals()
    time.sleep(seconds)
    last = totals()
    if first is None or last is None or last[1] <= first[1]:
        return float(cores)
    return cores * (last[0] - first[0]) / (last[1] - first[1])


def inconclusive(measured: str) -> None:
    pytest.skip(f"{INCONCLUSIVE}: {measured}")


def require_pace(on_pace: int, ops: int, floor: float = PACE_FLOOR, what: str = "paced ops") -> None:
    """Skip as inconclusive unless at least `floor` of `ops` kept their pace."""
    if ops <= 0 or on_pace < floor * ops:
        inconclusive(f"{on_pace}/{ops} {what} kept their pace (needs {floor:.0%})")


def kept_pace(records: list[dict], before: dict | None = None) -> list[bool]:
    """Per worker step record (cumulative `pace_on`/`pace_ops`, as the worker reports them): whether
    every op since the record before it kept its pace. `before` is the record before the first."""
    out, prev = [], before or {"pace_on": 0, "pace_ops": 0}
    for rec in records:
        out.append(rec["pace_on"] - prev["pace_on"] == rec["pace_ops"] - prev["pace_ops"])
        prev = rec
    return out


class Section:
    """Wall and CPU seconds of a section of this process (every thread's CPU time counts)."""

    def __enter__(self) -> "Section":
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu

    def require_pace(self, floor: float = 0.5) -> None:
        """Skip as inconclusive unless this process computed for at least `floor` of the section's
        wall time: CPU-bound work whose wall time is judged must have had the core it asked for."""
        if self.cpu < floor * self.wall:
            inconclusive(f"this process computed {self.cpu:.2f} s in {self.wall:.2f} s of wall time "
                         f"({self.cpu / self.wall:.0%} of a core; needs {floor:.0%})")
