"""The LLaMA-style decoder, cut into parts that any stage can build on its own.

Parts: "embedding" (token embedding), block i (RMSNorm, attention with rotary positions, RMSNorm,
SwiGLU MLP, both with residuals), "head" (final RMSNorm and the untied LM head).

Every tensor has a stable full-model name (``blocks.3.attn.wq``, ``embedding.weight``, ...) and
is initialised from a generator seeded by (seed, part) alone, so a stage builds exactly the
blocks it holds, identical to what any other plan (or the single-process reference) would build.

Inside a block, tensors are split Megatron-style over a TP group of size t: q/k/v by heads and
gate/up by ffn rows (column-parallel), out and down by the matching input columns
(row-parallel, summed by an all-reduce); the two norm weights are replicated.
"""
from __future__ import annotations

import hashlib
import math
from typing import Iterable, Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from malleus_svc.config.presets import ModelShape
from malleus_svc.plan import EMBEDDING, HEAD
from malleus_svc.runtime.attention import apply_rotary, rotary_tables, varlen_causal_attention
from malleus_svc.runtime.tensor_parallel import SINGLE, TensorParallel, copy_to_region, reduce_from_region

Part = int | str
INIT_STD = 0.02
NORM_EPS = 1e-5

# Local tensor name inside a block -> the dim split across TP ranks (None: replicated).
_BLOCK_SHARD_DIMS: dict[str, int | None] = {
    "attn_norm.weight": None,
    "attn.wq": 0, "attn.wk": 0, "attn.wv": 0,   # [heads * head_dim, hidden]: rows by head
    "attn.wo": 1,                                 # [hidden, heads * head_dim]: columns by head
    "mlp_norm.weight": None,
    "mlp.w_gate": 0, "mlp.w_up": 0,               # [ffn, hidden]
    "mlp.w_down": 1,                              # [hidden, ffn]
}
_BLOCK_NAMES = tuple(_BLOCK_SHARD_DIMS)


# ---------------------------------------------------------------------------- names and parts
def part_tensor_names(part: Part) -> tuple[str, ...]:
    """Full-model names of the tensors of one part, in initialisation order."""
    if part == EMBEDDING:
        return ("embedding.weight",)
    if part == HEAD:
        return ("final_norm.weight", "head.weight")
    return tuple(f"blocks.{int(part)}.{n}" for n in _BLOCK_NAMES)


def part_of(name: str) -> Part:
    """The part a full-model tensor name belongs to."""
    if name.startswith("blocks."):
        return int(name.split(".")[1])
    if name == "embedding.weight":
        return EMBEDDING
    if name in ("final_norm.weight", "head.weight"):
        return HEAD
    raise KeyError(f"{name!r} is not a tensor of this model")


def model_parts(shape: ModelShape) -> list[Part]:
    return [EMBEDDING, *range(shape.layers), HEAD]


def shard_spec(name: str) -> int | None:
    """The dim of tensor `name` split across a TP group, or None if every TP rank holds all of it."""
    if name.startswith("blocks."):
        local = name.split(".", 2)[2]
        if local in _BLOCK_SHARD_DIMS:
            return _BLOCK_SHARD_DIMS[local]
    elif name in ("embedding.weight", "final_norm.weight", "head.weight"):
        return None
    raise KeyError(f"{name!r} is not a tensor of this model")


def full_shape_of(shape: ModelShape, name: str) -> tuple[int, ...]:
    h, kv, ffn = shape.hidden, shape.n_kv_heads * shape.head_dim, shape.ffn
    local = name.split(".", 2)[2] if name.startswith("blocks.") else name
    return {
        "embedding.weight": (shape.vocab, h), "head.weight": (shape.vocab, h),
        "final_norm.weight": (h,), "attn_norm.weight": (h,), "mlp_norm.weight": (h,),
        "attn.wq": (shape.heads * shape.head_dim, h), "attn.wk": (kv, h), "attn.wv": (kv, h),
        "attn.wo": (h, shape.heads * shape.head_dim),
        "mlp.w_gate": (ffn, h), "mlp.w_up": (ffn, h), "mlp.w_down": (h, ffn),
    }[local]


def shard_range(full_size: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """Rows [start, end) of a dim of `full_size` that TP rank `tp_rank` of `tp_size` holds."""
    step = full_size // tp_size
    return tp_rank * step, (tp_rank + 1) * step


def take_shard(name: str, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    dim = shard_spec(name)
    if dim is None or tp_size == 1:
        return full
    start, end = shard_range(full.shape[dim], tp_rank, tp_size)
    return full.narrow(dim, start, end - start)


def tp_divisibility_error(shape: ModelShape, tp: int) -> str | None:
    """Why a TP size cannot shard this model's blocks, or None if it can."""
    dims = {"heads": shape.heads, "kv_heads": shape.n_kv_heads, "ffn": shape.ffn}
    bad = [f"{k}={v}" for k, v in dims.items() if v % tp]
    if not bad:
        return None
    ok = [d for d in range(1, shape.heads + 1) if all(v % d == 0 for v in dims.values())]
    return (f"TP size {tp} does not divide {', '.join(bad)}; sizes that divide heads={shape.heads}, "
            f"kv_heads={shape.n_kv_heads} and ffn={shape.ffn}: {', '.join(map(str, ok))}")


# ---------------------------------------------------------------------------- initialisation
def _part_generator(seed: int, part: Part) -> torch.Generator:
    digest = hashlib.sha256(f"malleus-init/{seed}/{part}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def init_part(shape: ModelShape, part: Part, seed: int) -> dict[str, torch.Tensor]:
    """Full (unsharded) fp32 tensors of one part, a pure function of (shape, part, seed)."""
    if part not in (EMBEDDING, HEAD) and not 0 <= int(part) < shape.layers:
        raise ValueError(f"part {part!r} is not 'embedding', 'head' or a block in 0..{shape.layers - 1}")
    gen = _part_generator(seed, part)
    # Residual-branch outputs get a smaller scale so the residual stream does not grow with depth.
    out_std = INIT_STD / math.sqrt(2 * shape.layers)
    out: dict[str, torch.Tensor] = {}
    for name in part_tensor_names(part):
        size = full_shape_of(shape, name)
        if name.endswith("norm.weight"):
            out[name] = torch.ones(size)
        else:
            std = out_std if name.endswith(("attn.wo", "mlp.w_down")) else INIT_STD
            out[name] = torch.randn(size, generator=gen) * std
    return out


# ---------------------------------------------------------------------------- modules
class RMSNorm(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.promote_types(x.dtype, torch.float32))  # statistics in at least fp32
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + NORM_EPS) * self.weight).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, shape: ModelShape, tp: TensorParallel):
        super().__init__()
        self.tp, self.head_dim = tp, shape.head_dim
        q_rows, kv_rows = shape.heads * shape.head_dim // tp.size, shape.n_kv_heads * shape.head_dim // tp.size
        self.wq = nn.Parameter(torch.empty(q_rows, shape.hidden))
        self.wk = nn.Parameter(torch.empty(kv_rows, shape.hidden))
        self.wv = nn.Parameter(torch.empty(kv_rows, shape.hidden))
        self.wo = nn.Parameter(torch.empty(shape.hidden, q_rows))

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                cu_seqlens: torch.Tensor) -> torch.Tensor:
        tokens, d = x.shape[0], self.head_dim
        x = copy_to_region(x, self.tp)
        q = F.linear(x, self.wq).view(tokens, -1, d)
        k = F.linear(x, self.wk).view(tokens, -1, d)
        v = F.linear(x, self.wv).view(tokens, -1, d)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        o = varlen_causal_attention(q, k, v, cu_seqlens).reshape(tokens, -1)
        return reduce_from_region(F.linear(o, self.wo), self.tp)


class SwiGLU(nn.Module):
    def __init__(self, shape: ModelShape, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        rows = shape.ffn // tp.size
        self.w_gate = nn.Parameter(torch.empty(rows, shape.hidden))
        self.w_up = nn.Parameter(torch.empty(rows, shape.hidden))
        self.w_down = nn.Parameter(torch.empty(shape.hidden, rows))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_region(x, self.tp)
        hidden = F.silu(F.linear(x, self.w_gate)) * F.linear(x, self.w_up)
        return reduce_from_region(F.linear(hidden, self.w_down), self.tp)


class Block(nn.Module):
    def __init__(self, shape: ModelShape, tp: TensorParallel):
        super().__init__()
        self.attn_norm = RMSNorm(shape.hidden)
        self.attn = Attention(shape, tp)
        self.mlp_norm = RMSNorm(shape.hidden)
        self.mlp = SwiGLU(shape, tp)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                cu_seqlens: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope, cu_seqlens)
        return x + self.mlp(self.mlp_norm(x))


class Embedding(nn.Module):
    def __init__(self, shape: ModelShape):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape.vocab, shape.hidden))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.weight)


class LMHead(nn.Module):
    def __init__(self, shape: ModelShape):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape.vocab, shape.hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class StageModel(nn.Module):
    """The parts one device holds: optionally the embedding, blocks [start, end), optionally the head.

    `named_parameters()` yields full-model names (``blocks.3.attn.wq``), holding this TP rank's shard.
    """

    def __init__(self, shape: ModelShape, layers: tuple[int, int], *, has_embedding: bool,
                 has_head: bool, tp: TensorParallel = SINGLE):
        super().__init__()
        err = tp_divisibility_error(shape, tp.size)
        if err:
            raise ValueError(err)
        self.shape, self.tp, self.layers = shape, tp, layers
        self.embedding = Embedding(shape) if has_embedding else None
        self.blocks = nn.ModuleDict({str(i): Block(shape, tp) for i in range(*layers)})
        self.final_norm = RMSNorm(shape.hidden) if has_head else None
        self.head = LMHead(shape) if has_head else None

    @property
    def parts(self) -> list[Part]:
        return ([EMBEDDING] if self.embedding is not None else []) + list(range(*self.layers)) + \
               ([HEAD] if self.head is not None else [])

    def load_full(self, full: Mapping[str, torch.Tensor]) -> None:
        """Copy this TP rank's shard of every held tensor out of full (unsharded) tensors."""
        for name, param in self.named_parameters():
            shard = take_shard(name, full[name], self.tp.rank, self.tp.size)
            if shard.shape != param.shape:
                raise ValueError(f"{name}: shard shape {tuple(shard.shape)} != parameter shape {tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(shard)

    def init_from_seed(self, seed: int) -> None:
        full: dict[str, torch.Tensor] = {}
        for part in self.parts:
            full.update(init_part(self.shape, part, seed))
        self.load_full(full)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """Tokens [T] (first stage) or hidden states [T, hidden] -> hidden states, or logits (last stage)."""
        if self.embedding is not None:
            x = self.embedding(x)
        rope = rotary_tables(positions, self.shape.head_dim, device=x.device)
        for block in self.blocks.values():
            x = block(x, rope, cu_seqlens)
        if self.head is not None:
            x = self.head(self.final_norm(x))
        return x


def full_model(shape: ModelShape, seed: int, dtype: torch.dtype = torch.float32) -> StageModel:
    """The whole model on one device (TP size 1), as the reference uses it."""
    model = StageModel(shape, (0, shape.layers), has_embedding=True, has_head=True)
    model.init_from_seed(seed)
    return model.to(dtype)


def tensor_names(parts: Iterable[Part]) -> list[str]:
    return [n for p in parts for n in part_tensor_names(p)]
