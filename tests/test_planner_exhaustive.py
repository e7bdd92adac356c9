"""Exhaustive search: it is exhaustive (a brute force over concrete plans agrees on tiny clusters),
it refuses clusters it cannot enumerate, and on random small scenarios it is the reference the
default search is measured against."""
from __future__ import annotations

import itertools
import math
import random
from dataclasses import replace

import pytest

from benchmarks.small_problems import OBJECTIVES, describe, random_problem
from malleus_svc.config import Scenario
from malleus_svc.config.errors import ConfigError
from malleus_svc.plan import Pipeline, Plan, Stage
from malleus_svc.planner import (CommCosts, InfeasibleError, MemoryProfile, PlannerProblem, evaluate,
                                 memory_violations, plan)
from malleus_svc.planner.build import build_problem
from malleus_svc.planner.exhaustive import EXACT_OBJECTIVES, optimum

RANDOM_CASES = 40     # per objective; `malleus bench planner --small N` runs a bigger sweep


def tiny(rng: random.Random, objective: str) -> PlannerProblem:
    """2 to 4 devices, few blocks and micro-batches: small enough to list every concrete plan."""
    nodes = rng.choice((1, 2))
    per_node = rng.choice((1, 2)) if nodes == 2 else rng.choice((2, 3, 4))
    tp = rng.choice([t for t in (1, 2) if per_node % t == 0])
    devices = nodes * per_node
    rates = tuple(rng.choice((1.0, 1.0, 1.5, 2.0, 4.0)) for _ in range(devices))
    budget = rng.choice((1e9, 420.0, 300.0))
    memory = MemoryProfile((100.0, 90.0, 80.0, 70.0), 20.0, 0.0, 0.0, budget)
    comm = CommCosts(0.05, 0.4, 0.0) if objective == "full" else CommCosts()
    return PlannerProblem(num_nodes=nodes, gpus_per_node=per_node, num_layers=rng.choice((3, 4, 5)), dp=1, tp=tp,
                          pp=devices // tp, num_micro_batches=rng.choice((3, 4, 6)), micro_batch_size=1, rates=rates,
                          tp_alpha=(1.0, 1.8)[:tp.bit_length()], memory=memory, objective=objective, comm=comm)


def _partial_partitions(devices: list[int], sizes: list[int]):
    """Every way to cut some of `devices` into groups of the allowed sizes (the rest idle)."""
    if not devices:
        yield []
        return
    d, rest = devices[0], devices[1:]
    yield from _partial_partitions(rest, sizes)                 # d idle
    for s in sizes:
        for mates in itertools.combinations(rest, s - 1):
            left = [x for x in rest if x not in mates]
            for tail in _partial_partitions(left, sizes):
                yield [(d, *mates), *tail]


def _ordered_partitions(items: list):
    """Every set of non-empty sequences using all of `items`."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _ordered_partitions(rest):
        for i in range(len(part)):                             # into an existing sequence, any position
            for pos in range(len(part[i]) + 1):
                yield part[:i] + [part[i][:pos] + [first] + part[i][pos:]] + part[i + 1:]
        yield part + [[first]]


def _compositions(total: int, parts: int, lows: list[int]):
    if parts == 1:
        if total >= lows[0]:
            yield (total,)
        return
    for x in range(lows[0], total - sum(lows[1:]) + 1):
        for rest in _compositions(total - x, parts - 1, lows[1:]):
            yield (x, *rest)


def brute_force(problem: PlannerProblem) -> float:
    """The best `evaluate` over every concrete plan: groupings, idle groups, pipelines, stage orders,
    blocks per stage and micro-batches per pipeline all listed, memory checked plan by plan."""
    sizes = [problem.tp >> r for r in range(problem.max_split + 1)]
    g = problem.gpus_per_node
    per_node = [list(_partial_partitions([d for d in range(n * g, (n + 1) * g) if d not in problem.excluded], sizes))
                for n in range(problem.num_nodes)]
    best = math.inf
    for combo in itertools.product(*per_node):
        groups = [grp for part in combo for grp in part]
        for k in range(1, len(groups) + 1):
            for used in itertools.combinations(groups, k):
                for pipes in _ordered_partitions(list(used)):
                    lows = [len(p) if problem.objective == "paper" else 1 for p in pipes]
                    for layers in itertools.product(*(list(_compositions(problem.num_layers, len(p), [1] * len(p)))
                                                      for p in pipes)):
                        for m in _compositions(problem.num_micro_batches, len(pipes), lows):
                            best = min(best, _value(problem, pipes, layers, m))
    return best


def _value(problem: PlannerProblem, pipes, layers, m) -> float:
    out = []
    for groups, ls, mi in zip(pipes, layers, m):
        starts = list(itertools.accumulate((0, *ls)))
        out.append(Pipeline(tuple(Stage(grp, (starts[j], starts[j + 1])) for j, grp in enumerate(groups)), mi))
    used = {d for p in out for d in p.devices}
    p = Plan(problem.num_devices, problem.num_layers, 1, tuple(out),
             tuple(d for d in range(problem.num_devices) if d not in used), (), problem.gpus_per_node,
             problem.objective)
    return math.inf if memory_violations(problem, p) else evaluate(problem, p)


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_exhaustive_equals_a_brute_force_over_every_concrete_plan(objective):
    rng = random.Random(f"tiny-{objective}")
    for _ in range(12):
        problem = tiny(rng, objective)
        best = brute_force(problem)
        found = optimum(problem)
        assert (found is None) == (best == math.inf), describe(problem)
        if found is not None:
            assert found.objective == pytest.approx(best, rel=1e-9), describe(problem)


def test_the_exhaustive_plan_is_valid_and_priced_as_evaluate_prices_it():
    problem = tiny(random.Random(7), "bubble")
    res = plan(replace(problem, search="exhaustive"))
    assert res.objective == pytest.approx(evaluate(problem, res.plan))
    assert memory_violations(problem, res.plan) == []
    assert res.plan.inputs["mode"] == "exhaustive"
    assert res.objective <= plan(problem).objective + 1e-9


def test_more_than_16_devices_is_refused_with_what_is_accepted():
    problem = PlannerProblem(num_nodes=3, gpus_per_node=8, num_layers=8, dp=3, tp=8, pp=1, num_micro_batches=8,
                             micro_batch_size=1, rates=(1.0,) * 24, tp_alpha=(1, 2, 4, 8),
                             memory=MemoryProfile((100.0,), 0.0, 0.0, 0.0, 1e9), search="exhaustive")
    with pytest.raises(ConfigError) as err:
        plan(problem)
    msg = str(err.value)
    assert "\n" not in msg and "at most 16 devices" in msg and "24" in msg and "search: default" in msg


def test_the_scenario_file_chooses_the_search():
    base = {"cluster": {"nodes": 1, "gpus_per_node": 4, "gpu_memory_mb": 40536}, "model": {"layers": 8},
            "parallel": {"dp": 1, "tp": 4, "pp": 1}, "batch": {"global": 8, "micro": 1},
            "profile": {"tp_alpha": [1, 2, 4], "layer_memory_mb": [1500, 1270, 1040, 810], "embedding_memory_mb": 600}}
    assert build_problem(Scenario.from_dict(base)).search == "default"
    sc = Scenario.from_dict({**base, "planner": {"search": "exhaustive", "objective": "paper"}})
    assert build_problem(sc).search == "exhaustive"
    with pytest.raises(ConfigError, match="default, exhaustive"):
        Scenario.from_dict({**base, "planner": {"search": "everything"}})


def _random_cases(objective: str):
    rng = random.Random(f"small-{objective}")
    return [random_problem(rng, objective) for _ in range(RANDOM_CASES)]


@pytest.mark.parametrize("objective", EXACT_OBJECTIVES)   # under 'full' the default search finds better plans
def test_the_default_search_against_exhaustive_on_random_small_scenarios(objective):
    """Exhaustive is the optimum: seeded with the default's objective, it finds a plan at least that
    good whenever the default finds one, and none when neither does. The default search is within 1%
    of it on every scenario; those where it is not are named with their gap."""
    gaps = []
    for problem in _random_cases(objective):
        try:
            default = plan(problem).objective
        except InfeasibleError:
            assert optimum(problem) is None, describe(problem)
            continue
        found = optimum(problem, default * (1 + 1e-6))
        assert found is not None and found.objective <= default * (1 + 1e-6), describe(problem)
        if default > found.objective * 1.01:
            gaps.append(f"{default / found.objective - 1:+.2%}: {describe(problem)}")
    assert not gaps, f"{len(gaps)} of {RANDOM_CASES} scenarios above the optimum:\n" + "\n".join(gaps)


def test_the_default_search_reaches_a_shape_its_family_does_not_build(monkeypatch):
    """Two stragglers of one node (5x and 3x) as one TP group holding 2 of 24 blocks beside healthy
    groups: the candidate family suspends them instead (35 t0); the exhaustive check that ends the
    default search on small clusters finds the optimum (33 t0)."""
    import malleus_svc.planner.exhaustive as exhaustive

    rates = {0: 1.5, 2: 3.0, 3: 1.5, 7: 1.1, 10: 5.0, 11: 1.5, 14: 3.0}
    problem = PlannerProblem(num_nodes=2, gpus_per_node=8, num_layers=24, dp=4, tp=2, pp=2, num_micro_batches=8,
                             micro_batch_size=1, rates=tuple(rates.get(d, 1.0) for d in range(16)), tp_alpha=(1.0, 2.0),
                             memory=MemoryProfile(tuple(100.0 * (1 + 0.15 * d) for d in (3, 2, 1, 0)), 50.0, 0.0, 0.0,
                                                  3580.0), objective="paper")
    best = optimum(problem)
    result = plan(problem)
    assert result.objective == pytest.approx(best.objective) and not memory_violations(problem, result.plan)
    blocks = {tuple(sorted(s.devices)): s.num_layers for p in result.plan.pipelines for s in p.stages}
    assert 0 < blocks.get((10, 14), 0) <= 4, blocks
    assert not result.notes
    monkeypatch.setattr(exhaustive, "WIDEN_VISITS", 0)      # the family alone, and the plan says so
    alone = plan(problem)
    assert alone.objective > best.objective * 1.05 and "stopped after 0 nodes" in " ".join(alone.notes)
