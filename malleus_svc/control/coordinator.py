"""The coordinator: head of one job, running measure → decide → plan → migrate → train.

One Ray actor per job, named ``malleus:<job name>`` in namespace ``malleus`` so that other
processes (the client API, `malleus status`) find it. It owns the worker group, the sampler, the
plan in force and the job's record; it carries out what its policies decide:
  * Measurement (measure.py): rates from the workers' own timings, never from emulation factors;
  * ReplanPolicy (policy.py): when to re-plan, and keep / rebalance / replan with their predicted
    time to finish including the migration; StaticPolicy never re-plans;
  * FailurePolicy (failure.py): where the state comes from after a lost device, when to look for
    devices that left;
  * Rounds (rounds.py): the round state machine and request coalescing.
The job's lifecycle is a JobState, the round's a RoundState (state.py). The mechanism is split by
concern: the client calls (api.py), re-planning rounds (replanning.py), lost and returning devices
(membership.py); this module holds the lifecycle and the training loop.

Threads (a threaded actor, ``max_concurrency`` > 1): the training thread (`start`) alone touches
the worker group, so steps and migrations never overlap; one planner thread at a time (a round)
decides while training goes on under the old plan; Ray's actor threads serve client calls. Shared
state is guarded by one lock, held only for bookkeeping, never across a step, a planner run or a
migration.
"""
from __future__ import annotations

import dataclasses
import hmac
import secrets
import threading
import time
import traceback
from typing import Any, Mapping

from malleus_svc.config.job import JobConfig
from malleus_svc.config.locations import is_remote
from malleus_svc.costmodel.profile import CommCosts
from malleus_svc.plan import Plan
from malleus_svc.planner.build import build_problem
from malleus_svc.runtime.cluster import WorkerGroupError
from malleus_svc.runtime.storage import storage_env

from . import requests as check
from .api import ClientAPI
from .checkpoints import RECORDS_KEPT, JobCheckpoints, first_plan
from .evaluation import Evaluation
from .failure import FailurePolicy
from .history import History
from .hooks import Delays, Emulation, Hooks
from .length_view import LengthView
from .membership import Membership
from .replanning import Replanning
from .measure import Measurement
from .policy import Planner, ReplanPolicy, StaticPolicy
from .requests import MalleusError
from .rounds import Rounds
from .state import JobState, RequestKind, RoundState
from .metrics import serve_job_metrics
from .status import describe_plan
from .training_thread import TrainingThread
from .workers import probe_baselines, ray_workers

__all__ = ["JobCoordinator", "MalleusError", "NAMESPACE", "actor_name", "describe_plan", "launch"]

NAMESPACE = "malleus"
ACTOR_PREFIX = "malleus:"   # a job's coordinator is the named actor ACTOR_PREFIX + its name
MAX_RESTARTS = 3     # coordinator restarts (from the last checkpoint) before the job fails


def actor_name(job_name: str) -> str:
    return ACTOR_PREFIX + job_name


class JobCoordinator(ClientAPI, Membership, Replanning):
    """Plain class; `launch` makes it the job's Ray actor. See the module docstring.

    `control` overrides knobs of the job file's `control` section (e.g. band=100.0)."""

    def __init__(self, job: JobConfig, *, plan: Plan | None = None, steps: int | None = None, static: bool = False,
                 driver_job_id: str | None = None, submission_id: str | None = None,
                 cpus_per_worker: float | None = None, emulation: Emulation | None = None,
                 delays: Delays | None = None, workers=None, planner: Planner | None = None,
                 owner: str | None = None, **control):
        if control:
            job = dataclasses.replace(job, control=job.control.with_overrides(control))
        self.job = job
        self._owner = owner          # the launching driver's key for start/shutdown (None: not checked)
        knobs = job.control
        self.policy = (StaticPolicy if static else ReplanPolicy).from_config(knobs)
        self.failure = FailurePolicy(knobs.rejoin_check_s)
        self.measurement = Measurement(knobs.window, knobs.skip, knobs.calibrate, knobs.skip_after_migration)
        self.hooks = Hooks(workers or (lambda j: ray_workers(j, knobs, cpus_per_worker)), planner or Planner.default(),
                           emulation or Emulation(job.emulate), delays or Delays())
        self.rounds = Rounds()
        self.calls = check.CallBudget(job.name)     # client calls that change the job: rate-limited
        self.history = History(job.name)
        self.lengths = LengthView(job, knobs.length_window)
        self.checkpoints = JobCheckpoints(job.checkpoint, job.shape)
        self.evaluation = Evaluation(job.eval, job.train.seed, job.dataset_spec())
        self.steps_total = int(steps if steps is not None else job.train.steps)
        self.origin = {"ray_job_id": driver_job_id, "submission_id": submission_id, "restarted": _was_restarted(),
                       "resumed_from": None}   # the checkpoint this run started from, once resumed
        self.state, self.error = JobState.CREATED, None
        self.group = self.sampler = self.metrics_export = None
        self._initial_plan, self.plan = plan, None
        self.basis: dict[int, float] = {}          # rates the plan in force was made from
        self.excluded: set[int] = set(job.scenario.excluded)   # wanted (the plan follows at the boundary)
        self.step = 0
        self._lock = threading.RLock()
        self.training = TrainingThread()
        if self.origin["restarted"]:   # Ray restarted this coordinator: resume from the last checkpoint
            threading.Thread(target=self._resume_after_restart, name="malleus-resume", daemon=True).start()

    def _resume_after_restart(self) -> None:
        try:
            self._start(self.steps_total)
        except Exception as e:
            with self._lock:
                self.state, self.error = JobState.FAILED, f"restart failed: {type(e).__name__}: {e}"
            self.training.done.set()

    # ================================================================== lifecycle
    def setup(self) -> dict:
        """Start workers, load data, apply the first plan, take probe baselines. Idempotent, also
        when called concurrently (a coordinator that Ray restarted resumes by itself, and its driver
        may call `start` meanwhile)."""
        with self.training.setup_lock:
            with self._lock:
                if self.group is not None:
                    return self.status()
                self.state = JobState.STARTING
            from malleus_svc.runtime.trainer import optim_config
            job = self.job
            ckpt = self.checkpoints.latest(lambda text: self._event("error", text))
            plan = first_plan(job, ckpt, self._initial_plan, self.origin["restarted"])
            group = self.hooks.workers(job)
            group.start()
            if job.scenario.shard_optimizer is None:     # the file leaves it to the workers: sharded on GPUs
                job = self.job = dataclasses.replace(job, scenario=job.scenario.sharding_on(group.use_gpu))
                if job.scenario.shard_optimizer:
                    self._event("start", "optimizer state sharded among each piece's holders (ZeRO-1; the default "
                                         "on GPU workers): re-plans price it")
            try:
                if group.gone & set(plan.roles()):   # started without nodes that could not be placed (yet)
                    self._event("membership", f"starting without devices {sorted(group.gone)}: their nodes could not "
                                              "be placed; they join when Ray can place them")
                    plan = self._plan_after_loss(frozenset(group.gone))
                n = group.set_data(job.dataset_spec(), job.data.mode, job.data.seq_len)
                sampler = self.evaluation.sampler(n, plan.global_batch)
                pretrained = job.scenario.pretrained if ckpt is None else None   # a Hugging Face LLaMA folder
                if pretrained:
                    from malleus_svc.runtime.pretrained import check_pretrained
                    check_pretrained(pretrained, job.shape)           # before any worker builds anything
                loading = ckpt is not None or bool(pretrained)      # then no initialisation
                group.apply_plan(plan, job.shape, seed=job.train.seed, optim=optim_config(job), init=not loading)
                start_step = 0
                if pretrained:
                    group.load_pretrained(pretrained)
                    self._event("start", f"weights from {pretrained}")
                if ckpt is not None:  # parameters, Adam state and the data position, under this plan
                    from malleus_svc.checkpoint import restore_group
                    start_step = restore_group(group, ckpt, sampler)
                emulated = job.emulated_device   # timed on the weights the job trains, never on uninitialised memory
                pace = group.pace(plan.micro_batch_size * job.data.seq_len, emulated.flops_per_second,
                                  emulated.bytes_per_second, emulated.block_seconds)
                probe_baselines(group, group.live, rounds=1)   # warm-up round, discarded
                baselines = probe_baselines(group, group.live, rounds=5)
                links = group.time_links(job.shape, plan.micro_batch_size * job.data.seq_len)
            except BaseException:
                group.shutdown()
                raise
            with self._lock:
                self.group, self.sampler, self.plan = group, sampler, plan
                self.step = start_step
                self.measurement.begin_at(start_step)
                if ckpt is not None:
                    self._resume_from(ckpt, start_step)
                self.basis = {dv: float(r) for dv, r in job.scenario.rates.items()}
                self.measurement.set_probe_baselines(baselines)
                self.measurement.links = links
                self.state = JobState.READY
                if pace is not None:
                    self.measurement.device_pace = pace
                    self._pace_event(pace, "")
                self._event("links", links.describe())
                self.metrics_export = serve_job_metrics(self.job, plan, self.history.plan_version)
                if self.metrics_export is not None:
                    self._event("metrics", f"Prometheus metrics at http://{self.metrics_export.endpoint}/metrics")
                if job.data.assignment == "length-aware":
                    self._event("lengths", self.lengths.start_length_aware(group, paced=pace is not None))
                self.history.plan_change(0, 0, "initial", "initial plan", None, plan, self.basis)
                self._event("start", f"plan {plan.plan_id}: {len(plan.pipelines)} pipelines, suspended "
                                     f"{list(plan.suspended)}, excluded {list(plan.excluded)}")
            return self.status()

    def _resume_from(self, ckpt, start_step: int) -> None:
        """(lock held) What a checkpoint carries besides the model: metrics lines, and an operator's
        health signals and exclusions (they outlive a restart, like the model does)."""
        extra = ckpt.manifest.extra
        self.history.resume(extra.get("records", []), extra.get("totals"), start_step)
        try:   # the client calls' own checks: a checkpoint's extras are input like any other
            rates = extra.get("external_rates") or {}
            clean = check.check_rates(rates, self.job.num_devices, self.job.name) if rates else {}
            devs = extra.get("excluded") or []
            excluded = check.check_devices(devs, "excluded", self.job.num_devices, self.job.name) if devs else []
            check.check_exclude(excluded, set(), set(), self.job.num_devices, self.job.name)
        except MalleusError as e:
            self._event("error", f"the checkpoint's external rates and exclusions are not applied: {e}")
        else:
            self.measurement.set_external(clean)
            self.excluded |= set(excluded)
        self.origin["resumed_from"] = {"path": str(ckpt.path), "step": start_step,
                                       "skipped": [f"{p.name}: {why}" for p, why in ckpt.skipped]}
        self._event("resumed", f"from {ckpt.path.name} at step {start_step}"
                    + (f" (skipped damaged: {self.origin['resumed_from']['skipped']})" if ckpt.skipped else ""))

    def start(self, steps: int | None = None, owner: str | None = None) -> dict:
        """Set up if needed and train `steps` iterations (default: the job's) on a thread of its own.
        Only the launching driver (`owner`: the key `launch` returned) starts its job."""
        self._check_owner(owner, "start")
        return self._start(steps)

    def _check_owner(self, owner: Any, what: str) -> None:
        if self._owner is not None and not (isinstance(owner, str) and hmac.compare_digest(owner, self._owner)):
            raise MalleusError(f"only the driver that launched job {self.job.name!r} may {what} its coordinator; "
                               f"to end the job, use `malleus stop {self.job.name}` (or the client's stop())")

    def _start(self, steps: int | None) -> dict:
        if steps is not None:
            steps = check.check_steps(steps)
        self.setup()
        with self._lock:
            if self.training.started:
                if self.origin["restarted"]:   # resuming by itself already: the driver's start joins it
                    return self.status()
                raise MalleusError(f"job {self.job.name!r} is already {self.state.value}")
            self.steps_total = steps or self.steps_total
            self.state = JobState.TRAINING
            self.training.start(self._train_loop)
        return self.status()

    def wait(self, timeout: float | None = None) -> dict:
        """Block until training ends (or `timeout`); the summary."""
        self.training.done.wait(timeout)
        return self.summary()

    def stop(self) -> dict:
        """Stop training at the next iteration boundary (never inside a step or a migration); the
        driver then ends its Ray job normally, with the steps done so far."""
        with self._lock:
            if self.state.ended:
                raise MalleusError(f"job {self.job.name!r} is already {self.state.value}")
            self.training.stop_requested.set()
            self._event("stop", f"stop requested at step {self.step}")
            return {"state": self.state.value, "step": self.step}

    def shutdown(self, owner: str | None = None) -> None:
        """Stop training and release the workers and the metrics endpoint (the launching driver's call)."""
        self._check_owner(owner, "shut down")
        self.training.stop_requested.set()
        if self.training.started:
            self.training.done.wait(120)
        if self.group is not None:
            self.group.shutdown()
        if self.metrics_export is not None:
            self.metrics_export.close()
        self.lengths.close()
        if self.state is not JobState.FAILED:
            self.state = JobState.STOPPED

    # ================================================================== the training loop
    def _train_loop(self) -> None:
        try:
            while not self.training.stop_requested.is_set() and self.step < self.steps_total:
                self._iteration()
            err = self.checkpoints.finish(self.group, self.sampler, self.step, self._checkpoint_extra())
            if err:
                self._event("error", err)
            with self._lock:
                self.state = JobState.STOPPED if self.step < self.steps_total else JobState.DONE
                if self.state is JobState.STOPPED:
                    self._event("stopped", f"stopped on request after {self.step} of {self.steps_total} steps")
        except Exception as e:  # the job failed: say where, keep the coordinator answering
            with self._lock:
                self.state, self.error = JobState.FAILED, f"{type(e).__name__}: {e}"
                self._event("error", self.error + "\n" + traceback.format_exc(limit=5))

    def _iteration(self) -> None:
        self._maybe_rejoin()
        self._apply_decided()
        if self.measurement.links_stale:
            self._retime_links()
        self._pace_warmup()
        step, plan, group = self.step, self.plan, self.group
        with self._lock:
            slowdowns = self.hooks.emulation.changes(step, self.job.num_devices)
        if slowdowns:
            group.set_slowdowns(slowdowns)
        before = self.sampler.state_dict()
        ids = self.sampler.next_global_batch(plan.global_batch)
        probes = group.probe([d for d in plan.suspended if d not in plan.excluded])
        self.history.started()
        last = self.history.records[-1]["iteration_seconds"] if self.history.records else None
        assignment = self.lengths.assignment(group, self.sampler, plan, ids, self.effective_rates(), last)
        try:
            rec = group.step(ids, assignment, lr=self.job.train.lr_at(step))
        except WorkerGroupError as e:
            self._recover(e, before)     # the batch is given back to the sampler and the step redone
            return
        rec.step = step
        try:
            probe_res = probes()
        except WorkerGroupError as e:    # the idle devices go unmeasured this once; a lost one fails the next step
            probe_res = []
            self._event("error", f"probes after step {step}: {str(e).splitlines()[0]}")
        batch_lengths = LengthView.of_batch(group, ids)
        if self.measurement.measures(step):
            self._measure(plan, rec, probe_res, batch_lengths)
        line = rec.metrics()
        line.update(epoch=self.sampler.epoch, sampler_position=self.sampler.position, time=time.time())
        if self.evaluation.due(step):
            try:
                line["eval_loss"] = self.evaluation.run(group, step)
            except WorkerGroupError as e:     # the next step fails too, and recovers
                self._event("error", f"evaluation after step {step} failed: {str(e).splitlines()[0]}")
        with self._lock:
            self._record_step(line, rec, plan, batch_lengths)
        if self.checkpoints.due(self.step):
            err = self.checkpoints.save(self.group, self.sampler, self.step, self._checkpoint_extra())
            if err:
                self._event("error", err)
        self._decide()
        self._grace_wait(rec.iteration_seconds)

    def _pace_warmup(self) -> None:
        """At a warm-up boundary: the CPU workers keep their ops' costs, or their pace is refitted
        on them (WorkerGroup.refit_pace) and the probes' baselines taken again on it."""
        action = self.measurement.pace_refit(self.step)
        try:
            if action == "keep":
                self.group.keep_op_costs()
            elif action == "refit":
                old, pace = self.measurement.device_pace, self.group.refit_pace()
                if pace != old:
                    with self._lock:     # the workers run on it now, whatever follows
                        self.measurement.device_pace = pace
                        self._pace_event(pace, "refitted on the warm-up's ops: ")
                    baselines = probe_baselines(self.group, self.group.live, rounds=5)
                    with self._lock:
                        self.measurement.set_probe_baselines(baselines)
        except WorkerGroupError as e:   # the step fails on it too, and recovers; the pace stays
            self._event("error", f"pace {action} failed: {str(e).splitlines()[0]}")

    def _pace_event(self, pace, how: str) -> None:
        self._event("pace", f"{how}CPU workers emulate accelerators of {pace.flops_per_second / 1e9:.3g} GFLOP/s "
                            f"and {pace.bytes_per_second / 1e9:.3g} GB/s, {pace.block_seconds * 1e3:.3g} ms per "
                            "block an op runs through")

    def _retime_links(self) -> None:
        """At an iteration boundary: the links among the devices the plan in force uses, timed again
        (after a node left or came back, or devices were planned out or in), so that the next
        round prices the links there are."""
        links = self.group.time_links(self.job.shape, self.plan.micro_batch_size * self.job.data.seq_len)
        with self._lock:
            self.measurement.links, self.measurement.links_stale = links, False
        self._event("links", f"timed again under plan {self.plan.plan_id}: {links.describe()}")

    def _record_step(self, line: dict, rec, plan: Plan, batch_lengths) -> None:
        """(lock held) The step's metrics line, exported; calibration once the warm-up is measured."""
        rates, stats = self.effective_rates(), self.lengths.last_stats or {}
        line["rates"] = {str(d): round(r, 3) for d, r in sorted(rates.items())}
        peak = self.job.num_devices * self.measurement.peak_flops_per_second(self.job.scenario.device)
        secs = line["iteration_seconds"]
        line["mfu"] = line["model_flops"] / (secs * peak) if secs > 0 else None   # over every device the job holds
        line["length_stats"] = {k: v for k, v in stats.items() if k != "histogram"}
        self.history.add_record(line, rec.tokens)
        if self.metrics_export is not None:
            self.metrics_export.on_iteration(
                line, rec.devices, rates, self.job.num_devices, plan.excluded,
                self.measurement.healthy_tokens_per_second,
                batch_lengths, {q: stats[k] for q, k in ((0.5, "p50"), (0.9, "p90"), (0.99, "p99"), (1.0, "max"))
                                if k in stats},
                self.measurement.pace.shares(), self.measurement.pace.unmeasured())
        self.step = rec.step + 1
        m = self.measurement
        if m.calibrate_if_due(self.step, self.history.records):
            opt = self._optimizer_per_block()
            update = f", optimizer step {opt:.3g} t0 per block" if opt is not None else ""
            self._event("calibrated", f"healthy unit {m.estimator.healthy_unit_seconds:.3g} s/t0, "
                                      f"{m.healthy_tokens_per_second or 0:,.0f} tok/s{update}")
            links = m.links
            if (links is not None or opt is not None) and self._problem({}, self.plan.excluded).objective == "full":
                # the plan in force was made before the links and the updates were priced (`_problem`)
                priced = [f"communication priced from the links measured: {links.describe()}"] if links else []
                priced += ["the optimizer step from the updates timed"] if opt is not None else []
                self._submit(RequestKind.LINKS, "; ".join(priced))

    def _measure(self, plan: Plan, rec, probe_res: list[dict], batch_lengths) -> None:
        with self._lock:
            self.measurement.observe_step(plan, self.job, rec.devices, probe_res)
            if batch_lengths is not None:
                self.lengths.observe_stats(batch_lengths)
                self._observe_lengths(batch_lengths)
            if self.measurement.calibrated:   # seconds per planner objective unit, under the rates now
                try:
                    objective = self.hooks.planner.evaluate(self._problem(self.effective_rates(), plan.excluded), plan)
                    self.measurement.observe_unit(rec.iteration_seconds, objective)
                except Exception:  # a plan the current problem cannot evaluate: skip the sample
                    pass

    def _observe_lengths(self, lengths) -> None:
        """(lock held) The drift detector's one call: a drift asks for a re-plan."""
        reason = self.lengths.observe_drift(lengths, self.step)
        if reason:
            self._submit(RequestKind.LENGTHS, f"length distribution drifted: {reason}")

    def _checkpoint_extra(self) -> dict:
        with self._lock:   # the last metrics lines travel along: a driver that had not read them yet still can
            return {"plan_version": self.history.plan_version, "records": list(self.history.records[-RECORDS_KEPT:]),
                    "totals": dict(self.history.totals),
                    "excluded": sorted(self.excluded),
                    "external_rates": {str(d): r for d, r in sorted(self.measurement.external.items())}}

    def _grace_wait(self, iteration_seconds: float) -> None:
        """A plan being made when an iteration ends may take effect at this boundary if it is ready
        within `grace` x an iteration; otherwise the new one takes effect at a later boundary."""
        deadline = time.perf_counter() + self.job.control.grace * iteration_seconds
        while time.perf_counter() < deadline and self.rounds.state is RoundState.PLANNING:
            time.sleep(0.005)

    def gone(self) -> set[int]:
        return set(self.group.gone) if self.group is not None else set()

    def effective_rates(self) -> dict[int, float]:
        """Measured rates with external ones (set_rates) taking precedence, device by device; a device
        not measured (its ops did not keep pace) keeps the rate the plan in force was made from."""
        with self._lock:
            return self.measurement.effective(self.basis)

    def _problem(self, rates: Mapping[int, float], excluded) -> Any:
        """The planner's input under these rates. Communication is priced from the job's own links
        in units of its measured t0, and the optimizer step from its own updates; until both are
        known (the first plan, made before the workers run, and the iterations before calibration),
        not at all."""
        rates = self.policy.snap({d: r for d, r in rates.items() if d not in excluded})
        sc = self.job.scenario
        with self._lock:
            profile = self.lengths.profile()
            t0, links = self.measurement.t0_seconds(sc.tp), self.measurement.links
            optimizer = self._optimizer_per_block()
        comm = links.comm_costs(t0) if links is not None and t0 else CommCosts()
        return build_problem(sc, rates=rates, excluded=frozenset(excluded), lengths=profile, comm=comm,
                             optimizer_per_block=optimizer or 0.0)

    def _optimizer_per_block(self) -> float | None:
        """(lock held) The optimizer step the workers timed, in t0 units per block (for a model given
        only by its layer count, the scenario's `profile.optimizer_seconds` in the measured t0); None
        until calibrated."""
        sc, m = self.job.scenario, self.measurement
        if sc.shape is not None:
            return m.optimizer_per_block(sc.shape.block_params())
        t0, given = m.t0_seconds(sc.tp), sc.profile.optimizer_seconds
        return given / t0 if m.calibrated and t0 and given is not None else None

    def _event(self, kind: str, text: str) -> None:
        self.history.event(self.step, kind, text)


def _was_restarted() -> bool:
    """True in a coordinator actor that Ray restarted after it died."""
    import warnings
    try:
        import ray
        with warnings.catch_warnings():   # Ray's own property trips its own actor_id deprecation warning
            warnings.simplefilter("ignore", DeprecationWarning)
            return bool(ray.is_initialized() and ray.get_runtime_context().was_current_actor_reconstructed)
    except Exception:  # not in an actor
        return False


def launch(job: JobConfig, *, name: str | None = None, detached: bool = False, jitter: float = 0.0,
           jitter_seed: int = 0, plan_delay_s: float = 0.0, migrate_delay_s: float = 0.0,
           **kwargs) -> tuple[Any, str]:
    """Create the job's coordinator actor (named, namespace "malleus"); its handle and the owner
    key that its `start` and `shutdown` take. jitter, jitter_seed (emulation) and the delays (tests)
    become the coordinator's hooks; the other keyword arguments are JobCoordinator's. Raises
    MalleusError if a job of that name already runs."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    name = name or actor_name(job.name)
    try:
        ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        pass
    else:
        raise MalleusError(f"a job named {job.name!r} is already running (actor {name!r} in namespace "
                           f"{NAMESPACE!r}); pick another job name or stop it first")
    kwargs.setdefault("driver_job_id", ray.get_runtime_context().get_job_id())
    kwargs.setdefault("emulation", Emulation(job.emulate, jitter, jitter_seed))
    kwargs.setdefault("delays", Delays(plan_delay_s, migrate_delay_s))
    # Beside the driver (on a Ray Jobs cluster: the head), where Prometheus reads the file-SD target.
    here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=True)
    opts = {"name": name, "namespace": NAMESPACE, "scheduling_strategy": here}
    if detached:
        opts["lifetime"] = "detached"
    if job.checkpoint.enabled and is_remote(job.checkpoint.dir):
        # The store's endpoint and credentials, as this driver has them, for the coordinator and
        # its workers (children inherit an actor's runtime env; Ray merges it with the job's).
        opts["runtime_env"] = {"env_vars": storage_env()}
    # With checkpoints, a coordinator that dies is restarted by Ray and resumes from the newest one
    # (its workers die with it: they are its children); without, there is nothing to resume from.
    restarts = MAX_RESTARTS if job.checkpoint.enabled else 0
    actor = ray.remote(num_cpus=0, max_concurrency=16, max_restarts=restarts)(JobCoordinator)
    owner = secrets.token_hex(16)     # a restarted actor gets the same arguments, so the same key
    return actor.options(**opts).remote(job, owner=owner, **kwargs), owner
