"""The whole planner: the Malleus bi-level search, with fixes to the authors' code.

Upper level: per node a small family of groupings (`grouping.node_options`); a combination of one
option per node gives the set of groups; for each number of pipelines P in a small range, the
groups are organised into pipelines (`organize`). Lower level: ILP-1 per pipeline and ILP-2
(`lower`). Every combination is scored with the FULL lower level (the authors' code scores only the tail), not a
per-node proxy.

Small clusters (at most WIDE_DEVICES devices) get a wider family, each part of it a plan shape the
narrow one misses: every grouping of every node (healthy groups split around a straggler group, TP
degrees mixed), the slowest groups left idle as well as normal ones, every pipeline count up to the
device count and every stage plan (a straggler pipeline of its own beside a deep one), and each
pipeline's stages in their best order under the memory caps (`organize.reorder_stages`). Last, the
exhaustive search, bounded by the best plan found, checks the whole plan space for a better one
within a fixed number of nodes (`exhaustive.widen`, under the objectives it is exact for).

Where a node holds a straggler or an excluded device (up to ANNEAL_DEVICES devices), the best
organisation found is then
annealed over concrete groups (`anneal`): other groupings of those nodes, groups moved between
pipelines, pipelines merged and split, each pipeline's stages in their best order under the memory
caps. It reaches the deep mixed-TP plans the family does not build above WIDE_DEVICES devices.

Keeping it fast:
  * dominated node options are removed (same group sizes, elementwise no faster);
  * a set of groups whose classes (rate, memory factor; and node under 'full') were organised
    already is not organised again, and a pipeline count P is skipped when its bound cannot win;
  * combinations are enumerated best-first by total capacity C = Σ_g 1/y_g, which gives the
    lower bound M·L/C on every objective (z_i >= L / Σ_j 1/y_ij and w >= M / Σ_i 1/z_i); the
    enumeration stops as soon as the bound cannot beat the incumbent (within the 0.5% band kept
    for migration-aware tie-breaking when a previous plan is given);
  * beam: at most `max_combinations(problem)` combinations are scored (all of them for small
    clusters; fewer for large ones, in capacity order);
  * ILP-1 is memoised on the pipeline signature (y, h, extra).

Objectives ('paper', 'bubble', 'full') are those of `lower`; for 'full', z_ij includes the p2p
time of the stage's boundaries (intra- or inter-node, `organize.p2p_extras`), a pipeline's fill and
drain are its stages' own times, each block's gradient reduction starts once every stage holding it
has passed it in the last backward, and each stage then takes its optimizer step at its slowest
device's rate (`timing.iteration_time`). Those coupling terms are evaluated exactly (in `evaluate`
and when choosing among finalists) but optimised only through the candidate search, not inside the
ILPs.
"""
from __future__ import annotations

import collections
import heapq
import itertools
import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, Sequence

from ..plan import RECOMPUTE, Pipeline, Plan, PlanError, Stage
from .budget import NEVER, Deadline
from .grouping import WIDE_DEVICES, Group, NodeOption, group_rate, make_group, node_options, slowest_first
from .lower import bottleneck, lay_out, layer_caps, solve_micro_batches
from .organize import (NORMAL, Score, Scorer, Template, TemplateScorer, TooManyTemplates, dfs_templates, fill,
                       greedy_templates, improve, p2p_extras, reorder_stages, stage_plans)
from ..config.scenario import OBJECTIVES
from .problem import PlannerProblem
from .anneal import Anneal, irregular_nodes
from .timing import PipelineTimes, fill_drain, iteration_time
from ..costmodel.profile import RECOMPUTE_TIME_FACTOR, recompute_time_factor

NEAR_OPTIMAL = 0.005        # plans within 0.5% of the best compete on migration bytes
DFS_BUDGET = 4000           # DFS visits per (combination, P) before switching to the greedy generator
THOROUGH = 2                # best combinations (after the greedy pass) that also get the template DFS
THOROUGH_SMALL = 8          # the same on small clusters, where the greedy pass ranks the best one lower more
                            # often (`malleus bench planner --small 300` before the exhaustive check: 2 -> 8
                            # took the scenarios more than 1% above exhaustive from 8 to 5 of 600)
FINALISTS = 6               # organisations kept for concretisation
ANNEAL_STEPS = 1000         # candidates the annealing over concrete groups scores from the best finalist (`anneal`)
ANNEAL_CHAINS = 3           # independent runs that share them (seeds 0, 1, ...), under 'paper' and 'bubble' (`_annealed`)
ANNEAL_DEVICES = 256        # on clusters of at most this many devices: beyond, a move scores dozens of pipelines
                            # (7 ms a move at 1,024 devices) for plans the family already finds
WIDE_GROUPS = 16            # combinations of at most this many groups try every pipeline count


class InfeasibleError(ValueError):
    """No plan fits; the message says why and what would make it feasible."""


@dataclass
class PlannerResult:
    plan: Plan
    objective: float
    ideal_objective: float
    candidates: int                 # node-option combinations scored with the full lower level
    solve_seconds: float
    templates: int = 0              # pipeline organisations scored
    ilp1_calls: int = 0             # ILP-1 solves actually run (after memoisation)
    moved_bytes: float | None = None  # vs `previous`, when given
    notes: list[str] = field(default_factory=list)
    finalists: list[Plan] = field(default_factory=list)   # the concrete plans `plan` chose among


@dataclass(order=True)
class _Finalist:
    objective: float
    order: int
    template: Template = field(compare=False)
    specials: tuple[Group, ...] = field(compare=False)
    normals: tuple[Group, ...] = field(compare=False)
    score: Score = field(compare=False)


# ----------------------------------------------------------------------------- public API
def plan(problem: PlannerProblem, previous: Plan | None = None,
         score: Callable[[Plan], float] | None = None) -> PlannerResult:
    """The best plan for `problem`; with `previous`, among plans within 0.5% of the best objective
    the one moving the fewest bytes (so an unchanged situation returns the previous plan).

    `score`, when given, is a finer judge of a plan's iteration time (e.g. the 1F1B event
    simulator, which sees overlaps the analytic objective cannot) used to choose among the
    finalists; the search itself still runs on the analytic objective.

    The search stops at `problem.time_budget_s` (budget.py) with the best plan found by then, and
    says so in the result's notes and the plan's inputs.

    Where memory binds (no plan fits, or the plan fills a stage to its memory cap) and the memory
    model knows what a block saves for backward, the search runs again as if every stage recomputed
    its blocks (less memory, a third more compute). A recompute mode (none, selective, full) is then
    chosen stage by stage on that plan and on the one without it (`_relaid`), and the fastest of
    them is returned.
    """
    recomputing = _recomputing(problem)
    try:
        result = _plan_once(problem, previous, score)
    except InfeasibleError:
        if recomputing is None:
            raise
        return _recomputed(problem, _plan_once(recomputing, previous, score))
    if recomputing is None or not _fills_a_stage(problem, result.plan):
        return result
    options = [result, _recomputed(problem, result)]
    try:
        options.append(_recomputed(problem, _plan_once(recomputing, previous, score)))
    except InfeasibleError:
        pass
    return min(options, key=lambda r: r.objective)    # the first of equals: no recomputation


def _recomputing(problem: PlannerProblem) -> PlannerProblem | None:
    """`problem` with every stage recomputing its blocks, or None where memory cannot price it: its
    blocks a third slower is its communication a third faster in a t0 a third longer."""
    if not problem.memory.activation_mb:
        return None
    f, c = RECOMPUTE_TIME_FACTOR, problem.comm
    return replace(problem, memory=problem.memory.recomputing(problem.tp), t0_seconds=problem.t0_seconds * f,
                   comm=replace(c, p2p_intra_node=c.p2p_intra_node / f, p2p_inter_node=c.p2p_inter_node / f,
                                grad_sync_per_block=c.grad_sync_per_block / f))


def _caps(problem: PlannerProblem, plan: Plan, pipe: Pipeline, recompute: str = "none") -> tuple[int, ...]:
    """Each stage's memory cap on blocks in `plan` were it of recompute mode `recompute`."""
    memory = problem.memory.over(len(plan.pipelines))
    if recompute == "selective":
        memory = memory.selective()
    elif recompute == "full":
        memory = memory.recomputing(problem.tp)
    return layer_caps([problem.tp / s.tp for s in pipe.stages], problem.num_layers, memory)


def _fills_a_stage(problem: PlannerProblem, plan: Plan) -> bool:
    """Memory binds: some stage holds as many blocks as its memory allows (caps stop at all of them)."""
    return any(problem.num_layers > c <= s.num_layers
               for pipe in plan.pipelines for s, c in zip(pipe.stages, _caps(problem, plan, pipe)))


def _recomputed(problem: PlannerProblem, result: PlannerResult) -> PlannerResult:
    """The result's plan with each stage's recomputation and blocks chosen again (`_relaid`)."""
    chosen = result.plan
    pipes = tuple(_relaid(problem, chosen, pipe) for pipe in chosen.pipelines)
    modes = collections.Counter(s.recompute for pipe in pipes for s in pipe.stages)
    chosen = replace(chosen, pipelines=pipes)
    ideal = min(ideal_objective(problem), evaluate(_healthy(problem), chosen))
    chosen = _finish(problem, chosen, ideal, result.solve_seconds,
                     {**chosen.inputs, "recomputing_stages": modes["full"], "selective_stages": modes["selective"]})
    note = (f"memory binds: {modes['full']} stage(s) recompute their blocks in backward, {modes['selective']} "
            "their elementwise outputs")
    return replace(result, plan=chosen, objective=chosen.objective_value, ideal_objective=ideal,
                   notes=[*result.notes, note])


def _relaid(problem: PlannerProblem, plan: Plan, pipe: Pipeline) -> Pipeline:
    """The pipeline's blocks laid out again (ILP-1's min-max) with a recompute mode per stage
    (`plan.RECOMPUTE`): starting from the least that holds its blocks, change the stage whose change
    lowers the bottleneck most, while one does. Selective recomputation frees part of a stage's
    activations for a few elementwise passes; full, nearly all of them for a third longer blocks."""
    stages = pipe.stages
    rates = [group_rate(problem, s.devices) for s in stages]
    extra = list(p2p_extras(problem, [plan.node_of(s.devices[0]) for s in stages], [s.tp for s in stages])
                 if problem.objective == "full" else [0.0] * len(stages))
    caps = {m: _caps(problem, plan, pipe, m) for m in RECOMPUTE}

    def lay(modes: list[str]) -> tuple[float, list[int]] | None:
        a = [y * recompute_time_factor(m) for y, m in zip(rates, modes)]
        hi = [caps[m][j] for j, m in enumerate(modes)]
        z = bottleneck(a, hi, problem.num_layers, extra, min_layers=1)
        return None if z is None else (z, lay_out(a, extra, hi, z, problem.num_layers, min_layers=1))

    modes = [next((m for m in RECOMPUTE if caps[m][j] >= s.num_layers), "full") for j, s in enumerate(stages)]
    best = lay(modes)
    while best is not None:
        tries = [(lay(t), t) for t in ([*modes[:j], m, *modes[j + 1:]] for j in range(len(modes))
                                       for m in RECOMPUTE if m != modes[j])]
        got, t = min(((z, t) for z, t in tries if z is not None), key=lambda zt: zt[0][0], default=(None, None))
        if got is None or got[0] >= best[0] * (1 - 1e-9):
            break
        best, modes = got, t
    if best is None:
        return pipe
    # the layout found, each stage in the least mode that holds its blocks (a stage off the
    # bottleneck may need less than the mode it started in; under 'full' its time still counts)
    modes = [next(m for m in RECOMPUTE if caps[m][j] >= n) for j, n in enumerate(best[1])]
    bounds = [0, *itertools.accumulate(best[1])]
    return replace(pipe, stages=tuple(replace(s, layers=(a, b), recompute=m)
                                      for s, a, b, m in zip(stages, bounds, bounds[1:], modes)))


def _plan_once(problem: PlannerProblem, previous: Plan | None,
               score: Callable[[Plan], float] | None) -> PlannerResult:
    if problem.search == "exhaustive":
        from .exhaustive import plan_exhaustive   # it builds on this module's helpers
        return plan_exhaustive(problem, previous, score)
    t_start = time.perf_counter()
    _check_problem(problem)
    deadline = Deadline(problem.time_budget_s)
    prev = previous if _compatible(problem, previous) else None
    ctx = _PrevInfo(prev)
    scorer = Scorer(problem)
    per_node = [node_options(problem, n, ctx.groups, ctx.roles) for n in range(problem.num_nodes)]
    fixed = [opts[0] for opts in per_node if len(opts) == 1]
    varying = [opts for opts in per_node if len(opts) > 1]
    band = NEAR_OPTIMAL if prev is not None else 0.0
    finalists: list[_Finalist] = []
    best = math.inf
    combos = 0
    templates = [0]
    limit = max_combinations(problem, sum(len(o.groups) for o in fixed) + sum(len(v[0].groups) for v in varying))
    base_capacity = sum(o.capacity for o in fixed)
    screened: list[tuple[float, int, list[Group]]] = []
    organised: set[tuple] = set()
    for choice in _best_first(varying):   # pass 1: every combination, greedy organisation
        capacity = base_capacity + sum(o.capacity for o in choice)
        if capacity <= 0 or lower_bound(problem, capacity) > best * (1 + band) + 1e-9:
            break
        if combos >= limit or (combos and deadline.passed()):
            break
        combos += 1
        for groups in _idle_variants(problem, [g for o in (*fixed, *choice) for g in o.groups]):
            most = min(len(groups), max_pipelines(problem))
            if lower_bound(problem, sum(1.0 / g.rate for g in groups), most) > best * (1 + band) + 1e-9:
                continue      # idle groups lower the capacity: this variant cannot win
            if _signature(problem, groups) in organised:
                continue      # the same classes as groups organised already (the first, best-first, is kept)
            organised.add(_signature(problem, groups))
            fs = _organise(problem, scorer, groups, _pipeline_counts(problem, len(groups)), templates, thorough=False,
                           deadline=deadline, cutoff=best * (1 + band) + 1e-9)
            finalists.extend(fs)
            v = min((f.objective for f in fs), default=math.inf)
            best = min(best, v)
            screened.append((v, combos, groups))
    thorough = THOROUGH_SMALL if _is_small(problem) else THOROUGH
    for v, _, groups in sorted(screened, key=lambda t: t[:2])[:thorough]:   # pass 2: the DFS
        if v < math.inf and not deadline.passed():
            finalists.extend(_organise(problem, scorer, groups, _pipeline_counts(problem, len(groups)), templates,
                                       deadline=deadline))
    finalists = _diverse(finalists)
    if not finalists:
        finalists = _fallback(problem, scorer, per_node, templates, deadline)
    if not finalists:
        raise InfeasibleError(_why_none(deadline, problem, [g for o in per_node for g in o[0].groups]))
    finalists += _annealed(problem, scorer, min(finalists), ctx, deadline)
    plans = [_concretise(problem, scorer, f, ctx) for f in finalists]
    plans = [p for p in plans if p is not None]
    notes = _budget_notes(deadline, combos)
    if plans and not deadline.passed():
        from .exhaustive import widen   # small clusters only; it builds on this module's helpers
        better, note = widen(problem, min(evaluate(problem, p) for p in plans))
        plans += [better] if better is not None else []
        notes += [note] if note else []
    if prev is not None:
        plans += [p for p in (_reuse(problem, prev), _safe_rebalance(problem, prev)) if p is not None]
    chosen, moved = _choose(problem, plans, prev, score)
    # the chosen plan on healthy devices bounds the ideal too (past the deadline the ideal is the
    # greedy organisation's, and the annealing reaches plans outside the family)
    ideal = min(ideal_objective(problem, deadline), evaluate(_healthy(problem), chosen))
    elapsed = time.perf_counter() - t_start
    chosen = _finish(problem, chosen, ideal, elapsed, {"pipelines": len(chosen.pipelines), "candidates": combos,
                                                       **_budget_note(deadline)})
    return PlannerResult(chosen, chosen.objective_value, ideal, combos, elapsed, templates[0],
                         scorer.ilp1_calls, moved, notes, plans)


def evaluate(problem: PlannerProblem, plan: Plan) -> float:
    """Objective of `plan` under `problem`'s rates (same definition as the planner's)."""
    times = [_stage_times(problem, plan, pipe) for pipe in plan.pipelines]
    if problem.objective == "full":
        return iteration_time(problem, [PipelineTimes(p.micro_batches, t, tuple(s.num_layers for s in p.stages),
                                                      tuple(s.tp for s in p.stages),
                                                      tuple(s.recompute for s in p.stages),
                                                      tuple(group_rate(problem, s.devices) for s in p.stages))
                                        for p, t in zip(plan.pipelines, times)])
    if problem.objective == "paper":
        return max(p.micro_batches * max(t) for p, t in zip(plan.pipelines, times))
    return max((p.micro_batches + len(p.stages) - 1) * max(t) for p, t in zip(plan.pipelines, times))


def check_plan_fits(problem: PlannerProblem, plan: Plan, where: str = "plan") -> Plan:
    """A plan made elsewhere (a file, a checkpoint) against the problem: the same cluster, model and
    batch, no excluded device in a stage, and every stage a TP group the problem prices (tp / 2^r
    devices on one node). PlanError says what differs."""
    pairs = (("devices", plan.num_devices, problem.num_devices),
             ("gpus_per_node", plan.gpus_per_node, problem.gpus_per_node),
             ("layers", plan.num_layers, problem.num_layers),
             ("micro_batch_size", plan.micro_batch_size, problem.micro_batch_size),
             ("micro-batches", plan.num_micro_batches, problem.num_micro_batches))
    found = [f"{what} {mine}, the scenario has {theirs}" for what, mine, theirs in pairs if mine != theirs]
    excluded = sorted(set(plan.active_devices) & problem.excluded)
    if excluded:
        found.append(f"it trains on excluded devices {excluded}")
    sizes = problem.tp_sizes
    for i, pipe in enumerate(plan.pipelines):
        for j, st in enumerate(pipe.stages):
            nodes = sorted({plan.node_of(d) for d in st.devices})
            if st.tp not in sizes or len(nodes) > 1:
                found.append(f"pipeline {i} stage {j} has {st.tp} devices on node(s) {nodes}, where a stage is "
                             f"a TP group of {' or '.join(map(str, sizes))} devices on one node")
    if found:
        raise PlanError(f"{where} {plan.plan_id} does not fit the scenario: " + "; ".join(found[:3]))
    return plan


def _stage_times(problem: PlannerProblem, plan: Plan, pipe: Pipeline) -> tuple[float, ...]:
    """t0 per micro-batch of each stage: blocks × group rate, plus its p2p under 'full'."""
    nodes = [plan.node_of(s.devices[0]) for s in pipe.stages]
    ex = (p2p_extras(problem, nodes, [s.tp for s in pipe.stages]) if problem.objective == "full"
          else (0.0,) * len(nodes))
    return tuple(group_rate(problem, s.devices) * s.num_layers * recompute_time_factor(s.recompute)
                 + e for s, e in zip(pipe.stages, ex))


def memory_violations(problem: PlannerProblem, plan: Plan) -> list[str]:
    """Stages whose blocks exceed the memory cap of the Malleus memory model (empty = the plan fits)."""
    out = []
    for i, pipe in enumerate(plan.pipelines):
        caps = {m: _caps(problem, plan, pipe, m) for m in {s.recompute for s in pipe.stages}}
        for j, s in enumerate(pipe.stages):
            c = caps[s.recompute][j]
            if s.num_layers > c:
                out.append(f"pipeline {i} stage {j}: {s.num_layers} blocks at TP {s.tp}, memory allows {c}")
    return out


def homogeneous_plan(problem: PlannerProblem, devices: Sequence[int], P: int, tp: int, pp: int) -> Plan:
    """P pipelines of pp stages of tp consecutive `devices` (Megatron order); blocks and micro-batches
    spread evenly (the remainder of blocks to the last stages, of micro-batches to the first pipelines)."""
    L, M = problem.num_layers, problem.num_micro_batches
    base, rem = divmod(L, pp)
    counts = [base + (1 if j >= pp - rem else 0) for j in range(pp)]
    mb, mrem = divmod(M, P)
    pipes, used = [], set()
    for i in range(P):
        stages, start = [], 0
        for j in range(pp):
            devs = tuple(devices[(i * pp + j) * tp:(i * pp + j + 1) * tp])
            used.update(devs)
            stages.append(Stage(devs, (start, start + counts[j])))
            start += counts[j]
        pipes.append(Pipeline(tuple(stages), mb + (1 if i < mrem else 0)))
    rest = tuple(d for d in range(problem.num_devices) if d not in used and d not in problem.excluded)
    return Plan(problem.num_devices, L, problem.micro_batch_size, tuple(pipes), rest,
                tuple(sorted(problem.excluded)), problem.gpus_per_node, problem.objective)


def baseline_plan(problem: PlannerProblem) -> Plan:
    """The healthy homogeneous dp×tp×pp layout (Megatron order), ignoring rates."""
    n = problem.dp * problem.tp * problem.pp
    if n > problem.num_devices:
        raise InfeasibleError(f"the baseline layout needs dp*tp*pp = {n} devices, the cluster has "
                              f"{problem.num_devices}")
    clash = sorted(set(range(n)) & set(problem.excluded))
    if clash:
        raise InfeasibleError(f"the baseline layout needs devices {clash}, which are excluded")
    p = homogeneous_plan(problem, range(n), problem.dp, problem.tp, problem.pp)
    return _finish(problem, p, None, 0.0, {"mode": "baseline"})


def rebalance_data(problem: PlannerProblem, plan: Plan) -> Plan:
    """Data-only re-balancing: same groups and layers, micro-batches re-solved (ILP-2)."""
    times = [_stage_times(problem, plan, pipe) for pipe in plan.pipelines]
    data = solve_micro_batches([max(t) for t in times], [len(p.stages) for p in plan.pipelines],
                               problem.num_micro_batches, problem.objective, solver=problem.solver,
                               prefer=[p.micro_batches for p in plan.pipelines],
                               fill=[fill_drain(t) for t in times] if problem.objective == "full" else None)
    if data is None:
        raise InfeasibleError(f"{problem.num_micro_batches} micro-batches cannot cover pipelines of "
                              f"{[len(p.stages) for p in plan.pipelines]} stages (the 'paper' objective needs "
                              f"m_i >= S_i): use a larger global batch or fewer stages")
    pipes = tuple(replace(p, micro_batches=m) for p, m in zip(plan.pipelines, data.micro_batches))
    return _finish(problem, replace(plan, pipelines=pipes), None, 0.0, {"mode": "rebalance_data"})


def plan_without_split(problem: PlannerProblem, previous: Plan | None = None) -> PlannerResult:
    """Layers and data re-planned with the groups kept whole (the previous plan's groups, else the
    baseline's): no splitting, no suspension by the grouping, P fixed (stages given 0 blocks by
    ILP-1 are still dropped)."""
    t_start = time.perf_counter()
    _check_problem(problem)
    deadline = Deadline(problem.time_budget_s)
    prev = previous if _compatible(problem, previous) else None
    if prev is not None:
        devsets = [s.devices for p in prev.pipelines for s in p.stages]
        P = len(prev.pipelines)
    else:
        k = problem.tp
        devsets = [tuple(range(s, s + k)) for s in range(0, problem.num_devices - k + 1, k)]
        P = problem.dp
    groups = [make_group(problem, d) for d in devsets if not set(d) & set(problem.excluded)]
    scorer = Scorer(problem)
    templates = [0]
    finalists = sorted(_organise(problem, scorer, groups, [P], templates, deadline=deadline))[:FINALISTS]
    if not finalists:
        finalists = sorted(_organise(problem, scorer, groups, list(range(P - 1, 0, -1)), templates,
                                     deadline=deadline))[:FINALISTS]
    if not finalists:
        raise InfeasibleError(_why_none(deadline, problem, groups))
    ctx = _PrevInfo(prev)
    plans = [p for p in (_concretise(problem, scorer, f, ctx) for f in finalists) if p is not None]
    chosen, moved = _choose(problem, plans, prev)
    ideal = ideal_objective(problem, deadline)
    elapsed = time.perf_counter() - t_start
    chosen = _finish(problem, chosen, ideal, elapsed, {"mode": "without_split", **_budget_note(deadline)})
    return PlannerResult(chosen, chosen.objective_value, ideal, 1, elapsed, templates[0], scorer.ilp1_calls, moved,
                         _budget_notes(deadline, 1))


def ideal_objective(problem: PlannerProblem, deadline: Deadline = NEVER) -> float:
    """The best objective of the same cluster with every device healthy and none excluded (past the
    search's deadline: of its greedy organisation, an upper bound)."""
    healthy = _healthy(problem)
    scorer = Scorer(healthy)
    groups = [g for n in range(healthy.num_nodes) for o in node_options(healthy, n)[:1] for g in o.groups]
    fs = _organise(healthy, scorer, groups, _pipeline_counts(healthy, len(groups)), [0], deadline=deadline)
    return min((f.objective for f in fs), default=math.inf)


def _healthy(problem: PlannerProblem) -> PlannerProblem:
    return replace(problem, rates=(1.0,) * problem.num_devices, excluded=frozenset())


def lower_bound(problem: PlannerProblem, capacity: float, pipelines: int | None = None) -> float:
    """No organisation of groups with this total capacity C = Σ_g 1/y_g into at most `pipelines`
    pipelines (default `max_pipelines`) can do better.

    'paper': M·L/C. With fill and drain ('bubble', 'full'): a pipeline takes at least
    (m_i - 1)·z_i + Σ_j y_ij·l_ij >= (m_i - 1)·L/c_i + L (every y >= 1), so summing m_i - 1 <= (w - L)·c_i/L
    over the P pipelines gives w >= L + (M - P)·L/C; and it takes at least m_i·z_i, so M·L/C holds too."""
    L, M = problem.num_layers, problem.num_micro_batches
    if problem.objective == "paper":
        return M * L / capacity
    P = max_pipelines(problem) if pipelines is None else pipelines
    return max(M * L / capacity, L + max(0, M - P) * L / capacity)


def max_pipelines(problem: PlannerProblem) -> int:
    """The most pipelines any organisation may have (`_pipeline_counts` never goes beyond it): twice
    the baseline's; on small clusters as many as devices (with fill and drain priced, many shallow
    pipelines can beat the baseline's few deep ones when memory allows)."""
    if not problem.allow_reshape:
        return problem.dp
    return max(2 * problem.dp, problem.num_devices) if _is_small(problem) else 2 * problem.dp


def _is_small(problem: PlannerProblem) -> bool:
    """Small enough for the wider enumeration (every pipeline count, stage plan and grouping)."""
    return problem.num_devices <= WIDE_DEVICES


def max_combinations(problem: PlannerProblem, num_groups: int) -> int:
    """The beam: how many node-option combinations get the full lower level. All (up to 512) on
    small clusters; on large ones the lower level costs more, so fewer, in capacity order."""
    return 512 if _is_small(problem) else max(8, min(512, 2000 // max(1, num_groups)))


# ----------------------------------------------------------------------------- internals
class _PrevInfo:
    """What the previous plan says about each device: its group, TP slot and layer range."""

    def __init__(self, prev: Plan | None):
        self.plan = prev
        self.groups: dict[int, tuple[int, ...]] = {}
        self.roles: dict[int, tuple[int, int]] = {}
        self.ranges: dict[int, tuple[int, int]] = {}
        self.stage_layers: dict[frozenset, int] = {}
        if prev is None:
            return
        for pipe in prev.pipelines:
            for st in pipe.stages:
                self.stage_layers[frozenset(st.devices)] = st.num_layers
                for r, d in enumerate(st.devices):
                    self.groups[d] = st.devices
                    self.roles[d] = (r, st.tp)
                    self.ranges[d] = st.layers


def _check_problem(problem: PlannerProblem) -> None:
    if len(problem.rates) != problem.num_devices:
        raise ValueError(f"rates has {len(problem.rates)} entries, the cluster has {problem.num_devices} devices")
    if problem.objective not in OBJECTIVES:
        raise ValueError(f"objective {problem.objective!r} is not one of {OBJECTIVES}")
    bad = [d for d, x in enumerate(problem.rates) if not (x > 0 and math.isfinite(x))]
    if bad:
        raise ValueError(f"rates must be positive and finite; devices {bad[:8]} are not")
    if problem.tp & (problem.tp - 1) or problem.gpus_per_node % problem.tp:
        raise ValueError(f"tp={problem.tp} must be a power of two dividing gpus_per_node={problem.gpus_per_node}")
    if len(problem.tp_alpha) < problem.max_split + 1:
        raise ValueError(f"tp_alpha needs {problem.max_split + 1} entries (group sizes {problem.tp}..1), "
                         f"got {len(problem.tp_alpha)}")


def _compatible(problem: PlannerProblem, prev: Plan | None) -> bool:
    return (prev is not None and prev.num_devices == problem.num_devices
            and prev.num_layers == problem.num_layers and prev.gpus_per_node == problem.gpus_per_node)


def _best_first(varying: list[list[NodeOption]]) -> Iterator[tuple[NodeOption, ...]]:
    """Combinations of one option per node in increasing total capacity loss (options are sorted
    by capacity, descending). Each combination is reached by exactly one path that increments
    node positions in non-decreasing order, so none is produced twice."""
    n = len(varying)
    loss = [[opts[0].capacity - o.capacity for o in opts] for opts in varying]
    heap = [(0.0, (0,) * n, 0)]
    while heap:
        total, idx, last = heapq.heappop(heap)
        yield tuple(varying[v][i] for v, i in enumerate(idx))
        for v in range(last, n):
            if idx[v] + 1 < len(varying[v]):
                nxt = idx[:v] + (idx[v] + 1,) + idx[v + 1:]
                heapq.heappush(heap, (total - loss[v][idx[v]] + loss[v][idx[v] + 1], nxt, v))


def _idle_variants(problem: PlannerProblem, groups: list[Group]) -> Iterator[list[Group]]:
    """The groups, and on small clusters the same with 1, 2, ... normal groups idle, and with the
    1, 2, ... slowest groups idle: with few micro-batches ('paper' asks m_i >= S_i) fewer and
    shallower pipelines can beat using every group, and a slow stage can cost more than it adds."""
    yield groups
    if not _is_small(problem):
        return
    seen = {tuple(range(len(groups)))}
    normals = [i for i, g in enumerate(groups) if g.is_normal]
    fastest_first = sorted(range(len(groups)), key=lambda i: (groups[i].rate, groups[i].h))
    kept_sets = [[i for i in range(len(groups)) if i not in set(normals[-k:])] for k in range(1, len(normals) + 1)]
    kept_sets += [sorted(fastest_first[:k]) for k in range(len(groups) - 1, 0, -1)]
    for kept in kept_sets:
        if kept and tuple(kept) not in seen:
            seen.add(tuple(kept))
            yield [groups[i] for i in kept]


def _signature(problem: PlannerProblem, groups: Sequence[Group]) -> tuple:
    """What the organisation sees of a set of groups: their classes, and under 'full' which of them
    share a node (p2p prices a boundary by whether its two stages do, never by which node it is):
    the multiset of each node's classes, so sets alike up to renumbering nodes are organised once."""
    if problem.objective != "full":
        return tuple(sorted((g.rate, g.h) for g in groups))
    nodes: dict[int, list[tuple[float, int]]] = {}
    for g in groups:
        nodes.setdefault(g.node, []).append((g.rate, g.h))
    return tuple(sorted(tuple(sorted(c)) for c in nodes.values()))


def _pipeline_counts(problem: PlannerProblem, num_groups: int) -> list[int]:
    """P values to try: the baseline dp, and with reshaping dp±1 and divisors of the group count
    within a factor 2 of dp (those give equal stage counts), and every P for few groups."""
    dp = problem.dp
    ps = {dp}
    if problem.allow_reshape:
        ps |= {dp - 1, dp + 1}
        ps |= {d for d in range(max(1, dp // 2), 2 * dp + 1) if num_groups % d == 0}
        if num_groups <= WIDE_GROUPS:    # small: every pipeline count, deeper or shallower than the baseline
            ps |= set(range(1, num_groups + 1))
    return sorted((p for p in ps if 1 <= p <= min(num_groups, max_pipelines(problem))), key=lambda p: (abs(p - dp), p))


def _organise(problem: PlannerProblem, scorer: Scorer, groups: Sequence[Group], counts: Sequence[int],
              templates: list[int], authors: bool = False, thorough: bool = True,
              deadline: Deadline = NEVER, cutoff: float = math.inf) -> list[_Finalist]:
    """The best organisations of `groups` into P pipelines, for each P in `counts`: the template
    DFS (`thorough`, falling back to greedy past its visit budget) or the greedy generator alone.
    A P whose lower bound exceeds `cutoff` is skipped.
    Past the deadline: no DFS, no local search, and no P after the first."""
    # Slowest first. The authors sort stably by rate alone (emission order: node, full
    # groups, tail); we break ties by memory factor so that the groups needing the most memory
    # per block sit deeper in the pipeline, where fewer micro-batches are in flight.
    key = (lambda g: -g.rate) if authors else slowest_first
    specials = tuple(sorted((g for g in groups if not g.is_normal), key=key))
    normals = tuple(g for g in groups if g.is_normal)
    # small clusters: each pipeline's stages in their best order under the memory caps, where that
    # scores better (on large ones only the annealing's pipelines are ordered so)
    reorder = _is_small(problem)
    judge = TemplateScorer(scorer, specials, problem.tp)   # one per grouping: its pipelines' rows shared
    out: list[_Finalist] = []
    capacity = sum(1.0 / g.rate for g in groups)
    for i, P in enumerate(counts):
        if i and deadline.passed():
            break
        if capacity > 0 and lower_bound(problem, capacity, P) > cutoff:
            continue
        found: list[_Finalist] = []
        budget = [DFS_BUDGET if thorough else -1]
        try:
            if not thorough or deadline.passed():
                raise TooManyTemplates()
            for S in stage_plans(len(groups), P, problem.pp, authors=authors, every=_is_small(problem)):
                for t in dfs_templates(specials, S, authors=authors, budget=budget):
                    if deadline.passed():
                        if found:
                            break
                        raise TooManyTemplates()
                    templates[0] += 1
                    t, s = _arranged(judge, t, reorder)
                    if s is not None:
                        found.append(_Finalist(s.objective, len(found), t, specials, normals, s))
        except TooManyTemplates:
            for t0 in greedy_templates(specials, len(normals), P):
                t0, _ = _arranged(judge, t0, reorder)
                t, s = improve(t0, judge, max_evals=_local_search_evals(problem, thorough),
                               deadline=deadline, reorder=reorder)
                templates[0] += 1
                if s is not None:
                    found.append(_Finalist(s.objective, len(found), t, specials, normals, s))
        out.extend(sorted(found)[:FINALISTS])
    return out


def _annealed(problem: PlannerProblem, scorer: Scorer, f: _Finalist, ctx: _PrevInfo,
              deadline: Deadline) -> list[_Finalist]:
    """The best finalist improved by simulated annealing over concrete groups (`anneal`), if it
    improves: deeper, more mixed pipelines than the family builds on large clusters."""
    irregular = irregular_nodes(problem)
    if deadline.passed() or not irregular or problem.num_devices > ANNEAL_DEVICES:
        return []
    rows = fill(f.template, f.specials, f.normals, f.score.layers, ctx.ranges)
    used = {g.devices for r in rows for g in r}
    idle = [g for g in (*f.specials, *f.normals) if g.devices not in used]
    # Single runs decide single cases: several shorter ones find better plans than one long one.
    # Under 'full' one run: its objective only approximates the event simulator, where three shorter
    # runs' plans of the reference bench's 30 scenarios were faster on 8 and slower on 2 (by
    # 0.03-0.14%; one of them slower than with no annealing at all).
    runs = 1 if scorer.objective == "full" else ANNEAL_CHAINS
    org = Anneal(problem, scorer, 0, max_pipelines(problem), irregular, ctx.roles).run(rows, idle, ANNEAL_STEPS,
                                                                                     deadline, runs)
    if org is None or org.score.objective >= f.objective * (1 - 1e-9):
        return []
    groups = [g for r in (*org.rows, org.idle) for g in r]
    specials = tuple(sorted((g for g in groups if not g.is_normal), key=slowest_first))
    index = {g.devices: i for i, g in enumerate(specials)}
    template = tuple(tuple(NORMAL if g.is_normal else index[g.devices] for g in r) for r in org.rows)
    normals = tuple(g for g in groups if g.is_normal)
    return [_Finalist(org.score.objective, -1, template, specials, normals, org.score)]


def _arranged(judge: TemplateScorer, t: Template, reorder: bool) -> tuple[Template, Score | None]:
    """The template or its stages reordered (`reorder_stages`), whichever scores better: the order
    of least bottleneck is not always the best one where fill, drain and p2p are priced ('full')."""
    s = judge.score(t)
    a = reorder_stages(judge.scorer, t, judge.specials) if reorder else t
    if a == t:
        return t, s
    sa = judge.score(a)
    return (a, sa) if sa is not None and (s is None or sa.objective < s.objective) else (t, s)


def _local_search_evals(problem: PlannerProblem, thorough: bool) -> int:
    """Moves the local search may score per greedy template. The screening pass on small clusters
    scores none: it screens many more groupings there, and the DFS of the thorough pass walks
    every stage plan. (Half of these on large clusters, the annealing after it moving the same
    groups, cut the slowest 64-device plan under 'full' from 1.6 to 1.1 s, but left 3 of 10 plans of
    `malleus bench planner --objective full` at 64 and 256 devices 0.1-0.3% slower.)"""
    if thorough:
        return 200
    return 0 if _is_small(problem) else 40


def _fallback(problem: PlannerProblem, scorer: Scorer, per_node: list[list[NodeOption]],
              templates: list[int], deadline: Deadline) -> list[_Finalist]:
    """Nothing fit with the usual pipeline counts: try fewer pipelines (deeper pipelines hold
    more blocks in total), best-capacity option per node."""
    groups = [g for opts in per_node for g in opts[0].groups]
    tried = set(_pipeline_counts(problem, len(groups)))
    rest = [p for p in range(min(problem.dp, len(groups)), 0, -1) if p not in tried]
    return sorted(_organise(problem, scorer, groups, rest, templates, deadline=deadline))[:FINALISTS]


def _concretise(problem: PlannerProblem, scorer: Scorer, f: _Finalist, ctx: _PrevInfo) -> Plan | None:
    """A finalist organisation as a Plan: concrete normal groups, layers re-solved with the exact
    p2p terms ('full') and preferring the previous plan's layer counts, 0-block stages dropped."""
    rows = fill(f.template, f.specials, f.normals, f.score.layers, ctx.ranges)
    extras = ([p2p_extras(problem, [g.node for g in row], [g.size for g in row]) for row in rows]
              if problem.objective == "full" else None)
    prefer = [[ctx.stage_layers.get(frozenset(g.devices), l) for g, l in zip(row, ls)]
              for row, ls in zip(rows, f.score.layers)] if ctx.plan is not None else None
    prev_m = ([p.micro_batches for p in ctx.plan.pipelines]
              if ctx.plan is not None and len(ctx.plan.pipelines) == len(rows) else None)
    s = scorer.score([[g.cls for g in row] for row in rows], extras,
                     [[g.size for g in row] for row in rows], prefer, prev_m)
    return None if s is None else assemble(problem, rows, s.layers, s.micro_batches)


def assemble(problem: PlannerProblem, rows: Sequence[Sequence[Group]], layers: Sequence[Sequence[int]],
             micro_batches: Sequence[int]) -> Plan:
    """Pipelines of these groups holding these block counts (0-block stages dropped); every other
    usable device suspended."""
    pipes = []
    for row, ls, m in zip(rows, layers, micro_batches):
        stages, start = [], 0
        for g, l in zip(row, ls):
            if l > 0:
                stages.append(Stage(g.devices, (start, start + l)))
                start += l
        pipes.append(Pipeline(tuple(stages), m))
    used = {d for p in pipes for d in p.devices}
    suspended = tuple(d for d in range(problem.num_devices) if d not in used and d not in problem.excluded)
    return Plan(problem.num_devices, problem.num_layers, problem.micro_batch_size, tuple(pipes), suspended,
                tuple(sorted(problem.excluded)), problem.gpus_per_node, problem.objective)


def _reuse(problem: PlannerProblem, prev: Plan) -> Plan | None:
    """The previous plan as it is, if it is still valid (no excluded device in it, memory fits)."""
    active = set(prev.active_devices)
    if active & set(problem.excluded) or memory_violations(problem, prev):
        return None
    try:
        return Plan(problem.num_devices, problem.num_layers, problem.micro_batch_size, prev.pipelines,
                    tuple(d for d in range(problem.num_devices) if d not in active and d not in problem.excluded),
                    tuple(sorted(problem.excluded)), problem.gpus_per_node, problem.objective)
    except ValueError:
        return None


def _safe_rebalance(problem: PlannerProblem, prev: Plan) -> Plan | None:
    p = _reuse(problem, prev)
    if p is None:
        return None
    try:
        return rebalance_data(problem, p)
    except InfeasibleError:
        return None


def _diverse(finalists: list["_Finalist"]) -> list["_Finalist"]:
    """The best FINALISTS, plus the best of every pipeline count not among them: the analytic
    objective ranks layouts of different depth least reliably, so each shape gets a final look."""
    ranked = sorted(finalists)
    out = ranked[:FINALISTS]
    seen = {len(f.template) for f in out}
    for f in ranked[FINALISTS:]:
        if len(f.template) not in seen:
            seen.add(len(f.template))
            out.append(f)
    return out


def _choose(problem: PlannerProblem, plans: list[Plan], prev: Plan | None,
            score: Callable[[Plan], float] | None = None) -> tuple[Plan, float | None]:
    """Best objective (or `score`); with a previous plan, fewest moved bytes within the near-optimal band."""
    judge = score or (lambda p: evaluate(problem, p))
    scored = [(judge(p), i, p) for i, p in enumerate(plans)]
    best = min(v for v, _, _ in scored)
    if prev is None:
        v, _, p = min(scored, key=lambda t: (t[0], t[1]))
        return p, None
    near = [(Plan.moved_bytes(prev, p, problem.state_sizes), v, i, p)
            for v, i, p in scored if v <= best * (1 + NEAR_OPTIMAL) + 1e-9]
    moved, _, _, p = min(near, key=lambda t: (t[0], t[1], t[2]))
    return p, moved


def _finish(problem: PlannerProblem, plan: Plan, ideal: float | None, seconds: float, extra: dict) -> Plan:
    value = evaluate(problem, plan)
    inputs = {"rates": {d: x for d, x in enumerate(problem.rates) if x != 1.0},
              "objective": problem.objective, "dp": problem.dp, "tp": problem.tp, "pp": problem.pp,
              "num_micro_batches": problem.num_micro_batches, "excluded": sorted(problem.excluded), **extra}
    return replace(plan, objective=problem.objective, objective_value=value,
                   predicted_iteration_seconds=value * problem.t0_seconds,
                   ideal_iteration_seconds=None if ideal is None else ideal * problem.t0_seconds,
                   solve_seconds=seconds, inputs=inputs)


def _budget_note(deadline: Deadline) -> dict:
    return {"stopped_at_budget_s": deadline.seconds} if deadline.hit else {}


def _budget_notes(deadline: Deadline, combos: int) -> list[str]:
    return [f"the search stopped at its time budget ({deadline.seconds:g} s, planner.time_budget_s) after "
            f"{combos} grouping combination(s): the best plan found by then"] if deadline.hit else []


def _why_none(deadline: Deadline, problem: PlannerProblem, groups: Sequence[Group]) -> str:
    reason = _infeasibility_reason(problem, groups)
    if not deadline.hit:
        return reason
    return (f"no plan was found within the planner's time budget of {deadline.seconds:g} s, and the search did not "
            f"finish, so a deeper layout may still fit (raise planner.time_budget_s); what it tried: {reason}")


def _gb(mb: float) -> str:
    return f"{mb / 1000:.1f} GB"


def _infeasibility_reason(problem: PlannerProblem, groups: Sequence[Group]) -> str:
    """Why nothing fits, with the numbers, and what would help."""
    mem = problem.memory
    k = problem.tp
    limit = mem.gpu_memory_mb - mem.safety_margin_mb
    end = max(mem.ends_mb(1.0, True, False), mem.ends_mb(1.0, False, True))     # the embedding's or the head's
    one_block = mem.per_layer_mb(1) + end + mem.reserved_mb
    if one_block > limit:
        return (f"the smallest stage needs {_gb(one_block)} per device (1 block at TP {k} with 1 micro-batch in "
                f"flight + embedding + {_gb(mem.reserved_mb)} reserved), devices have {_gb(limit)} usable "
                f"({_gb(mem.gpu_memory_mb)} minus {_gb(mem.safety_margin_mb)} margin): use a larger tp, or "
                f"devices with more memory")
    if not groups:
        return "no device is available (all excluded or too slow): add devices or lower the exclusions"
    hs = [g.h for g in sorted(groups, key=lambda g: g.h)]
    caps = layer_caps([float(h) for h in hs], problem.num_layers, mem)
    deepest = mem.per_layer_mb(len(hs)) + mem.ends_mb(1.0, True, False) + mem.reserved_mb
    return (f"the model has {problem.num_layers} blocks but all {len(groups)} usable groups together hold at most "
            f"{sum(caps)} in one pipeline of {len(hs)} stages (the first stage needs {_gb(deepest)} per device "
            f"for 1 block at TP {k} with {len(hs)} micro-batches in flight + embedding; devices have "
            f"{_gb(limit)} usable): use a larger tp, fewer pipeline stages in flight, more devices, or devices "
            f"with more memory")
