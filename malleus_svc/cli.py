"""`malleus` command line: plan, train, demo, simulate, bench.

Every user error (bad scenario, bad plan file, infeasible problem) ends with one clear line on
stderr and exit code 2, never a traceback.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .config import ConfigError, load_scenario, validate_rates
from .bench import BENCHES
from .plan import Plan, PlanError

BUNDLED = Path(__file__).parent / "scenarios"


def _scenario_path(name: str) -> Path:
    """A path, or the name of a bundled scenario (with or without .yaml)."""
    p = Path(name)
    if p.exists():
        return p
    for cand in (BUNDLED / name, BUNDLED / f"{name}.yaml"):
        if cand.exists():
            return cand
    bundled = ", ".join(sorted(x.stem for x in BUNDLED.glob("*.yaml")))
    raise ConfigError("scenario", name, f"no such file, and not a bundled scenario ({bundled})")


def _parse_rate_args(items: list[str]) -> dict:
    out = {}
    for item in items:
        dev, sep, rate = item.partition("=")
        if not sep:
            raise ConfigError("--rate", item, "expected DEVICE=RATE, e.g. --rate 5=3.0")
        try:
            out[int(dev)] = float(rate)
        except ValueError:
            raise ConfigError("--rate", item, "expected an integer device and a number, e.g. --rate 5=3.0") from None
    return out


def cmd_plan(args: argparse.Namespace) -> int:
    from .planner import plan as make_plan
    from .planner.describe import diff_summary, plan_table, summary_line

    scenario = load_scenario(_scenario_path(args.scenario))
    rates = dict(scenario.rates)
    rates.update(validate_rates(_parse_rate_args(args.rate), scenario.num_devices, field_name="--rate"))
    overrides = {"objective": args.objective} if args.objective else {}
    problem = scenario.problem(rates=rates, **overrides)
    previous = Plan.load(args.previous) if args.previous else None
    if previous is not None and (previous.num_devices, previous.num_layers) != (problem.num_devices, problem.num_layers):
        raise PlanError(f"--previous plan is for {previous.num_devices} devices and {previous.num_layers} layers, "
                        f"the scenario has {problem.num_devices} and {problem.num_layers}")
    result = make_plan(problem, previous=previous)
    plan = result.plan
    print(f"plan {plan.plan_id} for {scenario.name}: {scenario.num_devices} devices, {problem.num_layers} layers, "
          f"{problem.num_micro_batches} micro-batches of {problem.micro_batch_size}")
    print(plan_table(plan, problem))
    print(summary_line(plan, result.ideal_objective, result.solve_seconds, result.candidates))
    if previous is not None:
        print(diff_summary(Plan.diff(previous, plan, problem.state_sizes)))
    if args.output:
        plan.save(args.output)
        print(f"wrote {args.output}")
    if args.json:
        print(plan.to_json())
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from . import train

    return train.main(args.rest)


def cmd_demo(args: argparse.Namespace) -> int:
    from .control.demo import run_demo

    return run_demo(args.rest)


def cmd_simulate(args: argparse.Namespace) -> int:
    from .simulate import simulate_cli

    return simulate_cli(args.rest)


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import run_bench

    return run_bench(args.what, args.rest)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="malleus", description="Straggler-resilient hybrid-parallel training on Ray.")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="plan a scenario (YAML/JSON) and print/write the plan")
    p.add_argument("scenario", help="scenario file, or a bundled scenario name: "
                   + ", ".join(sorted(x.stem for x in BUNDLED.glob("*.yaml"))))
    p.add_argument("--previous", help="the plan in force now (JSON); prefer plans that move little state from it")
    p.add_argument("-o", "--output", help="write the plan as JSON here")
    p.add_argument("--rate", action="append", default=[], metavar="DEVICE=RATE", help="override a straggling rate")
    p.add_argument("--objective", choices=("paper", "bubble", "full"), help="override the scenario's objective")
    p.add_argument("--json", action="store_true", help="also print the plan JSON")
    p.set_defaults(func=cmd_plan)

    t = sub.add_parser("train", help="train under a plan on a Ray cluster (same as python -m malleus_svc.train)",
                       add_help=False)
    t.add_argument("rest", nargs=argparse.REMAINDER)
    t.set_defaults(func=cmd_train)

    d = sub.add_parser("demo", help="the main job: 8 CPU workers, stragglers come and go, live view and summary "
                       "(malleus demo --help)", add_help=False)
    d.add_argument("rest", nargs=argparse.REMAINDER)
    d.set_defaults(func=cmd_demo)

    s = sub.add_parser("simulate", help="iteration time and memory of a scenario's plans under the simulator "
                       "(malleus simulate SCENARIO --help)", add_help=False)
    s.add_argument("rest", nargs=argparse.REMAINDER)
    s.set_defaults(func=cmd_simulate)

    b = sub.add_parser("bench", help="benchmarks that print tables and write BENCHMARKS.md rows")
    b.add_argument("what", choices=BENCHES)
    b.add_argument("rest", nargs=argparse.REMAINDER)
    b.set_defaults(func=cmd_bench)
    return ap


# Commands with their own argument parsers: everything after the name is theirs (--help included).
PASS_THROUGH = {"train": cmd_train, "demo": cmd_demo, "simulate": cmd_simulate}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in PASS_THROUGH:
        args = argparse.Namespace(rest=argv[1:], func=PASS_THROUGH[argv[0]])
    else:
        args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, PlanError) as e:
        print(f"malleus: error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        # The planner's InfeasibleError is a ValueError whose message says why and what would help.
        if type(e).__name__ == "InfeasibleError":
            print(f"malleus: infeasible: {e}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
