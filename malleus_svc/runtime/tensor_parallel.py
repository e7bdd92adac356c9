"""Communication at the edges of a tensor-parallel (TP) region, as autograd functions: Megatron's
tensor parallelism with sequence parallelism.

Between the TP regions of a block (its norms, residuals and other elementwise work) each rank of a
group holds its own rows of the micro-batch's tokens (`geometry.sequence_rows`). A column-parallel
layer needs every row on every rank, so the region is entered by all-gathering the rows (its
backward reduce-scatters the ranks' partial input gradients: `gather_from_sequence`, or the fused
`model` linears that all-gather again in backward instead of keeping the whole input); a
row-parallel layer's partial outputs are summed and cut into rows by one reduce-scatter
(`reduce_scatter_to_sequence`, backward all-gather). Stage boundaries carry rows too: each rank
sends and receives its own (`transport`). A vocab-parallel head's logits leave the region whole
with `gather_from_region` (all-gather along the last dim). With one rank all are no-ops.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from malleus_svc.geometry import sequence_rows, shard_rows


@dataclass
class TensorParallel:
    """One device's place in its TP group, plus the time spent in TP collectives (which the
    device clock, when set, leaves out of the device's own compute)."""

    size: int = 1
    rank: int = 0
    group: "dist.ProcessGroup | None" = None
    comm_seconds: float = field(default=0.0, compare=False)
    clock: object = field(default=None, compare=False)     # a runtime.device_clock.DeviceClock
    # each TP rank's rank in `group` (whose ranks follow device ids, not a stage's device order)
    group_ranks: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"TP rank {self.rank} is outside a group of size {self.size}")
        if self.size > 1 and self.group is None:
            raise ValueError(f"a TP group of size {self.size} needs a process group")
        if self.group_ranks is None:
            self.group_ranks = tuple(range(self.size))
        if sorted(self.group_ranks) != list(range(self.size)):
            raise ValueError(f"group ranks {self.group_ranks} are not a permutation of a group of {self.size}")

    def all_reduce(self, x: torch.Tensor, op: "dist.ReduceOp" = dist.ReduceOp.SUM) -> torch.Tensor:
        out = x.contiguous().clone()
        with self._timed():
            dist.all_reduce(out, op=op, group=self.group)
        return out

    def all_gather(self, x: torch.Tensor, size: int) -> torch.Tensor:
        """Every rank's `x` side by side along the last dim, in TP rank order: all `size` columns,
        split as a tensor's rows are (`geometry.shard_rows`)."""
        return self.gather_sequence(x.movedim(-1, 0), size).movedim(0, -1).contiguous()

    def rows(self, tokens: int) -> tuple[int, int]:
        """This rank's rows [start, end) of a micro-batch of `tokens` tokens."""
        return sequence_rows(tokens, self.rank, self.size)

    def gather_sequence(self, own: torch.Tensor, tokens: int) -> torch.Tensor:
        """Every rank's rows, in TP rank order: the whole [tokens, ...] (the collective moves one
        equal slot per rank, in group rank order; shards a row short travel padded)."""
        return self.start_gather_sequence(own, tokens)()

    def start_gather_sequence(self, own: torch.Tensor, tokens: int) -> Callable[[], torch.Tensor]:
        """`gather_sequence` under way while the caller computes (Megatron's overlap of the
        backward's re-gather with the input gradient's GEMMs); calling the result waits for it."""
        width = -(-tokens // self.size)
        out = own.new_empty((self.size * width, *own.shape[1:]))
        if own.shape[0] < width:
            own = torch.cat([own, own.new_zeros((width - own.shape[0], *own.shape[1:]))])
        with self._timed():
            work = dist.all_gather_single(out, own.contiguous(), group=self.group, async_op=True)

        def whole() -> torch.Tensor:
            with self._timed():
                work.wait()
            if self._in_place(tokens):
                return out
            return torch.cat([out[g * width:g * width + e - s] for g, (s, e) in
                              zip(self.group_ranks, (sequence_rows(tokens, r, self.size) for r in range(self.size)))])
        return whole

    def reduce_scatter_sequence(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the sum over the group of `full` [tokens, ...]."""
        return self.start_reduce_scatter_sequence(full)()

    def start_reduce_scatter_sequence(self, full: torch.Tensor) -> Callable[[], torch.Tensor]:
        """`reduce_scatter_sequence` under way while the caller computes (the weights' gradients);
        calling the result waits for it."""
        tokens = full.shape[0]
        width = -(-tokens // self.size)
        if not self._in_place(tokens):
            slots = full.new_zeros((self.size, width, *full.shape[1:]))
            for r, g in enumerate(self.group_ranks):
                s, e = sequence_rows(tokens, r, self.size)
                slots[g, :e - s] = full[s:e]
            full = slots.view(self.size * width, *full.shape[1:])
        out = full.new_empty((width, *full.shape[1:]))
        with self._timed():
            work = dist.reduce_scatter_single(out, full.contiguous(), group=self.group, async_op=True)
        s, e = self.rows(tokens)

        def own() -> torch.Tensor:
            with self._timed():
                work.wait()
            return out[:e - s]
        return own

    def _in_place(self, tokens: int) -> bool:
        """Whether the rows of every rank are its slot as the collective lays them out."""
        return tokens % self.size == 0 and self.group_ranks == tuple(range(self.size))

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

    def gather_sequence(self, own: torch.Tensor, tokens: int) -> torch.Tensor:
        if not own.shape[0]:
            return own.new_zeros((tokens, *own.shape[1:]))
        return own.repeat(-(-tokens // own.shape[0]), *(1,) * (own.dim() - 1))[:tokens]   # real values, to time

    def reduce_scatter_sequence(self, full: torch.Tensor) -> torch.Tensor:
        s, e = self.rows(full.shape[0])
        return full[s:e].clone()

    def start_gather_sequence(self, own: torch.Tensor, tokens: int) -> Callable[[], torch.Tensor]:
        whole = self.gather_sequence(own, tokens)
        return lambda: whole

    def start_reduce_scatter_sequence(self, full: torch.Tensor) -> Callable[[], torch.Tensor]:
        rows = self.reduce_scatter_sequence(full)
        return lambda: rows


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TensorParallel, tokens: int) -> torch.Tensor:
        ctx.tp = tp
        return tp.gather_sequence(x, tokens)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.tp.reduce_scatter_sequence(grad), None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        ctx.tp, ctx.tokens = tp, x.shape[0]
        return tp.reduce_scatter_sequence(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.tp.gather_sequence(grad, ctx.tokens), None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TensorParallel, size: int) -> torch.Tensor:
        ctx.tp, ctx.size = tp, size
        return tp.all_gather(x, size)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        start, end = shard_rows(ctx.size, ctx.tp.rank, ctx.tp.size)
        return grad.narrow(-1, start, end - start), None, None


def gather_from_sequence(x: torch.Tensor, tp: TensorParallel, tokens: int) -> torch.Tensor:
    """Enter a column-parallel region: every rank's rows; backward sums the ranks' partial
    gradients and hands each rank its rows (reduce-scatter)."""
    return x if tp.size == 1 else _GatherFromSequence.apply(x, tp, tokens)


def reduce_scatter_to_sequence(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Leave a row-parallel region: the sum of the ranks' partial outputs, this rank's rows of it;
    backward all-gathers the rows' gradients."""
    return x if tp.size == 1 else _ReduceScatterToSequence.apply(x, tp)


def gather_from_region(x: torch.Tensor, tp: TensorParallel, size: int) -> torch.Tensor:
    """Leave a TP region whose ranks hold slices of the last dim (`size` in all): the whole forward,
    the rank's own slice of the gradient backward."""
    return x if tp.size == 1 else _GatherFromRegion.apply(x, tp, size)
