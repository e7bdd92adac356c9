"""`malleus bench planner-reference`: the default search against a stronger, slower one, 32 to 256 devices.

Random scenarios shaped like the paper's (`paper_shaped`): nodes of 8 devices, DP x TP8 x PP4 with
DP = devices / 32, global batch 32 x DP of micro-batch 1, 1-4 stragglers per 32 devices at rates
drawn uniformly from [1.25, 7], a 70B or 110B model. Memory is the authors' 70B rows (their
planner input, as in `malleus bench planner`); the 110B model's rows are those x 1.45 (a heavier
block that still fits the baseline layout).

The reference is the planner's simulated annealing over concrete plans (`planner.anneal`: every
grouping of each node that holds a straggler, any group in any pipeline or idle, pipelines merged
and split, each pipeline's stages in their best order under the memory caps), which the default
search runs for ANNEAL_STEPS scored candidates from its best organisation (ANNEAL_CHAINS runs under
'paper' and 'bubble', seeds 0, 1, ...): here `--restarts` runs from the default plan and one from
the healthy baseline's groups, `--steps` each, other seeds (no clock: the same seeds give the same
plans). Its best plan is valued by `planner.evaluate` and checked against the memory model like the
default's. Healthy nodes keep their full groups in both: under 'paper' splitting them too can beat
even the straggler-free plan (a TP1 block takes 7.22 t0 on 1 device, a TP8 one 1 t0 on 8), a
reshaping of the whole cluster the planner does not make for a straggler.
Also shown: the capacity bound (`capacity_bound`), which no plan of that space beats.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from malleus_svc.config import Scenario
from malleus_svc.config.options import number_option
from malleus_svc.config.scenario import OBJECTIVES
from malleus_svc.plan import Plan
from malleus_svc.planner import baseline_plan, evaluate, plan
from malleus_svc.planner.build import build_problem
from malleus_svc.planner.grouping import Group, available_devices, make_group
from malleus_svc.planner.organize import Scorer
from malleus_svc.planner.problem import PlannerProblem
from malleus_svc.planner.anneal import Anneal, irregular_nodes, regroup_options
from malleus_svc.planner.search import ANNEAL_CHAINS, assemble, lower_bound, max_pipelines, memory_violations

from .planner import write_section

AUTHORS_70B_ROWS = (2895, 2685, 2485, 2295, 2110, 1933, 1769, 1647)   # MB per block, 8..1 micro-batches in flight
HEAVIER_110B = 1.45
NEAR = 0.01          # "within 1% of the reference"


def paper_shaped(num_devices: int, seed: int, objective: str) -> tuple[PlannerProblem, str]:
    """One random scenario (module docstring) and a line that describes it."""
    rng = random.Random(f"reference-{num_devices}-{seed}")
    model = rng.choice(("llama-70b", "llama-110b"))
    scale = 1.0 if model == "llama-70b" else HEAVIER_110B
    dp = num_devices // 32
    scenario = Scenario.from_dict({
        "cluster": {"nodes": num_devices // 8, "gpus_per_node": 8, "gpu_memory_mb": 81252}, "model": model,
        "parallel": {"dp": dp, "tp": 8, "pp": 4}, "batch": {"global": 32 * dp, "micro": 1},
        "profile": {"tp_alpha": [1, 1.90, 3.66, 7.22], "layer_memory_mb": [round(m * scale) for m in AUTHORS_70B_ROWS],
                    "embedding_memory_mb": 600, "reserved_memory_mb": 4700, "safety_margin_mb": 4096},
        "planner": {"objective": objective}}, source=f"bench:reference-{num_devices}-{seed}")
    rates = {}
    for block in range(0, num_devices, 32):
        for d in rng.sample(range(block, block + 32), rng.randint(1, 4)):
            rates[d] = round(rng.uniform(1.25, 7.0), 2)
    return build_problem(scenario, rates=rates), f"{model}, stragglers {rates}"


def capacity_bound(problem: PlannerProblem) -> float:
    """No plan of the space searched beats M·L over the most capacity Σ 1/y its groupings give:
    `regroup_options` of a node holding a straggler, full groups of a healthy one."""
    irregular = set(irregular_nodes(problem))
    capacity = sum(max(o.capacity for o in regroup_options(problem, n)) if n in irregular
                   else len(available_devices(problem, n)) // problem.tp for n in range(problem.num_nodes))
    return lower_bound(problem, capacity)


def reference(problem: PlannerProblem, default_plan: Plan, steps: int, restarts: int) -> tuple[float, Plan]:
    """The best plan of `restarts` annealing runs from the default plan and one from the baseline's groups."""
    def rows_of(p: Plan) -> list[list[Group]]:
        return [[make_group(problem, s.devices) for s in pipe.stages] for pipe in p.pipelines]

    def idle_of(rows: list[list[Group]]) -> list[Group]:
        """The unused devices of the nodes the annealing regroups, as idle single-device groups."""
        used = {d for row in rows for g in row for d in g.devices}
        return [make_group(problem, (d,)) for n in irregular for d in available_devices(problem, n) if d not in used]

    scorer = Scorer(problem)
    irregular = irregular_nodes(problem)
    best_value, best_plan = evaluate(problem, default_plan), default_plan
    starts = [rows_of(default_plan)] * restarts + [rows_of(baseline_plan(problem))]
    for seed, rows in enumerate(starts, start=ANNEAL_CHAINS):    # the seeds below are the default search's own
        org = Anneal(problem, scorer, seed, max_pipelines(problem), irregular).run(rows, idle_of(rows), steps)
        if org is None:
            continue
        p = assemble(problem, org.rows, org.score.layers, org.score.micro_batches)
        value = evaluate(problem, p)
        if value < best_value * (1 - 1e-9) and not memory_violations(problem, p):
            best_value, best_plan = value, p
    return best_value, best_plan


def scaled_steps(steps: int, num_devices: int) -> int:
    """`--steps` up to 64 devices, 64/devices of it beyond: a candidate there has more pipelines."""
    return max(1, steps * 64 // max(64, num_devices))


@dataclass
class Row:
    devices: int
    seed: int
    objective: str
    what: str
    default: float
    reference: float
    bound: float
    seconds: float
    reference_seconds: float

    @property
    def gap(self) -> float:
        return self.default / self.reference - 1


def run(num_devices: int, seed: int, objective: str, steps: int, restarts: int) -> Row:
    problem, what = paper_shaped(num_devices, seed, objective)
    t = time.perf_counter()
    result = plan(problem)
    seconds = time.perf_counter() - t
    t = time.perf_counter()
    value, _ = reference(problem, result.plan, scaled_steps(steps, num_devices), restarts)
    return Row(num_devices, seed, objective, what, result.objective, value, capacity_bound(problem), seconds,
               time.perf_counter() - t)


def table(rows: list[Row]) -> str:
    out = ["| devices | objective | cases | default within 1% of the reference | worst gap | mean gap | "
           "default / capacity bound (mean) | default s (mean / max) | reference s (mean) |",
           "|---|---|---|---|---|---|---|---|---|"]
    for n in sorted({r.devices for r in rows}):
        for obj in sorted({r.objective for r in rows}):
            rs = [r for r in rows if r.devices == n and r.objective == obj]
            if not rs:
                continue
            gaps = [r.gap for r in rs]
            out.append(f"| {n} | {obj} | {len(rs)} | {sum(g <= NEAR for g in gaps)} | {max(gaps):+.2%} | "
                       f"{statistics.mean(gaps):+.2%} | {statistics.mean(r.default / r.bound for r in rs):.3f} | "
                       f"{statistics.mean(r.seconds for r in rs):.2f} / {max(r.seconds for r in rs):.2f} | "
                       f"{statistics.mean(r.reference_seconds for r in rs):.1f} |")
    worst = sorted(rows, key=lambda r: -r.gap)[:5]
    out += ["", "The largest gaps:", "", "| devices | objective | seed | scenario | default | reference | gap |",
            "|---|---|---|---|---|---|---|"]
    out += [f"| {r.devices} | {r.objective} | {r.seed} | {r.what} | {r.default:.1f} | {r.reference:.1f} | "
            f"{r.gap:+.2%} |"
            for r in worst]
    return "\n".join(out)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="malleus bench planner-reference", description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="32,64,256", help="cluster sizes (multiples of 32 devices)")
    number_option(ap, "--seeds", 1, 10_000, integer=True, default=10, help="random scenarios per size and objective")
    ap.add_argument("--objectives", default="paper,bubble", help="comma-separated objectives")
    number_option(ap, "--steps", 1, 10_000_000, integer=True, default=10000,
                  help="candidates each annealing run scores, up to 64 devices; 64/devices of them beyond")
    number_option(ap, "--restarts", 1, 100, integer=True, default=2,
                  help="annealing runs from the default plan (one more from the baseline's groups)")
    ap.add_argument("--write", metavar="MD", help="update this markdown file's planner-reference section")
    args = ap.parse_args(argv)
    try:
        sizes = [int(x) for x in args.sizes.split(",") if x]
    except ValueError:
        ap.error(f"--sizes must be comma-separated integers, got {args.sizes!r}")
    if not sizes or any(n < 32 or n % 32 for n in sizes):
        ap.error(f"--sizes: {args.sizes!r} must be multiples of 32 devices")
    objectives = [o for o in args.objectives.split(",") if o]
    if not objectives or set(objectives) - set(OBJECTIVES):
        ap.error(f"--objectives: {args.objectives!r} must be a comma-separated subset of {', '.join(OBJECTIVES)}")
    rows = []
    total = len(sizes) * len(objectives) * args.seeds
    for n in sizes:
        for obj in objectives:
            for seed in range(args.seeds):
                r = run(n, seed, obj, args.steps, args.restarts)
                rows.append(r)
                print(f"[{len(rows)}/{total}] {n} devices, {obj}, seed {seed} ({r.what}): default {r.default:.1f} in "
                      f"{r.seconds:.2f} s, reference {r.reference:.1f} in {r.reference_seconds:.0f} s, "
                      f"gap {r.gap:+.2%}",
                      file=sys.stderr, flush=True)
    md = table(rows)
    print(md)
    if args.write:
        cmd = "malleus bench planner-reference " + " ".join(argv)
        write_section(f"Command: `{cmd.strip()}` — {time.strftime('%Y-%m-%d')}, {os.cpu_count()}-core CPU machine, "
                      f"one process.\n\n{md}", Path(args.write), "bench:planner-reference")
    return 0
