"""Hugging Face LLaMA weights read where they are used.

A worker reads only the rows of its own shards out of the safetensors files
(`safe_open(...).get_slice`), so no process ever holds the whole model; the folder must be one
every worker sees. Shapes and dtypes are checked from the files' headers before any data is read.
"""
from __future__ import annotations

from pathlib import Path

import torch

from malleus_svc.config.errors import ConfigError
from malleus_svc.config.files import read_document
from malleus_svc.config.presets import ModelShape
from malleus_svc.geometry import hf_name, model_parts, part_tensors, tensor_spec

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_FIELD = "model.from_pretrained"


def weight_files(folder: Path) -> dict[str, Path]:
    """Hugging Face tensor name -> the safetensors file holding it."""
    from safetensors import safe_open

    if (folder / INDEX_FILE).is_file():
        index = read_document(folder / INDEX_FILE, "json")
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise ConfigError(_FIELD, str(folder / INDEX_FILE), "a safetensors index with a weight_map")
        return {name: folder / str(file) for name, file in weight_map.items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ConfigError(_FIELD, str(folder), f"a folder with {WEIGHTS_FILE} (or an index and shards)")
    out: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            out.update({name: f for name in sf.keys()})
    return out


def _source(where: dict[str, Path], name: str, folder: Path) -> str:
    """The Hugging Face tensor that holds `name` (a missing LM head is the tied embedding)."""
    theirs = hf_name(name)
    if theirs not in where and name == "head.weight":
        theirs = hf_name("embedding.weight")
    if theirs not in where:
        raise ConfigError(_FIELD, str(folder), f"a tensor {theirs} (for {name}); the folder does not hold it")
    return theirs


def check_pretrained(folder: str | Path, shape: ModelShape) -> None:
    """Every tensor of the model is in the folder with the model's shape, as floating point
    (headers only: no tensor data is read)."""
    from safetensors import safe_open

    folder = Path(folder)
    where = weight_files(folder)
    for part in model_parts(shape.layers):
        for spec in part_tensors(shape, part):
            theirs = _source(where, spec.name, folder)
            with safe_open(str(where[theirs]), framework="pt") as sf:
                sl = sf.get_slice(theirs)
                got, dtype = tuple(sl.get_shape()), sl.get_dtype()
            if got != spec.shape or not dtype.startswith(("F", "BF")):
                raise ConfigError(_FIELD, str(where[theirs]),
                                  f"{theirs} of shape {spec.shape} (floating point), found {got} {dtype}")


def read_rows(folder: str | Path, shape: ModelShape, name: str, rows: tuple[int, int] | None = None,
              where: dict[str, Path] | None = None) -> torch.Tensor:
    """Rows [start, end) along the split dim of tensor `name` (all of it if `rows` is None), fp32."""
    from safetensors import safe_open

    folder = Path(folder)
    where = where if where is not None else weight_files(folder)
    spec = tensor_spec(shape, name)
    theirs = _source(where, name, folder)
    with safe_open(str(where[theirs]), framework="pt") as sf:
        sl = sf.get_slice(theirs)
        if tuple(sl.get_shape()) != spec.shape:
            raise ConfigError(_FIELD, str(where[theirs]), f"{theirs} of shape {spec.shape}, found {tuple(sl.get_shape())}")
        if rows is None or spec.split_dim is None:
            t = sf.get_tensor(theirs)
        else:
            index = [slice(None)] * len(spec.shape)
            index[spec.split_dim] = slice(*rows)
            t = sl[tuple(index)]
    return t.to(torch.float32).contiguous()
