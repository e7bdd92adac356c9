"""Multi-iteration runs under rates that change over time, with each system re-planning.

Why: a static scenario shows steady-state speed only; what separates an elastic restart from a
malleable re-plan is the cost of reacting (restart + lost work vs. migration), paid each time the
straggler situation changes. A trace is a list of phases, each a duration and the true rates.

Timeline of one change, for every system alike:
  1. detection: `Costs.detect_iterations` iterations of the plan in force under the NEW rates;
  2. planning: the system's measured solve time, during which the old plan keeps training
     (planning runs off the training path);
  3. switching: the stall the decision charges (migration, restart), then progress rolled back by
     `lost_seconds` worth of the old plan's throughput (restart from a checkpoint);
  4. the new plan trains until the phase ends.
A step that does not fit in its phase carries over (as a debt of time) into the next phase;
progress is counted in samples, fractional iterations included.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from ..config import Scenario
from ..plan import Plan
from .baselines import Costs, System
from .timeline import SimOptions, simulate
from ..planner.build import build_problem


@dataclass(frozen=True)
class Phase:
    seconds: float
    rates: Mapping[int, float]

    def __post_init__(self) -> None:
        if not self.seconds > 0:
            raise ValueError(f"a phase lasts > 0 seconds, got {self.seconds}")


@dataclass(frozen=True)
class Trace:
    name: str
    phases: tuple[Phase, ...]

    @property
    def seconds(self) -> float:
        return sum(p.seconds for p in self.phases)


@dataclass
class TraceResult:
    system: str
    seconds: float
    samples: float = 0.0
    switches: int = 0
    stall_seconds: float = 0.0
    planning_seconds: float = 0.0
    lost_samples: float = 0.0
    events: list[str] = field(default_factory=list)

    @property
    def throughput(self) -> float:
        """Samples per second over the whole trace."""
        return self.samples / self.seconds


class IterationClock:
    """Simulated iteration seconds of (plan, rates), memoised: traces revisit the same pairs."""

    def __init__(self, scenario: Scenario, options: SimOptions = SimOptions()):
        self.scenario, self.options = scenario, options
        self._memo: dict[tuple, float] = {}

    def seconds(self, plan: Plan, rates: Mapping[int, float]) -> float:
        key = (plan.plan_id, tuple(sorted(rates.items())))
        if key not in self._memo:
            problem = build_problem(self.scenario, rates=rates)
            self._memo[key] = simulate(plan, problem, options=self.options).iteration_seconds
        return self._memo[key]


def run_trace(scenario: Scenario, trace: Trace, system: System, costs: Costs = Costs(),
              clock: IterationClock | None = None) -> TraceResult:
    clock = clock or IterationClock(scenario)
    gb = scenario.global_batch
    res = TraceResult(system.name, trace.seconds)
    first = trace.phases[0]
    current = system.decide(build_problem(scenario, rates=first.rates), None).plan
    debt = 0.0     # seconds of a switch that spilled over from the previous phase (no progress)
    for k, phase in enumerate(trace.phases):
        left = phase.seconds
        used = min(left, debt)
        left, debt = left - used, debt - used
        t_new = clock.seconds(current, phase.rates)
        if k > 0:
            prev_t = clock.seconds(current, trace.phases[k - 1].rates)
            # 1 + 2: detection and planning, training on the old plan meanwhile.
            decision = system.decide(build_problem(scenario, rates=phase.rates), current)
            res.planning_seconds += decision.planning_seconds
            react = costs.detect_iterations * t_new + decision.planning_seconds
            run = min(left, react)
            res.samples += run / t_new * gb
            left -= run
            if run == react and decision.plan.plan_id != current.plan_id:
                # 3: the switch.
                res.switches += 1
                stall = decision.stall_seconds
                res.stall_seconds += stall
                lost = min(res.samples, decision.lost_seconds / prev_t * gb)
                res.samples -= lost
                res.lost_samples += lost
                res.events.append(f"phase {k}: {decision.note or 'switch'} (stall {stall:.1f} s, "
                                  f"planning {decision.planning_seconds:.2f} s, lost {lost:.0f} samples)")
                used = min(left, stall)
                left -= used
                debt += stall - used
                current = decision.plan
                t_new = clock.seconds(current, phase.rates)
        # 4: train until the phase ends.
        res.samples += left / t_new * gb
    return res


def trace_from_dict(d: Mapping, num_devices: int) -> Trace:
    """{'name': ..., 'phases': [{'seconds': 600, 'rates': {5: 3.0}}, ...]} -> Trace."""
    from ..config import validate_rates

    phases = d.get("phases") if isinstance(d, Mapping) else None
    if not isinstance(phases, Sequence) or not phases:
        raise ValueError("a trace needs a non-empty list 'phases' of {seconds, rates}")
    out = []
    for i, p in enumerate(phases):
        if not isinstance(p, Mapping) or "seconds" not in p:
            raise ValueError(f"trace phase {i}: expected a mapping with 'seconds' (and optional 'rates')")
        out.append(Phase(float(p["seconds"]), validate_rates(p.get("rates") or {}, num_devices,
                                                             field_name=f"phases[{i}].rates")))
    return Trace(str(d.get("name", "trace")), tuple(out))
