"""Plan-agnostic sharded checkpoints: each worker writes its own pieces of the parameters and Adam
state (safetensors), a manifest describes them in full-tensor coordinates with checksums, atomic
publication, asynchronous writing, and each worker reads only its own rows under any plan.

    writer = CheckpointWriter(root, keep_last=3)
    save_group(writer, group, sampler, step)          # workers write in the background; training goes on
    ...
    ckpt = load_latest(root, shape)                   # newest checkpoint that verifies (no tensor read)
    group.apply_plan(any_plan, shape, init=False)
    step = restore_group(group, ckpt, sampler)        # each worker reads its own rows
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
