"""`malleus bench planner`: planning time and plan quality from 16 to 1024 devices.

For each cluster size, several random straggler situations (1-3 stragglers per 16 devices at
rates drawn from {1.5, 2.5, 5, 12}); for each, the objective (the Malleus paper's, units of t0) of:
  ideal      - the straggler-free plan,
  unchanged  - the healthy baseline plan run as is under the stragglers (Megatron-style static 3D),
  data-only  - the baseline's groups and layers with re-balanced micro-batches,
  no-split   - layers + data re-planned, TP groups kept whole,
  authors    - the authors' planner as published (tail-only score, fixed P),
  malleus    - ours,
with ratios to the ideal and planning times; then per scenario the objective and the simulated
iteration time (the 1F1B event simulator, t0 units) of ours, of the authors' plan and of the
reference, the exhaustive search's optimum where the cluster has at most 16 devices, with the
ratio ours / reference. `--small N` adds N random small scenarios per objective
(benchmarks/small_problems.py) against exhaustive search. `--replan S` adds, per case, the re-plan a
running job makes when one more device slows down (3x, from the plan it runs), unbounded and with
the search's budget at S seconds: time and objective of each. Results are printed as markdown tables,
written to BENCHMARKS.md between markers (--write) and plotted (--plot).
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

from malleus_svc.config import Scenario
from malleus_svc.config.limits import MAX_SECONDS
from malleus_svc.config.options import number_option
from malleus_svc.config.scenario import OBJECTIVES
from malleus_svc.planner.build import build_problem
from malleus_svc.simulate import simulate

RATES = (1.5, 2.5, 5.0, 12.0)
EXHAUSTIVE_DEVICES = 16     # clusters this small get the exhaustive search's optimum as the reference
SYSTEMS = ("unchanged", "data-only", "no-split", "authors", "malleus")


def scenario_for(num_devices: int, objective: str = "paper") -> Scenario:
    """The paper's shapes: the 16-GPU worked example's profile at 16, the 70B profile beyond."""
    if num_devices == 16:
        d = {"cluster": {"nodes": 2, "gpus_per_node": 8, "gpu_memory_mb": 40536}, "model": {"layers": 32},
             "parallel": {"dp": 2, "tp": 4, "pp": 2}, "batch": {"global": 64, "micro": 1},
             "profile": {"tp_alpha": [1, 2, 4], "layer_memory_mb": [1500, 1270, 1040, 810],
                         "embedding_memory_mb": 600, "reserved_memory_mb": 4500, "safety_margin_mb": 4096}}
    else:
        dp = num_devices // 32
        d = {"cluster": {"nodes": num_devices // 8, "gpus_per_node": 8, "gpu_memory_mb": 81252},
             "model": "llama-70b", "parallel": {"dp": dp, "tp": 8, "pp": 4}, "batch": {"global": 32 * dp, "micro": 1},
             "profile": {"tp_alpha": [1, 1.90, 3.66, 7.22],
                         "layer_memory_mb": [2895, 2685, 2485, 2295, 2110, 1933, 1769, 1647],
                         "embedding_memory_mb": 600, "reserved_memory_mb": 4700, "safety_margin_mb": 4096}}
    d["planner"] = {"objective": objective}
    return Scenario.from_dict(d, source=f"bench:{num_devices}")


def draw_rates(num_devices: int, rng: random.Random) -> dict[int, float]:
    rates = {}
    for block in range(0, num_devices, 16):
        for dev in rng.sample(range(block, min(block + 16, num_devices)), rng.randint(1, 3)):
            rates[dev] = rng.choice(RATES)
    return rates


@dataclass
class Case:
    devices: int
    seed: int
    stragglers: int
    ideal: float
    objectives: dict[str, float]
    seconds: dict[str, float]
    simulated: dict[str, float] = field(default_factory=dict)   # authors, malleus, reference: iteration t0


def run_case(num_devices: int, seed: int, objective: str = "paper") -> Case:
    from malleus_svc.planner import authors_plan, baseline_plan, evaluate, plan, plan_without_split, rebalance_data

    scenario = scenario_for(num_devices, objective)
    rates = draw_rates(num_devices, random.Random(seed))
    problem = build_problem(scenario, rates=rates)
    healthy = build_problem(scenario, rates={})
    objectives, seconds = {}, {}

    def timed(name, fn):
        t = time.perf_counter()
        value = fn()
        seconds[name] = time.perf_counter() - t
        objectives[name] = value

    base = baseline_plan(problem)
    timed("unchanged", lambda: evaluate(problem, base))
    timed("data-only", lambda: evaluate(problem, rebalance_data(problem, base)))
    timed("no-split", lambda: plan_without_split(problem).objective)
    plans = {}

    def planned(name, result):
        plans[name] = result.plan
        return result.objective
    timed("authors", lambda: planned("authors", authors_plan(problem)))
    timed("malleus", lambda: planned("malleus", plan(problem)))
    if num_devices <= EXHAUSTIVE_DEVICES:
        timed("reference", lambda: planned("reference", plan(replace(problem, search="exhaustive"))))
    ideal = evaluate(healthy, baseline_plan(healthy))
    simulated = {name: simulate(p, problem).iteration_t0 for name, p in plans.items()}
    return Case(num_devices, seed, len(rates), ideal, objectives, seconds, simulated)


def scenario_table(cases: list[Case]) -> str:
    """Per scenario: objective and simulated iteration time (t0) of ours, the authors' and the reference."""
    head = ("| devices | seed | malleus objective | malleus simulated | authors objective | authors simulated | "
            "reference objective | reference simulated | malleus / reference (objective) | (simulated) |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for c in cases:
        o, sim = c.objectives, c.simulated
        ref = (f"{o['reference']:.1f} | {sim['reference']:.1f} | {o['malleus'] / o['reference']:.3f} | "
               f"{sim['malleus'] / sim['reference']:.3f}") if "reference" in o else "— | — | — | —"
        rows.append(f"| {c.devices} | {c.seed} | {o['malleus']:.1f} | {sim['malleus']:.1f} | {o['authors']:.1f} | "
                    f"{sim['authors']:.1f} | {ref} |")
    return "\n".join(rows)


def small_table(count: int) -> str:
    """`count` random small scenarios per objective: how often the default search is within 1% of
    the exhaustive optimum, and the worst gap."""
    from malleus_svc.planner import InfeasibleError, plan
    from malleus_svc.planner.exhaustive import EXACT_OBJECTIVES, optimum

    from benchmarks.small_problems import random_problem

    rows = ["| objective | scenarios (feasible) | default within 1% of exhaustive | worst gap | default s (mean / max) "
            "| exhaustive check stopped at its node limit | exhaustive s (mean) |",
            "|---|---|---|---|---|---|---|"]
    for objective in EXACT_OBJECTIVES:
        rng = random.Random(f"small-{objective}")
        gaps, seconds, planning, stopped = [], [], [], 0
        for _ in range(count):
            problem = random_problem(rng, objective)
            t = time.perf_counter()
            try:
                result = plan(problem)
            except InfeasibleError:
                continue
            planning.append(time.perf_counter() - t)
            stopped += any("exhaustive check" in note for note in result.notes)
            t = time.perf_counter()
            found = optimum(problem, result.objective * (1 + 1e-6))
            seconds.append(time.perf_counter() - t)
            gaps.append(result.objective / found.objective - 1 if found else 0.0)
        rows.append(f"| {objective} | {count} ({len(gaps)}) | {sum(g <= 0.01 for g in gaps)} | "
                    f"{max(gaps, default=0):+.2%} | {statistics.mean(planning) if planning else 0:.2f} / "
                    f"{max(planning, default=0):.2f} | {stopped} | {statistics.mean(seconds) if seconds else 0:.2f} |")
    return "\n".join(rows)


def replan_table(sizes: list[int], seeds: int, objective: str, budget: float) -> str:
    """Per case: the job's re-plan after one more device slows down to 3x, planned from the plan in
    force, with no budget and with `budget` seconds (`planner.time_budget_s`)."""
    from malleus_svc.planner import plan

    rows = [f"| devices | seed | re-plan s | objective | re-plan s, {budget:g} s budget | objective | gap |",
            "|---|---|---|---|---|---|---|"]
    for n in sizes:
        for seed in range(seeds):
            rng = random.Random(seed)
            rates = draw_rates(n, rng)
            scenario = scenario_for(n, objective)
            current = plan(build_problem(scenario, rates=rates)).plan
            rates[rng.choice([d for d in range(n) if d not in rates])] = 3.0
            problem = build_problem(scenario, rates=rates)
            runs = []
            for p in (problem, replace(problem, time_budget_s=budget)):
                t = time.perf_counter()
                result = plan(p, previous=current)
                runs.append((time.perf_counter() - t, result))
            (s0, a), (s1, b) = runs
            rows.append(f"| {n} | {seed} | {s0:.2f} | {a.objective:.1f} | {s1:.2f} | {b.objective:.1f} | "
                        f"{b.objective / a.objective - 1:+.2%} |")
    return "\n".join(rows)


def table(cases: list[Case]) -> str:
    head = ("| devices | cases | stragglers | ideal (t0) | " + " | ".join(f"{s} / ideal" for s in SYSTEMS)
            + " | malleus ≤ authors | malleus solve s (mean / max) | authors solve s (mean) |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for n in sorted({c.devices for c in cases}):
        cs = [c for c in cases if c.devices == n]
        ratio = {s: statistics.mean(c.objectives[s] / c.ideal for c in cs) for s in SYSTEMS}
        never_worse = sum(c.objectives["malleus"] <= c.objectives["authors"] * (1 + 1e-9) for c in cs)
        ms = [c.seconds["malleus"] for c in cs]
        rows.append(f"| {n} | {len(cs)} | {statistics.mean(c.stragglers for c in cs):.1f} | "
                    f"{statistics.mean(c.ideal for c in cs):.0f} | "
                    + " | ".join(f"{ratio[s]:.3f}" for s in SYSTEMS)
                    + f" | {never_worse}/{len(cs)} | {statistics.mean(ms):.3f} / {max(ms):.3f} | "
                    f"{statistics.mean(c.seconds['authors'] for c in cs):.3f} |")
    return "\n".join(rows)


def plot(cases: list[Case], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({c.devices for c in cases})
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for s in SYSTEMS:
        ax1.plot(sizes, [statistics.mean(c.objectives[s] / c.ideal for c in cases if c.devices == n) for n in sizes],
                 marker="o", label=s)
    ax1.set(xscale="log", yscale="log", xlabel="devices", ylabel="iteration time / straggler-free",
            title="Plan quality under 1-3 stragglers per 16 devices")
    ax1.set_xticks(sizes, [str(n) for n in sizes])
    ax1.legend()
    for s in ("authors", "malleus"):
        ax2.plot(sizes, [max(c.seconds[s] for c in cases if c.devices == n) for n in sizes], marker="o", label=f"{s} (max)")
    ax2.set(xscale="log", yscale="log", xlabel="devices", ylabel="planning seconds",
            title=f"Planning time ({os.cpu_count()}-core machine)")
    ax2.set_xticks(sizes, [str(n) for n in sizes])
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_section(markdown: str, path: Path, marker: str) -> None:
    """Replace the text between <!-- marker --> and <!-- /marker --> in `path` (append if absent)."""
    start, end = f"<!-- {marker} -->", f"<!-- /{marker} -->"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    block = f"{start}\n{markdown}\n{end}"
    if start in text and end in text:
        text = text[:text.index(start)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)


def parse_sizes(ap: argparse.ArgumentParser, text: str) -> list[int]:
    """`--sizes`: cluster sizes `scenario_for` can build (16, or multiples of 32), else the parser's error."""
    try:
        sizes = [int(x) for x in text.split(",") if x]
    except ValueError:
        ap.error(f"--sizes must be comma-separated integers, got {text!r}")
    for n in sizes:
        if n != 16 and (n < 32 or n % 32):
            ap.error(f"--sizes: {n} is not 16 or a multiple of 32 (DP x TP8 x PP4 layouts)")
    return sizes


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="malleus bench planner", description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="16,64,256,1024", help="cluster sizes (devices, 8 per node)")
    ap.add_argument("--seeds", type=int, default=5, help="random straggler situations per size")
    ap.add_argument("--write", metavar="MD", help="update this markdown file's planner section (e.g. BENCHMARKS.md)")
    ap.add_argument("--plot", metavar="PNG", help="write a plot of quality and planning time")
    ap.add_argument("--objective", choices=OBJECTIVES, default="paper",
                    help="the objective every system is planned and scored under (default: paper, the authors'); "
                         "another one writes a section of its own")
    ap.add_argument("--small", type=int, default=0, metavar="N",
                    help="also N random small scenarios per objective against exhaustive search")
    number_option(ap, "--replan", 0.001, MAX_SECONDS, default=None, metavar="S",
                  help="also each case's re-plan after one more device slows down, unbounded and within S seconds")
    args = ap.parse_args(argv)
    sizes = parse_sizes(ap, args.sizes)
    cases = []
    for n in sizes:
        for seed in range(args.seeds):
            c = run_case(n, seed, args.objective)
            cases.append(c)
            print(f"[{len(cases)}/{len(sizes) * args.seeds}] {n} devices, seed {seed}: malleus "
                  f"{c.objectives['malleus'] / c.ideal:.3f}x ideal in {c.seconds['malleus']:.2f} s, authors "
                  f"{c.objectives['authors'] / c.ideal:.3f}x in {c.seconds['authors']:.2f} s", file=sys.stderr, flush=True)
    md = table(cases) + f"\n\nPer scenario (objective '{args.objective}', t0 units; simulated: one 1F1B iteration in the event " \
        "simulator; reference: exhaustive search at 16 devices):\n\n" + scenario_table(cases)
    if args.small:
        md += (f"\n\nRandom small scenarios (benchmarks/small_problems.py, {args.small} per objective), default "
               f"search against exhaustive search:\n\n" + small_table(args.small))
    if args.replan is not None:
        md += (f"\n\nA running job's re-plan (one more device at 3x, from the plan in force), with no budget "
               f"and with {args.replan:g} s:\n\n" + replan_table(sizes, args.seeds, args.objective, args.replan))
    print(md)
    if args.plot:
        plot(cases, Path(args.plot))
        print(f"wrote {args.plot}", file=sys.stderr)
    if args.write:
        cmd = "malleus bench planner " + " ".join(argv)
        stamp = time.strftime("%Y-%m-%d")
        write_section(f"Command: `{cmd.strip()}` — {stamp}, {os.cpu_count()}-core CPU machine, one process.\n\n{md}",
                      Path(args.write), "bench:planner" + ("" if args.objective == "paper" else f"-{args.objective}"))
    return 0
