"""Upper level, part B: which group sits at which (pipeline, stage).

A *template* fixes, per pipeline, the ordered "special" groups (every group that is not a normal
full-size healthy group) in its first stages and a number of placeholders for normal groups after
them. Normal groups are interchangeable for the time model, so the lower level can score a
template before any concrete normal group is chosen (`fill` does that afterwards, for migration
and locality only). On small clusters `reorder_stages` may then move stages within a pipeline
where memory binds.

Two generators, one scorer:
  * `dfs_templates`: the authors' DFS over stage-count plans S_i in [q-1, q+r+1] and subsets of
    special groups (sorted by rate, slowest first), with symmetry pruning. In the authors' mode
    the pruning is theirs (straggler counts non-increasing over all pipelines); otherwise only
    pipelines with equal S_i are treated as interchangeable (a superset of their family), and
    subsets that differ only by which of several identical (rate, h) groups they take are
    explored once (the DFS walks mixes of classes, not index subsets). A visit budget bounds it;
    past it, the caller uses
  * `greedy_templates`: balanced stage counts, special groups dealt out in a snake over the
    pipelines (slowest first), then a bounded local search moving one special group at a time.
  * `Scorer`: ILP-1 per distinct pipeline (templates repeat pipelines massively: each distinct
    one is laid out and timed once, with its count of copies) and ILP-2 by class, returning the
    paper's objective or its bubble-aware variants ('full': `timing.iteration_time`).
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import heapq
import itertools
import math
from dataclasses import dataclass
from typing import Hashable, Iterator, Mapping, Sequence

from .budget import NEVER, Deadline
from .grouping import Group
from .lower import (ClassSplit, DataSolution, LayerSolution, bottleneck, memory_caps, position_caps, solve_layers,
                    solve_micro_batches, solve_micro_batches_by_class, uncapped_bottleneck)
from .problem import PlannerProblem
from .stage_order import best_order
from .timing import PipelineTimes, fill_drain, iteration_time

NORMAL = -1   # a placeholder for a normal group in a template
NORMAL_CLASS = (1.0, 1)   # what the lower level sees of a normal group: (rate, memory factor)
Template = tuple[tuple[int, ...], ...]   # per pipeline, stage by stage: special-group indices and NORMAL slots
# One pipeline as the scorer sees it: its stages' (rate, memory factor), and under 'full' their p2p
# extras and TP group sizes (else None).
Row = tuple[tuple[tuple[float, int], ...], tuple[float, ...] | None, tuple[int, ...] | None]


class TooManyTemplates(Exception):
    """The DFS exceeded its visit budget; switch to the greedy generator."""


# ----------------------------------------------------------------------------- scoring
class Score:
    """An organisation's objective, and per pipeline its bottleneck z, layers and micro-batches,
    built from its distinct pipelines on first use: a search compares thousands of organisations of
    thousands of pipelines by objective alone."""

    def __init__(self, objective: float, classes: tuple[Hashable, ...], shapes: Mapping[Hashable, _Shape],
                 data: ClassSplit | DataSolution):
        self.objective = objective
        self._classes, self._shapes, self._data = classes, shapes, data

    @functools.cached_property
    def z(self) -> tuple[float, ...]:
        return tuple(self._shapes[k].sol.z for k in self._classes)

    @functools.cached_property
    def layers(self) -> tuple[tuple[int, ...], ...]:
        return tuple(self._shapes[k].sol.layers for k in self._classes)

    @functools.cached_property
    def micro_batches(self) -> tuple[int, ...]:
        d = self._data
        return d.micro_batches if isinstance(d, DataSolution) else d.micro_batches(self._classes)

    def _key(self) -> tuple:
        return self.objective, self.z, self.layers, self.micro_batches

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Score) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return f"Score(objective={self.objective!r}, pipelines={len(self._classes)})"


_NOT_BELOW = object()   # `Scorer._score`: the organisation's objective is not below the bound asked


class Scorer:
    """The lower level for a fixed organisation, with ILP-1 memoised across templates.

    `effective_stages`: a stage that gets 0 blocks is dropped from the plan (its devices are
    suspended), so ILP-2 sees only the stages that hold blocks (m_i >= S_i then counts real
    stages). The authors' code keeps the nominal S_i; `authors.py` turns this off.

    With the optimizer sharded, a pipeline's memory rows depend on how many pipelines share its
    state: an organisation of P pipelines is scored by `for_pipelines(P)`, a scorer of its own.
    """

    def __init__(self, problem: PlannerProblem, objective: str | None = None, effective_stages: bool = True):
        self.problem = problem
        self.objective = objective or problem.objective
        self.effective_stages = effective_stages
        self._memo: dict[tuple, LayerSolution | None] = {}
        self._scores: dict[tuple, Score | None] = {}
        self._orders: dict[tuple, tuple] = {}         # best order of each multiset of classes
        self._reordered: dict[tuple, tuple] = {}      # what `stage_order` answers for each order
        self._cap_memo: dict[tuple, tuple[int, ...] | None] = {}
        self._position_memo: dict[tuple[int, int], list[int]] = {}
        self._p2p: dict[tuple, tuple[float, ...]] = {}   # a pipeline's stage nodes -> its p2p extras
        self._shapes: dict[int, _Shape | None] = {}       # a pipeline's row -> its layout and times
        self._row_ids: dict[Row, int] = {}                # the rows numbered (`row_id`; on the root)
        self._rows: list[Row] = []
        self._by_count: dict[int, Scorer] = {}
        self._root = self
        self._ilp1_calls = 0

    @property
    def ilp1_calls(self) -> int:
        return self._ilp1_calls + sum(s._ilp1_calls for s in self._by_count.values())

    def for_pipelines(self, count: int) -> "Scorer":
        """The scorer of organisations of `count` pipelines (this one unless the state is sharded)."""
        root = self._root
        memory = root.problem.memory.over(count)
        if memory == root.problem.memory:
            return root
        if count not in root._by_count:
            sub = Scorer(dataclasses.replace(root.problem, memory=memory), root.objective, root.effective_stages)
            sub._root = root
            root._by_count[count] = sub
        return root._by_count[count]

    def p2p(self, nodes: tuple[int | None, ...], sizes: tuple[int, ...]) -> tuple[float, ...]:
        """`p2p_extras` of a pipeline whose stages sit on these nodes in groups of these sizes
        (templates repeat them)."""
        if (nodes, sizes) not in self._p2p:
            self._p2p[nodes, sizes] = p2p_extras(self.problem, nodes, sizes)
        return self._p2p[nodes, sizes]

    def layers(self, ys: Sequence[float], hs: Sequence[int], extra: Sequence[float] | None = None,
               prefer: Sequence[int] | None = None) -> LayerSolution | None:
        key = (tuple(ys), tuple(hs), None if extra is None or not any(extra) else tuple(extra))
        if prefer is None and key in self._memo:
            return self._memo[key]
        sol = self._solve(list(ys), list(hs), None if key[2] is None else list(extra), prefer)
        if self.effective_stages:
            # A stage with 0 blocks is dropped; if it was the first or last one, its neighbour
            # takes over the embedding/head, so re-solve the pipeline without it until stable.
            while sol is not None and 0 in sol.layers and any(sol.layers):
                keep = [j for j, l in enumerate(sol.layers) if l > 0]
                sub = self._solve([ys[j] for j in keep], [hs[j] for j in keep],
                                  None if key[2] is None else [extra[j] for j in keep],
                                  None if prefer is None else [prefer[j] for j in keep])
                if sub is None:
                    sol = None
                    break
                full = [0] * len(ys)
                for j, l in zip(keep, sub.layers):
                    full[j] = l
                sol = LayerSolution(sub.z, tuple(full))
                if 0 not in sub.layers:
                    break
        if prefer is None:
            self._memo[key] = sol
        return sol

    def stage_order(self, classes: tuple[tuple[float, int], ...]) -> tuple[tuple[float, int], ...]:
        """These stage classes (rate, memory factor) in the order of least ILP-1 bottleneck under the
        memory caps (`stage_order.best_order`, exact); `classes` itself when memory does not bind it
        or no order does better."""
        if classes not in self._reordered:
            self._reordered[classes] = self._reorder(classes)
        return self._reordered[classes]

    def _reorder(self, classes: tuple[tuple[float, int], ...]) -> tuple[tuple[float, int], ...]:
        L = self.problem.num_layers
        free = uncapped_bottleneck([y for y, _ in classes], L)
        given = self._bottleneck(classes)
        if given is not None and given <= free * (1 + 1e-12):
            return classes
        key = tuple(sorted(classes))
        if key not in self._orders:
            upper = math.inf if given is None else given
            self._orders[key] = best_order(key, self.position_caps, L, free, upper) or key
        best = self._orders[key]
        z = self._bottleneck(best)
        return best if z is not None and (given is None or z < given * (1 - 1e-12)) else classes

    def position_caps(self, h: int, stages: int) -> list[int]:
        """`lower.position_caps` of factor h in a pipeline of `stages` stages, memoised."""
        if (h, stages) not in self._position_memo:
            self._position_memo[h, stages] = position_caps(float(h), stages, self.problem.num_layers,
                                                           self.problem.memory)
        return self._position_memo[h, stages]

    def _bottleneck(self, classes: Sequence[tuple[float, int]]) -> float | None:
        caps = self.caps(tuple(h for _, h in classes))
        return None if caps is None else bottleneck([y for y, _ in classes], caps, self.problem.num_layers)

    def caps(self, hs: tuple[int, ...]) -> tuple[int, ...] | None:
        """`lower.memory_caps` of a pipeline with these memory factors, memoised."""
        if hs not in self._cap_memo:
            self._cap_memo[hs] = memory_caps([float(h) for h in hs], self.problem.num_layers, self.problem.memory)
        return self._cap_memo[hs]

    def _solve(self, ys, hs, extra, prefer) -> LayerSolution | None:
        p = self.problem
        self._ilp1_calls += 1
        return solve_layers(ys, [float(h) for h in hs], p.num_layers, p.memory, extra=extra,
                            solver=p.solver, prefer=prefer, time_limit_s=p.time_limit_s, mip_gap=p.mip_gap)

    def score(self, pipelines: Sequence[Sequence[tuple[float, int]]],
              extras: Sequence[Sequence[float]] | None = None,
              sizes: Sequence[Sequence[int]] | None = None,
              prefer_layers: Sequence[Sequence[int] | None] | None = None,
              prefer_micro_batches: Sequence[int] | None = None, below: float = math.inf) -> Score | None:
        """Objective of an organisation given per pipeline its stages' (y, h); None = infeasible,
        or (where `below` is given) not below it."""
        rows = tuple(self.row_id((tuple(pipe), None if extras is None else tuple(extras[i]),
                                  None if sizes is None else tuple(sizes[i])))
                     for i, pipe in enumerate(pipelines))
        return self.score_rows(rows, prefer_layers, prefer_micro_batches, below)

    def row_id(self, row: Row) -> int:
        """A number for this pipeline row, the same on every scorer of the search: an organisation
        is the tuple of its rows' numbers, which hashes fast as a memo key at thousands of pipelines."""
        ids = self._root._row_ids
        if row not in ids:
            ids[row] = len(ids)
            self._root._rows.append(row)
        return ids[row]

    def score_rows(self, rows: tuple[int, ...], prefer_layers: Sequence[Sequence[int] | None] | None = None,
                   prefer_micro_batches: Sequence[int] | None = None, below: float = math.inf) -> Score | None:
        """`score` of pipelines given by their rows' numbers (`row_id`). Memoised when nothing is
        preferred: templates of different groupings, and a local search's moves back and forth,
        repeat organisations."""
        scorer = self.for_pipelines(len(rows))
        if scorer is not self:
            return scorer.score_rows(rows, prefer_layers, prefer_micro_batches, below)
        if prefer_layers is not None or prefer_micro_batches is not None:
            return self._score(rows, prefer_layers, prefer_micro_batches)
        if rows not in self._scores:
            s = self._score(rows, None, None, below)
            if s is _NOT_BELOW:
                return None
            self._scores[rows] = s
        s = self._scores[rows]
        return s if s is None or s.objective < below else None

    def _score(self, rows: tuple[int, ...], prefer_layers, prefer_micro_batches, below: float = math.inf
               ) -> Score | None:
        # Pipelines repeat (data-parallel replicas, a template's all-normal pipelines): each distinct
        # one is laid out, timed and given micro-batches once, with its number of copies.
        classes = rows if prefer_layers is None else tuple(
            row if pref is None else (row, tuple(pref)) for row, pref in zip(rows, prefer_layers))
        copies = collections.Counter(classes)
        shapes: dict[Hashable, _Shape] = {}
        for k in copies:
            shape = self._shape(k) if isinstance(k, int) else self._shape(*k)
            if shape is None:
                return None
            shapes[k] = shape
        p = self.problem
        full = self.objective == "full"
        z = {k: s.sol.z for k, s in shapes.items()}
        stages = {k: s.stages for k, s in shapes.items()}
        fill = {k: s.fill for k, s in shapes.items()} if full else None
        data: ClassSplit | DataSolution | None
        if p.solver == "closed_form" and prefer_micro_batches is None:
            data = solve_micro_batches_by_class(classes, z, stages, p.num_micro_batches, self.objective, fill)
        else:   # HiGHS, or micro-batches preferred: pipeline by pipeline
            data = solve_micro_batches([z[k] for k in classes], [stages[k] for k in classes], p.num_micro_batches,
                                       self.objective, solver=p.solver, prefer=prefer_micro_batches,
                                       time_limit_s=p.time_limit_s, mip_gap=p.mip_gap,
                                       fill=None if fill is None else [fill[k] for k in classes])
        if data is None:
            return None
        obj = data.w
        if full and self._root._rows[rows[0]][2] is not None:
            # the pipelines' ends bound the iteration from below: past `below`, the reductions and
            # the optimizer steps need not be walked (most of a local search's candidates)
            if data.w >= below * (1 + 1e-9):
                return _NOT_BELOW
            split = (collections.Counter(zip(classes, data.micro_batches)) if isinstance(data, DataSolution)
                     else {(k, m): n for k, c in copies.items() for m, n in data.counts(k, c)})
            timed: collections.Counter = collections.Counter()
            for (k, m), n in split.items():    # distinct classes may time alike: their copies add up
                timed[dataclasses.replace(shapes[k].times, micro_batches=m)] += n
            obj = iteration_time(p, timed)
        return Score(obj, classes, shapes, data)

    def _shape(self, row: int, prefer: tuple[int, ...] | None = None) -> _Shape | None:
        """What the lower level makes of one pipeline: ILP-1's layout, its real stages and, under
        'full', their times (memoised unless layers are preferred)."""
        if prefer is None and row in self._shapes:
            return self._shapes[row]
        pipe, extra, sizes = self._root._rows[row]
        sol = self.layers([y for y, _ in pipe], [h for _, h in pipe], extra, prefer)
        shape = None
        if sol is not None:
            real = [j for j, l in enumerate(sol.layers) if l > 0]
            times = tuple(pipe[j][0] * sol.layers[j] + (extra[j] if extra is not None else 0.0) for j in real)
            timed = PipelineTimes(0, times, tuple(sol.layers[j] for j in real),
                                  tuple(sizes[j] for j in real) if sizes is not None else (),
                                  rates=tuple(pipe[j][0] for j in real))
            shape = _Shape(sol, len(real) if self.effective_stages else len(pipe), fill_drain(times), timed)
        if prefer is None:
            self._shapes[row] = shape
        return shape


@dataclass(frozen=True)
class _Shape:
    """One distinct pipeline of an organisation, laid out (`Scorer._shape`)."""
    sol: LayerSolution
    stages: int             # ILP-2's stage count: those holding blocks (all without `effective_stages`)
    fill: float             # 'full' ILP-2's offset: Σ t - max t over the stages holding blocks
    times: PipelineTimes    # those stages for 'full', micro_batches to be set


def p2p_extras(problem: PlannerProblem, nodes: Sequence[int | None], sizes: Sequence[int]) -> tuple[float, ...]:
    """Per-stage p2p time per micro-batch of stages on these nodes in TP groups of these sizes. A
    boundary's cost is its forward + backward transfer, intra- or inter-node, times the share its
    groups' ranks move at once (`CommCosts.p2p_share` of the smaller size); the sender pays each
    direction (blocking sends), so a stage pays half of each adjacent boundary: its output forward
    and its input gradient backward. An unknown node (a placeholder) next to a known one counts
    as inter-node; two placeholders side by side count as intra-node (`fill` puts consecutive
    normal groups on one node if it can)."""
    c = problem.comm
    if not (c.p2p_intra_node or c.p2p_inter_node):
        return (0.0,) * len(nodes)

    def edge(j: int) -> float:
        a, b = nodes[j], nodes[j + 1]
        same = (a is None and b is None) or (a is not None and a == b)
        return (c.p2p_intra_node if same else c.p2p_inter_node) * c.p2p_share(min(sizes[j], sizes[j + 1]), same)
    s = len(nodes)
    return tuple(0.5 * ((edge(j - 1) if j > 0 else 0.0) + (edge(j) if j < s - 1 else 0.0)) for j in range(s))


class TemplateScorer:
    """Scores templates over one list of special groups, each distinct pipeline turned into its row
    once (a local search's candidates share all but two of thousands of pipelines)."""

    def __init__(self, scorer: Scorer, specials: Sequence[Group], tp: int):
        self.scorer, self.specials, self.tp = scorer, specials, tp
        self._rows: dict[tuple[int, ...], int] = {}

    def row(self, pipe: tuple[int, ...]) -> int:
        """The scorer's number (`Scorer.row_id`) of this template pipeline's row."""
        if pipe not in self._rows:
            groups = [self.specials[g] if g != NORMAL else None for g in pipe]
            classes = tuple(NORMAL_CLASS if g is None else g.cls for g in groups)
            if self.scorer.objective != "full":
                row = (classes, None, None)
            else:
                sizes = tuple(self.tp if g is None else g.size for g in groups)
                row = (classes, self.scorer.p2p(tuple(None if g is None else g.node for g in groups), sizes), sizes)
            self._rows[pipe] = self.scorer.row_id(row)
        return self._rows[pipe]

    def score(self, template: Template, below: float = math.inf) -> Score | None:
        return self.scorer.score_rows(tuple(map(self.row, template)), below=below)


def reorder_stages(scorer: Scorer, template: Template, specials: Sequence[Group]) -> Template:
    """The template with each pipeline's stages in the order of least bottleneck under the memory
    caps (`Scorer.stage_order`). Templates put the special groups first, slowest first, which is
    best while memory is loose; when it binds, split groups (more memory per block) may need the
    deeper stages, where fewer micro-batches are in flight."""
    scorer = scorer.for_pipelines(len(template))
    return tuple(_reorder_pipeline(scorer, pipe, specials) for pipe in template)


def _reorder_pipeline(scorer: Scorer, pipe: tuple[int, ...], specials: Sequence[Group]) -> tuple[int, ...]:
    """One pipeline of `reorder_stages`; `scorer` is the one of the template's pipeline count."""
    classes = tuple(specials[g].cls if g != NORMAL else NORMAL_CLASS for g in pipe)
    pool: dict[tuple, list[int]] = {}
    for g, c in zip(pipe, classes):
        pool.setdefault(c, []).append(g)
    return tuple(pool[c].pop(0) for c in scorer.stage_order(classes))


# ----------------------------------------------------------------------------- generators
MAX_STAGE_PLANS = 48


def stage_plans(num_groups: int, num_pipelines: int, baseline_stages: int | None = None,
                authors: bool = False, max_plans: int = MAX_STAGE_PLANS, every: bool = False) -> list[tuple[int, ...]]:
    """Non-increasing stage counts S_1 >= ... >= S_P in [q-1, q+r+1] (at least 1) summing to the
    group count (as the authors' code does); the authors use S0 everywhere when the group count allows it.
    `every` (small clusters): every such sequence of counts >= 1, most balanced first, so that a slow
    group may form a pipeline of its own beside a deep one of fast groups.

    With many pipelines the authors' range explodes combinatorially (32 pipelines of ~4 stages
    have ~10^8 such sequences), so ours keeps S_i <= q+2 and then the `max_plans` most balanced
    sequences (least total deviation from the even split): stragglers need a few longer
    pipelines, never a wildly uneven layout. The authors' mode enumerates their full range.
    """
    P = num_pipelines
    if P < 1 or num_groups < P:
        return []
    if authors and baseline_stages is not None and num_groups == P * baseline_stages:
        return [(baseline_stages,) * P]
    q, r = divmod(num_groups, P)
    lo, hi = max(1, q - 1), q + r + 1
    if authors:
        return _all_stage_plans(num_groups, P, lo, hi)
    if every:
        mean = num_groups / P
        return sorted(_all_stage_plans(num_groups, P, 1, num_groups - P + 1),
                      key=lambda S: (sum(abs(s - mean) for s in S), S))
    return _balanced_stage_plans(num_groups, P, max_plans)


def _all_stage_plans(num_groups: int, P: int, lo: int, hi: int) -> list[tuple[int, ...]]:
    """Every non-increasing sequence of P counts in [lo, hi] summing to num_groups, in descending
    lexicographic order (an explicit stack: its depth would be the pipeline count)."""
    out: list[tuple[int, ...]] = []
    stack: list[tuple[tuple[int, ...], int, int]] = [((), num_groups, hi)]
    while stack:
        prefix, left, cap = stack.pop()
        slots = P - len(prefix)
        if slots == 0:
            if left == 0:
                out.append(prefix)
            continue
        values = [v for v in range(min(cap, left - lo * (slots - 1)), lo - 1, -1) if v * slots >= left]
        stack.extend((prefix + (v,), left - v, v) for v in reversed(values))   # largest popped first
    return out


def _balanced_stage_plans(num_groups: int, P: int, max_plans: int) -> list[tuple[int, ...]]:
    """Our family, S_i in [max(1, q-1), min(q+r+1, q+2)]: a non-increasing sequence is its counts
    (a of q-1, c of q, b of q+1, d of q+2), and the two sums fix c = P - r - 2a + d and
    b = r + a - 2d, so the family is the feasible (a, d) pairs. Its deviation from the even split
    grows with a and with d, so the most balanced come out of a best-first merge over d, without
    listing the family (~10^8 members at 32 pipelines, unbounded beyond): fewer than `max_plans`
    members come back all, in descending lexicographic order, else the `max_plans` least deviating."""
    q, r = divmod(num_groups, P)
    a_free = q - 1 >= 1               # q-1 is allowed only when it is at least 1
    d_free = q + r + 1 >= q + 2       # q+2 only when the remainder allows it (r >= 1)

    def a_range(d: int) -> range:
        return range(max(0, 2 * d - r), (P - r + d) // 2 + 1 if a_free else 1)

    def sequence(a: int, d: int) -> tuple[int, ...]:
        c, b = P - r - 2 * a + d, r + a - 2 * d
        return (q + 2,) * d + (q + 1,) * b + (q,) * c + (q - 1,) * a

    ds = [d for d in range(P + 1 if d_free else 1) if len(a_range(d))]
    if sum(len(a_range(d)) for d in ds) <= max_plans:
        return sorted((sequence(a, d) for d in ds for a in a_range(d)), reverse=True)
    mean = num_groups / P

    def deviation(a: int, d: int) -> float:
        counts = ((q + 2, d), (q + 1, r + a - 2 * d), (q, P - r - 2 * a + d), (q - 1, a))
        return sum(n * abs(v - mean) for v, n in counts)

    heap = [(deviation(a_range(d)[0], d), d, a_range(d)[0]) for d in ds]
    heapq.heapify(heap)
    picked: list[tuple[int, int]] = []
    cutoff = math.inf
    while heap and (len(picked) < max_plans or heap[0][0] <= cutoff + 1e-9):   # ties with the last kept too
        dev, d, a = heapq.heappop(heap)
        picked.append((a, d))
        cutoff = dev
        if a + 1 in a_range(d):
            heapq.heappush(heap, (deviation(a + 1, d), d, a + 1))
    # the exact order of the whole family's sort (ties included) on what the merge picked
    plans = [sequence(a, d) for a, d in picked]
    return sorted(plans, key=lambda S: (sum(abs(s - mean) for s in S), S))[:max_plans]


MAX_DFS_DEPTH = 256   # pipelines the template DFS walks while special groups are left (one frame each)


def _spend(budget: list[int] | None, visits: int) -> None:
    if budget is not None:
        budget[0] -= visits
        if budget[0] < 0:
            raise TooManyTemplates()


def dfs_templates(specials: Sequence[Group], stages: Sequence[int], authors: bool = False,
                  budget: list[int] | None = None) -> Iterator[Template]:
    """The authors' template DFS for one stage plan; `specials` sorted slowest first.

    `budget` is a one-element list of remaining visits, shared across calls; TooManyTemplates is
    raised when it runs out.
    """
    n, P = len(specials), len(stages)
    ys = [g.rate for g in specials]
    remaining_cap = [sum(stages[i:]) for i in range(P)] + [0]

    def rec(i: int, left: tuple[int, ...], prev_count: int, prev_first: float, acc: list) -> Iterator[Template]:
        if budget is not None:
            budget[0] -= 1
            if budget[0] < 0:
                raise TooManyTemplates()
        if i == P:
            if not left:
                yield tuple(acc)
            return
        if not left:   # the rest is all normal groups: one way, without one frame per pipeline
            _spend(budget, 2 * (P - i))      # what the frames would have counted
            yield tuple(acc) + tuple((NORMAL,) * stages[j] for j in range(i, P))
            return
        if i >= MAX_DFS_DEPTH:   # special groups spread over this many pipelines: past the DFS's reach
            raise TooManyTemplates()
        sym = authors or (i > 0 and stages[i] == stages[i - 1])
        max_c = min(stages[i], len(left), prev_count if sym and i > 0 else len(left))
        for c in range(max_c, -1, -1):
            if len(left) - c > remaining_cap[i + 1]:
                break
            for chosen in (itertools.combinations(left, c) if authors else _class_subsets(specials, left, c)):
                if budget is not None:
                    budget[0] -= 1
                    if budget[0] < 0:
                        raise TooManyTemplates()
                if sym and i > 0 and c == prev_count and c >= 1 and ys[chosen[0]] > prev_first:
                    continue
                rest = tuple(g for g in left if g not in chosen)
                pipe = tuple(chosen) + (NORMAL,) * (stages[i] - c)
                yield from rec(i + 1, rest, c, ys[chosen[0]] if c else float("inf"), acc + [pipe])
    yield from rec(0, tuple(range(n)), len(specials), float("inf"), [])


def _class_subsets(specials: Sequence[Group], left: Sequence[int], size: int) -> Iterator[tuple[int, ...]]:
    """The subsets of `left` of this size that differ in their classes (groups of one class are
    interchangeable: the first ones are taken), in the order of `itertools.combinations`: listing
    index combinations and skipping repeated classes would cost C(n, size) visits, not one per class mix."""
    runs: list[list[int]] = []
    for g in left:                       # sorted slowest first, so a class is one run
        if runs and specials[runs[-1][0]].cls == specials[g].cls:
            runs[-1].append(g)
        else:
            runs.append([g])

    def rec(r: int, need: int) -> Iterator[tuple[int, ...]]:
        if need == 0:
            yield ()
            return
        if r == len(runs) or need > sum(len(x) for x in runs[r:]):
            return
        for k in range(min(need, len(runs[r])), -1, -1):
            for tail in rec(r + 1, need - k):
                yield tuple(runs[r][:k]) + tail
    yield from rec(0, size)


def greedy_templates(specials: Sequence[Group], num_normal: int, num_pipelines: int) -> list[Template]:
    """Balanced stage counts with special groups dealt out in a snake (slowest first), so every
    pipeline gets a similar share of slow and fast groups. Two deals: plain, and with the stage
    counts ordered so that pipelines holding more special groups also have more stages."""
    n = len(specials) + num_normal
    P = num_pipelines
    if P < 1 or n < P:
        return []
    q, r = divmod(n, P)
    stages = [q + 1 if i < r else q for i in range(P)]
    out = []
    for rev in (False, True):
        st = stages[::-1] if rev else stages
        lists: list[list[int]] = [[] for _ in range(P)]
        order = list(range(P)) + list(range(P - 1, -1, -1))
        pos = 0
        for g in range(len(specials)):
            for _ in range(2 * P):
                i = order[pos % len(order)]
                pos += 1
                if len(lists[i]) < st[i]:
                    lists[i].append(g)
                    break
        t = tuple(tuple(lists[i]) + (NORMAL,) * (st[i] - len(lists[i])) for i in range(P))
        if t not in out:
            out.append(t)
    return out


def _moves(pipes: list[list[int]]) -> Iterator[tuple[int, int, int, int]]:
    """`improve`'s moves in its order, made as they are tried: (from pipeline a, special group x,
    to pipeline b, the placeholder or the special group y > x that x trades places with). Only
    pipelines holding special groups are sources, so thousands of all-normal pipelines cost little."""
    special = [[g for g in p if g != NORMAL] for p in pipes]
    has_normal = [NORMAL in p for p in pipes]
    for a, xs in enumerate(special):
        for b in (b for b in range(len(pipes)) if b != a) if xs else ():
            for x in xs:
                if has_normal[b]:
                    yield a, x, b, NORMAL
                yield from ((a, x, b, y) for y in special[b] if y > x)


def improve(template: Template, judge: TemplateScorer, max_evals: int = 200, deadline: Deadline = NEVER,
            reorder: bool = False) -> tuple[Template, Score | None]:
    """Bounded first-improvement local search: move one special group to another pipeline
    (trading places with a placeholder), or swap two special groups of different pipelines.
    Bounded by `max_evals` scored moves and by the search's deadline. With `reorder`, each
    candidate's stages are ordered as `reorder_stages` does before it is scored. `judge` scores
    templates over the grouping's special groups."""
    scorer, specials = judge.scorer, judge.specials
    best = judge.score(template)
    evals = 0
    improved = True
    settled: dict[tuple[int, ...], tuple[int, ...]] = {}
    ordering = scorer.for_pipelines(len(template))

    def settle(pipe: list[int]) -> tuple[int, ...]:
        """A pipeline's special groups in index order, then its placeholders (what the template
        generators build), with `reorder` its stages then reordered; each distinct pipeline once."""
        key = tuple(pipe)
        if key not in settled:
            canon = tuple(sorted(g for g in pipe if g != NORMAL)) + (NORMAL,) * pipe.count(NORMAL)
            settled[key] = _reorder_pipeline(ordering, canon, specials) if reorder else canon
        return settled[key]
    while improved and evals < max_evals:
        improved = False
        pipes = [list(p) for p in template]
        settled_pipes = [settle(p) for p in pipes]
        rows = [judge.row(p) for p in settled_pipes]
        for a, x, b, y in _moves(pipes):
            if evals >= max_evals or deadline.passed():
                break
            new_a, new_b = list(pipes[a]), list(pipes[b])
            new_a[new_a.index(x)] = y
            new_b[new_b.index(y)] = x
            new_a, new_b = settle(new_a), settle(new_b)
            cand = list(rows)    # the candidate differs in two pipelines: copy the others' rows
            cand[a], cand[b] = judge.row(new_a), judge.row(new_b)
            evals += 1
            s = scorer.score_rows(tuple(cand), below=math.inf if best is None else best.objective - 1e-9)
            if s is not None and (best is None or s.objective < best.objective - 1e-9):
                settled_pipes[a], settled_pipes[b] = new_a, new_b
                template, best, improved = tuple(settled_pipes), s, True
                break
    return template, best


# ----------------------------------------------------------------------------- concrete groups
def fill(template: Template, specials: Sequence[Group], normals: Sequence[Group],
         layers: Sequence[Sequence[int]],
         previous_ranges: Mapping[int, tuple[int, int]] | None = None) -> list[list[Group]]:
    """Put concrete normal groups into the placeholders.

    With a previous plan, each placeholder takes the free normal group whose devices already hold
    most of the slot's new layer range (the authors' IoU fill, measured in blocks
    that stay in place); otherwise, and for ties, a group on the same node as the previous stage
    (p2p locality), then the lowest node and device ids (determinism).

    Free groups are bucketed by their devices' previous ranges: within a bucket every group keeps
    the same blocks, so a pick compares one candidate per bucket (a few) instead of every free
    group (thousands at scale).
    """
    prev = previous_ranges or {}
    buckets: dict[tuple, list[Group]] = {}
    for g in sorted(normals, key=lambda g: (g.node, g.devices)):
        buckets.setdefault(tuple(prev.get(d) for d in g.devices), []).append(g)
    free = {sig: _FreeByNode(gs) for sig, gs in buckets.items()}
    out: list[list[Group]] = []
    for i, pipe in enumerate(template):
        start, row = 0, []
        for j, g in enumerate(pipe):
            lo, hi = start, start + layers[i][j]
            start = hi
            if g != NORMAL:
                row.append(specials[g])
                continue
            last_node = row[-1].node if row else None

            def key(sig: tuple) -> tuple:
                kept = sum(max(0, min(hi, r[1]) - max(lo, r[0])) for r in sig if r is not None)
                c = free[sig].peek(last_node)
                return (-kept, c.node != last_node, c.node, c.devices)
            sig = min((sig for sig, f in free.items() if f), key=key)
            row.append(free[sig].take(last_node))
        out.append(row)
    return out


class _FreeByNode:
    """Free groups of one bucket; `take` gives the min of (node != last_node, node, devices)
    without a scan: the first free group of `last_node`, else the first of the lowest node."""

    def __init__(self, free: Sequence[Group]):          # sorted by (node, devices)
        self.groups: dict[int, collections.deque] = {}
        for g in free:
            self.groups.setdefault(g.node, collections.deque()).append(g)
        self.nodes = collections.deque(sorted(self.groups))
        self.left = len(free)

    def __bool__(self) -> bool:
        return self.left > 0

    def peek(self, node: int | None) -> Group:
        if self.groups.get(node):
            return self.groups[node][0]
        while not self.groups[self.nodes[0]]:
            self.nodes.popleft()
        return self.groups[self.nodes[0]][0]

    def take(self, node: int | None) -> Group:
        g = self.peek(node)
        self.groups[g.node].popleft()
        self.left -= 1
        return g


def distinct_permutations(items: Sequence) -> Iterator[tuple]:
    """Each distinct ordering of a multiset once, in lexicographic order of its sorted values."""
    counts: dict = {}
    for i in items:
        counts[i] = counts.get(i, 0) + 1
    keys = sorted(counts)
    n = len(items)
    out: list = []

    def rec() -> Iterator[tuple]:
        if len(out) == n:
            yield tuple(out)
            return
        for k in keys:
            if counts[k]:
                counts[k] -= 1
                out.append(k)
                yield from rec()
                out.pop()
                counts[k] += 1
    yield from rec()
