"""The order of a pipeline's stages that lets ILP-1 reach its least bottleneck under the memory caps.

A stage's memory cap on blocks depends on its group's memory factor h (a split group needs h times
the memory per block) and on its position: 1F1B keeps S - j micro-batches in flight at stage j, so
caps grow along the pipeline, except that the first and the last stage also hold the embedding or
the head. The first stage has the most in flight and an end's share, so its cap is the least for
every h; only the last stage's cap may fall anywhere. Where it is still the largest for every h,
caps are non-decreasing along the pipeline for every h; else, for each class (rate, h) that may take
the last position, the other positions are taken in order, where they are.

For a level v, a group of rate y can hold min(cap, ⌊v/y⌋) blocks; v is feasible when some order
holds L blocks in all. Within one h the exchange argument puts the groups in increasing order of
⌊v/y⌋ on that h's positions, so an order is a choice of h per position: a dynamic programme over
positions whose state is how many groups of each h are placed (at most (n_h + 1) per factor), exact.
It runs only over the positions where some cap binds (past them the groups left hold all their
blocks in any order) and drops a state whose groups left could not make up the rest uncapped.
The least feasible v is found by bisection over the values y·n, and the order is read back from it.
Caps that fall along the pipeline before its last stage (a memory table no model here gives) are
outside what this is exact for: it then answers None and the caller keeps its order.
"""
from __future__ import annotations

import itertools
import math
from typing import Callable, Sequence

Class = tuple[float, int]         # (rate y, memory factor h)
REL_TOL = 1e-9


def best_order(classes: Sequence[Class], caps_of: Callable[[int, int], Sequence[int]], num_layers: int,
               lower: float = 0.0, upper: float = math.inf) -> tuple[Class, ...] | None:
    """The order of `classes` of least ILP-1 bottleneck; `caps_of(h, S)` gives each position's cap
    for factor h in a pipeline of S stages (-1: a group of that factor does not fit there even with no
    block). The bottleneck is known to lie in [lower, upper] (e.g. without memory caps, and of a
    given order). None when no order holds `num_layers` blocks."""
    s = len(classes)
    caps = {h: caps_of(h, s) for h in {h for _, h in classes}}
    levels = sorted({y * n for y in {y for y, _ in classes} for n in range(1, num_layers + 1)
                     if lower * (1 - REL_TOL) <= y * n <= upper * (1 + REL_TOL)})
    if not levels:
        return None
    lo, hi = 0, len(levels) - 1
    found = _arrange(classes, caps, levels[hi], num_layers)
    if found is None:
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        got = _arrange(classes, caps, levels[mid], num_layers)
        if got is None:
            lo = mid + 1
        else:
            hi, found = mid, got
    return found


def _arrange(classes: Sequence[Class], caps: dict[int, Sequence[int]], v: float,
             num_layers: int) -> tuple[Class, ...] | None:
    """An order holding `num_layers` blocks at level v, or None."""
    s = len(classes)
    tol = REL_TOL * max(1.0, v)
    blocks = {c: int((v + tol) // c[0]) for c in set(classes)}     # what each class holds without a cap
    if s == 1:
        cap = caps[classes[0][1]][0]
        return tuple(classes) if cap >= 0 and min(cap, blocks[classes[0]]) >= num_layers else None
    if any(a > b for c in caps.values() for a, b in zip(c[:-2], c[1:-1])):
        return None            # caps that fall along the pipeline: outside what this search is exact for
    if all(c[-1] >= c[-2] for c in caps.values()):       # the head leaves the last cap the largest: one pass
        return _positions(classes, caps, blocks, num_layers)
    for last in sorted(set(classes)):
        cap = caps[last[1]][s - 1]
        if cap < 0:
            continue
        rest = list(classes)
        rest.remove(last)
        found = _positions(rest, caps, blocks, num_layers - min(cap, blocks[last]))
        if found is not None:
            return (*found, last)
    return None


def _positions(classes: Sequence[Class], caps: dict[int, Sequence[int]], blocks: dict[Class, int],
               need: int) -> tuple[Class, ...] | None:
    """`classes` on positions 0.. (caps non-decreasing for each h) holding at least `need` blocks."""
    factors = sorted({h for _, h in classes})
    # per factor, its classes in increasing order of blocks at the level (the exchange argument)
    queue = [sorted((c for c in classes if c[1] == h), key=lambda c: blocks[c]) for h in factors]
    held_by = [[blocks[c] for c in q] for q in queue]
    cap_by = [caps[h] for h in factors]
    # what a factor's groups from its k-th on hold where no cap binds them
    rest = [list(itertools.accumulate(reversed(held), initial=0))[::-1] for held in held_by]
    # From the first position where every cap reaches the most blocks its factor's groups hold, no
    # cap binds (caps only grow along the pipeline): the groups left hold their blocks in any order
    # there, so the programme decides the positions before it only.
    free = next((j for j in range(len(classes))
                 if all(cap[j] >= held[-1] for cap, held in zip(cap_by, held_by))), len(classes))
    # a state is how many groups of each factor are placed, as one mixed-radix integer
    radix = [1]
    for q in queue[:-1]:
        radix.append(radix[-1] * (len(q) + 1))
    best: dict[int, tuple[int, int, int]] = {0: (0, -1, -1)}    # state -> (blocks held, previous state, factor)
    layer = {0: (0,) * len(factors)}

    def uncapped(state: int, counts: tuple[int, ...]) -> int:
        """What the state holds plus all its groups left hold uncapped: the most it can end with."""
        return best[state][0] + sum(r[k] for r, k in zip(rest, counts))
    for j in range(free):
        nxt: dict[int, tuple[int, ...]] = {}
        for state, counts in layer.items():
            held = best[state][0]
            for i, k in enumerate(counts):
                if k == len(queue[i]) or cap_by[i][j] < 0:
                    continue
                value = held + min(cap_by[i][j], held_by[i][k])
                after = state + radix[i]
                if after not in best or value > best[after][0]:
                    best[after] = (value, state, i)
                    if after not in nxt:
                        nxt[after] = counts[:i] + (k + 1,) + counts[i + 1:]
        # a state whose groups left cannot make up what is missing even uncapped ends here
        layer = {st: c for st, c in nxt.items() if uncapped(st, c) >= need}
        if not layer:
            return None
    end = max(layer, key=lambda st: uncapped(st, layer[st]))
    if uncapped(end, layer[end]) < need:     # with no binding position, the initial state unchecked
        return None
    picks, state = [], end
    while state:
        _, state, i = best[state]
        picks.append(i)
    taken = [0] * len(factors)
    out = []
    for i in reversed(picks):
        out.append(queue[i][taken[i]])
        taken[i] += 1
    # past `free`, the groups left in the order they were given
    left = [c for q, k in zip(queue, taken) for c in q[k:]]
    return (*out, *sorted(left, key=list(classes).index))
