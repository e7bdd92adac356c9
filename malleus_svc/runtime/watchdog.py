"""Failure detection that never holds the host: a watchdog over the device's progress.

Under NCCL a `wait()` only orders streams, so the host enqueues a whole step and blocks once, at
its end. A peer that is lost mid-step then leaves that one read waiting forever: nothing raises.
The watchdog times the device's progress instead (as torchft's fast abort times each collective
on its stream): a thread of its own polls how many ops the device has finished (`progress`: the
device clock's count, read from CUDA events without waiting) and, when a watched piece of work has
made none for `timeout`, aborts the world's communicators (`abort`), which ends the device's pending
NCCL kernels with an error; the work that the abort released raises `PeerLost` in the calling
thread. A slow step keeps finishing ops and is never taken for a lost peer; a collective that waits
for a peer that never comes holds every op queued behind it. Work with no device ops of its own (a
migration's exchanges) reports what the host saw complete with `kick`.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Callable, Iterator

log = logging.getLogger(__name__)


class PeerLost(RuntimeError):
    """A step's communication made no progress for the collective timeout: its communicators were
    aborted, and the world must be left and rebuilt."""


class Watchdog:
    """Arms a deadline around each piece of work (`watch`), moves it on whenever `progress` (a count
    of finished ops; none: the work's start only) changes or the work `kick`s, and aborts once if
    one passes.

    `abort` runs on the watchdog's thread and must not wait for the work it interrupts, nor must
    `progress`; one that raises counts as no progress. After it fired the watchdog stays fired:
    the world it watched is gone, and every later `watch` raises at once. Whoever tears the world
    down calls `close` first, which waits for an abort under way to end.
    """

    def __init__(self, timeout_s: float, abort: Callable[[], None], *, progress: Callable[[], int] | None = None,
                 poll_s: float | None = None, clock: Callable[[], float] = time.monotonic):
        if not timeout_s > 0:
            raise ValueError(f"the watchdog's timeout must be positive, got {timeout_s}")
        self.timeout_s, self._abort, self._clock = float(timeout_s), abort, clock
        self._progress = progress or (lambda: 0)
        self._poll_s = poll_s if poll_s is not None else min(1.0, self.timeout_s / 10)
        self._cv = threading.Condition()
        self._deadline: float | None = None
        self._what = ""
        self._seen: int | None = None
        self._kicks = 0
        self.fired: str | None = None          # what was running when it aborted
        self._aborted = threading.Event()      # the abort has ended (whether or not it raised)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="malleus-watchdog", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def watch(self, what: str) -> Iterator[None]:
        """Run the block under the deadline; raise PeerLost if the watchdog aborted during it (from
        the error the abort caused, if any)."""
        self._raise_if_fired()
        seen = self._read()
        with self._cv:
            self._deadline, self._what, self._seen = self._clock() + self.timeout_s, what, seen
            self._cv.notify_all()
        try:
            yield
        except Exception as e:
            self._raise_if_fired(e)
            raise
        finally:
            self._disarm()
        self._raise_if_fired()

    def kick(self) -> None:
        """The work made progress the device clock does not count (the host saw it complete)."""
        with self._cv:
            self._kicks += 1

    def close(self) -> None:
        """Stop watching; once fired, first wait for the abort to end, so that no world is torn down
        (or built) under it."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self.fired is not None:
            self._aborted.wait()
        self._thread.join(timeout=5)

    def _read(self) -> int | None:
        try:
            return self._progress() + self._kicks
        except Exception:  # noqa: BLE001 - a device that cannot say it progressed has not
            log.exception("the watchdog could not read the device's progress")
            return None

    def _disarm(self) -> None:
        with self._cv:
            self._deadline = None

    def _raise_if_fired(self, cause: BaseException | None = None) -> None:
        if self.fired is not None:
            self._aborted.wait()
            raise PeerLost(f"{self.fired} made no progress for the collective timeout of {self.timeout_s:g} s: "
                           "a peer is lost or stalled, and this device's communicators were aborted") from cause

    def _run(self) -> None:
        with self._cv:
            while not self._closed:
                if self._deadline is not None:
                    seen = self._read()
                    if seen is not None and seen != self._seen:
                        self._seen, self._deadline = seen, self._clock() + self.timeout_s
                    elif self._clock() >= self._deadline:
                        self.fired, self._deadline = self._what, None
                        break
                self._cv.wait(self._poll_s)
        if self.fired is None:
            return
        try:
            self._abort()
        except Exception:  # noqa: BLE001 - the work still raises PeerLost; the world is left anyway
            log.exception("aborting the communicators failed")
        finally:
            self._aborted.set()
