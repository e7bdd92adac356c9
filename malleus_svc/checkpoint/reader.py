"""Finding, verifying and loading checkpoints.

Every file's kind (regular, not a link), size and sha256 are checked against the manifest, and the
manifest's sizes against the model, before a byte is deserialised;
and deserialisation is `torch.load(weights_only=True)` only: a checkpoint is data, never code.
`load_latest` walks the published checkpoints newest first and returns the first that verifies,
reporting (log + `Checkpoint.skipped`) every newer one it passed over and why.
"""
from __future__ import annotations

import hashlib
import io
import logging
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from malleus_svc.config.errors import ConfigError
from malleus_svc.config.files import read_bytes
from malleus_svc.config.presets import ModelShape

from .errors import CheckpointError, CheckpointMismatchError
from .layout import MANIFEST, expected_files, max_part_file_bytes, step_of_dir, unpack_into
from .manifest import Manifest

log = logging.getLogger(__name__)


@dataclass
class Checkpoint:
    path: Path
    manifest: Manifest
    state: dict[str, torch.Tensor]          # flat full state, as WorkerGroup.full_state() gives it
    skipped: list[tuple[Path, str]] = field(default_factory=list)   # newer ones load_latest passed over

    @property
    def step(self) -> int:
        return self.manifest.step


def list_checkpoints(root: str | Path) -> list[Path]:
    """Published checkpoint directories under `root`, newest (highest step) first. Working
    directories (.tmp-/.del-) are not listed. Listed is not verified: see load_checkpoint."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if step_of_dir(p) is not None and p.is_dir() and not p.is_symlink()]
    return sorted(found, key=step_of_dir, reverse=True)


def read_manifest(path: str | Path) -> Manifest:
    path = Path(path)
    if not (path / MANIFEST).exists():
        raise CheckpointError(f"no {MANIFEST} (an incomplete checkpoint)", path)
    try:
        data = read_bytes(path / MANIFEST)      # size-capped: a manifest is parsed before it is verified
    except ConfigError as e:
        raise CheckpointError(f"{MANIFEST} cannot be read: {e.accepted}", path) from None
    m = Manifest.from_json(data, path)
    if step_of_dir(path) is not None and step_of_dir(path) != m.step:
        raise CheckpointError(f"{MANIFEST} says step {m.step}, the directory name says {step_of_dir(path)}", path)
    return m


def check_shape(manifest: Manifest, shape: ModelShape, path: Path | None = None) -> None:
    """Raise CheckpointMismatchError naming the first field of the model shape that differs."""
    saved, wanted = manifest.shape.to_dict(), shape.to_dict()
    for key in wanted:
        if saved.get(key) != wanted[key]:
            raise CheckpointMismatchError(
                f"model_shape.{key}", saved.get(key),
                f"the job's model has {key} = {wanted[key]!r}; this checkpoint is of the model {manifest.shape} "
                f"and cannot be loaded into {shape} (resume with the same model, or start without it)", path)


def _read_verified(path: Path, name: str, entry) -> bytes:
    """A part file's bytes, trusted only once they match the manifest. Before reading: a regular
    file of this directory (a symlink could point anywhere, a FIFO blocks a read forever) of the
    size the manifest says (a sparse or swapped file is refused without being read)."""
    try:
        st = (path / name).lstat()
    except FileNotFoundError:
        raise CheckpointError(f"{name} is missing", path) from None
    except OSError as e:
        raise CheckpointError(f"{name} cannot be read: {e}", path) from None
    if not stat.S_ISREG(st.st_mode):
        kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a regular file"
        raise CheckpointError(f"{name} is {kind}; a checkpoint holds only the regular files it wrote", path)
    if st.st_size != entry.bytes:
        raise CheckpointError(f"{name} has {st.st_size} bytes, the manifest says {entry.bytes} (truncated or overwritten)", path)
    try:
        with (path / name).open("rb") as f:
            data = f.read(entry.bytes + 1)
    except OSError as e:
        raise CheckpointError(f"{name} cannot be read: {e}", path) from None
    if len(data) != entry.bytes:
        raise CheckpointError(f"{name} has {len(data)} bytes, the manifest says {entry.bytes} (changed while read)", path)
    actual = hashlib.sha256(data).hexdigest()
    if actual != entry.sha256:
        raise CheckpointError(f"{name} sha256 mismatch: expected {entry.sha256}, actual {actual} (the file is damaged)", path)
    return data


def _load_tensors(path: Path, name: str, data: bytes) -> Any:
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any refusal or decode error is a bad checkpoint
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{name} refused by torch.load(weights_only=True): {type(e).__name__}: {first}", path) from e


def verify_checkpoint(path: str | Path, shape: ModelShape | None = None) -> Manifest:
    """Check the manifest, the model shape (if given) and every file's size and sha256."""
    path = Path(path)
    manifest = _checked_manifest(path, shape)
    for name, entry in manifest.files.items():
        _read_verified(path, name, entry)
    return manifest


def _checked_manifest(path: Path, shape: ModelShape | None) -> Manifest:
    manifest = read_manifest(path)
    if shape is not None:
        check_shape(manifest, shape, path)
    wanted = expected_files(manifest.shape)
    if set(manifest.files) != set(wanted):
        raise CheckpointError(f"{MANIFEST} lists files {sorted(manifest.files)}, a model of {manifest.shape} "
                              f"needs {sorted(wanted)}", path)
    for name, entry in manifest.files.items():
        most = max_part_file_bytes(manifest.shape, wanted[name])
        if not 0 < entry.bytes <= most:
            raise CheckpointError(f"{MANIFEST} says {name} has {entry.bytes} bytes; that part of a model of "
                                  f"{manifest.shape} takes at most {most}", path)
    return manifest


def load_checkpoint(path: str | Path, shape: ModelShape | None = None) -> Checkpoint:
    """Verify and load one checkpoint directory. `shape`: the job's model, if it should be checked
    (CheckpointMismatchError if it differs). Raises CheckpointError for anything damaged."""
    path = Path(path)
    manifest = _checked_manifest(path, shape)
    state: dict[str, torch.Tensor] = {}
    for name, entry in sorted(manifest.files.items()):
        data = _read_verified(path, name, entry)          # verified before it is deserialised
        unpack_into(state, _load_tensors(path, name, data), name, manifest.shape, path)
    return Checkpoint(path, manifest, state)


def load_latest(root: str | Path, shape: ModelShape | None = None) -> Checkpoint | None:
    """The newest checkpoint under `root` that verifies; None if there is none at all.

    Damaged or incomplete ones are skipped (logged as warnings and listed in `skipped`); if every
    checkpoint is damaged, CheckpointError lists them all (resuming from nothing silently would
    restart the job from scratch). A model shape mismatch raises at once (CheckpointMismatchError).
    """
    skipped: list[tuple[Path, str]] = []
    for path in list_checkpoints(root):
        try:
            ckpt = load_checkpoint(path, shape)
        except CheckpointMismatchError:
            raise
        except CheckpointError as e:
            skipped.append((path, e.reason))
            log.warning("skipping checkpoint %s: %s", path, e.reason)
            continue
        ckpt.skipped = skipped
        if skipped:
            log.warning("resuming from %s (step %d) after skipping %d newer checkpoint(s)", path, ckpt.step, len(skipped))
        return ckpt
    if skipped:
        raise CheckpointError("no checkpoint verifies: " + "; ".join(f"{p.name}: {why}" for p, why in skipped), root)
    return None
