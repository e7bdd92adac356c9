"""The authors' planner as published, kept for comparison.

Faithful on purpose, including its faults: the sort key mixes global ids and rates (fault 1:
`id` for healthy devices, `8·x` for stragglers), each node's grouping is chosen by the tail-only
score R = Σ_tail 1/(α_r · max x · w_r) (fault 2), P is fixed to dp, straggler counts must be
non-increasing over all pipelines, ILP-2 keeps the nominal stage counts (m_i >= S_i even for
stages that got 0 blocks), and of the top-K templates plan #0 is used. Faults 3 and 4 (variable
order, short memory list) are not reproduced: they crash or scramble rather than plan.
"""
from __future__ import annotations

import time

from .budget import Deadline
from .grouping import Group, NodeOption, available_devices, is_straggler, make_group, slide_orders, tail_splits
from .organize import Scorer
from .problem import PlannerProblem
from .search import (FINALISTS, InfeasibleError, PlannerResult, _concretise, _finish, _organise, _PrevInfo,
                     _infeasibility_reason, evaluate, ideal_objective)


def authors_order(problem: PlannerProblem, devices: list[int]) -> list[int]:
    """Fault 1: healthy devices keyed by global id, stragglers by 8·x, in one sort."""
    return sorted(devices, key=lambda d: 8 * problem.rates[d] if is_straggler(problem, d) else d)


def authors_node_option(problem: PlannerProblem, node: int) -> NodeOption:
    """The winning (order, tail split) of one node under the tail-only score R."""
    avail = available_devices(problem, node)
    G, k = problem.gpus_per_node, problem.tp
    if len(avail) <= G - k:
        raise InfeasibleError(f"node {node} has {len(avail)} usable devices; the authors' planner needs more than "
                              f"{G - k} (gpus_per_node - tp)")
    order = authors_order(problem, avail)
    s = sum(is_straggler(problem, d) for d in avail)
    weights = problem.tp_weight or (1.0,) * (problem.max_split + 1)
    best: NodeOption | None = None
    for o in slide_orders(order, len(avail) - s, s):
        full = [make_group(problem, o[i:i + k]) for i in range(0, G - k, k)]
        for sizes in tail_splits(len(avail) - (G - k), k, prefixes=False, allow_split=problem.allow_split):
            pos, tail = G - k, []
            for sz in sizes:
                tail.append(make_group(problem, o[pos:pos + sz]))
                pos += sz
            r = sum(1.0 / (problem.alpha(g.size) * max(problem.rates[d] for d in g.devices)
                           * weights[problem.max_split - (g.size.bit_length() - 1)]) for g in tail)
            if best is None or r > best.tail_score:
                best = NodeOption(node, tuple(full + tail), tuple(sorted(o[pos:])), r)
    return best


def authors_plan(problem: PlannerProblem, top_k: int = 3) -> PlannerResult:
    """The authors' plan #0 for `problem` (P fixed to dp)."""
    t_start = time.perf_counter()
    groups: list[Group] = [g for n in range(problem.num_nodes) for g in authors_node_option(problem, n).groups]
    scorer = Scorer(problem, effective_stages=False)
    templates = [0]
    found = sorted(_organise(problem, scorer, groups, [problem.dp], templates, authors=True,
                             deadline=Deadline(problem.time_budget_s)))[:max(1, min(top_k, FINALISTS))]
    plans = [p for p in (_concretise(problem, scorer, f, _PrevInfo(None)) for f in found) if p is not None]
    if not plans:
        raise InfeasibleError(_infeasibility_reason(problem, groups))
    chosen = plans[0]
    ideal = ideal_objective(problem)
    elapsed = time.perf_counter() - t_start
    chosen = _finish(problem, chosen, ideal, elapsed, {"mode": "authors"})
    return PlannerResult(chosen, evaluate(problem, chosen), ideal, 1, elapsed, templates[0], scorer.ilp1_calls)
