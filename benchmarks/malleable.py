"""`malleus bench malleable`: one device slowed 3× on 8 CPU workers — static plan, malleus, DDP, bound.

In one invocation on a local Ray cluster of 8 CPU workers, `small` preset on the python-stdlib
corpus, global batch 16 (micro-batch 2), one schedule: healthy warm-up, then device 3 slowed
``--factor`` (3×) from step ``--shift-at`` to the end. Systems:
  (a) static    - the first plan (DP4 × PP2) kept all run long (the `malleus demo` machinery);
  (b) malleus   - the coordinator measures, re-plans and migrates live;
  (c) ray-ddp   - Ray Train v2 ``TorchTrainer``, plain data parallelism (DDP over gloo, 8 workers,
                  each takes a contiguous 1/8 of the same global batch), worker 3 slowed exactly
                  like our emulator (after each forward and each backward, sleep (factor−1) × that
                  compute's thread CPU time: `runtime.straggler.Slowdown`);
  (d) bound     - the capacity bound: malleus's healthy throughput (its steps before the shift, same
                  plan as static) × Σ(1/x_i)/N = (7 + 1/3)/8.
Throughput of every system is tokens / seconds over the slowed steps (shift to end), migration
time included; re-plan-to-effect is the number of iterations run under the old plan after the shift.

On a machine with fewer cores than workers the comparison is not the GPU one: a straggler that
sleeps frees CPU for the others (its healthy peers run faster than in the warm-up), and DDP's
all-reduce makes every worker wait for the slow one each step. The printed notes say so.

Needs ``ray[train]`` for (c) (``pip install 'malleus-svc[bench]'``); without it, or with
``--no-ddp``, (c) is skipped and the table says why.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from malleus_svc.config.job import ControlConfig

from .planner import write_section

WORKERS = 8            # the demo's job: one CPU worker actor per device; DDP runs as many
SLOW_RANK = 3


# ---------------------------------------------------------------------------------------------
# (c) Ray Train TorchTrainer, plain DDP: the per-worker train loop (runs inside Ray Train workers)
# ---------------------------------------------------------------------------------------------
def ddp_train_loop(config: dict) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import ray.train
    import ray.train.torch
    from malleus_svc.config.job import JobConfig
    from malleus_svc.runtime.batch import IGNORE_INDEX
    from malleus_svc.runtime.data import GlobalSampler
    from malleus_svc.runtime.datasets import build_dataset, collate
    from malleus_svc.runtime.model import full_model
    from malleus_svc.runtime.straggler import Slowdown
    from malleus_svc.runtime.trainer import optim_config

    torch.set_num_threads(1)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    job = JobConfig.from_dict(config["job"])
    gb, micro = job.scenario.global_batch, job.scenario.micro_batch
    if gb % world or (gb // world) % micro:
        raise ValueError(f"global batch {gb} must split into {world} workers x whole micro-batches of {micro}")
    per = gb // world
    dataset = build_dataset(job.data.spec())
    lengths = getattr(dataset, "lengths", None)
    sampler = GlobalSampler(len(dataset), gb, seed=job.train.seed)

    model = ray.train.torch.prepare_model(full_model(job.shape, job.train.seed))
    opt_cfg = optim_config(job)
    optimizer = opt_cfg.make(model.parameters())
    slow = Slowdown(1.0)
    clock = time.thread_time

    steps, shift, factor = config["steps"], config["shift_at"], config["factor"]
    records = []
    for step in range(steps):
        if rank == config["slow_rank"] and step >= shift:
            slow.set(factor)
        ids = sampler.next_global_batch(gb)
        mine = ids[rank * per:(rank + 1) * per]
        if lengths is not None:
            loss_tokens = int(sum(int(lengths[i]) - 1 for i in ids))
            tokens = len(ids) * job.data.seq_len if job.data.mode == "pad" else loss_tokens
        else:
            full = collate(dataset, ids, job.data.mode, job.data.seq_len)
            tokens, loss_tokens = full.num_tokens, full.num_loss_tokens
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=False)
        chunks = [mine[j:j + micro] for j in range(0, per, micro)]
        local = 0.0
        for k, chunk in enumerate(chunks):
            mb = collate(dataset, chunk, job.data.mode, job.data.seq_len)
            sync = model.no_sync() if k < len(chunks) - 1 else _null()
            with sync:
                c0 = clock()
                logits = model(mb.tokens, mb.positions(), mb.cu_seqlens)
                # summed over tokens / the GLOBAL loss tokens; DDP averages over `world`, so × world
                loss = F.cross_entropy(logits.float(), mb.targets, ignore_index=IGNORE_INDEX,
                                       reduction="sum") / loss_tokens
                slow(clock() - c0)
                c0 = clock()
                (loss * world).backward()
                slow(clock() - c0)
            local += float(loss.detach())
        if opt_cfg.grad_clip and opt_cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), opt_cfg.grad_clip)
        optimizer.step()
        dt = time.perf_counter() - t0
        records.append({"step": step, "tokens": tokens, "iteration_seconds": dt, "local_loss": local})
    t = torch.tensor([records[-1]["local_loss"], slow.slept_seconds], dtype=torch.float64)
    dist.all_reduce(t)

    def tps(lo, hi):
        rs = [r for r in records if lo <= r["step"] < hi]
        s = sum(r["iteration_seconds"] for r in rs)
        return sum(r["tokens"] for r in rs) / s if s > 0 else None

    metrics = {
        "healthy_tokens_per_second": tps(config["skip"], shift),
        "slowed_tokens_per_second": tps(shift, steps),
        "last_loss": float(t[0]),
        "straggler_slept_seconds": float(t[1]),
        "records": records,
    }
    # Ray Train v2 keeps a run's metrics with its checkpoints: rank 0 attaches a small one
    checkpoint = None
    if rank == 0:
        d = tempfile.mkdtemp(prefix="malleus-ddp-metrics-")
        with open(os.path.join(d, "metrics.json"), "w") as fh:
            json.dump(metrics, fh)
        checkpoint = ray.train.Checkpoint.from_directory(d)
    ray.train.report({k: v for k, v in metrics.items() if k != "records"}, checkpoint=checkpoint)


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def run_ddp(job: dict, steps: int, shift: int, factor: float, skip: int) -> dict:
    """Ray Train v2 TorchTrainer on the running Ray cluster; rank 0's final metrics."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    storage = tempfile.mkdtemp(prefix="malleus-bench-ddp-")
    trainer = TorchTrainer(
        ddp_train_loop,
        train_loop_config={"job": job, "steps": steps, "shift_at": shift, "factor": factor,
                           "slow_rank": SLOW_RANK, "skip": skip},
        torch_config=TorchConfig(backend="gloo"),
        scaling_config=ScalingConfig(num_workers=WORKERS, use_gpu=False),
        run_config=RunConfig(name="malleus-bench-ddp", storage_path=storage),
    )
    t0 = time.perf_counter()
    try:
        result = trainer.fit()
        wall = time.perf_counter() - t0
        if result.error:
            raise RuntimeError(f"TorchTrainer failed: {result.error}")
        if result.checkpoint is None:
            raise RuntimeError("TorchTrainer finished without the metrics checkpoint of rank 0")
        with result.checkpoint.as_directory() as d:
            with open(os.path.join(d, "metrics.json")) as fh:
                m = json.load(fh)
    finally:
        shutil.rmtree(storage, ignore_errors=True)
    m["wall_seconds"] = wall
    return m


# ---------------------------------------------------------------------------------------------
# (a), (b), (d): the demo machinery
# ---------------------------------------------------------------------------------------------
def window_throughput(run: dict, lo: int, hi: int | None = None) -> float | None:
    """Tokens / (iteration seconds + migration seconds) over steps [lo, hi)."""
    hi = 10 ** 9 if hi is None else hi
    recs = [r for r in run["records"] if lo <= r["step"] < hi]
    mig = sum((h.get("migration") or {}).get("seconds", 0.0) for h in run["history"]
              if h["outcome"] == "applied" and lo <= h["step"] <= hi)
    secs = sum(r["iteration_seconds"] for r in recs) + mig
    return sum(r["tokens"] for r in recs) / secs if secs > 0 else None


def ray_train_version() -> str | None:
    try:
        import ray.train.torch  # noqa: F401  (needs ray[train]'s extras: pandas, pyarrow, ...)
        import pandas  # noqa: F401
        import pyarrow  # noqa: F401
    except Exception:
        return None
    import ray
    return ray.__version__


def table(s: dict) -> str:
    def f(x, fmt=",.0f"):
        return "-" if x is None else format(x, fmt)
    bound = s["bound_tokens_per_second"]

    def share(x):
        return "-" if (x is None or not bound) else f"{100 * x / bound:.0f}%"
    lat = s["replan"]
    mal_note = (f"re-plan in force {lat['iterations']} iteration(s) after the shift ({lat['seconds']:.1f} s); "
                f"{len(s['migrations'])} migration(s)" if lat.get("iterations") is not None
                else "no re-plan took effect")
    ddp = s.get("ddp")
    ddp_note = (f"healthy {f(ddp['healthy_tokens_per_second'])} tok/s before the shift; every step waits for "
                f"worker {SLOW_RANK} at the all-reduce" if ddp else s.get("ddp_skipped", "skipped"))
    rows = [
        "| system | tokens/s | share of the capacity bound | notes |",
        "|---|---|---|---|",
        f"| (a) unchanged plan (DP4×PP2) | {f(s['static_tokens_per_second'])} | {share(s['static_tokens_per_second'])} | "
        f"healthy {f(s['static_healthy_tokens_per_second'])} tok/s before the shift |",
        f"| (b) malleus-svc | {f(s['malleable_tokens_per_second'])} | {share(s['malleable_tokens_per_second'])} | "
        f"{mal_note} |",
        f"| (c) Ray Train TorchTrainer, DDP ×{s['workers']} | {f(ddp and ddp['slowed_tokens_per_second'])} | "
        f"{share(ddp and ddp['slowed_tokens_per_second'])} | {ddp_note} |",
        f"| (d) capacity bound | {f(bound)} | 100% | healthy {f(s['healthy_tokens_per_second'])} tok/s × "
        f"Σ(1/x)/N = {s['capacity_fraction']:.3f} |",
    ]
    return "\n".join(rows)


def details(s: dict) -> str:
    lat = s["replan"]
    lines = []
    if lat.get("iterations") is not None:
        lines.append(f"- Re-plan-to-effect: the shift is at step {s['shift_at']}; the new plan "
                     f"{lat.get('new_plan_id')} is in force from step {lat['new_plan_step']}: "
                     f"{lat['iterations']} iteration(s), {lat['seconds']:.2f} s (target ≤ 3 iterations: "
                     f"{'met' if lat['iterations'] <= 3 else 'NOT met'}).")
    else:
        lines.append(f"- Re-plan-to-effect: no new plan took effect after the shift at step {s['shift_at']} "
                     "(target ≤ 3 iterations: NOT met).")
    for m in s["migrations"]:
        lines.append(f"- Migration at step {m['step']} ({m['option']}, {m['old_plan_id']} → {m['new_plan_id']}): "
                     f"{m['bytes'] / 1e6:.1f} MB moved in {m['seconds']:.2f} s; planning {m['planning_seconds']:.3f} s.")
    for r in s["other_rounds"]:
        lines.append(f"- Round at step {r['step']}: {r['outcome']} ({r['reason'][:80]}).")
    if s.get("malleable_steady_tokens_per_second"):
        lines.append(f"- malleus-svc under the new plan, from step {s['steady_from']} (its first "
                     f"{s['steady_from'] - lat['new_plan_step']} iterations, new engines warming up, left out): "
                     f"{s['malleable_steady_tokens_per_second']:,.0f} tok/s = "
                     f"{s['malleable_steady_tokens_per_second'] / s['bound_tokens_per_second']:.2f} of the bound.")
    ha, hb = s.get("static_healthy_tokens_per_second"), s.get("healthy_tokens_per_second")
    if ha and hb and abs(ha / hb - 1) > 0.15:
        alt = ha * s["capacity_fraction"]
        lines.append(
            f"- **Caution: the machine's load changed during the run.** (a) and (b) run the same plan before the "
            f"shift, yet their healthy throughputs differ by {100 * (ha / hb - 1):+.0f}% ({ha:,.0f} vs {hb:,.0f} "
            f"tok/s), so the bound (from (b)'s healthy steps) is not reliable here. With (a)'s healthy steps instead "
            f"the bound is {alt:,.0f} tok/s: (a) {s['static_tokens_per_second'] / alt:.0%}, "
            f"(b) {s['malleable_tokens_per_second'] / alt:.0%}"
            + (f", (c) {s['ddp']['slowed_tokens_per_second'] / alt:.0%}" if s.get("ddp") else "") + ".")
    ratio = s.get("malleable_over_bound")
    if ratio is not None:
        unreliable = bool(ha and hb and abs(ha / hb - 1) > 0.15)
        verdict = ("met" if ratio >= 0.85 else "NOT met") + (" — against a bound that is unreliable in this run, "
                                                              "see the caution above" if unreliable else "")
        lines.append(f"- malleus-svc / capacity bound = {ratio:.3f} (target ≥ 0.85: "
                     f"{verdict}); malleus-svc / unchanged plan = "
                     f"{s['malleable_over_static']:.2f}×"
                     + (f"; malleus-svc / DDP = {s['malleable_over_ddp']:.2f}×." if s.get("malleable_over_ddp") else "."))
    if s.get("malleable_over_static") and s["malleable_over_static"] < 1.0:
        crowded = (f"with {s['workers']} workers on {s['host_cores']} cores a sleeping straggler hands its CPU to "
                   "its peers, so it costs the unchanged plan little, and " if s["host_cores"] < s["workers"] else "")
        lines.append("- In this run the unchanged plan was faster than malleus-svc over the slowed steps: " + crowded
                     + "the re-plan paid a migration, 3 iterations of reaction and 2 warm-up "
                     "iterations of the new engines out of the slowed steps.")
    lines.append("- Final loss (sanity): " + ", ".join(f"{k} {v:.3f}" for k, v in s["last_loss"].items()) + ".")
    lines.append(
        f"- What this means here: {s['workers']} worker processes share {s['host_cores']} cores (load average "
        f"{s['load_average']} at the start, {s['load_average_end']} at the end, other jobs included). A straggler emulated by sleeping frees CPU for "
        "its peers, so once malleus-svc gives the slow device less work the healthy devices speed up beyond their "
        "warm-up rate — the bound (warm-up throughput × Σ(1/x)/N) is the GPU bound, not this machine's, and shares "
        "near or above 100% are possible. DDP has no choice but to wait for the slow worker at every all-reduce; its "
        "healthy throughput also differs from ours (different parallelism: no pipeline, a full model per worker), "
        "so compare (c) with (b) as absolute tokens/s on the same machine and data, not as a tuned DDP baseline.")
    return "\n".join(lines)


def render(s: dict) -> str:
    """The BENCHMARKS.md section (also printed): command line, table, details."""
    head = (f"Command: `{s['command'].strip()}` — {s['date']}, {s['workers']} CPU workers (Ray, 1 logical CPU "
            f"each) on a {s['host_cores']}-core machine, no GPU; ray {s['ray_version']}; model {s['model']}, "
            f"{s['data']}, global batch {s['global_batch']} (micro {s['micro_batch']}), {s['steps']} steps per "
            f"system; device {s['slow_device']} slowed {s['factor']:g}× from step {s['shift_at']} to the end; "
            f"tokens/s over the slowed steps (migration time included); total {s['wall_seconds']['total']:.0f} s.")
    return f"{head}\n\n{table(s)}\n\n{details(s)}"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="malleus bench malleable", description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30, help="iterations per system (default 30, ~6 min in all)")
    ap.add_argument("--shift-at", type=int, default=None,
                    help="first slowed step (default max(9, steps // 3); the first 6 are warm-up and calibration)")
    ap.add_argument("--factor", type=float, default=3.0, help="slowdown of device 3 (default 3)")
    ap.add_argument("--global-batch", type=int, default=16, help="samples per iteration (default 16)")
    ap.add_argument("--no-ddp", action="store_true", help="skip (c), the Ray Train TorchTrainer baseline")
    ap.add_argument("--no-static", action="store_true", help="skip (a), the unchanged plan")
    ap.add_argument("--write", metavar="MD", help="update this markdown file's malleable section (BENCHMARKS.md)")
    ap.add_argument("--summary-out", metavar="JSON", help="write all numbers as JSON")
    args = ap.parse_args(argv)
    shift = args.shift_at if args.shift_at is not None else max(9, args.steps // 3)
    skip, warmup = ControlConfig().skip, ControlConfig().warmup
    if shift < skip + warmup + 1:
        ap.error(f"--shift-at must be >= {skip + warmup + 1} (healthy warm-up and calibration come first)")
    if args.steps < shift + 6:
        ap.error(f"--steps must be >= shift + 6 = {shift + 6} (room to react and measure)")
    if args.global_batch % 16:
        ap.error("--global-batch must be a multiple of 16 (DP4 × micro 2, and 8 DDP workers × micro 2)")

    import logging

    import ray

    from malleus_svc.config.job import JobConfig
    from malleus_svc.control.demo import View, job_dict, latencies, run_one
    from malleus_svc.runtime.cluster import start_local_ray

    logging.getLogger("malleus_svc").setLevel(logging.WARNING)
    ddp_version = None if args.no_ddp else ray_train_version()
    ddp_skipped = ("skipped (--no-ddp)" if args.no_ddp else
                   "skipped: ray[train] is not installed (pip install 'malleus-svc[bench]')" if ddp_version is None else None)
    emulate = [{"device": SLOW_RANK, "factor": args.factor, "at_step": shift, "until_step": None}]
    load0 = os.getloadavg()
    t_start = time.perf_counter()
    view = View(False, out=sys.stderr)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {"PYTHONPATH": os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p)}
    start_local_ray(WORKERS, log_to_driver=False, runtime_env={"env_vars": env})
    runs, ddp, walls = {}, None, {}
    try:
        for name, static in (("static", True), ("malleable", False)):
            if name == "static" and args.no_static:
                continue
            t0 = time.perf_counter()
            job = JobConfig.from_dict(job_dict(f"bench-{name}", 1, args.global_batch, args.steps, emulate))
            runs[name] = run_one(name, job, args.steps, static, view)
            walls[name] = time.perf_counter() - t0
        if ddp_version is not None:
            print(f"[ray-ddp] TorchTrainer, {WORKERS} workers, worker {SLOW_RANK} x{args.factor:g} from step {shift}",
                  file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            ddp = run_ddp(job_dict("bench-ddp", 1, args.global_batch, args.steps, emulate), args.steps, shift,
                          args.factor, skip)
            walls["ddp"] = time.perf_counter() - t0
    finally:
        ray.shutdown()

    mal = runs["malleable"]
    # healthy: malleus's steps after the skipped ones and before the shift (the initial plan, as static)
    healthy = window_throughput(mal, skip, shift)
    fraction = (WORKERS - 1 + 1 / args.factor) / WORKERS
    bound = healthy * fraction if healthy else None
    lat = next((x for x in latencies(mal, emulate) if x["shift_step"] == shift), {})
    migrations = [{"step": h["step"], "option": (h.get("decision") or {}).get("option"),
                   "old_plan_id": h.get("old_plan_id"), "new_plan_id": h.get("new_plan_id"),
                   "bytes": float(h["migration"]["moved_bytes"]), "seconds": float(h["migration"]["seconds"]),
                   "planning_seconds": float((h.get("decision") or {}).get("planning_seconds") or 0.0)}
                  for h in mal["history"] if h["outcome"] == "applied"]
    s = {
        "command": "malleus bench malleable " + " ".join(argv),
        "date": time.strftime("%Y-%m-%d %H:%M"), "workers": WORKERS, "host_cores": os.cpu_count() or 1,
        "load_average": " / ".join(f"{x:.1f}" for x in load0),
        "model": "small", "data": "python-stdlib", "global_batch": args.global_batch, "micro_batch": 2,
        "steps": args.steps, "shift_at": shift, "factor": args.factor, "slow_device": SLOW_RANK,
        "measured_from_step": skip, "schedule": emulate,
        "healthy_tokens_per_second": healthy, "capacity_fraction": fraction, "bound_tokens_per_second": bound,
        "static_tokens_per_second": window_throughput(runs["static"], shift) if "static" in runs else None,
        "static_healthy_tokens_per_second": window_throughput(runs["static"], skip, shift) if "static" in runs else None,
        "malleable_tokens_per_second": window_throughput(mal, shift),
        "replan": lat, "migrations": migrations,
        "other_rounds": [{"step": h["step"], "outcome": h["outcome"], "reason": h["reason"]}
                         for h in mal["history"] if h["outcome"] in ("kept", "failed")],
        "ddp": None if ddp is None else {k: v for k, v in ddp.items()},
        "ddp_skipped": ddp_skipped, "ray_version": ray.__version__,
        "last_loss": {**{k: r["records"][-1]["loss"] for k, r in runs.items()},
                      **({"ddp": ddp["last_loss"]} if ddp else {})},
        "wall_seconds": {k: round(v, 1) for k, v in walls.items()} | {"total": round(time.perf_counter() - t_start, 1)},
    }
    if bound and s["malleable_tokens_per_second"]:
        s["malleable_over_bound"] = s["malleable_tokens_per_second"] / bound
        if s["static_tokens_per_second"]:
            s["malleable_over_static"] = s["malleable_tokens_per_second"] / s["static_tokens_per_second"]
        if ddp and ddp.get("slowed_tokens_per_second"):
            s["malleable_over_ddp"] = s["malleable_tokens_per_second"] / ddp["slowed_tokens_per_second"]
    if lat.get("new_plan_step") is not None and bound:
        s["steady_from"] = lat["new_plan_step"] + ControlConfig().skip_after_migration
        if s["steady_from"] < args.steps:
            s["malleable_steady_tokens_per_second"] = window_throughput(mal, s["steady_from"])
    s["load_average_end"] = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    s.setdefault("malleable_over_static", float("nan"))
    md = render(s)
    print(md)
    print(f"\nwall: {s['wall_seconds']}", file=sys.stderr)
    if args.summary_out:
        with open(args.summary_out, "w") as fh:
            json.dump(s, fh, indent=2, default=str)
    if args.write:
        write_section(md, Path(args.write), "bench:malleable")
        print(f"updated {args.write}", file=sys.stderr)
    return 0
