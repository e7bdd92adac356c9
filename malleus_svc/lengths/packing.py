"""Stage 2 of the two-stage assignment: pack one pipeline's sequences into micro-batches.

Given the sequences stage 1 sent to a pipeline, choose the number of micro-batches V and which
sequence goes into which, every micro-batch at most `capacity` tokens (memory), minimising the
pipeline's time (Hydraulis §6.1). Two objectives:

* "1f1b" (default): `LengthCost.pipeline_time`, Σ_v max_s τ_s(w_v) + fill/drain of the slowest
  micro-batch; with varlen attention Σ_v of the per-sequence work is fixed, so what packing moves
  is V·c (more micro-batches, more overhead) against the fill term (fewer, bigger micro-batches,
  a longer fill);
* "eq1": the paper's Eq. 1, max micro-batch × (stages − 1 + V): the published test vectors.

Neither objective is monotone or unimodal in V (a test example: it falls from V = 2 to 4, rises at 5 and
falls again at 6), so every V in range is considered, never bisected. For one V both objectives
only grow with the slowest micro-batch (one TP degree per pipeline), so each V is a min-max
partition into exactly V non-empty bins with a capacity:

1. lower bound: the slowest micro-batch is at least the longest sequence's, and at least the
   average; V whose bound cannot beat the best found so far is skipped (`prune`);
2. LPT (longest first into the least-loaded bin that has room) gives an incumbent; if it meets
   the bound it is optimal and no solver runs;
3. otherwise a small MILP on HiGHS (aggregated: integer count per distinct length per bin, bins
   ordered by load, LPT as MIP start) under a time limit.

With stages of different TP degrees the MILP still returns a feasible packing, scored exactly
afterwards, but its objective is an upper bound and optimality is not claimed.
"""
from __future__ import annotations

import math
import numbers
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal, Mapping, Sequence

from .cost import LengthCost, LengthError, PipelineSpec

Objective = Literal["1f1b", "eq1"]


@dataclass(frozen=True)
class Packing:
    micro_batches: tuple[tuple[int, ...], ...]   # indices into the input lengths; slowest micro-batch first
    time: float                                  # objective of this packing
    objective: str
    per_v: Mapping[int, float] = field(compare=False)  # best objective found per V tried (pruned V absent)
    proven_optimal: bool = False
    method: str = "lpt"                          # "lpt" (met its bound), "ilp", "lpt+ilp" (ILP gave up), "empty"
    solve_seconds: float = 0.0

    @property
    def num_micro_batches(self) -> int:
        return len(self.micro_batches)

    def lengths(self, lengths: Sequence[float]) -> list[list[float]]:
        return [[lengths[i] for i in mb] for mb in self.micro_batches]

    def to_dict(self) -> dict:
        return {"micro_batches": [list(m) for m in self.micro_batches], "time": self.time,
                "objective": self.objective, "per_v": {str(k): v for k, v in sorted(self.per_v.items())},
                "proven_optimal": self.proven_optimal, "method": self.method, "solve_seconds": self.solve_seconds}


def first_fit_decreasing(lengths: Sequence[float], capacity: float) -> list[list[int]]:
    """Fixed-length packing (hydraulis App. A.2): longest first, each into the first micro-batch with
    room, up to `capacity` tokens; indices into `lengths`. Blind to time: the oblivious baseline of
    `bench lengths`, and the "packed to the token budget" micro-batches `expected` averages over."""
    bins: list[list[int]] = []
    room: list[float] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, r in enumerate(room):
            if lengths[i] <= r:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            if lengths[i] > capacity:
                raise LengthError(f"lengths[{i}]", lengths[i], f"at most the capacity ({capacity} tokens)")
            bins.append([i])
            room.append(capacity - lengths[i])
    return bins


def v_bounds(total_tokens: float, capacity: float, count: int, min_tokens: float | None = None) -> tuple[int, int]:
    """Range of micro-batch counts worth trying (Hydraulis App. C): memory bounds V from below
    (⌈Σl / capacity⌉), one sequence per micro-batch from above, and, when given, `min_tokens` (the
    shortest micro-batch that still runs efficiently, UtilLen) lowers the top to ⌊Σl / min_tokens⌋."""
    if count == 0:
        return 0, 0
    lo = max(1, math.ceil(total_tokens / capacity - 1e-9))
    hi = count
    if min_tokens:
        hi = min(hi, max(lo, math.floor(total_tokens / min_tokens + 1e-9)))
    return lo, hi


def pack(lengths: Sequence[float], pipeline: PipelineSpec, cost: LengthCost, *, objective: Objective = "1f1b",
         capacity: float | None = None, min_tokens: float | None = None, v_range: tuple[int, int] | None = None,
         prune: bool = True, time_limit_s: float = 1.0, total_time_s: float = 10.0, mip_gap: float = 0.0) -> Packing:
    """Pack `lengths` (one pipeline's sequences) into micro-batches minimising `objective`.

    `capacity` defaults to the pipeline's `max_tokens`. `time_limit_s` bounds each MILP; after
    `total_time_s` the remaining V values get LPT only. `prune=False` scores every V in range
    (for inspection and tests).
    """
    t0 = time.perf_counter()
    if objective not in ("1f1b", "eq1"):
        raise LengthError("objective", objective, "'1f1b' or 'eq1'")
    cap = pipeline.max_tokens if capacity is None else capacity
    if not (cap > 0):
        raise LengthError("capacity", capacity, "a token count > 0")
    for i, x in enumerate(lengths):
        if not (isinstance(x, numbers.Real) and math.isfinite(x) and x > 0):
            raise LengthError(f"lengths[{i}]", x, "a positive token count")
        if x > cap:
            raise LengthError(f"lengths[{i}]", x, f"at most {cap:g} tokens, what one micro-batch of this pipeline "
                                                  "can hold; dispatch it to a pipeline with more memory per token")
    n = len(lengths)
    if n == 0:
        return Packing((), 0.0, objective, {}, True, "empty", time.perf_counter() - t0)
    lo, hi = v_bounds(sum(lengths), cap, n, min_tokens) if v_range is None else v_range
    if not (1 <= lo <= hi <= n):
        raise LengthError("v_range", (lo, hi), f"1 <= lo <= hi <= {n} (the number of sequences)")

    model = _Model(lengths, pipeline, cost, objective)
    candidates = sorted(range(lo, hi + 1), key=lambda v: (model.bound(v), v))
    best: tuple[float, list[list[int]]] | None = None
    per_v: dict[int, float] = {}
    proven, used_ilp, ilp_gave_up = model.exact, False, False
    for v in candidates:
        if prune and best is not None and model.bound(v) >= best[0] * (1 - 1e-12):
            continue   # cannot beat the incumbent: proven without solving
        bins = _lpt(lengths, model, v, cap)
        score = model.score(bins) if bins is not None else math.inf
        if not (bins is not None and model.exact and score <= model.bound(v) * (1 + 1e-12)):
            if time.perf_counter() - t0 < total_time_s:
                used_ilp = True
                solved, ok = _milp(lengths, model, v, cap, bins, time_limit_s, mip_gap)
                if solved is not None and model.score(solved) < score:
                    bins, score = solved, model.score(solved)
                proven = proven and ok
                ilp_gave_up = ilp_gave_up or not ok
            else:
                proven, ilp_gave_up = False, True
        if bins is None:
            continue   # no packing into exactly v micro-batches found (capacity)
        per_v[v] = score
        if best is None or score < best[0]:
            best = (score, bins)
    if best is None:
        raise LengthError("lengths", list(lengths), f"a set of sequences packable into {lo}..{hi} micro-batches of "
                                                    f"{cap:g} tokens; none was found within the time limits")
    ordered = sorted((tuple(sorted(b)) for b in best[1]), key=lambda b: (-model.bottleneck(b), b))
    method = ("lpt+ilp" if ilp_gave_up else "ilp") if used_ilp else "lpt"
    return Packing(tuple(ordered), best[0], objective, per_v, proven, method, time.perf_counter() - t0)


class _Model:
    """The objective, its per-V lower bound and the reference load the heuristics balance."""

    def __init__(self, lengths, pipeline: PipelineSpec, cost: LengthCost, objective: str):
        self.lengths, self.pipe, self.cost, self.objective = lengths, pipeline, cost, objective
        stages = pipeline.stages
        self.exact = len({s.tp for s in stages}) == 1
        # Reference stage: the one a sequence is slowest on (the only one that matters for one TP degree).
        longest = max(lengths)
        self.ref = max(range(len(stages)), key=lambda s: stages[s].weight * cost.at(stages[s].tp).seq(longest))
        self.coef = [cost.at(s.tp) for s in stages]
        self.kappa = [s.weight for s in stages]
        self.seq_ref = [self.coef[self.ref].seq(x) for x in lengths]
        self.total = [sum(c.seq(x) for x in lengths) for c in self.coef]
        self.longest = [c.seq(longest) for c in self.coef]

    def ref_load(self, idx) -> float:
        return sum(self.seq_ref[i] for i in idx)

    def bottleneck(self, idx) -> float:
        return max(self.cost.stage_times([self.lengths[i] for i in idx], self.pipe.stages))

    def score(self, bins) -> float:
        mbs = [[self.lengths[i] for i in b] for b in bins]
        if self.objective == "eq1":
            return self.cost.eq1_time(mbs, self.pipe.stages)
        return self.cost.pipeline_time(mbs, self.pipe.stages)

    def bound(self, v: int) -> float:
        """No packing into v micro-batches scores below this."""
        # Per stage, the slowest micro-batch is at least the longest sequence's and the average.
        per = [k * (max(lng, tot / v) + c.c) for k, lng, tot, c in zip(self.kappa, self.longest, self.total, self.coef)]
        if self.objective == "eq1":
            return max(per) * (len(per) - 1 + v)
        work = max(k * (tot + v * c.c) for k, tot, c in zip(self.kappa, self.total, self.coef))
        fill = (sum(per) - max(per)) if self.exact else 0.0
        return work + fill


def _lpt(lengths, model: _Model, v: int, cap: float) -> list[list[int]] | None:
    """Longest first into the least-loaded bin with room; the first v go one per bin."""
    order = sorted(range(len(lengths)), key=lambda i: (-model.seq_ref[i], i))
    bins: list[list[int]] = [[] for _ in range(v)]
    load, tokens = [0.0] * v, [0.0] * v
    for i in order:
        fits = [b for b in range(v) if tokens[b] + lengths[i] <= cap]
        if not fits:
            return None
        b = min(fits, key=lambda b: (len(bins[b]) > 0, load[b], b))
        bins[b].append(i)
        load[b] += model.seq_ref[i]
        tokens[b] += lengths[i]
    return bins if all(bins) else None


def _milp(lengths, model: _Model, v: int, cap: float, start: list[list[int]] | None, time_limit_s: float,
          mip_gap: float) -> tuple[list[list[int]] | None, bool]:
    """Exactly v non-empty bins, min of the objective written linearly; (bins or None, optimal?)."""
    import pyomo.environ as pyo

    from .. import highs

    counts = Counter(lengths)
    classes = sorted(counts, reverse=True)
    members = {x: [i for i in range(len(lengths)) if lengths[i] == x] for x in classes}
    stages, coef, kappa = model.pipe.stages, model.coef, model.kappa
    s_count, ref = len(stages), model.ref

    m = pyo.ConcreteModel(name=f"length_packing_v{v}")
    m.K = pyo.RangeSet(0, len(classes) - 1)
    m.B = pyo.RangeSet(0, v - 1)
    m.S = pyo.RangeSet(0, s_count - 1)
    m.x = pyo.Var(m.K, m.B, domain=pyo.NonNegativeIntegers, bounds=lambda m, k, b: (0, counts[classes[k]]))

    def tau(b, s):   # stage s's time for bin b: linear in the counts
        return kappa[s] * (sum(coef[s].seq(classes[k]) * m.x[k, b] for k in m.K) + coef[s].c)

    m.once = pyo.Constraint(m.K, rule=lambda m, k: sum(m.x[k, b] for b in m.B) == counts[classes[k]])
    m.nonempty = pyo.Constraint(m.B, rule=lambda m, b: sum(m.x[k, b] for k in m.K) >= 1)
    m.capacity = pyo.Constraint(m.B, rule=lambda m, b: sum(classes[k] * m.x[k, b] for k in m.K) <= cap)
    m.order = pyo.Constraint(pyo.RangeSet(0, v - 2), rule=lambda m, b: (
        sum(model.coef[ref].seq(classes[k]) * (m.x[k, b] - m.x[k, b + 1]) for k in m.K) >= 0))
    if model.objective == "eq1":
        m.top = pyo.Var(domain=pyo.NonNegativeReals)
        m.slot = pyo.Constraint(m.B, m.S, rule=lambda m, b, s: m.top >= tau(b, s))
        m.obj = pyo.Objective(expr=(s_count - 1 + v) * m.top, sense=pyo.minimize)
    else:
        m.t = pyo.Var(m.B, domain=pyo.NonNegativeReals)       # bottleneck of bin b
        m.fill = pyo.Var(domain=pyo.NonNegativeReals)         # fill/drain: the non-reference stages
        m.slot = pyo.Constraint(m.B, m.S, rule=lambda m, b, s: m.t[b] >= tau(b, s))
        m.filling = pyo.Constraint(m.B, rule=lambda m, b: m.fill >= sum(tau(b, s) for s in m.S if s != ref))
        m.obj = pyo.Objective(expr=sum(m.t[b] for b in m.B) + m.fill, sense=pyo.minimize)

    if start is not None:   # MIP start: LPT's bins, sorted to obey the order rows
        ordered = sorted(start, key=lambda b: -model.ref_load(b))
        for b, idx in enumerate(ordered):
            c = Counter(lengths[i] for i in idx)
            for k, x in enumerate(classes):
                m.x[k, b].value = c.get(x, 0)
        taus = [[pyo.value(tau(b, s)) for s in range(s_count)] for b in range(v)]
        if model.objective == "eq1":
            m.top.value = max(max(t) for t in taus)
        else:
            for b in range(v):
                m.t[b].value = max(taus[b])
            m.fill.value = max(sum(t) - t[ref] for t in taus)

    out = highs.solve(m, time_limit_s, mip_gap)
    if not out.loaded:
        return None, out.status == "infeasible"   # proven infeasible counts as settled
    pools = {x: list(members[x]) for x in classes}
    bins: list[list[int]] = []
    for b in range(v):
        idx = []
        for k, x in enumerate(classes):
            cnt = int(round(m.x[k, b].value or 0))
            idx.extend(pools[x][:cnt])
            del pools[x][:cnt]
        bins.append(idx)
    if any(pools.values()) or not all(bins):
        return None, False   # numerically broken answer
    return bins, out.status == "optimal"
