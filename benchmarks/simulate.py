"""`malleus bench simulate`: every system under the simulator, at the paper's scale.

Three parts, all scored by the 1F1B event simulation under TRUE rates (malleus_svc.simulate):
  1. static situations (malleus_svc.simulate.scenarios): 32B on 32 GPUs, 70B and 110B on 64
     GPUs, each healthy and under mild / severe / authors' / slow-node stragglers; steady-state
     throughput of static, data-only, restart, authors and malleus (ours, 'full' objective,
     previous = the static plan in force), the speedup over static, and the efficiency against
     the capacity bound  healthy throughput × Σ_d (1/x_d) / N  (healthy throughput: the best of
     the static and our plan with every device healthy);
  2. dynamic traces (stragglers come and go, 20-minute phases): throughput over the whole trace,
     switching costs included (restart 300 s + 15 min lost work; migration of Plan.diff bytes);
  3. large clusters (70B, DP(N/32)-TP8-PP4, 1% of devices straggling): planning time and plan
     quality; each planner runs in a child process with a time limit (--planner-timeout).
Tables are printed as markdown, optionally written to BENCHMARKS.md between
<!-- bench:simulate --> markers (--write) and plotted (--plot-dir). Progress goes to stderr.
"""
from __future__ import annotations

import argparse
import os
import multiprocessing as mp
import queue
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from malleus_svc.config.limits import MAX_SECONDS
from malleus_svc.config.options import number_option
from malleus_svc.simulate import SYSTEMS, Costs, IterationClock, make_systems, run_trace, simulate
from malleus_svc.simulate.baselines import static_plan
from malleus_svc.simulate.scenarios import (SETUPS, SINGLE_DEVICE, STRAGGLER_SITUATIONS, dynamic_trace,
                                            large_scenario, paper_scenario)
from .planner import write_section
from malleus_svc.planner.build import build_problem

PAPER_BAND = (2.63, 5.28)
EFFICIENCY_TARGET = 0.90


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- part 1: situations
@dataclass
class Row:
    setup: str
    situation: str
    capacity: float                    # Σ 1/x_d / N
    healthy_sps: float                 # samples/s of the best healthy plan
    sps: dict[str, float] = field(default_factory=dict)
    planning_s: dict[str, float] = field(default_factory=dict)
    oom: dict[str, int] = field(default_factory=dict)

    def speedup(self, system: str) -> float:
        return self.sps[system] / self.sps["static"]

    def efficiency(self, system: str) -> float:
        return self.sps[system] / (self.healthy_sps * self.capacity)


def healthy_throughput(setup: str) -> float:
    sc = paper_scenario(setup, "healthy")
    p = build_problem(sc)
    best = 0.0
    for s in make_systems(names=("static", "malleus")):
        plan = s.decide(p, None).plan
        best = max(best, plan.global_batch / simulate(plan, p).iteration_seconds)
    return best


def run_situations(setups, situations) -> list[Row]:
    from malleus_svc.simulate import memory_report

    rows = []
    systems = make_systems()
    for setup in setups:
        healthy = healthy_throughput(setup)
        for sit in situations:
            sc = paper_scenario(setup, sit)
            p = build_problem(sc)
            row = Row(setup, sit, sum(1.0 / x for x in p.rates) / len(p.rates), healthy)
            current = static_plan(p)
            for s in systems:
                d = s.decide(p, current)
                sim = simulate(d.plan, p)
                row.sps[s.name] = d.plan.global_batch / sim.iteration_seconds
                row.planning_s[s.name] = d.planning_seconds
                row.oom[s.name] = len(memory_report(d.plan, p, sim).oom)
            rows.append(row)
            _log(f"[situations] {setup}/{sit}: " + ", ".join(
                f"{n} {row.speedup(n):.2f}x ({100 * row.efficiency(n):.0f}%)" for n in SYSTEMS))
    return rows


def situations_table(rows: list[Row]) -> str:
    head = "| scenario | capacity Σ(1/x)/N | " + " | ".join(SYSTEMS) + " | malleus planning s |"
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        cells = [f"{r.sps[s]:.2f} · {r.speedup(s):.2f}× · {100 * r.efficiency(s):.0f}%"
                 + (" OOM" if r.oom[s] else "") for s in SYSTEMS]
        out.append(f"| {r.setup}/{r.situation} | {r.capacity:.3f} | " + " | ".join(cells)
                   + f" | {r.planning_s['malleus']:.2f} |")
    return "\n".join(out)


def situations_summary(rows: list[Row]) -> tuple[str, dict]:
    strag = [r for r in rows if r.situation in STRAGGLER_SITUATIONS]
    avg = {s: statistics.mean(r.speedup(s) for r in strag) for s in SYSTEMS} if strag else {}
    heavy = [r for r in strag if r.situation in ("severe", "authors")]
    single = [r for r in rows if r.situation in SINGLE_DEVICE]
    min_eff = min((r.efficiency("malleus") for r in single), default=float("nan"))
    losses = [(r, s, r.sps[s] / r.sps["malleus"] - 1) for r in rows for s in SYSTEMS
              if s != "malleus" and r.sps[s] > r.sps["malleus"] * (1 + 1e-9)]
    lines = []
    if strag:
        lines.append(f"- Average speedup over static on the {len(strag)} straggler scenarios: "
                     + ", ".join(f"{s} {avg[s]:.2f}×" for s in SYSTEMS if s != "static")
                     + f" (paper's band {PAPER_BAND[0]}–{PAPER_BAND[1]}×: malleus "
                     + ("in or above it" if avg["malleus"] >= PAPER_BAND[0] else "BELOW it") + ").")
    if heavy:
        lines.append(f"- On the severe and authors' scenarios only ({len(heavy)}): malleus "
                     f"{statistics.mean(r.speedup('malleus') for r in heavy):.2f}×, authors "
                     f"{statistics.mean(r.speedup('authors') for r in heavy):.2f}×.")
    if single:
        lines.append(f"- Single straggling device: malleus reaches at least {100 * min_eff:.1f}% of the capacity "
                     f"bound (target {100 * EFFICIENCY_TARGET:.0f}%: {'met' if min_eff >= EFFICIENCY_TARGET else 'NOT met'}).")
    if losses:
        lines.append("- A baseline beats malleus on: " + "; ".join(
            f"{r.setup}/{r.situation} ({s} +{100 * g:.1f}%)" for r, s, g in losses) + ".")
    else:
        lines.append("- Malleus is never slower than any baseline on these scenarios.")
    return "\n".join(lines), {"avg": avg, "min_single_eff": min_eff, "losses": losses}


# ----------------------------------------------------------------------------- part 2: traces
def run_traces(setups, costs: Costs) -> list[tuple[str, dict]]:
    out = []
    for setup in setups:
        sc = paper_scenario(setup, "healthy")
        trace = dynamic_trace(setup)
        clock = IterationClock(sc)
        results = {}
        for s in make_systems(costs):
            results[s.name] = run_trace(sc, trace, s, costs, clock)
        out.append((trace.name, results))
        _log(f"[traces] {trace.name}: " + ", ".join(f"{n} {r.throughput:.2f} samples/s" for n, r in results.items()))
    return out


def traces_table(traces: list[tuple[str, dict]]) -> str:
    head = "| trace (6 × 20 min) | " + " | ".join(SYSTEMS) + " | malleus stall s / planning s | restart stall s / lost samples |"
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, res in traces:
        st = res["static"].throughput
        cells = [f"{res[s].throughput:.2f} · {res[s].throughput / st:.2f}×" for s in SYSTEMS]
        m, r = res["malleus"], res["restart"]
        out.append(f"| {name} | " + " | ".join(cells)
                   + f" | {m.stall_seconds:.1f} / {m.planning_seconds:.1f} | {r.stall_seconds:.0f} / {r.lost_samples:.0f} |")
    return "\n".join(out)


# ----------------------------------------------------------------------------- part 3: large clusters
def _plan_in_child(which: str, num_devices: int, seed: int, queue) -> None:
    from malleus_svc.planner import authors_plan, plan
    from malleus_svc.simulate.baselines import full
    sc = large_scenario(num_devices, seed)
    p = build_problem(sc)
    t = time.perf_counter()
    r = plan(full(p)) if which == "malleus" else authors_plan(replace(p, objective="paper"))
    queue.put((r.plan.to_json(), time.perf_counter() - t))


def _timed_plan(which: str, num_devices: int, seed: int, timeout: float):
    """(plan or None, seconds) with the planner in a child process we can stop at `timeout`."""
    from malleus_svc.plan import Plan

    # the child imports this module by name: `malleus bench` loaded it from the checkout's folder,
    # which a spawned child finds only on sys.path (it inherits the parent's); appended, it shadows nothing
    root = str(Path(__file__).resolve().parents[1])
    if root not in sys.path:
        sys.path.append(root)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_plan_in_child, args=(which, num_devices, seed, q), daemon=True)
    t = time.perf_counter()
    proc.start()
    try:
        while True:
            try:
                text, secs = q.get(timeout=min(1.0, max(0.0, t + timeout - time.perf_counter())))
                proc.join(10)
                return Plan.from_json(text), secs
            except queue.Empty:
                if proc.exitcode:      # died, not stopped: no planning time to report
                    how = (f"was killed by signal {-proc.exitcode}" if proc.exitcode < 0 else
                           f"failed (exit code {proc.exitcode}; its error is above)")
                    raise RuntimeError(f"the {which} planner's process {how}") from None
                if time.perf_counter() >= t + timeout:
                    return None, time.perf_counter() - t
    finally:
        if proc.is_alive():
            proc.terminate()
            proc.join(5)


@dataclass
class LargeRow:
    devices: int
    stragglers: int
    capacity: float
    efficiency: dict[str, float]
    planning_s: dict[str, float]
    timed_out: dict[str, bool]


def run_large(sizes, timeout: float) -> list[LargeRow]:
    from malleus_svc.simulate.baselines import data_only_plan, full

    rows = []
    for n in sizes:
        sc = large_scenario(n)
        p = build_problem(sc)
        healthy = build_problem(sc, rates={})
        base = static_plan(p)
        ideal_sps = base.global_batch / simulate(static_plan(healthy), healthy).iteration_seconds
        cap = sum(1.0 / x for x in p.rates) / len(p.rates)
        eff, secs, to = {}, {}, {}
        plans = {"static": base, "data-only": data_only_plan(full(p))}
        for which in ("authors", "malleus"):
            _log(f"[large] {n} devices: {which} planning (limit {timeout:.0f} s) ...")
            plans[which], secs[which] = _timed_plan(which, n, 0, timeout)
            to[which] = plans[which] is None
        for name, plan in plans.items():
            eff[name] = (float("nan") if plan is None
                         else plan.global_batch / simulate(plan, p).iteration_seconds / (ideal_sps * cap))
        rows.append(LargeRow(n, sum(x != 1.0 for x in p.rates), cap, eff, secs, to))
        _log(f"[large] {n} devices: " + ", ".join(f"{k} {100 * v:.1f}%" for k, v in eff.items())
             + f"; planning malleus {secs['malleus']:.1f} s, authors {secs['authors']:.1f} s")
    return rows


def large_table(rows: list[LargeRow], timeout: float) -> str:
    names = ("static", "data-only", "authors", "malleus")
    head = ("| devices | stragglers | capacity | " + " | ".join(f"{s} eff." for s in names)
            + " | malleus planning s | authors planning s |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]

    def secs(r, s):
        return f"> {timeout:.0f} (stopped)" if r.timed_out[s] else f"{r.planning_s[s]:.1f}"
    for r in rows:
        out.append(f"| {r.devices} | {r.stragglers} | {r.capacity:.4f} | "
                   + " | ".join("—" if r.efficiency[s] != r.efficiency[s] else f"{100 * r.efficiency[s]:.1f}%"
                                for s in names)
                   + f" | {secs(r, 'malleus')} | {secs(r, 'authors')} |")
    return "\n".join(out)


# ----------------------------------------------------------------------------- plots
def plot(rows: list[Row], traces, large: list[LargeRow], directory: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    strag = [r for r in rows if r.situation != "healthy"]
    labels = [f"{r.setup}\n{r.situation}" for r in strag]
    for what, fn, ylabel, fname, log in (
            ("speedup", lambda r, s: r.speedup(s), "throughput / static", "simulate_speedup.png", True),
            ("efficiency", lambda r, s: r.efficiency(s), "throughput / capacity bound", "simulate_efficiency.png", False)):
        fig, ax = plt.subplots(figsize=(13, 4.5))
        w = 0.8 / len(SYSTEMS)
        for k, s in enumerate(SYSTEMS):
            ax.bar([i + k * w for i in range(len(strag))], [fn(r, s) for r in strag], w, label=s)
        ax.set_xticks([i + 0.4 - w / 2 for i in range(len(strag))], labels, fontsize=7)
        if log:
            ax.set_yscale("log")
        else:
            ax.axhline(EFFICIENCY_TARGET, color="grey", ls="--", lw=0.8)
        ax.set(ylabel=ylabel, title=f"Simulated {what} per straggler scenario (1F1B event simulation, true rates)")
        ax.legend(ncol=len(SYSTEMS), fontsize=8)
        fig.tight_layout()
        fig.savefig(directory / fname, dpi=110)
        plt.close(fig)
        paths.append(directory / fname)
    if traces:
        fig, ax = plt.subplots(figsize=(8, 4))
        w = 0.8 / len(SYSTEMS)
        for k, s in enumerate(SYSTEMS):
            ax.bar([i + k * w for i in range(len(traces))],
                   [res[s].throughput / res["static"].throughput for _, res in traces], w, label=s)
        ax.set_xticks([i + 0.4 - w / 2 for i in range(len(traces))], [n for n, _ in traces])
        ax.set(ylabel="throughput / static", title="Dynamic traces, switching costs included")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(directory / "simulate_traces.png", dpi=110)
        plt.close(fig)
        paths.append(directory / "simulate_traces.png")
    pts = sorted({(SETUPS[r.setup][1] * 8, r.planning_s["malleus"]) for r in rows
                  if r.situation != "healthy"})
    if pts or large:
        fig, ax = plt.subplots(figsize=(6, 4))
        xs = [n for n, _ in pts] + [r.devices for r in large if not r.timed_out["malleus"]]
        ys = [t for _, t in pts] + [r.planning_s["malleus"] for r in large if not r.timed_out["malleus"]]
        ax.scatter(xs, ys, label="malleus")
        xa = [r.devices for r in large if not r.timed_out["authors"]]
        ax.scatter(xa, [r.planning_s["authors"] for r in large if not r.timed_out["authors"]], marker="x", label="authors")
        ax.set(xscale="log", yscale="log", xlabel="devices", ylabel=f"planning seconds ({os.cpu_count()}-core machine)",
               title="Planning time against cluster size")
        ax.legend()
        fig.tight_layout()
        fig.savefig(directory / "simulate_planning.png", dpi=110)
        plt.close(fig)
        paths.append(directory / "simulate_planning.png")
    return paths


# ----------------------------------------------------------------------------- entry point
def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="malleus bench simulate", description=__doc__.split("\n")[0])
    ap.add_argument("--setups", default=",".join(SETUPS), help=f"comma-separated subset of {', '.join(SETUPS)}")
    ap.add_argument("--large", default="1024,4096", help="large cluster sizes for planning time ('' for none)")
    number_option(ap, "--planner-timeout", 0.001, MAX_SECONDS, default=120.0, help="seconds per planner run on large clusters")
    ap.add_argument("--no-traces", action="store_true", help="skip the dynamic traces")
    number_option(ap, "--restart-seconds", 0, MAX_SECONDS, default=300.0)
    number_option(ap, "--checkpoint-minutes", 0, 1e7, default=30.0, help="a restart loses half of it")
    ap.add_argument("--write", metavar="MD", help="update this markdown file's simulate section (e.g. BENCHMARKS.md)")
    ap.add_argument("--plot-dir", metavar="DIR", help="write PNG plots here")
    args = ap.parse_args(argv)
    setups = [s for s in args.setups.split(",") if s]
    bad = [s for s in setups if s not in SETUPS]
    if bad:
        ap.error(f"--setups: unknown {bad}; known: {', '.join(SETUPS)}")
    try:
        sizes = [int(x) for x in args.large.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--large must be comma-separated integers, got {args.large!r}")
    if any(n % 32 for n in sizes):
        ap.error("--large: sizes must be multiples of 32 (DP x TP8 x PP4)")
    costs = Costs(restart_seconds=args.restart_seconds, checkpoint_interval_seconds=args.checkpoint_minutes * 60)
    t_start = time.perf_counter()
    rows = run_situations(setups, ("healthy", *STRAGGLER_SITUATIONS))
    summary, _ = situations_summary(rows)
    traces = [] if args.no_traces else run_traces(setups, costs)
    large = run_large(sizes, args.planner_timeout)
    elapsed = time.perf_counter() - t_start
    parts = ["Cells: samples/s · speedup over static · efficiency against the capacity bound (healthy throughput "
             "× Σ(1/x)/N). Ours plans with the 'full' objective (bubbles, p2p, gradient reduction), the authors' "
             "planner with its own ('paper'); every plan is scored by the same 1F1B event simulation under true "
             "rates (blocking p2p, backward = 2× forward). Steady state: switching costs are in the traces.",
             situations_table(rows), summary]
    if traces:
        parts += [f"Dynamic traces (samples/s · speedup over static). Restart: {costs.restart_seconds:.0f} s + "
                  f"{costs.lost_seconds / 60:.0f} min of lost work per change; migration: Plan.diff bytes at "
                  f"{costs.intra_node_gbps:.0f}/{costs.inter_node_gbps:.0f} GB/s intra/inter-node; planning runs "
                  f"beside training (not a stall); every system reacts after {costs.detect_iterations} iterations.",
                  traces_table(traces)]
    if large:
        parts += ["Large clusters (70B, DP(N/32)-TP8-PP4, global batch 32·DP, 1% of devices at rates in "
                  "{1.5, 2.57, 5, 12.53}): efficiency against the capacity bound and planning time.",
                  large_table(large, args.planner_timeout)]
    md = "\n\n".join(parts)
    print(md)
    if args.plot_dir:
        for p in plot(rows, traces, large, Path(args.plot_dir)):
            _log(f"wrote {p}")
    if args.write:
        cmd = ("malleus bench simulate " + " ".join(argv)).strip()
        stamp = time.strftime("%Y-%m-%d")
        write_section(f"Command: `{cmd}` — {stamp}, {os.cpu_count()}-core CPU machine, one process (planners on "
                      f"large clusters in a child process); {elapsed:.0f} s.\n\n{md}", Path(args.write), "bench:simulate")
    _log(f"done in {elapsed:.0f} s")
    return 0
