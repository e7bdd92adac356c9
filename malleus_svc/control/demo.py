"""`malleus demo`: the malleable loop end to end on one machine, in a few minutes.

Starts a local Ray cluster with 8 CPU workers standing in for GPUs (1 node of 8, or --nodes 2 of
4), trains the `small` preset on the bundled Python-source corpus, and runs one emulation
schedule twice in the same invocation:
  * static: the first plan kept for the whole run (what an unchanged job would do);
  * malleable: the coordinator measures, re-plans and migrates live.
Schedule (steps scale with --steps): device 3 slows 3× part-way through, later device 5 slows 3×,
then device 3 heals. The live view shows per-device rates, the plan, throughput and re-plan
events (plain lines when stdout is not a TTY). The summary compares throughput of both runs with
the capacity bound (healthy throughput measured in the warm-up × Σ(1/x_i)/N averaged over the
schedule's steps), and gives re-plan latencies and migration times. --summary-out FILE writes it
as JSON.

Emulation is for demos only: the coordinator never reads the factors; it measures compute time.
With 8 workers on few cores, a sleeping straggler frees CPU for the others, so wall-clock gaps
are smaller than on real GPUs (NOTES.md "Measuring on CPU");
both runs share the same contention, and the summary reports ratios from this one invocation.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Sequence


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="malleus demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30, help="iterations per run (default 30; the schedule scales)")
    p.add_argument("--nodes", type=int, choices=(1, 2), default=1, help="1 node of 8 workers, or 2 nodes of 4")
    p.add_argument("--global-batch", type=int, default=16, help="samples per iteration (default 16)")
    p.add_argument("--factor", type=float, default=3.0, help="slowdown of the emulated stragglers (default 3)")
    p.add_argument("--no-static", action="store_true", help="skip the static baseline run")
    p.add_argument("--summary-out", default=None, help="write the summary as JSON to this file")
    p.add_argument("--plain", action="store_true", help="plain lines even on a TTY")
    p.add_argument("--address", default=None, help="join this Ray cluster instead of starting a local one")
    return p


def schedule_for(steps: int, factor: float) -> list[dict]:
    a, b, c = max(6, steps // 5), max(9, (2 * steps) // 5), max(12, (3 * steps) // 5)
    return [{"device": 3, "factor": factor, "at_step": a, "until_step": c},
            {"device": 5, "factor": factor, "at_step": b, "until_step": None}]


def job_dict(name: str, nodes: int, global_batch: int, steps: int, emulate: list[dict]) -> dict:
    gpn = 8 // nodes
    return {"name": name, "cluster": {"nodes": nodes, "gpus_per_node": gpn, "gpu_memory_mb": 16000},
            "model": "small", "parallel": {"dp": 4, "tp": 1, "pp": 2}, "batch": {"global": global_batch, "micro": 2},
            "data": {"source": "python-stdlib", "seq_len": 128, "mode": "pack", "max_files": 400},
            "train": {"steps": steps, "seed": 0, "lr": 1.0e-3}, "emulate": emulate}


def true_factors(emulate: list[dict], step: int, n: int = 8) -> list[float]:
    out = [1.0] * n
    for e in emulate:
        if e["at_step"] <= step and (e["until_step"] is None or step < e["until_step"]):
            out[e["device"]] = e["factor"]
    return out


class View:
    """Live view: a redrawn block on a TTY, plain lines otherwise."""

    def __init__(self, tty: bool, out=sys.stdout):
        self.tty, self.out = tty, out
        self.log: list[str] = []

    def event(self, text: str) -> None:
        self.log.append(text)
        if not self.tty:
            print(text, file=self.out, flush=True)

    def step(self, title: str, line: dict, status: dict) -> None:
        from .coordinator import describe_plan
        rates = line.get("rates") or {}
        # "-": no estimate yet (a device that just changed role, e.g. suspended and not yet probed)
        r = " ".join(f"{d}:{rates[str(d)]:.1f}" if str(d) in rates else f"{d}:-" for d in range(8)) \
            if rates else "(calibrating)"
        tps = line["tokens"] / line["iteration_seconds"] if line["iteration_seconds"] > 0 else 0
        plain = (f"[{title}] step {line['step'] + 1:>3}/{status['steps']} iter {line['iteration_seconds']:.2f}s "
                 f"tok/s {tps:,.0f} plan {line['plan_id']} rates {r}")
        if not self.tty:
            print(plain, file=self.out, flush=True)
            return
        plan = status.get("plan")
        block = [f"malleus demo: {title}", plain,
                 "plan: " + (describe_plan(plan) if plan else "-"),
                 "rates: " + "  ".join(f"dev{d} {'#' * min(12, int(round(4 * rates.get(str(d), 1.0))))}"
                                       f"{rates.get(str(d), 1.0):.1f}" for d in range(8)),
                 "events:"] + ["  " + e for e in self.log[-6:]]
        self.out.write("\033[H\033[J" + "\n".join(block) + "\n")
        self.out.flush()


def run_one(title: str, job, steps: int, static: bool, view: View) -> dict:
    """Train `job` through a coordinator; the per-step lines, history and status at the end."""
    import ray

    from .coordinator import launch
    h = launch(job, steps=steps, static=static)
    try:
        st = ray.get(h.start.remote(steps))
        w = st["workers"]
        view.event(f"[{title}] {w['devices']} workers ({w['cpus_per_worker']:g} logical CPU each) sharing "
                   f"{w['host_cores']} cores; coordinator malleus:{job.name}")
        seen, ev_seen = 0, 0.0
        while True:
            st = ray.get(h.status.remote())
            for ev in st["events"]:
                if ev["time"] > ev_seen and ev["kind"] in ("calibrated", "planned", "applied", "kept", "failed", "error"):
                    view.event(f"[{title}] step {ev['step']}: {ev['kind']}: {ev['text'].splitlines()[0]}")
            if st["events"]:
                ev_seen = max(ev_seen, max(e["time"] for e in st["events"]))
            lines = ray.get(h.metrics.remote(seen))
            for line in lines:
                view.step(title, line, st)
            seen += len(lines)
            if st["state"] in ("done", "failed") and seen >= st["step"]:
                break
            time.sleep(0.2)
        if st["state"] == "failed":
            raise RuntimeError(f"{title} run failed: {st['error']}")
        return {"records": ray.get(h.metrics.remote()), "history": ray.get(h.get_history.remote()), "status": st}
    finally:
        try:
            ray.get(h.shutdown.remote(), timeout=120)
        except Exception:
            pass
        ray.kill(h)


def throughput(run: dict, first: int) -> float | None:
    recs = [r for r in run["records"] if r["step"] >= first]
    mig = sum((h.get("migration") or {}).get("seconds", 0.0) for h in run["history"] if h["outcome"] == "applied")
    secs = sum(r["iteration_seconds"] for r in recs) + mig
    return sum(r["tokens"] for r in recs) / secs if secs > 0 else None


def latencies(run: dict, emulate: list[dict]) -> list[dict]:
    """Per emulated shift: iterations and seconds from the shift until a new plan is in force."""
    recs = {r["step"]: r for r in run["records"]}
    shifts = sorted({e["at_step"] for e in emulate} | {e["until_step"] for e in emulate if e["until_step"]})
    out = []
    for s in shifts:
        if s not in recs:
            continue
        before = recs[s]["plan_id"]
        after = next((r for st, r in sorted(recs.items()) if st > s and r["plan_id"] != before), None)
        ev = {"shift_step": s, "what": ", ".join(
            f"device {e['device']} {'x' + format(e['factor'], 'g') if e['at_step'] == s else 'healed'}"
            for e in emulate if s in (e["at_step"], e["until_step"]))}
        if after is None:
            ev.update(new_plan_step=None, iterations=None, seconds=None)
        else:
            t_shift = recs[s]["time"] - recs[s]["iteration_seconds"]
            t_new = after["time"] - after["iteration_seconds"]
            ev.update(new_plan_step=after["step"], iterations=after["step"] - s, seconds=round(t_new - t_shift, 3),
                      new_plan_id=after["plan_id"])
        out.append(ev)
    return out


def run_demo(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.steps < 15:
        print("error: --steps must be >= 15 (warm-up, two slowdowns and a heal need room)", file=sys.stderr)
        return 2
    import logging

    import ray

    from malleus_svc.config.job import JobConfig
    from malleus_svc.runtime.cluster import start_local_ray

    logging.getLogger("malleus_svc").setLevel(logging.WARNING)
    emulate = schedule_for(args.steps, args.factor)
    view = View(sys.stdout.isatty() and not args.plain)
    t0 = time.perf_counter()
    if args.address:
        ray.init(address=args.address, log_to_driver=False)
    else:
        repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = {"PYTHONPATH": os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p)}
        start_local_ray(8, log_to_driver=False, runtime_env={"env_vars": env})
    try:
        view.event(f"schedule: {json.dumps(emulate)}; {args.steps} steps per run, {8 // args.nodes} workers per "
                   f"node x {args.nodes} node(s) on {os.cpu_count()} host cores")
        runs = {}
        if not args.no_static:
            job = JobConfig.from_dict(job_dict("demo-static", args.nodes, args.global_batch, args.steps, emulate))
            runs["static"] = run_one("static", job, args.steps, True, view)
        job = JobConfig.from_dict(job_dict("demo-malleable", args.nodes, args.global_batch, args.steps, emulate))
        runs["malleable"] = run_one("malleable", job, args.steps, False, view)
    finally:
        ray.shutdown()
    summary = summarize(runs, emulate, args, time.perf_counter() - t0)
    print_summary(summary)
    if args.summary_out:
        with open(args.summary_out, "w") as f:
            json.dump(summary, f, indent=2)
        print(f"summary written to {args.summary_out}")
    return 0


def summarize(runs: dict, emulate: list[dict], args, wall: float) -> dict:
    from malleus_svc.config.job import ControlConfig
    first = ControlConfig().skip   # warm-up iterations, not measured by either run
    mal = runs["malleable"]
    healthy = mal["status"]["healthy_tokens_per_second"]
    fractions = [sum(1.0 / x for x in true_factors(emulate, s)) / 8 for s in range(first, args.steps)]
    bound = healthy * sum(fractions) / len(fractions) if healthy else None
    out = {
        "workers": 8, "nodes": args.nodes, "workers_per_node": 8 // args.nodes, "host_cores": os.cpu_count(),
        "model": "small", "data": "python-stdlib", "steps": args.steps, "global_batch": args.global_batch,
        "schedule": emulate, "measured_from_step": first, "wall_seconds": round(wall, 1),
        "healthy_tokens_per_second": healthy,
        "capacity_bound_tokens_per_second": bound,
        "capacity_fraction_mean": sum(fractions) / len(fractions),
        "malleable_tokens_per_second": throughput(mal, first),
        "replans": [{"step": h["step"], "reason": h["reason"], "option": (h.get("decision") or {}).get("option"),
                     "old_plan_id": h.get("old_plan_id"), "new_plan_id": h.get("new_plan_id"),
                     "predicted_gain_seconds": (h.get("decision") or {}).get("predicted_gain_seconds"),
                     "planning_seconds": (h.get("decision") or {}).get("planning_seconds"),
                     "migration_bytes": (h.get("migration") or {}).get("moved_bytes"),
                     "migration_seconds": (h.get("migration") or {}).get("seconds")}
                    for h in mal["history"] if h["outcome"] in ("applied", "kept", "failed")],
        "replan_latency": latencies(mal, emulate),
        "migration_seconds": [h["migration"]["seconds"] for h in mal["history"] if h["outcome"] == "applied"],
        "last_loss": {k: r["records"][-1]["loss"] for k, r in runs.items()},
    }
    if "static" in runs:
        out["static_tokens_per_second"] = throughput(runs["static"], first)
        if out["static_tokens_per_second"]:
            out["malleable_over_static"] = out["malleable_tokens_per_second"] / out["static_tokens_per_second"]
    if bound:
        out["malleable_over_bound"] = out["malleable_tokens_per_second"] / bound
        if out.get("static_tokens_per_second"):
            out["static_over_bound"] = out["static_tokens_per_second"] / bound
    return out


def print_summary(s: dict) -> None:
    def f(x, fmt=",.0f"):
        return "-" if x is None else format(x, fmt)
    print("\n=== malleus demo summary ===")
    print(f"{s['workers']} CPU workers ({s['nodes']} node(s) x {s['workers_per_node']}) shared {s['host_cores']} "
          f"cores; model {s['model']}, {s['steps']} steps/run, global batch {s['global_batch']}, "
          f"measured from step {s['measured_from_step']}; wall {s['wall_seconds']} s")
    print(f"healthy (warm-up) throughput   {f(s['healthy_tokens_per_second'])} tok/s")
    print(f"capacity bound                 {f(s['capacity_bound_tokens_per_second'])} tok/s "
          f"(x mean Σ(1/x_i)/N = {s['capacity_fraction_mean']:.3f})")
    if "static_tokens_per_second" in s:
        print(f"static plan                    {f(s['static_tokens_per_second'])} tok/s "
              f"({f(s.get('static_over_bound'), '.2f')} of bound)")
    print(f"malleable                      {f(s['malleable_tokens_per_second'])} tok/s "
          f"({f(s.get('malleable_over_bound'), '.2f')} of bound"
          + (f", {s['malleable_over_static']:.2f}x static)" if s.get("malleable_over_static") else ")"))
    for lat in s["replan_latency"]:
        print(f"shift at step {lat['shift_step']} ({lat['what']}): new plan in force after "
              f"{f(lat['iterations'], 'd')} iterations, {f(lat['seconds'], '.2f')} s")
    for r in s["replans"]:
        print(f"  step {r['step']}: {r['option']} {r['old_plan_id'] or ''} -> {r['new_plan_id'] or '(kept)'}; "
              f"planning {f(r['planning_seconds'], '.3f')} s, migration {f(r['migration_bytes'] and r['migration_bytes'] / 1e6, '.1f')} MB "
              f"in {f(r['migration_seconds'], '.2f')} s; {r['reason'][:90]}")


if __name__ == "__main__":
    sys.exit(run_demo())
