"""The Malleus planner: `plan(problem, previous) -> PlannerResult` (see search.py) and helpers.

Modules: problem (inputs), grouping (per-node TP groups), organize (pipelines), lower (ILP-1/2),
search (the bi-level search and the public entry points), authors (the published planner).
"""
from .authors import authors_plan
from .problem import CommCosts, MemoryProfile, PlannerProblem
from .search import (InfeasibleError, PlannerResult, baseline_plan, evaluate, ideal_objective, memory_violations,
                     plan, plan_without_split, rebalance_data)

__all__ = ["CommCosts", "InfeasibleError", "MemoryProfile", "PlannerProblem", "PlannerResult", "authors_plan",
           "baseline_plan", "evaluate", "ideal_objective", "memory_violations", "plan", "plan_without_split",
           "rebalance_data"]
