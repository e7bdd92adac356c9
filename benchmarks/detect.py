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
    and the iterations until its measured rate first moved past the coordinator's band (detected),
    until the round it started ended (decided: a plan applied, or the plan in force kept when the
    planner found none faster) and until a new plan was in force (`malleus demo`'s count); "–"
    when none came within `--window` iterations. The job is declared `--horizon` steps long, so that a better plan pays
    for its migration (over a few steps left, keeping the plan is the right answer), and ends once
    a new plan is in force or the window has passed.
The coordinator's thresholds are the job's (`control:` band, confirm, threshold, window) unless given.
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

from malleus_svc.config.options import number_option

from .planner import write_section

JOBS = ("tiny", "demo", "demo16")
TINY_JOB = Path(__file__).resolve().parent.parent / "examples" / "tiny_job.yaml"


def num_devices(name: str) -> int:
    return {"tiny": 4, "demo": 8, "demo16": 16}[name]


def job_for(name: str, steps: int, stragglers: list[dict], seed: int, control: dict) -> dict:
    """The job file (as a dict) of one run: `name`'s job, `steps` long, these stragglers."""
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


def straggler_row(name: str, factor: float, seed: int, device: int, shift: int, band: float, run: dict) -> dict:
    """Iterations from the slowdown at `shift` until the device's measured rate moved past `band`
    (`detected`), until the round it started ended (`decided`, with its outcome: a plan applied, or
    the plan in force kept when the planner found none faster) and until a new plan was in force
    (`planned`); None: not within the run."""
    from malleus_svc.control.demo import latencies

    emulate = [{"device": device, "factor": factor, "at_step": shift, "until_step": None}]
    early = [h for h in run["history"] if from_rates(h) and h["outcome"] == "applied" and h["step"] < shift]
    seen = next((r["step"] for r in run["records"]
                 if r["step"] >= shift and (r.get("rates") or {}).get(str(device), 1.0) >= 1.0 + band), None)
    decided = next((h for h in run["history"] if from_rates(h) and h["step"] >= shift), None)
    lat = latencies(run, emulate)
    return {"job": name, "factor": factor, "seed": seed, "device": device,
            "detected": None if seen is None else seen - shift,
            "decided": None if decided is None else (decided["step"] - shift, decided["outcome"]),
            "planned": lat[0]["iterations"] if lat else None, "adopted_before_shift": len(early),
            "pace_held": run["records"][-1].get("pace_held") if run["records"] else None}


def settled(records: list[dict], shift: int, window: int) -> bool:
    """A straggler run may end: a new plan is in force since the slowdown, or the window has passed."""
    at = next((r["plan_id"] for r in records if r["step"] == shift), None)
    return bool(records) and (records[-1]["step"] >= shift + window or
                              (at is not None and records[-1]["plan_id"] != at))


def run_job(d: dict, steps: int, until=None) -> dict:
    from malleus_svc.config.job import JobConfig
    from malleus_svc.control.demo import View, run_one

    with open(os.devnull, "w") as quiet:
        return run_one(d["name"], JobConfig.from_dict(d), steps, False, View(False, out=quiet), until=until)


def markdown(argv, healthy: list[dict], found: list[dict], args, band: float, wall: float) -> str:
    lines = [f"Command: `malleus bench detect {' '.join(argv)}`".rstrip() + f" — {time.strftime('%Y-%m-%d')}, "
             f"{os.cpu_count()} host cores, {wall / 60:.0f} min.", "",
             "Healthy runs (nothing straggles):", "",
             "| job | workers | steps | ops that kept pace | rounds that kept the plan | plans adopted | "
             "false re-plans per 1,000 steps | unmeasured at the end |", "|---|---|---|---|---|---|---|---|"]
    for h in healthy:
        um = ", ".join(f"{d} ({s:.0%})" for d, s in h["unmeasured_at_end"].items()) or "none"
        lines.append(f"| {h['job']} | {h['workers']} | {h['steps']} | {h['pace_held']:.1%} | {h['rounds_kept']} | "
                     f"{h['adopted']} | {h['false_replans_per_1000']:.1f} | {um} |")
    lines += ["", f"One device slowed from the first step after calibration (a job declared {args.horizon} steps "
                  f"long); iterations until its measured rate moved past the band ({band:g}) and until a new plan "
                  f"was in force, per seed (–: none within {args.window}):", "",
              "| job | factor | detected after | median | round decided after (outcome) | new plan in force after | median | "
              "plans adopted before the slowdown |", "|---|---|---|---|---|---|---|---|"]

    def cells(values: list) -> str:
        hit = [v for v in values if v is not None]
        return f"{', '.join('–' if v is None else str(v) for v in values)} | {statistics.median(hit) if hit else '–'}"
    for (job, factor) in dict.fromkeys((r["job"], r["factor"]) for r in found):
        rows = [r for r in found if (r["job"], r["factor"]) == (job, factor)]
        decided = ", ".join("–" if r["decided"] is None else f"{r['decided'][0]} ({r['decided'][1]})" for r in rows)
        lines.append(f"| {job} | {factor:g}x | {cells([r['detected'] for r in rows])} | {decided} | "
                     f"{cells([r['planned'] for r in rows])} | {sum(r['adopted_before_shift'] for r in rows)} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="malleus bench detect", description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", default=",".join(JOBS), help=f"comma-separated, of {', '.join(JOBS)} (default all)")
    number_option(ap, "--healthy-steps", 0, 100_000, integer=True, default=500,
                  help="iterations of each healthy run (default 500; 0: none)")
    ap.add_argument("--factors", default="1.25,1.5,2,3", help="slowdowns to detect (default 1.25,1.5,2,3)")
    number_option(ap, "--seeds", 0, 100, integer=True, default=2, help="straggler runs per job and factor (default 2)")
    number_option(ap, "--window", 1, 1000, integer=True, default=10,
                  help="iterations after the slowdown to wait for a plan (default 10)")
    number_option(ap, "--horizon", 20, 100_000, integer=True, default=200,
                  help="steps a straggler run's job is declared to last (default 200)")
    for knob, low, high, integer in (("band", 0.0, 100.0, False), ("confirm", 1, 100, True),
                                     ("threshold", 1.0, 100.0, False), ("window", 1, 1000, True)):
        number_option(ap, f"--rate-{knob}", low, high, integer=integer, dest=f"rate_{knob}", default=None,
                      help=f"the coordinator's `control.{knob}` (default the job's own)")
    ap.add_argument("--write", metavar="MD", help="replace this markdown file's detect section (BENCHMARKS.md)")
    ap.add_argument("--summary-out", metavar="JSON", help="write all numbers as JSON")
    return ap


def control_of(args) -> dict:
    """The coordinator's knobs given on the command line, as a job file's `control:` section."""
    return {k: v for k in ("band", "confirm", "threshold", "window") if (v := getattr(args, f"rate_{k}")) is not None}


def main(argv: list[str]) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    jobs = [j for j in args.jobs.split(",") if j]
    bad = [j for j in jobs if j not in JOBS]
    if bad:
        ap.error(f"unknown job(s) {', '.join(bad)}: choose from {', '.join(JOBS)}")
    try:
        factors = [float(f) for f in args.factors.split(",") if f]
    except ValueError:
        ap.error(f"--factors must be numbers separated by commas, got {args.factors!r}")
    if any(not 1 <= f <= 100 for f in factors):
        ap.error(f"--factors must be slowdowns in [1, 100], got {args.factors!r}")
    if args.horizon < args.window + 10:
        ap.error("--horizon must be at least --window + 10 (warm-up, calibration and healthy steps come first)")
    control = control_of(args)

    import logging

    import ray

    from malleus_svc.config.job import ControlConfig
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
                    device = random.Random(seed).randrange(num_devices(name))
                    slow = [{"device": device, "factor": factor, "at_step": HEALTHY_STEPS}]
                    d = job_for(name, args.horizon, slow, seed, control)
                    band = d["control"].get("band", ControlConfig.band)
                    found.append(straggler_row(name, factor, seed, device, HEALTHY_STEPS, band,
                                               run_job(d, args.horizon, lambda recs: settled(recs, HEALTHY_STEPS, args.window))))
                    print(f"[detect] {name}: {found[-1]}", file=sys.stderr, flush=True)
    finally:
        ray.shutdown()
    band = control.get("band", ControlConfig.band)
    md = markdown(argv, healthy, found, args, band, time.perf_counter() - t0)
    print(md)
    if args.summary_out:
        Path(args.summary_out).write_text(json.dumps({"healthy": healthy, "stragglers": found}, indent=2))
    if args.write:
        write_section(md, Path(args.write), "bench:detect")
        print(f"updated {args.write}", file=sys.stderr)
    return 0
