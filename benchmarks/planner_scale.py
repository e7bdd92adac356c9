"""Planner at the largest layouts the limits allow: every 4,096-device shape of the table, then the
65,536-device maximum, each planned from scratch and re-planned from its own plan after one more
device slows down (the coordinator's path). Time, whether the search stopped at its time budget,
and the process's peak memory."""
from __future__ import annotations

import argparse
import resource
import time
from pathlib import Path

from malleus_svc.config.limits import MAX_SECONDS
from malleus_svc.config.scenario import DEFAULT_OBJECTIVE, OBJECTIVES
from malleus_svc.config.options import number_option
from malleus_svc.config import Scenario
from malleus_svc.planner import InfeasibleError, plan
from malleus_svc.planner.build import build_problem

from .planner import write_section

# (nodes of 8, model, dp, tp, pp)
LAYOUTS = (
    (512, "gpt-1.3b", 4096, 1, 1), (512, "gpt-1.3b", 1024, 1, 4), (512, "gpt-1.3b", 512, 8, 1),
    (512, "gpt-1.3b", 1024, 4, 1), (512, "gpt-1.3b", 256, 2, 8), (512, "llama-70b", 128, 4, 8),
    (512, "llama-70b", 64, 8, 8), (512, "llama-70b", 32, 8, 16), (8192, "gpt-1.3b", 16384, 1, 4),
)
RATES = {5: 3.0, 29: 2.0, 100: 5.0, 3000: 1.5}


def scenario(nodes: int, model: str, dp: int, tp: int, pp: int, budget: float, objective: str) -> Scenario:
    return Scenario.from_dict({
        "name": f"scale-{dp}x{tp}x{pp}", "cluster": {"nodes": nodes, "gpus_per_node": 8, "gpu_memory_mb": 81920},
        "model": model, "parallel": {"dp": dp, "tp": tp, "pp": pp},
        "batch": {"global": max(4 * dp, 2 * dp * pp), "micro": 1}, "rates": RATES,
        "planner": {"time_budget_s": budget, "objective": objective}})


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run(layout, budget: float, objective: str) -> dict:
    nodes, model, dp, tp, pp = layout
    sc = scenario(nodes, model, dp, tp, pp, budget, objective)
    row = {"devices": nodes * 8, "model": model, "layout": f"{dp}x{tp}x{pp}"}
    t = time.perf_counter()
    try:
        first = plan(build_problem(sc))
    except InfeasibleError as e:
        return {**row, "first_s": time.perf_counter() - t, "outcome": f"infeasible: {str(e)[:60]}"}
    row.update(first_s=time.perf_counter() - t, first_budget=bool(first.notes), pipelines=len(first.plan.pipelines))
    t = time.perf_counter()
    again = plan(build_problem(sc, rates={**RATES, 77: 4.0}), previous=first.plan)
    row.update(replan_s=time.perf_counter() - t, replan_budget=bool(again.notes), outcome="plan")
    return row


def table(rows: list[dict], budget: float) -> str:
    out = [f"| devices | model | dp×tp×pp | pipelines | first plan s | re-plan s (with previous) | "
           f"stopped at the {budget:g} s budget | peak MB |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["outcome"] != "plan":
            out.append(f"| {r['devices']} | {r['model']} | {r['layout']} | — | {r['first_s']:.1f} | — | {r['outcome']} | "
                       f"{r['peak_mb']:.0f} |")
            continue
        stopped = ", ".join(w for w, hit in (("first", r["first_budget"]), ("re-plan", r["replan_budget"])) if hit)
        out.append(f"| {r['devices']} | {r['model']} | {r['layout']} | {r['pipelines']} | {r['first_s']:.1f} | "
                   f"{r['replan_s']:.1f} | {stopped or 'no'} | {r['peak_mb']:.0f} |")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="malleus bench planner-scale", description=__doc__.split("\n")[0])
    number_option(ap, "--budget", 0.001, MAX_SECONDS, default=60.0, help="planner.time_budget_s (the default: 60)")
    ap.add_argument("--objective", choices=OBJECTIVES, default=DEFAULT_OBJECTIVE,
                    help=f"the planner's objective (default: {DEFAULT_OBJECTIVE})")
    ap.add_argument("--write", metavar="MD", help="update this markdown file's planner-scale section")
    args = ap.parse_args(argv)
    rows = []
    for i, layout in enumerate(LAYOUTS, 1):
        print(f"[{i}/{len(LAYOUTS)}] {layout[0] * 8} devices, {layout[1]}, dp×tp×pp {layout[2]}×{layout[3]}×{layout[4]}",
              flush=True)
        rows.append({**run(layout, args.budget, args.objective), "peak_mb": peak_mb()})
    md = table(rows, args.budget)
    print(md)
    if args.write:
        stamp = time.strftime("%Y-%m-%d")
        given = f" --objective {args.objective}" + (f" --budget {args.budget:g}" if args.budget != 60.0 else "")
        write_section(f"Command: `malleus bench planner-scale{given} --write BENCHMARKS.md` — {stamp}, 2-core CPU machine, "
                      f"one process (peak MB: the process so far).\n\n{md}", Path(args.write), "bench:planner-scale")
    return 0
