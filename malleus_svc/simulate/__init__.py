"""Iteration time and memory of plans under true straggling rates; baselines; scenarios; traces.

    from malleus_svc.simulate import simulate, memory_report, make_systems, run_trace
    sim = simulate(plan, problem, rates=true_rates)        # one 1F1B iteration, event by event
    sim.iteration_seconds, memory_report(plan, problem, sim).oom

`simulate_cli(argv)` backs `malleus simulate SCENARIO`: it plans the scenario with the chosen
system(s), simulates one iteration under the scenario's rates and prints per-pipeline and
per-stage results. The simulator asks the planner for the plans it compares and for the check of a
plan file against the scenario; it knows nothing of Ray or torch.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import get_args

from ..geometry import one_f_one_b
from .baselines import SYSTEMS, Costs, Decision, System, make_systems, migration_seconds, restart_plan
from .memory import MemoryReport, StageMemory, memory_report
from .timeline import MAX_SIMULATED_OPS, P2PMode, SimOptions, SimResult, SimulationError, simulate, simulated_ops
from .trace import IterationClock, Phase, Trace, TraceResult, run_trace, trace_from_dict
from ..config.scenario import bundled_names, find_scenario, parse_rate_assignments
from ..planner.build import build_problem
from ..planner.describe import ranges

__all__ = ["SYSTEMS", "Costs", "Decision", "System", "make_systems", "migration_seconds", "restart_plan",
           "MemoryReport", "StageMemory", "memory_report", "SimOptions", "SimResult", "SimulationError",
           "one_f_one_b", "simulate", "IterationClock", "Phase", "Trace", "TraceResult", "run_trace",
           "trace_from_dict", "simulate_cli", "load_any_scenario"]

def load_any_scenario(name: str):
    """A scenario file, a bundled scenario name, or a paper grid entry 'SETUP/SITUATION'
    (e.g. '70b-64gpu/severe')."""
    from ..config import ConfigError, load_scenario
    from .scenarios import SETUPS, SITUATIONS, paper_scenario

    path = find_scenario(name)
    if path is not None:
        return load_scenario(path)
    setup, _, situation = name.partition("/")
    if setup in SETUPS:
        return paper_scenario(setup, situation or "healthy")
    known = bundled_names() + [f"{s}/{{{','.join(SITUATIONS)}}}" for s in SETUPS]
    raise ConfigError("scenario", name, f"no such file, bundled scenario or grid entry (known: {', '.join(known)})")


def _describe(name: str, decision: Decision, sim: SimResult, mem: MemoryReport, verbose: bool) -> list[str]:
    plan = decision.plan
    out = [f"== {name}: plan {plan.plan_id}, iteration {sim.iteration_seconds:.3f} s ({sim.iteration_t0:.1f} t0), "
           f"{plan.global_batch / sim.iteration_seconds:.2f} samples/s, peak memory {mem.peak_mb / 1024:.1f} GiB"
           + (f", OOM on {len(mem.oom)} stage(s)" if mem.oom else "")
           + (f", {len(mem.over_budget)} stage(s) inside the safety margin" if mem.over_budget and not mem.oom else "")
           + (f"; {decision.note}" if decision.note else "")]
    if plan.suspended:
        out.append(f"   suspended devices: {list(plan.suspended)}")
    mems = {(m.pipeline, m.stage): m for m in mem.stages}
    for i, (pipe, pres) in enumerate(zip(plan.pipelines, sim.pipelines)):
        busy = sum(s.busy for s in pres.stages) / (len(pres.stages) * pres.compute_end)
        out.append(f"   pipeline {i}: {pipe.micro_batches} micro-batches, {len(pipe.stages)} stages, compute ends "
                   f"{pres.compute_end:.1f} t0, gradients reduced and stepped by {pres.end:.1f} t0, "
                   f"stages busy {100 * busy:.0f}% of the compute span")
        if not verbose:
            continue
        out.append("     stage | devices | blocks | rate | t0/mb | busy t0 | sync [start, end] | in flight | peak GiB")
        for s in pres.stages:
            m = mems[(i, s.stage)]
            flag = " OOM" if m in mem.oom else (" (margin)" if m in mem.over_budget else "")
            devs = ranges(s.devices)
            out.append(f"     {s.stage:>5} | {devs:>7} | {s.layers[1] - s.layers[0]:>6} | {s.rate:4.2f} | "
                       f"{s.compute_per_mb:5.1f} | {s.busy:7.1f} | [{s.sync_start:.1f}, {s.sync_end:.1f}] | "
                       f"{m.in_flight:>9} | {m.peak_mb / 1024:6.1f}{flag}")
    return out


def _check_ops(ops: int, scenario) -> None:
    from ..config import ConfigError
    if ops > MAX_SIMULATED_OPS:
        raise ConfigError("batch.global", scenario.global_batch,
                          f"a batch this command simulates in at most {MAX_SIMULATED_OPS:,} forward and backward ops "
                          f"(a plan needs {ops:,}); steady-state time scales with the batch, so simulate a smaller one")


def simulate_cli(argv: list[str]) -> int:
    """`malleus simulate SCENARIO [--system NAME|all] [--rate D=X ...] [--plan FILE]`."""
    from ..config import ConfigError, validate_rates
    from ..config.options import number_option
    from ..costmodel.profile import BACKWARD_RATIO
    from ..plan import Plan, PlanError
    from ..planner.search import check_plan_fits

    ap = argparse.ArgumentParser(prog="malleus simulate", description=__doc__.split("\n")[0])
    ap.add_argument("scenario", help="scenario file, bundled name, or grid entry such as 70b-64gpu/severe")
    ap.add_argument("--system", default="malleus", choices=(*SYSTEMS, "all"),
                    help="whose plan to simulate (default malleus; 'all' compares every system)")
    ap.add_argument("--rate", action="append", default=[], metavar="D=X", help="override a device's true rate")
    ap.add_argument("--plan", metavar="FILE", help="simulate this plan file instead of planning")
    ap.add_argument("--p2p", choices=get_args(P2PMode), default=SimOptions.p2p)
    number_option(ap, "--backward-ratio", 0.01, 100, default=BACKWARD_RATIO,
                  help=f"backward time / forward time (default {BACKWARD_RATIO:g})")
    ap.add_argument("--brief", action="store_true", help="pipelines only, no per-stage rows")
    ap.add_argument("--json", action="store_true", help="also print a JSON summary")
    args = ap.parse_args(argv)
    try:
        scenario = load_any_scenario(args.scenario)
        rates = dict(scenario.rates)
        rates.update(validate_rates(parse_rate_assignments(args.rate, "--rate"), scenario.num_devices, field_name="--rate"))
        problem = build_problem(scenario, rates=rates)
        options = SimOptions(backward_ratio=args.backward_ratio, p2p=args.p2p)
        # Before planning: the baselines simulate plans of the scenario's depth while they decide.
        _check_ops(2 * problem.num_micro_batches * scenario.pp, scenario)
        if args.plan:
            plan = check_plan_fits(problem, Plan.load(args.plan), f"--plan {args.plan}")
            decisions = [("plan file", Decision(plan))]
        else:
            names = SYSTEMS if args.system == "all" else (args.system,)
            base = make_systems(names=("static",))[0].decide(problem, None).plan
            decisions = [(s.name, s.decide(problem, None if s.name == "static" else base))
                         for s in make_systems(Costs(), options, names)]
        _check_ops(max(simulated_ops(dec.plan) for _, dec in decisions), scenario)
        print(f"{scenario.name}: {scenario.num_devices} devices, {scenario.num_layers} blocks, "
              f"{scenario.num_micro_batches} micro-batches; true rates "
              f"{ {d: x for d, x in sorted(rates.items()) if x != 1.0} or 'all 1.0'}; t0 = {problem.t0_seconds * 1e3:.1f} ms; "
              f"p2p {options.p2p}, backward = {options.backward_ratio:g} x forward")
        summary = []
        for name, dec in decisions:
            sim = simulate(dec.plan, problem, options=options)
            mem = memory_report(dec.plan, problem, sim)
            print("\n".join(_describe(name, dec, sim, mem, not args.brief)))
            summary.append({"system": name, "plan_id": dec.plan.plan_id, "iteration_seconds": sim.iteration_seconds,
                            "samples_per_second": dec.plan.global_batch / sim.iteration_seconds,
                            "peak_memory_mb": mem.peak_mb, "oom_stages": len(mem.oom),
                            "planning_seconds": dec.planning_seconds, "switch_stall_seconds": dec.stall_seconds})
        if args.json:
            print(json.dumps(summary, indent=2))
    except (ConfigError, PlanError, ValueError) as e:
        print(f"malleus simulate: {e}", file=sys.stderr)
        return 2
    return 0
