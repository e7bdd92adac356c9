"""Stage 1 of the two-stage assignment: which pipeline takes which sequence (Hydraulis §6.2).

Every sequence of one global batch goes to exactly one pipeline that can hold it (its length at
most the pipeline's `max_tokens`), so that the slowest pipeline's predicted time is as small as
possible. A pipeline's predicted time needs no packing decision (the paper's LB_j, generalised to
stages that differ in layers, straggling rate and TP degree):

    est_j = max_s Σ_i g_js(l_i)  +  e_j(max_i l_i)  +  C_j·[j gets anything]

with g_js(l) = ρ_s·layers_s·(a·l² + b·l + d) what sequence l adds to stage s, e_j(l) = Σ_s g_js(l)
− max_s g_js(l) the fill/drain of the micro-batch holding the longest sequence, and C_j the c of
one micro-batch through every stage. For stages of one TP degree this never exceeds the 1F1B time
of any packing of those sequences (`cost.LengthCost.pipeline_time`), so stage 2 can only add.

Solved two ways, best kept:
* greedy (Alg. 1 with restarts): longest first (then random orders), each sequence to the pipeline
  that leaves the smallest global max, ties to the pipeline that ends least loaded;
* an exact MILP on HiGHS over aggregated lengths: integer x[k, j] = how many sequences of length
  class k pipeline j takes, binary u[k, j] = whether it takes any. e_j is increasing in l, so
  e_j(max l) = max_k u[k, j]·e_j(l_k) exactly: y_j >= e_j(l_k)·u[k, j]. Identical pipelines are
  ordered by load (symmetry), the greedy answer is the MIP start and an upper bound, and HiGHS
  stops at a hard time limit (then its incumbent, or the greedy, is used).

A pipeline may end up with no sequence (time 0); the authors' code rejected such candidates, here
the caller decides (its gradient contribution is zero, which token-weighted averaging handles).
"""
from __future__ import annotations

import math
import numbers
import random
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Literal, Sequence

from .cost import LengthCost, LengthError, PipelineSpec


@dataclass(frozen=True)
class Dispatch:
    assignment: tuple[tuple[int, ...], ...]   # sample indices (into `lengths`) per pipeline, ascending
    times: tuple[float, ...]                  # predicted (stage-1) time per pipeline
    objective: float                          # max(times)
    method: str                               # "ilp" or "greedy": whose assignment this is
    greedy_objective: float
    ilp_objective: float | None               # the MILP's assignment, re-evaluated on exact lengths
    ilp_status: str                           # optimal | time_limit | infeasible | error | skipped
    bound: float | None                       # proven lower bound on the optimum (exact classes only)
    solve_seconds: float                      # greedy + MILP wall time
    ilp_seconds: float

    def to_dict(self) -> dict:
        return {"assignment": [list(a) for a in self.assignment], "times": list(self.times),
                "objective": self.objective, "method": self.method, "greedy_objective": self.greedy_objective,
                "ilp_objective": self.ilp_objective, "ilp_status": self.ilp_status, "bound": self.bound,
                "solve_seconds": self.solve_seconds, "ilp_seconds": self.ilp_seconds}


# ---------------------------------------------------------------------------- the estimate
class _PipeTerms:
    """Per-pipeline pieces of est_j, precomputed once (stages with one TP degree collapse to one row)."""

    def __init__(self, pipe: PipelineSpec, cost: LengthCost):
        self.pipe, self.cost = pipe, cost
        # The max over stages only needs, per TP degree, the stage with the largest ρ·layers.
        rows: dict[int, object] = {}
        for s in pipe.stages:
            if s.tp not in rows or s.weight > rows[s.tp].weight:
                rows[s.tp] = s
        self.rows = list(rows.values())
        self.overhead = cost.micro_batch_overhead(pipe.stages)

    def row_costs(self, length: float) -> list[float]:
        return [s.weight * self.cost.at(s.tp).seq(length) for s in self.rows]

    def fill(self, length: float) -> float:
        return self.cost.fill_cost(length, self.pipe.stages)

    def estimate(self, lengths: Sequence[float]) -> float:
        if not lengths:
            return 0.0
        sums = [0.0] * len(self.rows)
        for x in lengths:
            for r, v in enumerate(self.row_costs(x)):
                sums[r] += v
        return max(sums) + self.fill(max(lengths)) + self.overhead


def predicted_time(lengths: Sequence[float], pipeline: PipelineSpec, cost: LengthCost) -> float:
    """Stage-1 estimate of one pipeline's time for these sequences (module docstring)."""
    return _PipeTerms(pipeline, cost).estimate(lengths)


def _costs(cost: LengthCost | Sequence[LengthCost], n: int) -> list[LengthCost]:
    if isinstance(cost, LengthCost):
        return [cost] * n
    costs = list(cost)
    if len(costs) != n:
        raise LengthError("cost", f"{len(costs)} models", f"one LengthCost, or one per pipeline ({n})")
    return costs


def _check_fit(lengths: Sequence[float], pipelines: Sequence[PipelineSpec]) -> list[list[int]]:
    """Reachable pipelines of every sequence; a clear error for one that fits nowhere."""
    if not pipelines:
        raise LengthError("pipelines", list(pipelines), "at least one pipeline")
    caps = [p.max_tokens for p in pipelines]
    out = []
    for i, x in enumerate(lengths):
        if not (isinstance(x, numbers.Real) and math.isfinite(x) and x > 0):
            raise LengthError(f"lengths[{i}]", x, "a positive token count")
        reach = [j for j, c in enumerate(caps) if x <= c]
        if not reach:
            raise LengthError(f"lengths[{i}]", x, f"at most {max(caps):g} tokens, the longest sequence any pipeline "
                                                  f"can hold (max_tokens per pipeline: {[f'{c:g}' for c in caps]}); "
                                                  f"truncate it or add a pipeline with more memory per token")
        out.append(reach)
    return out


# ---------------------------------------------------------------------------- greedy
def greedy_dispatch(lengths: Sequence[float], pipelines: Sequence[PipelineSpec],
                    cost: LengthCost | Sequence[LengthCost], trials: int = 20, seed: int = 0,
                    tie: Literal["least_loaded", "first"] = "least_loaded") -> tuple[list[list[int]], float]:
    """Alg. 1 with restarts: the longest-first order, then `trials - 1` seeded shuffles.

    Each sequence goes to the reachable pipeline that leaves the smallest global max. Many
    pipelines tie on that (any one below the current max does); `tie="least_loaded"` then picks
    the one that ends least loaded (LPT), `"first"` the lowest index, as the paper's listing does
    (it piles work on low-index pipelines up to the max).
    """
    if tie not in ("least_loaded", "first"):
        raise LengthError("tie", tie, "'least_loaded' or 'first'")
    reach = _check_fit(lengths, pipelines)
    terms = [_PipeTerms(p, c) for p, c in zip(pipelines, _costs(cost, len(pipelines)))]
    n = len(lengths)
    desc = sorted(range(n), key=lambda i: (-lengths[i], i))
    rng = random.Random(seed)
    best: tuple[float, list[list[int]]] | None = None
    for t in range(max(1, trials)):
        order = desc if t == 0 else rng.sample(range(n), n)
        assign, obj = _greedy_once(order, lengths, reach, terms, tie == "first")
        if best is None or obj < best[0] - 1e-12:
            best = (obj, assign)
    assert best is not None
    return best[1], best[0]


def _greedy_once(order, lengths, reach, terms: list[_PipeTerms], first: bool) -> tuple[list[list[int]], float]:
    d = len(terms)
    sums = [[0.0] * len(t.rows) for t in terms]
    lmax = [0.0] * d
    est = [0.0] * d
    assign: list[list[int]] = [[] for _ in range(d)]
    row_costs: dict[tuple[int, float], list[float]] = {}
    for i in order:
        x = lengths[i]
        best = None
        # The max over the other pipelines, in O(1) per candidate: the top two loads.
        top = max(range(d), key=est.__getitem__)
        second = max((est[k] for k in range(d) if k != top), default=0.0)
        for j in reach[i]:
            key = (j, x)
            rc = row_costs.get(key)
            if rc is None:
                rc = row_costs[key] = terms[j].row_costs(x)
            new = max(s + v for s, v in zip(sums[j], rc)) + terms[j].fill(max(lmax[j], x)) + terms[j].overhead
            glob = max(new, second if j == top else est[top])
            cand = (glob, 0.0 if first else new, j, new)
            if best is None or cand < best:
                best = cand
        _, _, j, new = best
        rc = row_costs[(j, x)]
        sums[j] = [s + v for s, v in zip(sums[j], rc)]
        lmax[j] = max(lmax[j], x)
        est[j] = new
        assign[j].append(i)
    return assign, max(est) if est else 0.0


# ---------------------------------------------------------------------------- exact MILP
def dispatch(lengths: Sequence[float], pipelines: Sequence[PipelineSpec], cost: LengthCost | Sequence[LengthCost],
             *, time_limit_s: float = 5.0, mip_gap: float = 1e-3, greedy_trials: int = 20, seed: int = 0,
             bucket: float = 1, solver: Literal["auto", "ilp", "greedy"] = "auto") -> Dispatch:
    """Assign every sequence of a global batch to one pipeline, minimising the slowest estimate.

    `bucket` > 1 groups lengths into buckets of that many tokens for the MILP (each bucket costed
    at its longest member, so the MILP never under-estimates); the answer is always re-evaluated
    on the exact lengths. `solver`: "auto" runs the MILP when HiGHS is available, "greedy" never.
    `mip_gap` is HiGHS's relative gap: "optimal" means within it (0 for exact; many identical
    pipelines then tend to run into `time_limit_s` closing the last 0.1%).
    """
    t0 = time.perf_counter()
    if solver not in ("auto", "ilp", "greedy"):
        raise LengthError("solver", solver, "'auto', 'ilp' or 'greedy'")
    if not (bucket >= 1):
        raise LengthError("bucket", bucket, "a token count >= 1 (1 = exact lengths)")
    reach = _check_fit(lengths, pipelines)
    costs = _costs(cost, len(pipelines))
    terms = [_PipeTerms(p, c) for p, c in zip(pipelines, costs)]
    g_assign, _ = greedy_dispatch(lengths, pipelines, costs, greedy_trials, seed)
    g_times = [t.estimate([lengths[i] for i in a]) for t, a in zip(terms, g_assign)]
    g_obj = max(g_times)

    from .. import highs
    use_ilp = solver == "ilp" or (solver == "auto" and len(lengths) > 0 and highs.available())
    if solver == "ilp" and not highs.available():
        raise LengthError("solver", solver, "'greedy' or 'auto': HiGHS (highspy) is not installed")
    ilp_assign, status, bound, ilp_secs = None, "skipped", None, 0.0
    if use_ilp:
        ilp_assign, status, bound, ilp_secs = _solve_milp(lengths, reach, pipelines, costs, terms, g_assign,
                                                          time_limit_s, mip_gap, bucket)
    ilp_obj = None
    chosen, method, times = g_assign, "greedy", g_times
    if ilp_assign is not None:
        i_times = [t.estimate([lengths[i] for i in a]) for t, a in zip(terms, ilp_assign)]
        ilp_obj = max(i_times)
        if ilp_obj <= g_obj * (1 + 1e-12):
            chosen, method, times = ilp_assign, "ilp", i_times
    obj = max(times)
    return Dispatch(assignment=tuple(tuple(sorted(a)) for a in chosen), times=tuple(times), objective=obj,
                    method=method, greedy_objective=g_obj, ilp_objective=ilp_obj, ilp_status=status,
                    bound=min(bound, obj) if bound is not None else None,
                    solve_seconds=time.perf_counter() - t0, ilp_seconds=ilp_secs)


def _classes(lengths, reach, bucket) -> list[tuple[float, list[int], tuple[int, ...]]]:
    """(costed length, member indices, reachable pipelines) per length class.

    Buckets never straddle a memory limit (the reachable set is part of the key), so costing a
    class at its longest member never makes a sequence look unplaceable.
    """
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, x in enumerate(lengths):
        key = (x if bucket == 1 else math.ceil(x / bucket), tuple(reach[i]))
        groups[key].append(i)
    out = []
    for (_, r), idx in groups.items():
        out.append((max(lengths[i] for i in idx), sorted(idx, key=lambda i: (-lengths[i], i)), r))
    out.sort(key=lambda c: -c[0])
    return out


def _solve_milp(lengths, reach, pipelines, costs, terms: list[_PipeTerms], g_assign, time_limit_s, mip_gap, bucket):
    import pyomo.environ as pyo

    from .. import highs

    classes = _classes(lengths, reach, bucket)
    d = len(pipelines)
    pairs = [(k, j) for k, (_, _, r) in enumerate(classes) for j in r]
    by_pipe: dict[int, list[int]] = defaultdict(list)
    for k, j in pairs:
        by_pipe[j].append(k)
    rep = [c[0] for c in classes]
    sizes = [len(c[1]) for c in classes]
    row_cost = {(k, j): terms[j].row_costs(rep[k]) for k, j in pairs}
    fill = {(k, j): terms[j].fill(rep[k]) for k, j in pairs}

    m = pyo.ConcreteModel(name="length_dispatch")
    m.P = pyo.Set(initialize=pairs, dimen=2)
    m.J = pyo.RangeSet(0, d - 1)
    m.x = pyo.Var(m.P, domain=pyo.NonNegativeIntegers, bounds=lambda m, k, j: (0, sizes[k]))
    m.u = pyo.Var(m.P, domain=pyo.Binary)
    m.y = pyo.Var(m.J, domain=pyo.NonNegativeReals)
    m.used = pyo.Var(m.J, domain=pyo.Binary)
    m.z = pyo.Var(domain=pyo.NonNegativeReals)
    m.obj = pyo.Objective(expr=m.z, sense=pyo.minimize)
    m.once = pyo.Constraint(range(len(classes)), rule=lambda m, k: sum(m.x[k, j] for j in classes[k][2]) == sizes[k])
    m.link = pyo.Constraint(m.P, rule=lambda m, k, j: m.x[k, j] <= sizes[k] * m.u[k, j])
    m.used_link = pyo.Constraint(m.P, rule=lambda m, k, j: m.used[j] >= m.u[k, j])
    # Exact: T(max_i m_ij l_i) = max_i m_ij T(l_i) for T increasing in l.
    m.fill = pyo.Constraint(m.P, rule=lambda m, k, j: m.y[j] >= fill[k, j] * m.u[k, j])

    def load(j, r):
        return (sum(row_cost[k, j][r] * m.x[k, j] for k in by_pipe[j]) + m.y[j]
                + terms[j].overhead * m.used[j])

    rows = [(j, r) for j in range(d) for r in range(len(terms[j].rows))]
    m.R = pyo.Set(initialize=rows, dimen=2)
    m.makespan = pyo.Constraint(m.R, rule=lambda m, j, r: m.z >= load(j, r))
    # Identical neighbours: any optimum can be permuted so their loads fall (symmetry breaking).
    same = [j for j in range(d - 1) if pipelines[j] == pipelines[j + 1] and costs[j] == costs[j + 1]]
    m.order = pyo.Constraint(same, rule=lambda m, j: load(j, 0) >= load(j + 1, 0))

    # The greedy answer, costed like the model (class lengths), is the MIP start and a bound.
    cls_of = {i: k for k, c in enumerate(classes) for i in c[1]}
    start = [defaultdict(int) for _ in range(d)]
    for j, a in enumerate(g_assign):
        for i in a:
            start[j][cls_of[i]] += 1

    def start_load(cnt, j):   # load(j, 0) of the order rows, evaluated on the start
        if not cnt:
            return 0.0
        return sum(row_cost[k, j][0] * n for k, n in cnt.items()) + max(fill[k, j] for k in cnt) + terms[j].overhead

    # Sort each run of identical pipelines by load so the start obeys the order rows.
    j = 0
    while j < d:
        e = j
        while e in same:
            e += 1
        run = sorted(start[j:e + 1], key=lambda c: -start_load(c, j))
        start[j:e + 1] = run
        j = e + 1
    ub = 0.0
    for j in range(d):
        cnt = start[j]
        for k in by_pipe[j]:
            m.x[k, j].value = cnt.get(k, 0)
            m.u[k, j].value = 1 if cnt.get(k, 0) else 0
        m.used[j].value = 1 if cnt else 0
        m.y[j].value = max((fill[k, j] for k in cnt), default=0.0)
        ub = max(ub, max((sum(row_cost[k, j][r] * n for k, n in cnt.items()) + m.y[j].value
                          + terms[j].overhead * m.used[j].value) for r in range(len(terms[j].rows))))
    m.z.value = ub
    m.upper = pyo.Constraint(expr=m.z <= ub * (1 + 1e-9) + 1e-12)

    out = highs.solve(m, time_limit_s, mip_gap)
    bound = out.bound if bucket == 1 else None
    if not out.loaded:
        return None, out.status, bound, out.seconds
    assign: list[list[int]] = [[] for _ in range(d)]
    for k, (_, members, r) in enumerate(classes):
        counts = [int(round(m.x[k, j].value or 0)) for j in r]
        if sum(counts) != len(members) or min(counts) < 0:
            return None, "error", bound, out.seconds   # numerically broken answer: keep the greedy
        pos = 0
        for j, cnt in zip(r, counts):
            assign[j].extend(members[pos:pos + cnt])
            pos += cnt
    return assign, out.status, bound, out.seconds
