"""Lower level of the planner (ILP-1 layers, ILP-2 micro-batches): hand checks, oracles, regressions.

Oracles: the worked example (top plans, memory check), brute-force enumeration on tiny instances,
and HiGHS (raw model output, read straight from `planner.ilp`) on larger random ones.
"""
from __future__ import annotations

import collections
import itertools
import math
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from malleus_svc.planner import ilp
from malleus_svc.planner.lower import (
    DataSolution, LayerSolution, PlannerInternalError, bottleneck, layer_caps, solve_layers,
    solve_micro_batches, solve_micro_batches_by_class, uncapped_bottleneck,
)
from malleus_svc.costmodel.profile import MemoryProfile
from malleus_svc.highs import SolverError

# The worked example: K for d = 4..1, E, X0, C, delta  ->  C - delta = 36440, budget C - delta - X0 = 31940
GPT_MEM = MemoryProfile(layer_mb=(1500, 1270, 1040, 810), embedding_mb=600, reserved_mb=4500,
                        safety_margin_mb=4096, gpu_memory_mb=40536)
ROOMY = MemoryProfile(layer_mb=(1.0,), embedding_mb=0, reserved_mb=0, safety_margin_mb=0, gpu_memory_mb=1e9)
PROPS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-6)


# ------------------------------------------------------------------ independent reference code

def fits(memory: MemoryProfile, h: float, s: int, j: int, l: int) -> bool:
    """The memory model's row written out directly (not through layer_caps)."""
    e = memory.embedding_mb if j in (0, s - 1) else 0
    return h * (memory.per_layer_mb(s - j) * l + e) + memory.reserved_mb <= memory.gpu_memory_mb - memory.safety_margin_mb


def compositions(total: int, parts: int, lower: list[int]):
    """Every integer vector x >= lower with sum x = total."""
    rest = total - sum(lower)
    if rest < 0:
        return
    for cuts in itertools.combinations(range(rest + parts - 1), parts - 1):
        bounds = (-1, *cuts, rest + parts - 1)
        yield [lower[i] + bounds[i + 1] - bounds[i] - 1 for i in range(parts)]


def layer_time(y, e, l):
    return max(y[j] * l[j] + e[j] for j in range(len(y)))


def data_time(z, s, m, objective):
    off = [0] * len(z) if objective == "paper" else [si - 1 for si in s]
    return max((m[i] + off[i]) * z[i] for i in range(len(z)))


def brute_layers(y, h, L, memory, e):
    """All feasible layer vectors and the optimum, by enumeration."""
    s = len(y)
    feas = [l for l in compositions(L, s, [0] * s) if all(fits(memory, h[j], s, j, l[j]) for j in range(s))]
    if not feas:
        return None, []
    best = min(layer_time(y, e, l) for l in feas)
    return best, [l for l in feas if close(layer_time(y, e, l), best)]


def brute_data(z, s, M, objective):
    lower = list(s) if objective == "paper" else [1] * len(z)
    feas = list(compositions(M, len(z), lower))
    if not feas:
        return None, []
    best = min(data_time(z, s, m, objective) for m in feas)
    return best, [m for m in feas if close(data_time(z, s, m, objective), best)]


def check_layers(sol: LayerSolution, y, h, L, memory, e):
    s = len(y)
    assert len(sol.layers) == s and sum(sol.layers) == L and min(sol.layers) >= 0
    assert all(fits(memory, h[j], s, j, sol.layers[j]) for j in range(s)), sol
    assert close(sol.z, layer_time(y, e, sol.layers))


def check_data(sol: DataSolution, z, s, M, objective):
    lower = list(s) if objective == "paper" else [1] * len(z)
    assert len(sol.micro_batches) == len(z) and sum(sol.micro_batches) == M
    assert all(m >= lb for m, lb in zip(sol.micro_batches, lower))
    assert close(sol.w, data_time(z, s, sol.micro_batches, objective))


# ------------------------------------------------------------------ strategies

rate = st.one_of(st.sampled_from([1.0, 1.5, 1.9, 2.0, 3.66, 4.0, 7.22, 8.0]),
                 st.integers(20, 800).map(lambda n: n / 100))
extra_term = st.one_of(st.just(0.0), st.integers(0, 40).map(lambda n: n / 10))
h_factor = st.sampled_from([1, 2, 4, 8])
objective = st.sampled_from(["paper", "bubble", "full"])


@st.composite
def memories(draw, max_budget: int):
    n = draw(st.integers(1, 5))
    k = sorted(draw(st.lists(st.integers(50, 2000), min_size=n, max_size=n)), reverse=True)
    budget = draw(st.integers(0, max_budget))
    safety, reserved = draw(st.integers(0, 5000)), draw(st.integers(0, 5000))
    return MemoryProfile(layer_mb=tuple(float(x) for x in k), embedding_mb=draw(st.integers(0, 1000)),
                         reserved_mb=reserved, safety_margin_mb=safety, gpu_memory_mb=budget + reserved + safety)


@st.composite
def layer_instances(draw, max_stages: int, max_layers: int, max_budget: int):
    s = draw(st.integers(1, max_stages))
    y = draw(st.lists(rate, min_size=s, max_size=s))
    h = draw(st.lists(h_factor, min_size=s, max_size=s))
    e = draw(st.one_of(st.none(), st.lists(extra_term, min_size=s, max_size=s)))
    return y, h, draw(st.integers(1, max_layers)), draw(memories(max_budget)), e


@st.composite
def data_instances(draw, max_pipes: int, max_stages: int, max_mb: int):
    p = draw(st.integers(1, max_pipes))
    z = draw(st.lists(st.one_of(st.integers(1, 40).map(float), rate.map(lambda r: r * 7)), min_size=p, max_size=p))
    s = draw(st.lists(st.integers(1, max_stages), min_size=p, max_size=p))
    return z, s, draw(st.integers(1, max_mb)), draw(objective)


# ------------------------------------------------------------------ hand checks (the worked example)

def test_memory_caps_match_the_worked_example():
    assert layer_caps([4, 4, 2, 1], 100, GPT_MEM) == (4, 6, 15, 38)
    assert layer_caps([1, 2], 100, GPT_MEM) == (30, 18)
    assert layer_caps([4, 4, 2, 1], 32, GPT_MEM) == (4, 6, 15, 32)   # clipped at L


@pytest.mark.parametrize("solver", ["closed_form", "highs", "both"])
def test_plan_1_of_the_worked_example(solver):
    p0 = solve_layers([4, 4, 2, 1], [4, 4, 2, 1], 32, GPT_MEM, solver=solver)
    assert p0 == LayerSolution(16.0, (4, 4, 8, 16))
    p1 = solve_layers([2, 2], [1, 2], 32, GPT_MEM, solver=solver)
    assert p1 == LayerSolution(32.0, (16, 16))
    assert solve_micro_batches([p0.z, p1.z], [4, 2], 64, solver=solver) == DataSolution(688.0, (43, 21))


def test_plan_2_tie_and_the_bubble_objective():
    # The worked example's plan 2: [2,2,2] ties between [10,11,11] and [11,10,11]; default removes the surplus
    # from the lowest-index slowest stage. [4,4,1] -> [5,5,22]; micro-batches [32,32], w = 704.
    assert solve_layers([2, 2, 2], [2, 2, 2], 32, GPT_MEM) == LayerSolution(22.0, (10, 11, 11))
    assert solve_layers([4, 4, 1], [4, 4, 1], 32, GPT_MEM) == LayerSolution(22.0, (5, 5, 22))
    assert solve_micro_batches([22, 22], [3, 3], 64) == DataSolution(704.0, (32, 32))
    # Bubble-aware: max((m0 + 3) * 16, (m1 + 1) * 32) = 736 at both (43, 21) and (42, 22); the caps
    # at 736 are (43, 22) and the surplus block leaves the lowest-index slowest pipeline: (42, 22).
    assert solve_micro_batches([16, 32], [4, 2], 64, "bubble") == DataSolution(736.0, (42, 22))


def test_infeasible_returns_none():
    assert solve_layers([4, 4, 2, 1], [4, 4, 2, 1], 64, GPT_MEM) is None       # caps 4+6+15+38 = 63
    assert solve_layers([4, 4, 2, 1], [4, 4, 2, 1], 63, GPT_MEM) is not None
    assert solve_layers([1, 1], [8, 8], 32, GPT_MEM, solver="both") is None     # embedding alone overflows
    assert solve_micro_batches([1, 1], [4, 4], 7, solver="both") is None
    # bubble: m >= 1 only; (3+3)*1 vs (4+3)*1, tie (4,3)/(3,4): the surplus leaves stage 0 first.
    assert solve_micro_batches([1, 1], [4, 4], 7, "bubble") == DataSolution(7.0, (3, 4))
    # a first/last stage whose embedding alone overflows makes the pipeline infeasible (not "0 blocks")
    tight = MemoryProfile(layer_mb=(50.0,), embedding_mb=51, reserved_mb=0, safety_margin_mb=0, gpu_memory_mb=101)
    assert layer_caps([1, 1, 2], 2, tight) == (1, 2, 0)     # last stage: 2 * (0 + 51) > 101
    assert solve_layers([1, 1, 1], [1, 1, 2], 2, tight, solver="both") is None
    assert solve_layers([1, 1, 1], [1, 1, 1], 2, tight) == LayerSolution(1.0, (0, 1, 1))


# ------------------------------------------------------------------ properties: closed form vs oracles

@PROPS
@given(layer_instances(max_stages=4, max_layers=8, max_budget=8000))
def test_layers_closed_form_against_brute_force(inst):
    y, h, L, mem, e = inst
    ee = e or [0.0] * len(y)
    best, _ = brute_layers(y, h, L, mem, ee)
    sol = solve_layers(y, h, L, mem, extra=e)
    if best is None:
        assert sol is None
    else:
        check_layers(sol, y, h, L, mem, ee)
        assert close(sol.z, best)


@PROPS
@given(st.lists(rate, min_size=1, max_size=40), st.integers(1, 160))
def test_the_uncapped_bottleneck_equals_ilp1_with_no_cap(y, L):
    """The annealing's floor and the stage order's lower bound: the same z as ILP-1 with every cap L."""
    assert uncapped_bottleneck(y, L) == bottleneck(y, [L] * len(y), L)


@PROPS
@given(data_instances(max_pipes=4, max_stages=4, max_mb=12))
def test_micro_batches_closed_form_against_brute_force(inst):
    z, s, M, obj = inst
    best, _ = brute_data(z, s, M, obj)
    sol = solve_micro_batches(z, s, M, obj)
    if best is None:
        assert sol is None
    else:
        check_data(sol, z, s, M, obj)
        assert close(sol.w, best)


@PROPS
@given(layer_instances(max_stages=8, max_layers=80, max_budget=40000))
def test_layers_closed_form_against_highs(inst):
    y, h, L, mem, e = inst
    ee = e or [0.0] * len(y)
    raw = ilp.solve_layers_model(y, h, L, mem, ee, time_limit_s=10.0, mip_gap=0.0)
    sol = solve_layers(y, h, L, mem, extra=e)
    assert (raw is None) == (sol is None)
    if sol is not None:
        check_layers(sol, y, h, L, mem, ee)
        check_layers(LayerSolution(layer_time(y, ee, raw), tuple(raw)), y, h, L, mem, ee)
        assert close(layer_time(y, ee, raw), sol.z)
        assert solve_layers(y, h, L, mem, extra=e, solver="both") == sol


@PROPS
@given(data_instances(max_pipes=8, max_stages=8, max_mb=256))
def test_micro_batches_closed_form_against_highs(inst):
    z, s, M, obj = inst
    lower = list(s) if obj == "paper" else [1] * len(z)
    offsets = [0.0] * len(z) if obj == "paper" else [(si - 1) * zi for si, zi in zip(s, z)]
    raw = ilp.solve_micro_batches_model(z, offsets, lower, M, time_limit_s=10.0, mip_gap=0.0)
    sol = solve_micro_batches(z, s, M, obj)
    assert (raw is None) == (sol is None)
    if sol is not None:
        check_data(sol, z, s, M, obj)
        check_data(DataSolution(data_time(z, s, raw, obj), tuple(raw)), z, s, M, obj)
        assert close(data_time(z, s, raw, obj), sol.w)
        assert solve_micro_batches(z, s, M, obj, solver="both") == sol


@PROPS
@given(st.data())
def test_micro_batches_by_class_equal_the_pipeline_by_pipeline_solution(data):
    """Repeated pipelines solved once per class give the same vector, tie-break included: small
    integer times make equal slots across classes common."""
    k = data.draw(st.integers(1, 4))
    whole = data.draw(st.booleans())
    time = st.integers(1, 6).map(float) if whole else st.floats(0.5, 6.0)
    z = data.draw(st.lists(time, min_size=k, max_size=k))
    stages = data.draw(st.lists(st.integers(1, 4), min_size=k, max_size=k))
    fill = data.draw(st.lists(st.integers(0, 8).map(float) if whole else st.floats(0.0, 9.0), min_size=k, max_size=k))
    of = data.draw(st.permutations(list(range(k)) + data.draw(st.lists(st.integers(0, k - 1), max_size=10))))
    M = data.draw(st.integers(1, 60))
    obj = data.draw(st.sampled_from(["paper", "bubble", "full"]))
    f = fill if obj == "full" else None
    members = [[i for i, c in enumerate(of) if c == j] for j in range(k)]
    want = solve_micro_batches([z[c] for c in of], [stages[c] for c in of], M, obj,
                               fill=None if f is None else [f[c] for c in of])
    got = solve_micro_batches_by_class(of, dict(enumerate(z)), dict(enumerate(stages)), M, obj,
                                       None if f is None else dict(enumerate(f)))
    assert (got is None) == (want is None)
    if want is not None:
        assert got.w == want.w
        assert got.micro_batches(of) == want.micro_batches
        for k, ms in enumerate(members):
            assert sorted(got.counts(k, len(ms))) == sorted(collections.Counter(want.micro_batches[i] for i in ms).items())


# ------------------------------------------------------------------ tie-break with prefer

@PROPS
@given(layer_instances(max_stages=4, max_layers=8, max_budget=8000), st.data())
def test_layers_prefer_is_l1_closest_optimum(inst, data):
    y, h, L, mem, e = inst
    ee = e or [0.0] * len(y)
    best, optimal = brute_layers(y, h, L, mem, ee)
    if best is None:
        return
    prefer = data.draw(st.lists(st.integers(0, 10), min_size=len(y), max_size=len(y)))
    sol = solve_layers(y, h, L, mem, extra=e, prefer=prefer)
    check_layers(sol, y, h, L, mem, ee)
    assert close(sol.z, best)
    dist = lambda l: sum(abs(a - b) for a, b in zip(l, prefer))  # noqa: E731
    assert dist(sol.layers) == min(dist(l) for l in optimal)
    previous = data.draw(st.sampled_from(optimal))   # an optimal previous layout is kept as is
    assert solve_layers(y, h, L, mem, extra=e, prefer=previous).layers == tuple(previous)


@PROPS
@given(data_instances(max_pipes=4, max_stages=4, max_mb=12), st.data())
def test_micro_batches_prefer_is_l1_closest_optimum(inst, data):
    z, s, M, obj = inst
    best, optimal = brute_data(z, s, M, obj)
    if best is None:
        return
    prefer = data.draw(st.lists(st.integers(0, 12), min_size=len(z), max_size=len(z)))
    sol = solve_micro_batches(z, s, M, obj, prefer=prefer)
    check_data(sol, z, s, M, obj)
    assert close(sol.w, best)
    dist = lambda m: sum(abs(a - b) for a, b in zip(m, prefer))  # noqa: E731
    assert dist(sol.micro_batches) == min(dist(m) for m in optimal)
    previous = data.draw(st.sampled_from(optimal))
    assert solve_micro_batches(z, s, M, obj, prefer=previous).micro_batches == tuple(previous)


@pytest.mark.parametrize("solver", ["closed_form", "highs"])
def test_prefer_keeps_the_previous_tie(solver):
    assert solve_layers([2, 2, 2], [2, 2, 2], 32, GPT_MEM, prefer=[11, 10, 11], solver=solver).layers == (11, 10, 11)
    # not optimal (z = 24 > 22) -> clipped to (11, 10, 10), the missing block goes to the stage that
    # stays fastest, lowest index first: (11, 11, 10), at L1 distance 2 like (11, 10, 11).
    assert solve_layers([2, 2, 2], [2, 2, 2], 32, GPT_MEM, prefer=[12, 10, 10], solver=solver).layers == (11, 11, 10)


def test_products_equal_up_to_rounding_are_ties():
    # 0.1 * 3 = 0.30000000000000004 > 0.3 = 0.3 * 1 in floating point; mathematically both are 0.3.
    assert solve_layers([0.1, 0.3], [1, 1], 3, ROOMY, prefer=[3, 0]).layers == (3, 0)
    assert solve_layers([0.1, 0.3], [1, 1], 3, ROOMY, prefer=[2, 1]).layers == (2, 1)
    assert solve_micro_batches([0.1, 0.3, 0.1], [1, 1, 1], 5, prefer=[3, 1, 1]).micro_batches == (3, 1, 1)
    assert solve_micro_batches([0.1, 0.3, 0.1], [1, 1, 1], 5).micro_batches == (2, 1, 2)
    # memory exactly at the limit fits: 1 * (0.1 * 3 + 0) + 0 <= 0.3
    exact = MemoryProfile(layer_mb=(0.1,), embedding_mb=0, reserved_mb=0, safety_margin_mb=0, gpu_memory_mb=0.3)
    assert layer_caps([1], 10, exact) == (3,)


# ------------------------------------------------------------------ regressions of the authors' faults

def test_fault_4_more_stages_than_memory_profile_entries():
    # len(K) = 4, six stages: K[6], K[5] extrapolate with the step 1500 - 1270 = 230.
    h = [1, 1, 1, 1, 1, 1]
    caps = layer_caps(h, 100, GPT_MEM)
    assert caps[0] == math.floor((31940 - 600) / 1960) and caps[1] == math.floor(31940 / 1730)
    assert caps[2:] == (21, 25, 30, 38)
    for solver in ("closed_form", "highs", "both"):
        assert solve_layers([1] * 6, h, 90, GPT_MEM, solver=solver) == LayerSolution(15.0, (15,) * 6)
        assert solve_layers([1] * 6, h, 96, GPT_MEM, solver=solver) == LayerSolution(17.0, (15, 16, 16, 16, 16, 17))


@pytest.mark.parametrize("solver", ["closed_form", "highs", "both"])
def test_fault_3_twelve_stages_and_pipelines_keep_their_order(solver):
    # Rates 27720/(j+1): the unique optimum gives stage j exactly j+1 blocks (bottleneck 27720).
    n = 12
    y = [27720 / (j + 1) for j in range(n)]
    expected = tuple(range(1, n + 1))
    assert solve_layers(y, [1] * n, sum(expected), ROOMY, solver=solver) == LayerSolution(27720.0, expected)
    assert solve_micro_batches(y, [1] * n, sum(expected), solver=solver) == DataSolution(27720.0, expected)
    # The raw HiGHS output, before any canonicalisation, is in index order too.
    assert ilp.solve_layers_model(y, [1] * n, sum(expected), ROOMY, [0.0] * n, 10.0, 0.0) == list(expected)
    assert ilp.solve_micro_batches_model(y, [0.0] * n, [1] * n, sum(expected), 10.0, 0.0) == list(expected)


# ------------------------------------------------------------------ errors and cost

def test_bad_inputs_say_what_is_wrong():
    with pytest.raises(ValueError, match=r"rates\[1\] = 0"):
        solve_layers([1, 0], [1, 1], 4, GPT_MEM)
    with pytest.raises(ValueError, match="mem_factors has 1 entries"):
        solve_layers([1, 1], [1], 4, GPT_MEM)
    with pytest.raises(ValueError, match="solver 'cbc'"):
        solve_layers([1], [1], 4, GPT_MEM, solver="cbc")
    with pytest.raises(ValueError, match="prefer has 3 entries"):
        solve_micro_batches([1, 2], [1, 1], 8, prefer=[1, 2, 3])
    with pytest.raises(ValueError, match="objective 'fast'"):
        solve_micro_batches([1, 2], [1, 1], 8, objective="fast")


def test_time_limit_without_incumbent_raises_solver_error():
    y = [(100 + 37 * j % 900) / 97 for j in range(40)]
    with pytest.raises(SolverError, match="time limit"):
        solve_layers(y, [1] * 40, 1000, ROOMY, solver="highs", time_limit_s=1e-9)


def test_cross_check_reports_disagreement():
    from malleus_svc.planner import lower
    with pytest.raises(PlannerInternalError, match="differs from HiGHS"):
        lower._cross_check(16.0, 17.0, 0.0, "ILP-1 test")
    with pytest.raises(PlannerInternalError, match="infeasible"):
        lower._cross_check(None, 17.0, 0.0, "ILP-1 test")
    lower._cross_check(16.0, 16.0 + 1e-9, 0.0, "ILP-1 test")


def test_closed_form_path_does_not_import_pyomo():
    code = ("import sys, malleus_svc.planner.lower as lw, malleus_svc.planner.problem as pb\n"
            "m = pb.MemoryProfile((1.0,), 0, 0, 0, 1e9)\n"
            "assert lw.solve_layers([1, 2], [1, 1], 8, m).layers == (5, 3)\n"
            "assert lw.solve_micro_batches([3.0, 5.0], [2, 2], 16) is not None\n"
            "assert not any(k.split('.')[0] == 'pyomo' for k in sys.modules), 'pyomo was imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_an_ilp_that_highs_presolve_fails_on_is_solved_without_it():
    """HiGHS's presolve returns an error on this ILP-2 (found by the property test above); the
    wrapper retries without presolve and gets the closed form's optimum."""
    z, s, M = [29.0, 20.0, 50.54, 25.0, 21.56, 9.0, 21.7], [1, 5, 2, 5, 5, 1, 2], 54
    offsets = [(si - 1) * zi for si, zi in zip(s, z)]
    raw = ilp.solve_micro_batches_model(z, offsets, [1] * len(z), M, time_limit_s=10.0, mip_gap=0.0)
    sol = solve_micro_batches(z, s, M, "bubble")
    assert raw is not None and close(data_time(z, s, raw, "bubble"), sol.w)


def _tie_break_one_slot_at_a_time(a, b, lo, caps, total, prefer):
    """The tie-break as the module states it, one slot at a time: from the caps (or the preferred
    counts) remove from the slowest stage, earlier stages first among equals, or add where the stage
    stays fastest, earlier stages first."""
    x = list(caps) if prefer is None else [min(max(p, l), c) for p, l, c in zip(prefer, lo, caps)]
    while sum(x) > total:
        j = min((j for j in range(len(a)) if x[j] > lo[j]), key=lambda j: (-(a[j] * x[j] + b[j]), j))
        x[j] -= 1
    while sum(x) < total:
        j = min((j for j in range(len(a)) if x[j] < caps[j]), key=lambda j: (a[j] * (x[j] + 1) + b[j], j))
        x[j] += 1
    return x


@PROPS
@given(st.data())
def test_the_tie_break_takes_slots_in_bulk_as_it_would_one_at_a_time(data):
    """The closed form settles every slot below a relaxed level at once (ILP-2 over thousands of
    pipelines can have millions to give back); the layout is the one the slot-by-slot rule gives."""
    from malleus_svc.planner.lower import _caps_at, _choose, _optimum

    s = data.draw(st.integers(1, 8))
    a = data.draw(st.lists(st.sampled_from([0.7, 1.0, 1.5, 2.0, 3.0, 1e6]), min_size=s, max_size=s))
    b = data.draw(st.lists(st.sampled_from([0.0, 1.0, 2.5]), min_size=s, max_size=s))
    lo = data.draw(st.lists(st.integers(0, 3), min_size=s, max_size=s))
    hi = [lo_j + data.draw(st.integers(0, 40)) for lo_j in lo]
    total = data.draw(st.integers(sum(lo), sum(hi)))
    prefer = data.draw(st.none() | st.lists(st.integers(0, 45), min_size=s, max_size=s))
    caps = _caps_at(_optimum(a, b, lo, hi, total), a, b, lo, hi)
    assert _choose(a, b, lo, caps, total, prefer) == _tie_break_one_slot_at_a_time(a, b, lo, caps, total, prefer)


def test_micro_batches_beside_a_pipeline_that_sets_the_optimum_alone():
    """One pipeline of a dead device (z = 1e6, at least its 2 stages' micro-batches) beside 4,095
    healthy ones: each healthy one could take all M, and the layout still balances them."""
    z = [1e6] + [2.0] * 4095
    sol = solve_micro_batches(z, [2] * 4096, 32768)
    assert sol.micro_batches[0] == 2 and sum(sol.micro_batches) == 32768
    assert max(sol.micro_batches[1:]) - min(sol.micro_batches[1:]) <= 1
