"""Peak host memory of each process during init, a recovery, a live migration, a checkpoint and its
restore, beside the state that process owns (fp32 parameters and both Adam moments of its shards).

Four CPU workers on a local Ray cluster train a model of 8 blocks (`--layers`) under DP 2 x PP 2,
lose worker 1 (killed; its replica is worker 3) and recover, then migrate to TP 2 x PP 2, then
checkpoint (each worker writes its own pieces) and restore it (each reads its own rows). Each
process's peak is its resident high-water mark over the operation alone (procfs, reset before it)
minus what it held before, so a ratio of 1 means the operation needed one more copy of the
process's own state.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from .planner import write_section

MIB = 2 ** 20


def _plan(pipes, layers):
    from malleus_svc.plan import Pipeline, Plan, Stage

    return Plan(num_devices=4, num_layers=layers, micro_batch_size=2, gpus_per_node=4,
                pipelines=tuple(Pipeline(tuple(Stage(tuple(d), tuple(l)) for d, l in stages), m) for m, stages in pipes))



def own_state_bytes(plan, shape) -> dict[int, int]:
    """Bytes of parameters + Adam moments each device holds under `plan` (fp32), from the geometry:
    nothing is shipped to the driver to count it."""
    from math import prod

    from malleus_svc.geometry import model_parts, part_tensors

    out = {d: 0 for d in plan.roles()}
    for part in model_parts(shape.layers):
        for _, stage in plan.holders(part):
            for d in stage.devices:
                out[d] += sum(3 * 4 * prod(t.shard_shape(stage.tp)) for t in part_tensors(shape, part))
    return out


def mark(group) -> dict[int, int]:
    """Start a new peak on every worker; what each holds now."""
    return {d: m["memory_bytes"] for d, m in zip(group.live, group._each("host_memory", True))}


def peaks(group, held: dict[int, int]) -> dict[int, int]:
    """Each worker's peak since `mark`, above what it held then."""
    return {d: m["peak_memory_bytes"] - held[d] for d, m in zip(group.live, group._each("host_memory"))}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="malleus bench host-memory", description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8, help="blocks (even); e.g. --hidden 2048 --layers 16 is ~1B parameters")
    ap.add_argument("--write", metavar="MD", help="update this markdown file's host-memory section")
    args = ap.parse_args(argv)

    import ray

    from malleus_svc.checkpoint import CheckpointWriter, load_latest, restore_group, save_group
    from malleus_svc.config.presets import ModelShape
    from malleus_svc.runtime import host_memory
    from malleus_svc.runtime.cluster import WorkerGroup
    from malleus_svc.runtime.data import GlobalSampler

    layers = args.layers
    shape = ModelShape(layers=layers, hidden=args.hidden, heads=16, ffn=int(args.hidden * 2.75) // 64 * 64,
                       vocab=32_000, seq_len=64)
    half = layers // 2
    dp_pp = _plan([(2, [((0,), (0, half)), ((1,), (half, layers))]), (2, [((2,), (0, half)), ((3,), (half, layers))])],
                  layers)
    tp_pp = _plan([(4, [((0, 2), (0, half)), ((1, 3), (half, layers))])], layers)
    ray.init(address="local", num_cpus=16, include_dashboard=False, configure_logging=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parent.parent)}})
    rows = []
    try:
        with WorkerGroup(4, 4, name="bench-host-memory") as group:
            n = group.set_data({"source": "synthetic", "seq_len": 64, "num_samples": 256, "vocab": 32_000}, "pack", 64)
            sampler = GlobalSampler(n, dp_pp.global_batch, seed=0)
            print("init ...", flush=True)
            held = mark(group)
            group.apply_plan(dp_pp, shape)
            init_peak = peaks(group, held)
            group.step(sampler.next_global_batch())           # Adam moments exist from here on
            before = own_state_bytes(dp_pp, shape)
            rows += [("init (DP 2 x PP 2)", f"worker {d}", init_peak[d], before[d] // 3) for d in sorted(before)]
            print("recovery ...", flush=True)
            held = mark(group)
            ray.kill(group.workers[1])
            start = host_memory.resident()
            host_memory.reset_peak()
            report = group.recover()
            driver = host_memory.peak() - start
            assert report.lost == [1] and report.source == "replicas", report
            survived = peaks(group, held)    # the survivors (the new worker 1 started from nothing)
            rows += [("recovery of worker 1 from its replica", f"worker {d}", survived[d], before[d])
                     for d in sorted(before) if d != 1]
            rows.append(("recovery of worker 1 from its replica", "driver", driver, max(before.values())))
            print("migration ...", flush=True)
            held = mark(group)
            group.migrate(tp_pp)
            moved = peaks(group, held)
            after = own_state_bytes(tp_pp, shape)
            rows += [("migration to TP 2 x PP 2", f"worker {d}", moved[d], max(before[d], after[d]))
                     for d in sorted(after)]
            with tempfile.TemporaryDirectory() as tmp:
                for op, run in (("checkpoint (each worker writes its own pieces)",
                                 lambda: save_group(CheckpointWriter(tmp), group, sampler, 1, wait=True)),
                                ("restore of it (each worker reads its own rows)",
                                 lambda: restore_group(group, load_latest(tmp, shape), sampler))):
                    print(op, "...", flush=True)
                    held = mark(group)
                    start = host_memory.resident()
                    host_memory.reset_peak()
                    run()
                    driver = host_memory.peak() - start
                    done = peaks(group, held)
                    rows += [(op, f"worker {d}", done[d], after[d]) for d in sorted(after)]
                    rows.append((op, "driver", driver, max(after.values())))
    finally:
        ray.shutdown()
    md = ["| operation | process | peak above before, MiB | its own state, MiB | ratio |", "|---|---|---|---|---|"]
    md += [f"| {op} | {who} | {p / MIB:.0f} | {own / MIB:.0f} | {p / own:.2f} |" for op, who, p, own in rows]
    table = "\n".join(md)
    print(table)
    if args.write:
        total = sum(after.values()) / MIB
        options = "" if (args.hidden, layers) == (1024, 8) else f" --hidden {args.hidden} --layers {layers}"
        write_section(f"Command: `malleus bench host-memory{options} --write BENCHMARKS.md` — {time.strftime('%Y-%m-%d')}, "
                      f"{os.cpu_count()}-core CPU machine; {layers} blocks of hidden {args.hidden}, vocab 32,000 "
                      f"({total:.0f} MiB of parameters and Adam state in all). For init the state is the "
                      f"parameters alone (Adam's moments come with the first step). A checkpoint's files are "
                      f"written and read by the workers (the driver writes the manifest); the restore's "
                      f"driver figure includes verifying every file's sha256.\n\n{table}",
                      Path(args.write), f"bench:host-memory-{args.hidden}x{layers}" if options else "bench:host-memory")
    return 0
