"""A Hugging Face LLaMA `config.json` and the model shape it describes, both ways.

The project's decoder is LLaMA's (RMSNorm, rotary positions in the rotate-half layout, SwiGLU,
grouped-query attention, an LM head tied to the embedding or not), so a `LlamaForCausalLM` folder
of any LLaMA generation maps onto a `ModelShape`: its RMSNorm epsilon, rotary base, Llama 3 rotary
scaling and `tie_word_embeddings` are read from the config as `transformers` 4 writes them
(`rope_theta`, `rope_scaling`) and as 5 does (`rope_parameters`). Variants the model does not have
(biases, another activation, another rotary scaling) are refused in one line naming the field.
"""
from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path
from typing import Any, Mapping

from .errors import ConfigError
from .files import read_document
from .limits import MAX_LAYERS, MAX_MODEL_DIM
from .presets import NORM_EPS, ROPE_BASE, ModelShape, RopeScaling

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
    eps = cfg.get("rms_norm_eps", NORM_EPS)
    if not _positive(eps) or eps >= 1:
        raise bad("rms_norm_eps", "a number in (0, 1)")
    # transformers 5 keeps the rotary settings in rope_parameters; 4 in rope_theta and rope_scaling
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    key = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    if not isinstance(rope, Mapping):
        raise bad(key, "a mapping of the rotary settings")
    theta = rope.get("rope_theta", cfg.get("rope_theta", ROPE_BASE))
    if not _positive(theta):
        raise bad("rope_theta", "a positive number (the rotary base)")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "llama3"):
        raise bad(key, f"rope_type \"default\" or \"llama3\", not {kind!r}: the rotary scalings the model has")
    scaling = None
    if kind == "llama3":
        fields = {f: rope.get(f) for f in ("factor", "low_freq_factor", "high_freq_factor",
                                            "original_max_position_embeddings")}
        if not all(_positive(v) for v in fields.values()) or fields["high_freq_factor"] <= fields["low_freq_factor"]:
            raise bad(key, "llama3 scaling with positive factor, low_freq_factor < high_freq_factor and "
                           "original_max_position_embeddings")
        fields["original_max_position_embeddings"] = int(fields["original_max_position_embeddings"])
        scaling = RopeScaling(**fields)
    tied = cfg.get("tie_word_embeddings", False)   # LlamaConfig's default
    if not isinstance(tied, bool):
        raise bad("tie_word_embeddings", "true or false")
    if seq_len is None:
        seq_len = cfg.get("max_position_embeddings")
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or not 1 <= seq_len <= MAX_MODEL_DIM:
            raise bad("max_position_embeddings", f"an integer in 1..{MAX_MODEL_DIM} (or give model.seq_len)")
    return ModelShape(seq_len=seq_len, kv_heads=None if kv == dims["heads"] else kv, norm_eps=float(eps),
                      rope_theta=float(theta), rope_scaling=scaling, tie_embeddings=tied, **dims)


def _positive(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def hf_config(shape: ModelShape) -> dict:
    """config.json for `shape` as `transformers.LlamaForCausalLM` reads it (fp32 weights)."""
    return {"architectures": [LLAMA_ARCHITECTURE], "model_type": "llama",
            "num_hidden_layers": shape.layers, "hidden_size": shape.hidden, "num_attention_heads": shape.heads,
            "num_key_value_heads": shape.n_kv_heads, "intermediate_size": shape.ffn, "vocab_size": shape.vocab,
            "head_dim": shape.head_dim, "max_position_embeddings": shape.seq_len, "hidden_act": "silu",
            "rms_norm_eps": shape.norm_eps, "rope_theta": shape.rope_theta, **_rope(shape),
            "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": shape.tie_embeddings,
            "torch_dtype": "float32", "dtype": "float32"}


def _rope(shape: ModelShape) -> dict:
    """The rotary settings as both `transformers` 4 (rope_scaling) and 5 (rope_parameters) read them."""
    params = {"rope_type": "default", "rope_theta": shape.rope_theta}
    if shape.rope_scaling is None:
        return {"rope_parameters": params}
    scaling = {"rope_type": "llama3", **asdict(shape.rope_scaling)}
    return {"rope_scaling": scaling, "rope_parameters": {**params, **scaling}}
