"""Lower level of the Malleus planner: layers per stage (ILP-1) and micro-batches per pipeline (ILP-2).

The upper level fixes a pipeline organisation: P pipelines, pipeline i has S_i stages, and stage j
of pipeline i is a TP group with rate y_ij (t0 units per block and micro-batch, the Malleus time model)
and memory multiplier h_ij = k / |group| (its memory model). What is left to decide is

  l_ij  blocks held by stage j of pipeline i  (integers >= 0, sum_j l_ij = L), and
  m_i   micro-batches run by pipeline i       (integers, sum_i m_i = M).

Joint program (a MINLP: the objective multiplies two decision-dependent quantities)
---------------------------------------------------------------------------------
  min_{l, m}  max_i  T_i(m_i, z_i)   with   z_i = max_j (y_ij * l_ij + extra_ij)
  s.t.  sum_j l_ij = L,  memory row of every stage (below),  sum_i m_i = M,  m_i >= lb_i,

where T_i is the pipeline's iteration time in t0 units:
  'paper'            T_i = m_i * z_i                  lb_i = S_i   (the authors' code)
  'bubble' / 'full'  T_i = (m_i + S_i - 1) * z_i      lb_i = 1     (1F1B fill and drain)
('full' differs from 'bubble' only in what the caller folds into `extra` and z, e.g. p2p time.)
The memory row of stage j of a pipeline with S stages is
  h_j * (K[S - j] * l_j + E * [j == 0 or j == S - 1]) + X0 <= C - delta.
It does not depend on m because 1F1B keeps at most S - j micro-batches in flight at stage j; with
m_i >= S_i that is exact, with m_i < S_i ('bubble') it is an upper bound, so it stays safe.

Why two ILPs solve it exactly
-----------------------------------------------
The constraints on l (per pipeline) and on m (global) share no variable, and T_i is
non-decreasing in z_i for every m_i >= 0. Take any jointly optimal (l+, m+). Replacing pipeline
i's layers by a minimiser of z_i (ILP-1) cannot increase z_i, hence cannot increase any T_i under
the same m+; so (ILP-1 layers, m+) is optimal too, and then minimising over m for those fixed
z_i* (ILP-2) is optimal for the joint program. The bilinear product m_i * z_i therefore never
reaches a solver: inside ILP-2 z_i* is data, so w >= z_i* * m_i + (S_i - 1) * z_i* is a linear row.
In ILP-1 the products y_ij * l_ij are linear because y_ij is data. HiGHS accepts both models.

Both ILPs are instances of one problem:
  min v  s.t.  v >= a_j * x_j + b_j,  lo_j <= x_j <= hi_j integer,  sum_j x_j = total,
(ILP-1: a = y, b = extra, lo = 0, hi = memory cap; ILP-2: a = z, b = 0 or (S-1) z, lo = lb),
which has an exact closed form. Every x_j needs "slots" whose values are a_j * n + b_j,
n = lo_j+1, lo_j+2, ...; a solution with bottleneck v exists iff at least `total - sum lo`
slots have value <= v (and v >= max_j a_j * lo_j + b_j). So the optimum is
  v* = max( max_j a_j*lo_j + b_j,  the (total - sum lo)-th smallest slot value ),
which is the paper's binary-search formula (smallest candidate v = a_j * n + b_j with
sum_j min(hi_j, floor((v - b_j) / a_j)) >= total). We find that order statistic directly: a
continuous relaxation places a level just below it in O(S log S), then a heap pops the remaining
<= S slots. Cost: O(S log S) per call, independent of L and M, the tie-break below included (it
is carried out the same way, `_smallest_slots`); no solver is imported.

Tie-break (optimal x is rarely unique; the rule is a pure function of the inputs and of v*, so
'closed_form', 'highs' and 'both' return the same vectors)
-------------------------------------------------------------------------------------------
Let c_j be the cap at v*: the largest n <= hi_j with a_j * n + b_j <= v*. Every x with
lo <= x <= c and sum x = total is optimal, and these are all the optimal solutions.
  * default: start from x = c and remove the surplus one unit at a time from the stage whose
    current time a_j * x_j + b_j is largest (equal times: lowest index). This lowers the slowest stages
    first, so the stages end as balanced as the optimum allows.
  * prefer=p (e.g. the previous plan's layer counts): start from p clipped into [lo_j, c_j]. Every
    unit still to move costs one unit of L1 distance whichever stage it comes from, so clipping
    then moving the rest is L1-closest to p among optimal solutions; the remaining units are
    removed as in the default, or added to the stage whose time after adding is smallest
    (equal times: lowest index). A p that is itself optimal is returned unchanged.
  The rules are stated one unit at a time; they are carried out in bulk (the surplus can be ~10^8
  slots: ILP-2 on thousands of pipelines beside one whose lower bound sets v*), with the same result.

Floating point: rates are floats, so v = a * n + b products of equal rationals can differ in the
last bit. A slot counts as "<= v" when a * n + b <= v + 1e-9 * max(1, |v|) (relative tolerance
`REL_TOL`), so such ties are ties and no candidate loses to rounding. The reported z / w is
recomputed from the chosen integers, so it is exactly max_j (a_j * x_j + b_j) of what is returned.

Solvers. 'closed_form' (default) is the above. 'highs' builds the Pyomo model (memory rows written
out as in the memory model; `malleus_svc.planner.ilp`, imported lazily) and lets HiGHS find the optimum v;
its integer vector is checked against the model and the returned vector is then chosen by the
same tie-break at HiGHS's v, so the solver never changes the layout. 'both' runs the two and
raises PlannerInternalError unless they agree on feasibility and on v within HiGHS's own
tolerance (1e-6 absolute + REL_TOL, widened by mip_gap when one is set); it returns the closed form.
"""
from __future__ import annotations

import collections
import functools
import heapq
import math
import numbers
from dataclasses import dataclass
from typing import Hashable, Mapping, Sequence

from ..config.scenario import OBJECTIVES, SOLVERS
from ..costmodel.profile import MemoryProfile

REL_TOL = 1e-9      # relative tolerance when comparing a slot value a*n+b with a bottleneck v


class PlannerInternalError(RuntimeError):
    """An internal invariant broke (e.g. the closed form and HiGHS disagree): a bug, not bad input."""


@dataclass(frozen=True)
class LayerSolution:
    z: float                  # bottleneck per-micro-batch stage time, t0 units: max_j (y_j*l_j + extra_j)
    layers: tuple[int, ...]   # blocks per stage, sums to num_layers; 0 = stage gets no block (suspended)


@dataclass(frozen=True)
class DataSolution:
    w: float                        # max_i m_i*z_i ('paper') or max_i (m_i+S_i-1)*z_i ('bubble'/'full')
    micro_batches: tuple[int, ...]  # per pipeline, sums to M


# ---------------------------------------------------------------------------- public API

def layer_caps(mem_factors: Sequence[float], num_layers: int, memory: MemoryProfile) -> tuple[int, ...]:
    """Memory cap u_j on the blocks of each stage of a pipeline with S = len(mem_factors) stages.

    u_j is the largest integer l with h_j * (K[S-j] * l + E_j) + X0 <= C - delta (the memory model,
    with the parts a group does not split left unscaled: `MemoryProfile.block_mb` and `ends_mb`),
    E_j = E on the first and last stage; clipped into [0, num_layers]. K beyond the profiled depths
    is extrapolated by `MemoryProfile.per_layer_mb` (authors' fault 4). A stage whose fixed part
    (E_j, X0) alone does not fit also gets 0 here; `solve_layers` treats such a pipeline as
    infeasible, since the memory row must hold for every stage, even one left without blocks.
    """
    return tuple(max(0, u) for u in _stage_caps(mem_factors, num_layers, memory))


def memory_caps(mem_factors: Sequence[float], num_layers: int, memory: MemoryProfile) -> tuple[int, ...] | None:
    """As `layer_caps`, or None when some stage's memory row fails even with 0 blocks (no such
    pipeline fits)."""
    caps = _stage_caps(mem_factors, num_layers, memory)
    return None if min(caps) < 0 else tuple(caps)


def position_caps(mem_factor: float, stages: int, num_layers: int, memory: MemoryProfile) -> list[int]:
    """Each position's cap in a pipeline of `stages` stages whose groups all have this factor; -1
    where the memory row fails even with 0 blocks (for `stage_order`, which mixes factors)."""
    return _stage_caps([mem_factor] * stages, num_layers, memory)


def _stage_caps(mem_factors: Sequence[float], num_layers: int, memory: MemoryProfile) -> list[int]:
    """As `layer_caps`, but -1 for a stage whose memory row fails even with 0 blocks."""
    return list(_stage_caps_of(tuple(mem_factors), num_layers, memory))


@functools.lru_cache(maxsize=4096)    # a search asks for the same few pipelines' caps thousands of times
def _stage_caps_of(mem_factors: tuple[float, ...], num_layers: int, memory: MemoryProfile) -> tuple[int, ...]:
    h = _floats("mem_factors", mem_factors, positive=True)
    if not h:
        raise ValueError("mem_factors is empty: a pipeline needs at least one stage")
    _check_count("num_layers", num_layers, minimum=1)
    s = len(h)
    budget = memory.budget_mb
    slack = REL_TOL * max(1.0, abs(budget))
    caps = []
    for j, hj in enumerate(h):
        k = memory.block_mb(hj, s - j)
        if not (math.isfinite(k) and k > 0):
            raise ValueError(f"per-layer memory K[{s - j}] = {k!r} for stage {j} of {s}: must be a positive number")
        e = memory.ends_mb(hj, j == 0, j == s - 1)

        def fits(n: int) -> bool:
            return k * n + e <= budget + slack

        if not fits(0):
            caps.append(-1)
            continue
        n = min(num_layers, max(0, math.floor((budget - e) / k)))
        while n < num_layers and fits(n + 1):   # the division may round either way: fix it up
            n += 1
        while n > 0 and not fits(n):
            n -= 1
        caps.append(n)
    return tuple(caps)


def solve_layers(rates: Sequence[float], mem_factors: Sequence[float], num_layers: int, memory: MemoryProfile,
                 extra: Sequence[float] | None = None, solver: str = "closed_form",
                 prefer: Sequence[int] | None = None, time_limit_s: float = 10.0,
                 mip_gap: float = 0.0, min_layers: int = 0) -> LayerSolution | None:
    """ILP-1 for one pipeline: blocks per stage minimising the bottleneck stage time.

    min z  s.t.  sum_j l_j = L,  z >= y_j * l_j + extra_j,  memory row of each stage,  l_j >= min_layers integer.
    `extra_j` (default 0) is a per-micro-batch time the stage pays whatever it holds (e.g. p2p);
    it counts even for a stage given 0 blocks. Returns None when the memory caps sum to < L, or
    when some stage's memory row fails even with `min_layers` blocks (with 0: embedding/head or X0
    alone too big). `min_layers=1` prices the pipeline with every group a real stage.
    See the module docstring for the solvers and the tie-break (default: balanced; `prefer`:
    L1-closest to the given layer counts).
    """
    y = _floats("rates", rates, positive=True)
    s = len(y)
    if s == 0:
        raise ValueError("rates is empty: a pipeline needs at least one stage")
    if len(mem_factors) != s:
        raise ValueError(f"mem_factors has {len(mem_factors)} entries, rates has {s}: one per stage")
    e = [0.0] * s if extra is None else _floats("extra", extra, nonnegative=True)
    if len(e) != s:
        raise ValueError(f"extra has {len(e)} entries, rates has {s}: one per stage")
    _check_solver(solver, time_limit_s, mip_gap)
    pref = _prefer(prefer, s)
    _check_count("min_layers", min_layers, minimum=0)
    caps = _stage_caps(mem_factors, num_layers, memory)
    lo = [min_layers] * s

    out = _solve_min_max(
        y, e, lo, caps, num_layers, pref, solver, mip_gap,
        lambda: _highs().solve_layers_model(y, _floats("mem_factors", mem_factors, positive=True),
                                            num_layers, memory, e, time_limit_s, mip_gap, min_layers),
        "ILP-1 (layers)", f"ILP-1 rates={y} mem_factors={list(mem_factors)} L={num_layers} extra={e}",
        infeasible=min(caps) < min_layers)   # e.g. a first/last stage cannot even hold the embedding/head
    return None if out is None else LayerSolution(*out)


def bottleneck(rates: Sequence[float], caps: Sequence[int], num_layers: int, extra: Sequence[float] | None = None,
               min_layers: int = 0) -> float | None:
    """The optimum z of ILP-1 for given memory caps (`layer_caps`), without the layout or any input
    check: for search loops that price many stage orders and lay out only the best one."""
    lo = [min_layers] * len(rates)
    if min(caps) < min_layers:
        return None
    return _optimum(rates, extra or [0.0] * len(rates), lo, caps, num_layers)


def uncapped_bottleneck(rates: Sequence[float], num_layers: int) -> float:
    """`bottleneck` with no memory cap: the least z with Σ ⌊z / y_j⌋ >= num_layers, a lower bound on
    it under any caps. From the continuous level, whose floors fall short by less than one slot per
    stage, the next slots are taken smallest first."""
    v = num_layers / sum(1.0 / y for y in rates) * (1 - 1e-12)     # rounding never takes a floor past it
    x = [int(v // y) for y in rates]
    z = 0.0         # Σ x < num_layers: the last slot taken below is z
    heap = [(y * (n + 1), j) for j, (y, n) in enumerate(zip(rates, x))]
    heapq.heapify(heap)
    for _ in range(num_layers - sum(x)):
        z, j = heapq.heappop(heap)
        x[j] += 1
        heapq.heappush(heap, (rates[j] * (x[j] + 1), j))
    return z


def lay_out(rates: Sequence[float], extra: Sequence[float], caps: Sequence[int], z: float, num_layers: int,
            min_layers: int = 0) -> list[int]:
    """ILP-1's layout at its optimum `z` (from `bottleneck` with the same caps and `min_layers`), by
    the tie-break `solve_layers` uses."""
    lo = [min_layers] * len(rates)
    return _choose(rates, extra, lo, _caps_at(z, rates, extra, lo, caps), num_layers, None)


def solve_micro_batches(z: Sequence[float], stages: Sequence[int], num_micro_batches: int, objective: str = "paper",
                        solver: str = "closed_form", prefer: Sequence[int] | None = None,
                        time_limit_s: float = 10.0, mip_gap: float = 0.0,
                        fill: Sequence[float] | None = None) -> DataSolution | None:
    """ILP-2: micro-batches per pipeline minimising the slowest pipeline's iteration time.

    'paper':           min max_i m_i * z_i,               m_i >= S_i (as the authors' code)
    'bubble' / 'full': min max_i m_i * z_i + f_i,         m_i >= 1   (1F1B fill/drain included)
    s.t. sum_i m_i = M, m_i integer. Returns None when the lower bounds sum to more than M.
    f_i is `fill[i]` when given ('full': Σ_j t_ij - z_i, `timing.fill_drain`), else (S_i - 1)·z_i
    (equal stages).
    Tie-break as in the module docstring (default: balanced; `prefer`: L1-closest).
    """
    zz = _floats("z", z, positive=True)
    p = len(zz)
    if p == 0:
        raise ValueError("z is empty: need at least one pipeline")
    if len(stages) != p:
        raise ValueError(f"stages has {len(stages)} entries, z has {p}: one per pipeline")
    for i, st in enumerate(stages):
        _check_count(f"stages[{i}]", st, minimum=1)
    if fill is not None and (len(fill) != p or not all(math.isfinite(f) and f >= 0 for f in fill)):
        raise ValueError(f"fill must be {p} finite times >= 0 (one per pipeline), got {list(fill)}")
    _check_count("num_micro_batches", num_micro_batches, minimum=1)
    if objective not in OBJECTIVES:
        raise ValueError(f"objective {objective!r} is not one of {OBJECTIVES}")
    _check_solver(solver, time_limit_s, mip_gap)
    pref = _prefer(prefer, p)
    b, lo = _offsets_and_bounds(objective, zz, stages, fill)
    hi = [int(num_micro_batches)] * p

    out = _solve_min_max(
        zz, b, lo, hi, num_micro_batches, pref, solver, mip_gap,
        lambda: _highs().solve_micro_batches_model(zz, b, lo, num_micro_batches, time_limit_s, mip_gap),
        "ILP-2 (micro-batches)", f"ILP-2 z={zz} stages={list(stages)} M={num_micro_batches} objective={objective}")
    return None if out is None else DataSolution(*out)


def _offsets_and_bounds(objective: str, z: Sequence[float], stages: Sequence[int], fill: Sequence[float] | None
                        ) -> tuple[list[float], list[int]]:
    """ILP-2's b_i and lower bounds per pipeline under `objective` (`solve_micro_batches`)."""
    if objective == "paper":
        return [0.0] * len(z), [int(st) for st in stages]
    b = [(st - 1) * zi for st, zi in zip(stages, z)] if fill is None else [float(f) for f in fill]
    return b, [1] * len(z)


@dataclass(frozen=True)
class ClassSplit:
    """ILP-2's solution where pipelines repeat (`solve_micro_batches_by_class`): per class, the
    micro-batches of its members and how many of them, its last ones, take one more."""
    w: float
    base: Mapping[Hashable, int]
    extra: Mapping[Hashable, int]

    def micro_batches(self, classes: Sequence[Hashable]) -> tuple[int, ...]:
        """Per pipeline, given each pipeline's class."""
        left = dict(self.extra)
        out = [0] * len(classes)
        for i in range(len(classes) - 1, -1, -1):
            k = classes[i]
            out[i] = self.base[k] + (left[k] > 0)
            left[k] -= left[k] > 0
        return tuple(out)

    def counts(self, k: Hashable, members: int) -> tuple[tuple[int, int], ...]:
        """(micro-batches, pipelines) of class k's `members` pipelines."""
        e = self.extra[k]
        return tuple((m, n) for m, n in ((self.base[k], members - e), (self.base[k] + 1, e)) if n)


def solve_micro_batches_by_class(classes: Sequence[Hashable], z: Mapping[Hashable, float],
                                 stages: Mapping[Hashable, int], num_micro_batches: int, objective: str = "paper",
                                 fill: Mapping[Hashable, float] | None = None) -> ClassSplit | None:
    """ILP-2 by the closed form when pipelines repeat (data-parallel replicas): `classes` gives each
    pipeline's class, and every pipeline of class k has bottleneck z[k], stages[k] stages and fill[k].
    The same solution, tie-break included, as `solve_micro_batches` on the pipelines one by one, in
    time per class (but for counting them): the optimum takes the M - Σ lo smallest slots, ranked by
    value, equal values by the later pipeline first, so a class's members split into at most two
    counts, m and m + 1, the later members holding the larger. None when the lower bounds sum to more
    than M. Inputs are the search's own, so they are not checked again."""
    n = collections.Counter(classes)
    keys = list(n)
    a = [z[k] for k in keys]
    b, lo = _offsets_and_bounds(objective, a, [stages[k] for k in keys], None if fill is None else [fill[k] for k in keys])
    counts, k_range = [n[k] for k in keys], range(len(keys))
    count = num_micro_batches - sum(counts[k] * lo[k] for k in k_range)
    if count < 0:
        return None
    hi = [lo[k] + count for k in k_range]         # no member can take more than every free slot
    u = _counted_order_statistic(a, b, lo, hi, counts, count) if count else -math.inf
    below = [_slots_below(u, a[k], b[k], lo[k], hi[k]) for k in k_range]   # every slot < u is taken
    left = count - sum(counts[k] * (below[k] - lo[k]) for k in k_range)
    tied = [k for k in k_range if below[k] < hi[k] and a[k] * (below[k] + 1) + b[k] == u]
    extra = dict.fromkeys(keys, 0)                # ...and `left` slots of value u, later pipelines first
    if len(tied) == 1:
        extra[keys[tied[0]]] = left
    elif tied:
        tied_keys = {keys[k] for k in tied}
        for i in range(len(classes) - 1, -1, -1):
            if left and classes[i] in tied_keys:
                extra[classes[i]] += 1
                left -= 1
    w = max(a[k] * (below[k] + (extra[keys[k]] > 0)) + b[k] for k in k_range)
    return ClassSplit(w, dict(zip(keys, below)), extra)


def _counted_order_statistic(a, b, lo, hi, n, count: int) -> float:
    """The value of the `count`-th smallest slot when class k holds n_k copies of the slots a_k·x + b_k,
    x in (lo_k, hi_k]: the relaxed level, then whole classes' top slots added or removed in order."""
    u = _relaxed_level(a, b, lo, hi, sum(c * x for c, x in zip(n, lo)) + count, n)
    x = [_slots_upto(u, a[k], b[k], lo[k], hi[k]) for k in range(len(a))]
    taken = sum(n[k] * (x[k] - lo[k]) for k in range(len(a)))
    if taken >= count:     # drop the largest slots while at least `count` stay
        heap = [(-(a[k] * x[k] + b[k]), k) for k in range(len(a)) if x[k] > lo[k]]
        heapq.heapify(heap)
        while True:
            value, k = heapq.heappop(heap)
            if taken - n[k] < count:
                return -value
            taken -= n[k]
            x[k] -= 1
            if x[k] > lo[k]:
                heapq.heappush(heap, (-(a[k] * x[k] + b[k]), k))
    heap = [(a[k] * (x[k] + 1) + b[k], k) for k in range(len(a)) if x[k] < hi[k]]
    heapq.heapify(heap)
    while True:            # add the smallest slots until `count` are taken
        value, k = heapq.heappop(heap)
        taken += n[k]
        if taken >= count:
            return value
        x[k] += 1
        if x[k] < hi[k]:
            heapq.heappush(heap, (a[k] * (x[k] + 1) + b[k], k))


def _slots_below(u: float, a: float, b: float, start: int, stop: int) -> int:
    """Largest n in [start, stop] with every slot up to n (a·n + b) below u, compared exactly."""
    if u == -math.inf:
        return start
    n = min(stop, max(start, math.floor((u - b) / a)))
    while n < stop and a * (n + 1) + b < u:
        n += 1
    while n > start and a * n + b >= u:
        n -= 1
    return n


def _highs():
    from . import ilp  # lazy: Pyomo costs ~0.3 s to import and is not needed on the closed-form path
    return ilp


def _solve_min_max(a, b, lo, hi, total, pref, solver, mip_gap, run_highs, what, detail, infeasible=False):
    """The path ILP-1 and ILP-2 share: min max_j a_j·x_j + b_j over lo <= x <= hi, sum x = total.

    'closed_form' solves exactly; 'highs' takes HiGHS's optimum value; 'both' cross-checks the two.
    Either way the layout at the optimum comes from the same tie-break, so the solver choice never
    changes a plan. Returns (bottleneck, x) or None when infeasible.
    """
    def settle(v: float) -> tuple[float, tuple[int, ...]]:
        x = _choose(a, b, lo, _caps_at(v, a, b, lo, hi), total, pref)
        return _bottleneck(a, b, x), tuple(x)

    def exact():
        if infeasible:
            return None
        v = _optimum(a, b, lo, hi, total)
        return None if v is None else settle(v)

    if solver == "closed_form":
        return exact()
    raw = run_highs()
    via_highs = None
    if raw is not None:
        _check_solution(raw, a, b, lo, hi, total, what)
        via_highs = settle(_bottleneck(a, b, raw))
    if solver == "highs":
        return via_highs
    closed = exact()
    _cross_check(closed and closed[0], via_highs and via_highs[0], mip_gap, detail)
    return closed


# ---------------------------------------------------------------------------- the closed form

def _tol(v: float) -> float:
    return REL_TOL * max(1.0, abs(v))


def _count_at(v: float, a: float, b: float, lo: int, hi: int) -> int:
    """Largest n in [lo, hi] with a*n + b <= v (within tolerance); lo - 1 if even lo does not fit."""
    limit = v + _tol(v)
    if a * lo + b > limit:
        return lo - 1
    n = min(hi, max(lo, math.floor((limit - b) / a)))
    while n < hi and a * (n + 1) + b <= limit:   # the division may round either way: fix it up
        n += 1
    while n > lo and a * n + b > limit:
        n -= 1
    return n


def _caps_at(v: float, a: Sequence[float], b: Sequence[float], lo: Sequence[int], hi: Sequence[int]) -> list[int]:
    return [_count_at(v, a[j], b[j], lo[j], hi[j]) for j in range(len(a))]


def _bottleneck(a: Sequence[float], b: Sequence[float], x: Sequence[int]) -> float:
    return max(a[j] * x[j] + b[j] for j in range(len(a)))


def _relaxed_level(a, b, lo, hi, total, copies=None) -> float:
    """A level v where the continuous relaxation sum_j n_j·clip((v - b_j)/a_j, lo_j, hi_j) reaches
    `total` (n_j = copies[j], default 1).

    The integer slot count at v is at most that, and at least `total - sum n`, so it is a cheap
    starting point for the exact order statistic. Requires sum(n·lo) <= total <= sum(n·hi).
    """
    n = copies or [1] * len(a)
    events = []
    for j in range(len(a)):
        if hi[j] > lo[j]:
            events.append((a[j] * lo[j] + b[j], n[j] / a[j]))
            events.append((a[j] * hi[j] + b[j], -n[j] / a[j]))
    events.sort()
    level, slope, v = float(sum(c * x for c, x in zip(n, lo))), 0.0, events[0][0] if events else 0.0
    for t, d_slope in events:
        reach = level + slope * (t - v)
        if reach >= total and slope > 0:
            return v + (total - level) / slope
        level, v = reach, t
        slope += d_slope
    return v


def _optimum(a: Sequence[float], b: Sequence[float], lo: Sequence[int], hi: Sequence[int], total: int) -> float | None:
    """v* = min max_j (a_j x_j + b_j) over integers lo <= x <= hi with sum x = total; None if none exist."""
    if sum(lo) > total or sum(hi) < total:
        return None
    s = len(a)
    base = max(a[j] * lo[j] + b[j] for j in range(s))
    if total == sum(lo):
        return base
    x = _smallest_slots(a, b, lo, hi, total - sum(lo), tie=1)   # v* is the largest slot taken
    return max(base, max(a[j] * x[j] + b[j] for j in range(s) if x[j] > lo[j]))


def _choose(a: Sequence[float], b: Sequence[float], lo: Sequence[int], caps: Sequence[int], total: int,
            prefer: Sequence[int] | None) -> list[int]:
    """The tie-break among optimal solutions {lo <= x <= caps, sum x = total} (module docstring): from
    the caps (or the preferred counts) remove from the slowest stage first, or add where the stage
    stays fastest; among equal slots the later stage keeps its slot and the earlier one gets one."""
    s = len(a)
    x = list(caps) if prefer is None else [min(max(prefer[j], lo[j]), caps[j]) for j in range(s)]
    diff = sum(x) - total
    if diff > 0:   # keep the smallest slots above lo, equal ones by the later stage first
        return _smallest_slots(a, b, lo, x, total - sum(lo), tie=-1)
    if diff < 0:
        return _smallest_slots(a, b, x, caps, -diff, tie=1)
    return x


def _smallest_slots(a: Sequence[float], b: Sequence[float], start: Sequence[int], stop: Sequence[int],
                    count: int, tie: int) -> list[int]:
    """x with start <= x <= stop that takes the `count` smallest slots n in (start_j, stop_j], a slot
    valued a_j·n + b_j, equal values ranked by tie·j. Every slot up to the relaxed level at once, then
    at most one slot per stage one by one: the counts can be millions (ILP-2 on thousands of
    pipelines beside one whose lower bound sets v)."""
    s = len(a)
    count = min(count, sum(stop) - sum(start))
    u = _relaxed_level(a, b, start, stop, sum(start) + count)
    x = [_slots_upto(u, a[j], b[j], start[j], stop[j]) for j in range(s)]
    extra = sum(x) - sum(start) - count
    if extra > 0:     # a hair above: give back the largest-ranked slots taken
        heap = [(-(a[j] * x[j] + b[j]), -tie * j) for j in range(s) if x[j] > start[j]]
        heapq.heapify(heap)
        for _ in range(extra):
            _, k = heapq.heappop(heap)
            j = -tie * k
            x[j] -= 1
            if x[j] > start[j]:
                heapq.heappush(heap, (-(a[j] * x[j] + b[j]), k))
    elif extra < 0:   # below: take the smallest-ranked slots left
        heap = [(a[j] * (x[j] + 1) + b[j], tie * j) for j in range(s) if x[j] < stop[j]]
        heapq.heapify(heap)
        for _ in range(-extra):
            _, k = heapq.heappop(heap)
            j = tie * k
            x[j] += 1
            if x[j] < stop[j]:
                heapq.heappush(heap, (a[j] * (x[j] + 1) + b[j], k))
    return x


def _slots_upto(u: float, a: float, b: float, start: int, stop: int) -> int:
    """Largest n in [start, stop] with a*n + b <= u, compared exactly as the slots are."""
    if not math.isfinite(u):
        return stop if u > 0 else start
    n = min(stop, max(start, math.floor((u - b) / a)))
    while n < stop and a * (n + 1) + b <= u:
        n += 1
    while n > start and a * n + b > u:
        n -= 1
    return n


# ---------------------------------------------------------------------------- checks

def _check_solution(x, a, b, lo, hi, total, what: str) -> None:
    """HiGHS's integers must satisfy the model we built; anything else is a bug in the model."""
    bad = [j for j in range(len(x)) if not lo[j] <= x[j] <= hi[j]]
    if bad or sum(x) != total:
        raise PlannerInternalError(
            f"{what}: HiGHS returned {list(x)} which violates the model (sum must be {total}, "
            f"bounds {list(zip(lo, hi))}, out of bounds at {bad})")


def _cross_check(closed: float | None, via_highs: float | None, mip_gap: float, what: str) -> None:
    """solver='both': the objective values must agree (HiGHS within its gap and 1e-6 feasibility tolerance)."""
    if (closed is None) != (via_highs is None):
        raise PlannerInternalError(
            f"{what}: closed form says {'infeasible' if closed is None else closed}, "
            f"HiGHS says {'infeasible' if via_highs is None else via_highs}")
    if closed is None:
        return
    tol = 1e-6 + _tol(closed)
    upper = closed / (1.0 - mip_gap) if mip_gap > 0 else closed
    if not closed - tol <= via_highs <= upper + tol:
        raise PlannerInternalError(f"{what}: closed form optimum {closed!r} differs from HiGHS {via_highs!r}")


def _floats(name: str, values: Sequence[float], positive: bool = False, nonnegative: bool = False) -> list[float]:
    out = []
    for i, v in enumerate(values):
        try:
            f = float(v)
        except (TypeError, ValueError):
            raise ValueError(f"{name}[{i}] = {v!r} is not a number") from None
        if not math.isfinite(f) or (positive and f <= 0) or (nonnegative and f < 0):
            need = "a positive" if positive else "a non-negative" if nonnegative else "a finite"
            raise ValueError(f"{name}[{i}] = {v!r}: must be {need} finite number")
        out.append(f)
    return out


def _check_count(name: str, v: int, minimum: int) -> None:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < minimum:
        raise ValueError(f"{name} = {v!r}: must be an integer >= {minimum}")


def _check_solver(solver: str, time_limit_s: float, mip_gap: float) -> None:
    if solver not in SOLVERS:
        raise ValueError(f"solver {solver!r} is not one of {SOLVERS}")
    if not (time_limit_s > 0):
        raise ValueError(f"time_limit_s = {time_limit_s!r}: must be > 0 seconds")
    if not (0 <= mip_gap < 1):
        raise ValueError(f"mip_gap = {mip_gap!r}: must be in [0, 1)")


def _prefer(prefer: Sequence[int] | None, n: int) -> list[int] | None:
    if prefer is None:
        return None
    p = list(prefer)
    if len(p) != n:
        raise ValueError(f"prefer has {len(p)} entries, expected {n} (one per stage / pipeline)")
    for i, v in enumerate(p):
        _check_count(f"prefer[{i}]", v, minimum=0)
    return [int(v) for v in p]
