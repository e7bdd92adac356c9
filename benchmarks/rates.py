"""`malleus bench rates`: how steady a healthy device's measured rate is on the device clock, on a
machine busy with other work.

Runs the demo's job (8 CPU workers, no straggler) through a coordinator on a local Ray cluster
for `--steps` iterations while `--load` processes spin on the host's cores, and reports the spread
of every device's measured straggling rate over the measured steps (a healthy device should read
1.00), the share of ops that kept pace and the throughput. With `--load 0` it measures a quiet
machine; to load it with something real, run it beside a test suite instead.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

from .planner import write_section


def _spin(stop) -> None:
    x = 0
    while not stop.is_set():
        for _ in range(100_000):
            x += 1


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="malleus bench rates", description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40, help="iterations (default 40; the first 6 calibrate)")
    ap.add_argument("--load", type=int, default=2, help="busy processes beside the job (default 2: one per core here)")
    ap.add_argument("--write", metavar="MD", help="update this markdown file's rates section (BENCHMARKS.md)")
    args = ap.parse_args(argv)
    if args.steps < 10:
        ap.error("--steps must be >= 10 (6 warm-up and calibration steps come first)")
    if args.load < 0:
        ap.error("--load must be >= 0")

    import logging

    import ray

    from malleus_svc.config.job import JobConfig
    from malleus_svc.control.demo import View, job_dict, run_one
    from malleus_svc.runtime.cluster import start_local_ray

    logging.getLogger("malleus_svc").setLevel(logging.WARNING)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    start_local_ray(8, log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": repo}})
    stop = mp.Event()
    spinners = [mp.Process(target=_spin, args=(stop,), daemon=True) for _ in range(args.load)]
    t0 = time.perf_counter()
    try:
        for p in spinners:
            p.start()
        job = JobConfig.from_dict(job_dict("bench-rates", 1, 16, args.steps, []))
        run = run_one("rates", job, args.steps, False, View(False, out=sys.stderr))
    finally:
        stop.set()
        for p in spinners:
            p.join(5)
        ray.shutdown()
    rates = [r for rec in run["records"] for r in (rec.get("rates") or {}).values()]
    recs = [r for r in run["records"] if r.get("rates")]
    replans = [h for h in run["history"] if h["outcome"] in ("applied", "kept")]
    tps = sum(r["tokens"] for r in recs) / sum(r["iteration_seconds"] for r in recs)
    md = (f"Command: `malleus bench rates {' '.join(argv)}`".rstrip() + f" — {time.strftime('%Y-%m-%d')}, "
          f"8 CPU workers on {os.cpu_count()} cores beside {args.load} spinning process(es), "
          f"{len(recs)} measured iterations, {time.perf_counter() - t0:.0f} s.\n\n"
          "| healthy rates read | min | max | spread | ops that kept pace | re-plans | tokens/s |\n"
          "|---|---|---|---|---|---|---|\n"
          f"| {len(rates)} | {min(rates):.3f} | {max(rates):.3f} | {max(rates) - min(rates):.3f} | "
          f"{run['records'][-1]['pace_held']:.1%} | {len(replans)} | {tps:,.0f} |")
    print(md)
    if args.write:
        write_section(md, Path(args.write), "bench:rates")
        print(f"updated {args.write}", file=sys.stderr)
    return 0
