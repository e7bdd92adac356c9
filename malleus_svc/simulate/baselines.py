"""The systems compared under the simulator, each as "which plan runs, and what switching costs".

  static     Megatron-LM / DeepSpeed: the healthy dp×tp×pp layout, never changed. A straggler
             slows its stage, hence its pipeline, hence everyone at the gradient reduction.
  data-only  the static layout with micro-batches re-balanced over pipelines (ILP-2 alone); moves
             no model state, so switching is free.
  restart    TorchElastic / Oobleck treating stragglers as failures: nodes holding a device at or
             above τ are dropped and the job restarts from a checkpoint on the healthy nodes with
             the best homogeneous layout that fits (same TP, as many pipelines as fit, the
             baseline's stage count or fewer stages if memory allows). Every change of the set of
             dropped nodes costs `restart_seconds` (default 300 s) of stall plus the work since the
             last checkpoint (half an interval, default 30 min → 15 min lost). An operator
             restarts only when the new layout is faster than the plan in force under the
             current rates (otherwise it keeps running, as static does).
  authors    the authors' planner as published (`authors_plan`, their 'paper' objective: no
             bubbles, no communication), migrating state like ours.
  malleus    ours: `plan(problem, previous=plan in force)` with the 'full' objective (bubbles, p2p,
             gradient reduction), charged the migration time of `Plan.diff`.

Migration time: `Plan.diff(old, new, state_sizes)` slices; per device, bytes sent and received
over intra-node and inter-node links, each at its own bandwidth, the two link kinds overlapping:
time = max over devices and directions of max(intra / intra_bw, inter / inter_bw). Planning
time is NOT a stall: the planner runs off the training path (NOTES.md), so `trace.py` lets the
old plan keep training for the measured solve time before the switch.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from ..plan import Plan
from ..planner.problem import PlannerProblem
from ..planner import authors_plan, baseline_plan, plan, rebalance_data
from ..planner.search import homogeneous_plan
from .timeline import MAX_SIMULATED_OPS, SimOptions, simulate

SYSTEMS = ("static", "data-only", "restart", "authors", "malleus")


@dataclass(frozen=True)
class Costs:
    """What switching plans costs; bandwidths default to the analytic DeviceSpec's."""

    intra_node_gbps: float = 200.0
    inter_node_gbps: float = 25.0
    restart_seconds: float = 300.0
    checkpoint_interval_seconds: float = 1800.0   # restart loses half of it on average
    detect_iterations: int = 3                    # measurement window before any system reacts

    @property
    def lost_seconds(self) -> float:
        return self.checkpoint_interval_seconds / 2


@dataclass(frozen=True)
class Decision:
    """A system's answer to a new straggler situation."""

    plan: Plan
    planning_seconds: float = 0.0   # solve time; training continues on the old plan meanwhile
    stall_seconds: float = 0.0      # training stopped: migration or restart
    lost_seconds: float = 0.0       # progress rolled back (restart from a checkpoint)
    note: str = ""


def migration_seconds(old: Plan, new: Plan, problem: PlannerProblem, costs: Costs = Costs()) -> float:
    """Stall to move model + optimizer state from `old` to `new` (see module docstring)."""
    if old.plan_id == new.plan_id:
        return 0.0
    diff = Plan.diff(old, new, problem.state_sizes)
    g = new.gpus_per_node
    load: dict[tuple[int, str, bool], float] = {}
    for m in diff.moves:
        inter = m.src // g != m.dst // g
        for dev, way in ((m.src, "send"), (m.dst, "recv")):
            load[(dev, way, inter)] = load.get((dev, way, inter), 0.0) + m.bytes
    worst = 0.0
    for (dev, way, inter), b in load.items():
        worst = max(worst, b / ((costs.inter_node_gbps if inter else costs.intra_node_gbps) * 1e9))
    return worst


# ----------------------------------------------------------------------------- plans of each system
def static_plan(problem: PlannerProblem) -> Plan:
    return baseline_plan(problem)


def data_only_plan(problem: PlannerProblem) -> Plan:
    return rebalance_data(problem, baseline_plan(problem))


def straggler_nodes(problem: PlannerProblem) -> frozenset[int]:
    """Nodes with a device at or above τ, or an excluded device: what an elastic restart drops."""
    bad = {problem.node_of(d) for d, x in enumerate(problem.rates) if x >= problem.straggler_threshold}
    bad |= {problem.node_of(d) for d in problem.excluded}
    return frozenset(bad)


def restart_plan(problem: PlannerProblem, options: SimOptions = SimOptions()) -> Plan:
    """The best homogeneous layout on the nodes without stragglers (see module docstring). When no
    pipeline fits on them, the job cannot restart without its stragglers and keeps the static plan."""
    from ..planner import memory_violations   # a pure check on a given plan

    drop = straggler_nodes(problem)
    if not drop:
        return static_plan(problem)
    g, tp = problem.gpus_per_node, problem.tp
    healthy = [d for n in range(problem.num_nodes) if n not in drop for d in range(n * g, (n + 1) * g)]
    best, best_t = None, float("inf")
    for pp in range(min(problem.pp, problem.num_layers), 0, -1):
        P = min(len(healthy) // (tp * pp), problem.num_micro_batches)
        if P == 0:
            continue
        cand = homogeneous_plan(problem, healthy, P, tp, pp)
        if memory_violations(problem, cand):
            continue
        t = simulate(cand, problem, options=options).iteration_t0
        if t < best_t:
            best, best_t = cand, t
    return best if best is not None else static_plan(problem)


EXACT_JUDGE_MAX_DEVICES = 256

# ----------------------------------------------------------------------------- systems
@dataclass
class System:
    """A system reacting to straggler situations. `decide(problem, current)` returns the plan to
    run under `problem`'s rates, given the plan in force, with its switching costs."""

    name: str
    decide: Callable[[PlannerProblem, Plan | None], Decision]


def make_systems(costs: Costs = Costs(), options: SimOptions = SimOptions(),
                 names: tuple[str, ...] = SYSTEMS) -> list[System]:

    def static(problem, current):
        return Decision(current or static_plan(problem))

    def data_only(problem, current):
        return Decision(data_only_plan(full(problem)))

    def restart(problem, current):
        new = restart_plan(problem, options)
        if current is None or new.plan_id == current.plan_id:
            return Decision(new if current is None else current)
        if _dropped(current, problem) == _dropped(new, problem):
            return Decision(current)
        if simulate(new, problem, options=options).iteration_t0 >= simulate(current, problem, options=options).iteration_t0:
            return Decision(current, note="a restart would not be faster: keep running")
        return Decision(new, stall_seconds=costs.restart_seconds, lost_seconds=costs.lost_seconds,
                        note=f"restart without nodes {sorted(straggler_nodes(problem))}")

    def authors(problem, current):
        r = authors_plan(replace(problem, objective="paper"))
        return _migrate(r.plan, r.solve_seconds, current, problem, costs)

    def malleus(problem, current):
        # The planner searches on its analytic objective and picks among its finalists with this
        # simulator, which sees the overlaps (drain vs gradient reduction) the objective cannot.
        # An event simulation of a 1024-device plan (or of a huge batch) takes seconds, so beyond
        # paper scale the analytic objective alone decides.
        p = full(problem)
        judge = None
        deepest = min(p.num_layers, p.num_devices)     # any plan's ops are at most 2 x M x its deepest pipeline
        if p.num_devices <= EXACT_JUDGE_MAX_DEVICES and 2 * p.num_micro_batches * deepest <= MAX_SIMULATED_OPS:
            judge = lambda c: simulate(c, p, options=options).iteration_t0  # noqa: E731
        r = plan(p, previous=current, score=judge)
        return _migrate(r.plan, r.solve_seconds, current, problem, costs)

    table = {"static": static, "data-only": data_only, "restart": restart, "authors": authors, "malleus": malleus}
    unknown = [n for n in names if n not in table]
    if unknown:
        raise ValueError(f"unknown systems {unknown}; known: {', '.join(SYSTEMS)}")
    return [System(n, table[n]) for n in names]


def full(problem: PlannerProblem) -> PlannerProblem:
    """The problem as our planner sees it in the comparisons: the 'full' objective."""
    return problem if problem.objective == "full" else replace(problem, objective="full")


def _dropped(plan: Plan, problem: PlannerProblem) -> frozenset[int]:
    active = {problem.node_of(d) for d in plan.active_devices}
    return frozenset(n for n in range(problem.num_nodes) if n not in active)


def _migrate(new: Plan, solve_s: float, current: Plan | None, problem: PlannerProblem, costs: Costs) -> Decision:
    if current is None:
        return Decision(new, planning_seconds=solve_s)
    if new.plan_id == current.plan_id:
        return Decision(current, planning_seconds=solve_s)
    return Decision(new, planning_seconds=solve_s, stall_seconds=migration_seconds(current, new, problem, costs),
                    note="migrate")
