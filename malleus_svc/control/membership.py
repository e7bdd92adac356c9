"""Lost, gone and returning devices, carried out as the FailurePolicy (failure.py) says: a failed
step is recovered (replacements, then the state from replicas or the checkpoint), devices gone
for good are planned around, and returning ones are taken back."""
from __future__ import annotations

import time

from malleus_svc.plan import Plan
from malleus_svc.runtime.cluster import WorkerGroupError

from .failure import Restore
from .state import RequestKind
from .status import describe_plan
from .workers import probe_baselines


class Membership:
    """Mixed into JobCoordinator (the training thread calls these at iteration boundaries)."""


    def _recover(self, error: Exception, sampler_before: dict) -> None:
        """A step failed: replace lost devices, keep the survivors, restore the state from the
        survivors' replicas (the step is redone on the same global batch), else from the newest
        checkpoint."""
        t0 = time.perf_counter()
        self._event("failure", f"step {self.step} failed: {str(error).splitlines()[0]}")
        old = self.plan
        rep = self.group.recover(plan_for=self._plan_after_loss)
        if self.failure.planned_around(rep, old.plan_id):
            self._membership_changed(old, f"devices {rep.gone} gone (no worker could start in their bundles)")
        ckpt = None if rep.source == "replicas" else self.checkpoints.latest(lambda text: self._event("error", text))
        if self.failure.restore_from(rep, ckpt is not None, self.group.last_recovery_error) is Restore.CHECKPOINT:
            from malleus_svc.checkpoint import restore_group
            step = restore_group(self.group, ckpt, self.sampler)
            with self._lock:
                self.history.rewind(step)
                self.step = step
            how = f"from checkpoint {ckpt.path.name} (step {step})"
        else:
            self.sampler.load_state_dict(sampler_before)
            how = "from the survivors' replicas"
        with self._lock:
            self.measurement.restart_after(self.step, rep.lost)
            self.history.failures.append({"step": self.step, "lost": rep.lost, "gone": rep.gone, "source": rep.source,
                                          "plan_id": rep.plan_id, "seconds": time.perf_counter() - t0})
            replaced = [d for d in rep.lost if d not in rep.gone]
            self._event("recovered", f"replaced devices {replaced}, gone {rep.gone}; state restored {how} in "
                                     f"{time.perf_counter() - t0:.1f} s; step redone")

    def _plan_without(self, gone: frozenset) -> Plan:
        """The plan over the devices that are still there (the group asks when some are gone or back)."""
        return self.hooks.planner.replan(self._problem(self.effective_rates(), self.excluded | set(gone)), self.plan)

    def _plan_after_loss(self, gone: frozenset) -> Plan:
        """`_plan_without` when devices are lost for good: the running plan cannot stay, so a planner
        that fails unexpectedly gives way to the fallback planner rather than failing the job. When
        nothing fits on the devices left (InfeasibleError), the job cannot go on, and says why."""
        from malleus_svc.planner import InfeasibleError

        try:
            return self._plan_without(gone)
        except InfeasibleError:
            raise
        except Exception as e:  # noqa: BLE001 - whatever the planner raised, the job goes on if it can
            if self.hooks.planner.fallback is None:
                raise
            problem = self._problem(self.effective_rates(), self.excluded | set(gone))
            plan = self.hooks.planner.fallback(problem, self.plan)
            self._event("error", f"planning without devices {sorted(gone)} failed ({_one_line(e)}); the fallback "
                                 f"planner's plan {plan.plan_id} runs (the running plan's groups without them)")
            return plan

    def _membership_changed(self, old: Plan, detail: str) -> None:
        """The group runs another plan because devices left or came back (the state moved with the
        new world, not in a round's migration). Book it like a re-plan."""
        new = self.group.plan
        with self._lock:
            self._adopt(old, new, self.effective_rates())
            if self.metrics_export is not None:
                self.metrics_export.on_round([RequestKind.MEMBERSHIP.value], "applied", None)
            self.history.plan_change(self.step, None, "membership", f"membership: {detail}", old.plan_id, new,
                                     self.basis, gone=sorted(self.group.gone))
            self._event("membership", f"{detail}: {old.plan_id} -> {new.plan_id} ({describe_plan(new)})")

    def _maybe_rejoin(self) -> None:
        """At an iteration boundary, while devices are gone: take back those whose node returned."""
        if not self.failure.rejoin_due(self.group.gone) or not (ready := self.group.rejoinable()):
            return
        old, t0 = self.plan, time.perf_counter()

        def plan_or_keep(gone: frozenset) -> Plan:
            # More devices never make the running plan invalid (it leaves them out), so a planner
            # that fails here costs the extra devices until a later round, never the job.
            try:
                return self._plan_without(gone)
            except Exception as e:  # noqa: BLE001 - whatever the planner raised, the job goes on
                self._event("error", f"planning with devices {sorted(ready)} back failed ({_one_line(e)}); "
                                     f"plan {old.plan_id} kept, they stay out of it until a later round")
                return old
        back = self.group.rejoin(ready, plan_or_keep)
        if not back:
            return
        try:
            baselines = probe_baselines(self.group, back, rounds=5)   # fresh processes: their own probe baselines
        except WorkerGroupError as e:   # measured by their work alone until then; a lost one fails the next step
            baselines = {}
            self._event("error", f"probe baselines of rejoined devices {back}: {str(e).splitlines()[0]}")
        with self._lock:
            self.hooks.emulation.forget(back)          # emulation (tests) re-applies to the fresh workers
            self.measurement.set_probe_baselines(baselines)
        detail = f"devices {back} rejoined in {time.perf_counter() - t0:.1f} s"
        if self.group.plan.plan_id == old.plan_id:    # the planner failed: same plan, no plan change
            self._event("membership", f"{detail}; plan {old.plan_id} kept")
        else:
            self._membership_changed(old, detail)


def _one_line(e: Exception) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 200 else text[:197] + "..."
