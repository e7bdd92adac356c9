"""Random small planner problems (at most 16 devices), where exhaustive search is the reference.

One or two nodes of 2 to 8 devices, tp 1, 2 or 4 where it divides a node, a baseline dp x tp x pp
that fills the cluster, stragglers at random rates (some just below the straggler threshold),
sometimes excluded devices, memory from loose to tight (a full-size group holds 1.2 to 3 times the
baseline's blocks per stage, or anything), and for 'full' random p2p and gradient costs.
Used by tests/test_planner_exhaustive.py and `malleus bench planner --small N`.
"""
from __future__ import annotations

import random

from malleus_svc.config.scenario import OBJECTIVES
from malleus_svc.planner import CommCosts, MemoryProfile, PlannerProblem

STRAGGLER_RATES = (1.1, 1.5, 2.0, 3.0, 5.0, 8.0)


def random_problem(rng: random.Random, objective: str) -> PlannerProblem:
    nodes = rng.choice((1, 2))
    per_node = rng.randint(2, 8)
    devices = nodes * per_node
    tp = rng.choice([t for t in (1, 2, 4) if per_node % t == 0])
    groups = devices // tp
    pp = rng.choice([d for d in range(1, groups + 1) if groups % d == 0 and d <= 4])
    dp = groups // pp
    layers = rng.choice((8, 12, 16, 24, 32))
    rates = tuple(rng.choice(STRAGGLER_RATES) if rng.random() < 0.25 else 1.0 for _ in range(devices))
    excluded = frozenset(rng.sample(range(devices), rng.randint(1, 2))) if rng.random() < 0.2 and devices > 2 else \
        frozenset()
    per_block = 100.0
    embedding = 50.0
    room = rng.choice((1.2, 1.5, 2.0, 3.0, None))   # blocks a full group holds, over the baseline's per stage
    budget = 1e9 if room is None else per_block * 1.45 * room * layers / pp + 2 * embedding
    memory = MemoryProfile(tuple(per_block * (1 + 0.15 * d) for d in (3, 2, 1, 0)), embedding, 0.0, 0.0, budget)
    alpha = (1.0, round(rng.uniform(1.6, 2.0), 2), round(rng.uniform(3.0, 4.0), 2))[:tp.bit_length()]
    comm = CommCosts()
    if objective == "full":
        comm = CommCosts(round(rng.uniform(0.0, 0.1), 3), round(rng.uniform(0.1, 0.6), 3), round(rng.uniform(0, 2), 2))
    return PlannerProblem(num_nodes=nodes, gpus_per_node=per_node, num_layers=layers, dp=dp, tp=tp, pp=pp,
                          num_micro_batches=rng.choice((8, 16, 32, 64)), micro_batch_size=1, rates=rates,
                          tp_alpha=alpha, memory=memory, excluded=excluded, objective=objective, comm=comm)


def describe(problem: PlannerProblem) -> str:
    """One line that rebuilds the case by eye: shape, stragglers, exclusions, memory, objective."""
    strag = {d: r for d, r in enumerate(problem.rates) if r != 1.0}
    return (f"{problem.num_nodes}x{problem.gpus_per_node} tp{problem.tp} dp{problem.dp} pp{problem.pp} "
            f"L={problem.num_layers} M={problem.num_micro_batches} rates={strag} excluded={sorted(problem.excluded)} "
            f"memory={problem.memory.gpu_memory_mb:.0f} objective={problem.objective} comm={problem.comm}")
