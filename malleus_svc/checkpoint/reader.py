"""Finding, verifying and loading checkpoints.

Every file's kind (regular, not a link), size and sha256 are checked against the manifest, the
manifest's pieces and sizes against the model, and each file's safetensors header against its
pieces, before a tensor is read; safetensors holds data only, never code. Verifying streams the
files through sha256 and reads no tensor: `load_checkpoint` holds none of the model. A job's
workers then read their own rows (`restore_group`, runtime/shard_files.py); `Checkpoint.state`
assembles whole tensors for tools.
`load_latest` walks the published checkpoints newest first and returns the first that verifies,
reporting (log + `Checkpoint.skipped`) every newer one it passed over and why.
"""
from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch

from malleus_svc.config.locations import location
from malleus_svc.config.presets import ModelShape
from malleus_svc.geometry import model_parts, part_tensors
from malleus_svc.runtime.engine import EXP_AVG, EXP_AVG_SQ, STEP
from malleus_svc.runtime.shard_files import ShardFileError, ShardReader, check_header

from .errors import CheckpointError, CheckpointMismatchError
from .layout import MANIFEST, check_files, header_of, step_of_dir
from .manifest import Manifest
from .store import Where, manifest_bytes, step_dirs, verified_copy

log = logging.getLogger(__name__)


@dataclass
class Checkpoint:
    """A verified checkpoint: its manifest; tensors are read where they are needed."""

    path: Where
    manifest: Manifest
    skipped: list[tuple[Where, str]] = field(default_factory=list)   # newer ones load_latest passed over

    @property
    def step(self) -> int:
        return self.manifest.step

    def table(self) -> dict:
        """What a `shard_files.ShardReader` needs (plain data, shipped to the workers): each file's
        sha256 and size, each tensor's pieces and Adam step."""
        files = self.manifest.files
        return {"files": {n: [e.sha256, e.bytes] for n, e in files.items()},
                "pieces": {t: [list(p) for p in ps] for t, ps in check_files(self.manifest.shape, files).items()},
                "steps": {t: piece["step"] for e in files.values() for t, piece in e.tensors.items()}}

    @cached_property
    def state(self) -> dict[str, torch.Tensor]:
        """The flat full state (as `WorkerGroup.full_state()` gives it), whole tensors read one by
        one in this process: for tools and tests. A job's workers read their own rows instead."""
        shape = self.manifest.shape
        out: dict[str, torch.Tensor] = {}
        try:
            with ShardReader(self.path, shape, self.table(), verified=self.manifest.files) as reader:
                for part in model_parts(shape.layers):
                    for spec in part_tensors(shape, part):
                        st = reader.state(spec.name, 0, spec.shape[spec.axis])
                        out[spec.name], out[spec.name + EXP_AVG], out[spec.name + EXP_AVG_SQ] = (
                            st.param, st.exp_avg, st.exp_avg_sq)
                        out[spec.name + STEP] = torch.tensor(st.step)
        except ShardFileError as e:
            raise CheckpointError(str(e), self.path) from None
        return out


def list_checkpoints(root: str | Path) -> list[Where]:
    """Published checkpoint directories (object-store prefixes) under `root`, newest (highest step)
    first. Working directories (.tmp-/.del-) are not listed. Listed is not verified: see load_checkpoint."""
    try:
        return step_dirs(root)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot list the checkpoints: {e}", None if isinstance(e, ValueError) else root) from None


def read_manifest(path: str | Path) -> Manifest:
    path = location(path)
    m = Manifest.from_json(manifest_bytes(path), path)
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


def verify_checkpoint(path: str | Path, shape: ModelShape | None = None) -> Manifest:
    """Check the manifest, the model shape (if given), and every file's size, sha256 and header."""
    path = location(path)
    manifest = _checked_manifest(path, shape)
    with tempfile.TemporaryDirectory(prefix="malleus-verify-") as spool:
        for name, entry in sorted(manifest.files.items()):
            try:
                local = verified_copy(path, name, entry.sha256, entry.bytes, Path(spool))
                check_header(local.parent, name, header_of(manifest.shape, entry.tensors))
            except ShardFileError as e:
                raise CheckpointError(str(e), path) from None
            if local.parent == Path(spool):
                local.unlink()      # one download at a time on the spool's disk
    return manifest


def _checked_manifest(path: Where, shape: ModelShape | None) -> Manifest:
    manifest = read_manifest(path)
    if shape is not None:
        check_shape(manifest, shape, path)
    try:
        check_files(manifest.shape, manifest.files)
    except CheckpointError as e:
        raise CheckpointError(e.reason, path) from None
    return manifest


def load_checkpoint(path: str | Path, shape: ModelShape | None = None) -> Checkpoint:
    """Verify one checkpoint directory (no tensor is read). `shape`: the job's model, if it should be
    checked (CheckpointMismatchError if it differs). Raises CheckpointError for anything damaged."""
    path = location(path)
    return Checkpoint(path, verify_checkpoint(path, shape))


def load_latest(root: str | Path, shape: ModelShape | None = None) -> Checkpoint | None:
    """The newest checkpoint under `root` that verifies; None if there is none at all.

    Damaged or incomplete ones are skipped (logged as warnings and listed in `skipped`); if every
    checkpoint is damaged, CheckpointError lists them all (resuming from nothing silently would
    restart the job from scratch). A model shape mismatch raises at once (CheckpointMismatchError).
    """
    skipped: list[tuple[Where, str]] = []
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
