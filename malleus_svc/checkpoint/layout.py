"""What lies where: directory and file names, and which rows of each tensor the files hold.

A checkpoint of step s is the directory ``step-{s:08d}/`` under the root, holding shard files and
``manifest.json``. A shard file (runtime/shard_files.py) is safetensors holding one writer's
pieces of one model part: ``block-0002.d0003.safetensors`` is what device 3 wrote of block 2,
``block-0002.safetensors`` whole tensors written by one process. The manifest lists, per file, its
part and, per tensor, the rows [start, end) of the FULL tensor along its axis that the file holds,
and the Adam step: the full tensors' coordinates, which mean the same under every plan (like
DeepSpeed's universal checkpoints, with no conversion step), so any plan reads any checkpoint.
The pieces of each tensor of the model cover it exactly once.

Working directories are ``step-XXXXXXXX.tmp-<pid>`` (being written) and ``.del-<pid>`` (being
deleted); readers never look at them.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Mapping

import torch

from malleus_svc.config.presets import ModelShape
from malleus_svc.geometry import Part, model_parts, part_tensors, tensor_spec
from malleus_svc.runtime.engine import STEP, ShardState
from malleus_svc.runtime.shard_files import MOMENTS, part_stem, piece_shape

from .errors import CheckpointError

MANIFEST = "manifest.json"
STEP_DIR = re.compile(r"^step-(\d{8,})$")
WORK_DIR = re.compile(r"^step-(\d{8,})\.(tmp|del)-(\d+)$")
SHARD_FILE = re.compile(r"^(embedding|head|block-\d{4,})(\.d\d{4,})?\.safetensors$")

# safetensors' header (a JSON line per tensor) around the data: generous, it only has to stop a
# manifest from promising gigabytes.
_FILE_OVERHEAD_BYTES, _KEY_OVERHEAD_BYTES = 64 * 1024, 1024


def step_dir_name(step: int) -> str:
    return f"step-{int(step):08d}"


def tmp_dir_name(step: int, pid: int | None = None) -> str:
    return f"{step_dir_name(step)}.tmp-{os.getpid() if pid is None else pid}"


def step_of_dir(path: Path) -> int | None:
    m = STEP_DIR.match(path.name)
    return int(m.group(1)) if m else None


def whole_pieces(state: Mapping[str, Any], shape: ModelShape) -> dict[Part, dict[str, ShardState]]:
    """Flat full state (``name``, ``name:exp_avg``, ``name:exp_avg_sq``, ``name:step``, as
    `WorkerGroup.full_state()` gives it) -> per part, each tensor as one piece of all its rows.
    Raises CheckpointError if a tensor is missing, extra or of the wrong shape for `shape`."""
    wanted = {f"{t.name}{suffix}" for p in model_parts(shape.layers) for t in part_tensors(shape, p)
              for suffix in (*MOMENTS, STEP)}
    missing, extra = sorted(wanted - set(state)), sorted(set(state) - wanted)
    if missing or extra:
        raise CheckpointError(f"the state does not match the model {shape}: missing {missing[:6]}"
                              f"{'...' if len(missing) > 6 else ''}, unexpected {extra[:6]}{'...' if len(extra) > 6 else ''}")
    out: dict[Part, dict[str, ShardState]] = {}
    for part in model_parts(shape.layers):
        out[part] = {}
        for spec in part_tensors(shape, part):
            ts = [_plain_cpu(state[spec.name + key], spec.name + key, spec.shape) for key in MOMENTS]
            out[part][spec.name] = ShardState(spec.split_dim, 0, spec.shape[spec.axis], *ts,
                                              int(state[spec.name + STEP]), spec.shape)
    return out


def _plain_cpu(t: Any, what: str, shape: tuple[int, ...]) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise CheckpointError(f"{what} is a {type(t).__name__}, not a tensor")
    if tuple(t.shape) != shape:
        raise CheckpointError(f"{what} has shape {tuple(t.shape)}, the model's is {shape} (a shard, not the full tensor?)")
    return t.detach().cpu().contiguous()


def check_files(shape: ModelShape, files: Mapping[str, Any]) -> dict[str, list[tuple[str, int, int]]]:
    """The manifest's files (name -> FileEntry) against the model: names, parts, tensors, rows,
    steps and the most bytes each may take; the pieces of every tensor must cover it exactly
    once. Returns tensor -> its pieces (file, start, end) in row order; CheckpointError (the reason,
    naming the file or tensor) if anything does not fit."""
    pieces: dict[str, list[tuple[str, int, int]]] = {}
    steps: dict[str, int] = {}
    for name, entry in sorted(files.items()):
        m = SHARD_FILE.match(name)
        part = _part(entry.part, shape)
        if m is None or part is None or m.group(1) != part_stem(part):
            raise CheckpointError(f"{MANIFEST}: files.{name} is not a shard file of part {entry.part!r} of a model "
                                  f"of {shape}")
        held = {t.name for t in part_tensors(shape, part)}
        for tensor, piece in entry.tensors.items():
            where = f"{MANIFEST}: files.{name}.tensors.{tensor}"
            if tensor not in held:
                raise CheckpointError(f"{where}: part {part!r} has no such tensor")
            rows, step = (piece.get("rows"), piece.get("step")) if isinstance(piece, Mapping) else (None, None)
            spec = tensor_spec(shape, tensor)
            n = spec.shape[spec.axis]
            if not (isinstance(rows, list) and len(rows) == 2 and all(_count(r) for r in rows)
                    and 0 <= rows[0] < rows[1] <= n):
                raise CheckpointError(f"{where}.rows = {rows!r} is not valid: rows [start, end) within [0, {n})")
            if not _count(step) or steps.setdefault(tensor, step) != step:
                raise CheckpointError(f"{where}.step = {step!r} is not valid: one int >= 0 for all of {tensor}")
            pieces.setdefault(tensor, []).append((name, rows[0], rows[1]))
        most = max_file_bytes(shape, entry.tensors)
        if not 0 < entry.bytes <= most:
            raise CheckpointError(f"{MANIFEST} says {name} has {entry.bytes} bytes; its pieces of a model of "
                                  f"{shape} take at most {most}")
    for part in model_parts(shape.layers):
        for spec in part_tensors(shape, part):
            got = sorted(pieces.get(spec.name, []), key=lambda p: p[1])
            ends = [0] + [p[2] for p in got]
            if [p[1] for p in got] != ends[:-1] or ends[-1] != spec.shape[spec.axis]:
                spans = [f"[{a}, {b})" for _, a, b in got]
                raise CheckpointError(f"{MANIFEST}: the pieces of {spec.name} cover rows {spans or 'none'}, not each "
                                      f"of [0, {spec.shape[spec.axis]}) exactly once")
            pieces[spec.name] = got
    return pieces


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _part(part: Any, shape: ModelShape) -> Part | None:
    return part if not isinstance(part, bool) and part in model_parts(shape.layers) else None


def max_file_bytes(shape: ModelShape, tensors: Mapping[str, Mapping]) -> int:
    """The most bytes a shard file holding these pieces may have: fp32 rows of the parameter and both
    Adam moments, plus the header."""
    total = _FILE_OVERHEAD_BYTES
    for tensor, piece in tensors.items():
        start, end = piece["rows"]
        total += len(MOMENTS) * (4 * tensor_spec(shape, tensor).row_numel * (end - start) + _KEY_OVERHEAD_BYTES)
    return total


def header_of(shape: ModelShape, tensors: Mapping[str, Mapping]) -> dict[str, tuple[int, ...]]:
    """The keys and shapes a shard file holding these pieces has in its header."""
    return {tensor + key: piece_shape(shape, tensor, *piece["rows"]) for tensor, piece in tensors.items()
            for key in MOMENTS}

