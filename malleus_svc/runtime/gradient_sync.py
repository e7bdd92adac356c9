"""Gradient reduction over the plan's pieces: each piece of every tensor summed once over the
pipelines that hold it (groups.py), and the global norm with each unique element counted once."""
from __future__ import annotations

from typing import Callable, Iterator, Mapping

import torch
import torch.distributed as dist

from malleus_svc.config.presets import ModelShape
from malleus_svc.geometry import TIED, part_tensors
from malleus_svc.runtime.groups import Groups, Piece, ordered_group_ranks, tied_piece, world_rank
from malleus_svc.runtime.optimizer import AdamW, update_bytes

Item = tuple[str, "int | None", int, int]   # a tensor's name, its split dim, and rows [lo, hi) of it there
Moments = tuple[torch.Tensor, torch.Tensor, int]   # a tensor's exp_avg, exp_avg_sq and Adam step


# A reduction's flat copy is bounded by this (DDP's default bucket): the gradients are never copied whole.
GRAD_BUCKET_BYTES = 25 << 20


def _buckets(views: list[torch.Tensor], cap: int) -> Iterator[list[torch.Tensor]]:
    """Consecutive runs of `views` of at most `cap` bytes each (a larger view is a run of its own)."""
    run: list[torch.Tensor] = []
    size = 0
    for v in views:
        n = v.numel() * v.element_size()
        if run and size + n > cap:
            yield run
            run, size = [], 0
        run.append(v)
        size += n
    if run:
        yield run


class GradientSync:
    """Sums each gradient piece over the pipelines holding it, measures the global norm, and runs
    the device's optimizer on the result (replicated: every holder updates the whole piece; see
    distributed_optimizer.py for the sharded kind).

    Sharded pieces: flattened into buckets per group (same order on every member, since every
    member walks the same pieces in plan order) and all-reduced among one holder per pipeline.
    Replicated tensors: all-reduced among the TP-rank-0 holders, then broadcast in the TP group.
    A tied embedding and head: one contribution per device (the sum of the copies it holds),
    all-reduced among the TP-rank-0 holders of either, so every copy gets the weight's whole
    gradient, counted once in the norm.
    """

    def __init__(self, groups: Groups, params: Mapping[str, torch.nn.Parameter], shape: ModelShape,
                 optimizer: AdamW, bucket_bytes: int = GRAD_BUCKET_BYTES):
        self.groups, self.rank, self.bucket_bytes, self.optimizer = groups, groups.rank, bucket_bytes, optimizer
        r, t = groups.tp.rank, groups.tp.size
        self.buckets: dict[tuple[int, ...], list[Item]] = {}
        self.norm_items: list[Item] = []
        self.broadcast_items: list[Item] = []
        sharded, replicated = groups.local_pieces()
        tied = tied_piece(groups.plan) if groups.tied else None
        self.tied_names = [n for n in TIED if n in params] if tied else []   # the copies this device holds

        def add(piece: Piece, item) -> None:
            if len(set(piece.members)) > 1:
                self.buckets.setdefault(tuple(sorted(piece.members)), []).append(item)
            if piece.members[0] == self.rank:
                self.norm_items.append(item)

        for piece in sharded:
            for spec in part_tensors(shape, piece.part):
                if spec.split_dim is None:
                    continue
                offset = spec.held_rows(r, t)[0]
                lo, hi = spec.rows((piece.start, piece.end))
                add(piece, (spec.name, spec.split_dim, lo - offset, hi - offset))
        for piece in replicated:
            for spec in part_tensors(shape, piece.part):
                if spec.split_dim is not None or spec.name in self.tied_names:
                    continue
                self._add_replicated(piece, (spec.name, None, 0, 0), add, t)
        if self.tied_names:
            self._add_replicated(tied, (self.tied_names[0], None, 0, 0), add, t)
        self.order = [k for k in ordered_group_ranks(groups.plan, groups.tied) if k in self.buckets]
        self.params = params

    def _add_replicated(self, piece: Piece, item, add, tp_size: int) -> None:
        if self.rank in piece.members:
            add(piece, item)
        if tp_size > 1 and len(piece.members) > 1:
            self.broadcast_items.append(item)

    def _view(self, item: Item, grad: bool = True) -> torch.Tensor:
        """The item's rows of its parameter's gradient (or, not `grad`, of the parameter itself)."""
        p = self.params[item[0]]
        return narrow(p.grad if grad else p.detach(), item)

    def _collective(self, items, op: Callable[[torch.Tensor], None], grad: bool = True) -> None:
        """`op` on the items' gradient (or parameter) views, a bucket of at most `bucket_bytes` at a
        time: one flat copy per bucket (a view that is contiguous and alone in its bucket in place)."""
        for views in _buckets([self._view(it, grad) for it in items], self.bucket_bytes):
            if len(views) == 1 and views[0].is_contiguous():
                op(views[0])
                continue
            flat = torch.cat([v.reshape(-1) for v in views])
            op(flat)
            offset = 0
            for v in views:
                n = v.numel()
                v.copy_(flat[offset:offset + n].view_as(v))
                offset += n

    def reduce(self) -> None:
        both = [self.params[n].grad for n in self.tied_names] if len(self.tied_names) == 2 else None
        if both:               # this device's one contribution to the tied weight
            both[0].add_(both[1])
        for key in self.order:  # one global order on every rank: no cycle of waiting groups
            group = self.groups.group(key)
            self._collective(self.buckets[key], lambda f: dist.all_reduce(f, group=group))
        if self.broadcast_items:
            tp_group, src = self.groups.tp.group, world_rank(self.groups.stage_devices[0])
            self._collective(self.broadcast_items, lambda f: dist.broadcast(f, src=src, group=tp_group))
        if both:
            both[1].copy_(both[0])

    def local_square_norm(self) -> torch.Tensor:
        """Sum of squares of the pieces this device counts (each unique element exactly once), in fp64
        on the device: one fused norm over all pieces, nothing read by the host."""
        views = [self._view(item) for item in self.norm_items]
        if not views:
            return torch.zeros((), dtype=torch.float64, device=next(iter(self.params.values())).device)
        return torch.stack(torch._foreach_norm(views, 2, dtype=torch.float64)).square().sum()

    def grads(self) -> list[torch.Tensor]:
        """The gradients the update reads (clipping scales them)."""
        return [p.grad for p in self.params.values()]

    def update_bytes(self) -> float:
        return update_bytes(self.params.values())

    def step(self, lr: float | None) -> None:
        """The update of what this device holds, on its own (the clock times it as the device's)."""
        self.optimizer.step(lr)

    def publish(self) -> None:
        """What the update must send to other devices: nothing, every holder updated its copy."""

    def moments(self) -> dict[str, Moments]:
        """Every parameter's Adam moments and step (zeros and 0 before its first update)."""
        out = {}
        for name, p in self.params.items():
            st = self.optimizer.state.get(p)
            out[name] = ((st["exp_avg"], st["exp_avg_sq"], int(st["step"])) if st
                         else (torch.zeros_like(p), torch.zeros_like(p), 0))
        return out

    def load_moments(self, moments: Mapping[str, Moments]) -> None:
        """Set the moments `moments()` gives (each like its parameter): step 0 drops the state."""
        for name, (exp_avg, exp_avg_sq, step) in moments.items():
            p = self.params[name]
            if step > 0:
                self.optimizer.state[p] = {"step": torch.tensor(float(step)),
                                           "exp_avg": exp_avg.to(device=p.device, dtype=p.dtype).clone(),
                                           "exp_avg_sq": exp_avg_sq.to(device=p.device, dtype=p.dtype).clone()}
            else:
                self.optimizer.state.pop(p, None)


def narrow(t: torch.Tensor, item: Item) -> torch.Tensor:
    """The rows of `t` (a device's shard of the item's tensor) that the item covers."""
    _, dim, lo, hi = item
    return t if dim is None else t.narrow(dim, lo, hi - lo)
