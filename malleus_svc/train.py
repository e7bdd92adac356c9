"""`python -m malleus_svc.train CONFIG` (also `malleus train`): train a job on Ray workers.

    python -m malleus_svc.train examples/tiny_job.yaml --steps 5 --metrics-out /tmp/m.jsonl
    python -m malleus_svc.train job.yaml --address auto --plan plan.json

Starts a local Ray cluster (or joins --address / the job's ray.address), creates one worker per
device, gets a plan (the planner on the job's scenario, or --plan), runs the steps, and writes one
JSON line per step to --metrics-out. Progress goes to stderr.
"""
from __future__ import annotations

import argparse
import logging
import sys
from typing import Sequence

from malleus_svc.config.errors import ConfigError
from malleus_svc.plan import Plan, PlanError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="malleus train", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="job file (YAML or JSON): scenario sections plus data, train, emulate, ray")
    p.add_argument("--address", default=None,
                   help='Ray cluster to join ("auto" or host:port); default: the job\'s ray.address, else a new local cluster')
    p.add_argument("--plan", default=None, help="plan JSON to use instead of running the planner")
    p.add_argument("--steps", type=int, default=None, help="number of steps (default: the job's train.steps)")
    p.add_argument("--metrics-out", default=None, help="append one JSON line per step to this file")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.steps is not None and args.steps < 1:
        print(f"error: --steps must be >= 1, got {args.steps}", file=sys.stderr)
        return 2
    from malleus_svc.config.job import load_job_config

    try:
        job = load_job_config(args.config)
        if args.plan:
            from malleus_svc.runtime.trainer import check_plan_for_job
            plan = check_plan_for_job(Plan.load(args.plan), job, f"--plan {args.plan}")
        else:
            from malleus_svc.runtime.trainer import make_plan
            plan = make_plan(job)
    except (ConfigError, PlanError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return _run(job, plan, args)


def _run(job, plan: Plan, args) -> int:
    import ray

    from malleus_svc.runtime.cluster import WorkerGroup, WorkerGroupError, start_local_ray
    from malleus_svc.runtime.data import DataError
    from malleus_svc.runtime.trainer import Trainer, describe_group, summary

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    address = args.address or job.ray.address
    say = (lambda msg: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    if address:
        ray.init(address=address, log_to_driver=True)
    else:
        start_local_ray(job.num_devices)
    try:
        say(f"[{job.name}] plan {plan.plan_id}: {len(plan.pipelines)} pipelines, "
            f"suspended {list(plan.suspended)}, excluded {list(plan.excluded)}, global batch {plan.global_batch}")
        with WorkerGroup(job.num_devices, job.scenario.gpus_per_node, name=f"malleus-{job.name}") as group:
            say(f"[{job.name}] {describe_group(group)}")
            trainer = Trainer(job, plan, group, metrics_out=args.metrics_out,
                              progress=None if args.quiet else sys.stderr)
            records = trainer.run(args.steps)
            say(f"[{job.name}] done: {summary(records)}")
    except DataError as e:  # e.g. a global batch larger than the dataset
        print(f"error: data: {e}", file=sys.stderr)
        return 2
    except WorkerGroupError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
