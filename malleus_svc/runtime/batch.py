"""A micro-batch as the runtime passes it around: sequences packed into one token row.

Packing keeps padding out of the compute: `cu_seqlens` marks where each sequence starts, so
attention never crosses a boundary and rotary positions restart at 0 for every sequence.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE_INDEX = -100


@dataclass
class MicroBatch:
    tokens: torch.Tensor       # int64 [T]: the packed input tokens
    targets: torch.Tensor      # int64 [T]: next-token targets, IGNORE_INDEX where no loss is taken
    cu_seqlens: torch.Tensor   # int32 [n+1]: cumulative sequence boundaries, cu_seqlens[0] = 0, cu_seqlens[-1] = T
    sample_ids: tuple[int, ...]  # global sample indices packed here, in order

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    @property
    def num_loss_tokens(self) -> int:
        return int((self.targets != IGNORE_INDEX).sum())

    def positions(self) -> torch.Tensor:
        """Position of each token inside its own sequence (restarts at 0 at every boundary)."""
        lengths = self.cu_seqlens[1:] - self.cu_seqlens[:-1]
        starts = torch.repeat_interleave(self.cu_seqlens[:-1], lengths)
        return torch.arange(self.num_tokens, dtype=torch.int64) - starts.to(torch.int64)

    def __post_init__(self) -> None:
        t = self.tokens.numel()
        if self.targets.shape != self.tokens.shape:
            raise ValueError(f"targets shape {tuple(self.targets.shape)} != tokens shape {tuple(self.tokens.shape)}")
        if self.cu_seqlens.numel() < 2 or int(self.cu_seqlens[0]) != 0 or int(self.cu_seqlens[-1]) != t:
            raise ValueError(f"cu_seqlens must start at 0 and end at the token count {t}, got {self.cu_seqlens.tolist()}")
