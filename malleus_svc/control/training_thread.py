"""The job's training thread and the events around it, apart from what the thread runs."""
from __future__ import annotations

import threading
from typing import Callable


class TrainingThread:
    """Started once; asked to stop at the next iteration boundary; waited for. `setup_lock` keeps
    setup to one caller at a time (a coordinator that Ray restarted sets up by itself while its
    driver may call `start`)."""

    def __init__(self) -> None:
        self.setup_lock = threading.Lock()
        self.stop_requested = threading.Event()
        self.done = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self, loop: Callable[[], None]) -> None:
        """Run `loop` on a daemon thread; `done` is set when it returns, however it ends."""
        def run() -> None:
            try:
                loop()
            finally:
                self.done.set()
        self._thread = threading.Thread(target=run, name="malleus-train", daemon=True)
        self._thread.start()
