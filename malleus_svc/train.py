"""`python -m malleus_svc.train CONFIG` (also `malleus train`): train a job on Ray workers.

    python -m malleus_svc.train examples/tiny_job.yaml --steps 5 --metrics-out /tmp/m.jsonl
    python -m malleus_svc.train job.yaml --address auto --plan plan.json
    ray job submit --working-dir . -- python -m malleus_svc.train job.yaml   # as a Ray job

Starts a local Ray cluster (or joins --address / the job's ray.address / RAY_ADDRESS, which Ray
Jobs sets for every submitted driver), starts the job's
coordinator (control/coordinator.py: a named Ray actor "malleus:<job name>" that owns one worker
per device), gets a plan (the planner on the job's scenario, or --plan), runs the steps through
the coordinator, and writes one JSON line per step to --metrics-out. Progress and re-plan events
go to stderr. The job is malleable: it re-plans and migrates live when measured straggling rates
move, and answers `malleus_svc.connect(<job name>)` from other processes; --static keeps the
first plan fixed (for baselines).
"""
from __future__ import annotations

import argparse
import logging
import sys
from typing import Sequence

from malleus_svc.config.errors import ConfigError
from malleus_svc.config.limits import MAX_NUMBER, MAX_PORT
from malleus_svc.config.options import number_option, output_file_option
from malleus_svc.plan import Plan, PlanError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="malleus train", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="job file (YAML or JSON): scenario sections plus data, train, emulate, ray")
    p.add_argument("--address", default=None,
                   help='Ray cluster to join ("auto" or host:port); default: the job\'s ray.address, else a new local cluster')
    p.add_argument("--plan", default=None, help="plan JSON to use instead of running the planner")
    number_option(p, "--steps", 1, MAX_NUMBER, integer=True, default=None,
                  help="number of steps (default: the job's train.steps)")
    output_file_option(p, "--metrics-out", default=None, help="append one JSON line per step to this file")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("--static", action="store_true",
                   help="keep the first plan for the whole run (no re-planning; a baseline)")
    number_option(p, "--metrics-port", 0, MAX_PORT, integer=True, default=None,
                   help="Prometheus endpoint port (default: the job's metrics.port; 0 = any free port)")
    p.add_argument("--metrics-host", default=None,
                   help="Prometheus endpoint bind address (default: the job's metrics.host, 127.0.0.1)")
    p.add_argument("--no-metrics", action="store_true", help="serve no Prometheus endpoint")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from malleus_svc.config.job import load_job_config
    from malleus_svc.planner import InfeasibleError
    from malleus_svc.runtime.data import DataError

    job = None
    try:
        job = _with_metrics_args(load_job_config(args.config), args)
        from malleus_svc.runtime.datasets import check_before_start
        check_before_start(job.dataset_spec())   # a bad corpus is refused before Ray and the workers start
        if args.plan:
            from malleus_svc.runtime.trainer import check_plan_for_job
            plan = check_plan_for_job(Plan.load(args.plan), job, f"--plan {args.plan}")
        else:
            from malleus_svc.runtime.trainer import make_plan
            plan = make_plan(job)
    except (ConfigError, PlanError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except InfeasibleError as e:
        hint = ("; the first plan assumes the optimizer's state replicated, as parallel.shard_optimizer leaves "
                "it to the workers: true plans it sharded (ZeRO-1)" if job and job.scenario.shard_optimizer is None else "")
        print(f"error: infeasible: {e}{hint}", file=sys.stderr)
        return 2
    except DataError as e:
        print(f"error: data: {e}", file=sys.stderr)
        return 2
    return _run(job, plan, args)


def _with_metrics_args(job, args):
    """The job with --metrics-* applied, validated like the job file's own metrics section."""
    import dataclasses

    from malleus_svc.config.fields import Section
    from malleus_svc.config.job import parse_metrics

    m = dataclasses.asdict(job.metrics)
    if args.metrics_port is not None:
        m["port"] = args.metrics_port
    if args.metrics_host is not None:
        m["host"] = args.metrics_host
    if args.no_metrics:
        m["enabled"] = False
    return dataclasses.replace(job, metrics=parse_metrics(Section(m, "--metrics")))


def submission_id() -> str | None:
    """The Ray Jobs submission id of this driver, if it was submitted as a Ray job (the job
    supervisor passes it in the job config's metadata), so clients can find the job by it."""
    import json
    import os

    try:
        return json.loads(os.environ["RAY_JOB_CONFIG_JSON_ENV_VAR"])["metadata"]["job_submission_id"]
    except (KeyError, ValueError, TypeError):
        return None


def _run(job, plan: Plan, args) -> int:
    import os
    import signal

    import ray

    from malleus_svc.runtime.cluster import start_local_ray

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    address = args.address or job.ray.address or os.environ.get("RAY_ADDRESS")
    say = (lambda msg: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    if address:
        ray.init(address=address, log_to_driver=True)
    else:
        start_local_ray(job.num_devices)
    signal.signal(signal.SIGTERM, _on_sigterm)     # after ray.init, which sets its own (a bare exit)
    interrupt = Interrupt()
    signal.signal(signal.SIGINT, interrupt)
    try:
        say(f"[{job.name}] plan {plan.plan_id}: {len(plan.pipelines)} pipelines, "
            f"suspended {list(plan.suspended)}, excluded {list(plan.excluded)}, global batch {plan.global_batch}"
            + (" (static)" if args.static else ""))
        return run_through_coordinator(job, plan, args.steps or job.train.steps, static=args.static,
                                       metrics_out=args.metrics_out, say=say, interrupt=interrupt,
                                       submission_id=submission_id())
    finally:
        ray.shutdown()


class Interrupt:
    """Ctrl-C (SIGINT) at the driver: the first stops the job at the next step boundary, where its
    final checkpoint is written; a second aborts at once."""

    def __init__(self):
        self.requested = False

    def __call__(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True


def run_through_coordinator(job, plan: Plan | None, steps: int, *, static: bool = False,
                            metrics_out: str | None = None, say=print, poll_s: float = 0.25,
                            restart_wait_s: float = 300.0, interrupt: Interrupt | None = None,
                            **coordinator_kwargs) -> int:
    """Launch the job's coordinator, train `steps`, stream metrics lines and progress; 0 on success,
    130 when `interrupt` stopped it. However the run ends once the coordinator is up (done, failed,
    stopped, an error here, SIGTERM), its outcome is recorded on the cluster for `malleus status`
    (control/outcome.py)."""
    import json
    import time

    import ray

    from malleus_svc.control.coordinator import NAMESPACE, MalleusError, actor_name, launch
    from malleus_svc.control.measure import pace_warning
    from malleus_svc.control.tensorboard import TensorBoardLog
    from malleus_svc.runtime.cluster import WorkerGroupError
    from malleus_svc.runtime.data import DataError

    try:
        handle, owner = launch(job, plan=plan, steps=steps, static=static, **coordinator_kwargs)
    except MalleusError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = open(metrics_out, "a") if metrics_out else None
    tensorboard = TensorBoardLog(job.logging.tensorboard) if job.logging.tensorboard else None
    st: dict = {}
    seen = Progress(job.name)            # what this driver read, should the coordinator not answer
    ended: dict = {}                     # how the run ended where the coordinator cannot tell
    try:
        try:
            st = ray.get(handle.start.remote(steps, owner=owner))
        except ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", e)
            if isinstance(cause, DataError):  # e.g. a global batch larger than the dataset
                ended = {"state": "failed", "error": f"data: {cause}"}
                print(f"error: data: {cause}", file=sys.stderr)
                return 2
            if isinstance(cause, WorkerGroupError):
                ended = {"state": "failed", "error": str(cause)}
                print(f"error: {cause}", file=sys.stderr)
                return 1
            raise
        w = st.get("workers") or {}
        say(f"[{job.name}] {w.get('devices')} workers ({w.get('cpus_per_worker')} CPU each, host cores "
            f"{w.get('host_cores')}); coordinator actor {actor_name(job.name)} (namespace {NAMESPACE})"
            + (f"; metrics at http://{st['metrics_endpoint']}/metrics" if st.get("metrics_endpoint") else ""))
        every = max(1, steps // 50)
        events_seen, t_start, warned = 0.0, time.perf_counter(), False
        lost_since: float | None = None
        interrupt, stopping = interrupt or Interrupt(), False
        while True:
            if interrupt.requested and not stopping:
                stopping, ended = True, {"ended_by": "Ctrl-C (SIGINT) at the driver"}
                say(f"[{job.name}] interrupted: stopping at the next step boundary (Ctrl-C again to abort)")
                try:
                    ray.get(handle.stop.remote())
                except ray.exceptions.RayTaskError:   # it had already ended
                    pass
            try:
                st = ray.get(handle.status.remote())
                lines = ray.get(handle.metrics.remote(seen.steps))
                lost_since = None
            except ray.exceptions.RayActorError as e:
                # The coordinator died. With checkpoints Ray restarts it and it resumes by itself from
                # the newest one; the steps redone after it are not written twice (metrics by step).
                if not job.checkpoint.enabled or (lost_since and time.monotonic() - lost_since > restart_wait_s):
                    ended = {"state": "failed", "error": f"the job's coordinator died: {e}"}
                    print(f"error: the job's coordinator died: {e}", file=sys.stderr)
                    return 1
                if lost_since is None:
                    lost_since = time.monotonic()
                    say(f"[{job.name}] coordinator lost; waiting for it to restart from the last checkpoint")
                time.sleep(1.0)
                continue
            if st.get("restarted") and st["state"] in ("created", "starting", "ready"):
                time.sleep(poll_s)      # restarted, still restoring
                continue
            for line in lines:
                i = line["step"]
                seen.add(line)
                if out is not None:
                    out.write(json.dumps(line) + "\n")
                if tensorboard is not None:
                    tensorboard.line(line)
                if i % every == 0 or i == steps - 1:
                    elapsed = time.perf_counter() - t_start
                    say(f"[{job.name}] step {i + 1}/{steps} loss {line['loss']:.4f} "
                        f"tok/s {line['tokens'] / line['iteration_seconds']:,.0f} (avg {seen.tokens / elapsed:,.0f}) "
                        f"iter {line['iteration_seconds']:.3f}s plan {line['plan_id']}")
            if out is not None:
                out.flush()
            # once, past the warm-up: a host too busy for its workers' pace (CPU workers)
            if not warned and st.get("calibrated") and lines and (warning := pace_warning(lines[-1].get("pace_held"))):
                say(f"[{job.name}] {warning}")
                warned = True
            for ev in st["events"]:
                if ev["time"] > events_seen and ev["kind"] in ("planned", "applied", "kept", "failed", "error", "resumed"):
                    say(f"[{job.name}] {ev['kind']} at step {ev['step']}: {ev['text'].splitlines()[0]}")
                    if tensorboard is not None:
                        tensorboard.event(ev)
            if st["events"]:
                events_seen = max(events_seen, max(ev["time"] for ev in st["events"]))
            if st["state"] in ("done", "failed", "stopped"):   # lines were read after the status: all are in
                break
            time.sleep(poll_s)
        summ = _record_outcome(handle, seen, st, steps, ended, say)
        if st["state"] == "failed":
            print(f"error: {st['error']}", file=sys.stderr)
            return 1
        if stopping:
            ckpt = st.get("last_checkpoint")
            say(f"[{job.name}] interrupted after {summ['steps']} of {steps} steps; last checkpoint: "
                + (f"{ckpt['path']} (step {ckpt['step']})" if ckpt else "none (the job has no checkpoint.dir)"))
            return 130
        if st["state"] == "stopped":
            say(f"[{job.name}] stopped on request after {summ['steps']} of {steps} steps")
        say(f"[{job.name}] done: {summ}")
        return 0
    except Terminated:
        ended = {"state": "terminated", "error": None,
                 "ended_by": "SIGTERM to the driver (`ray job stop`, or a kill) while the job ran"}
        raise
    except BaseException as e:           # a bug or an interrupt here: the job goes with this driver
        ended = {"state": "failed", "error": f"the driver failed: {type(e).__name__}: {e}"}
        raise
    finally:
        if seen.recorded is None:
            _record_outcome(handle, seen, st, steps, ended, say)
        if out is not None:
            out.close()
        if tensorboard is not None:
            tensorboard.close()
        try:
            ray.get(handle.shutdown.remote(owner=owner), timeout=120)
        except Exception:  # already gone
            pass
        ray.kill(handle)


class Terminated(SystemExit):
    """SIGTERM to the driver. `ray job stop` sends it (to the driver and its children), waits
    RAY_JOB_STOP_WAIT_TIME_S (3 s by default) and then sends SIGKILL: time to record the outcome."""


def _on_sigterm(signum, frame):
    raise Terminated(128 + signum)


class Progress:
    """The steps this driver has read from the coordinator: the outcome's numbers if it is gone."""

    def __init__(self, job: str):
        self.job, self.steps, self.tokens = job, 0, 0
        self.first_loss = self.last_loss = None
        self.seconds = 0.0
        self.recorded: dict | None = None

    def add(self, line: dict) -> None:
        self.steps, self.tokens = line["step"] + 1, self.tokens + line["tokens"]
        self.seconds += line["iteration_seconds"]
        self.first_loss = line["loss"] if self.first_loss is None else self.first_loss
        self.last_loss = line["loss"]

    def summary(self) -> dict:
        return {"job": self.job, "state": "unknown", "error": None, "steps": self.steps, "first_loss": self.first_loss,
                "last_loss": self.last_loss, "tokens": self.tokens, "train_seconds": self.seconds,
                "tokens_per_second": self.tokens / self.seconds if self.seconds > 0 else None, "migrations": None}


SUMMARY_TIMEOUT_S = 1.5      # within Ray's 3 s between SIGTERM and SIGKILL, with time to write


def _record_outcome(handle, seen: Progress, st: dict, steps: int, ended: dict, say) -> dict:
    """Leave the job's final summary on the cluster for `malleus status` (control/outcome.py): the
    coordinator's, else what this driver read; `ended` overrides its state where the driver knows
    better. When it does (a stop, a failure), what the driver read is recorded first, at once: a
    host too busy to have the coordinator's answer within the grace a stop leaves still leaves an
    outcome. A failure to record costs the answer after the job, never the job."""
    import ray

    from malleus_svc.control.outcome import record

    def write(summ: dict) -> dict:
        summ = {**summ, **ended, "steps_requested": steps, "plan_id": st.get("plan_id"),
                "replans": st.get("history", 0), "submission_id": st.get("submission_id") or submission_id(),
                "ray_job_id": ray.get_runtime_context().get_job_id()}
        seen.recorded = summ
        try:
            record(summ)
        except Exception as e:
            say(f"[{seen.job}] could not record the final summary on the cluster: {e}")
        return summ

    if ended:
        write(seen.summary())
    try:
        return write(ray.get(handle.summary.remote(), timeout=SUMMARY_TIMEOUT_S))
    except Exception:     # gone, or busy past the grace a stop leaves
        return seen.recorded if ended else write(seen.summary())


if __name__ == "__main__":
    sys.exit(main())
