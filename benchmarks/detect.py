"""`malleus bench detect`: does the coordinator take noise for a straggler, and how soon does it
catch a real one?

Runs jobs through a coordinator on a local Ray cluster, as `malleus demo` does: the tiny example
(4 CPU workers), the demo's job (8) and the demo's model on 16 workers (2 nodes of 8 on this host),
each on an `auto` pace.
  * A healthy run of `--healthy-steps` per job: the planning rounds that rates started (a round that
    keeps the plan in force costs a planner call; one that adopts a plan is a false re-plan, which
    costs a migration), the share of ops that kept pace, the devices left unmeasured at the end.
  * A straggler run per job, factor (`--factors`) and seed (`--seeds`; the slowed device is drawn
    from the seed): one device slowed from the first step after calibration and 3 healthy steps,
    and the iterations until a new plan is in force (`malleus demo`'s count), or "missed" when none
    came within `--window` iterations.
The coordinator's thresholds are its defaults (`control:` band, confirm, threshold) unless given.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import yaml

from .planner import write_section

JOBS = ("tiny", "demo", "demo16")
TINY_JOB = Path(__file__).resolve().parent.parent / "examples" / "tiny_job.yaml"


def job_for(name: str, steps: int, stragglers: list[dict], seed: int, control: dict) -> dict:
    from malleus_svc.control.demo import job_dict

    if name == "tiny":
        d = yaml.safe_load(TINY_JOB.read_text())
        d.pop("eval", None)     # evaluation steps are not what is measured here
    else:
        d = job_dict(f"detect-{name}", 1, 16, steps, [])
        if name == "demo16":
            d["cluster"] = {**d["cluster"], "nodes": 2, "gpus_per_node": 8}
            d["parallel"] = {"dp": 8, "tp": 1, "pp": 2}
            d["batch"] = {**d["batch"], "global": 32}
    d["name"] = f"detect-{name}"
    d["train"] = {**d["train"], "steps": steps, "seed": seed}
    d["emulate"] = {"device": "auto", "stragglers": stragglers}
    d["control"] = {**d.get("control", {}), **control}
    return d


def from_rates(entry: dict) -> bool:
    """A history entry of a planning round that measured rates started."""
    return any(r.get("kind") == "rates" for r in entry.get("requests") or ())


def rounds_from_rates(run: dict) -> tuple[int, int]:
    """(planning rounds that kept the plan, plans adopted) that measured rates started."""
    rounds = [h for h in run["history"] if from_rates(h)]
    return sum(h["outcome"] == "kept" for h in rounds), sum(h["outcome"] == "applied" for h in rounds)


def healthy_row(name: str, run: dict) -> dict:
    kept, adopted = rounds_from_rates(run)
    steps = len(run["records"])
    return {"job": name, "steps": steps, "workers": run["status"]["workers"]["devices"],
            "pace_held": run["records"][-1].get("pace_held") if run["records"] else None,
            "rounds_kept": kept, "adopted": adopted, "false_replans_per_1000": 1000 * adopted / max(1, steps),
            "unmeasured_at_end": run["status"].get("unmeasured") or {}}


def straggler_row(name: str, factor: float, seed: int, device: int, shift: int, run: dict) -> dict:
    from malleus_svc.control.demo import latencies

    emulate = [{"device": device, "factor": factor, "at_step": shift, "until_step": None}]
    early = [h for h in run["history"] if from_rates(h) and h["outcome"] == "applied" and h["step"] < shift]
    lat = latencies(run, emulate)
    return {"job": name, "factor": factor, "seed": seed, "device": device,
            "iterations": lat[0]["iterations"] if lat else None, "adopted_before_shift": len(early),
            "pace_held": run["records"][-1].get("pace_held") if run["records"] else None}


def run_job(d: dict, steps: int) -> dict:
    from malleus_svc.config.job import JobConfig
    from malleus_svc.control.demo import View, run_one

    return run_one(d["name"], JobConfig.from_dict(d), steps, False, View(False, out=open(os.devnull, "w")))


def markdown(argv, healthy: list[dict], found: list[dict], args, wall: float) -> str:
    lines = [f"Command: `malleus bench detect {' '.join(argv)}`".rstrip() + f" — {time.strftime('%Y-%m-%d')}, "
             f"{os.cpu_count()} host cores, {wall / 60:.0f} min.", "",
             "Healthy runs (nothing straggles):", "",
             "| job | workers | steps | ops that kept pace | rounds that kept the plan | plans adopted | "
             "false re-plans per 1,000 steps | unmeasured at the end |", "|---|---|---|---|---|---|---|---|"]
    for h in healthy:
        um = ", ".join(f"{d} ({s:.0%})" for d, s in h["unmeasured_at_end"].items()) or "none"
        lines.append(f"| {h['job']} | {h['workers']} | {h['steps']} | {h['pace_held']:.1%} | {h['rounds_kept']} | "
                     f"{h['adopted']} | {h['false_replans_per_1000']:.1f} | {um} |")
    lines += ["", f"One device slowed from the first step after calibration; iterations until a new plan is in force "
                  f"(missed: none within {args.window}), per seed:", "",
              "| job | factor | iterations per seed | median | missed | plans adopted before the slowdown |",
              "|---|---|---|---|---|---|"]
    for (job, factor) in dict.fromkeys((r["job"], r["factor"]) for r in found):
        rows = [r for r in found if (r["job"], r["factor"]) == (job, factor)]
        its = [r["iterations"] for r in rows]
        hit = [i for i in its if i is not None]
        lines.append(f"| {job} | {factor:g}x | {', '.join('missed' if i is None else str(i) for i in its)} | "
                     f"{statistics.median(hit) if hit else '-'} | {len(its) - len(hit)} | "
                     f"{sum(r['adopted_before_shift'] for r in rows)} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="malleus bench detect", description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", default=",".join(JOBS), help=f"comma-separated, of {', '.join(JOBS)} (default all)")
    ap.add_argument("--healthy-steps", type=int, default=500, help="iterations of each healthy run (default 500; 0: none)")
    ap.add_argument("--factors", default="1.25,1.5,2,3", help="slowdowns to detect (default 1.25,1.5,2,3)")
    ap.add_argument("--seeds", type=int, default=2, help="straggler runs per job and factor (default 2)")
    ap.add_argument("--window", type=int, default=10, help="iterations after the slowdown to wait for a plan (default 10)")
    for knob in ("band", "confirm", "threshold"):
        ap.add_argument(f"--{knob}", type=float, default=None, help=f"the coordinator's `control.{knob}` (default its own)")
    ap.add_argument("--write", metavar="MD", help="replace this markdown file's detect section (BENCHMARKS.md)")
    ap.add_argument("--summary-out", metavar="JSON", help="write all numbers as JSON")
    args = ap.parse_args(argv)
    jobs = [j for j in args.jobs.split(",") if j]
    bad = [j for j in jobs if j not in JOBS]
    if bad:
        ap.error(f"unknown job(s) {', '.join(bad)}: choose from {', '.join(JOBS)}")
    try:
        factors = [float(f) for f in args.factors.split(",") if f]
    except ValueError:
        ap.error(f"--factors must be numbers separated by commas, got {args.factors!r}")
    if any(f < 1 for f in factors) or args.healthy_steps < 0 or args.seeds < 0 or args.window < 1:
        ap.error("factors must be >= 1, --healthy-steps and --seeds >= 0, --window >= 1")
    control = {k: (int(v) if k == "confirm" else v) for k in ("band", "confirm", "threshold")
               if (v := getattr(args, k)) is not None}

    import logging

    import ray

    from malleus_svc.control.demo import HEALTHY_STEPS
    from malleus_svc.runtime.cluster import start_local_ray

    logging.getLogger("malleus_svc").setLevel(logging.WARNING)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    start_local_ray(16, log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": repo}})
    t0 = time.perf_counter()
    healthy, found = [], []
    try:
        for name in jobs:
            if args.healthy_steps:
                print(f"[detect] {name}: healthy, {args.healthy_steps} steps", file=sys.stderr, flush=True)
                run = run_job(job_for(name, args.healthy_steps, [], 0, control), args.healthy_steps)
                healthy.append(healthy_row(name, run))
                print(f"[detect] {name}: {healthy[-1]}", file=sys.stderr, flush=True)
            for factor in factors:
                for seed in range(args.seeds):
                    steps = HEALTHY_STEPS + args.window + 1
                    d = job_for(name, steps, [], seed, control)
                    n = d["cluster"]["nodes"] * d["cluster"]["gpus_per_node"]
                    device = random.Random(seed).randrange(n)
                    d["emulate"]["stragglers"] = [{"device": device, "factor": factor, "at_step": HEALTHY_STEPS}]
                    found.append(straggler_row(name, factor, seed, device, HEALTHY_STEPS, run_job(d, steps)))
                    print(f"[detect] {name}: {found[-1]}", file=sys.stderr, flush=True)
    finally:
        ray.shutdown()
    md = markdown(argv, healthy, found, args, time.perf_counter() - t0)
    print(md)
    if args.summary_out:
        Path(args.summary_out).write_text(json.dumps({"healthy": healthy, "stragglers": found}, indent=2))
    if args.write:
        write_section(md, Path(args.write), "bench:detect")
        print(f"updated {args.write}", file=sys.stderr)
    return 0
