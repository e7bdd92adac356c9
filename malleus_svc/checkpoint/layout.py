"""What lies where: directory and file names, and the per-layer file payload.

A checkpoint of step s is the directory ``step-{s:08d}/`` under the root, holding one file per
model part (``embedding.pt``, ``block-0000.pt`` ..., ``head.pt`` = final norm + LM head, the parts
and tensors of `geometry.tensors`) and ``manifest.json``. Each part file holds the FULL, unsharded tensors of
that part, so it means the same under every plan (like DeepSpeed's universal checkpoints):

    {"format": "malleus-layer", "part": "embedding" | block index | "head",
     "tensors": {full tensor name: {"param": T, "exp_avg": T, "exp_avg_sq": T, "step": int}}}

Only dicts, str, int and tensors: what `torch.load(weights_only=True)` accepts.
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
from malleus_svc.geometry import EMBEDDING, HEAD, model_parts, part_tensors
from malleus_svc.runtime.engine import EXP_AVG, EXP_AVG_SQ, STEP

from .errors import CheckpointError

MANIFEST = "manifest.json"
LAYER_FORMAT = "malleus-layer"
STEP_DIR = re.compile(r"^step-(\d{8,})$")
WORK_DIR = re.compile(r"^step-(\d{8,})\.(tmp|del)-(\d+)$")
_MOMENTS = (("param", ""), ("exp_avg", EXP_AVG), ("exp_avg_sq", EXP_AVG_SQ))


def step_dir_name(step: int) -> str:
    return f"step-{int(step):08d}"


def tmp_dir_name(step: int, pid: int | None = None) -> str:
    return f"{step_dir_name(step)}.tmp-{os.getpid() if pid is None else pid}"


def step_of_dir(path: Path) -> int | None:
    m = STEP_DIR.match(path.name)
    return int(m.group(1)) if m else None


def part_file_name(part: int | str) -> str:
    if part == EMBEDDING:
        return "embedding.pt"
    if part == HEAD:
        return "head.pt"
    return f"block-{int(part):04d}.pt"


def expected_files(shape: ModelShape) -> dict[str, int | str]:
    """File name -> model part, for every part of a model of `shape`."""
    return {part_file_name(p): p for p in model_parts(shape.layers)}


# torch.save's zip and pickle around the tensors: measured at ~1.5 KiB per tensor for a tiny part;
# the bound is generous, it only has to stop a manifest from promising gigabytes.
_FILE_OVERHEAD_BYTES, _TENSOR_OVERHEAD_BYTES = 64 * 1024, 16 * 1024


def max_part_file_bytes(shape: ModelShape, part: int | str) -> int:
    """The most bytes a part file of this model may have: fp32 parameter and Adam moments of every
    tensor of the part, plus the container's overhead."""
    specs = part_tensors(shape, part)
    return sum(len(_MOMENTS) * 4 * t.numel + _TENSOR_OVERHEAD_BYTES for t in specs) + _FILE_OVERHEAD_BYTES


def _plain_cpu(t: Any, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise CheckpointError(f"{what} is a {type(t).__name__}, not a tensor")
    t = t.detach().cpu()
    # torch.save writes a view's whole storage: copy views so a file holds exactly its tensor.
    if not t.is_contiguous() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.contiguous().clone()
    return t


def pack(state: Mapping[str, Any], shape: ModelShape) -> dict[str, dict]:
    """Flat full state (as `WorkerGroup.full_state()` / `assemble_full` give it: ``name``,
    ``name:exp_avg``, ``name:exp_avg_sq``, ``name:step``) -> file name -> payload.
    Raises CheckpointError if a tensor is missing, extra or of the wrong shape for `shape`."""
    wanted = {f"{t.name}{suffix}" for p in model_parts(shape.layers) for t in part_tensors(shape, p)
              for suffix in ("", EXP_AVG, EXP_AVG_SQ, STEP)}
    missing, extra = sorted(wanted - set(state)), sorted(set(state) - wanted)
    if missing or extra:
        raise CheckpointError(f"the state does not match the model {shape}: missing {missing[:6]}"
                              f"{'...' if len(missing) > 6 else ''}, unexpected {extra[:6]}{'...' if len(extra) > 6 else ''}")
    out = {}
    for part in model_parts(shape.layers):
        tensors = {}
        for spec in part_tensors(shape, part):
            name = spec.name
            entry: dict[str, Any] = {}
            for key, suffix in _MOMENTS:
                t = _plain_cpu(state[name + suffix], name + suffix)
                if tuple(t.shape) != spec.shape:
                    raise CheckpointError(f"{name + suffix} has shape {tuple(t.shape)}, the model's is "
                                          f"{spec.shape} (a shard, not the full tensor?)")
                entry[key] = t
            entry["step"] = int(state[name + STEP])
            tensors[name] = entry
        out[part_file_name(part)] = {"format": LAYER_FORMAT, "part": part, "tensors": tensors}
    return out


def describe(payload: Mapping) -> dict[str, dict]:
    """Per tensor of a payload: shape, dtype and Adam step (the manifest's informative listing)."""
    return {name: {"shape": list(e["param"].shape), "dtype": str(e["param"].dtype).replace("torch.", ""),
                   "step": e["step"]} for name, e in payload["tensors"].items()}


def unpack_into(out: dict[str, torch.Tensor], payload: Any, file: str, shape: ModelShape, where: Path) -> None:
    """Check one loaded part file against the model and add its tensors to the flat state `out`."""
    part = expected_files(shape)[file]

    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{file}: {why}", where)

    if not isinstance(payload, dict) or payload.get("format") != LAYER_FORMAT:
        raise bad(f"not a {LAYER_FORMAT} file")
    if payload.get("part") != part:
        raise bad(f"holds part {payload.get('part')!r}, expected {part!r}")
    tensors = payload.get("tensors")
    specs = part_tensors(shape, part)
    names = {t.name for t in specs}
    if not isinstance(tensors, dict) or set(tensors) != names:
        got = sorted(tensors) if isinstance(tensors, dict) else type(tensors).__name__
        raise bad(f"tensors {got}, expected {sorted(names)}")
    for spec in specs:
        name = spec.name
        entry = tensors[name]
        if not isinstance(entry, dict):
            raise bad(f"{name} is a {type(entry).__name__}, expected a dict")
        for key, suffix in _MOMENTS:
            t = entry.get(key)
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != spec.shape or t.dtype != torch.float32:
                got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise bad(f"{name} {key} is {got}, expected a float32 tensor of shape {spec.shape}")
            out[name + suffix] = t
        step = entry.get("step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise bad(f"{name} step is {step!r}, expected an int >= 0")
        out[name + STEP] = torch.tensor(step)
