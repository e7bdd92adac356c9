"""CheckpointWriter: atomic, asynchronous checkpoint writes with retention.

A job's checkpoint (`save_shards_async`): the workers write their own pieces into the temporary
directory (`WorkerGroup.write_checkpoint`: snapshots taken at once, files written by a thread of
each worker while training goes on) and report each file's sha256, size and pieces; a background
thread here waits for those reports, checks that the pieces cover every tensor exactly once,
writes the manifest and publishes the directory. No tensor passes through this process.
`save_async` writes a whole state held by this process (tools, tests) the same way.

The metadata (and a whole state) are checked at once, so a bad one fails in the caller. One write
at a time: a new save first waits for the previous one. A failure in the thread is logged when it
happens and raised, as CheckpointError, by the next save/save_async/wait/close call: never lost.
A whole state must not be modified in place until the write is done (`WorkerGroup.full_state()`
returns fresh CPU tensors that nothing else touches, so it can be handed over as is).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from malleus_svc.runtime.shard_files import write_part

from . import atomic
from .errors import CheckpointError
from .layout import WORK_DIR, check_files, step_dir_name, whole_pieces
from .manifest import CheckpointMeta, FileEntry, build_manifest
from .store import LocalRoot, Where, open_root

log = logging.getLogger(__name__)

# Called after each file (shard files, then manifest.json) is durably written into the temporary
# directory, before the directory is published (for the workers' files: once they all reported).
# For progress reporting, and for tests that need to stop a writer at a known point.
FileHook = Callable[[str, Where], None]


@dataclass(frozen=True)
class SaveResult:
    path: Where           # the published checkpoint directory (object-store prefix)
    step: int
    files: int            # including manifest.json
    bytes: int            # all files, manifest included
    seconds: float        # serialise + write + fsync + publish + retention, in the writer thread


class CheckpointWriter:
    def __init__(self, root: str | Path, *, keep_last: int | None = 3, on_file_written: FileHook | None = None):
        if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
            raise CheckpointError(f"keep_last must be an int >= 1 or None (keep all), got {keep_last!r}")
        self.store = open_root(root)
        self.root = self.store.root
        self.keep_last = keep_last
        self.on_file_written = on_file_written
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._error_step: int | None = None
        self._result: SaveResult | None = None
        self.results: list[SaveResult] = []
        if isinstance(self.store, LocalRoot):
            clean_stale(self.root)

    # ------------------------------------------------------------------ public
    def save(self, state: Mapping[str, Any], meta: CheckpointMeta) -> SaveResult:
        """Write a checkpoint and return when it is durable."""
        self.save_async(state, meta)
        result = self.wait()
        assert result is not None
        return result

    def save_async(self, state: Mapping[str, Any], meta: CheckpointMeta) -> Where:
        """Start writing a whole state (held by this process) in the background; returns the
        directory it will have."""
        self.wait()  # one write at a time; raises the previous write's error, if any
        parts = whole_pieces(state, meta.shape)   # validates, and copies GPU tensors to CPU
        build_manifest(meta, {}).to_json()        # the metadata must be JSON: fail here, not later

        def produce(tmp: Where) -> dict[str, dict]:
            entries = {}
            for part, states in parts.items():
                name, entry = write_part(tmp, part, None, states)
                entries[name] = entry
                self._hook(name, tmp / name)
            return entries
        return self._start(meta, produce, staging=None)

    def save_shards_async(self, write_shards: Callable[[Where], Callable[[], dict[str, dict]]],
                          meta: CheckpointMeta) -> Where:
        """Start a checkpoint whose tensors their holders write: `write_shards(folder)` has each
        writer snapshot its pieces and write them into `folder` in the background, and returns a
        function that waits for them and gives the files' entries (`WorkerGroup.write_checkpoint`).
        Returns the directory the checkpoint will have, once the snapshots are taken."""
        self.wait()
        build_manifest(meta, {}).to_json()
        tmp = self._begin(meta.step)
        try:
            written = write_shards(tmp)
        except BaseException:
            self.store.abort(tmp)
            raise

        def produce(tmp: Where) -> dict[str, dict]:
            entries = written()
            for name in sorted(entries):
                self._hook(name, tmp / name)
            return entries
        return self._start(meta, produce, staging=tmp)

    def _begin(self, step: int) -> Where:
        try:
            return self.store.begin(int(step))
        except OSError as e:
            raise CheckpointError(f"cannot start the checkpoint of step {step}: {type(e).__name__}: {e}",
                                  self.root) from e

    def _start(self, meta: CheckpointMeta, produce: Callable[[Where], dict[str, dict]], staging: Where | None) -> Where:
        step = int(meta.step)
        self._result = None
        self._thread = threading.Thread(target=self._run, args=(meta, produce, staging), daemon=False,
                                        name=f"checkpoint-writer-{step}")
        self._thread.start()
        return self.root / step_dir_name(step)

    def wait(self) -> SaveResult | None:
        """Wait for the write in progress (if any); its result, or None if nothing was written
        since the last wait. Raises CheckpointError if the write failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, step = self._error, self._error_step
            self._error = self._error_step = None
            raise CheckpointError(f"writing the checkpoint of step {step} failed: "
                                  f"{type(err).__name__}: {err}", self.root) from err
        result, self._result = self._result, None
        return result

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def close(self) -> SaveResult | None:
        return self.wait()

    def __enter__(self) -> "CheckpointWriter":
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.close()
        else:  # do not hide the caller's exception behind a write error; still log it
            try:
                self.close()
            except CheckpointError as e:
                log.error("%s", e)

    # ------------------------------------------------------------------ the thread
    def _run(self, meta: CheckpointMeta, produce, staging: Where | None) -> None:
        try:
            self._result = self._write(meta, produce, staging)
            self.results.append(self._result)
        except BaseException as e:  # surfaced by the next call
            self._error, self._error_step = e, int(meta.step)
            log.error("writing the checkpoint of step %s under %s failed: %s: %s",
                      meta.step, self.root, type(e).__name__, e)

    def _write(self, meta: CheckpointMeta, produce, staging: Where | None) -> SaveResult:
        t0 = time.perf_counter()
        step = int(meta.step)
        tmp = self.store.begin(step) if staging is None else staging
        try:
            entries = {name: FileEntry(e["sha256"], int(e["bytes"]), e["part"], e["tensors"])
                       for name, e in produce(tmp).items()}
            check_files(meta.shape, entries)    # every tensor covered exactly once, or nothing is published
            manifest = build_manifest(meta, entries).to_json().encode()
            # last: it is what makes the directory (prefix) a checkpoint
            final = self.store.commit(step, tmp, manifest, self._hook)
        except BaseException:
            self.store.abort(tmp)
            raise
        self._retain(keep=final)
        return SaveResult(final, step, len(entries) + 1, sum(e.bytes for e in entries.values()) + len(manifest),
                          time.perf_counter() - t0)

    def _hook(self, name: str, path: Where) -> None:
        if self.on_file_written is not None:
            self.on_file_written(name, path)

    def _retain(self, keep: Where) -> None:
        if self.keep_last is None:
            return
        for old in self.store.published()[self.keep_last:]:
            if old != keep:
                self.store.retire(old)
                log.info("retention (keep_last=%d): removed %s", self.keep_last, old)


def clean_stale(root: Path) -> list[Path]:
    """Remove working directories (``.tmp-<pid>`` / ``.del-<pid>``) left by writers that died.

    A directory whose pid is alive (another writer on this host, or this process) is left alone.
    Assumes writers of one root run on one host: a pid from another host cannot be checked.
    """
    removed = []
    for p in Path(root).iterdir():
        m = WORK_DIR.match(p.name)
        if not m or not p.is_dir():
            continue
        pid = int(m.group(3))
        if pid == os.getpid() or _alive(pid):
            continue
        atomic.remove_tree(p)
        removed.append(p)
        log.info("removed %s, left by writer pid %d which is gone", p, pid)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # exists, owned by someone else
        return True
    return True
