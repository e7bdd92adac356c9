"""Hugging Face LLaMA weights in and out: `safetensors` files with `transformers`' names.

In: `pretrained_state(folder, shape)` reads a LlamaForCausalLM folder (one `model.safetensors` or
shards with `model.safetensors.index.json`) into the flat full state a job starts from, the way a
checkpoint is restored: fp32 parameters, fresh Adam moments (zeros at step 0, which is what AdamW
starts from). Each tensor is read on its own (`safe_open`), its shape checked against the model.
Out: `export_checkpoint(checkpoint, out_dir)` writes `config.json` and `model.safetensors` (fp32
parameters, no optimizer state) from a checkpoint, which `transformers` loads as it is.
Import then export gives the same bytes per tensor.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

import torch

from malleus_svc.config.errors import ConfigError
from malleus_svc.config.files import read_document
from malleus_svc.config.hf_config import CONFIG_FILE, hf_config, read_hf_config, shape_from_hf_config
from malleus_svc.config.presets import ModelShape
from malleus_svc.geometry import hf_name, model_parts, part_tensors
from malleus_svc.runtime.engine import EXP_AVG, EXP_AVG_SQ, STEP

from .errors import CheckpointError
from .layout import MANIFEST
from .reader import load_checkpoint, load_latest

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def _weight_files(folder: Path) -> dict[str, Path]:
    """Hugging Face tensor name -> the safetensors file holding it."""
    from safetensors import safe_open

    if (folder / INDEX_FILE).is_file():
        index = read_document(folder / INDEX_FILE, "json")
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise ConfigError("model.from_pretrained", str(folder / INDEX_FILE), "a safetensors index with a weight_map")
        return {name: folder / str(file) for name, file in weight_map.items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ConfigError("model.from_pretrained", str(folder), f"a folder with {WEIGHTS_FILE} (or an index and shards)")
    out: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            out.update({name: f for name in sf.keys()})
    return out


def pretrained_state(folder: str | Path, shape: ModelShape) -> dict[str, torch.Tensor]:
    """The flat full state (`WorkerGroup.load_full_state`'s input) of a LLaMA folder for `shape`:
    each tensor fp32 and of the model's shape, Adam moments zero at step 0. A missing LM head (a
    tied one) starts as a copy of the embedding."""
    from safetensors import safe_open

    folder = Path(folder)
    where = _weight_files(folder)
    state: dict[str, torch.Tensor] = {}
    for part in model_parts(shape.layers):
        for spec in part_tensors(shape, part):
            theirs = hf_name(spec.name)
            if theirs not in where and spec.name == "head.weight":
                theirs = hf_name("embedding.weight")                 # tied embeddings
            if theirs not in where:
                raise ConfigError("model.from_pretrained", str(folder), f"a tensor {theirs} (for {spec.name}); "
                                  "the folder does not hold it")
            with safe_open(str(where[theirs]), framework="pt") as sf:
                t = sf.get_tensor(theirs)
            if tuple(t.shape) != spec.shape or not t.is_floating_point():
                raise ConfigError("model.from_pretrained", str(where[theirs]),
                                  f"{theirs} of shape {spec.shape} (floating point), found {tuple(t.shape)} {t.dtype}")
            t = t.to(torch.float32).contiguous()
            state[spec.name] = t
            state[spec.name + EXP_AVG] = torch.zeros_like(t)
            state[spec.name + EXP_AVG_SQ] = torch.zeros_like(t)
            state[spec.name + STEP] = torch.tensor(0)
    return state


def read_pretrained(folder: str | Path, seq_len: int | None = None) -> tuple[ModelShape, dict[str, torch.Tensor]]:
    """(shape, flat full state) of a LLaMA folder."""
    shape = shape_from_hf_config(read_hf_config(folder), str(Path(folder) / CONFIG_FILE), seq_len)
    return shape, pretrained_state(folder, shape)


def write_hf(params: Mapping[str, torch.Tensor], shape: ModelShape, out_dir: str | Path) -> Path:
    """`config.json` and `model.safetensors` (fp32, Hugging Face names) for full parameters."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {hf_name(spec.name): params[spec.name].detach().to(torch.float32).contiguous()
               for part in model_parts(shape.layers) for spec in part_tensors(shape, part)}
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    (out / CONFIG_FILE).write_text(json.dumps(hf_config(shape), indent=2) + "\n")
    return out


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path) -> tuple[Path, ModelShape, int]:
    """A verified checkpoint (its step directory, or a job's checkpoint root: the newest that
    verifies) as a Hugging Face LLaMA folder; (folder, shape, step)."""
    path = Path(checkpoint)
    ckpt = load_checkpoint(path) if (path / MANIFEST).exists() else load_latest(path)
    if ckpt is None:
        raise CheckpointError("no checkpoint here (a step-XXXXXXXX directory, or a root holding them)", path)
    shape = ckpt.manifest.shape
    return write_hf(ckpt.state, shape, out_dir), shape, ckpt.step
