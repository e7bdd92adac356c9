"""How a tensor-parallel (TP) group splits a part's sharded tensors, and how two splits meet.

A TP group is the tuple of its devices. Device r of a group of t holds the fraction
[r/t, (r+1)/t) of every sharded tensor along the tensor's split dim (Megatron: contiguous, in
rank order) and the whole of every replicated tensor. Fractions are exact, so groups of any sizes
compare without knowing the model; `rows_of` turns a fraction into rows of one tensor, rounding
each bound down: a dim the group's size does not divide (an odd vocabulary, a micro-batch's tokens)
splits into sizes one row apart at most, and the rows of two groups' fractions meet as the
fractions do (rounding down keeps their order).
"""
from __future__ import annotations

import bisect
from fractions import Fraction
from typing import Iterable, Sequence

Span = tuple[Fraction, Fraction]
WHOLE: Span = (Fraction(0), Fraction(1))


def shard_of(tp_rank: int, tp_size: int) -> Span:
    """The fraction of each sharded tensor that TP rank `tp_rank` of a group of `tp_size` holds."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"TP rank {tp_rank} is outside a group of size {tp_size}")
    return Fraction(tp_rank, tp_size), Fraction(tp_rank + 1, tp_size)


def rows_of(span: Span, size: int) -> tuple[int, int]:
    """Rows [start, end) of a dim of `size` rows that the fraction `span` covers, bounds rounded down
    (in integers: `size` may be a compiled graph's symbolic token count)."""
    return tuple(f.numerator * size // f.denominator for f in span)


def shard_rows(size: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """Rows [start, end) of a split dim of `size` rows that TP rank `tp_rank` of `tp_size` holds:
    `rows_of(shard_of(tp_rank, tp_size), size)`, without building fractions."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"TP rank {tp_rank} is outside a group of size {tp_size}")
    return size * tp_rank // tp_size, size * (tp_rank + 1) // tp_size


def most_rows(size: int, tp_size: int) -> int:
    """The most rows of a split dim of `size` rows that any rank of a group of `tp_size` holds: the
    last rank's (bounds round down), ⌈size / tp_size⌉."""
    return -(-size // tp_size)


def sequence_rows(tokens: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """Rows [start, end) of a micro-batch of `tokens` tokens that TP rank `tp_rank` of `tp_size`
    holds between TP regions (sequence parallelism): split as a tensor's rows are (micro-batches of
    packed documents have any number of tokens)."""
    return shard_rows(tokens, tp_rank, tp_size)


def shard_map(groups: Iterable[Sequence[int]], *, sharded: bool = True,
              exclude: Iterable[int] = ()) -> dict[int, Span]:
    """device -> the fraction it holds of a part held by these TP groups (the whole when not `sharded`)."""
    skip = set(exclude)
    return {d: shard_of(r, len(g)) if sharded else WHOLE
            for g in groups for r, d in enumerate(g) if d not in skip}


def finest_partition(spans: Iterable[Span], within: Span = WHOLE) -> list[Span]:
    """`within` cut at every bound of `spans` that falls inside it: each piece lies wholly inside or
    wholly outside every span, so it has one holder in each split."""
    return Cuts(spans).partition(within)


class Cuts:
    """The bounds of some spans, sorted once: `partition` of many spans against the same holders
    without a pass over every holder each time."""

    def __init__(self, spans: Iterable[Span]):
        self.bounds = sorted({c for span in spans for c in span})

    def partition(self, within: Span = WHOLE) -> list[Span]:
        lo, hi = within
        inner = self.bounds[bisect.bisect_right(self.bounds, lo):bisect.bisect_left(self.bounds, hi)]
        cuts = [lo, *inner, hi]
        return list(zip(cuts, cuts[1:]))


def holder_at(group: Sequence[int], point: Fraction) -> int:
    """The device of a TP group whose shard holds the piece that starts at fraction `point`."""
    return group[int(point * len(group))]
