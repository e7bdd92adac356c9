"""Who owns each element of a sharded optimizer's state under a plan, from the plan alone.

With the optimizer sharded (distributed_optimizer.py), the fp32 masters and Adam moments of a piece
that several pipelines hold are cut into one chunk per holder, bucket by bucket; a piece one
pipeline holds stays with its device. So every element of the model's optimizer state has exactly
one owner. A migration between two such plans moves an element only where its owner changes
(migrate.py), and never gathers a piece whole.

Elements are named in one frame per tensor, the same on every plan: a tensor's elements laid out
axis-major (`TensorSpec.axis` first, the rows a TP shard or a plan's fraction cuts), so a device's
rows of it are one contiguous range whatever the TP degree. A tied head is named as the embedding.
"""
from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass
from typing import Iterator

from malleus_svc.config.presets import ModelShape
from malleus_svc.geometry import TIED, tensor_spec
from malleus_svc.plan import Plan
from malleus_svc.runtime.gradient_sync import (GRAD_BUCKET_BYTES, Item, ReductionLayout, item_numel,
                                               item_runs)
from malleus_svc.runtime.groups import PlanPieces


@dataclass(frozen=True, order=True)
class Run:
    """Elements [start, end) of tensor `name`'s axis-major layout."""
    name: str
    start: int
    end: int


@dataclass(frozen=True)
class RunState:
    """The optimizer state of one owned run: fp32 masters, exp_avg, exp_avg_sq, each laid out
    axis-major (1-D, or a tensor viewed with its axis first, whose flattening the run is), and the
    Adam step (0, with zero moments, before the first update)."""
    run: Run
    tensors: tuple  # three torch.Tensor
    step: int


def find(states: "dict[str, list[RunState]]", run: Run) -> tuple[tuple, int]:
    """The tensors of `run` cut from the state that covers it, and its step; KeyError if none does."""
    for st in states.get(run.name, ()):
        if st.run.start <= run.start and run.end <= st.run.end:
            a, e = run.start - st.run.start, run.end - st.run.start
            return tuple(_elements(t, a, e) for t in st.tensors), st.step
    raise KeyError(f"{run.name} elements [{run.start}, {run.end}): no state holds them")


def _elements(t, a: int, e: int):
    """Elements [a, e) of `t`'s flattening: a view where `t` is contiguous, else a copy of only the
    rows (its first dim) they span, never of the whole tensor."""
    if t.is_contiguous():
        return t.reshape(-1)[a:e]
    n = t[0].numel()
    first, last = a // n, (e - 1) // n + 1
    return t[first:last].reshape(-1)[a - first * n:e - first * n]


def chunk_of(total: int, members: int, k: int) -> tuple[int, int, int]:
    """A bucket of `total` elements cut into `members` equal chunks (the last padded with zeros):
    (chunk length, [lo, hi) of the bucket that member k owns)."""
    chunk = math.ceil(total / members)
    return chunk, min(k * chunk, total), min((k + 1) * chunk, total)


def overlaps(items: list[Item], sizes: list[int], lo: int, hi: int) -> Iterator[tuple[Item, int, int, int]]:
    """(item, a, e, start): elements [a, e) of the chunk [lo, hi) of a bucket of `items` are the
    item's from its own flat index `start`."""
    offset = 0
    for item, n in zip(items, sizes):
        a, e = max(offset, lo), min(offset + n, hi)
        if a < e:
            yield item, a - lo, e - lo, a - offset
        offset += n


def canonical(name: str, tied_names: list[str]) -> str:
    """The name an element is owned under: a tied weight's copies are one tensor, the embedding."""
    return TIED[0] if name in tied_names else name


def chunk_run(shape: ModelShape, layout: ReductionLayout, item: Item, a: int, e: int, start: int) -> Run:
    """The run of an `overlaps` entry: elements [a, e) of a chunk, the item's from `start` (an item
    of a split tensor begins at its rows' first element, `offsets` being its shard's first row)."""
    if item[1] is not None:
        start += (layout.offsets[item[0]] + item[2]) * tensor_spec(shape, item[0]).row_numel
    return Run(canonical(item[0], layout.tied_names), start, start + e - a)


def unshared_run(shape: ModelShape, layout: ReductionLayout, name: str, tp_rank: int, tp: int) -> Run:
    """The run of a tensor only this device holds (`ReductionLayout.unshared`): all its rows of it."""
    spec = tensor_spec(shape, name)
    lo, hi = spec.held_rows(tp_rank, tp)
    return Run(canonical(name, layout.tied_names), lo * spec.row_numel, hi * spec.row_numel)


def owned_runs(plan: Plan, rank: int, shape: ModelShape, *, itemsize: int = 4,
               bucket_bytes: int = GRAD_BUCKET_BYTES, pieces: PlanPieces | None = None) -> list[Run]:
    """The runs of optimizer state device `rank` owns under `plan`: its chunk of every bucket it
    reduces, cut as the engine cuts them (`itemsize`: the bytes of an fp32 master), and the whole
    of its shard of every tensor that it alone holds."""
    pieces = pieces or PlanPieces(plan, shape.tie_embeddings)
    layout = ReductionLayout.of(plan, rank, shape, pieces)
    out = []
    for key, items in layout.buckets.items():
        sizes = [item_numel(shape, it) for it in items]
        k = bisect_left(key, rank)      # its group rank: keys are sorted device ids
        for a, e in item_runs([n * itemsize for n in sizes], bucket_bytes):
            _, lo, hi = chunk_of(sum(sizes[a:e]), len(key), k)
            out += [chunk_run(shape, layout, *entry) for entry in overlaps(items[a:e], sizes[a:e], lo, hi)]
    role = pieces.roles[rank]
    tp = plan.pipelines[role.pipeline].stages[role.stage].tp
    return out + [unshared_run(shape, layout, name, role.tp_rank, tp) for name in layout.unshared]


def owners(plan: Plan, shape: ModelShape, *, itemsize: int = 4,
           bucket_bytes: int = GRAD_BUCKET_BYTES) -> dict[str, list[tuple[int, int, int]]]:
    """Every tensor's owners under `plan`: (start, end, device), sorted, covering each element once."""
    out: dict[str, list[tuple[int, int, int]]] = {}
    pieces = PlanPieces(plan, shape.tie_embeddings)
    for d in sorted(pieces.roles):
        for r in owned_runs(plan, d, shape, itemsize=itemsize, bucket_bytes=bucket_bytes, pieces=pieces):
            out.setdefault(r.name, []).append((r.start, r.end, d))
    for runs in out.values():
        runs.sort()
    return out
