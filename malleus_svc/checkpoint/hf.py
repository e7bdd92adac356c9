"""Hugging Face LLaMA weights in and out: `safetensors` files with `transformers`' names.

In: a job's workers read their own rows of a LlamaForCausalLM folder (`runtime/pretrained.py`);
`pretrained_state(folder, shape)` reads the whole of it into one flat full state, for tools:
fp32 parameters, fresh Adam moments (zeros at step 0, which is what AdamW starts from).
Out: `export_checkpoint(checkpoint, out_dir)` writes `config.json` and `model.safetensors` (fp32
parameters, no optimizer state) from a checkpoint, which `transformers` loads as it is.
Import then export gives the same bytes per tensor.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Mapping

import torch

from malleus_svc.config.hf_config import CONFIG_FILE, hf_config, shape_of_folder
from malleus_svc.config.locations import Uri, location
from malleus_svc.config.presets import ModelShape
from malleus_svc.geometry import TIED, hf_name, model_parts, part_tensors
from malleus_svc.runtime.engine import EXP_AVG, EXP_AVG_SQ, STEP
from malleus_svc.runtime.pretrained import WEIGHTS_FILE, check_pretrained, read_rows, weight_files
from malleus_svc.runtime.storage import Bucket

from .errors import CheckpointError
from .reader import load_checkpoint, load_latest
from .store import has_manifest

def pretrained_state(folder: str | Path, shape: ModelShape) -> dict[str, torch.Tensor]:
    """The flat full state (`WorkerGroup.load_full_state`'s input) of a LLaMA folder for `shape`:
    each tensor fp32 and of the model's shape, Adam moments zero at step 0. A missing LM head (a
    tied one) starts as a copy of the embedding. A job reads its shards on the workers instead
    (`WorkerGroup.load_pretrained`); this whole copy is for tools."""
    folder = Path(folder)
    check_pretrained(folder, shape)
    where = weight_files(folder)
    state: dict[str, torch.Tensor] = {}
    for part in model_parts(shape.layers):
        for spec in part_tensors(shape, part):
            t = read_rows(folder, shape, spec.name, where=where)
            state[spec.name] = t
            state[spec.name + EXP_AVG] = torch.zeros_like(t)
            state[spec.name + EXP_AVG_SQ] = torch.zeros_like(t)
            state[spec.name + STEP] = torch.tensor(0)
    return state


def read_pretrained(folder: str | Path, seq_len: int | None = None) -> tuple[ModelShape, dict[str, torch.Tensor]]:
    """(shape, flat full state) of a LLaMA folder."""
    shape = shape_of_folder(folder, seq_len)
    return shape, pretrained_state(folder, shape)


def write_hf(params: Mapping[str, torch.Tensor], shape: ModelShape, out_dir: str | Path) -> Path | Uri:
    """`config.json` and `model.safetensors` (fp32, Hugging Face names) for full parameters, into a
    folder or an object-store prefix (written locally, then uploaded)."""
    from safetensors.torch import save_file

    out = location(out_dir)
    if isinstance(out, Uri):
        with tempfile.TemporaryDirectory(prefix="malleus-export-") as local:
            write_hf(params, shape, local)
            bucket = Bucket(out)
            for name in (WEIGHTS_FILE, CONFIG_FILE):
                bucket.upload(Path(local) / name, name)
        return out
    out.mkdir(parents=True, exist_ok=True)
    tensors = {hf_name(spec.name): params[spec.name].detach().to(torch.float32).contiguous()
               for part in model_parts(shape.layers) for spec in part_tensors(shape, part)
               if not (shape.tie_embeddings and spec.name == TIED[1])}   # tied: transformers keeps one copy
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    (out / CONFIG_FILE).write_text(json.dumps(hf_config(shape), indent=2) + "\n")
    return out


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path) -> tuple[Path | Uri, ModelShape, int]:
    """A verified checkpoint (its step directory, or a job's checkpoint root: the newest that
    verifies; either may be in an object store) as a Hugging Face LLaMA folder; (folder, shape, step)."""
    try:
        path = location(checkpoint)
        ckpt = load_checkpoint(path) if has_manifest(path) else load_latest(path)
    except (OSError, ValueError) as e:
        raise CheckpointError(str(e), None if isinstance(e, ValueError) else checkpoint) from None
    if ckpt is None:
        raise CheckpointError("no checkpoint here (a step-XXXXXXXX directory, or a root holding them)", path)
    shape = ckpt.manifest.shape
    return write_hf(ckpt.state, shape, out_dir), shape, ckpt.step
