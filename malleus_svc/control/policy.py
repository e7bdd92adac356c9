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
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping


@dataclass(frozen=True)
class Trigger:
    reason: str      # "rates", "membership", "request", "length-drift"
    detail: str


class ReplanPolicy:
    def __init__(self, band: float = 0.3, threshold: float = 1.2, min_interval: int = 3, confirm: int = 2):
        if band <= 0:
            raise ValueError(f"band must be > 0, got {band}")
        if confirm < 1:
            raise ValueError(f"confirm must be >= 1 check, got {confirm}")
        self.band, self.threshold, self.min_interval, self.confirm = band, threshold, min_interval, confirm
        self._streak: dict[int, int] = {}

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
