"""Causal self-attention over packed variable-length sequences, and rotary positions.

Sequences packed into one token row must never see each other: `cu_seqlens` marks the
boundaries. On CUDA in bf16/fp16 one varlen kernel call covers the whole micro-batch: flash-attn's
where it is installed, else torch's own (`torch.nn.attention.varlen`, the flash kernel built into
torch; a run without flash-attn says so once). Elsewhere (the CPU stand-in, or fp32/fp64 on CUDA)
torch's scaled_dot_product_attention takes the sequences as 4-D batches [B, H, L, d], so the cost
is the sum of the sequences' costs rather than that of one big masked square. On an accelerator
the sequences of one length form one batch (one call per length). On the CPU stand-in each
sequence is its own call: the length cost model it is measured against (lengths/cost.py) charges
a per-sequence term, which equal-length batching would turn into a per-length one.

What both paths need of the boundaries (flash-attn: them on the device and the longest length;
SDPA: the sequences grouped by length) is the same for every layer of a forward, so a `Packing`
is made once per micro-batch (`StageModel.forward`) and handed to each layer.
"""
from __future__ import annotations

import inspect
import logging
import math
from functools import cache, cached_property
from typing import Callable

import torch
import torch.nn.functional as F

from malleus_svc.config.presets import ROPE_BASE, RopeScaling

try:  # optional, GPU only
    from flash_attn import flash_attn_varlen_func as _flash_varlen
except Exception:  # noqa: BLE001 - any import failure means "not available"
    _flash_varlen = None

log = logging.getLogger(__name__)


def rotary_frequencies(head_dim: int, theta: float = ROPE_BASE, scaling: RopeScaling | None = None,
                       device: torch.device | None = None) -> torch.Tensor:
    """The rotary angle per position of each pair of channels [head_dim/2] (fp64), with Llama 3's
    scaling where given (as `transformers` computes it for rope_type "llama3")."""
    if head_dim % 2:
        raise ValueError(f"rotary positions need an even head_dim, got {head_dim}")
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)
    if scaling is None:
        return inv_freq
    context = scaling.original_max_position_embeddings
    wavelength = 2 * math.pi / inv_freq
    stretched = torch.where(wavelength > context / scaling.low_freq_factor, inv_freq / scaling.factor, inv_freq)
    smooth = (context / wavelength - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    between = (wavelength >= context / scaling.high_freq_factor) & (wavelength <= context / scaling.low_freq_factor)
    return torch.where(between, (1 - smooth) * stretched / scaling.factor + smooth * stretched, stretched)


def rotary_tables(positions: torch.Tensor, head_dim: int, device: torch.device | None = None,
                  theta: float = ROPE_BASE, scaling: RopeScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [T, head_dim/2] (fp64, cast where used) for per-token positions."""
    device = device or positions.device
    inv_freq = rotary_frequencies(head_dim, theta, scaling, device)
    angles = positions.to(device=device, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


class RotaryTables:
    """cos and sin of every position up to the longest sequence seen, made once per device and dtype
    and grown when a longer one comes: a micro-batch's tables are their rows at its positions (each
    token's place in its own sequence, so below the longest length). The same values as
    `rotary_tables` of those positions, cast: each row is computed alike, in fp64."""

    def __init__(self, head_dim: int, theta: float = ROPE_BASE, scaling: RopeScaling | None = None):
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        self._tables: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, positions: torch.Tensor, longest: int, device: torch.device, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        key = (torch.device(device), dtype)
        tables = self._tables.get(key)
        if tables is None or tables[0].shape[0] < longest:
            rows = 1 << max(longest - 1, 0).bit_length()       # powers of two: few rebuilds
            cos, sin = rotary_tables(torch.arange(rows, device=device), self.head_dim, device, self.theta,
                                     self.scaling)
            tables = self._tables[key] = (cos.to(dtype), sin.to(dtype))
        index = positions.to(device)
        return tables[0][index], tables[1][index]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + d/2) of every head of x [T, H, d] by the token's angles."""
    half = x.shape[-1] // 2
    wide = torch.promote_types(x.dtype, torch.float32)  # at least fp32, fp64 stays fp64
    x1, x2 = x[..., :half].to(wide), x[..., half:].to(wide)
    c, s = cos[:, None, :].to(wide), sin[:, None, :].to(wide)
    return torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).to(x.dtype)


class Packing:
    """The sequence boundaries of one packed token row, prepared once for all of a forward's layers.

    `cu_seqlens` (int [n+1], on the host as `MicroBatch` holds it) is read once here; what each
    attention path needs is built on first use, on `device`, and kept.
    """

    def __init__(self, cu_seqlens: torch.Tensor, device: torch.device | str, batch_equal_lengths: bool | None = None):
        self.bounds: list[int] = cu_seqlens.tolist()
        self.device = torch.device(device)
        self.batch_equal_lengths = self.device.type != "cpu" if batch_equal_lengths is None else batch_equal_lengths
        self.lengths = [b - a for a, b in zip(self.bounds, self.bounds[1:])]
        self.max_len = max(self.lengths, default=0)
        self.num_tokens = self.bounds[-1]
        # made here, outside any compiled block, for every layer to read: what this device's path needs
        self.kernel = attention_backend(self.device)
        if self.kernel == SDPA:
            self.by_length
        else:
            self.device_cu_seqlens

    @cached_property
    def device_cu_seqlens(self) -> torch.Tensor:
        """int32 [n+1] on the device, as the varlen kernels read it: one copy from pinned host memory
        that does not wait for the device."""
        host = torch.tensor(self.bounds, dtype=torch.int32)
        if self.device.type == "cuda":
            host = host.pin_memory()
        return host.to(self.device, non_blocking=True)

    @cached_property
    def by_length(self) -> tuple[list[tuple[int, torch.Tensor]], torch.Tensor | None]:
        """([(length L, token indices [B*L] of its B sequences, row-major)], and the permutation that
        puts the groups' concatenated outputs back in row order, None where they already are).
        Without `batch_equal_lengths` every sequence is a group of its own. Empty sequences have no
        tokens and no group."""
        starts: dict[tuple[int, int], list[int]] = {}
        for start, n in zip(self.bounds, self.lengths):
            if n:
                starts.setdefault((n, 0 if self.batch_equal_lengths else start), []).append(start)
        groups = [(n, (torch.tensor(s)[:, None] + torch.arange(n)).reshape(-1)) for (n, _), s in starts.items()]
        order = torch.cat([idx for _, idx in groups]) if groups else torch.zeros(0, dtype=torch.long)
        restore = None
        if not torch.equal(order, torch.arange(self.num_tokens)):
            restore = torch.empty_like(order)
            restore[order] = torch.arange(len(order))
            restore = restore.to(self.device)
        return [(n, idx.to(self.device)) for n, idx in groups], restore


def varlen_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packing: Packing) -> torch.Tensor:
    """Causal attention inside each packed sequence.

    q [T, Hq, d], k and v [T, Hkv, d] with Hq a multiple of Hkv (grouped-query attention: query
    head h reads key/value head h // (Hq / Hkv)). Returns [T, Hq, d].
    """
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads cannot share {k.shape[1]} key/value heads")
    if q.shape[0] != packing.num_tokens:
        raise ValueError(f"{q.shape[0]} tokens, but the packing covers {packing.num_tokens}")
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and packing.kernel != SDPA:
        cu = packing.device_cu_seqlens
        if _flash_varlen is not None:
            return _flash_varlen(q, k.to(q.dtype), v.to(q.dtype), cu, cu, packing.max_len, packing.max_len,
                                 causal=True)
        return _torch_varlen_causal(q, k.to(q.dtype), v.to(q.dtype), cu, packing.max_len)
    return sdpa_by_length(q, k, v, packing)


FLASH_ATTN, TORCH_VARLEN, SDPA = "flash-attn varlen", "torch varlen (flash)", "SDPA per sequence length"


@cache
def attention_backend(device: torch.device) -> str:
    """Which kernel packed bf16 attention runs on `device`, said once per process on CUDA when it is
    not flash-attn's."""
    global _TORCH_VARLEN
    if device.type != "cuda":
        return SDPA
    if _flash_varlen is None:
        _TORCH_VARLEN = _import_torch_varlen()
    backend = FLASH_ATTN if _flash_varlen is not None else TORCH_VARLEN if _TORCH_VARLEN is not None else SDPA
    if backend != FLASH_ATTN:
        log.warning("flash-attn is not installed: packed attention runs on %s (the `gpu` extra installs it)",
                    "torch's varlen flash kernel" if backend == TORCH_VARLEN else "one SDPA call per sequence length")
    return backend


# torch's varlen kernel with what makes it causal and whether it takes grouped key/value heads (its
# signature changed between torch releases), once `attention_backend` has chosen it on CUDA
_TORCH_VARLEN: tuple[Callable, dict, bool] | None = None


def _import_torch_varlen() -> tuple[Callable, dict, bool] | None:
    """torch's own varlen flash kernel (CUDA; torch >= 2.9), imported only on CUDA: importing it
    imports torch's compiler, which a CPU worker's start does without."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return None
    params = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    return varlen_attn, causal, "enable_gqa" in params


def _torch_varlen_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int
                         ) -> torch.Tensor:
    varlen, causal, takes_gqa = _TORCH_VARLEN
    # the flash kernel reads grouped key/value heads as they are; newer torch asks to be told so
    extra = {"enable_gqa": True} if q.shape[1] != k.shape[1] and takes_gqa else {}
    return varlen(q, k, v, cu, cu, max_len, max_len, **causal, **extra)


def sdpa_by_length(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packing: Packing) -> torch.Tensor:
    """The fallback: per length, its sequences as one batch [B, H, L, d] through torch's SDPA
    (4-D, so its fused kernels can take it; `enable_gqa` lets key/value heads serve their query
    groups without copies)."""
    groups, restore = packing.by_length
    gqa = q.shape[1] != k.shape[1]
    outs = []
    for n, idx in groups:
        # [B*L, H, d] -> [B, L, H, d] -> [B, H, L, d]
        qs, ks, vs = (t.index_select(0, idx).unflatten(0, (-1, n)).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=gqa)
        outs.append(out.transpose(1, 2).flatten(0, 1))
    out = torch.cat(outs) if outs else q.new_empty(q.shape)
    return out if restore is None else out.index_select(0, restore)
