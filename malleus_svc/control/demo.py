"""`malleus demo`: the malleable loop end to end on one machine, in a few minutes.

Starts a local Ray cluster with 8 CPU workers standing in for GPUs (1 node of 8, or --nodes 2 of
4), trains a small GPT on the bundled Python-source corpus, and runs one emulation schedule twice
in the same invocation:
  * static: the first plan kept for the whole run (what an unchanged job would do);
  * malleable: the coordinator measures, re-plans and migrates live.
Schedule: healthy for 9 steps, then three phases of equal length (15 steps each by default):
device 3 slows 3×, then device 5 slows 3× too, then device 3 heals. The live view shows
per-device rates, the plan, throughput and re-plan events (plain lines when stdout is not a TTY).

Every worker runs on the paced device clock (runtime/device_clock.py): it behaves like an
accelerator of its own, sized so that the host keeps pace with all 8 computing at once, and a 3×
straggler really takes three times as long per op. The coordinator never reads the factors; it
measures device time.

The summary compares the throughput of both runs with the capacity bound (the healthy throughput
measured in the warm-up × Σ(1/x_i)/N, as a harmonic mean over the measured steps), over the whole
run and in steady state (from each new plan to the next shift), gives the best a perfect planner
could do against the static plan on this schedule, re-plan latencies, migration times and the
share of ops that kept pace. --summary-out FILE writes it as JSON.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Callable, Sequence

from malleus_svc.config.job import ControlConfig
from malleus_svc.config.limits import MAX_GLOBAL_BATCH
from malleus_svc.config.options import number_option, output_file_option
from malleus_svc.runtime.device_clock import host_cores

from .measure import pace_warning


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="malleus demo", description=__doc__.split("\n\n")[0])
    number_option(p, "--steps", 1, 10**6, integer=True, default=HEALTHY_STEPS + 3 * 15,
                   help=f"iterations per run (default {HEALTHY_STEPS + 3 * 15}: {HEALTHY_STEPS} healthy, then three "
                        "phases of 15; the phases scale)")
    number_option(p, "--nodes", 1, 2, integer=True, default=1, help="1 node of 8 workers, or 2 nodes of 4")
    number_option(p, "--global-batch", 1, MAX_GLOBAL_BATCH, integer=True, default=16,
                  help="samples per iteration (default 16)")
    number_option(p, "--factor", 1, 100, default=3.0, help="slowdown of the emulated stragglers (default 3)")
    p.add_argument("--no-static", action="store_true", help="skip the static baseline run")
    output_file_option(p, "--summary-out", default=None, help="write the summary as JSON to this file")
    p.add_argument("--plain", action="store_true", help="plain lines even on a TTY")
    p.add_argument("--address", default=None, help="join this Ray cluster instead of starting a local one")
    return p


# Small enough that a step of 8 paced workers on 2 cores takes about a second.
MODEL = {"layers": 8, "hidden": 128, "heads": 4, "ffn": 384, "vocab": 256, "seq_len": 32}
SHOWN_EVENTS = ("links", "calibrated", "planned", "applied", "kept", "failed", "error")   # in the live view
# warm-up, calibration and 3 measured healthy steps before the first shift
HEALTHY_STEPS = ControlConfig.skip + ControlConfig.calibrate + 3
MIN_PHASE = 4


def schedule_for(steps: int, factor: float) -> list[dict]:
    phase = (steps - HEALTHY_STEPS) // 3
    a, b, c = HEALTHY_STEPS, HEALTHY_STEPS + phase, HEALTHY_STEPS + 2 * phase
    return [{"device": 3, "factor": factor, "at_step": a, "until_step": c},
            {"device": 5, "factor": factor, "at_step": b, "until_step": None}]


def job_dict(name: str, nodes: int, global_batch: int, steps: int, emulate: list[dict],
             device: dict | str = "auto") -> dict:
    """The demo's job; `device` is the emulated accelerator ("auto", or {tflops, gbps} to give a
    second run the pace the first one was sized to)."""
    gpn = 8 // nodes
    return {"name": name, "cluster": {"nodes": nodes, "gpus_per_node": gpn, "gpu_memory_mb": 16000},
            "model": MODEL, "parallel": {"dp": 4, "tp": 1, "pp": 2}, "batch": {"global": global_batch, "micro": 1},
            "data": {"source": "python-stdlib", "seq_len": MODEL["seq_len"], "mode": "pack", "max_files": 400},
            "train": {"steps": steps, "seed": 0, "lr": 1.0e-3},
            "emulate": {"device": device, "stragglers": emulate}}


def same_device(run: dict) -> dict | str:
    """The accelerator a finished run emulated, for the next run: both on the same clock."""
    pace = run["status"]["device_pace"]
    return {"tflops": pace["gflops"] / 1e3, "gbps": pace["gbps"], "block_ms": pace["block_ms"]} if pace else "auto"


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


def run_one(title: str, job, steps: int, static: bool, view: View,
            until: Callable[[list[dict]], bool] | None = None) -> dict:
    """Train `job` through a coordinator; the per-step lines, history and status at the end. With
    `until`, the run ends early once it holds for the metrics lines so far (the coordinator still
    plans for all `steps`)."""
    import ray

    from .coordinator import actor_name, launch
    h, owner = launch(job, steps=steps, static=static)
    try:
        st = ray.get(h.start.remote(steps, owner=owner))
        w = st["workers"]
        pace = st["device_pace"]
        view.event(f"[{title}] {w['devices']} workers ({w['cpus_per_worker']:g} logical CPU each) sharing "
                   f"{w['host_cores']} cores" + (f", each an emulated accelerator of {pace['gflops']:.3g} GFLOP/s"
                                                 if pace else "") + f"; coordinator {actor_name(job.name)}")
        seen, ev_seen, so_far = 0, 0.0, []
        while True:
            st = ray.get(h.status.remote())
            for ev in st["events"]:
                if ev["time"] > ev_seen and ev["kind"] in SHOWN_EVENTS:
                    view.event(f"[{title}] step {ev['step']}: {ev['kind']}: {ev['text'].splitlines()[0]}")
            if st["events"]:
                ev_seen = max(ev_seen, max(e["time"] for e in st["events"]))
            lines = ray.get(h.metrics.remote(seen))
            for line in lines:
                view.step(title, line, st)
            seen += len(lines)
            so_far += lines
            if (st["state"] in ("done", "failed") and seen >= st["step"]) or (until is not None and until(so_far)):
                break
            time.sleep(0.2)
        if st["state"] == "failed":
            raise RuntimeError(f"{title} run failed: {st['error']}")
        return {"records": ray.get(h.metrics.remote()), "history": ray.get(h.get_history.remote()), "status": st}
    finally:
        try:
            ray.get(h.shutdown.remote(owner=owner), timeout=120)
        except Exception:
            pass
        ray.kill(h)


def throughput(run: dict, steps, transitions=()) -> float | None:
    """Tokens per second over these steps, the migrations applied before them included except at
    `transitions` (the steps whose migration brought a new plan in)."""
    steps = set(steps)
    recs = [r for r in run["records"] if r["step"] in steps]
    mig = sum((h.get("migration") or {}).get("seconds", 0.0) for h in run["history"]
              if h["outcome"] == "applied" and h["step"] in steps and h["step"] not in transitions)
    secs = sum(r["iteration_seconds"] for r in recs) + mig
    return sum(r["tokens"] for r in recs) / secs if secs > 0 else None


def bound(healthy: float | None, emulate: list[dict], steps) -> float | None:
    """The capacity bound over these steps: every step at the healthy throughput × Σ(1/x_i)/N."""
    steps = list(steps)
    if not healthy or not steps:
        return None
    return healthy * len(steps) / sum(8 / sum(1.0 / x for x in true_factors(emulate, s)) for s in steps)


def steady_steps(latency: list[dict], emulate: list[dict], steps: int) -> list[int]:
    """The steps from each decision after a shift to the next shift: from the new plan taking effect
    (its migration done), or from the round that kept the plan in force."""
    shifts = sorted({e["at_step"] for e in emulate} | {e["until_step"] for e in emulate if e["until_step"]})
    out = []
    for lat in latency:
        start = lat["new_plan_step"] if lat["new_plan_step"] is not None else lat.get("kept_step")
        if start is not None:
            end = next((s for s in shifts if s > lat["shift_step"]), steps)
            out += range(start, end)
    return out


def latencies(run: dict, emulate: list[dict]) -> list[dict]:
    """Per emulated shift: iterations and seconds from the shift until a new plan is in force; when
    none comes before the next shift, the step of a round that kept the plan in force (the planner
    found none faster), if any."""
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
        end = next((x for x in shifts if x > s), math.inf)
        if after is not None and after["step"] >= end:
            after = None
        if after is None:
            kept = next((h["step"] for h in run["history"] if h["outcome"] == "kept" and s < h["step"] < end), None)
            ev.update(new_plan_step=None, iterations=None, seconds=None, kept_step=kept)
        else:
            t_shift = recs[s]["time"] - recs[s]["iteration_seconds"]
            t_new = after["time"] - after["iteration_seconds"]
            ev.update(new_plan_step=after["step"], iterations=after["step"] - s, seconds=round(t_new - t_shift, 3),
                      new_plan_id=after["plan_id"])
        out.append(ev)
    return out


def run_demo(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.steps < HEALTHY_STEPS + 3 * MIN_PHASE:
        print(f"error: --steps must be >= {HEALTHY_STEPS + 3 * MIN_PHASE} ({HEALTHY_STEPS} healthy steps, then two "
              f"slowdowns and a heal of >= {MIN_PHASE} steps each)", file=sys.stderr)
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
                   f"node x {args.nodes} node(s) on {host_cores()} host cores")
        runs, device = {}, "auto"
        if not args.no_static:
            job = JobConfig.from_dict(job_dict("demo-static", args.nodes, args.global_batch, args.steps, emulate))
            runs["static"] = run_one("static", job, args.steps, True, view)
            device = same_device(runs["static"])
        job = JobConfig.from_dict(job_dict("demo-malleable", args.nodes, args.global_batch, args.steps, emulate,
                                           device))
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
    measured = range(first, args.steps)
    healthy_phase = range(first, HEALTHY_STEPS)
    mal = runs["malleable"]
    healthy = mal["status"]["healthy_tokens_per_second"]
    latency = latencies(mal, emulate)
    steady = steady_steps(latency, emulate, args.steps)
    held = [r["records"][-1].get("pace_held") for r in runs.values() if r["records"]]
    out = {
        "workers": 8, "nodes": args.nodes, "workers_per_node": 8 // args.nodes, "host_cores": host_cores(),
        "model": MODEL, "data": "python-stdlib", "steps": args.steps, "global_batch": args.global_batch,
        "schedule": emulate, "measured_from_step": first, "wall_seconds": round(wall, 1),
        "device_pace": mal["status"]["device_pace"],
        "pace_held": min(held) if held and None not in held else None,
        "healthy_tokens_per_second": healthy,
        "capacity_bound_tokens_per_second": bound(healthy, emulate, measured),
        "malleable_tokens_per_second": throughput(mal, measured),
        "malleable_steady_tokens_per_second": throughput(mal, steady, {x["new_plan_step"] for x in latency}),
        "steady_steps": len(steady),
        "replans": [{"step": h["step"], "reason": h["reason"], "option": (h.get("decision") or {}).get("option"),
                     "old_plan_id": h.get("old_plan_id"), "new_plan_id": h.get("new_plan_id"),
                     "predicted_gain_seconds": (h.get("decision") or {}).get("predicted_gain_seconds"),
                     "planning_seconds": (h.get("decision") or {}).get("planning_seconds"),
                     "migration_bytes": (h.get("migration") or {}).get("moved_bytes"),
                     "migration_seconds": (h.get("migration") or {}).get("seconds")}
                    for h in mal["history"] if h["outcome"] in ("applied", "kept", "failed")],
        "replan_latency": latency,
        "migration_seconds": [h["migration"]["seconds"] for h in mal["history"] if h["outcome"] == "applied"],
        "last_loss": {k: r["records"][-1]["loss"] for k, r in runs.items()},
    }
    b, steady_bound = out["capacity_bound_tokens_per_second"], bound(healthy, emulate, steady)
    if b:
        out["malleable_over_bound"] = out["malleable_tokens_per_second"] / b
    if steady_bound and out["malleable_steady_tokens_per_second"]:
        out["malleable_steady_over_bound"] = out["malleable_steady_tokens_per_second"] / steady_bound
    if "static" in runs:
        out["static_tokens_per_second"] = throughput(runs["static"], measured)
        if out["static_tokens_per_second"]:
            out["malleable_over_static"] = out["malleable_tokens_per_second"] / out["static_tokens_per_second"]
            if b:   # and its inverse: what a perfect planner would reach against the static plan
                out["static_over_bound"] = out["static_tokens_per_second"] / b
        healthy_static = throughput(runs["static"], healthy_phase)
        if healthy_static:   # nothing to do: the coordinator should cost nothing
            out["healthy_malleable_over_static"] = throughput(mal, healthy_phase) / healthy_static
    return out


def print_summary(s: dict) -> None:
    def f(x, fmt=",.0f"):
        return "-" if x is None else format(x, fmt)
    print("\n=== malleus demo summary ===")
    m, pace = s["model"], s["device_pace"]
    print(f"{s['workers']} CPU workers ({s['nodes']} node(s) x {s['workers_per_node']}) shared {s['host_cores']} "
          f"cores; model {m['layers']} layers x {m['hidden']} hidden, {s['steps']} steps/run, global batch "
          f"{s['global_batch']} x {m['seq_len']} tokens, measured from step {s['measured_from_step']}; "
          f"wall {s['wall_seconds']} s")
    if pace:
        print(f"each worker emulated an accelerator of {pace['gflops']:.3g} GFLOP/s and {pace['gbps']:.3g} GB/s, "
              f"{pace.get('block_ms', 0):.3g} ms per block an op runs through; "
              f"ops that kept pace: {f(s['pace_held'], '.1%')}")
        if warning := pace_warning(s["pace_held"]):
            print(warning)
    print(f"healthy (warm-up) throughput   {f(s['healthy_tokens_per_second'])} tok/s")
    print(f"capacity bound                 {f(s['capacity_bound_tokens_per_second'])} tok/s"
          + (f": a perfect planner would reach {1 / s['static_over_bound']:.2f}x the static plan on this schedule"
             if s.get("static_over_bound") else ""))
    if "static_tokens_per_second" in s:
        print(f"static plan                    {f(s['static_tokens_per_second'])} tok/s "
              f"({f(s.get('static_over_bound'), '.2f')} of bound)")
    print(f"malleable                      {f(s['malleable_tokens_per_second'])} tok/s "
          f"({f(s.get('malleable_over_bound'), '.2f')} of bound"
          + (f", {s['malleable_over_static']:.2f}x static)" if s.get("malleable_over_static") else ")"))
    print(f"malleable in steady state      {f(s['malleable_steady_tokens_per_second'])} tok/s "
          f"({f(s.get('malleable_steady_over_bound'), '.2f')} of bound over its {s['steady_steps']} steps)")
    if s.get("healthy_malleable_over_static"):
        print(f"while no device straggled      malleable at {s['healthy_malleable_over_static']:.3f}x static")
    for lat in s["replan_latency"]:
        if lat["new_plan_step"] is None and lat.get("kept_step") is not None:
            print(f"shift at step {lat['shift_step']} ({lat['what']}): plan in force kept at step {lat['kept_step']} "
                  "(the planner found none faster)")
            continue
        print(f"shift at step {lat['shift_step']} ({lat['what']}): new plan in force after "
              f"{f(lat['iterations'], 'd')} iterations, {f(lat['seconds'], '.2f')} s")
    for r in s["replans"]:
        print(f"  step {r['step']}: {r['option']} {r['old_plan_id'] or ''} -> {r['new_plan_id'] or '(kept)'}; "
              f"planning {f(r['planning_seconds'], '.3f')} s, migration {f(r['migration_bytes'] and r['migration_bytes'] / 1e6, '.1f')} MB "
              f"in {f(r['migration_seconds'], '.2f')} s; {r['reason'][:90]}")


if __name__ == "__main__":
    sys.exit(run_demo())
