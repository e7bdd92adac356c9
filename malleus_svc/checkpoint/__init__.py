"""Plan-agnostic checkpoints: full (unsharded) per-layer tensors + Adam state, a manifest with
checksums, atomic publication, asynchronous writing, verified loading under any plan.

    writer = CheckpointWriter(root, keep_last=3)
    save_group(writer, group, sampler, step)          # background write; training goes on
    ...
    ckpt = load_latest(root, shape)                   # newest checkpoint that verifies
    group.apply_plan(any_plan, shape)
    step = restore_group(group, ckpt, sampler)
"""
from .errors import CheckpointError, CheckpointMismatchError
from .manifest import CheckpointMeta, FileEntry, Manifest
from .reader import Checkpoint, list_checkpoints, load_checkpoint, load_latest, read_manifest, verify_checkpoint
from .resume import group_meta, restore_group, save_group
from .writer import CheckpointWriter, SaveResult, clean_stale

__all__ = [
    "Checkpoint", "CheckpointError", "CheckpointMeta", "CheckpointMismatchError", "CheckpointWriter",
    "FileEntry", "Manifest", "SaveResult", "clean_stale", "group_meta", "list_checkpoints", "load_checkpoint",
    "load_latest", "read_manifest", "restore_group", "save_group", "verify_checkpoint",
]
