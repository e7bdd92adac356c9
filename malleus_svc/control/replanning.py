"""Re-planning carried out: the rate trigger checked each iteration, requests queued and
coalesced into rounds (rounds.py), the policy's decision made on a planner thread while training
goes on, and the decided plan migrated live at the next iteration boundary (WorkerGroup.migrate
moves exactly the slices the plans differ in, bitwise)."""
from __future__ import annotations

import threading
import time

from malleus_svc.plan import Plan

from .policy import Observation
from .rounds import Round
from .state import RequestKind, RoundState


class Replanning:
    """Mixed into JobCoordinator: the planner thread runs `_plan_round`, the training thread the rest."""

    def _decide(self) -> None:
        with self._lock:
            if self.rounds.state is RoundState.IDLE and self.rounds.pending:   # requests held for min_interval
                if self.policy.due(self.step, self.policy.last_change_step):
                    self._start_round()
                return
            if not self.measurement.calibrated or self.rounds.state is not RoundState.IDLE:
                return
            trig = self.policy.trigger(self.basis, self.effective_rates(), self.plan, self.step,
                                       self.policy.last_change_step)
            if trig is not None:
                self._submit(RequestKind(trig.reason), trig.detail)

    def _submit(self, kind: RequestKind, detail: str, force: bool = False, hold: bool = False):
        """(lock held) Queue a request: start a round now, or merge into the pending one (`hold`: it
        waits for the iteration at which a re-plan is due). None when the policy takes no requests."""
        if not self.policy.replans:
            return None
        req = self.rounds.add(kind, detail, self.step, force)
        self._event("request", f"#{req.id} {kind.value}: {detail}" + (" (held until a re-plan is due)" if hold else ""))
        if self.rounds.state is RoundState.IDLE and self.plan is not None and not hold:
            self._start_round()
        return req

    def _start_round(self) -> None:
        gone = frozenset(self.gone())
        rnd = self.rounds.begin(self.step, self.effective_rates(), frozenset(self.excluded) | gone, gone)
        threading.Thread(target=self._plan_round, args=(rnd, self.plan), name=f"malleus-plan-{rnd.id}",
                         daemon=True).start()

    def _finish_round(self) -> None:
        """(lock held) The round in flight is over; start the pending one, if any."""
        if self.rounds.finish():
            self._start_round()

    def _plan_round(self, rnd: Round, current: Plan) -> None:
        """The planner thread: the policy decides while training goes on."""
        t0 = time.perf_counter()
        try:
            self.hooks.delays.before_plan()
            obs = self._observation(rnd, current)
            decision = self.policy.decide(obs, self.hooks.planner)
            for note in decision.notes:
                self._event("planner", note)
            with self._lock:
                rnd.decision = {**decision.to_dict(obs.remaining, obs.seconds_per_unit),
                                "planning_seconds": time.perf_counter() - t0}
                if decision.plan is None:
                    self.basis = dict(rnd.rates)     # hysteresis is now around what was decided on
                    self._round_ended(rnd, "kept")
                else:
                    self.rounds.decided(decision.plan)   # the training thread applies it at the boundary
                    self._event("planned", f"round {rnd.id}: {decision.option} -> {decision.plan.plan_id} "
                                           f"({time.perf_counter() - t0:.2f} s), applying at the next iteration boundary")
        except Exception as e:
            with self._lock:
                rnd.decision = {"option": "failed", "error": f"{type(e).__name__}: {e}",
                                "planning_seconds": time.perf_counter() - t0}
                if set(rnd.excluded) != set(self.plan.excluded):   # an infeasible exclusion is undone
                    self.excluded = set(self.plan.excluded) - set(rnd.gone)
                self._round_ended(rnd, "failed")

    def _observation(self, rnd: Round, current: Plan) -> Observation:
        problem = self._problem(rnd.rates, rnd.excluded)
        with self._lock:
            unit = self.measurement.seconds_per_unit()
            last_it = self.history.records[-1]["iteration_seconds"] if self.history.records else None
            remaining = max(self.steps_total - self.step - 1, 0)
        if unit is None:  # no measurement yet: the plan in force's last iteration, else the profile's t0
            obj = self.hooks.planner.evaluate(problem, current)
            unit = (last_it / obj) if (last_it and obj > 0) else problem.t0_seconds
        return Observation(current, problem, remaining, unit, problem.state_sizes,
                           membership=set(current.excluded) != set(rnd.excluded), forced=rnd.forced)

    def _apply_decided(self) -> None:
        """At an iteration boundary: migrate live to the decided plan (WorkerGroup.migrate moves
        exactly the slices the plans differ in, bitwise)."""
        with self._lock:
            rnd = self.rounds.take_decided()
            if rnd is not None and rnd.gone != frozenset(self.gone()):   # planned before devices left or came back
                self._round_ended(rnd, "superseded")
                self._submit(RequestKind.MEMBERSHIP, f"re-plan round {rnd.id} again: devices gone now "
                                                     f"{sorted(self.gone())}")
                return
        if rnd is None:
            return
        old, new, t0 = self.plan, rnd.new_plan, time.perf_counter()
        self.hooks.delays.before_migrate()
        rep = self.group.migrate(new, bucket_bytes=self.job.control.bucket_mb << 20)
        seconds = time.perf_counter() - t0
        report = {"mode": "live", "moved_bytes": float(rep.moved_bytes), "inter_node_bytes": float(rep.inter_node_bytes),
                  "moves": rep.moves, "worker_seconds": float(rep.seconds), "seconds": seconds}
        with self._lock:
            self._adopt(old, new, dict(rnd.rates))
            if self.metrics_export is not None:
                self.metrics_export.on_migration(seconds, report["moved_bytes"])
            self.policy.migration.observe(report["moved_bytes"], seconds)
            self._round_ended(rnd, "applied", report, old.plan_id)

    def _round_ended(self, rnd: Round, outcome: str, migration: dict | None = None, old_plan_id=None) -> None:
        """(lock held) A round's one history entry, counted once; then the next round, if any."""
        self.history.round_ended(self.step, rnd, outcome, migration, old_plan_id)
        if self.metrics_export is not None:
            self.metrics_export.on_round([r.kind.value for r in rnd.requests], outcome,
                                         (rnd.decision or {}).get("planning_seconds"))
        self._finish_round()

    def _adopt(self, old: Plan, new: Plan, basis: dict[int, float]) -> None:
        """(lock held) `new` runs now, made from rates `basis`: a new plan version, measurements
        restart after a warm-up, and devices that became active or idle lose their stale history."""
        self.plan, self.basis = new, basis
        self.history.plan_version += 1
        if self.metrics_export is not None:
            self.metrics_export.on_plan(new, self.history.plan_version)
        self.policy.last_change_step = self.step
        self.measurement.restart_after(self.step, set(old.roles()) ^ set(new.roles()))
        if set(old.roles()) != set(new.roles()):   # other devices talk now (a device lost, back, in or out)
            self.measurement.links_stale = True
