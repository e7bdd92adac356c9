"""The one way this package runs a Pyomo MILP on HiGHS: hard time limit, MIP start, no surprises.

Used by the planner's lower level (`planner.ilp`) and the length dispatch and packing MILPs. It
drives Pyomo's APPSI `Highs` class directly, not `SolverFactory('appsi_highs')`: that legacy
wrapper resets `config.time_limit` from its `timelimit` argument on each call (a 30 s limit was
seen ignored for 13 minutes when set on the config) and has no MIP-start argument; the APPSI class
takes both on its config (`time_limit` goes straight to HiGHS, `warmstart` hands the variables'
current values to HiGHS as an incumbent). Pyomo is imported inside the functions: it takes ~0.3 s
and the closed-form paths never need it.
"""
from __future__ import annotations

import logging
import math
import time
import dataclasses
from dataclasses import dataclass

logger = logging.getLogger(__name__)


class SolverError(RuntimeError):
    """HiGHS could not answer: error status, or a limit was hit before any feasible solution."""


@dataclass(frozen=True)
class MilpOutcome:
    status: str                 # "optimal" | "time_limit" | "infeasible" | "error"
    loaded: bool                # the model's variables hold HiGHS's best solution
    objective: float | None     # best feasible objective HiGHS reports
    bound: float | None         # best proven lower bound (minimisation)
    seconds: float              # wall time of the solve call


def available() -> bool:
    try:
        from pyomo.contrib.appsi.solvers import Highs
        return bool(Highs().available())
    except Exception:  # noqa: BLE001 - any import/load failure means "no HiGHS"
        return False


def solve(model, time_limit_s: float, mip_gap: float = 0.0, warm_start: bool = True) -> MilpOutcome:
    """Minimise `model` (one active objective); load the best solution found, if any. HiGHS's
    presolve errors out on some small MILPs that it solves without it (an ILP-2 of 7 pipelines
    did): an error is retried once without presolve, in the time left."""
    out = _solve(model, time_limit_s, mip_gap, warm_start, presolve=True)
    if out.status == "error" and out.seconds < time_limit_s:
        retry = _solve(model, time_limit_s - out.seconds, mip_gap, warm_start, presolve=False)
        return dataclasses.replace(retry, seconds=out.seconds + retry.seconds)
    return out


def _solve(model, time_limit_s: float, mip_gap: float, warm_start: bool, presolve: bool) -> MilpOutcome:
    from pyomo.contrib.appsi.base import TerminationCondition as TC
    from pyomo.contrib.appsi.solvers import Highs

    opt = Highs()
    opt.config.time_limit = float(time_limit_s)
    opt.config.mip_gap = float(mip_gap)
    opt.config.load_solution = False
    opt.config.warmstart = warm_start
    opt.config.log_level = logging.DEBUG      # HiGHS's log is noise at INFO
    # mip_abs_gap defaults to 1e-6 in HiGHS; an exact request should be exact in both senses.
    opt.highs_options = {"mip_abs_gap": 0.0} if mip_gap == 0 else {}
    if not presolve:
        opt.highs_options["presolve"] = "off"
    t0 = time.perf_counter()
    try:
        res = opt.solve(model)
    except Exception as exc:  # noqa: BLE001 - a solver failure is an outcome here, the caller falls back
        logger.warning("HiGHS failed on %s: %s", model.name, exc)
        return MilpOutcome("error", False, None, None, time.perf_counter() - t0)
    secs = time.perf_counter() - t0
    tc = res.termination_condition
    obj = res.best_feasible_objective
    bound = res.best_objective_bound
    has = obj is not None and math.isfinite(obj)
    if tc == TC.optimal:
        status = "optimal"
    elif tc in (TC.infeasible, TC.infeasibleOrUnbounded):
        status = "infeasible"
    elif tc in (TC.maxTimeLimit, TC.maxIterations, TC.interrupted, TC.objectiveLimit):
        status = "time_limit"
    else:
        status = "error"
    loaded = False
    if has and status in ("optimal", "time_limit"):
        res.solution_loader.load_vars()
        loaded = True
    bound = float(bound) if bound is not None and math.isfinite(bound) else None
    return MilpOutcome(status, loaded, float(obj) if has else None, bound, secs)
