"""The order of a pipeline's stages that lets ILP-1 reach its least bottleneck under the memory caps.

A stage's memory cap on blocks depends on its group's memory factor h (a split group needs h times
the memory per block) and on its position: 1F1B keeps S - j micro-batches in flight at stage j, so
caps grow along the pipeline, except that the first and the last stage also hold the embedding or
the head. The first stage has the most in flight and an end's share, so its cap is the least for
every h; only the last stage's cap may fall anywhere. Where it is still the largest for every h,
caps are non-decreasing along the pipeline for every h; else, for each class (rate, h) that may take
the last position, the other positions are taken in order, where they are.

For a level v, a group of rate y can hold min(cap, ⌊v/y⌋) blocks; v is feasible when some order
holds L blocks in all. A group whose blocks fit the first position's cap goes first (anywhere else
it holds no more, and the group it displaces no less). Where the level leaves room, the rest ordered
by the first position that holds all their blocks often hold L: that order is taken when it does.
Else the exact search: within one h the exchange argument puts the groups in increasing order of
⌊v/y⌋ on that h's positions, so an order is a choice of h per position, a dynamic programme over
positions whose state is how many groups of each h are placed (at most (n_h + 1) per factor). It
runs only over the positions where some cap binds (past them the groups left hold all their blocks
in any order, the order they came in) and drops a state that could not make up the rest even with
its groups left uncapped, or with every position left holding the most any group could hold there.
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
    # A group whose blocks fit the first position's cap holds them at any position: such groups take
    # the first positions (swapping one with a capped group before it never loses a block).
    first = [c for c in classes if caps[c[1]][0] >= blocks[c]]
    need -= sum(blocks[c] for c in first)
    start = len(first)
    capped = [c for c in classes if caps[c[1]][0] < blocks[c]]
    end = len(classes)
    # Where the level leaves room, the groups ordered by the first position that holds all their
    # blocks often hold enough: then no programme is needed.
    uncapped_from = {c: next((p for p in range(start, end) if caps[c[1]][p] >= blocks[c]), end)
                     for c in set(capped)}
    quick = sorted(capped, key=lambda c: (uncapped_from[c], blocks[c]))
    if all(caps[h][p] >= 0 for p, (_, h) in enumerate(quick, start)) and sum(
            min(caps[c[1]][p], blocks[c]) for p, c in enumerate(quick, start)) >= need:
        return (*first, *quick)
    factors = sorted({h for _, h in capped})
    # per factor, its classes in increasing order of blocks at the level (the exchange argument)
    queue = [sorted((c for c in capped if c[1] == h), key=lambda c: blocks[c]) for h in factors]
    held_by = [[blocks[c] for c in q] for q in queue]
    cap_by = [caps[h] for h in factors]
    # From the first position where every cap reaches the most blocks its factor's groups hold, no
    # cap binds (caps only grow along the pipeline): the groups left hold their blocks in any order
    # there, so the programme decides the positions before it only.
    binding = next((p for p in range(start, end)
                    if all(cap[p] >= held[-1] for cap, held in zip(cap_by, held_by))), end) - start
    # the most the positions from p on can hold, whoever takes them
    most = list(itertools.accumulate(
        (max((min(cap[p], held[-1]) for cap, held in zip(cap_by, held_by)), default=0)
         for p in reversed(range(start, end))), initial=0))[::-1]
    # a state is how many groups of each factor are placed, as one mixed-radix integer
    radix = [1]
    for q in queue[:-1]:
        radix.append(radix[-1] * (len(q) + 1))
    best: dict[int, tuple[int, int, int]] = {0: (0, -1, -1)}    # state -> (blocks held, previous state, factor)
    # state -> (its counts, what its groups left hold uncapped)
    layer = {0: ((0,) * len(factors), sum(map(sum, held_by)))}
    for j in range(binding):
        p = start + j
        nxt: dict[int, tuple[tuple[int, ...], int]] = {}
        for state, (counts, left) in layer.items():
            held = best[state][0]
            for i, k in enumerate(counts):
                if k == len(queue[i]) or cap_by[i][p] < 0:
                    continue
                b = held_by[i][k]
                value = held + min(cap_by[i][p], b)
                # a state that cannot make up what is missing, with its groups left uncapped or
                # the positions left full, ends here
                if value + min(left - b, most[j + 1]) < need:
                    continue
                after = state + radix[i]
                if after not in best or value > best[after][0]:
                    best[after] = (value, state, i)
                    if after not in nxt:
                        nxt[after] = (counts[:i] + (k + 1,) + counts[i + 1:], left - b)
        layer = nxt
        if not layer:
            return None
    last = max(layer, key=lambda st: best[st][0] + layer[st][1])
    if best[last][0] + layer[last][1] < need:     # with no binding position, the initial state unchecked
        return None
    picks, state = [], last
    while state:
        _, state, i = best[state]
        picks.append(i)
    taken = [0] * len(factors)
    out = list(first)
    for i in reversed(picks):
        out.append(queue[i][taken[i]])
        taken[i] += 1
    # past the binding positions, the groups left in the order they were given
    rest = [c for q, k in zip(queue, taken) for c in q[k:]]
    return (*out, *sorted(rest, key=list(classes).index))
