"""The coordinator: head of one job, running measure → decide → plan → migrate → train.

One Ray actor per job, named ``malleus:<job name>`` in namespace ``malleus`` so that other
processes (the client API, `malleus status`) find it. It owns the WorkerGroup, the sampler, the
plan in force and the plan history.

Threads (a threaded actor, ``max_concurrency`` > 1):
  * the training thread (`start`) runs the iterations; it alone touches the WorkerGroup, so
    steps and migrations never overlap;
  * one planner thread at a time (a *round*) computes keep / rebalance / replan and their
    predicted cost while training goes on under the old plan;
  * Ray's actor threads serve client calls (status, rates, replan, set_rates, exclude, ...).
  Shared state is guarded by one lock, held only for bookkeeping, never across a step, a
  planner run or a migration.

Decisions (the Malleus paper's re-planning workflow, made measurable):
  * measure: per device per iteration busy = compute_seconds + injected_seconds (its own compute:
    thread CPU time on CPU, CUDA-synchronised time on GPU, plus a stall inside it) over its work in
    t0 units (workload.py); suspended devices run a fixed probe each iteration against a probe
    baseline taken at start-up; the healthy unit time is calibrated after `warmup` iterations.
    Emulation factors are never read: rates come from timings only;
  * decide: policy.rate_trigger against the rates the plan in force was made from (its *basis*),
    membership changes and user requests; a rate trigger needs `min_interval` iterations since
    the last migration (no thrashing);
  * plan: options keep / rebalance (data only) / replan (planner with previous = plan in force);
    predicted time to finish = remaining iterations × evaluate() × measured seconds per t0 unit,
    plus predicted migration seconds (fixed cost + Plan.diff bytes × measured seconds per byte,
    conservative defaults until a migration was seen); choose() takes the least;
  * migrate: at the next iteration boundary, WorkerGroup.migrate: always live, only the slices the
    two plans place differently move, bitwise, and no worker restarts.

Coalescing: at most one round is in flight (planning, or decided and waiting for / in migration)
and at most one request is pending; a request arriving meanwhile merges its reasons into the
pending one, which starts one new round with fresh inputs once the current one is finished.
Every request id appears in exactly one history entry.
"""
from __future__ import annotations

import itertools
import logging
import math
import os
import random
import statistics
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from malleus_svc.config.job import JobConfig
from malleus_svc.costmodel.scenario import scenario_costs
from malleus_svc.plan import Plan
from malleus_svc.planner.build import build_problem, length_profile

from malleus_svc.runtime.cluster import WorkerGroupError

from .measure import RateEstimator, WorkSample
from .policy import Option, ReplanPolicy, choose
from .workload import busy_seconds, device_work

log = logging.getLogger(__name__)

NAMESPACE = "malleus"
DEFAULT_SECONDS_PER_BYTE = 2e-8      # 50 MB/s: conservative until a migration was measured
DEFAULT_MIGRATION_OVERHEAD_S = 2.0   # rebuilding engines and groups, conservative
MAX_RESTARTS = 3                     # coordinator restarts (from the last checkpoint) before the job fails
RECORDS_KEPT = 256                   # metrics lines saved with each checkpoint


def actor_name(job_name: str) -> str:
    return f"malleus:{job_name}"


class MalleusError(ValueError):
    """A client call the coordinator refuses; the message says why. Nothing changed."""


@dataclass
class Request:
    id: int
    kind: str        # "rates", "membership", "request", "external-rates"
    detail: str
    step: int
    time: float
    force: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "kind": self.kind, "detail": self.detail, "step": self.step, "time": self.time,
                "force": self.force}


@dataclass
class Round:
    id: int
    requests: list[Request]
    started: float
    step: int
    rates: dict[int, float] = field(default_factory=dict)
    excluded: frozenset = frozenset()     # wanted exclusions and gone devices, as the round plans them
    gone: frozenset = frozenset()
    decision: dict | None = None
    new_plan: Plan | None = None


class JobCoordinator:
    """Plain class; `COORDINATOR` below is the Ray actor. See the module docstring."""

    def __init__(self, job: JobConfig, *, plan: Plan | None = None, steps: int | None = None,
                 static: bool = False, window: int = 5, warmup: int = 3, skip: int = 3, min_interval: int = 3,
                 band: float = 0.3, threshold: float = 1.2, jitter: float = 0.0, jitter_seed: int = 0,
                 emulate_schedule: Iterable | None = None, bucket_bytes: int = 64 << 20,
                 driver_job_id: str | None = None, submission_id: str | None = None, length_window: int = 50,
                 plan_delay_s: float = 0.0, grace: float = 0.1, migrate_delay_s: float = 0.0,
                 collective_timeout_s: float = 120.0, replace_timeout_s: float = 60.0,
                 rejoin_check_s: float = 5.0, cpus_per_worker: float | None = None):
        self.job = job
        self.static = bool(static)
        self.steps_total = int(steps if steps is not None else job.train.steps)
        self.warmup = max(1, int(warmup))
        self.skip = max(0, int(skip))           # first iterations not measured (allocator, caches warm up)
        self.skip_after_migration = 2            # new engines warm up too: their first iterations are not measured
        self._measure_from = self.skip
        self._start_step = 0
        self.plan_delay_s = float(plan_delay_s)  # tests only: a slow planner, to exercise coalescing
        self.grace = float(grace)                # boundary waits up to grace x iteration for a plan in progress
        self.migrate_delay_s = float(migrate_delay_s)  # tests only: a slow migration, to exercise coalescing
        self._migrating = False
        self.jitter = float(jitter)
        self._rng = random.Random(jitter_seed)
        self.bucket_bytes = int(bucket_bytes)
        self.collective_timeout_s = float(collective_timeout_s)   # a collective slower than this is a failure
        self.replace_timeout_s = float(replace_timeout_s)   # a lost device with no new worker by then is gone
        self.cpus_per_worker = cpus_per_worker   # CPU workers: None = WorkerGroup's rule (fit the cluster)
        self.rejoin_check_s = float(rejoin_check_s)   # while devices are gone, how often to look for them
        self._next_rejoin_check = 0.0
        self.failures: list[dict] = []
        self.driver_job_id = driver_job_id
        self.submission_id = submission_id      # the Ray Jobs submission id, when submitted as a Ray job
        self.metrics_export = None              # JobMetrics once set up (metrics.py)
        self.plan_version = 0
        self._writer = None                     # CheckpointWriter when job.checkpoint.dir is set
        self._length_cost = None                # lengths.LengthCost when data.assignment is length-aware
        self._lookahead = None
        self.resumed_from: dict | None = None   # the checkpoint this run started from
        self.restarted = _was_restarted()
        from malleus_svc.runtime.straggler import EmulationSchedule
        self.schedule = EmulationSchedule(job.emulate if emulate_schedule is None else tuple(emulate_schedule))
        self.policy = ReplanPolicy(band=band, threshold=threshold, min_interval=min_interval)
        # common-mode correction: a machine-wide slowdown of one iteration is not a straggler (measure.py)
        self.estimator = RateEstimator(window=window, common_mode_quantile=0.25)
        self._initial_plan = plan
        self._lock = threading.RLock()
        self._setup_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._round_ids = itertools.count(1)
        self.state = "created"
        self.error: str | None = None
        self.group = None
        self.sampler = None
        self.plan: Plan | None = None
        self.basis: dict[int, float] = {}          # rates the plan in force was made from
        self.excluded: set[int] = set(job.scenario.excluded)   # wanted (plan follows at the boundary)
        self.external: dict[int, float] = {}       # set_rates overrides (precedence over measured)
        self.history: list[dict] = []
        self.events: deque = deque(maxlen=200)
        self.records: list[dict] = []              # metrics lines
        self.step = 0
        self.last_migration_step: int | None = None
        self.calibrated = False
        self.healthy_tokens_per_second: float | None = None
        self._pending: list[Request] = []
        self._round: Round | None = None
        self._ready: Round | None = None
        self._unit_seconds: deque = deque(maxlen=5)   # measured seconds per planner objective unit
        self._migrations: list[tuple[float, float]] = []   # (bytes, seconds)
        self._manual_slowdown: dict[int, float] = {}
        self._factors: dict[int, float] = {}
        self._lengths: deque = deque(maxlen=length_window)
        self._last_length_stats: dict | None = None
        # the sampled lengths' distribution: a shift of its high quantiles is a reason to re-plan
        self.length_drift = _drift_detector()
        self.last_drift: dict | None = None
        self._drift_lengths = None                 # the batch that showed a drift (until the new window fills)
        self._profile, self._profile_key = None, None
        self._probe_baseline: dict[int, float] = {}
        self._thread: threading.Thread | None = None
        self._done = threading.Event()
        self._t_start: float | None = None
        self._tokens_total = 0
        self._stop = False
        if self.restarted:   # Ray restarted this coordinator: resume training from the last checkpoint
            threading.Thread(target=self._resume_after_restart, name="malleus-resume", daemon=True).start()

    def _resume_after_restart(self) -> None:
        try:
            self.start(self.steps_total)
        except Exception as e:
            with self._lock:
                self.state, self.error = "failed", f"restart failed: {type(e).__name__}: {e}"
            self._done.set()

    # ================================================================== lifecycle
    def setup(self) -> dict:
        """Start workers, load data, apply the first plan, take probe baselines. Idempotent, also
        when called concurrently (a coordinator that Ray restarted resumes by itself, and its driver
        may call `start` meanwhile)."""
        with self._setup_lock:
            with self._lock:
                if self.group is not None:
                    return self.status()
                self.state = "starting"
            from malleus_svc.runtime.cluster import WorkerGroup
            from malleus_svc.runtime.data import GlobalSampler
            from malleus_svc.runtime.trainer import check_plan_for_job, make_plan, optim_config

            job = self.job
            ckpt = self._latest_checkpoint()
            plan = None
            if ckpt is not None and (self.restarted or self._initial_plan is None):
                try:  # resume under the plan in force when it was written, if it fits (any plan would do)
                    plan = check_plan_for_job(ckpt.manifest.plan_obj(), job, f"{ckpt.path.name} plan")
                except Exception as e:
                    log.warning("checkpoint plan does not fit the job (%s); planning afresh", e)
            if plan is None:
                plan = check_plan_for_job(self._initial_plan, job) if self._initial_plan else make_plan(job)
            group = WorkerGroup(job.num_devices, job.scenario.gpus_per_node, name=f"malleus-{job.name}",
                                timeout_s=self.collective_timeout_s, replace_timeout_s=self.replace_timeout_s,
                                cpus_per_worker=self.cpus_per_worker)
            group.start()
            try:
                if group.gone & set(plan.roles()):   # started without nodes that could not be placed (yet)
                    self._event("membership", f"starting without devices {sorted(group.gone)}: their nodes could not "
                                              "be placed; they join when Ray can place them")
                    plan = self._plan_without(frozenset(group.gone))
                d = job.data
                n = group.set_data(d.spec(), d.mode, d.seq_len)
                sampler = GlobalSampler(n, plan.global_batch, seed=job.train.seed)
                group.apply_plan(plan, job.shape, seed=job.train.seed, optim=optim_config(job))
                start_step = 0
                if ckpt is not None:  # parameters, Adam state and the data position, under this plan
                    from malleus_svc.checkpoint import restore_group
                    start_step = restore_group(group, ckpt, sampler)
                self._probe_all(group, group.live, rounds=1)   # warm-up round, discarded
                baselines = self._probe_all(group, group.live, rounds=5)
            except BaseException:
                group.shutdown()
                raise
            with self._lock:
                self.group, self.sampler, self.plan = group, sampler, plan
                self._begin_at(start_step)
                if ckpt is not None:
                    extra = ckpt.manifest.extra
                    self.records = [r for r in extra.get("records", []) if r["step"] < start_step]
                    # an operator's health signals and exclusions outlive a restart, like the model does
                    self.external.update({int(d): float(r) for d, r in extra.get("external_rates", {}).items()})
                    self.excluded |= {int(d) for d in extra.get("excluded", [])}
                    self.resumed_from = {"path": str(ckpt.path), "step": start_step,
                                         "skipped": [f"{p.name}: {why}" for p, why in ckpt.skipped]}
                    self._event("resumed", f"from {ckpt.path.name} at step {start_step}"
                                + (f" (skipped damaged: {self.resumed_from['skipped']})" if ckpt.skipped else ""))
                self.basis = {dv: float(r) for dv, r in job.scenario.rates.items()}
                self._probe_baseline = baselines
                for dv, s in baselines.items():
                    self.estimator.set_probe_baseline(dv, s)
                self.state = "ready"
                self._start_metrics(plan)
                if job.data.assignment == "length-aware":
                    self._start_length_aware()
                self._record_plan_change(0, "initial", "initial plan", None, plan, step=0)
                self._event("start", f"plan {plan.plan_id}: {len(plan.pipelines)} pipelines, suspended "
                                     f"{list(plan.suspended)}, excluded {list(plan.excluded)}")
            return self.status()

    def _start_length_aware(self) -> None:
        """(lock held) Fit the per-layer time of a micro-batch from its sequence lengths on this
        machine (lengths.sweep through the runtime's own blocks, on real TP groups for TP > 1), for
        `assign`. Every TP degree up to the job's: a re-plan may split TP groups into smaller ones."""
        from malleus_svc.runtime.length_sweep import run_sweeps
        from malleus_svc.geometry import tp_divisibility_error

        from .assign import Lookahead
        shape = self.job.shape
        tps = [t for t in (1, 2, 4, 8) if t <= self.job.scenario.tp and tp_divisibility_error(shape, t) is None]
        self._length_cost, reports = run_sweeps(shape, tps=tps, layers=min(2, shape.layers),
                                                repeats=21 if len(tps) > 1 else 9)
        self._lookahead = Lookahead()
        self._event("lengths", "length cost fitted, held-out error " + ", ".join(
            f"TP{t} {r.get('test_max_abs_error', float('nan')):.1%}" for t, r in sorted(reports.items())))

    def _assignment(self, ids: list[int], plan: Plan):
        from .assign import assign, planning_time_limit
        lengths = self.group.dataset.lengths
        with self._lock:
            last = self.records[-1]["iteration_seconds"] if self.records else None
        limit = planning_time_limit(last)   # planned while a step trains: well under an iteration
        # a sample of l tokens trains l - 1 (inputs and shifted targets): the budget counts those
        return assign(ids, [int(lengths[i]) - 1 for i in ids], plan, self._length_cost, self.effective_rates(),
                      plan.micro_batch_size * self.job.data.seq_len, time_limit_s=limit)

    def _begin_at(self, step: int) -> None:
        """(lock held) Training starts at `step` (0, or a checkpoint's): warm-up counts from here."""
        self.step = step
        self._start_step = step
        self._measure_from = step + self.skip

    def _latest_checkpoint(self):
        cfg = self.job.checkpoint
        if not cfg.enabled:
            return None
        from malleus_svc.checkpoint import CheckpointWriter, load_latest
        if self._writer is None:   # one writer per job: a second would race the first's write in flight
            self._writer = CheckpointWriter(cfg.dir, keep_last=cfg.keep)
        from malleus_svc.checkpoint import CheckpointError
        try:
            self._writer.wait()    # a recovery reads what the last save wrote, never half of it
        except CheckpointError as e:   # that save failed: the previous checkpoint is the good one
            self._event("error", f"the last checkpoint write failed: {e}")
        return load_latest(cfg.dir, self.job.shape)   # damaged ones are skipped; a wrong model raises

    def _checkpoint(self) -> None:
        """At an iteration boundary: gather (synchronous), write (in the background). A failed
        write is reported and training goes on; the previous checkpoint stays the good one."""
        from malleus_svc.checkpoint import CheckpointError, save_group
        try:
            with self._lock:   # the last metrics lines travel along: a driver that had not read them yet still can
                recent = list(self.records[-RECORDS_KEPT:])
                extra = {"plan_version": self.plan_version, "records": recent, "excluded": sorted(self.excluded),
                         "external_rates": {str(d): r for d, r in sorted(self.external.items())}}
            save_group(self._writer, self.group, self.sampler, self.step, extra=extra)
        except CheckpointError as e:
            self._event("error", f"checkpoint at step {self.step} failed: {e}")
        except WorkerGroupError as e:   # a worker lost while gathering: the next step fails and recovers
            self._event("error", f"checkpoint at step {self.step} skipped: {str(e).splitlines()[0]}")

    def _start_metrics(self, plan: Plan) -> None:
        """Serve the job's Prometheus metrics (metrics.py); a port that cannot be bound fails the job
        at start-up, with the reason, rather than leaving it running unobserved."""
        cfg = self.job.metrics
        if not cfg.enabled:
            return
        from .metrics import JobMetrics, default_sd_dir
        m = JobMetrics(self.job.name, self.job.scenario.gpus_per_node)
        try:
            endpoint = m.serve(cfg.host, cfg.port, cfg.sd_dir or default_sd_dir())
        except OSError as e:
            raise MalleusError(f"metrics: cannot serve on {cfg.host}:{cfg.port} ({e}); set metrics.port to a free "
                               "port, or 0 for any") from None
        m.on_plan(plan, self.plan_version)
        self.metrics_export = m
        self._event("metrics", f"Prometheus metrics at http://{endpoint}/metrics")

    def _probe_all(self, group, devices, rounds: int = 1) -> dict[int, float]:
        import ray
        out: dict[int, list[float]] = {}
        for _ in range(rounds):
            res = ray.get([group.workers[d].probe.remote() for d in devices], timeout=group.timeout_s)
            for r in res:
                out.setdefault(r["device"], []).append(busy_seconds(r))
        return {d: statistics.median(v) for d, v in out.items()}

    def start(self, steps: int | None = None) -> dict:
        """Set up if needed and train `steps` iterations (default: the job's) on a thread of its own."""
        self.setup()
        with self._lock:
            if self._thread is not None:
                if self.restarted:   # resuming by itself already: the driver's start joins it
                    return self.status()
                raise MalleusError(f"job {self.job.name!r} is already {self.state}")
            if steps is not None:
                if int(steps) < 1:
                    raise MalleusError(f"steps must be >= 1, got {steps}")
                self.steps_total = int(steps)
            self.state = "training"
            self._thread = threading.Thread(target=self._train_loop, name="malleus-train", daemon=True)
            self._thread.start()
        return self.status()

    def wait(self, timeout: float | None = None) -> dict:
        """Block until training ends (or `timeout`); the summary."""
        self._done.wait(timeout)
        return self.summary()

    def stop(self) -> dict:
        """Stop training at the next iteration boundary (never inside a step or a migration); the
        driver then ends its Ray job normally, with the steps done so far."""
        with self._lock:
            if self.state in ("done", "failed", "stopped"):
                raise MalleusError(f"job {self.job.name!r} is already {self.state}")
            self._stop = True
            self._event("stop", f"stop requested at step {self.step}")
            return {"state": self.state, "step": self.step}

    def shutdown(self) -> None:
        self._stop = True
        if self._thread is not None:
            self._done.wait(120)
        if self.group is not None:
            self.group.shutdown()
        if self.metrics_export is not None:
            self.metrics_export.close()
        if self._lookahead is not None:
            self._lookahead.close()
        self.state = "stopped" if self.state != "failed" else self.state

    # ================================================================== the training loop
    def _train_loop(self) -> None:
        try:
            while not self._stop and self.step < self.steps_total:
                self._iteration()
            if self._writer is not None:
                if self.job.checkpoint.every and self.step % self.job.checkpoint.every:
                    self._checkpoint()          # the final state too, so a later run resumes from the end
                self._writer.wait()
            with self._lock:
                self.state = "stopped" if self.step < self.steps_total else "done"
                if self.state == "stopped":
                    self._event("stopped", f"stopped on request after {self.step} of {self.steps_total} steps")
        except Exception as e:  # the job failed: say where, keep the coordinator answering
            with self._lock:
                self.state, self.error = "failed", f"{type(e).__name__}: {e}"
                self._event("error", self.error + "\n" + traceback.format_exc(limit=5))
        finally:
            self._done.set()

    def _iteration(self) -> None:
        import ray
        self._maybe_rejoin()
        self._apply_ready()
        step = self.step
        self._emulate(step)
        plan, group = self.plan, self.group
        before = self.sampler.state_dict()
        ids = self.sampler.next_global_batch(plan.global_batch)
        suspended = [d for d in plan.suspended if d not in plan.excluded]
        probes = [group.workers[d].probe.remote() for d in suspended]
        if self._t_start is None:
            self._t_start = time.perf_counter()
        assignment = None
        if self._lookahead is not None:   # this batch's, prepared during the last step; the next one's now
            assignment = self._lookahead.take((plan.plan_id, tuple(ids)), self._assignment, ids, plan)
            nxt = self.sampler.peek(0, plan.global_batch)
            self._lookahead.prepare((plan.plan_id, tuple(nxt)), self._assignment, nxt, plan)
        try:
            rec = group.step(ids, assignment)
        except WorkerGroupError as e:
            self._recover(e, before)     # the batch is given back to the sampler and the step redone
            return
        rec.step = step
        probe_res = ray.get(probes, timeout=group.timeout_s) if probes else []
        batch_lengths = self._batch_lengths(ids)
        if step >= self._measure_from:
            self._measure(plan, rec, probe_res, batch_lengths)
        line = rec.metrics()
        line.update(epoch=self.sampler.epoch, sampler_position=self.sampler.position,
                    injected_seconds={str(d): s.get("injected_seconds") for d, s in sorted(rec.devices.items())},
                    time=time.time())
        with self._lock:
            self._tokens_total += rec.tokens
            line["rates"] = {str(d): round(r, 3) for d, r in sorted(self.effective_rates().items())}
            line["length_stats"] = {k: v for k, v in (self._last_length_stats or {}).items() if k != "histogram"}
            self.records.append(line)
            if self.metrics_export is not None:
                st = self._last_length_stats or {}
                self.metrics_export.on_iteration(
                    line, rec.devices, self.effective_rates(), self.job.num_devices, plan.excluded,
                    self.healthy_tokens_per_second, batch_lengths,
                    {q: st[k] for q, k in ((0.5, "p50"), (0.9, "p90"), (0.99, "p99"), (1.0, "max")) if k in st})
            self.step = step + 1
            if self.step == self._start_step + self.skip + self.warmup and not self.calibrated:
                self.estimator.calibrate()
                self.calibrated = True
                recent = self.records[-self.warmup:]
                secs = sum(r["iteration_seconds"] for r in recent)
                self.healthy_tokens_per_second = sum(r["tokens"] for r in recent) / secs if secs > 0 else None
                self._event("calibrated", f"healthy unit {self.estimator.healthy_unit_seconds:.3g} s/t0, "
                                          f"{self.healthy_tokens_per_second or 0:,.0f} tok/s")
        every = self.job.checkpoint.every
        if every and self.step % every == 0:
            self._checkpoint()
        self._decide()
        self._grace_wait(rec.iteration_seconds)

    def _recover(self, error: Exception, sampler_before: dict) -> None:
        """A step failed: replace lost devices, keep the survivors, restore the state from the
        survivors' replicas (the step is redone on the same global batch), else from the newest
        checkpoint."""
        t0 = time.perf_counter()
        self._event("failure", f"step {self.step} failed: {str(error).splitlines()[0]}")
        old = self.plan
        rep = self.group.recover(plan_for=self._plan_without)
        if rep.plan_id != old.plan_id:   # devices gone for good: the group runs a plan without them now
            self._membership_changed(old, f"devices {rep.gone} gone (no worker could start in their bundles)")
        how = "from the survivors' replicas"
        if rep.source != "replicas":
            ckpt = self._latest_checkpoint()
            if ckpt is None:
                raise MalleusError(f"devices {rep.lost} were lost and the survivors cannot rebuild the model "
                                   f"({self.group.last_recovery_error}); there is no checkpoint to restore it from "
                                   "(set checkpoint.dir and checkpoint.every)")
            from malleus_svc.checkpoint import restore_group
            step = restore_group(self.group, ckpt, self.sampler)
            with self._lock:
                self.records = [r for r in self.records if r["step"] < step]
                self.step = step
            how = f"from checkpoint {ckpt.path.name} (step {step})"
        else:
            self.sampler.load_state_dict(sampler_before)
        with self._lock:
            for d in rep.lost:
                self.estimator.forget(d)
            self._measure_from = max(self._measure_from, self.step + self.skip_after_migration)
            self.failures.append({"step": self.step, "lost": rep.lost, "gone": rep.gone, "source": rep.source,
                                  "plan_id": rep.plan_id, "seconds": time.perf_counter() - t0})
            replaced = [d for d in rep.lost if d not in rep.gone]
            self._event("recovered", f"replaced devices {replaced}, gone {rep.gone}; state restored {how} in "
                                     f"{time.perf_counter() - t0:.1f} s; step redone")

    def _plan_without(self, gone: frozenset) -> Plan:
        """The plan over the devices that are still there (the group asks when some are gone or back)."""
        from malleus_svc.planner import plan as solve
        problem = self._problem(self.effective_rates(), self.excluded | set(gone))
        return solve(problem, previous=self.plan).plan

    def _membership_changed(self, old: Plan, detail: str) -> None:
        """The group now runs another plan because devices left or came back (not a round's migration:
        the state was rebuilt with the world). Book it like a re-plan."""
        new = self.group.plan
        with self._lock:
            self._adopt(old, new, self.effective_rates())
            if self.metrics_export is not None:
                self.metrics_export.on_round(["membership"], "applied", None)
            self._record_plan_change(None, "membership", f"membership: {detail}", old.plan_id, new,
                                     gone=sorted(self.group.gone))
            self._event("membership", f"{detail}: {old.plan_id} -> {new.plan_id} ({describe_plan(new)})")

    def _maybe_rejoin(self) -> None:
        """At an iteration boundary, every few seconds while devices are gone: bring back those whose
        node has returned (Ray placed their placement group again) and plan with them."""
        if not self.group.gone or time.monotonic() < self._next_rejoin_check:
            return
        self._next_rejoin_check = time.monotonic() + self.rejoin_check_s
        ready = self.group.rejoinable()
        if not ready:
            return
        old, t0 = self.plan, time.perf_counter()
        back = self.group.rejoin(ready, self._plan_without)
        if not back:
            return
        baselines = self._probe_all(self.group, back, rounds=5)   # fresh processes: their own probe baselines
        with self._lock:
            for d in back:
                self._factors.pop(d, None)          # emulation (tests) re-applies to the fresh worker
                self.estimator.set_probe_baseline(d, baselines[d])
        self._membership_changed(old, f"devices {back} rejoined in {time.perf_counter() - t0:.1f} s")

    def _grace_wait(self, iteration_seconds: float) -> None:
        """A plan being made when an iteration ends may take effect at this boundary if it is ready
        within `grace` x an iteration (the planner takes milliseconds here); otherwise training goes
        on under the old plan and the new one takes effect at a later boundary."""
        deadline = time.perf_counter() + self.grace * iteration_seconds
        while time.perf_counter() < deadline:
            with self._lock:
                rnd = self._round
                if rnd is None or self._ready is not None or rnd.decision is not None:
                    return
            time.sleep(0.005)

    # ------------------------------------------------------------------ emulation (demos/tests only)
    def _emulate(self, step: int) -> None:
        want = self.schedule.factors_at(step, range(self.job.num_devices))
        with self._lock:
            want.update(self._manual_slowdown)
        jitter = self.jitter
        if jitter > 0:
            want = {d: f * (1.0 + self._rng.uniform(0.0, 2.0 * jitter)) for d, f in want.items()}
        changed = {d: f for d, f in want.items() if self._factors.get(d, 1.0) != f}
        if changed:
            self.group.set_slowdowns(changed)
            self._factors.update(changed)

    def emulate(self, factors: Mapping[int, float] | None = None, jitter: float | None = None) -> dict:
        """EMULATION ONLY (demos/tests): slow devices from the next iteration on (1.0 = off), and/or
        set the random per-step jitter (each device's factor times U(1, 1 + 2·jitter) every step).
        The coordinator never reads these factors to estimate rates; it measures."""
        if jitter is not None:
            if not _is_number(jitter) or not 0.0 <= float(jitter) <= 1.0:
                raise MalleusError(f"jitter must be a number in [0, 1], got {jitter!r}")
            jitter = float(jitter)
        if factors is not None and not isinstance(factors, Mapping):
            raise MalleusError(f"factors must be a mapping of device -> slowdown factor (>= 1.0), got {factors!r}")
        clean = {}
        for d, f in (factors or {}).items():
            d = self._check_device(d)
            if not _is_number(f) or float(f) < 1.0:
                raise MalleusError(f"slowdown factor for device {d} must be a finite number >= 1.0, got {f!r}")
            clean[d] = float(f)
        with self._lock:
            self._manual_slowdown.update(clean)
            if jitter is not None:
                self.jitter = jitter
            return {"factors": dict(self._manual_slowdown), "jitter": self.jitter}

    # ------------------------------------------------------------------ measure
    def _batch_lengths(self, ids: list[int]):
        """The lengths of this global batch's samples (None if the dataset keeps no length table)."""
        lengths = getattr(self.group.dataset, "lengths", None)
        if lengths is None:
            return None
        import numpy as np
        return np.asarray(lengths)[np.asarray(ids, dtype=np.int64)]

    def _measure(self, plan: Plan, rec, probe_res: list[dict], batch_lengths) -> None:
        from malleus_svc.planner import evaluate
        tokens = {d: int(s.get("tokens") or 0) for d, s in rec.devices.items()}
        work = device_work(plan, self.job.scenario, tokens, self.job.data.seq_len)
        samples = [WorkSample(d, busy_seconds(s), work[d]) for d, s in rec.devices.items() if d in work]
        stats = None
        if batch_lengths is not None:
            from malleus_svc.runtime.datasets import length_stats
            stats = length_stats(batch_lengths)
        with self._lock:
            self.estimator.observe(samples)
            m = self.estimator.last_common_mode   # the same machine-wide factor applies to the probes
            for r in probe_res:
                self.estimator.observe_probe(r["device"], busy_seconds(r) / m)
            if stats is not None:
                self._last_length_stats = stats
                self._lengths.append(stats)
                self._observe_lengths(batch_lengths)
            # seconds per planner objective unit, under the rates measured now (after calibration)
            if self.calibrated:
                try:
                    obj = evaluate(self._problem(self.effective_rates(), set(plan.excluded)), plan)
                    if obj > 0:
                        self._unit_seconds.append(rec.iteration_seconds / obj)
                except Exception:  # a plan the current problem cannot evaluate: skip the sample
                    pass

    def _observe_lengths(self, lengths) -> None:
        """(lock held) Feed the drift detector; a drift asks for a re-plan and becomes the new reference."""
        rep = self.length_drift.observe(int(n) for n in lengths)
        if rep.drifted:
            self.last_drift = {"step": self.step, **rep.to_dict()}
            # the next window of batches (all after the shift) is the new reference; rebasing on the
            # recent window instead, half old and half new, would report the same shift again
            self.length_drift = _drift_detector()
            from malleus_svc.lengths import LengthHistogram
            self._drift_lengths = LengthHistogram.of(int(n) for n in lengths)
            if not self.static:
                self._submit("lengths", f"length distribution drifted: {rep.reason}")

    def effective_rates(self) -> dict[int, float]:
        """Measured rates with external ones (set_rates) taking precedence, device by device."""
        with self._lock:
            out = dict(self.estimator.rates()) if self.calibrated else {}
            out.update(self.external)
            return out

    def _problem(self, rates: Mapping[int, float], excluded: set[int]):
        snapped = {d: (r if r >= self.policy.threshold else 1.0) for d, r in rates.items() if d not in excluded}
        return build_problem(self.job.scenario, rates=snapped, excluded=frozenset(excluded), lengths=self._length_profile())

    def _length_profile(self):
        """The planner's view of the sampled lengths (lengths/expected.py): what a packed micro-batch
        costs and holds against the fixed-length one it assumes. None before any batch, and under
        padding (every micro-batch is then the fixed-length one). Recomputed as batches arrive."""
        if self.job.data.mode == "pad":
            return None
        with self._lock:
            hist = self.length_drift.lifetime if self.length_drift.lifetime.count else self._drift_lengths
            if hist is None or not hist.count:
                return None
            key = (id(hist), hist.count)
            if key != self._profile_key:
                try:
                    self._profile = length_profile(self.job.scenario, hist, self._length_cost,
                                                                     seq_len=self.job.data.seq_len)
                except Exception as e:   # never let the length view stop planning: plan at fixed length
                    log.warning("length profile unavailable (%s); planning with fixed-length micro-batches", e)
                    self._profile = None
                self._profile_key = key
            return self._profile

    # ------------------------------------------------------------------ decide
    def _decide(self) -> None:
        with self._lock:
            if self.static or not self.calibrated or self._round is not None or self._pending:
                return
            plan = self.plan
            active = set(plan.active_devices)
            suspended = set(plan.suspended)
            trig = self.policy.rate_trigger(self.basis, self.effective_rates(), active, suspended)
            if trig is None or not self.policy.due(self.step, self.last_migration_step):
                return
            self._submit(trig.reason, trig.detail)

    def _submit(self, kind: str, detail: str, force: bool = False) -> Request:
        """Queue a request (lock held): start a round now, or merge into the pending one."""
        req = Request(next(self._ids), kind, detail, self.step, time.time(), force)
        self._pending.append(req)
        self._event("request", f"#{req.id} {kind}: {detail}")
        if self._round is None and self.plan is not None:
            self._start_round()
        return req

    def _start_round(self) -> None:
        reqs, self._pending = self._pending, []
        gone = frozenset(self._gone())
        rnd = Round(next(self._round_ids), reqs, time.perf_counter(), self.step,
                    rates=self.effective_rates(), excluded=frozenset(self.excluded) | gone, gone=gone)
        self._round = rnd
        threading.Thread(target=self._plan_round, args=(rnd, self.plan), name=f"malleus-plan-{rnd.id}",
                         daemon=True).start()

    def _finish_round(self) -> None:
        """(lock held) The round in flight is over; start the pending one, if any."""
        self._round = None
        if self._pending and not self.static:
            self._start_round()

    def _predict_migration(self, old: Plan, new: Plan) -> tuple[float, float]:
        """(bytes, seconds) of switching from old to new."""
        if old.plan_id == new.plan_id:
            return 0.0, 0.0
        nbytes = Plan.diff(old, new, scenario_costs(self.job.scenario).state_sizes).moved_bytes
        zero = [s for b, s in self._migrations if b <= 0]
        with_bytes = [(s - (statistics.median(zero) if zero else 0.0)) / b for b, s in self._migrations if b > 0]
        overhead = statistics.median(zero) if zero else (
            statistics.median(s for _, s in self._migrations) * 0.5 if self._migrations else DEFAULT_MIGRATION_OVERHEAD_S)
        spb = max(statistics.median(with_bytes), 0.0) if with_bytes else DEFAULT_SECONDS_PER_BYTE
        return nbytes, overhead + nbytes * spb

    def _plan_round(self, rnd: Round, current: Plan) -> None:
        """The planner thread: options, their predicted cost, the choice. Training goes on meanwhile."""
        from malleus_svc.planner import evaluate, plan as solve, rebalance_data
        t0 = time.perf_counter()
        try:
            if self.plan_delay_s > 0:
                time.sleep(self.plan_delay_s)
            problem = self._problem(rnd.rates, set(rnd.excluded))
            with self._lock:
                unit = statistics.median(self._unit_seconds) if self._unit_seconds else None
                last_it = self.records[-1]["iteration_seconds"] if self.records else None
            if unit is None:  # no measurement yet: the plan in force's last iteration, else the profile's t0
                obj = evaluate(problem, current)
                unit = (last_it / obj) if (last_it and obj > 0) else scenario_costs(self.job.scenario).t0_seconds
            with self._lock:
                remaining = max(self.steps_total - self.step - 1, 0)
            membership = set(current.excluded) != set(rnd.excluded)
            forced = membership or any(r.force for r in rnd.requests)
            candidates: dict[str, Plan] = {}
            if not membership:
                candidates["keep"] = current
                try:
                    candidates["rebalance"] = rebalance_data(problem, current)
                except Exception as e:
                    self._event("planner", f"rebalance not possible: {e}")
            result = solve(problem, previous=current)
            candidates["replan"] = result.plan
            options, info = [], {}
            for name, p in candidates.items():
                it = evaluate(problem, p) * unit
                nbytes, mig = (0.0, 0.0) if name == "keep" else self._predict_migration(current, p)
                if name != "keep" and p.plan_id == current.plan_id:
                    continue
                options.append(Option(name, it, mig))
                info[name] = {"plan_id": p.plan_id, "iteration_seconds": it, "migration_seconds": mig,
                              "migration_bytes": nbytes, "time_to_finish": remaining * it + mig}
            if forced:
                pick = min((o for o in options if o.name != "keep"), default=None,
                           key=lambda o: remaining * o.iteration_seconds + o.migration_seconds)
                if pick is None:  # the planner's plan is the current one: nothing to move
                    pick = Option("keep", info["keep"]["iteration_seconds"], 0.0) if "keep" in info else None
            else:
                pick = choose(options, remaining)
            planning_s = time.perf_counter() - t0
            keep_s = info.get("keep", {}).get("time_to_finish")
            decision = {"option": pick.name if pick else "keep", "options": info, "remaining_iterations": remaining,
                        "seconds_per_unit": unit, "planning_seconds": planning_s,
                        "predicted_gain_seconds": (keep_s - info[pick.name]["time_to_finish"])
                        if (pick and keep_s is not None) else None}
            with self._lock:
                rnd.decision = decision
                if pick is None or pick.name == "keep":
                    self.basis = dict(rnd.rates)     # hysteresis is now around what we decided on
                    self._record(rnd, None, "kept")
                    self._finish_round()
                else:
                    rnd.new_plan = candidates[pick.name]
                    self._ready = rnd                 # the training thread applies it at the boundary
                    self._event("planned", f"round {rnd.id}: {pick.name} -> {rnd.new_plan.plan_id} "
                                           f"({planning_s:.2f} s), applying at the next iteration boundary")
        except Exception as e:
            with self._lock:
                rnd.decision = {"option": "failed", "error": f"{type(e).__name__}: {e}",
                                "planning_seconds": time.perf_counter() - t0}
                # an infeasible exclusion is undone: the plan in force keeps running
                if set(rnd.excluded) != set(self.plan.excluded):
                    self.excluded = set(self.plan.excluded) - set(rnd.gone)
                self._record(rnd, None, "failed")
                self._finish_round()

    # ------------------------------------------------------------------ migrate
    def _apply_ready(self) -> None:
        with self._lock:
            rnd, self._ready = self._ready, None
        if rnd is None:
            return
        if rnd.gone != frozenset(self._gone()):   # planned before devices left or came back: void
            with self._lock:
                self._record(rnd, None, "superseded")
                self._finish_round()
                self._submit("membership", f"re-plan round {rnd.id} again: devices gone now {sorted(self._gone())}")
            return
        old, new = self.plan, rnd.new_plan
        with self._lock:
            self._migrating = True
        t0 = time.perf_counter()
        try:
            if self.migrate_delay_s > 0:
                time.sleep(self.migrate_delay_s)
            report = self._migrate(old, new)
        finally:
            with self._lock:
                self._migrating = False
        seconds = time.perf_counter() - t0
        with self._lock:
            self._adopt(old, new, dict(rnd.rates))
            if self.metrics_export is not None:
                self.metrics_export.on_migration(seconds, report["moved_bytes"])
            self._migrations.append((float(report["moved_bytes"]), seconds))
            self._record(rnd, {"seconds": seconds, **report}, "applied", old.plan_id)
            self._finish_round()

    def _adopt(self, old: Plan, new: Plan, basis: dict[int, float]) -> None:
        """(lock held) `new` runs now, made from rates `basis`: a new plan version, measurements
        restart after a warm-up, and devices that became active or idle lose their stale history."""
        self.plan = new
        self.plan_version += 1
        if self.metrics_export is not None:
            self.metrics_export.on_plan(new, self.plan_version)
        self.basis = basis
        self.last_migration_step = self.step
        self._measure_from = max(self._measure_from, self.step + self.skip_after_migration)
        for d in set(old.roles()) ^ set(new.roles()):
            self.estimator.forget(d)

    def _migrate(self, old: Plan, new: Plan) -> dict:
        """Live migration at this iteration boundary: workers move exactly the slices the plans differ in."""
        rep = self.group.migrate(new, bucket_bytes=self.bucket_bytes)
        return {"mode": "live", "moved_bytes": float(rep.moved_bytes), "inter_node_bytes": float(rep.inter_node_bytes),
                "moves": rep.moves, "worker_seconds": float(rep.seconds)}

    # ------------------------------------------------------------------ history and events
    def _record_plan_change(self, round_id: int | None, outcome: str, reason: str, old_plan_id: str | None,
                            new: Plan, **extra) -> None:
        """(lock held) A history entry for a plan that took effect outside a re-plan round."""
        self.history.append({"round": round_id, "outcome": outcome, "time": time.time(), "step": self.step,
                             "reason": reason, "requests": [], "old_plan_id": old_plan_id,
                             "new_plan_id": new.plan_id, "new_plan": new.to_dict(),
                             "rates": {str(d): r for d, r in sorted(self.basis.items())},
                             "excluded": sorted(new.excluded), **extra})

    def _record(self, rnd: Round, migration: dict | None, outcome: str, old_plan_id: str | None = None) -> None:
        new = rnd.new_plan if outcome == "applied" else None
        entry = {
            "round": rnd.id, "outcome": outcome, "time": time.time(), "step": self.step,
            "requested_step": rnd.step,
            "reason": "; ".join(f"{r.kind}: {r.detail}" for r in rnd.requests),
            "requests": [r.to_dict() for r in rnd.requests],
            "decision": rnd.decision, "rates": {str(d): r for d, r in sorted(rnd.rates.items())},
            "excluded": sorted(rnd.excluded),
            "latency_seconds": time.perf_counter() - rnd.started,
        }
        if new is not None:
            entry.update(old_plan_id=old_plan_id, new_plan_id=new.plan_id,
                         new_plan=new.to_dict(), migration=migration)
        self.history.append(entry)
        if self.metrics_export is not None:
            # a round is counted once, when it ends (applied, kept or failed); its solve time then too
            self.metrics_export.on_round([r.kind for r in rnd.requests], outcome,
                                         (rnd.decision or {}).get("planning_seconds"))
        self._event(outcome, f"round {rnd.id} ({entry['reason']}): "
                    + (f"{entry['old_plan_id']} -> {new.plan_id}, moved {migration['moved_bytes'] / 1e6:.1f} MB "
                       f"in {migration['seconds']:.2f} s" if new is not None else
                       str((rnd.decision or {}).get("error") or (rnd.decision or {}).get("option"))))

    def _event(self, kind: str, text: str) -> None:
        self.events.append({"time": time.time(), "step": self.step, "kind": kind, "text": text})
        log.info("[%s] %s: %s", self.job.name, kind, text)

    # ================================================================== client API (validated)
    def _check_device(self, d: Any) -> int:
        n = self.job.num_devices
        # ASCII digits only: '²'.isdigit() is True, and int('²') raises
        ascii_digits = isinstance(d, str) and d.strip().isascii() and d.strip().isdigit()
        if isinstance(d, bool) or not (isinstance(d, int) or ascii_digits):
            raise MalleusError(f"device ids are ints in 0..{n - 1}, got {d!r}")
        d = int(d)
        if not 0 <= d < n:
            raise MalleusError(f"unknown device {d}: job {self.job.name!r} has devices 0..{n - 1}")
        return d

    def _check_devices(self, devices: Any, what: str) -> list[int]:
        if isinstance(devices, (int, str)):
            devices = [devices]
        if not isinstance(devices, (list, tuple, set, frozenset)) or not devices:
            raise MalleusError(f"{what} needs a non-empty list of device ids, got {devices!r}")
        return sorted({self._check_device(d) for d in devices})

    def replan(self, reason: str = "user request", force: bool = False) -> dict:
        """Ask for a re-plan (coalesced with any in flight). force: adopt the planner's plan even if
        keeping the current one is predicted to finish sooner."""
        if not isinstance(reason, str) or not reason.strip():
            raise MalleusError(f"reason must be a non-empty string, got {reason!r}")
        with self._lock:
            self._check_running()
            if self.static:
                raise MalleusError(f"job {self.job.name!r} runs a fixed plan (--static): it does not re-plan")
            req = self._submit("request", reason.strip(), bool(force))
            return {"request": req.id, "pending": [r.id for r in self._pending],
                    "round": self._round.id if self._round else None}

    def set_rates(self, rates: Mapping[Any, Any]) -> dict:
        """External health signals (DCGM/NVML, an operator): device -> straggling rate >= 1.0.
        They take precedence over measured rates for those devices until cleared with None."""
        if not isinstance(rates, Mapping) or not rates:
            raise MalleusError(f"set_rates needs a non-empty mapping of device -> rate (>= 1.0, or None to clear), "
                               f"got {rates!r}")
        clean: dict[int, float | None] = {}
        for d, r in rates.items():
            d = self._check_device(d)
            if r is None:
                clean[d] = None
                continue
            if not _is_number(r):
                raise MalleusError(f"rate for device {d} must be a finite number >= 1.0 (or None to clear), got {r!r}")
            if float(r) < 1.0:
                raise MalleusError(f"rate for device {d} must be >= 1.0 (1.0 = healthy, 3.0 = three times slower), "
                                   f"got {r!r}")
            clean[d] = float(r)
        with self._lock:
            self._check_running()
            for d, r in clean.items():
                if r is None:
                    self.external.pop(d, None)
                else:
                    self.external[d] = r
            detail = ", ".join(f"{d}={'cleared' if r is None else r}" for d, r in sorted(clean.items()))
            req = self._submit("external-rates", detail) if not self.static else None
            return {"external": dict(self.external), "request": req.id if req else None}

    def clear_rates(self) -> dict:
        with self._lock:
            if not self.external:
                return {"external": {}, "request": None}
        return self.set_rates({d: None for d in list(self.external)})

    def exclude(self, devices: Any) -> dict:
        devs = self._check_devices(devices, "exclude")
        with self._lock:
            self._check_running()
            already = [d for d in devs if d in self.excluded]
            if already:
                raise MalleusError(f"devices {already} are already excluded (excluded now: {sorted(self.excluded)})")
            if len(self.excluded | set(devs) | self._gone()) >= self.job.num_devices:
                raise MalleusError(f"excluding {devs} would leave no device for job {self.job.name!r}")
            if self.static:
                raise MalleusError(f"job {self.job.name!r} runs a fixed plan (--static): membership cannot change")
            self.excluded |= set(devs)
            req = self._submit("membership", f"exclude {devs}")
            return {"excluded": sorted(self.excluded), "request": req.id}

    def include(self, devices: Any) -> dict:
        devs = self._check_devices(devices, "include")
        with self._lock:
            self._check_running()
            gone = sorted(set(devs) & self._gone())
            if gone:
                raise MalleusError(f"devices {gone} are gone (their node left the cluster); they rejoin by "
                                   "themselves when Ray can place them again")
            missing = [d for d in devs if d not in self.excluded]
            if missing:
                raise MalleusError(f"devices {missing} are not excluded (excluded now: {sorted(self.excluded)})")
            if self.static:
                raise MalleusError(f"job {self.job.name!r} runs a fixed plan (--static): membership cannot change")
            self.excluded -= set(devs)
            req = self._submit("membership", f"include {devs}")
            return {"excluded": sorted(self.excluded), "request": req.id}

    def _gone(self) -> set[int]:
        return set(self.group.gone) if self.group is not None else set()

    def _check_running(self) -> None:
        if self.plan is None:
            raise MalleusError(f"job {self.job.name!r} has not started yet (state {self.state})")
        if self.state in ("failed", "stopped"):
            raise MalleusError(f"job {self.job.name!r} is {self.state}; it takes no requests")

    # ------------------------------------------------------------------ read-only calls
    def rates(self) -> dict:
        with self._lock:
            return {"measured": dict(self.estimator.rates()) if self.calibrated else {},
                    "external": dict(self.external), "effective": self.effective_rates(),
                    "basis": dict(self.basis), "calibrated": self.calibrated,
                    "healthy_unit_seconds": self.estimator.healthy_unit_seconds}

    def current_plan(self) -> dict | None:
        with self._lock:
            return self.plan.to_dict() if self.plan else None

    def get_history(self) -> list[dict]:
        with self._lock:
            return list(self.history)

    def metrics(self, since: int = 0) -> list[dict]:
        """Metrics lines of steps >= `since` (after a restart the first lines are the resumed steps)."""
        with self._lock:
            return [r for r in self.records if r["step"] >= since]

    def job_info(self) -> dict:
        import ray
        return {"job": self.job.name, "ray_job_id": self.driver_job_id, "submission_id": self.submission_id,
                "actor_job_id": ray.get_runtime_context().get_job_id(),
                "node_id": ray.get_runtime_context().get_node_id(), "state": self.state}

    def status(self) -> dict:
        with self._lock:
            plan = self.plan
            last = self.records[-1] if self.records else None
            elapsed = (time.perf_counter() - self._t_start) if self._t_start else 0.0
            return {
                "job": self.job.name, "state": self.state, "error": self.error, "static": self.static,
                "step": self.step, "steps": self.steps_total, "submission_id": self.submission_id,
                "resumed_from": self.resumed_from, "restarted": self.restarted, "failures": list(self.failures),
                "plan_id": plan.plan_id if plan else None, "plan_version": self.plan_version,
                "plan": _plan_summary(plan) if plan else None,
                "excluded": sorted(self.excluded), "gone": sorted(self._gone()),
                "rates": {str(d): r for d, r in sorted(self.effective_rates().items())},
                "external_rates": {str(d): r for d, r in sorted(self.external.items())},
                "calibrated": self.calibrated,
                "planning": None if self._round is None else {
                    "round": self._round.id,
                    "phase": "migrating" if self._migrating else "planning" if self._round.decision is None
                    else "waiting for the iteration boundary",
                    "requests": [r.id for r in self._round.requests]},
                "pending_requests": [r.to_dict() for r in self._pending],
                "tokens_per_second": (last["tokens"] / last["iteration_seconds"]) if last else None,
                "avg_tokens_per_second": self._tokens_total / elapsed if elapsed > 0 else None,
                "healthy_tokens_per_second": self.healthy_tokens_per_second,
                "length_stats": self._last_length_stats,
                "length_drift": self.last_drift,
                "history": len(self.history),
                "migrations": sum(1 for h in self.history if h["outcome"] == "applied"),
                "events": list(self.events)[-10:],
                "metrics_endpoint": self.metrics_export.endpoint if self.metrics_export else None,
                "workers": None if self.group is None else {
                    "devices": self.group.num_devices, "cpus_per_worker": self.group.cpus_per_worker,
                    "use_gpu": self.group.use_gpu, "host_cores": os.cpu_count(),
                    "pids": {str(i["device"]): i["pid"] for i in self.group.infos},
                    "nodes": {str(i["device"]): i["node_id"] for i in self.group.infos}},
            }

    def summary(self) -> dict:
        with self._lock:
            recs = self.records
            secs = sum(r["iteration_seconds"] for r in recs)
            return {"job": self.job.name, "state": self.state, "error": self.error, "steps": len(recs),
                    "first_loss": recs[0]["loss"] if recs else None, "last_loss": recs[-1]["loss"] if recs else None,
                    "tokens": sum(r["tokens"] for r in recs), "train_seconds": secs,
                    "tokens_per_second": sum(r["tokens"] for r in recs) / secs if secs > 0 else None,
                    "mean_iteration_seconds": secs / len(recs) if recs else None,
                    "migrations": sum(1 for h in self.history if h["outcome"] == "applied"),
                    "healthy_tokens_per_second": self.healthy_tokens_per_second}


def _plan_summary(plan: Plan) -> dict:
    return {"pipelines": [{"micro_batches": p.micro_batches,
                           "stages": [{"devices": list(s.devices), "layers": list(s.layers)} for s in p.stages]}
                          for p in plan.pipelines],
            "suspended": list(plan.suspended), "excluded": list(plan.excluded), "global_batch": plan.global_batch}


def describe_plan(plan: Plan | dict) -> str:
    """One line: pipelines as stage devices[layers] x micro-batches."""
    d = plan.to_dict() if isinstance(plan, Plan) else plan
    pipes = []
    for p in d["pipelines"]:
        st = " > ".join(f"{','.join(map(str, s['devices']))}[{s['layers'][0]}:{s['layers'][1]}]" for s in p["stages"])
        pipes.append(f"({st})x{p['micro_batches']}")
    extra = f" susp {list(d.get('suspended') or [])}" if d.get("suspended") else ""
    extra += f" excl {list(d.get('excluded') or [])}" if d.get("excluded") else ""
    return " ".join(pipes) + extra


def _drift_detector():
    from malleus_svc.lengths import DriftDetector
    return DriftDetector(window=8, threshold=0.25, min_samples=64)


def _is_number(v: Any) -> bool:
    """A finite real number (bools are not numbers here, though Python says they are)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))


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


def _make_actor_class(restarts: int):
    import ray
    return ray.remote(num_cpus=0, max_concurrency=16, max_restarts=restarts)(JobCoordinator)


def launch(job: JobConfig, *, name: str | None = None, detached: bool = False, **kwargs) -> Any:
    """Create the job's coordinator actor (named, namespace "malleus") and return its handle.
    Raises MalleusError if a job of that name already runs."""
    import ray
    name = name or actor_name(job.name)
    try:
        ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        pass
    else:
        raise MalleusError(f"a job named {job.name!r} is already running (actor {name!r} in namespace "
                           f"{NAMESPACE!r}); pick another job name or stop it first")
    kwargs.setdefault("driver_job_id", ray.get_runtime_context().get_job_id())
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    # Beside the driver (on a Ray Jobs cluster: the head), where Prometheus reads the file-SD target.
    here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=True)
    opts = {"name": name, "namespace": NAMESPACE, "scheduling_strategy": here}
    if detached:
        opts["lifetime"] = "detached"
    # With checkpoints, a coordinator that dies is restarted by Ray and resumes from the newest one
    # (its workers die with it: they are its children); without, there is nothing to resume from.
    restarts = MAX_RESTARTS if job.checkpoint.enabled else 0
    return _make_actor_class(restarts).options(**opts).remote(job, **kwargs)
