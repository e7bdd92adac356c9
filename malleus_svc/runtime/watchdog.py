"""Failure detection that never holds the host: a watchdog over each step's outstanding work.

Under NCCL a `wait()` only orders streams, so the host enqueues a whole step and blocks once, at
its end. A peer that is lost mid-step then leaves that one read waiting forever: nothing raises.
The watchdog times the device's progress instead (as torchft's fast abort times each collective
on its stream): a thread of its own polls how many ops the device has finished (`progress`: the
device clock's count, read from CUDA events without waiting) and, when a watched piece of work has
made none for `timeout`, aborts the world's communicators (`abort`), which ends the device's pending
NCCL kernels with an error; the work that the abort released raises `PeerLost` in the calling
thread. A slow step keeps finishing ops and is never taken for a lost peer; a collective that waits
for a peer that never comes holds every op queued behind it. The process stays up and joins the next world, as survivors do on
gloo, whose collectives raise at the same timeout by themselves.
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Iterator


class PeerLost(RuntimeError):
    """A step's communication did not finish within the collective timeout: its communicators were
    aborted, and the world must be left and rebuilt."""


class Watchdog:
    """Arms a deadline around each piece of work (`watch`), moves it on whenever `progress` (a count
    of finished ops; none: the work's start only) changes, and aborts once if one passes.

    `abort` runs on the watchdog's thread and must not wait for the work it interrupts, nor must
    `progress`. After it fired the watchdog stays fired: the world it watched is gone, and every
    later `watch` raises at once.
    """

    def __init__(self, timeout_s: float, abort: Callable[[], None], *, progress: Callable[[], int] | None = None,
                 poll_s: float | None = None, clock: Callable[[], float] = time.monotonic):
        if not timeout_s > 0:
            raise ValueError(f"the watchdog's timeout must be positive, got {timeout_s}")
        self.timeout_s, self._abort, self._clock = float(timeout_s), abort, clock
        self._progress = progress or (lambda: 0)
        self._seen = 0
        self._poll_s = poll_s if poll_s is not None else min(1.0, self.timeout_s / 10)
        self._cv = threading.Condition()
        self._deadline: float | None = None
        self._what = ""
        self.fired: str | None = None          # what was running when it aborted
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="malleus-watchdog", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def watch(self, what: str) -> Iterator[None]:
        """Run the block under the deadline; raise PeerLost if the watchdog aborted during it (from
        the error the abort caused, if any)."""
        self._raise_if_fired()
        seen = self._progress()
        with self._cv:
            self._deadline, self._what, self._seen = self._clock() + self.timeout_s, what, seen
            self._cv.notify_all()
        try:
            yield
        except Exception as e:
            self._disarm()
            self._raise_if_fired(e)
            raise
        self._disarm()
        self._raise_if_fired()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=5)

    def _disarm(self) -> None:
        with self._cv:
            self._deadline = None

    def _raise_if_fired(self, cause: BaseException | None = None) -> None:
        if self.fired is not None:
            raise PeerLost(f"{self.fired} made no progress for the collective timeout of {self.timeout_s:g} s: "
                           "a peer is lost or stalled, and this device's communicators were aborted") from cause

    def _run(self) -> None:
        with self._cv:
            while not self._closed:
                if self._deadline is not None:
                    seen = self._progress()
                    if seen != self._seen:
                        self._seen, self._deadline = seen, self._clock() + self.timeout_s
                    elif self._clock() >= self._deadline:
                        self.fired, self._deadline = self._what, None
                        break
                self._cv.wait(self._poll_s)
        if self.fired is not None:
            self._abort()
