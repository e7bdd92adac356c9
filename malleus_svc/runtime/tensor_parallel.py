"""Communication at the edges of a tensor-parallel (TP) region, as autograd functions.

A column-parallel layer needs its (replicated) input on every TP rank and produces a partial
gradient for it on each; a row-parallel layer produces partial outputs that must be summed.
So the region is entered with `copy_to_region` (forward identity, backward all-reduce) and left
with `reduce_from_region` (forward all-reduce, backward identity); a vocab-parallel head's logits
leave it whole with `gather_from_region` (forward all-gather along the last dim, backward the
rank's own slice). With one rank all three are no-ops.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class TensorParallel:
    """One device's place in its TP group, plus the time spent in TP collectives (which the
    device clock, when set, leaves out of the device's own compute)."""

    size: int = 1
    rank: int = 0
    group: "dist.ProcessGroup | None" = None
    comm_seconds: float = field(default=0.0, compare=False)
    clock: object = field(default=None, compare=False)     # a runtime.device_clock.DeviceClock

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"TP rank {self.rank} is outside a group of size {self.size}")
        if self.size > 1 and self.group is None:
            raise ValueError(f"a TP group of size {self.size} needs a process group")

    def all_reduce(self, x: torch.Tensor, op: "dist.ReduceOp" = dist.ReduceOp.SUM) -> torch.Tensor:
        out = x.contiguous().clone()
        with self._timed():
            dist.all_reduce(out, op=op, group=self.group)
        return out

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` side by side along the last dim, in rank order."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        with self._timed():
            dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    @contextlib.contextmanager
    def _timed(self):
        start = time.perf_counter()
        with self.clock.collective() if self.clock is not None else contextlib.nullcontext():
            yield
        self.comm_seconds += time.perf_counter() - start


SINGLE = TensorParallel()


class LocalShard(TensorParallel):
    """One rank's shard of a TP group of `size`, held alone, without a process group: an all-reduce
    returns the buffer it would fill. For what measures a rank's own share (memory on the meta
    device, a shard's compute time, initialisation), never for training."""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"TP rank {self.rank} is outside a group of size {self.size}")

    def all_reduce(self, x: torch.Tensor, op: "dist.ReduceOp" = dist.ReduceOp.SUM) -> torch.Tensor:
        return x.contiguous().clone()

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x] * self.size, dim=-1)


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.tp.all_reduce(grad), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        return tp.all_reduce(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        ctx.tp, ctx.width = tp, x.shape[-1]
        return tp.all_gather(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.narrow(-1, ctx.tp.rank * ctx.width, ctx.width), None


def copy_to_region(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Enter a TP region: identity forward, sum of the ranks' input gradients backward."""
    return x if tp.size == 1 else _CopyToRegion.apply(x, tp)


def reduce_from_region(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Leave a TP region: sum of the ranks' partial outputs forward, identity backward."""
    return x if tp.size == 1 else _ReduceFromRegion.apply(x, tp)


def gather_from_region(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Leave a TP region whose ranks hold slices of the last dim: the whole forward, the rank's own
    slice of the gradient backward."""
    return x if tp.size == 1 else _GatherFromRegion.apply(x, tp)
