"""A checkpoint root: a local directory or an object-store prefix, and how a checkpoint is
committed in each.

Local (a file system every node sees): the files are written into a working directory, fsynced,
and the directory renamed to its final name (atomic.py), so a reader sees all of it or nothing.
Object store (no rename): the files are uploaded into the checkpoint's final prefix and the
manifest last; a prefix without a manifest is not a checkpoint, so a failed or partial upload is
never read as one. Rewriting a step first deletes its manifest, and retention deletes the manifest
before the rest, so no manifest ever names files that are not all there.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

from malleus_svc.config.errors import ConfigError
from malleus_svc.config.files import read_bytes
from malleus_svc.config.limits import MAX_FILE_BYTES
from malleus_svc.config.locations import Uri, location
from malleus_svc.runtime.shard_files import fetch_object, verify_file, write_durably
from malleus_svc.runtime.storage import Bucket

from . import atomic
from .errors import CheckpointError
from .layout import MANIFEST, step_dir_name, step_of_dir, tmp_dir_name

log = logging.getLogger(__name__)
Where = Path | Uri


class LocalRoot:
    def __init__(self, root: Path):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def begin(self, step: int) -> Path:
        """An empty working directory for the step's files (one left by a writer of this process is dropped)."""
        tmp = self.root / tmp_dir_name(step)
        atomic.remove_tree(tmp)
        tmp.mkdir()
        return tmp

    def commit(self, step: int, staging: Path, manifest: bytes, written: Callable[[str, Where], None]) -> Path:
        write_durably(staging / MANIFEST, manifest)
        written(MANIFEST, staging / MANIFEST)
        final = self.root / step_dir_name(step)
        atomic.publish(staging, final)
        return final

    def abort(self, staging: Path) -> None:
        atomic.remove_tree(staging)

    def published(self) -> list[Path]:
        return step_dirs(self.root)

    def retire(self, path: Path) -> None:
        atomic.retire(path)


class ObjectRoot:
    def __init__(self, root: Uri):
        self.root = root

    def begin(self, step: int) -> Uri:
        """The step's prefix, emptied: its manifest first (a rewrite is never read as the old checkpoint)."""
        prefix = self.root / step_dir_name(step)
        bucket = Bucket(prefix)
        bucket.delete(MANIFEST)
        bucket.delete_all()
        return prefix

    def commit(self, step: int, staging: Uri, manifest: bytes, written: Callable[[str, Where], None]) -> Uri:
        Bucket(staging).write(MANIFEST, manifest)    # the commit record: the checkpoint exists from here
        written(MANIFEST, staging / MANIFEST)
        return staging

    def abort(self, staging: Uri) -> None:
        try:
            Bucket(staging).delete_all()
        except OSError as e:       # no manifest was written: what is left is not a checkpoint either way
            log.warning("could not remove the partial upload %s: %s", staging, e)

    def published(self) -> list[Uri]:
        return step_dirs(self.root)

    def retire(self, prefix: Uri) -> None:
        bucket = Bucket(prefix)
        bucket.delete(MANIFEST)     # first: a half-deleted prefix is no longer a checkpoint
        bucket.delete_all()


def open_root(root: str | Path) -> LocalRoot | ObjectRoot:
    try:
        where = location(root)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    return ObjectRoot(where) if isinstance(where, Uri) else LocalRoot(where)


def step_dirs(root: str | Path) -> list[Where]:
    """The step-XXXXXXXX directories (prefixes) under `root`, newest first; working directories are
    not listed, nor are symlinks."""
    where = location(root)
    if isinstance(where, Uri):
        found: list[Where] = [where / d for d in Bucket(where).listing()[0] if step_of_dir(where / d) is not None]
    elif where.is_dir():
        found = [p for p in where.iterdir() if step_of_dir(p) is not None and p.is_dir() and not p.is_symlink()]
    else:
        found = []
    return sorted(found, key=step_of_dir, reverse=True)


def manifest_bytes(path: Where) -> bytes:
    """The manifest's bytes, size-capped (it is parsed before it is verified)."""
    if isinstance(path, Uri):
        bucket = Bucket(path)
        try:
            size = bucket.size(MANIFEST)
            data = None if size is None or size > MAX_FILE_BYTES else bucket.read(MANIFEST, MAX_FILE_BYTES)
        except OSError as e:
            raise CheckpointError(f"{MANIFEST} cannot be read: {e}", path) from None
        if size is None:
            raise CheckpointError(f"no {MANIFEST} (an incomplete checkpoint)", path)
        if data is None or len(data) > MAX_FILE_BYTES:
            raise CheckpointError(f"{MANIFEST} cannot be read: at most {MAX_FILE_BYTES} bytes "
                                  "(limits.MAX_FILE_BYTES)", path)
        return data
    if not (path / MANIFEST).exists():
        raise CheckpointError(f"no {MANIFEST} (an incomplete checkpoint)", path)
    try:
        return read_bytes(path / MANIFEST)
    except ConfigError as e:
        raise CheckpointError(f"{MANIFEST} cannot be read: {e.accepted}", path) from None


def has_manifest(path: Where) -> bool:
    """Whether `path` is a checkpoint itself (not a root holding them)."""
    return Bucket(path).size(MANIFEST) is not None if isinstance(path, Uri) else (path / MANIFEST).exists()


def verified_copy(path: Where, name: str, sha256: str, size: int, spool: Path) -> Path:
    """A local file of the checkpoint, verified (size, sha256): the file itself, or its download into `spool`."""
    if isinstance(path, Uri):
        return fetch_object(path, name, sha256, size, spool)
    verify_file(path, name, sha256, size)
    return path / name

