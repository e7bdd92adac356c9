"""Gradient reduction over the plan's pieces: each piece of every tensor summed once over the
pipelines that hold it (groups.py), and the global norm with each unique element counted once."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Mapping

import torch
import torch.distributed as dist

from malleus_svc.config.presets import ModelShape
from malleus_svc.geometry import TIED, Part, TensorSpec, model_parts, part_of, part_tensors, tensor_spec
from malleus_svc.plan import Plan
from malleus_svc.runtime.groups import Groups, Piece, PlanPieces
from malleus_svc.runtime.optimizer import AdamW, update_bytes

Item = tuple[str, "int | None", int, int]   # a tensor's name, its split dim, and rows [lo, hi) of it there
TensorState = tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]   # a parameter, its exp_avg, exp_avg_sq, Adam step


# A reduction's flat copy is bounded by this (DDP's default bucket): the gradients are never copied whole.
GRAD_BUCKET_BYTES = 25 << 20


def item_runs(nbytes: list[int], cap: int) -> Iterator[tuple[int, int]]:
    """[start, end) of consecutive items of at most `cap` bytes together (a larger item is a run of its
    own): how a group's items are cut into buckets."""
    start, size = 0, 0
    for i, n in enumerate(nbytes):
        if i > start and size + n > cap:
            yield start, i
            start, size = i, 0
        size += n
    if start < len(nbytes):
        yield start, len(nbytes)


@dataclass(frozen=True)
class ReductionLayout:
    """What one device reduces under a plan, derived from the plan alone (so every device, and a
    migration's schedule, can tell what any other device does): its items per group of holders,
    in the order backward finishes them (latest part first), the items it counts in the global
    norm, and the copies of a tied weight it holds."""
    buckets: dict[tuple[int, ...], list[Item]]
    norm_items: list[Item]
    tied_names: list[str]
    offsets: dict[str, int]       # the first row (along the tensor's axis) of this device's shard
    held: list[str]               # the tensors of the parts this device holds, in model order

    @property
    def unshared(self) -> list[str]:
        """The tensors no bucket reduces (a piece only this device holds): updated whole where they
        lie. A tied weight once: its second copy follows the first."""
        bucketed = {it[0] for items in self.buckets.values() for it in items}
        if self.tied_names and self.tied_names[0] in bucketed:
            bucketed |= set(self.tied_names)
        return [n for n in self.held if n not in bucketed and n not in self.tied_names[1:]]

    @classmethod
    def of(cls, plan: Plan, rank: int, shape: ModelShape, pieces: PlanPieces | None = None) -> "ReductionLayout":
        """`pieces`: the plan's, when several devices' layouts are wanted (computed once)."""
        tied = shape.tie_embeddings
        pieces = pieces or PlanPieces(plan, tied)
        role = pieces.roles[rank]
        r, t = role.tp_rank, plan.pipelines[role.pipeline].stages[role.stage].tp
        held = [spec.name for part in pieces.parts(rank) for spec in part_tensors(shape, part)]
        tied_names = [n for n in TIED if n in held] if tied else []
        buckets: dict[tuple[int, ...], list[Item]] = {}
        norm_items: list[Item] = []
        offsets: dict[str, int] = {}
        sharded, replicated = pieces.local(rank)

        def add(piece: Piece, item: Item) -> None:
            if len(set(piece.members)) > 1:
                buckets.setdefault(tuple(sorted(piece.members)), []).append(item)
            if piece.members[0] == rank:
                norm_items.append(item)

        def add_rows(piece: Piece, spec: TensorSpec) -> None:
            offset = offsets[spec.name] = spec.held_rows(r, t)[0]
            lo, hi = spec.rows((piece.start, piece.end))
            add(piece, (spec.name, spec.split_dim, lo - offset, hi - offset))

        for piece in sharded:
            for spec in part_tensors(shape, piece.part):
                if spec.split_dim is not None:
                    add_rows(piece, spec)
        for piece in pieces.local_tied(rank):      # as the first copy this device holds
            add_rows(piece, tensor_spec(shape, tied_names[0]))
        for piece in replicated:
            for spec in part_tensors(shape, piece.part):
                if spec.split_dim is None:
                    add(piece, (spec.name, None, 0, 0))
        order = {part: i for i, part in enumerate(model_parts(shape.layers))}
        for items in buckets.values():    # in the order backward finishes them, latest part first
            items.sort(key=lambda it: -item_position(it, tied_names, order))
        return cls(buckets, norm_items, tied_names, offsets, held)


def item_position(item: Item, tied_names: list[str], order: Mapping[Part, int]) -> int:
    """The item's part in model order. A tied weight's copies are the embedding on some members and
    the head on others: placed as the embedding, the same on every member."""
    return 0 if item[0] in tied_names else order[part_of(item[0])]


def item_numel(shape: ModelShape, item: Item) -> int:
    spec = tensor_spec(shape, item[0])
    return spec.numel if item[1] is None else (item[3] - item[2]) * spec.row_numel


@dataclass
class Bucket:
    """Consecutive items of one group, reduced as one flat tensor: launched once every gradient it
    reads is final, waited for before the update."""
    key: tuple[int, ...]
    index: int                    # its place among the group's buckets
    group: "dist.ProcessGroup"
    items: list[Item]
    sizes: list[int]
    names: frozenset[str]         # the parameters whose gradients it reads
    position: int                 # the last part it covers in model order (backward finishes those first)
    work: "dist.Work | None" = None
    flat: torch.Tensor | None = None


class GradientSync:
    """Sums each gradient piece over the pipelines holding it, measures the global norm, and runs
    the device's optimizer on the result (replicated: every holder updates the whole piece; see
    distributed_optimizer.py for the sharded kind).

    Sharded pieces: flattened into buckets per group (same buckets on every member, since every
    member walks the same pieces in plan order) and all-reduced among one holder per pipeline.
    Replicated tensors (norm weights): all-reduced among every device of every holding stage (under
    sequence parallelism each TP rank's gradient is its rows' share).
    A tied embedding and head: one contribution per device (the sum of the copies it holds, which
    are the same rows), reduced piece by piece among the holders of either, so every copy gets the
    weight's whole gradient, counted once in the norm.

    Overlap: `arm()` before the step's last backward, and each bucket is launched (asynchronously)
    from a gradient hook as soon as the gradients it reads are final, while backward goes on;
    `reduce()` launches what is left and waits once. Buckets launch in one global order, latest
    part first (the order backward finishes them), so no two devices launch shared ones in
    different orders.
    """

    def __init__(self, groups: Groups, params: Mapping[str, torch.nn.Parameter], shape: ModelShape,
                 optimizer: AdamW, bucket_bytes: int = GRAD_BUCKET_BYTES):
        self.groups, self.rank, self.bucket_bytes, self.optimizer = groups, groups.rank, bucket_bytes, optimizer
        self.shape, self.params = shape, params
        self.layout = layout = ReductionLayout.of(groups.plan, groups.rank, shape)
        self.buckets, self.norm_items, self.tied_names = layout.buckets, layout.norm_items, layout.tied_names
        self._parts = {part: i for i, part in enumerate(model_parts(shape.layers))}
        self._order: list[Bucket] | None = None    # cut at first use, once bucket_bytes is final
        self._armed, self._final, self._next, self._folded = False, set(), 0, False
        self.launched_early = self.pending_at_first_launch = 0
        self._names = {id(p): name for name, p in params.items()}
        self._hooked = {it[0] for items in self.buckets.values() for it in items} | set(self.tied_names)
        for name in self._hooked:
            params[name].register_post_accumulate_grad_hook(self._on_final)

    # ------------------------------------------------------------------ buckets
    @property
    def launch_order(self) -> list[Bucket]:
        if self._order is None:
            made = [self._bucket(key, i, run) for key, items in self.buckets.items()
                    for i, run in enumerate(self._runs(items))]
            self._order = sorted(made, key=lambda b: (-b.position, b.key, b.index))
        return self._order

    def _runs(self, items: list[Item]) -> Iterator[list[Item]]:
        """The items in runs of at most `bucket_bytes`."""
        size = next(iter(self.params.values())).element_size()
        for a, e in item_runs([item_numel(self.shape, it) * size for it in items], self.bucket_bytes):
            yield items[a:e]

    def _position(self, item: Item) -> int:
        return item_position(item, self.tied_names, self._parts)

    def _bucket(self, key: tuple[int, ...], index: int, items: list[Item]) -> Bucket:
        names = {it[0] for it in items}
        if names & set(self.tied_names):
            names |= set(self.tied_names)   # both copies final: the device's one contribution is their sum
        return Bucket(key, index, self.groups.group(key), items, [item_numel(self.shape, it) for it in items],
                      frozenset(names), max(self._position(it) for it in items))

    def reset(self) -> None:
        """A new step: nothing armed or in flight (a step that failed may have left both)."""
        self._armed, self._final, self._next, self._folded = False, set(), 0, False
        for b in self._order or ():
            b.work = b.flat = None

    def arm(self) -> None:
        """The next backward is the step's last: launch each bucket once its gradients are final."""
        self.reset()
        self._armed, self.pending_at_first_launch = True, 0

    def _on_final(self, p: torch.Tensor) -> None:
        if self._armed:
            self._final.add(self._names[id(p)])
            self._launch_through(lambda b: b.names <= self._final)

    def _launch_through(self, ready: Callable[[Bucket], bool]) -> None:
        order = self.launch_order
        if self._armed and self._next == 0 and order and ready(order[0]):   # how much of backward they overlap
            self.pending_at_first_launch = len(self._hooked) - len(self._final)
        while self._next < len(order) and ready(order[self._next]):
            self._launch(order[self._next])
            self._next += 1

    def _launch(self, b: Bucket) -> None:
        """Start the bucket's all-reduce (in place when it is one contiguous view)."""
        self._fold_tied(b)
        views = [self._view(it) for it in b.items]
        alone = len(views) == 1 and views[0].is_contiguous()
        b.flat = None if alone else torch.cat([v.reshape(-1) for v in views])
        b.work = dist.all_reduce(views[0] if alone else b.flat, group=b.group, async_op=True)

    def _finish(self, b: Bucket) -> None:
        b.work.wait()
        if b.flat is not None:
            unflatten(b.flat, [self._view(it) for it in b.items])
        b.work = b.flat = None

    def _fold_tied(self, b: Bucket | None = None) -> None:
        """The tied weight's gradient: the sum of the copies this device holds, once a step, before
        the first bucket holding it (`b`; which waits for both copies) or after backward (None)."""
        if len(self.tied_names) == 2 and not self._folded and (b is None or b.names & set(self.tied_names)):
            self.params[self.tied_names[0]].grad.add_(self.params[self.tied_names[1]].grad)
            self._folded = True

    def _view(self, item: Item) -> torch.Tensor:
        """The item's rows of its parameter's gradient."""
        return narrow(self.params[item[0]].grad, item)

    def reduce(self) -> None:
        """Launch the buckets not launched yet and wait for all of them (the step's one wait)."""
        self._armed = False
        self.launched_early = self._next      # buckets that backward's hooks launched (overlapped)
        self._fold_tied()               # if no bucket did: reduced by no one else, this sum is the gradient
        self._launch_through(lambda b: True)
        for b in self.launch_order:
            self._finish(b)
        self._next, self._folded = 0, False
        self._settle()

    def _settle(self) -> None:
        """After the reductions: the tied weight's second copy."""
        if len(self.tied_names) == 2:
            self.params[self.tied_names[1]].grad.copy_(self.params[self.tied_names[0]].grad)

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

    def state(self) -> dict[str, TensorState]:
        """Every parameter with its Adam moments and step (zeros and 0 before its first update): the
        live tensors."""
        out = {}
        for name, p in self.params.items():
            st = self.optimizer.state.get(p)
            out[name] = ((p.detach(), st["exp_avg"], st["exp_avg_sq"], int(st["step"])) if st
                         else (p.detach(), torch.zeros_like(p), torch.zeros_like(p), 0))
        return out

    @torch.no_grad()
    def load(self, states: Mapping[str, TensorState]) -> None:
        """Set what `state()` gives (each tensor like its parameter); step 0 drops Adam's state."""
        for name, (param, exp_avg, exp_avg_sq, step) in states.items():
            p = self.params[name]
            p.copy_(param.to(p.device))
            if step > 0:
                self.optimizer.state[p] = {"step": torch.tensor(float(step)),
                                           "exp_avg": exp_avg.to(device=p.device, dtype=p.dtype).clone(),
                                           "exp_avg_sq": exp_avg_sq.to(device=p.device, dtype=p.dtype).clone()}
            else:
                self.optimizer.state.pop(p, None)


def unflatten(flat: torch.Tensor, views: list[torch.Tensor]) -> None:
    """Copy consecutive runs of `flat` back into `views`, in order (the inverse of their concatenation)."""
    offset = 0
    for v in views:
        n = v.numel()
        v.copy_(flat[offset:offset + n].view_as(v))
        offset += n


def narrow(t: torch.Tensor, item: Item) -> torch.Tensor:
    """The rows of `t` (a device's shard of the item's tensor) that the item covers."""
    _, dim, lo, hi = item
    return t if dim is None else t.narrow(dim, lo, hi - lo)
