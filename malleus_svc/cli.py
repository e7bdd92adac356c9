"""`malleus` command line: plan, memory, export, prepare-data, train, demo, simulate, bench; submit, status, replan, rates, stop.

Every user error (bad scenario, bad plan file, infeasible problem, unknown job, refused request,
unreachable cluster) ends with one clear line on stderr and exit code 2, never a traceback.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import sys
from pathlib import Path

from .config import ConfigError, validate_rates
from .config.job import load_scenario_of
from .config.locations import location
from .config.options import output_file_option
from .config.scenario import DEFAULT_OBJECTIVE, OBJECTIVES, bundled_names, find_scenario, parse_rate_assignments
from .plan import Plan, PlanError
from .service import commands
from .planner.build import build_problem


def _scenario_path(name: str) -> Path:
    path = find_scenario(name)
    if path is None:
        raise ConfigError("scenario", name, f"no such file, and not a bundled scenario ({', '.join(bundled_names())})")
    return path


def _load_scenario(args: argparse.Namespace):
    """The scenario the command names, with the optimizer sharded where `--shard-optimizer` asks."""
    scenario = load_scenario_of(_scenario_path(args.scenario))
    return dataclasses.replace(scenario, shard_optimizer=True) if args.shard_optimizer else scenario


def cmd_plan(args: argparse.Namespace) -> int:
    from .planner import plan as make_plan
    from .planner.describe import migration_summary, plan_table, summary_line

    scenario = _load_scenario(args)
    rates = dict(scenario.rates)
    rates.update(validate_rates(parse_rate_assignments(args.rate, "--rate"), scenario.num_devices, field_name="--rate"))
    overrides = {"objective": args.objective} if args.objective else {}
    problem = build_problem(scenario, rates=rates, **overrides)
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
    for note in result.notes:       # where the search stopped short, and why
        print(f"note: {note}")
    if previous is not None:
        print(migration_summary(previous, plan, problem.state_sizes))
    if args.output:
        plan.save(args.output)
        print(f"wrote {args.output}")
    if args.json:
        print(plan.to_json())
    return 0


def cmd_memory(args: argparse.Namespace) -> int:
    from .planner import plan as make_plan
    from .service.memory import measured_profile, print_memory

    scenario = _load_scenario(args)
    if args.profile and scenario.shape is not None:
        layer_mb, embedding_mb = measured_profile(scenario)
        print(f"  layer_memory_mb: {layer_mb}\n  embedding_memory_mb: {embedding_mb}")
        return 0
    plan = Plan.load(args.plan) if args.plan else None
    if plan is None and scenario.shape is not None:
        plan = make_plan(build_problem(scenario)).plan
    return print_memory(scenario, plan, args.json)


def cmd_export(args: argparse.Namespace) -> int:
    from .checkpoint import CheckpointError
    from .checkpoint.hf import export_checkpoint

    try:
        out = location(args.out_dir)
    except ValueError as e:
        raise ConfigError("out_dir", args.out_dir, str(e)) from None
    if isinstance(out, Path) and out.exists() and not out.is_dir():
        raise ConfigError("out_dir", args.out_dir, "a folder to write (or to create), not a file")
    try:
        out, shape, step = export_checkpoint(args.checkpoint, out)
    except CheckpointError as e:
        raise ConfigError("checkpoint", args.checkpoint, e.reason) from None
    except OSError as e:       # the destination: a permission, a full disk, an unreachable store
        raise ConfigError("out_dir", args.out_dir, f"cannot be written: {e}") from None
    print(f"exported step {step} of a {shape.layers}-layer model ({shape.hidden} hidden, vocab {shape.vocab}) to "
          f"{out}: config.json and model.safetensors for transformers' LlamaForCausalLM")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from . import train

    return train.main(args.rest)


def cmd_prepare_data(args: argparse.Namespace) -> int:
    from . import prepare_data

    return prepare_data.main(args.rest)


def cmd_demo(args: argparse.Namespace) -> int:
    from .control.demo import run_demo

    return run_demo(args.rest)


def cmd_simulate(args: argparse.Namespace) -> int:
    from .simulate import simulate_cli

    return simulate_cli(args.rest)


def cmd_submit(args: argparse.Namespace) -> int:
    from .service.submit import follow, submit

    sid, name = submit(args.config, address=args.address, working_dir=args.working_dir, train_args=args.train_args,
                       submission_id=args.submission_id, python=args.python)
    print(sid)
    print(f"submitted malleus job {name!r} as Ray job {sid}; `malleus status {name}` (or {sid}) talks to it",
          file=sys.stderr)
    if not args.follow:
        return 0
    status = follow(args.address, sid)
    print(f"Ray job {sid}: {status}", file=sys.stderr)
    return 0 if status == "SUCCEEDED" else 1


def _benchmarks():
    """The `benchmarks` package of a source checkout: the folder next to this package (a clone or an
    editable install), else one on sys.path; None in a wheel install, which does not ship it."""
    module = sys.modules.get("benchmarks")
    init = Path(__file__).resolve().parent.parent / "benchmarks" / "__init__.py"
    if module is None and init.is_file():
        spec = importlib.util.spec_from_file_location("benchmarks", init, submodule_search_locations=[str(init.parent)])
        module = importlib.util.module_from_spec(spec)
        sys.modules["benchmarks"] = module
        spec.loader.exec_module(module)
    elif module is None:
        try:
            module = importlib.import_module("benchmarks")
        except ModuleNotFoundError as e:
            if e.name != "benchmarks":
                raise
    # A folder named benchmarks that is not this package (data only, another project's) does not count.
    return module if callable(getattr(module, "main", None)) else None


def cmd_bench(args: argparse.Namespace) -> int:
    benchmarks = _benchmarks()
    if benchmarks is None:
        print("malleus: error: benchmarks need a source checkout (git clone, then run `malleus bench` from it or "
              "`pip install -e .`); this install has the malleus_svc package only", file=sys.stderr)
        return 2
    return benchmarks.main(args.rest)


def _shard_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shard-optimizer", action="store_true", help="as if the scenario's parallel.shard_optimizer "
                   "were true: Adam's moments split among the pipelines holding each piece (ZeRO-1)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="malleus", description="Straggler-resilient hybrid-parallel training on Ray.")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="plan a scenario (YAML/JSON) and print/write the plan")
    p.add_argument("scenario", help="scenario or job file, or a bundled scenario name: "
                   + ", ".join(bundled_names()))
    p.add_argument("--previous", help="the plan in force now (JSON); prefer plans that move little state from it")
    output_file_option(p, "-o", "--output", help="write the plan as JSON here")
    p.add_argument("--rate", action="append", default=[], metavar="DEVICE=RATE", help="override a straggling rate")
    p.add_argument("--objective", choices=OBJECTIVES,
                   help=f"override the scenario's objective (default: the scenario's, else {DEFAULT_OBJECTIVE})")
    p.add_argument("--json", action="store_true", help="also print the plan JSON")
    _shard_option(p)
    p.set_defaults(func=cmd_plan)

    m = sub.add_parser("memory", help="per-device peak memory of a plan, measured on the modules built on the "
                       "meta device, beside the planner's memory model (exit 1 if a device is over)")
    m.add_argument("scenario", help="scenario or job file, or a bundled scenario name")
    m.add_argument("--plan", help="the plan (JSON) to measure; default: plan the scenario as `malleus plan` does")
    m.add_argument("--json", action="store_true", help="also print the rows as JSON")
    m.add_argument("--profile", action="store_true", help="print measured layer_memory_mb and embedding_memory_mb "
                   "for the scenario's profile: instead of the table")
    _shard_option(m)
    m.set_defaults(func=cmd_memory)

    e = sub.add_parser("export", help="a checkpoint as a Hugging Face LLaMA folder (config.json + model.safetensors)")
    e.add_argument("checkpoint", help="a checkpoint's step-XXXXXXXX directory, or a job's checkpoint dir (the newest)")
    e.add_argument("out_dir", help="the folder to write; `model: {from_pretrained: OUT_DIR}` starts a job from it")
    e.set_defaults(func=cmd_export)

    for name, (_, text) in PASS_THROUGH.items():   # listed in the help; main() hands them their arguments
        sub.add_parser(name, help=text, add_help=False)

    j = sub.add_parser("submit", help="submit a training job through the Ray Jobs API; prints the submission id")
    j.add_argument("config", help="job file, inside --working-dir")
    j.add_argument("--address", default=None, help="Ray dashboard address, e.g. http://head:8265 "
                   "(default: RAY_API_SERVER_ADDRESS / RAY_ADDRESS / the local cluster)")
    j.add_argument("--working-dir", default=".", help="uploaded as the job's working dir (default: .)")
    j.add_argument("--submission-id", default=None, help="the Ray job's submission id (default: Ray picks one)")
    j.add_argument("--python", default="python", help="interpreter on the cluster (default: python)")
    j.add_argument("--follow", action="store_true", help="stream the job's logs until it ends; exit 0 on success")
    j.set_defaults(func=cmd_submit, train_args=[])   # after `--`: arguments for malleus_svc.train (main())
    commands.add_parsers(sub)
    return ap


# Commands with their own argument parsers: everything after the name is theirs (--help included).
PASS_THROUGH = {
    "train": (cmd_train, "train under a plan on a Ray cluster (same as python -m malleus_svc.train)"),
    "prepare-data": (cmd_prepare_data, "tokenize text, JSON lines or Parquet files into a corpus a job trains on "
                                       "(malleus prepare-data --help)"),
    "demo": (cmd_demo, "the main job: 8 CPU workers, stragglers come and go, live view and summary (malleus demo --help)"),
    "simulate": (cmd_simulate, "iteration time and memory of a scenario's plans under the simulator "
                               "(malleus simulate SCENARIO --help)"),
    "bench": (cmd_bench, "benchmarks that print tables and write BENCHMARKS.md rows, from a source checkout "
                         "(malleus bench --help)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in PASS_THROUGH:
        args = argparse.Namespace(rest=argv[1:], func=PASS_THROUGH[argv[0]][0])
    elif argv and argv[0] == "submit" and "--" in argv:
        # malleus submit CONFIG [options] -- TRAIN ARGS: what follows `--` goes to malleus_svc.train untouched
        cut = argv.index("--")
        args = build_parser().parse_args(argv[:cut])
        args.train_args = argv[cut + 1:]
    else:
        args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, PlanError, ConnectionError) as e:
        print(f"malleus: error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        # The planner's InfeasibleError and the client's MalleusError are ValueErrors whose messages
        # say why and what would help.
        kind = type(e).__name__
        if kind in ("InfeasibleError", "MalleusError"):
            print(f"malleus: {'infeasible' if kind == 'InfeasibleError' else 'error'}: {e}", file=sys.stderr)
            return 2
        raise
    except Exception as e:
        if type(e).__name__ == "AuthenticationError":  # ray.exceptions: refused on a request after connecting
            from .service.ray_auth import from_ray
            print(f"malleus: error: {from_ray(e)}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
