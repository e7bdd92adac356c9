"""Simulated annealing over concrete pipelines: plan shapes the candidate family does not build.

Above WIDE_DEVICES devices a node's groupings are the authors' family (full groups, then a geometric
tail) and a pipeline's special groups sit first, slowest first. The best plans of paper-shaped
clusters are often deeper and more mixed: a TP8 group split into a four, pairs and single devices
that become consecutive stages, a straggler alone in a short stage, pipelines of different depth
side by side. From the search's best organisation, random moves:
  * regroup: a node that holds a straggler or an excluded device takes another of its groupings
    (`regroup_options`); its new groups join the pipelines that held its old ones, or any
    pipeline, or stay idle. A fifth of the moves (`KICK`) instead regroup a node of the slowest
    pipeline by rule: into the grouping that holds the most blocks just below that pipeline's
    bottleneck, what lowering it asks;
  * move a group to another pipeline, a new pipeline, or idle; swap two groups of different
    pipelines; an idle group back into a pipeline; merge two pipelines; split one in two;
each scored by the lower level with every pipeline's stages in their best order under the memory
caps (`Scorer.stage_order`). A worse candidate is accepted with probability exp(-worse / heat), the
heat falling from 1% to 0.01% of the energy over the run: whole blocks make the objective flat
across single moves, and the way to a better plan often passes an equal or slightly worse one.
Under 'paper' and 'bubble' the energy adds a relaxed objective (`Anneal.energy`) that tells apart
organisations of equal objective. Under 'paper' most candidates are refused before they are scored:
the acceptance draw is made first, and a lower bound (`Anneal._floor`: a changed pipeline priced
without memory caps) already passes what it accepts.
Without reshaping, the pipeline count stays and no node the start used is dropped whole; at most
`max_pipelines` pipelines.
Healthy nodes keep their full groups: under 'paper' splitting them too can beat even the
straggler-free plan, a reshaping of a whole healthy cluster that no straggler asks for.

The run's length is counted in scored candidates (at most MOVES moves each), so the refused ones
lengthen it for next to no time. The default search shares `search.ANNEAL_STEPS` among
`search.ANNEAL_CHAINS` runs from fixed seeds (one run under 'full'), so equal inputs give equal
plans (unless the search's time budget stops it first); `malleus bench planner-reference` scores
many more as the reference it is measured against.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Mapping, Sequence

from .budget import NEVER, Deadline
from .grouping import (Group, NodeOption, available_devices, every_grouping, is_straggler, node_options,
                       slowest_first)
from .lower import solve_micro_batches, uncapped_bottleneck
from .organize import Score, Scorer
from .problem import PlannerProblem

HEAT = (0.01, 0.0001)     # the heat's start and end, as a share of the energy
MOVES = 5                 # moves per scored candidate at most (`Anneal._run`)
KICK = 0.2                # share of moves that regroup a node of the slowest pipeline by rule (`_kick`)
RELAXED = 0.3             # weight of the relaxed objective in the energy under 'paper' and 'bubble' (`Anneal.energy`)


@dataclass(frozen=True)
class Organisation:
    rows: tuple[tuple[Group, ...], ...]   # per pipeline, its groups in their scored stage order
    idle: tuple[Group, ...]
    score: Score


def score_rows(scorer: Scorer, rows: Sequence[Sequence[Group]], idle: Sequence[Group]) -> Organisation | None:
    """The lower level of these pipelines, each in its best stage order; None if one does not fit."""
    rows = [r for r in rows if r]
    if not rows:
        return None
    ordered = tuple(_ordered(scorer.for_pipelines(len(rows)), r) for r in rows)
    full = scorer.objective == "full"
    s = scorer.score([[g.cls for g in r] for r in ordered],
                     [scorer.p2p(tuple(g.node for g in r), tuple(g.size for g in r)) for r in ordered] if full else None,
                     [[g.size for g in r] for r in ordered] if full else None)
    return None if s is None else Organisation(ordered, tuple(idle), s)


def _ordered(scorer: Scorer, row: Sequence[Group]) -> tuple[Group, ...]:
    """The row's groups in the order `stage_order` gives their classes (slowest first to start)."""
    row = sorted(row, key=slowest_first)
    pool: dict[tuple[float, int], list[Group]] = {}
    for g in row:
        pool.setdefault(g.cls, []).append(g)
    return tuple(pool[c].pop(0) for c in scorer.stage_order(tuple(g.cls for g in row)))


def irregular_nodes(problem: PlannerProblem) -> list[int]:
    """Nodes holding a straggler or an excluded device: the ones the default search regroups (a
    healthy node keeps its full groups, so a healthy cluster keeps the healthy layout)."""
    k = problem.gpus_per_node
    return [n for n in range(problem.num_nodes)
            if len(available_devices(problem, n)) < k or any(is_straggler(problem, d) for d in range(n * k, n * k + k))]


def regroup_options(problem: PlannerProblem, node: int,
                    roles: Mapping[int, tuple[int, int]] | None = None) -> list[NodeOption]:
    """The groupings a regrouped node may take: every one (`every_grouping`) where listing them is
    cheap, else the family's (`node_options`). Their number grows fast with the node's distinct
    straggler rates: on 8 devices 0.04 s at 4 rates, 0.5 s at 8; on 16 devices 0.04 s at 1, 6.6 s at 4."""
    rates = {problem.rates[d] for d in available_devices(problem, node) if is_straggler(problem, d)}
    if len(rates) <= (4 if problem.gpus_per_node <= 8 else 1):
        return every_grouping(problem, node, roles)
    return node_options(problem, node, previous_roles=roles)


class Anneal:
    """`regroup`: the nodes whose grouping may change (`irregular_nodes`; default: every node).
    `seed`: the first run's; a run after it takes the next."""

    def __init__(self, problem: PlannerProblem, scorer: Scorer, seed: int, max_pipelines: int,
                 regroup: Sequence[int] | None = None, roles: Mapping[int, tuple[int, int]] | None = None):
        self.problem, self.scorer, self.seed, self.roles = problem, scorer, seed, roles
        self.most = max_pipelines
        self._options: dict[int, list[NodeOption]] = {}
        self._known: tuple[Organisation | None, dict] = (None, {})   # an organisation, its pipelines' z
        self.nodes = [n for n in range(problem.num_nodes) if available_devices(problem, n)]
        self.regroup = [n for n in (self.nodes if regroup is None else regroup) if n in self.nodes]

    def run(self, rows: Sequence[Sequence[Group]], idle: Sequence[Group], steps: int,
            deadline: Deadline = NEVER, runs: int = 1) -> Organisation | None:
        """The best organisation met by `runs` runs from `rows` and `idle`, each from its own seed
        and `steps // runs` scored candidates (or until the deadline)."""
        found = [self._run(rows, idle, steps // runs, deadline) for _ in range(runs)]
        return min((o for o in found if o is not None), key=lambda o: o.score.objective, default=None)

    def _run(self, rows: Sequence[Sequence[Group]], idle: Sequence[Group], steps: int,
             deadline: Deadline) -> Organisation | None:
        """One run: the best organisation met in `steps` scored candidates. A move that yields no
        valid candidate, or one the floor refuses (`_floor`), costs next to nothing and is not
        counted, up to MOVES moves per step."""
        self.rng = random.Random(self.seed)
        self.seed += 1
        cur = score_rows(self.scorer, rows, idle)
        best = cur
        energy = self.energy
        self.pipelines = sum(1 for r in rows if r)
        self.used = {g.node for r in rows for g in r}
        scored = 0
        for _ in range(MOVES * steps if cur is not None else 0):
            if scored == steps or deadline.passed():
                break
            heat = HEAT[0] * (HEAT[1] / HEAT[0]) ** (scored / steps)
            if self.rng.random() < KICK and self.regroup:
                new = self._kick(cur)
            else:
                new = self._neighbour([list(r) for r in cur.rows], list(cur.idle))
            if new is None:
                continue
            # accepted at or below this: better, or worse by w with probability exp(-w / heat)
            limit = energy(cur.score) * (1 - heat * math.log(1 - self.rng.random()))
            if self._floor(cur, new[0]) > limit:
                continue
            scored += 1
            s = score_rows(self.scorer, *new)
            if s is not None and energy(s.score) <= limit:
                cur = s
                gain = best.score.objective - s.score.objective
                if gain > best.score.objective * 1e-9 or (gain >= 0 and self._tie(s.score) < self._tie(best.score)):
                    best = s
        return best

    def energy(self, score: Score) -> float:
        """What the annealing lowers: the objective, and under 'paper' and 'bubble' RELAXED times the
        relaxed one, M / Σ_i 1/z_i ('paper' with micro-batches split continuously, at most the
        objective). Whole blocks and micro-batches leave the objective flat across most moves; of two
        organisations of equal objective this prefers the one whose bottlenecks leave more room,
        from which a lower objective is fewer moves away."""
        return score.objective + self._tie(score)

    def _tie(self, score: Score) -> float:
        """The energy's part that tells equal objectives apart (none under 'full')."""
        return 0.0 if self.scorer.objective == "full" else RELAXED * self._relaxed(score.z)

    def _relaxed(self, z: Sequence[float]) -> float:
        return self.problem.num_micro_batches / sum(1 / v for v in z)

    def _floor(self, cur: Organisation, rows: Sequence[Sequence[Group]]) -> float:
        """A lower bound on these pipelines' energy under 'paper', cheap beside scoring them: the
        pipelines of `cur` at their bottleneck, a changed one at its bottleneck without memory caps,
        the micro-batches split without the bounds m_i >= S_i (both terms of the energy only fall
        as z does). Most candidates are refused on it.
        0 under 'bubble' and 'full': their fill and drain count the stages that hold blocks, which
        only the layout tells."""
        if self.scorer.objective != "paper":
            return 0.0
        if self._known[0] is not cur:     # a move leaves most pipelines as they were, groups in place
            self._known = (cur, {tuple(map(id, r)): z for r, z in zip(cur.rows, cur.score.z)})
        # a sharded state's caps depend on the pipeline count: z carries over only where they do not
        same_caps = self.scorer.for_pipelines(len(rows)) is self.scorer.for_pipelines(len(cur.rows))
        known, L = self._known[1] if same_caps else {}, self.problem.num_layers
        zs = [known.get(tuple(map(id, row))) or uncapped_bottleneck([g.rate for g in row], L) for row in rows]
        split = solve_micro_batches(zs, [1] * len(zs), self.problem.num_micro_batches, "paper")
        if split is None:       # more pipelines than micro-batches
            return math.inf
        return split.w + RELAXED * self._relaxed(zs)

    def options(self, node: int) -> list[NodeOption]:
        if node not in self._options:
            self._options[node] = regroup_options(self.problem, node, self.roles)
        return self._options[node]

    def _kick(self, org: Organisation) -> tuple[list[list[Group]], list[Group]] | None:
        """Regroup a node of the slowest pipeline into the grouping that holds the most blocks just
        below that pipeline's bottleneck z (each group ⌊z/y⌋, at most its memory cap mid-pipeline):
        what lowering z asks of it."""
        s = org.score
        slowest = max(range(len(org.rows)), key=lambda i: s.micro_batches[i] * s.z[i])
        row = org.rows[slowest]
        nodes = sorted({g.node for g in row} & set(self.regroup))
        if not nodes:
            return None
        n = self.rng.choice(nodes)
        level = s.z[slowest] * (1 - 1e-9)
        depth = len(row)
        scorer = self.scorer.for_pipelines(len(org.rows))

        def held(option) -> tuple[int, int]:
            total = 0
            for g in option.groups:
                cap = scorer.position_caps(g.h, depth)[depth // 2]
                total += max(0, min(cap, int(level // g.rate)))
            return total, -len(option.groups)
        best = max(self.options(n), key=held)
        rows = [[g for g in r if g.node != n] for r in org.rows]
        rows[slowest] += best.groups
        return self._valid(rows, [g for g in org.idle if g.node != n])

    def _neighbour(self, rows: list[list[Group]], idle: list[Group]) -> tuple[list[list[Group]], list[Group]] | None:
        rng, r = self.rng, self.rng.random()
        if r < 0.25:
            if not self.regroup:
                return None
            n = rng.choice(self.regroup)
            if len(self.options(n)) < 2:
                return None
            where = [i for i, row in enumerate(rows) for g in row if g.node == n] or list(range(len(rows)))
            rows = [[g for g in row if g.node != n] for row in rows]
            idle = [g for g in idle if g.node != n]
            for g in rng.choice(self.options(n)).groups:
                k = rng.random()
                if k < 0.1:
                    idle.append(g)
                else:
                    rows[rng.choice(where) if k < 0.6 else rng.randrange(len(rows))].append(g)
        elif r < 0.55:
            a = rng.randrange(len(rows))
            g = rows[a].pop(rng.randrange(len(rows[a])))
            k = rng.random()
            if k < 0.05:
                idle.append(g)
            elif k < 0.1:
                rows.append([g])
            else:
                rows[rng.randrange(len(rows))].append(g)
        elif r < 0.8:
            if len(rows) < 2:
                return None
            a, b = rng.sample(range(len(rows)), 2)
            i, j = rng.randrange(len(rows[a])), rng.randrange(len(rows[b]))
            rows[a][i], rows[b][j] = rows[b][j], rows[a][i]
        elif r < 0.9:
            if not idle:
                return None
            rows[rng.randrange(len(rows))].append(idle.pop(rng.randrange(len(idle))))
        elif r < 0.95:
            if len(rows) < 2:
                return None
            a, b = rng.sample(range(len(rows)), 2)
            rows[a] += rows[b]
            rows[b] = []
        else:
            a = rng.randrange(len(rows))
            if len(rows[a]) < 2:
                return None
            rng.shuffle(rows[a])
            k = rng.randrange(1, len(rows[a]))
            rows.append(rows[a][k:])
            rows[a] = rows[a][:k]
        return self._valid(rows, idle)

    def _valid(self, rows: list[list[Group]], idle: list[Group]) -> tuple[list[list[Group]], list[Group]] | None:
        """The candidate without its empty pipelines, or None where it breaks a rule: at most
        `max_pipelines`; without reshaping, the starting pipeline count and every node it used."""
        rows = [row for row in rows if row]
        if not rows or len(rows) > self.most:
            return None
        if not self.problem.allow_reshape and (len(rows) != self.pipelines
                                               or not self.used <= {g.node for row in rows for g in row}):
            return None
        return rows, idle
