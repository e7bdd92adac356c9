"""Causal self-attention over packed variable-length sequences, and rotary positions.

Sequences packed into one token row must never see each other: `cu_seqlens` marks the
boundaries. On CUDA with flash-attn installed, its varlen kernel does exactly this. Elsewhere
each sequence is attended on its own with torch's scaled_dot_product_attention, so the cost is
the sum of the sequences' costs rather than that of one big masked square.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from malleus_svc.config.presets import ROPE_BASE

try:  # optional, GPU only
    from flash_attn import flash_attn_varlen_func as _flash_varlen
except Exception:  # noqa: BLE001 - any import failure means "not available"
    _flash_varlen = None



def rotary_tables(positions: torch.Tensor, head_dim: int, device: torch.device | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [T, head_dim/2] (fp64, cast where used) for per-token positions."""
    if head_dim % 2:
        raise ValueError(f"rotary positions need an even head_dim, got {head_dim}")
    device = device or positions.device
    inv_freq = ROPE_BASE ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)
    angles = positions.to(device=device, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + d/2) of every head of x [T, H, d] by the token's angles."""
    half = x.shape[-1] // 2
    wide = torch.promote_types(x.dtype, torch.float32)  # at least fp32, fp64 stays fp64
    x1, x2 = x[..., :half].to(wide), x[..., half:].to(wide)
    c, s = cos[:, None, :].to(wide), sin[:, None, :].to(wide)
    return torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).to(x.dtype)


def varlen_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Causal attention inside each packed sequence.

    q [T, Hq, d], k and v [T, Hkv, d] with Hq a multiple of Hkv (grouped-query attention);
    cu_seqlens int [n+1]. Returns [T, Hq, d].
    """
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads cannot share {k.shape[1]} key/value heads")
    if _flash_varlen is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
        max_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        return _flash_varlen(q, k.to(q.dtype), v.to(q.dtype), cu, cu, max_len, max_len, causal=True)
    return _per_sequence_sdpa(q, k, v, cu_seqlens)


def _per_sequence_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       cu_seqlens: torch.Tensor) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    if group > 1:  # give every query head its key/value head
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    bounds = cu_seqlens.tolist()
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        # [L, H, d] -> [H, L, d]: sdpa treats leading dims as batch
        qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1))
    return torch.cat(outs, dim=0)
