"""A training step with the gradient reduction behind backward against the same step with it after
backward, side by side in one run.

Two CPU processes joined by gloo (the link: TCP on this host) train one model as two data-parallel
pipelines of one stage each, each on an emulated accelerator (`device_clock.PacedClock` at
`--tflops` and `--gbps`, so that a compute op lasts its nominal time and leaves the host's cores to
the link meanwhile). The model's gradients are large against its compute, as a wide model's are on
a fast accelerator: its reduction takes a large share of the step. Runs alternate between the two
modes, `--rounds` of each, each run `--steps` steps after one to warm up. Reported per mode: the
step's median wall time, the median time the step waited for the reductions after backward (the
exposed part), and, with overlap, the share of the gradients still to come when the first bucket
was launched. `--shard` runs the distributed optimizer (reduce-scatter) instead of all-reduce.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from .planner import write_section


def _step_times(rank: int, world: int, shape, overlap: bool, shard: bool, tokens: int, steps: int,
                tflops: float, gbps: float) -> dict:
    import torch

    from malleus_svc.plan import Pipeline, Plan, Stage
    from malleus_svc.runtime.batch import MicroBatch
    from malleus_svc.runtime.device_clock import Pace, PacedClock
    from malleus_svc.runtime.engine import Engine, OptimConfig

    plan = Plan(num_devices=2, num_layers=shape.layers, micro_batch_size=1, gpus_per_node=2,
                pipelines=tuple(Pipeline((Stage((d,), (0, shape.layers)),), 1) for d in range(2)))
    clock = PacedClock(Pace(tflops * 1e12, gbps * 1e9))
    engine = Engine(shape, plan, rank, optim=OptimConfig(overlap_grad_reduce=overlap, shard_optimizer=shard),
                    clock=clock)
    g = torch.Generator().manual_seed(rank)
    walls, waits = [], []
    for i in range(steps + 1):
        ids = torch.randint(shape.vocab, (tokens + 1,), generator=g)
        mb = MicroBatch(tokens=ids[:-1], targets=ids[1:], cu_seqlens=torch.tensor([0, tokens], dtype=torch.int32),
                        sample_ids=(i,))
        stats = engine.train_step([mb], 2 * tokens)
        if i:                       # the first step warms up
            walls.append(stats.wall_seconds)
            waits.append(stats.comm_seconds)
    sync = engine.grad_sync
    return {"wall": statistics.median(walls), "wait": statistics.median(waits),
            "pending": sync.pending_at_first_launch / max(1, len(sync._hooked)), "buckets": len(sync.launch_order),
            "grad_mib": sum(p.numel() * p.element_size() for p in engine.params.values()) / 2 ** 20,
            "pace_held": clock.pace_count.on_pace / max(1, clock.pace_count.ops)}


def main(argv: list[str]) -> int:
    from malleus_svc.config.options import number_option
    from malleus_svc.config.presets import ModelShape
    from malleus_svc.runtime.local_world import run_local_world

    ap = argparse.ArgumentParser(prog="malleus bench overlap", description=__doc__.split("\n")[0])
    number_option(ap, "--hidden", 128, 8192, integer=True, default=1024, help="a multiple of 128 (heads of 128)")
    number_option(ap, "--layers", 1, 64, integer=True, default=4)
    number_option(ap, "--tokens", 8, 8192, integer=True, default=64,
                  help="tokens per micro-batch (one micro-batch per pipeline)")
    number_option(ap, "--steps", 1, 1000, integer=True, default=4)
    number_option(ap, "--rounds", 1, 100, integer=True, default=2)
    number_option(ap, "--tflops", 1e-4, 1e3, default=0.01, help="the emulated accelerator's FLOP/s, in TFLOP/s")
    number_option(ap, "--gbps", 0.01, 1e4, default=4.0, help="its memory bandwidth (the optimizer step), GB/s")
    ap.add_argument("--shard", action="store_true", help="the distributed optimizer: reduce-scatter, not all-reduce")
    ap.add_argument("--write", metavar="MD", help="update this markdown file's overlap section")
    args = ap.parse_args(argv)
    if args.hidden % 128:
        ap.error(f"--hidden must be a multiple of 128, got {args.hidden}")
    shape = ModelShape(layers=args.layers, hidden=args.hidden, heads=args.hidden // 128, ffn=int(2.75 * args.hidden),
                       vocab=8192, seq_len=args.tokens)
    runs: dict[bool, list[dict]] = {False: [], True: []}
    for r in range(args.rounds):
        for overlap in (False, True):
            t0 = time.perf_counter()
            out = run_local_world(_step_times, 2, shape, overlap, args.shard, args.tokens, args.steps,
                                  args.tflops, args.gbps)
            runs[overlap].append(max(out, key=lambda o: o["wall"]))      # the slower rank sets the step
            print(f"round {r + 1}/{args.rounds}, {'overlapped' if overlap else 'after backward'}: "
                  f"{runs[overlap][-1]['wall']:.3f} s a step ({time.perf_counter() - t0:.0f} s)", flush=True)
    first = runs[True][0]
    rows = ["| reduction | step (median of runs) | waited after backward | gradients to come at the first launch | pace held |",
            "|---|---|---|---|---|"]
    for overlap in (False, True):
        rs = runs[overlap]
        wall, wait = (statistics.median(r[k] for r in rs) for k in ("wall", "wait"))
        pending = f"{100 * statistics.median(r['pending'] for r in rs):.0f}%" if overlap else "-"
        rows.append(f"| {'behind backward' if overlap else 'after backward'} | {wall:.3f} s | {wait:.3f} s | "
                    f"{pending} | {100 * min(r['pace_held'] for r in rs):.0f}% |")
    ratio = statistics.median(r["wall"] for r in runs[True]) / statistics.median(r["wall"] for r in runs[False])
    head = (f"{args.layers} blocks of hidden {args.hidden} ({first['grad_mib']:.0f} MiB of fp32 gradients per device, "
            f"{first['buckets']} buckets), {args.tokens} tokens a step per pipeline, 2 pipelines on gloo, "
            f"{'reduce-scatter (distributed optimizer)' if args.shard else 'all-reduce'}; emulated device "
            f"{args.tflops:g} TFLOP/s, {args.gbps:g} GB/s; {args.rounds} runs of {args.steps} steps per mode, alternating")
    md = "\n".join(rows)
    print(head, md, f"step with the reduction behind backward / after it: {ratio:.2f}", sep="\n")
    if args.write:
        write_section(f"Command: `malleus bench overlap{' --shard' if args.shard else ''} --write BENCHMARKS.md` — "
                      f"{time.strftime('%Y-%m-%d')}, 2-core CPU machine. {head}.\n\n{md}\n\nStep behind / after: "
                      f"{ratio:.2f}.", Path(args.write), "bench:overlap" + ("-shard" if args.shard else ""))
    return 0
