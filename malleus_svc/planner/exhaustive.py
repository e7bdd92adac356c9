"""Exhaustive search (`planner: {search: exhaustive}`): the best plan of a cluster of at most 16 devices.

The plan space: per node, every partition of its usable devices into TP groups of sizes tp, tp/2,
..., 1 (full size only without `allow_split`, the other devices then idle); any of those groups
idle; the others in any number of pipelines, each an ordered sequence of groups (its stages),
every stage holding at least one block. Layers (ILP-1) and micro-batches (ILP-2) are the exact
lower level, and the value of a plan is `search.evaluate`'s, so this search and the default one
are judged alike.

Left out are symmetric copies, plans a bound rules out and, under 'full', the assumptions marked:
  * devices of equal rate are interchangeable, so a node's groupings are listed up to them (a
    group is its size and rate, plus its node when p2p is priced); a grouping is dropped when
    another has the same group sizes and is elementwise no slower (the objective is non-decreasing
    in every group's rate; assumed under 'full' for the gradient term, evaluated on ILP-1's layers,
    as the default search's grouping assumes it);
  * pipelines are unordered: they are built as one canonical multiset partition of the groups;
  * the stage order inside a pipeline matters only through the memory rows (and the p2p terms
    under 'full'): the order with the smallest bottleneck z is found once per multiset of groups;
    assumed under 'full' with p2p priced: among the orders that visit each node once, groups of
    one size and node placed by rule (`_Partitions._class_orders`, `_best_order`);
  * branch and bound: groupings in decreasing total capacity C = Σ 1/y, cut at M·L/C; a partial
    partition is cut when (M + Σ_i (S_i - 1)) / (Σ_i 1/z_i + C_left / L) (M alone under 'paper'
    and 'full'), or max_i S_i·z_i (max_i z_i under 'full'), reaches the incumbent.
Under 'full' the pipelines' layers are ILP-1's for that order (least slowest stage, not least fill
and drain) and the plan is valued by `planner.timing` as `search.evaluate` values it: the search is
exact for `EXACT_OBJECTIVES` only.
"""
from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, replace
from typing import Iterator, Sequence

from ..config.errors import ConfigError
from ..plan import Plan
from .grouping import Group, every_grouping, size_of_factor, slowest_first
from .lower import bottleneck, layer_caps, solve_layers, solve_micro_batches
from .timing import PipelineTimes, fill_drain, iteration_time
from .organize import distinct_permutations, p2p_extras
from .problem import PlannerProblem
from .search import (InfeasibleError, PlannerResult, _choose, _compatible, _finish, _infeasibility_reason, _reuse,
                     _safe_rebalance, assemble, evaluate, ideal_objective, plan)

MAX_DEVICES = 16
# Objectives it is exact for: under 'full' a pipeline's layers are ILP-1's (least slowest stage),
# not those of least fill and drain, so the default search can find better 'full' plans.
EXACT_OBJECTIVES = ("paper", "bubble")
BOUND_SLACK = 1e-6      # the seed's objective, widened so that a plan as good as the seed is still found
WIDEN_VISITS = 200_000  # nodes the default search's exhaustive check may visit (`malleus bench planner --small N`:
                        # every plan within 1% of the optimum, and the planning time, BENCHMARKS.md)


@dataclass(frozen=True)
class Optimum:
    objective: float
    pipelines: tuple[tuple[Group, ...], ...]   # stages in order
    layers: tuple[tuple[int, ...], ...]
    micro_batches: tuple[int, ...]
    groupings: int                              # node-grouping combinations searched
    organisations: int                          # complete partitions given the lower level
    complete: bool = True                       # False: stopped at `max_visits`, the best found by then


def plan_exhaustive(problem: PlannerProblem, previous: Plan | None = None, score=None) -> PlannerResult:
    """`search.plan` for `search: exhaustive`. The default search's plan seeds the bound (the
    enumeration then only looks for plans at least as good) and competes; with `previous`, the
    previous plan as it is or with its micro-batches re-balanced competes too (fewest moved bytes
    within 0.5%, as in the default search)."""
    t_start = time.perf_counter()
    check_size(problem)
    try:
        seed = plan(replace(problem, search="default"), previous).plan
    except InfeasibleError:
        seed = None
    best = optimum(problem, math.inf if seed is None else evaluate(problem, seed) * (1 + BOUND_SLACK))
    if best is None and seed is None:
        groups = [g for n in range(problem.num_nodes) for g in _groupings(problem, n)[0]]
        raise InfeasibleError(_infeasibility_reason(problem, groups))
    plans = ([] if best is None else [as_plan(problem, best)]) + ([] if seed is None else [seed])
    prev = previous if _compatible(problem, previous) else None
    if prev is not None:
        plans += [p for p in (_reuse(problem, prev), _safe_rebalance(problem, prev)) if p is not None]
    chosen, moved = _choose(problem, plans, prev, score)
    ideal = ideal_objective(problem)
    elapsed = time.perf_counter() - t_start
    searched = (best.groupings, best.organisations) if best is not None else (0, 0)
    chosen = _finish(problem, chosen, ideal, elapsed,
                     {"mode": "exhaustive", "pipelines": len(chosen.pipelines), "candidates": searched[0]})
    return PlannerResult(chosen, chosen.objective_value, ideal, searched[0], elapsed, searched[1], 0, moved)


def widen(problem: PlannerProblem, bound: float) -> tuple[Plan | None, str]:
    """The default search's last step on small clusters: a plan of the whole space better than
    `bound` (the best the candidate family gave), if the branch and bound finds one within
    WIDEN_VISITS nodes; and a note when it stopped there. It reaches the shapes the family does not
    build (e.g. a node's two worst stragglers as one TP group holding a few blocks). Not under 'full',
    where this search is not exact and its nodes cost several times more (BENCHMARKS.md, planner)."""
    if problem.objective not in EXACT_OBJECTIVES or not problem.allow_reshape or problem.num_devices > MAX_DEVICES:
        return None, ""     # the space it enumerates changes the pipeline count and drops nodes
    search = _search(problem, bound, WIDEN_VISITS)
    best = search.result()
    note = "" if search.complete else (
        f"the exhaustive check of this small cluster stopped after {WIDEN_VISITS} nodes: the plan may not be optimal")
    return (None if best is None else as_plan(problem, best)), note


def check_size(problem: PlannerProblem) -> None:
    if problem.num_devices > MAX_DEVICES:
        raise ConfigError("planner.search", "exhaustive",
                          f"exhaustive search plans clusters of at most {MAX_DEVICES} devices and this one has "
                          f"{problem.num_devices}; use search: default")


def optimum(problem: PlannerProblem, bound: float = math.inf, max_visits: int | None = None) -> Optimum | None:
    """The best plan of the whole plan space whose objective is below `bound` (None: none is); with
    `max_visits`, the best found within that many nodes of the branch and bound (`complete` says
    whether the search ended)."""
    return _search(problem, bound, max_visits).result()


def _search(problem: PlannerProblem, bound: float, max_visits: int | None) -> "_Partitions":
    full = problem.objective == "full"
    per_node = [_groupings(problem, n) for n in range(problem.num_nodes)]
    combos = sorted(itertools.product(*per_node), key=lambda c: -sum(1.0 / g.rate for gs in c for g in gs))
    search = _Partitions(problem, full, max_visits)
    search.best_value = bound
    try:
        for combo in combos:
            capacity = sum(1.0 / g.rate for gs in combo for g in gs)
            if capacity <= 0 or problem.num_micro_batches * problem.num_layers / capacity >= search.best_value:
                break
            search.groupings += 1
            search.run([g for gs in combo for g in gs])
    except _Spent:
        search.complete = False
    return search


def as_plan(problem: PlannerProblem, best: Optimum) -> Plan:
    return assemble(problem, best.pipelines, best.layers, best.micro_batches)


# ----------------------------------------------------------------------------- groupings of a node
def _groupings(problem: PlannerProblem, node: int) -> list[tuple[Group, ...]]:
    return [o.groups for o in every_grouping(problem, node)]


# ----------------------------------------------------------------------------- pipelines
@dataclass(frozen=True)
class _Pipe:
    order: tuple[int, ...]     # group types, stage by stage
    z: float
    layers: "_Layers"          # ILP-1's blocks per stage, solved when first asked for


class _Layers:
    def __init__(self, problem: PlannerProblem, order: Sequence[tuple], by_node: bool):
        self.args = (problem, order, by_node)
        self.value: tuple[int, ...] | None = None

    def get(self) -> tuple[int, ...]:
        if self.value is None:
            p, order, by_node = self.args
            self.value = solve_layers([t[0] for t in order], [float(t[1]) for t in order], p.num_layers, p.memory,
                                      extra=p2p_extras(p, [t[2] for t in order], [size_of_factor(p, t[1]) for t in order])
                                      if by_node else None,
                                      min_layers=1).layers
        return self.value


class _Spent(Exception):
    """The branch and bound reached its visit limit."""


class _Partitions:
    """Branch and bound over the multiset partitions of a combination's groups into pipelines
    (plus idle groups); the best pipeline order of each multiset of group types is memoised."""

    def __init__(self, problem: PlannerProblem, full: bool, max_visits: int | None = None):
        self.problem = problem
        self.full = full
        self.visits_left = math.inf if max_visits is None else max_visits
        self.complete = True          # False: stopped at max_visits
        # the stage order sees nodes only through p2p terms
        self.by_node = full and bool(problem.comm.p2p_intra_node or problem.comm.p2p_inter_node)
        self.best_value = math.inf
        self.best: tuple | None = None
        self.groupings = 0
        self.organisations = 0
        self._pipes: dict[tuple, _Pipe | None] = {}
        self._cap_memo: dict[tuple, tuple[int, ...]] = {}

    def key(self, g: Group) -> tuple:
        return (g.rate, g.h, g.node) if self.by_node else (g.rate, g.h)

    def run(self, groups: Sequence[Group]) -> None:
        by_type: dict[tuple, list[Group]] = {}
        for g in sorted(groups, key=slowest_first):
            by_type.setdefault(self.key(g), []).append(g)
        self.types = list(by_type)
        self.index = {ty: i for i, ty in enumerate(self.types)}
        self.members = list(by_type.values())
        self.inv_rate = [1.0 / t[0] for t in self.types]
        self._rec(tuple(len(m) for m in self.members), [], 0.0, 0.0, -1, None)

    def result(self) -> Optimum | None:
        if self.best is None:
            return None
        pipes, members, m = self.best
        left = [list(gs) for gs in members]
        groups = tuple(tuple(left[t].pop(0) for t in p.order) for p in pipes)
        return Optimum(self.best_value, groups, tuple(p.layers.get() for p in pipes), m, self.groupings,
                       self.organisations, self.complete)

    def _visit(self) -> None:
        """One node of the search: a partial partition or a stage order tried."""
        self.visits_left -= 1
        if self.visits_left < 0:
            raise _Spent

    # -- the partition
    def _rec(self, counts: tuple[int, ...], pipes: list[_Pipe], inv_z: float, worst: float, first: int,
             prev: tuple[int, ...] | None) -> None:
        self._visit()
        p = self.problem
        left = sum(c * r for c, r in zip(counts, self.inv_rate)) / p.num_layers
        # m_i <= w / z_i, less the S_i - 1 bubble slots under 'bubble' ('full' charges a pipeline's fill
        # and drain at its stages' own times, which z alone does not bound); later pipelines add
        # <= w * left; and m_i >= S_i
        fill = p.num_micro_batches + (sum(len(x.order) - 1 for x in pipes) if p.objective == "bubble" else 0)
        if inv_z + left <= 0 or max(fill / (inv_z + left), worst) >= self.best_value:
            return
        t = next((i for i, c in enumerate(counts) if c), None)
        if t is None:
            self._leaf(pipes)
            return
        for vec in self._sub_vectors(counts, t, prev if first == t else None):
            pipe = self._pipe(vec)
            if pipe is None:
                continue
            rest = tuple(c - v for c, v in zip(counts, vec))
            # a pipeline takes at least S_i·z_i ('paper': m_i >= S_i; 'bubble': fill and drain at z_i),
            # under 'full' only z_i (its fill and drain are its other stages' own, shorter, times)
            least = pipe.z if self.full else len(pipe.order) * pipe.z
            self._rec(rest, pipes + [pipe], inv_z + 1.0 / pipe.z, max(worst, least), t, vec)
        idle = counts[:t] + (0,) + counts[t + 1:]   # the remaining groups of type t stay idle
        self._rec(idle, pipes, inv_z, worst, -1, None)

    @staticmethod
    def _sub_vectors(counts: tuple[int, ...], t: int, cap: tuple[int, ...] | None) -> Iterator[tuple[int, ...]]:
        """Pipelines whose first type is t, in decreasing lexicographic order, not above `cap` (the
        previous pipeline with the same first type: pipelines are unordered)."""
        ranges = [range(counts[i], 0 if i == t else -1, -1) if i >= t else range(0, -1, -1)
                  for i in range(len(counts))]
        for vec in itertools.product(*ranges):
            if cap is None or vec <= cap:
                yield vec

    def _leaf(self, pipes: list[_Pipe]) -> None:
        if not pipes:
            return
        p = self.problem
        self.organisations += 1
        times = [self._stage_times(x) for x in pipes] if self.full else None
        data = solve_micro_batches([x.z for x in pipes], [len(x.order) for x in pipes], p.num_micro_batches,
                                   p.objective, fill=[fill_drain(t) for t in times] if self.full else None)
        if data is None or data.w >= self.best_value:
            return
        value = data.w
        if self.full:    # the gradient reductions too, as `search.evaluate` values a plan
            value = iteration_time(p, [PipelineTimes(m, t, x.layers.get(), tuple(self.members[i][0].size for i in x.order),
                                                     rates=tuple(self.types[i][0] for i in x.order))
                                       for m, t, x in zip(data.micro_batches, times, pipes)])
        if value < self.best_value - 1e-9 * max(1.0, value):
            self.best_value = value
            self.best = (list(pipes), self.members, data.micro_batches)

    def _stage_times(self, x: "_Pipe") -> tuple[float, ...]:
        """t0 per micro-batch of each stage: blocks x group rate, plus its p2p."""
        types = [self.types[i] for i in x.order]
        ex = (p2p_extras(self.problem, [ty[2] for ty in types], [size_of_factor(self.problem, ty[1]) for ty in types])
              if self.by_node else (0.0,) * len(types))
        return tuple(ty[0] * l + e for ty, l, e in zip(types, x.layers.get(), ex))

    # -- one pipeline
    def _pipe(self, vec: tuple[int, ...]) -> _Pipe | None:
        key = tuple((self.types[i], c) for i, c in enumerate(vec) if c)
        if key not in self._pipes:
            self._pipes[key] = self._best_order(vec)
        out = self._pipes[key]
        if out is None:
            return None
        # re-index the memoised order to this combination's type numbering
        return _Pipe(tuple(self.index[ty] for ty in out.order), out.z, out.layers)

    def _best_order(self, vec: tuple[int, ...]) -> _Pipe | None:
        """The stage order of these groups with the smallest bottleneck (every stage >= 1 block).

        Orders are taken as sequences of classes: memory factor h, plus the node when p2p is priced.
        The groups of one class go fastest first to its positions of largest memory cap (then of
        least p2p time): without p2p that is exact (exchange argument: min(cap, v/y) is
        supermodular); with p2p it is the one place the search trusts a rule rather than
        enumerating, since its terms are small against a block's time. Stops at the order-free
        bound (no memory rows, no p2p)."""
        p = self.problem
        items = sorted((i for i, c in enumerate(vec) for _ in range(c)), key=lambda i: self.types[i][0])
        if len(items) > p.num_layers:
            return None
        free = bottleneck([self.types[i][0] for i in items], [p.num_layers] * len(items), p.num_layers, min_layers=1)
        cls = {i: self.types[i][1:] for i in items}     # (h,) or (h, node)
        best: tuple[float, tuple[int, ...]] | None = None
        for seq in self._class_orders([cls[i] for i in items]):
            self._visit()
            caps = self._caps(tuple(c[0] for c in seq))
            if min(caps) < 1:
                continue
            extra = (p2p_extras(p, [c[1] for c in seq], [size_of_factor(p, c[0]) for c in seq]) if self.by_node
                     else [0.0] * len(seq))
            order = self._fill(seq, items, caps, extra, cls)
            z = bottleneck([self.types[i][0] for i in order], caps, p.num_layers, extra, min_layers=1)
            if z is not None and (best is None or z < best[0] - 1e-12 * max(1.0, z)):
                best = (z, order)
                if z <= free * (1 + 1e-12):
                    break
        if best is None:
            return None
        order = tuple(self.types[i] for i in best[1])
        return _Pipe(order, best[0], _Layers(p, order, self.by_node))

    def _caps(self, hs: tuple[int, ...]) -> tuple[int, ...]:
        if hs not in self._cap_memo:
            self._cap_memo[hs] = layer_caps([float(h) for h in hs], self.problem.num_layers, self.problem.memory)
        return self._cap_memo[hs]

    def _class_orders(self, classes: list[tuple]) -> Iterator[tuple[tuple, ...]]:
        """Orders of the stage classes; with p2p priced, those visiting each node once (its stages
        contiguous: any other order pays for more boundaries), every node order and every order
        within a node."""
        if not self.by_node:
            yield from distinct_permutations(classes)
            return
        nodes = sorted({c[1] for c in classes})
        for node_order in itertools.permutations(nodes):
            blocks = [list(distinct_permutations([c for c in classes if c[1] == n])) for n in node_order]
            for parts in itertools.product(*blocks):
                yield tuple(c for part in parts for c in part)

    @staticmethod
    def _fill(seq: Sequence[tuple], items: Sequence[int], caps: Sequence[int], extra: Sequence[float],
              cls: dict[int, tuple]) -> tuple[int, ...]:
        """Each class's groups (`items` are sorted fastest first) on its positions by decreasing cap,
        then increasing p2p time."""
        slots: dict[tuple, list[int]] = {}
        for j, c in enumerate(seq):
            slots.setdefault(c, []).append(j)
        members: dict[tuple, list[int]] = {}
        for i in items:
            members.setdefault(cls[i], []).append(i)
        order = [0] * len(seq)
        for c, pos in slots.items():
            for j, i in zip(sorted(pos, key=lambda j: (-caps[j], extra[j], j)), members[c]):
                order[j] = i
        return tuple(order)
