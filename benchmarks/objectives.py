"""`malleus bench objectives`: which planner objective orders plans as the event simulator times
them, and what planning under each one gives in simulated iteration time.

Scenarios: the simulate bench's grid (32B on 32 GPUs, 70B and 110B on 64, each healthy and under
mild / severe / authors' / slow-node stragglers) and the planner bench's random situations (1-3
stragglers per 16 devices; `--sizes`, `--seeds`). For each scenario:
  1. candidates: the finalists of `plan()` (the concrete plans it chooses among) under every
     objective, pooled; each is scored by every objective (`evaluate`) and by the 1F1B event
     simulation under the true rates (`simulate`, the reference); reported: Spearman's ρ and
     Kendall's τ-b between each objective and the simulator over the candidates;
  2. plans: the simulated iteration time of the plan `plan()` returns under each objective (the
     'full' first), of the authors' planner (its 'paper' objective) and of the baselines static,
     data-only and restart (`malleus_svc.simulate.baselines`), each as a ratio to full's;
     "best known" is the fastest of all these plans and the candidates of part 1.
Tables go to stdout as markdown, to BENCHMARKS.md between <!-- bench:objectives --> markers
(--write) and to a plot (--plot). Progress goes to stderr.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from malleus_svc.config.scenario import OBJECTIVES
from malleus_svc.planner import authors_plan, evaluate, plan
from malleus_svc.planner.build import build_problem
from malleus_svc.planner.problem import PlannerProblem
from malleus_svc.simulate import simulate
from malleus_svc.simulate.baselines import data_only_plan, restart_plan, static_plan
from malleus_svc.simulate.scenarios import SETUPS, SITUATIONS, paper_scenario
from .planner import draw_rates, parse_sizes, scenario_for, write_section
from .ranks import kendall, spearman

# 'full' first, the candidate for the default objective: every ratio is to its plan.
REFERENCE = "full"
ORDER = (REFERENCE, *(o for o in OBJECTIVES if o != REFERENCE))
OTHERS = ("authors", "static", "data-only", "restart")


@dataclass
class Row:
    name: str
    candidates: int
    spearman: dict[str, float] = field(default_factory=dict)
    kendall: dict[str, float] = field(default_factory=dict)
    sim: dict[str, float] = field(default_factory=dict)     # plan -> simulated iteration t0
    best_known: float = 0.0

    def ratio(self, which: str) -> float:
        """Simulated time of `which` over the 'full' objective's plan (> 1: full's is faster)."""
        return self.sim[which] / self.sim[REFERENCE]


def scenarios(sizes: list[int], seeds: int):
    for setup in SETUPS:
        for sit in SITUATIONS:
            yield f"{setup}/{sit}", build_problem(paper_scenario(setup, sit))
    for n in sizes:
        for seed in range(seeds):
            yield f"{n} devices, seed {seed}", build_problem(scenario_for(n), rates=draw_rates(n, random.Random(seed)))


def run_one(name: str, problem: PlannerProblem) -> Row:
    per = {o: replace(problem, objective=o) for o in OBJECTIVES}
    results = {o: plan(per[o]) for o in OBJECTIVES}
    pool = {c.plan_id: c for o in OBJECTIVES for c in results[o].finalists}
    cands = list(pool.values())
    sims = [simulate(c, problem).iteration_t0 for c in cands]
    row = Row(name, len(cands))
    for o in OBJECTIVES:
        values = [evaluate(per[o], c) for c in cands]
        row.spearman[o], row.kendall[o] = spearman(values, sims), kendall(values, sims)
    plans = {o: results[o].plan for o in OBJECTIVES}
    plans["authors"] = authors_plan(per["paper"]).plan
    plans["static"] = static_plan(problem)
    plans["data-only"] = data_only_plan(per[REFERENCE])
    plans["restart"] = restart_plan(problem)
    row.sim = {k: simulate(p, problem).iteration_t0 for k, p in plans.items()}
    row.best_known = min(min(sims), *row.sim.values())
    return row


def _fmt(x: float) -> str:
    return "–" if x != x else f"{x:+.2f}"


def ranks_table(rows: list[Row]) -> str:
    head = "| scenario | candidates | " + " | ".join(f"{o} ρ / τ" for o in ORDER) + " |"
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        out.append(f"| {r.name} | {r.candidates} | "
                   + " | ".join(f"{_fmt(r.spearman[o])} / {_fmt(r.kendall[o])}" for o in ORDER) + " |")
    s = summary(rows)
    out.append("| **mean (min)** | | " + " | ".join(
        f"**{s['mean_rho'][o]:+.2f}** ({s['min_rho'][o]:+.2f}) / {s['mean_tau'][o]:+.2f}" for o in ORDER) + " |")
    return "\n".join(out)


def plans_table(rows: list[Row]) -> str:
    cols = (*ORDER, *OTHERS)
    head = "| scenario | " + " | ".join(cols) + " | best known / full |"
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        cells = [f"{r.sim[c]:.1f}" + ("" if c == REFERENCE else f" · {r.ratio(c):.3f}") for c in cols]
        out.append(f"| {r.name} | " + " | ".join(cells) + f" | {r.best_known / r.sim[REFERENCE]:.3f} |")
    return "\n".join(out)


def summary(rows: list[Row]) -> dict:
    def ok(xs):
        return [x for x in xs if x == x]   # NaN: a constant column (e.g. one candidate)
    return {"mean_rho": {o: statistics.mean(ok([r.spearman[o] for r in rows])) for o in OBJECTIVES},
            "min_rho": {o: min(ok([r.spearman[o] for r in rows])) for o in OBJECTIVES},
            "mean_tau": {o: statistics.mean(ok([r.kendall[o] for r in rows])) for o in OBJECTIVES},
            "slower": [(r, c) for r in rows for c in (*ORDER[1:], *OTHERS) if r.ratio(c) < 1 - 1e-9],
            "short_of_best": [r for r in rows if r.best_known < r.sim[REFERENCE] * (1 - 1e-9)]}


def summary_lines(rows: list[Row]) -> str:
    s = summary(rows)
    best = max(OBJECTIVES, key=lambda o: s["mean_rho"][o])
    lines = [f"- Objective that best orders the candidates as the simulator does: **{best}** (mean Spearman "
             + ", ".join(f"{o} {s['mean_rho'][o]:+.3f}" for o in ORDER) + f" over {len(rows)} scenarios)."]
    if s["slower"]:
        lines.append("- A plan is faster in simulation than the 'full' objective's on: " + "; ".join(
            f"{r.name} ({c}, {100 * (1 / r.ratio(c) - 1):.2f}% faster)" for r, c in s["slower"]) + ".")
    else:
        lines.append(f"- The 'full' objective's plan is never slower in simulation than the other objectives' "
                     f"plans, the authors' or the baselines ({len(rows)} scenarios).")
    gaps = s["short_of_best"]
    lines.append(f"- The fastest plan known (those above and every candidate) beats full's on {len(gaps)} "
                 f"of {len(rows)} scenarios" + (": " + "; ".join(
                     f"{r.name} by {100 * (1 - r.best_known / r.sim[REFERENCE]):.2f}%" for r in gaps)
                     if gaps else "") + ".")
    return "\n".join(lines)


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4))
    xs = range(len(rows))
    for o in ORDER:
        ax.plot(xs, [r.spearman[o] for r in rows], marker="o", label=o)
    ax.set_xticks(list(xs), [r.name for r in rows], rotation=70, ha="right", fontsize=7)
    ax.set(ylabel="Spearman ρ vs simulator", ylim=(-1.05, 1.05),
           title="How well each objective orders the planner's finalists (1 = as the simulator)")
    ax.axhline(0, color="grey", lw=0.5)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="malleus bench objectives", description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="16,64", help="cluster sizes of the random situations (16 or multiples of 32)")
    ap.add_argument("--seeds", type=int, default=4, help="random situations per size (0: the grid only)")
    ap.add_argument("--write", metavar="MD", help="update this markdown file's objectives section")
    ap.add_argument("--plot", metavar="PNG", help="plot each scenario's rank correlations")
    args = ap.parse_args(argv)
    sizes = parse_sizes(ap, args.sizes)
    if args.seeds < 0:
        ap.error("--seeds must be >= 0")
    t = time.perf_counter()
    rows = []
    for name, problem in scenarios(sizes, args.seeds):
        rows.append(run_one(name, problem))
        r = rows[-1]
        print(f"[objectives] {name}: {r.candidates} candidates, ρ " + ", ".join(
            f"{o} {_fmt(r.spearman[o])}" for o in ORDER), file=sys.stderr, flush=True)
    md = f"{ranks_table(rows)}\n\n{plans_table(rows)}\n\n{summary_lines(rows)}"
    print(md)
    if args.plot:
        plot(rows, Path(args.plot))
        print(f"wrote {args.plot}", file=sys.stderr)
    if args.write:
        cmd = ("malleus bench objectives " + " ".join(argv)).strip()
        write_section(f"Command: `{cmd}` — {time.strftime('%Y-%m-%d')}, {os.cpu_count()}-core CPU machine, one "
                      f"process, {time.perf_counter() - t:.0f} s.\n\n{md}", Path(args.write), "bench:objectives")
    return 0
