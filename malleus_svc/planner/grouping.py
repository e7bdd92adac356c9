"""Upper level, part A: how each node's devices form tensor-parallel groups (the Malleus grouping).

A node's devices are put in an order, the first positions form full-size groups of `tp` devices
and the last few positions ("the tail") may be split into smaller groups tp/2, tp/4, ..., 1, which
lets a straggler be isolated (or left out) without slowing a whole group. Whatever is left after
the tail is suspended. This module produces, per node, the *candidate family* of such groupings;
which candidate wins is decided by the full lower level in `search.py` (fixing the authors' tail-only score).

Generalisations over the authors' family:
  * any number of a node's devices may be excluded: the number of full groups is
    ceil(available / tp) - 1, the tail holds the remaining 1..tp devices;
  * every prefix of a geometric tail series is a candidate (the rest is suspended), so a bad
    straggler need not be given a stage of its own;
  * a node may be dropped entirely (all its devices suspended);
  * the ordering is FIX 1: healthy devices by local id, then stragglers by rate (never mixed);
  * on small clusters (at most WIDE_DEVICES devices) every grouping of a node is a candidate too
    (`every_grouping`, shared with the exhaustive search), e.g. healthy groups split into smaller
    stages around a straggler group, or TP degrees mixed on one node.

Theorem 1 (consecutive grouping of the rate-sorted order is optimal for equal-size groups) is what
justifies grouping stragglers together in the full positions; `theorem1_holds` checks it by brute
force for tests.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Iterable, Iterator, Mapping, Sequence

from .problem import PlannerProblem

WIDE_DEVICES = 16    # clusters this small also get every grouping of every node


@dataclass(frozen=True, order=True)
class Group:
    """One TP group. `devices` is in TP-rank order; `rate` is y_g (time model); `h` = tp/|g| (memory model)."""

    devices: tuple[int, ...]
    rate: float
    h: int
    node: int

    @property
    def size(self) -> int:
        return len(self.devices)

    @property
    def is_normal(self) -> bool:
        """A full-size group at healthy speed: interchangeable with any other normal group."""
        return self.rate == 1.0 and self.h == 1

    @property
    def cls(self) -> tuple[float, int]:
        """What the lower level sees of a group (rate, memory factor)."""
        return (self.rate, self.h)


def slowest_first(g: Group) -> tuple:
    """The order special groups take in a template: slowest first; at equal rates the larger memory
    factor h later (deeper in the pipeline, where fewer micro-batches are in flight), then by node
    and devices."""
    return (-g.rate, g.h, g.node, g.devices)


def group_rate(problem: PlannerProblem, devices: Sequence[int]) -> float:
    """y_g = alpha(|g|) * max x over g, snapped to 1.0 below the straggler threshold τ."""
    y = problem.alpha(len(devices)) * max(problem.rates[d] for d in devices)
    return 1.0 if y < problem.straggler_threshold else y


def make_group(problem: PlannerProblem, devices: Sequence[int]) -> Group:
    devices = tuple(devices)
    return Group(devices, group_rate(problem, devices), problem.tp // len(devices),
                 problem.node_of(devices[0]))


def size_of_factor(problem: PlannerProblem, h: int) -> int:
    """The size of a group of memory factor h (`make_group`'s h = tp / size; sizes divide tp)."""
    return problem.tp // h


def is_straggler(problem: PlannerProblem, device: int) -> bool:
    return problem.rates[device] >= problem.straggler_threshold


# ----------------------------------------------------------------------------- node options
@dataclass(frozen=True)
class NodeOption:
    """One way to use one node: its groups and its suspended devices."""

    node: int
    groups: tuple[Group, ...]
    suspended: tuple[int, ...]
    tail_score: float = 0.0   # the authors' R, used only in authors' mode

    @property
    def capacity(self) -> float:
        """Σ 1/y: the node's share of the total-capacity lower bound (see search.lower_bound)."""
        return sum(1.0 / g.rate for g in self.groups)

    @property
    def key(self) -> tuple:
        return (tuple(sorted(tuple(sorted(g.devices)) for g in self.groups)),
                tuple(sorted(self.suspended)))

    @property
    def shape(self) -> tuple:
        """Sizes with their sorted rates, for dominance checks."""
        by_size: dict[int, list[float]] = {}
        for g in self.groups:
            by_size.setdefault(g.size, []).append(g.rate)
        return tuple(sorted((s, tuple(sorted(r))) for s, r in by_size.items()))


def available_devices(problem: PlannerProblem, node: int) -> list[int]:
    g = problem.gpus_per_node
    return [d for d in range(node * g, (node + 1) * g) if d not in problem.excluded]


def base_order(problem: PlannerProblem, devices: Iterable[int]) -> list[int]:
    """Healthy devices by local id, then stragglers by rate (ascending), then id (the authors' key
    mixes global ids with 8·rate, so a straggler can sort in among healthy devices)."""
    g = problem.gpus_per_node
    return sorted(devices, key=lambda d: (is_straggler(problem, d),
                                          problem.rates[d] if is_straggler(problem, d) else 0.0,
                                          d % g))


def slide_orders(base: Sequence[int], num_healthy: int, num_stragglers: int) -> Iterator[tuple[int, ...]]:
    """The authors' candidate orders: for block size β = 1..s-1 the β mildest
    stragglers slide left one slot at a time, so they may be absorbed into full-size groups."""
    yield tuple(base)
    for beta in range(1, num_stragglers):
        order = list(base)
        for idx in range(num_healthy - 1, -2, -1):
            yield tuple(order)
            if idx >= 0:
                order.insert(idx + beta, order.pop(idx))


def tail_splits(tail_len: int, tp: int, prefixes: bool = True, allow_split: bool = True) -> list[tuple[int, ...]]:
    """Group sizes for the tail: decreasing geometric series h0, h0/2, ..., cut while they fit.

    The authors take, for each start size h0 (a power of two <= min(tail_len, tp)), the longest
    series that fits; with `prefixes` every non-empty prefix is also a candidate (the rest is
    suspended). Without splitting only a full group (or nothing) is possible.
    """
    if not allow_split:
        return [(tp,)] if tail_len >= tp else [()]
    out: list[tuple[int, ...]] = []
    h0 = 1 << int(math.floor(math.log2(min(tail_len, tp))))
    while h0 >= 1:
        sizes, used, h = [], 0, h0
        while h >= 1 and used + h <= tail_len:
            sizes.append(h)
            used += h
            h //= 2
        series = [tuple(sizes[:n]) for n in range(1, len(sizes) + 1)] if prefixes else [tuple(sizes)]
        out.extend(s for s in series if s not in out)
        h0 //= 2
    return out


def assemble_full_groups(problem: PlannerProblem, devices: Sequence[int],
                         previous_groups: Mapping[int, tuple[int, ...]] | None = None) -> list[tuple[int, ...]]:
    """Partition the full-size positions into groups of tp devices.

    Stragglers are grouped consecutively by rate (Theorem 1: this minimises every monotone
    objective); the remaining healthy slots keep old TP groups together where possible (an old
    groupmate joins its straggler's group first, then whole old groups, then the rest by id),
    so that an unchanged situation reproduces the old groups and migration stays small.
    """
    k = problem.tp
    prev = previous_groups or {}
    strag = sorted((d for d in devices if is_straggler(problem, d)), key=lambda d: (-problem.rates[d], d))
    healthy = sorted(d for d in devices if not is_straggler(problem, d))
    pool = set(healthy)
    groups = [list(strag[i:i + k]) for i in range(0, len(strag), k)]
    for grp in groups:  # fill the partial straggler group with old groupmates first
        for d in list(grp):
            for mate in prev.get(d, ()):
                if len(grp) < k and mate in pool:
                    grp.append(mate)
                    pool.discard(mate)
    for d in healthy:   # whole old groups that survive intact
        old = prev.get(d)
        if old and len(old) == k and set(old) <= pool and len(groups) < len(devices) // k:
            groups.append(list(old))
            pool -= set(old)
    rest = sorted(pool)
    for grp in groups:
        while len(grp) < k and rest:
            grp.append(rest.pop(0))
    while rest:
        groups.append(rest[:k])
        rest = rest[k:]
    return [tuple(g) for g in groups]


def tp_order(devices: Iterable[int], previous_roles: Mapping[int, tuple[int, int]] | None = None) -> tuple[int, ...]:
    """TP-rank order inside a new group: each device keeps the slot whose shard contains its old
    shard (old rank r of t maps to slot r*n//t when n <= t), so kept groups keep their order."""
    devs = sorted(devices)
    n = len(devs)
    prev = previous_roles or {}
    slots: list[int | None] = [None] * n
    rest = []
    for d in devs:
        if d in prev:
            r, t = prev[d]
            if n <= t and slots[r * n // t] is None:
                slots[r * n // t] = d
                continue
        rest.append(d)
    it = iter(rest)
    return tuple(s if s is not None else next(it) for s in slots)


def node_options(problem: PlannerProblem, node: int,
                 previous_groups: Mapping[int, tuple[int, ...]] | None = None,
                 previous_roles: Mapping[int, tuple[int, int]] | None = None,
                 allow_drop: bool | None = None) -> list[NodeOption]:
    """The generalised candidate family of one node, de-duplicated and without dominated options.

    A node without stragglers and without exclusions has exactly one option (all full groups) on
    clusters of more than WIDE_DEVICES devices; smaller ones also get every grouping of every node.
    Option B is dominated by option A when they have the same group sizes and A's rates are
    elementwise no worse; a monotone objective can then never prefer B.
    """
    avail = available_devices(problem, node)
    if not avail:
        return [NodeOption(node, (), ())]
    k = problem.tp
    order = base_order(problem, avail)
    s = sum(is_straggler(problem, d) for d in avail)
    drop = problem.allow_reshape if allow_drop is None else allow_drop
    options: dict[tuple, NodeOption] = {}
    if s == 0 and len(avail) % k == 0:
        groups = assemble_full_groups(problem, avail, previous_groups)
        whole = NodeOption(node, tuple(make_group(problem, tp_order(g, previous_roles)) for g in groups), ())
        options[whole.key] = whole
    else:
        for opt in tail_options(problem, node, order, s, previous_groups, previous_roles):
            options.setdefault(opt.key, opt)
        if drop:
            opt = NodeOption(node, (), tuple(avail))
            options.setdefault(opt.key, opt)
    if problem.allow_split and problem.num_devices <= WIDE_DEVICES:
        # small clusters: every grouping too (e.g. healthy groups split around a straggler group);
        # after the others, which keep old groups and win ties of shape (less migration)
        for opt in [*uniform_splits(problem, node, order, previous_roles),
                    *every_grouping(problem, node, previous_roles)]:
            options.setdefault(opt.key, opt)
    return undominated(list(options.values()))


def tail_options(problem: PlannerProblem, node: int, order: Sequence[int], num_stragglers: int,
                 previous_groups: Mapping[int, tuple[int, ...]] | None = None,
                 previous_roles: Mapping[int, tuple[int, int]] | None = None) -> Iterator[NodeOption]:
    """The authors' family, generalised: full groups of each slide order, then each tail split."""
    k = problem.tp
    n_full = math.ceil(len(order) / k) - 1
    tail_len = len(order) - n_full * k
    # small clusters: the tail may also be suspended whole (a TP1 straggler has no shorter prefix)
    whole_tail = [()] if problem.num_devices <= WIDE_DEVICES else []
    for o in slide_orders(order, len(order) - num_stragglers, num_stragglers):
        full = assemble_full_groups(problem, o[:n_full * k], previous_groups)
        for sizes in [*tail_splits(tail_len, k, prefixes=True, allow_split=problem.allow_split), *whole_tail]:
            pos, tail = n_full * k, []
            for sz in sizes:
                tail.append(o[pos:pos + sz])
                pos += sz
            groups = tuple(make_group(problem, tp_order(g, previous_roles)) for g in [*full, *tail])
            yield NodeOption(node, groups, tuple(sorted(o[pos:])))


def group_sizes(problem: PlannerProblem) -> list[int]:
    return list(problem.tp_sizes) if problem.allow_split else [problem.tp]


def every_grouping(problem: PlannerProblem, node: int,
                   previous_roles: Mapping[int, tuple[int, int]] | None = None) -> list[NodeOption]:
    """Every partition of the node's usable devices into groups of the allowed sizes, up to devices of
    equal rate; without TP1 groups, devices may also be left out (with them, an idle device is an
    idle TP1 group). Dominated groupings are dropped (`undominated`)."""
    rates = problem.rates
    devs = sorted(available_devices(problem, node), key=lambda d: (-rates[d], d))
    sizes = group_sizes(problem)
    found: dict[tuple, tuple[tuple[int, ...], ...]] = {}
    seen: set = set()

    def rec(rest: tuple[int, ...], acc: tuple[tuple[int, ...], ...]) -> None:
        state = (tuple(rates[d] for d in rest), tuple(sorted((len(g), rates[g[0]]) for g in acc)))
        if state in seen:     # the same leftover rates and the same groups so far: nothing new below
            return
        seen.add(state)
        if not rest:
            shape = tuple(sorted((len(g), group_rate(problem, g)) for g in acc))
            found.setdefault(shape, acc)
            return
        d, others = rest[0], rest[1:]
        if 1 not in sizes:
            rec(others, acc)
        for s in sizes:
            picked: set = set()
            for mates in itertools.combinations(range(len(others)), s - 1):
                sig = tuple(rates[others[i]] for i in mates)
                if sig in picked:
                    continue
                picked.add(sig)
                group = (d, *(others[i] for i in mates))
                rec(tuple(x for i, x in enumerate(others) if i not in mates), acc + (group,))
    rec(tuple(devs), ())
    options = []
    for acc in found.values():
        used = {d for g in acc for d in g}
        groups = tuple(make_group(problem, tp_order(g, previous_roles)) for g in acc)
        options.append(NodeOption(node, groups, tuple(d for d in available_devices(problem, node) if d not in used)))
    return undominated(options)


def uniform_splits(problem: PlannerProblem, node: int, order: Sequence[int],
                   previous_roles: Mapping[int, tuple[int, int]] | None = None) -> Iterator[NodeOption]:
    """The node in groups of one smaller size t = tp/2, ..., 1, consecutive in the rate order
    (Theorem 1), the slowest leftover devices suspended: healthy groups split into smaller stages,
    which pays when the TP slowdown alpha is below the group-size ratio."""
    t = problem.tp // 2
    while t >= 1:
        n = len(order) // t * t
        if n:
            groups = tuple(make_group(problem, tp_order(order[i:i + t], previous_roles)) for i in range(0, n, t))
            yield NodeOption(node, groups, tuple(sorted(order[n:])))
        t //= 2


def undominated(options: list[NodeOption]) -> list[NodeOption]:
    """The options no other option dominates (same number of groups of each size, elementwise no
    slower), by decreasing capacity."""
    def dominates(a: NodeOption, b: NodeOption) -> bool:
        sa, sb = a.shape, b.shape
        return ([(s, len(r)) for s, r in sa] == [(s, len(r)) for s, r in sb]
                and all(x <= y for (_, ra), (_, rb) in zip(sa, sb) for x, y in zip(ra, rb)))
    keep: list[NodeOption] = []
    for i, b in enumerate(options):
        if any(dominates(a, b) and (a.shape != b.shape or j < i) for j, a in enumerate(options) if j != i):
            continue
        keep.append(b)
    return sorted(keep, key=lambda o: -o.capacity)


# ----------------------------------------------------------------------------- Theorem 1
def consecutive_grouping(rates: Sequence[float], k: int) -> list[tuple[int, ...]]:
    """Theorem 1's grouping: indices sorted by rate (descending), cut into consecutive blocks of k."""
    order = sorted(range(len(rates)), key=lambda i: (-rates[i], i))
    return [tuple(order[i:i + k]) for i in range(0, len(order), k)]


def all_groupings(n: int, k: int) -> Iterator[list[tuple[int, ...]]]:
    """Every partition of range(n) into groups of k (brute force, for tests on small n)."""
    def rec(rest: tuple[int, ...]) -> Iterator[list[tuple[int, ...]]]:
        if not rest:
            yield []
            return
        first, others = rest[0], rest[1:]
        for mates in itertools.combinations(others, k - 1):
            left = tuple(x for x in others if x not in mates)
            for tail in rec(left):
                yield [(first, *mates), *tail]
    yield from rec(tuple(range(n)))


def group_maxima(rates: Sequence[float], groups: Sequence[Sequence[int]]) -> tuple[float, ...]:
    """The groups' maxima, sorted descending: what every monotone symmetric objective sees."""
    return tuple(sorted((max(rates[i] for i in g) for g in groups), reverse=True))


def theorem1_holds(rates: Sequence[float], k: int) -> bool:
    """True iff the consecutive grouping's sorted maxima are elementwise <= those of every
    partition, i.e. it is optimal for every objective non-decreasing in each group rate."""
    best = group_maxima(rates, consecutive_grouping(rates, k))
    return all(all(a <= b + 1e-12 for a, b in zip(best, group_maxima(rates, g)))
               for g in all_groupings(len(rates), k))
