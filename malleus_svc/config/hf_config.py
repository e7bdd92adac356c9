"""A Hugging Face LLaMA `config.json` and the model shape it describes, both ways.

The project's decoder is LLaMA's (RMSNorm, rotary positions in the rotate-half layout, SwiGLU,
grouped-query attention, untied LM head), so a `LlamaForCausalLM` folder maps onto a `ModelShape`
when it uses the same architecture constants (`presets.NORM_EPS`, `presets.ROPE_BASE`) and none of
the variants the model does not have (biases, rope scaling, another activation). Anything else is
refused in one line naming the field. A tied LM head is accepted: the head starts as a copy of
the embedding and trains untied from there (an export writes it untied).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping

from .errors import ConfigError
from .files import read_document
from .limits import MAX_LAYERS, MAX_MODEL_DIM
from .presets import NORM_EPS, ROPE_BASE, ModelShape

LLAMA_ARCHITECTURE = "LlamaForCausalLM"
CONFIG_FILE = "config.json"
_DIMS = (("layers", "num_hidden_layers", MAX_LAYERS), ("hidden", "hidden_size", MAX_MODEL_DIM),
         ("heads", "num_attention_heads", MAX_MODEL_DIM), ("ffn", "intermediate_size", MAX_MODEL_DIM),
         ("vocab", "vocab_size", MAX_MODEL_DIM))


def read_hf_config(folder: str | Path) -> dict:
    """The folder's config.json as a mapping (ConfigError if it is missing or not JSON)."""
    path = Path(folder) / CONFIG_FILE
    if not Path(folder).is_dir():
        raise ConfigError("model.from_pretrained", str(folder), "a folder holding config.json and *.safetensors "
                          "(a Hugging Face LLaMA checkpoint, or what `malleus export` wrote)")
    doc = read_document(path, "json")
    if not isinstance(doc, dict):
        raise ConfigError("model.from_pretrained", str(path), "a JSON object (a Hugging Face config)")
    return doc


def shape_of_folder(folder: str | Path, seq_len: int | None = None) -> ModelShape:
    """The ModelShape of a Hugging Face LLaMA folder (its config.json)."""
    return shape_from_hf_config(read_hf_config(folder), str(Path(folder) / CONFIG_FILE), seq_len)


def shape_from_hf_config(cfg: Mapping[str, Any], source: str, seq_len: int | None = None) -> ModelShape:
    """The ModelShape of a LLaMA config; `seq_len` defaults to its max_position_embeddings."""
    def bad(key: str, accepted: str) -> ConfigError:
        return ConfigError(f"model.from_pretrained: {key}", cfg.get(key), accepted, source)

    arch = cfg.get("architectures") or []
    if cfg.get("model_type") != "llama" and LLAMA_ARCHITECTURE not in arch:
        raise bad("architectures", f"{LLAMA_ARCHITECTURE} (model_type \"llama\"): the model this project trains")
    dims: dict[str, int] = {}
    for ours, theirs, top in _DIMS:
        v = cfg.get(theirs)
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= top:
            raise bad(theirs, f"an integer in 1..{top}")
        dims[ours] = v
    kv = cfg.get("num_key_value_heads", dims["heads"])
    if isinstance(kv, bool) or not isinstance(kv, int) or kv < 1 or dims["heads"] % kv:
        raise bad("num_key_value_heads", f"an integer that divides num_attention_heads = {dims['heads']}")
    if dims["hidden"] % dims["heads"]:
        raise bad("hidden_size", f"a multiple of num_attention_heads = {dims['heads']}")
    if cfg.get("head_dim") not in (None, dims["hidden"] // dims["heads"]):
        raise bad("head_dim", f"hidden_size / num_attention_heads = {dims['hidden'] // dims['heads']}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise bad("hidden_act", "\"silu\" (SwiGLU)")
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            raise bad(key, "false: the model's projections have no bias")
    eps = cfg.get("rms_norm_eps")
    if not isinstance(eps, (int, float)) or not math.isclose(eps, NORM_EPS, rel_tol=1e-6):
        raise bad("rms_norm_eps", f"{NORM_EPS} (the model's RMSNorm epsilon)")
    rope = cfg.get("rope_parameters") or {}
    theta = rope.get("rope_theta", cfg.get("rope_theta", ROPE_BASE))
    if not isinstance(theta, (int, float)) or not math.isclose(theta, ROPE_BASE, rel_tol=1e-9):
        raise bad("rope_theta", f"{ROPE_BASE:g} (the model's rotary base)")
    if rope.get("rope_type", "default") != "default" or cfg.get("rope_scaling"):
        raise bad("rope_parameters", "plain rotary positions (rope_type \"default\", no rope_scaling)")
    if seq_len is None:
        seq_len = cfg.get("max_position_embeddings")
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or not 1 <= seq_len <= MAX_MODEL_DIM:
            raise bad("max_position_embeddings", f"an integer in 1..{MAX_MODEL_DIM} (or give model.seq_len)")
    return ModelShape(seq_len=seq_len, kv_heads=None if kv == dims["heads"] else kv, **dims)


def hf_config(shape: ModelShape) -> dict:
    """config.json for `shape` as `transformers.LlamaForCausalLM` reads it (fp32 weights)."""
    return {"architectures": [LLAMA_ARCHITECTURE], "model_type": "llama",
            "num_hidden_layers": shape.layers, "hidden_size": shape.hidden, "num_attention_heads": shape.heads,
            "num_key_value_heads": shape.n_kv_heads, "intermediate_size": shape.ffn, "vocab_size": shape.vocab,
            "head_dim": shape.head_dim, "max_position_embeddings": shape.seq_len, "hidden_act": "silu",
            "rms_norm_eps": NORM_EPS, "rope_theta": ROPE_BASE,
            "rope_parameters": {"rope_type": "default", "rope_theta": ROPE_BASE},
            "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
            "torch_dtype": "float32", "dtype": "float32"}
