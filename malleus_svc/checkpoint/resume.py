"""Glue between checkpoints and a running `WorkerGroup` + `GlobalSampler`.

Saving: each worker writes its own pieces (one replica of each) into the checkpoint's temporary
directory and the writer publishes them with the manifest; restoring: each worker, under whatever
plan the group was just given (`apply_plan` first), reads only its own rows of the files. No
tensor passes through the driver either way. The sampler goes back to the saved data position,
so the next global batches are the ones the interrupted run would have taken.
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Mapping

from .errors import CheckpointError
from .manifest import CheckpointMeta
from .reader import Checkpoint, check_shape
from .writer import CheckpointWriter

log = logging.getLogger(__name__)


def group_meta(group, sampler, step: int, extra: Mapping[str, Any] | None = None) -> CheckpointMeta:
    if group.plan is None or getattr(group, "shape", None) is None:
        raise CheckpointError("the group has no plan applied: there is no state to checkpoint")
    return CheckpointMeta(step=int(step), shape=group.shape, data=sampler.state_dict(), plan=group.plan,
                          optim=getattr(group, "optim", None), extra=dict(extra or {}))


def save_group(writer: CheckpointWriter, group, sampler, step: int, *, wait: bool = False,
               extra: Mapping[str, Any] | None = None) -> Path:
    """Checkpoint the group's state and the sampler's position as of `step` completed steps.

    The workers' snapshots are synchronous; the files are written in the background unless `wait`.
    Call at an iteration boundary (no step in flight).
    """
    meta = group_meta(group, sampler, step, extra)
    path = writer.save_shards_async(group.write_checkpoint, meta)
    if wait:
        writer.wait()
    return path


def restore_group(group, checkpoint: Checkpoint, sampler=None) -> int:
    """Load `checkpoint` into `group` (whatever its plan) and `sampler`; returns the saved step."""
    if group.plan is None or getattr(group, "shape", None) is None:
        raise CheckpointError("apply_plan must run before restoring a checkpoint into the group")
    check_shape(checkpoint.manifest, group.shape, checkpoint.path)
    saved_optim = checkpoint.manifest.optim
    optim = getattr(group, "optim", None)
    if saved_optim is not None and optim is not None:
        # what the update computes; compiling the blocks or not does not change it
        now = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(optim).items()
               if k != "compile"}
        if now != {k: v for k, v in saved_optim.items() if k != "compile"}:
            log.warning("optimizer config differs from the checkpoint's: saved %s, now %s", saved_optim, now)
    group.load_checkpoint(checkpoint.path, checkpoint.table())
    if sampler is not None:
        sampler.load_state_dict(checkpoint.manifest.sampler_state)
    return checkpoint.step
