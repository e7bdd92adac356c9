"""The model's parts and the tensor table: every tensor's name, full shape and TP split dim.

Parts: EMBEDDING (token embedding), block i (RMSNorm, attention, RMSNorm, SwiGLU MLP) and HEAD
(final RMSNorm and the LM head; a tied head is a second copy of the embedding's matrix, kept
equal by summing the two gradients before either is updated, as Megatron's embedding group does:
runtime/gradient_sync.py). Inside a block, tensors are split Megatron-style: q/k/v by heads and
gate/up by ffn rows (column-parallel, dim 0), out and down by the matching input columns
(row-parallel, dim 1). The embedding and the head are split by vocabulary rows (Megatron's
vocab-parallel embedding and cross-entropy); norm weights are replicated.

The torch model builds its parameters from this table, the checkpoint lays out its files by it,
and migration and gradient reduction cut tensors by it.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Callable

from ..config.presets import ModelShape
from .shards import WHOLE, Span, rows_of, shard_of

Part = int | str
EMBEDDING = "embedding"
HEAD = "head"

_Row = tuple[str, "int | None", Callable[["ModelShape"], tuple[int, ...]]]  # (local name, split dim, full shape)
_EMBEDDING: tuple[_Row, ...] = (("embedding.weight", 0, lambda s: (s.vocab, s.hidden)),)     # rows by token
_BLOCK: tuple[_Row, ...] = (   # in initialisation order
    ("attn_norm.weight", None, lambda s: (s.hidden,)),
    ("attn.wq", 0, lambda s: (s.heads * s.head_dim, s.hidden)),      # rows by head
    ("attn.wk", 0, lambda s: (s.n_kv_heads * s.head_dim, s.hidden)),
    ("attn.wv", 0, lambda s: (s.n_kv_heads * s.head_dim, s.hidden)),
    ("attn.wo", 1, lambda s: (s.hidden, s.heads * s.head_dim)),      # columns by head
    ("mlp_norm.weight", None, lambda s: (s.hidden,)),
    ("mlp.w_gate", 0, lambda s: (s.ffn, s.hidden)),
    ("mlp.w_up", 0, lambda s: (s.ffn, s.hidden)),
    ("mlp.w_down", 1, lambda s: (s.hidden, s.ffn)),
)
_HEAD: tuple[_Row, ...] = (("final_norm.weight", None, lambda s: (s.hidden,)),
                           ("head.weight", 0, lambda s: (s.vocab, s.hidden)))            # rows by token

# The same tensors under Hugging Face LLaMA's names (`transformers.LlamaForCausalLM`'s state dict).
_HF_WHOLE = {"embedding.weight": "model.embed_tokens.weight", "final_norm.weight": "model.norm.weight",
             "head.weight": "lm_head.weight"}
_HF_BLOCK = {"attn_norm.weight": "input_layernorm.weight", "attn.wq": "self_attn.q_proj.weight",
             "attn.wk": "self_attn.k_proj.weight", "attn.wv": "self_attn.v_proj.weight",
             "attn.wo": "self_attn.o_proj.weight", "mlp_norm.weight": "post_attention_layernorm.weight",
             "mlp.w_gate": "mlp.gate_proj.weight", "mlp.w_up": "mlp.up_proj.weight", "mlp.w_down": "mlp.down_proj.weight"}


@dataclass(frozen=True)
class TensorSpec:
    """One full-model tensor. Rows run along `axis`: the split dim, or dim 0 if replicated."""

    name: str
    shape: tuple[int, ...]
    split_dim: int | None    # None: every TP rank holds all of it

    @property
    def axis(self) -> int:
        return 0 if self.split_dim is None else self.split_dim

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def row_numel(self) -> int:
        return self.numel // self.shape[self.axis]

    def rows(self, span: Span) -> tuple[int, int]:
        """Rows [start, end) along `axis` that a fraction of the tensor covers."""
        return rows_of(span, self.shape[self.axis])

    def held_rows(self, tp_rank: int, tp_size: int) -> tuple[int, int]:
        """Rows that TP rank `tp_rank` of a group of `tp_size` holds (all of them if replicated)."""
        return self.rows(WHOLE if self.split_dim is None else shard_of(tp_rank, tp_size))

    def shard_shape(self, tp_size: int, tp_rank: int = 0) -> tuple[int, ...]:
        """The shape TP rank `tp_rank` holds (rank 0 holds the fewest rows where the size does not divide)."""
        start, end = self.held_rows(tp_rank, tp_size)
        return tuple(end - start if k == self.axis else n for k, n in enumerate(self.shape))


def model_parts(layers: int) -> list[Part]:
    """Every part of a model of `layers` blocks, in the one order everything walks them."""
    return [EMBEDDING, *range(layers), HEAD]


def _rows_of_part(part: Part) -> tuple[str, tuple[_Row, ...]]:
    if part == EMBEDDING:
        return "", _EMBEDDING
    if part == HEAD:
        return "", _HEAD
    return f"blocks.{int(part)}.", _BLOCK


def part_tensors(shape: ModelShape, part: Part) -> tuple[TensorSpec, ...]:
    """The tensors of one part, in initialisation order."""
    if part not in (EMBEDDING, HEAD) and not (isinstance(part, int) and 0 <= part < shape.layers):
        raise ValueError(f"part {part!r} is not {EMBEDDING!r}, {HEAD!r} or a block in 0..{shape.layers - 1}")
    prefix, rows = _rows_of_part(part)
    return tuple(TensorSpec(prefix + local, full(shape), dim) for local, dim, full in rows)


def part_of(name: str) -> Part:
    """The part a full-model tensor name belongs to."""
    if name.startswith("blocks."):
        index = name.split(".")[1]
        if index.isascii() and index.isdigit():
            return int(index)
    for part in (EMBEDDING, HEAD):
        if any(name == local for local, _, _ in _rows_of_part(part)[1]):
            return part
    raise KeyError(f"{name!r} is not a tensor of this model")


def _row(name: str) -> _Row:
    prefix, rows = _rows_of_part(part_of(name))
    for row in rows:
        if prefix + row[0] == name:
            return row
    raise KeyError(f"{name!r} is not a tensor of this model")


def hf_name(name: str) -> str:
    """The Hugging Face LLaMA name of tensor `name` (``blocks.3.attn.wq`` -> ``model.layers.3.self_attn.q_proj.weight``)."""
    part = part_of(name)
    if isinstance(part, int):
        return f"model.layers.{part}.{_HF_BLOCK[name.split('.', 2)[2]]}"
    return _HF_WHOLE[name]


def split_dim(name: str) -> int | None:
    """The dim of tensor `name` split across a TP group, or None if every TP rank holds all of it."""
    return _row(name)[1]


TIED = ("embedding.weight", "head.weight")    # one weight when the shape ties them


def decayed(name: str, embedding: bool, tied: bool = False) -> bool:
    """Whether AdamW's weight decay applies to tensor `name`: never to a norm's gain (a scale, not a
    weight: as Megatron, nanoGPT and Hugging Face's Trainer do), to the embedding (and a head
    `tied` to it) only if `embedding`, to every other matrix always."""
    local = _row(name)[0]
    if local.endswith("norm.weight"):
        return False
    return embedding or local not in (TIED if tied else TIED[:1])


def tensor_spec(shape: ModelShape, name: str) -> TensorSpec:
    _, dim, full = _row(name)
    return TensorSpec(name, full(shape), dim)


def tp_divisibility_error(shape: ModelShape, tp: int) -> str | None:
    """Why a TP group of size `tp` cannot split this model (its blocks by whole heads and ffn rows;
    the vocabulary by rows whatever its size, `geometry.rows_of`, but one at least per rank), or
    None if it can."""
    if shape.vocab < tp:
        return f"TP size {tp} exceeds the vocabulary ({shape.vocab} rows): every rank holds one at least"
    dims = {"heads": shape.heads, "kv_heads": shape.n_kv_heads, "ffn": shape.ffn}
    bad = [f"{k}={v}" for k, v in dims.items() if v % tp]
    if not bad:
        return None
    ok = [d for d in range(1, shape.heads + 1) if all(v % d == 0 for v in dims.values())]
    return (f"TP size {tp} does not divide {', '.join(bad)}; sizes that divide "
            f"{', '.join(f'{k}={v}' for k, v in dims.items())}: {', '.join(map(str, ok))}")
