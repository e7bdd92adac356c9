"""When to re-plan, and whether a new plan is worth its migration (the Malleus paper's trigger).

Trigger (the authors' rule, kept): compared with the rates the plan in force was made from,
  * an active device's rate moved by at least `band` (Δ = 0.3), or
  * a suspended device's rate moved by at least `band`, unless it is >= τ both before and after
    (a still-slow suspended device never causes churn; one that healed below τ comes back),
  * or the set of devices changed, or a user asked.
Beyond the authors: a shift smaller than twice the band must persist for `confirm` consecutive
checks (large ones act at once), a re-plan needs `min_interval` iterations since the last one,
and a candidate plan is adopted only if its predicted gain over the remaining iterations exceeds
its predicted migration time, with data-only re-balancing (no state moves) preferred when it wins.

Decision (`ReplanPolicy.decide`): the options keep / rebalance (data only) / replan (the planner
with previous = the plan in force), each with its predicted time to finish = remaining iterations
x evaluate() x measured seconds per objective unit + predicted migration seconds (MigrationCost:
a fixed cost + moved bytes x seconds per byte, conservative defaults until migrations were seen).
A forced round (a user's force, or a membership change) takes the best option that moves.
`StaticPolicy` never re-plans. The policies decide; the coordinator carries out.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from malleus_svc.config.job import ControlConfig
from malleus_svc.plan import Plan


@dataclass(frozen=True)
class Trigger:
    reason: str      # a RequestKind value (the rate trigger: "rates")
    detail: str


class MigrationCost:
    """Predicted seconds of a migration: a fixed cost + bytes x seconds per byte, both refitted
    from the migrations measured so far (the defaults until then are conservative)."""

    def __init__(self, overhead_s: float = ControlConfig.migration_overhead_s,
                 seconds_per_byte: float = ControlConfig.seconds_per_byte):
        self.default_overhead_s, self.default_seconds_per_byte = overhead_s, seconds_per_byte
        self.seen: list[tuple[float, float]] = []   # (bytes, seconds)

    def observe(self, nbytes: float, seconds: float) -> None:
        self.seen.append((float(nbytes), float(seconds)))

    def predict(self, nbytes: float) -> float:
        zero = [s for b, s in self.seen if b <= 0]
        fixed = statistics.median(zero) if zero else 0.0
        per_byte = [(s - fixed) / b for b, s in self.seen if b > 0]
        overhead = fixed if zero else (statistics.median(s for _, s in self.seen) * 0.5 if self.seen
                                       else self.default_overhead_s)
        spb = max(statistics.median(per_byte), 0.0) if per_byte else self.default_seconds_per_byte
        return overhead + nbytes * spb


@dataclass(frozen=True)
class Planner:
    """The planner calls a decision needs (malleus_svc.planner by default)."""
    evaluate: Callable[[Any, Plan], float]     # (problem, plan) -> objective units per iteration
    rebalance: Callable[[Any, Plan], Plan]     # data only: same stages, new micro-batch split
    replan: Callable[[Any, Plan], Plan]        # (problem, previous) -> the planner's plan
    # when `replan` fails unexpectedly and the running plan cannot stay (devices lost): a simpler
    # planner (the running plan's TP groups kept, minus the lost devices)
    fallback: Callable[[Any, Plan | None], Plan] | None = None

    @classmethod
    def default(cls) -> "Planner":
        from malleus_svc.planner import evaluate, plan, plan_without_split, rebalance_data
        return cls(evaluate, rebalance_data, lambda problem, previous: plan(problem, previous=previous).plan,
                   lambda problem, previous: plan_without_split(problem, previous).plan)


@dataclass(frozen=True)
class Observation:
    """What a round decides on."""
    current: Plan
    problem: Any                          # the planner's problem under the round's rates and exclusions
    remaining: int                        # iterations left after this one
    seconds_per_unit: float               # measured seconds per planner objective unit
    state_sizes: Any                      # for Plan.moved_bytes: bytes each move carries
    membership: bool = False              # the set of devices changed: the current plan cannot stay
    forced: bool = False                  # a user asked to adopt the planner's plan


@dataclass
class Decision:
    option: str                           # "keep", "rebalance" or "replan"
    plan: Plan | None                     # the plan to migrate to (None: keep)
    options: dict[str, dict] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)   # what could not be considered, and why

    def to_dict(self, remaining: int, seconds_per_unit: float) -> dict:
        keep_s = self.options.get("keep", {}).get("time_to_finish")
        mine = self.options.get(self.option, {}).get("time_to_finish")
        return {"option": self.option, "options": self.options, "remaining_iterations": remaining,
                "seconds_per_unit": seconds_per_unit,
                "predicted_gain_seconds": keep_s - mine if keep_s is not None and mine is not None else None}


class ReplanPolicy:
    replans = True

    def __init__(self, band: float = ControlConfig.band, threshold: float = ControlConfig.threshold,
                 min_interval: int = ControlConfig.min_interval, confirm: int = ControlConfig.confirm,
                 migration: MigrationCost | None = None):
        if band <= 0:
            raise ValueError(f"band must be > 0, got {band}")
        if confirm < 1:
            raise ValueError(f"confirm must be >= 1 check, got {confirm}")
        self.band, self.threshold, self.min_interval, self.confirm = band, threshold, min_interval, confirm
        self.migration = migration or MigrationCost()
        self.last_change_step: int | None = None   # when the plan in force took effect (for min_interval)
        self._streak: dict[int, int] = {}

    @classmethod
    def from_config(cls, control) -> "ReplanPolicy":
        """From the job file's `control` section (config/job.py ControlConfig)."""
        return cls(control.band, control.threshold, control.min_interval, control.confirm,
                   MigrationCost(control.migration_overhead_s, control.seconds_per_byte))

    def snap(self, rates: Mapping[int, float]) -> dict[int, float]:
        """The planner's view of rates: below the threshold a device counts as healthy."""
        return {d: (r if r >= self.threshold else 1.0) for d, r in rates.items()}

    def rate_trigger(self, planned: Mapping[int, float], current: Mapping[int, float],
                     active: set[int], suspended: set[int]) -> Trigger | None:
        """The paper's trigger rule over devices with a current estimate; None means keep the plan.

        Confidence grows with the size of a shift: one of at least twice the band (a 3x straggler,
        a heal) acts at once; a smaller one must show on `confirm` consecutive checks, so a noisy
        reading just past the band does not buy a migration. Call once per decision.
        """
        moved, streak = [], {}
        snap = lambda x: 1.0 if x < self.threshold else x  # the planner treats rates below τ as healthy
        for d, now in sorted(current.items()):
            before, now = snap(planned.get(d, 1.0)), snap(now)
            if abs(now - before) < self.band or not (d in active or d in suspended):
                continue
            if d in suspended and before >= self.threshold and now >= self.threshold:
                continue
            streak[d] = self._streak.get(d, 0) + 1
            if abs(now - before) >= 2 * self.band or streak[d] >= self.confirm:
                moved.append(f"device {d}: {before:.2f} -> {now:.2f}")
        self._streak = streak
        if moved:
            return Trigger("rates", "; ".join(moved))
        return None

    def due(self, step: int, last_replan_step: int | None) -> bool:
        return last_replan_step is None or step - last_replan_step >= self.min_interval

    def trigger(self, basis: Mapping[int, float], rates: Mapping[int, float], plan: Plan, step: int,
                last_replan_step: int | None) -> Trigger | None:
        """The rate trigger, if a re-plan is also due (once per iteration)."""
        trig = self.rate_trigger(basis, rates, set(plan.active_devices), set(plan.suspended))
        return trig if trig is not None and self.due(step, last_replan_step) else None

    def decide(self, obs: Observation, planner: Planner) -> Decision:
        """keep / rebalance / replan: the least predicted time to finish (or, forced, the best that moves)."""
        notes: list[str] = []
        candidates: dict[str, Plan] = {}
        if not obs.membership:
            candidates["keep"] = obs.current
            try:
                candidates["rebalance"] = planner.rebalance(obs.problem, obs.current)
            except Exception as e:
                notes.append(f"rebalance not possible: {e}")
        candidates["replan"] = planner.replan(obs.problem, obs.current)
        options, info = [], {}
        for name, p in candidates.items():
            if name != "keep" and p.plan_id == obs.current.plan_id:
                continue
            it = planner.evaluate(obs.problem, p) * obs.seconds_per_unit
            nbytes = 0.0 if name == "keep" else Plan.moved_bytes(obs.current, p, obs.state_sizes)
            mig = 0.0 if name == "keep" else self.migration.predict(nbytes)
            options.append(Option(name, it, mig))
            info[name] = {"plan_id": p.plan_id, "iteration_seconds": it, "migration_seconds": mig,
                          "migration_bytes": nbytes, "time_to_finish": obs.remaining * it + mig}
        if obs.membership or obs.forced:
            movers = [o for o in options if o.name != "keep"]
            pick = min(movers, key=lambda o: info[o.name]["time_to_finish"]).name if movers else "keep"
        else:
            pick = choose(options, obs.remaining).name
        return Decision(pick, None if pick == "keep" else candidates[pick], info, notes)


class StaticPolicy(ReplanPolicy):
    """A fixed plan (--static): no trigger ever fires and no request is taken."""
    replans = False

    def trigger(self, basis, rates, plan, step, last_replan_step) -> Trigger | None:
        return None

    def decide(self, obs: Observation, planner: Planner) -> Decision:
        return Decision("keep", None)


@dataclass(frozen=True)
class Option:
    name: str                  # "keep", "rebalance" (data only) or "replan"
    iteration_seconds: float   # predicted, under the current rates
    migration_seconds: float   # predicted one-off cost of switching to it


def choose(options: list[Option], remaining_iterations: int) -> Option:
    """The option with the least predicted time to finish: remaining × iteration + migration.

    `keep` must be among the options; ties keep the cheaper-to-apply option (listed first).
    """
    if not any(o.name == "keep" for o in options):
        raise ValueError("choose() needs the 'keep' option to compare against")
    n = max(remaining_iterations, 0)
    return min(options, key=lambda o: n * o.iteration_seconds + o.migration_seconds)
