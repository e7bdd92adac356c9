"""`malleus bench runtime`: throughput of the Ray runtime against a plain single-process run.

For each model (tiny, small) and worker count (4, 8), one local Ray cluster runs the same global
batches under a plain DP × PP (× TP at 8 workers) plan, and a single process trains the same
model on the same batches (the better of 1 and all-cores torch threads). Reported, from one run, side by side:

  tokens/s         of the runtime and of the single process, and their ratio;
  compute share    Σ over devices of their compute CPU seconds / (cores × iteration seconds):
                   how much of the machine did model arithmetic (the rest is communication,
                   pipeline bubbles, orchestration and the OS switching between workers);
  orchestration    driver iteration time − the slowest worker's train_step wall time, over the
                   iteration: Ray dispatch, argument and result transfer, the driver's own work;
  communication    mean over devices of the wall time spent in p2p and collectives, over the
                   iteration (on an oversubscribed CPU this includes waiting for a core).

More workers than cores time-slice the cores, so the runtime's tokens/s on this machine measures
the overheads, not parallel speed-up; the table states the worker/core ratio of every row.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from .planner import write_section
from malleus_svc.planner.build import build_problem

LAYOUTS = {2: (1, 1, 2), 4: (2, 1, 2), 8: (2, 2, 2)}   # workers -> (dp, tp, pp)


def job_dict(model: str, workers: int, global_batch: int, seq_len: int) -> dict:
    dp, tp, pp = LAYOUTS[workers]
    return {
        "name": f"bench-{model}-{workers}",
        "cluster": {"nodes": 1, "gpus_per_node": workers, "gpu_memory_mb": 16000},
        "model": model, "parallel": {"dp": dp, "tp": tp, "pp": pp},
        "batch": {"global": global_batch, "micro": 2},
        "data": {"source": "synthetic", "seq_len": seq_len, "num_samples": 4096, "vocab": 256, "mode": "pack", "seed": 0},
        "train": {"steps": 1, "seed": 0, "lr": 1e-3},
    }


def single_process(shape, dataset, batches, seq_len: int, threads: int) -> float:
    """Tokens/s of the plain single-process reference loop on the same global batches."""
    import torch
    import torch.nn.functional as F

    from malleus_svc.runtime.batch import IGNORE_INDEX
    from malleus_svc.runtime.datasets import collate
    from malleus_svc.runtime.model import full_model

    torch.set_num_threads(threads)
    model = full_model(shape, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = 0
    elapsed = 0.0
    for i, ids in enumerate(batches):
        mbs = [collate(dataset, ids[j:j + 2], "pack", seq_len) for j in range(0, len(ids), 2)]
        t = time.perf_counter()
        loss_tokens = sum(mb.num_loss_tokens for mb in mbs)
        opt.zero_grad(set_to_none=True)
        for mb in mbs:
            logits = model(mb.tokens, mb.positions(), mb.cu_seqlens)
            (F.cross_entropy(logits, mb.targets, ignore_index=IGNORE_INDEX, reduction="sum") / loss_tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if i >= 1:  # the first step warms up allocators
            elapsed += time.perf_counter() - t
            tokens += sum(mb.num_tokens for mb in mbs)
    return tokens / elapsed


def run_row(model: str, workers: int, steps: int, cores: int) -> dict:
    from malleus_svc.config.job import JobConfig
    from malleus_svc.runtime.cluster import WorkerGroup
    from malleus_svc.runtime.data import GlobalSampler
    from malleus_svc.runtime.trainer import optim_config
    from malleus_svc.planner import baseline_plan

    seq_len = 64 if model == "tiny" else 128
    job = JobConfig.from_dict(job_dict(model, workers, 16, seq_len))
    sc = job.scenario
    plan = baseline_plan(build_problem(sc))
    sampler = GlobalSampler(4096, sc.global_batch, seed=0)
    batches = [sampler.next_global_batch() for _ in range(steps + 1)]
    with WorkerGroup(sc.num_devices, sc.gpus_per_node) as group:
        group.set_data(job.data.spec(), job.data.mode, job.data.seq_len)
        group.apply_plan(plan, sc.shape, seed=0, optim=optim_config(job))
        records = [group.step(ids) for ids in batches]
    timed = records[1:]
    it = statistics.mean(r.iteration_seconds for r in timed)
    tok = sum(r.tokens for r in timed) / sum(r.iteration_seconds for r in timed)
    compute = statistics.mean(sum(d["compute_seconds"] for d in r.devices.values()) for r in timed)
    worker_wall = statistics.mean(max(d["wall_seconds"] + d.get("collate_seconds", 0.0) for d in r.devices.values())
                                  for r in timed)
    comm = statistics.mean(statistics.mean(d["comm_seconds"] for d in r.devices.values()) for r in timed)
    # The best of one thread and all cores: intra-op threads spin and collapse when cores are shared.
    single = max(single_process(sc.shape, group.dataset, batches, seq_len, threads=t) for t in sorted({1, cores}))
    return {"model": model, "workers": workers, "layout": "dp{}·tp{}·pp{}".format(*LAYOUTS[workers]),
            "iteration_s": it, "tokens_per_s": tok, "single_tokens_per_s": single,
            "compute_share": compute / (min(cores, workers) * it),
            "orchestration_share": max(0.0, it - worker_wall) / it, "comm_share": comm / it}


def table(rows: list[dict], cores: int) -> str:
    out = ["| model | workers / cores | layout | iteration s | runtime tokens/s | single-process tokens/s "
           "| runtime / single | compute share | orchestration share | communication share |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['model']} | {r['workers']} / {cores} | {r['layout']} | {r['iteration_s']:.3f} | "
                   f"{r['tokens_per_s']:.0f} | {r['single_tokens_per_s']:.0f} | "
                   f"{r['tokens_per_s'] / r['single_tokens_per_s']:.2f} | {r['compute_share']:.1%} | "
                   f"{r['orchestration_share']:.1%} | {r['comm_share']:.1%} |")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="malleus bench runtime", description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="tiny,small")
    ap.add_argument("--workers", default="4,8", help=f"worker counts, from {sorted(LAYOUTS)}")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per row (one more warms up)")
    ap.add_argument("--write", metavar="MD", help="update this markdown file's runtime section")
    args = ap.parse_args(argv)
    workers = [int(w) for w in args.workers.split(",")]
    if any(w not in LAYOUTS for w in workers):
        ap.error(f"--workers must be among {sorted(LAYOUTS)}, got {args.workers}")
    import ray

    from malleus_svc.runtime.cluster import start_local_ray

    cores = os.cpu_count() or 1
    start_local_ray(max(workers), include_dashboard=False, log_to_driver=False)
    rows = []
    try:
        for model in args.models.split(","):
            for w in workers:
                print(f"[bench runtime] {model} on {w} workers ...", file=sys.stderr, flush=True)
                rows.append(run_row(model, w, args.steps, cores))
    finally:
        ray.shutdown()
    md = table(rows, cores)
    print(md)
    if args.write:
        cmd = ("malleus bench runtime " + " ".join(argv)).strip()
        write_section(f"Command: `{cmd}` — {time.strftime('%Y-%m-%d')}, {cores}-core CPU machine, "
                      f"CPU worker actors over gloo, single process: best of 1 and {cores} torch threads.\n\n{md}",
                      __import__("pathlib").Path(args.write), "bench:runtime")
    return 0
