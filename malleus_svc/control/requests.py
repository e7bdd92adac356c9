"""Client calls, checked: pure functions that return clean values or raise MalleusError (one line:
what was wrong, what would be accepted). Nothing here touches the job; the coordinator applies
what passed."""
from __future__ import annotations

import math
import time
from typing import Any, Mapping

from malleus_svc.config.errors import shorten
from malleus_svc.config.limits import MAX_DEVICES, MAX_RATE

MAX_REASON = 200                          # characters of a re-plan reason (it goes into history and metrics)
_DEVICE_DIGITS = len(str(MAX_DEVICES))    # a device id as text: int() of thousands of digits is refused by Python


class MalleusError(ValueError):
    """A client call the coordinator refuses; the message says why. Nothing changed."""


def is_number(v: Any) -> bool:
    """A finite real number (bools are not numbers here, though Python says they are)."""
    try:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    except OverflowError:       # an int beyond any float
        return False


def check_device(d: Any, num_devices: int, job: str) -> int:
    # ASCII digits only ('²'.isdigit() is True, and int('²') raises), and few of them
    text = d.strip() if isinstance(d, str) else ""
    ascii_digits = text.isascii() and text.isdigit() and len(text) <= _DEVICE_DIGITS
    if isinstance(d, bool) or not (isinstance(d, int) or ascii_digits):
        raise MalleusError(f"device ids are ints in 0..{num_devices - 1}, got {shorten(d)}")
    if not 0 <= int(d) < num_devices:
        raise MalleusError(f"unknown device {shorten(d)}: job {job!r} has devices 0..{num_devices - 1}")
    d = int(d)
    return d


def check_devices(devices: Any, what: str, num_devices: int, job: str) -> list[int]:
    if isinstance(devices, (int, str)):
        devices = [devices]
    if not isinstance(devices, (list, tuple, set, frozenset)) or not devices:
        raise MalleusError(f"{what} needs a non-empty list of device ids, got {shorten(devices)}")
    return sorted({check_device(d, num_devices, job) for d in devices})


def check_reason(reason: Any) -> str:
    """A non-empty string of at most MAX_REASON characters (stripped)."""
    if not isinstance(reason, str) or not reason.strip():
        raise MalleusError(f"reason must be a non-empty string, got {shorten(reason)}")
    if len(reason.strip()) > MAX_REASON:
        raise MalleusError(f"reason must be at most {MAX_REASON} characters, got {len(reason.strip())}: {shorten(reason)}")
    return reason.strip()


def check_rates(rates: Any, num_devices: int, job: str) -> dict[int, float | None]:
    """device -> straggling rate >= 1.0, or None to clear it."""
    if not isinstance(rates, Mapping) or not rates:
        raise MalleusError(f"set_rates needs a non-empty mapping of device -> rate (>= 1.0, or None to clear), "
                           f"got {shorten(rates)}")
    clean: dict[int, float | None] = {}
    for d, r in rates.items():
        d = check_device(d, num_devices, job)
        if r is None:
            clean[d] = None
            continue
        if not is_number(r):
            raise MalleusError(f"rate for device {d} must be a finite number >= 1.0 (or None to clear), got {shorten(r)}")
        if not 1.0 <= float(r) <= MAX_RATE:
            raise MalleusError(f"rate for device {d} must be >= 1.0 and at most {MAX_RATE:g} (1.0 = healthy, "
                               f"3.0 = three times slower), got {shorten(r)}")
        clean[d] = float(r)
    return clean


def check_exclude(devices: list[int], excluded: set[int], gone: set[int], num_devices: int, job: str) -> None:
    already = [d for d in devices if d in excluded]
    if already:
        raise MalleusError(f"devices {already} are already excluded (excluded now: {sorted(excluded)})")
    if len(excluded | set(devices) | gone) >= num_devices:
        raise MalleusError(f"excluding {devices} would leave no device for job {job!r}")


def check_include(devices: list[int], excluded: set[int], gone: set[int]) -> None:
    back = sorted(set(devices) & gone)
    if back:
        raise MalleusError(f"devices {back} are gone (their node left the cluster); they rejoin by "
                           "themselves when Ray can place them again")
    missing = [d for d in devices if d not in excluded]
    if missing:
        raise MalleusError(f"devices {missing} are not excluded (excluded now: {sorted(excluded)})")


def check_emulation(factors: Any, jitter: Any, num_devices: int, job: str) -> tuple[dict[int, float], float | None]:
    """EMULATION ONLY: slowdown factors (>= 1.0, 1.0 = off) and the per-step jitter in [0, 1]."""
    if jitter is not None:
        if not is_number(jitter) or not 0.0 <= float(jitter) <= 1.0:
            raise MalleusError(f"jitter must be a number in [0, 1], got {shorten(jitter)}")
        jitter = float(jitter)
    if factors is not None and not isinstance(factors, Mapping):
        raise MalleusError(f"factors must be a mapping of device -> slowdown factor (>= 1.0), got {shorten(factors)}")
    clean = {}
    for d, f in (factors or {}).items():
        d = check_device(d, num_devices, job)
        if not is_number(f) or not 1.0 <= float(f) <= MAX_RATE:
            raise MalleusError(f"slowdown factor for device {d} must be a finite number >= 1.0 and at most "
                               f"{MAX_RATE:g}, got {shorten(f)}")
        clean[d] = float(f)
    return clean, jitter


def check_steps(steps: Any) -> int:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise MalleusError(f"steps must be an integer >= 1, got {shorten(steps)}")
    return steps


# Client calls that change the job, per job: a steady rate and a burst. A loop of calls would
# otherwise grow the pending requests and the history with its own speed, and queue a round per call.
CALLS_PER_SECOND = 5.0
CALL_BURST = 20


class CallBudget:
    """A token bucket over the job's changing client calls (refused calls count too: they cost the
    coordinator a check each). `take` raises MalleusError with the wait when the budget is spent."""

    def __init__(self, job: str, rate: float = CALLS_PER_SECOND, burst: int = CALL_BURST,
                 clock=time.monotonic):
        self.job, self.rate, self.burst, self.clock = job, float(rate), float(burst), clock
        self.tokens, self.at = float(burst), clock()

    def take(self) -> None:
        now = self.clock()
        self.tokens, self.at = min(self.burst, self.tokens + (now - self.at) * self.rate), now
        if self.tokens < 1.0:
            wait = (1.0 - self.tokens) / self.rate
            raise MalleusError(f"job {self.job!r} takes at most {self.rate:g} changing calls per second (bursts of "
                               f"{self.burst:g}); retry in {wait:.1f} s")
        self.tokens -= 1.0
