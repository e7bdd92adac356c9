"""Pyomo models of ILP-1 and ILP-2 of the Malleus lower level, solved on HiGHS (`malleus_svc.highs`).

Used by `lower.solve_layers` / `lower.solve_micro_batches` with solver='highs' (HiGHS answers)
or 'both' (HiGHS cross-checks the closed form). Imported lazily: Pyomo takes ~0.3 s to import
and the planner's default closed-form path never needs it.

Both models are linear: the rates y_j (ILP-1) and the bottlenecks z_i (ILP-2) are data, so
`z >= y_j * l_j + extra_j` and `w >= z_i * m_i + offset_i` are ordinary rows; the bilinear m_i * z_i
of the joint program never appears (see the `lower` module docstring for why that is exact).

The functions return the integer solution as a list in stage / pipeline order, read by index
from the indexed variable (never by sorted variable name: the authors' PuLP code read
`model.variables()`, which sorts 'l_10' before 'l_2' and scrambled pipelines of >= 10 stages).
They return None when HiGHS proves the model infeasible, and raise `SolverError` when it stops
without a feasible solution for any other reason (time limit, numerical trouble, ...); a time
limit with an incumbent returns the incumbent, with a warning.
"""
from __future__ import annotations

import logging
from typing import Sequence

import pyomo.environ as pyo

from ..costmodel.profile import MemoryProfile
from ..highs import SolverError, solve

logger = logging.getLogger(__name__)


def solve_layers_model(rates: Sequence[float], mem_factors: Sequence[float], num_layers: int,
                       memory: MemoryProfile, extra: Sequence[float], time_limit_s: float,
                       mip_gap: float, min_layers: int = 0) -> list[int] | None:
    """ILP-1 for one pipeline with the memory rows of the Malleus memory model written out.

    min z  s.t.  sum_j l_j = L;  z >= y_j l_j + extra_j;  h_j (K[S-j] l_j + E_j) + X0 <= C - delta;
    l_j in {min_layers..L}.
    """
    s = len(rates)
    m = pyo.ConcreteModel(name="ilp1_layers")
    m.J = pyo.RangeSet(0, s - 1)
    m.l = pyo.Var(m.J, domain=pyo.NonNegativeIntegers, bounds=(min_layers, num_layers))
    m.z = pyo.Var(domain=pyo.Reals)
    m.obj = pyo.Objective(expr=m.z, sense=pyo.minimize)
    m.total = pyo.Constraint(expr=sum(m.l[j] for j in m.J) == num_layers)
    m.bottleneck = pyo.Constraint(m.J, rule=lambda m, j: m.z >= rates[j] * m.l[j] + extra[j])

    def memory_row(m, j):
        k = memory.block_mb(mem_factors[j], s - j)
        e = memory.ends_mb(mem_factors[j], j == 0, j == s - 1)
        return k * m.l[j] + e + memory.reserved_mb <= memory.gpu_memory_mb - memory.safety_margin_mb

    m.memory = pyo.Constraint(m.J, rule=memory_row)
    return _solve(m, m.l, s, time_limit_s, mip_gap, f"ILP-1 (layers, {s} stages, L={num_layers})")


def solve_micro_batches_model(z: Sequence[float], offsets: Sequence[float], lower: Sequence[int],
                              num_micro_batches: int, time_limit_s: float, mip_gap: float) -> list[int] | None:
    """ILP-2: min w  s.t.  sum_i m_i = M;  w >= z_i m_i + offset_i;  m_i in {lower_i..M}."""
    p = len(z)
    m = pyo.ConcreteModel(name="ilp2_micro_batches")
    m.I = pyo.RangeSet(0, p - 1)
    m.m = pyo.Var(m.I, domain=pyo.NonNegativeIntegers, bounds=lambda m, i: (lower[i], num_micro_batches))
    m.w = pyo.Var(domain=pyo.Reals)
    m.obj = pyo.Objective(expr=m.w, sense=pyo.minimize)
    m.total = pyo.Constraint(expr=sum(m.m[i] for i in m.I) == num_micro_batches)
    m.bottleneck = pyo.Constraint(m.I, rule=lambda m, i: m.w >= z[i] * m.m[i] + offsets[i])
    return _solve(m, m.m, p, time_limit_s, mip_gap, f"ILP-2 (micro-batches, {p} pipelines, M={num_micro_batches})")


def _solve(model, var, n: int, time_limit_s: float, mip_gap: float, what: str) -> list[int] | None:
    out = solve(model, time_limit_s, mip_gap, warm_start=False)
    if out.status == "infeasible":
        return None
    if out.status == "time_limit" and not out.loaded:
        raise SolverError(f"{what}: HiGHS stopped at the {time_limit_s} s time limit before finding any feasible "
                          f"solution; raise time_limit_s or use solver='closed_form'")
    if not out.loaded:
        raise SolverError(f"{what}: HiGHS failed (status {out.status!r}); no solution was loaded")
    if out.status == "time_limit":
        logger.warning("%s: HiGHS stopped at its %.3g s time limit; using its best feasible solution, which may "
                       "not be optimal", what, time_limit_s)
    values = [var[i].value for i in range(n)]          # by index: stage / pipeline order
    if any(v is None for v in values):
        raise SolverError(f"{what}: HiGHS reported {out.status} but returned no value for some variables")
    return [int(round(v)) for v in values]
