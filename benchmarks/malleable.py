"""`malleus bench malleable`: one device slowed 3× on 8 paced CPU workers — static, malleus, DDP, bound.

One invocation starts a local Ray cluster of 8 CPU workers and trains `malleus demo`'s model on its
data (python-stdlib, global batch 16) under one schedule: healthy warm-up, then device 3 slowed
``--factor`` (3×) from step ``--shift-at`` to the end. Every system runs on the same emulated
accelerator (runtime/device_clock.py): each worker is a `PacedClock` at the pace the first run
sized, so an op takes `rate × FLOPs / FLOP/s` whatever else the host does, and a device at rate 3
takes three times as long while leaving the cores to the others, as a slow GPU would. Systems:
  (a) static   - the first plan (DP4 × PP2) kept all run long (`malleus demo`'s static run);
  (b) malleus  - the coordinator measures, re-plans and migrates live;
  (c) ray-ddp  - Ray Train v2 ``TorchTrainer``, plain data parallelism (DDP over gloo, 8 workers,
                 a contiguous 1/8 of the same global batch each), worker 3 at the same rate on
                 the same clock: forward and backward are paced compute ops (FLOPs counted by
                 `StageModel.forward_flops`, backward twice), the optimizer step a paced update;
                 the gradient all-reduce is outside them, so waiting for the slow worker is real
                 waiting, as on GPUs;
  (d) bound    - the capacity bound: healthy throughput × Σ(1/x_i)/N = (7 + 1/3)/8.
Throughput is tokens / seconds over the slowed steps (shift to end), migrations included. malleus
in steady state is measured from its new plan taking effect to the end (`malleus demo`'s rule).

Needs ``ray[train]`` for (c); without it, or with ``--no-ddp``, (c) is skipped and says so.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from malleus_svc.config.options import number_option
from malleus_svc.control.demo import HEALTHY_STEPS
from .planner import write_section

WORKERS = 8
SLOW_DEVICE = 3
PLOT = "benchmarks/plots/malleable.png"
TARGETS = {"over_bound": 0.8, "steady_over_bound": 0.9, "pace_held": 0.95}
SYSTEMS = ("static", "malleus", "ray-ddp")


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# (c) plain DDP on the device clock: one step, one worker's loop (plain torch.distributed; the Ray
# Train entry point below only wraps it)
# ---------------------------------------------------------------------------------------------
def all_reduce_gradients(params) -> None:
    """Sum the gradients over the workers, in one flat buffer (what DDP's buckets do)."""
    import torch
    import torch.distributed as dist

    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def ddp_step(model, optimizer, clock, micro_batches, loss_tokens: int, grad_clip: float | None) -> float:
    """One data-parallel step of this worker: its micro-batches' forward and backward as paced
    compute ops, the gradients summed over the workers outside any op (a worker waiting there for
    a slow peer is idle, not computing), clipping, then the update as a paced op. `model` may be
    DDP-wrapped; its own gradient sync is turned off so that it cannot run inside a paced backward.
    The loss is summed over tokens and divided by the global batch's loss tokens, so the summed
    gradients are the global mean's. Returns this worker's share of the loss."""
    import torch
    import torch.nn.functional as F

    from malleus_svc.runtime.batch import IGNORE_INDEX
    from malleus_svc.runtime.engine import update_bytes

    net = getattr(model, "module", model)
    params = [p for p in net.parameters()]
    optimizer.zero_grad()
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    local = torch.zeros((), dtype=torch.float64)
    with model.no_sync() if hasattr(model, "no_sync") else contextlib.nullcontext():
        for mb in micro_batches:
            flops, blocks = net.forward_flops(mb.cu_seqlens), len(net.blocks)
            with clock.op("compute", flops=flops, blocks=blocks):
                logits = model(mb.tokens, mb.positions(), mb.cu_seqlens)
                loss = F.cross_entropy(logits.float(), mb.targets, ignore_index=IGNORE_INDEX,
                                       reduction="sum") / loss_tokens
            with clock.op("compute", flops=2 * flops, blocks=blocks):    # backward: twice the forward's FLOPs
                loss.backward()
            local += loss.detach().double()
    all_reduce_gradients(params)
    if grad_clip and grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(params, grad_clip)
    with clock.op("update", nbytes=update_bytes(params)):
        optimizer.step()
    return float(local)


def ddp_worker(rank: int, world: int, config: dict, wrap=lambda m: m) -> dict:
    """One DDP worker's whole run (a process group must be up): the job's model and data, this
    worker's contiguous share of each global batch, rank `slow_rank` at `factor` from `shift_at`.
    Every rank returns the same summary (its device time, pace counts, last loss: all-reduced);
    `records` are this rank's steps."""
    import torch
    import torch.distributed as dist

    from malleus_svc.config.job import JobConfig
    from malleus_svc.runtime.data import GlobalSampler
    from malleus_svc.runtime.datasets import build_dataset, collate
    from malleus_svc.runtime.device_clock import Pace, PacedClock
    from malleus_svc.runtime.model import full_model
    from malleus_svc.runtime.trainer import optim_config

    job = JobConfig.from_dict(config["job"])
    gb, micro, seq_len, mode = job.scenario.global_batch, job.scenario.micro_batch, job.data.seq_len, job.data.mode
    if gb % world or (gb // world) % micro:
        raise ValueError(f"global batch {gb} must split into {world} workers x whole micro-batches of {micro}")
    per = gb // world
    dataset = build_dataset(job.data.spec())
    sampler = GlobalSampler(len(dataset), gb, seed=job.train.seed)
    model = wrap(full_model(job.shape, job.train.seed))
    opt = optim_config(job)
    optimizer = opt.make(dict(getattr(model, "module", model).named_parameters()))
    pace = config.get("pace")
    clock = PacedClock(Pace(**pace) if pace else None)
    records, device = [], torch.zeros(world, dtype=torch.float64)
    dist.barrier()
    last = time.perf_counter()        # a step lasts from the previous one's end: its data included
    for step in range(config["steps"]):
        if rank == config["slow_rank"] and step >= config["shift_at"]:
            clock.rate = config["factor"]
        ids = sampler.next_global_batch(gb)
        mine = ids[rank * per:(rank + 1) * per]
        full = collate(dataset, ids, mode, seq_len)          # the global batch's token counts
        mbs = [collate(dataset, mine[j:j + micro], mode, seq_len) for j in range(0, per, micro)]
        loss = ddp_step(model, optimizer, clock, mbs, full.num_loss_tokens, opt.grad_clip)
        now = time.perf_counter()
        dt, last = now - last, now
        seconds = clock.read()
        device[rank] += seconds.get("compute", 0.0) + seconds.get("update", 0.0)
        records.append({"step": step, "tokens": full.num_tokens, "iteration_seconds": dt, "local_loss": loss,
                        "device_seconds": seconds})
    totals = torch.tensor([records[-1]["local_loss"], clock.pace_count.on_pace, clock.pace_count.ops],
                          dtype=torch.float64)
    dist.all_reduce(totals)
    dist.all_reduce(device)
    return {"records": records, "last_loss": float(totals[0]),
            "pace_held": float(totals[1] / totals[2]) if totals[2] else None,
            "device_seconds": device.tolist(), "host_flops": clock.host.flops}


def ddp_train_loop(config: dict) -> None:
    """Ray Train's per-worker entry: the loop above on Ray Train's gloo group, DDP from prepare_model;
    rank 0 hands its records back in a checkpoint (Ray Train v2 keeps a run's results there)."""
    import torch

    import ray.train
    import ray.train.torch

    torch.set_num_threads(1)
    ctx = ray.train.get_context()
    out = ddp_worker(ctx.get_world_rank(), ctx.get_world_size(), config, wrap=ray.train.torch.prepare_model)
    checkpoint = None
    if ctx.get_world_rank() == 0:
        d = tempfile.mkdtemp(prefix="malleus-ddp-metrics-")
        with open(os.path.join(d, "metrics.json"), "w") as fh:
            json.dump(out, fh)
        checkpoint = ray.train.Checkpoint.from_directory(d)
    ray.train.report({"last_loss": out["last_loss"]}, checkpoint=checkpoint)


def ray_train_missing() -> str | None:
    """Why (c) cannot run here, or None."""
    try:
        import ray.train.torch  # noqa: F401  (ray[train]'s extras: pandas, pyarrow)
    except Exception as e:   # ImportError, or an extra that fails on import
        return f"{type(e).__name__}: {str(e).splitlines()[0]}"
    return None


def ddp_skip_reason(no_ddp: bool) -> str | None:
    """Why (c) does not run, in one line; None when it does."""
    if no_ddp:
        return "skipped (--no-ddp)"
    why = ray_train_missing()
    return f"skipped: ray.train cannot be imported ({why}); pip install -e '.[bench]'" if why else None


def run_ddp(job: dict, steps: int, shift: int, factor: float, pace: dict) -> dict:
    """Ray Train v2 TorchTrainer on the running Ray cluster; rank 0's run."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    storage = tempfile.mkdtemp(prefix="malleus-bench-ddp-")
    trainer = TorchTrainer(
        ddp_train_loop,
        train_loop_config={"job": job, "steps": steps, "shift_at": shift, "factor": factor,
                           "slow_rank": SLOW_DEVICE, "pace": pace},
        torch_config=TorchConfig(backend="gloo"),
        scaling_config=ScalingConfig(num_workers=WORKERS, use_gpu=False),
        run_config=RunConfig(name="malleus-bench-ddp", storage_path=storage),
    )
    try:
        result = trainer.fit()
        if result.error:
            raise RuntimeError(f"TorchTrainer failed: {result.error}")
        if result.checkpoint is None:
            raise RuntimeError("TorchTrainer finished without rank 0's checkpoint")
        with result.checkpoint.as_directory() as d:
            with open(os.path.join(d, "metrics.json")) as fh:
                return json.load(fh)
    finally:
        shutil.rmtree(storage, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# the figures: `malleus demo`'s rules on every system
# ---------------------------------------------------------------------------------------------
def pace_numbers(device: dict | str) -> dict | None:
    """The Pace of `same_device(run)`, as numbers a train-loop config can carry."""
    if not isinstance(device, dict):
        return None
    return {"flops_per_second": device["tflops"] * 1e12, "bytes_per_second": device["gbps"] * 1e9,
            "block_seconds": device.get("block_ms", 0.0) / 1e3}


def per_step(run: dict) -> list[tuple[int, float]]:
    return [(r["step"], r["tokens"] / r["iteration_seconds"]) for r in run["records"] if r["iteration_seconds"] > 0]


def summarize(runs: dict, emulate: list[dict], args, ddp_skipped: str | None) -> dict:
    """Tokens/s over the slowed steps, ratios to the bound and to static, malleus in steady state,
    pace held, re-plan latency; per-step throughput for the plot."""
    from malleus_svc.control.demo import bound, latencies, steady_steps, throughput

    mal = runs["malleus"]
    healthy = mal["status"]["healthy_tokens_per_second"]
    slowed, whole = range(args.shift_at, args.steps), range(args.skip, args.steps)
    latency = latencies(mal, emulate)
    steady = steady_steps(latency, emulate, args.steps)
    b, b_whole = bound(healthy, emulate, slowed), bound(healthy, emulate, whole)
    systems = {}
    for name, run in runs.items():
        tps, tps_whole = throughput(run, slowed), throughput(run, whole)
        systems[name] = {"tokens_per_second": tps,
                         "whole_over_bound": tps_whole / b_whole if tps_whole and b_whole else None,
                         "healthy_tokens_per_second": throughput(run, range(args.skip, args.shift_at)),
                         "pace_held": run["pace_held"], "last_loss": run["last_loss"], "per_step": per_step(run)}
    static = systems.get("static", {}).get("tokens_per_second")
    for v in systems.values():
        v["over_bound"] = v["tokens_per_second"] / b if b and v["tokens_per_second"] else None
        v["over_static"] = v["tokens_per_second"] / static if static and v["tokens_per_second"] else None
    steady_tps = throughput(mal, steady, {x["new_plan_step"] for x in latency})
    steady_bound = bound(healthy, emulate, steady)
    return {
        "command": args.command, "date": time.strftime("%Y-%m-%d", time.gmtime()), "workers": WORKERS,
        "host_cores": os.cpu_count(), "steps": args.steps, "shift_at": args.shift_at, "factor": args.factor,
        "slow_device": SLOW_DEVICE, "measured_from": args.skip, "global_batch": args.global_batch, "schedule": emulate,
        "device_pace": mal["status"]["device_pace"], "healthy_tokens_per_second": healthy,
        "bound_tokens_per_second": b, "capacity_fraction": b / healthy if b and healthy else None,
        "systems": systems, "ddp_skipped": ddp_skipped,
        "malleus_steady_tokens_per_second": steady_tps, "steady_steps": len(steady),
        "malleus_steady_over_bound": steady_tps / steady_bound if steady_tps and steady_bound else None,
        "replan_latency": latency,
        "replans": [{"step": h["step"], "option": (h.get("decision") or {}).get("option"),
                     "planning_seconds": (h.get("decision") or {}).get("planning_seconds"),
                     "migration_bytes": (h.get("migration") or {}).get("moved_bytes"),
                     "migration_seconds": (h.get("migration") or {}).get("seconds")}
                    for h in mal["history"] if h["outcome"] == "applied"],
        "ddp_device_seconds": runs.get("ray-ddp", {}).get("device_seconds"),
        "wall_seconds": dict(args.walls),
    }


def _f(x, fmt=",.0f") -> str:
    return "-" if x is None else format(x, fmt)


def verdicts(s: dict) -> list[str]:
    """Each target, met or not, with the figure reached."""
    sy, out = s["systems"], []
    ddp, static = sy.get("ray-ddp"), sy.get("static")
    if ddp and static:
        ok = ddp["tokens_per_second"] <= static["tokens_per_second"]
        out.append(f"DDP no better than static: {ddp['over_static']:.2f}× static ({'met' if ok else 'NOT met'})")
    mal, whole = sy["malleus"], f"malleus over the whole run (steps {s['measured_from']}–{s['steps'] - 1})"
    for key, fig, what in (("over_bound", mal["whole_over_bound"], whole),
                           ("over_bound", mal["over_bound"], "malleus over the slowed steps"),
                           ("steady_over_bound", s["malleus_steady_over_bound"], "malleus in steady state")):
        ok = fig is not None and fig >= TARGETS[key]
        out.append(f"{what} ≥ {TARGETS[key]:.1f} of bound: {_f(fig, '.2f')} ({'met' if ok else 'NOT met'})")
    held = {k: v["pace_held"] for k, v in sy.items()}
    ok = all(h is not None and h >= TARGETS["pace_held"] for h in held.values())
    out.append(f"pace held ≥ {TARGETS['pace_held']:.0%}: " + ", ".join(f"{k} {_f(h, '.1%')}" for k, h in held.items())
               + f" ({'met' if ok else 'NOT met'})")
    return out


def table(s: dict) -> str:
    sy = s["systems"]
    rows = ["| system | tokens/s (slowed steps) | of the bound | against static | of the bound, whole run | "
            "healthy tokens/s | pace held |", "|---|---|---|---|---|---|---|"]
    labels = {"static": "(a) static plan (DP4 × PP2 kept)", "malleus": "(b) malleus (re-plans, migrates live)",
              "ray-ddp": f"(c) Ray Train TorchTrainer, DDP × {s['workers']}"}
    for name in SYSTEMS:
        v = sy.get(name)
        if v is None:
            why = s["ddp_skipped"] if name == "ray-ddp" else "skipped (--no-static)"
            rows.append(f"| {labels[name]} | {why} | | | | | |")
            continue
        rows.append(f"| {labels[name]} | {_f(v['tokens_per_second'])} | {_f(v['over_bound'], '.2f')} | "
                    f"{_f(v['over_static'], '.2f')}× | {_f(v['whole_over_bound'], '.2f')} | "
                    f"{_f(v['healthy_tokens_per_second'])} | {_f(v['pace_held'], '.1%')} |")
    rows.append(f"| (b) malleus, steady state ({s['steady_steps']} steps from its new plan) | "
                f"{_f(s['malleus_steady_tokens_per_second'])} | {_f(s['malleus_steady_over_bound'], '.2f')} | | | | |")
    rows.append(f"| (d) capacity bound (healthy {_f(s['healthy_tokens_per_second'])} tok/s × Σ(1/x_i)/N = "
                f"{_f(s['capacity_fraction'], '.3f')}) | {_f(s['bound_tokens_per_second'])} | 1.00 | "
                f"{_f(sy.get('static') and s['bound_tokens_per_second'] / sy['static']['tokens_per_second'], '.2f')}× "
                "| | | |")
    return "\n".join(rows)


def details(s: dict) -> list[str]:
    lines = []
    for lat in s["replan_latency"]:
        lines.append(f"Re-plan latency: the shift at step {lat['shift_step']} ({lat['what']}) was in a new plan "
                     + (f"after {lat['iterations']} iterations ({lat['seconds']:.1f} s)" if lat["iterations"] is not None
                        else "never") + ".")
    for r in s["replans"]:
        lines.append(f"Re-plan at step {r['step']} ({r['option']}): planning {_f(r['planning_seconds'], '.3f')} s, "
                     f"migration {_f(r['migration_bytes'] and r['migration_bytes'] / 1e6, '.1f')} MB in "
                     f"{_f(r['migration_seconds'], '.2f')} s.")
    dev = s.get("ddp_device_seconds")
    if dev:
        healthy = [x for i, x in enumerate(dev) if i != s["slow_device"]]
        lines.append(f"DDP device time per worker: worker {s['slow_device']} {dev[s['slow_device']]:.1f} s, the others "
                     f"{min(healthy):.1f}–{max(healthy):.1f} s; they spent the difference waiting at the all-reduce.")
    lines.append("Final loss (sanity): " + ", ".join(f"{k} {_f(v['last_loss'], '.3f')}" for k, v in s["systems"].items())
                 + ".")
    return lines


def render(s: dict, plot_path: str | None = None) -> str:
    """The BENCHMARKS.md section (also printed)."""
    pace = s["device_pace"]
    head = (f"Command: `{s['command']}` — {s['date']}, {s['workers']} CPU workers on a {s['host_cores']}-core "
            f"machine, each an emulated accelerator of "
            + (f"{pace['gflops']:.3g} GFLOP/s and {pace['gbps']:.3g} GB/s, {pace.get('block_ms', 0):.3g} ms per "
               "block an op runs through" if pace else "(unpaced)")
            + f" (the pace the first run sized, kept by all); `malleus demo`'s model and data, global batch "
            f"{s['global_batch']}, {s['steps']} steps per system; device {s['slow_device']} at {s['factor']:g}× "
            f"from step {s['shift_at']} to the end; tokens/s over the slowed steps, migrations included; "
            f"whole run: steps {s['measured_from']}–{s['steps'] - 1}; {s['wall_seconds'].get('total', 0):.0f} s in all."
            + (f" Plot: `{plot_path}`." if plot_path else ""))
    body = [head, "", table(s), ""] + [f"- {x}" for x in details(s)] + [f"- Target: {x}." for x in verdicts(s)]
    return "\n".join(body)


def plot(s: dict, path: Path) -> Path:
    """Tokens/s per step of every system, and the bound."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.2))
    for name in SYSTEMS:
        v = s["systems"].get(name)
        if v:
            xs, ys = zip(*v["per_step"])
            ax.plot(xs, ys, marker=".", label=name)
    healthy, shift, b = s["healthy_tokens_per_second"], s["shift_at"], s["bound_tokens_per_second"]
    if healthy and b:
        ax.step([0, shift - 0.5, s["steps"] - 1], [healthy, b, b], where="post", color="k", ls="--", label="bound")
    ax.axvline(shift - 0.5, color="grey", lw=0.8)
    ax.text(shift - 0.4, ax.get_ylim()[1] * 0.97, f"device {s['slow_device']} ×{s['factor']:g}", va="top",
            fontsize=8, color="grey")
    ax.set_xlabel("step")
    ax.set_ylabel("tokens/s")
    ax.set_title(f"{s['workers']} paced CPU workers, one device slowed {s['factor']:g}× from step {shift}")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------
def coordinator_run(title: str, emulate: list[dict], args, static: bool, device) -> dict:
    """(a) or (b) through a coordinator, as `malleus demo` runs them."""
    from malleus_svc.config.job import JobConfig
    from malleus_svc.control.demo import View, job_dict, run_one

    job = JobConfig.from_dict(job_dict(f"bench-{title}", 1, args.global_batch, args.steps, emulate, device))
    run = run_one(title, job, args.steps, static, View(False, out=sys.stderr))
    run["pace_held"] = run["records"][-1].get("pace_held") if run["records"] else None
    run["last_loss"] = run["records"][-1]["loss"] if run["records"] else None
    return run


def ddp_run(emulate: list[dict], args, device) -> dict:
    from malleus_svc.control.demo import job_dict

    job = job_dict("bench-ddp", 1, args.global_batch, args.steps, emulate, device)
    out = run_ddp(job, args.steps, args.shift_at, args.factor, pace_numbers(device))
    return {"records": out["records"], "history": [], "pace_held": out["pace_held"], "last_loss": out["last_loss"],
            "device_seconds": out["device_seconds"]}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="malleus bench malleable", description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30, help="iterations per system (default 30)")
    ap.add_argument("--shift-at", type=int, default=HEALTHY_STEPS,
                    help=f"first slowed step (default {HEALTHY_STEPS}: warm-up, calibration, 3 healthy steps)")
    number_option(ap, "--factor", 1, 100, default=3.0, help="slowdown of device 3 (default 3)")
    ap.add_argument("--global-batch", type=int, default=16, help="samples per iteration (default 16)")
    ap.add_argument("--no-ddp", action="store_true", help="skip (c), the Ray Train TorchTrainer baseline")
    ap.add_argument("--write", metavar="MD", help="replace this markdown file's malleable section (BENCHMARKS.md)")
    ap.add_argument("--plot", metavar="PNG", default=None, help=f"write the plot here (default with --write: {PLOT})")
    ap.add_argument("--summary-out", metavar="JSON", help="write all numbers as JSON")
    return ap


def main(argv: list[str]) -> int:
    from malleus_svc.config.job import ControlConfig

    ap = build_parser()
    args = ap.parse_args(argv)
    args.skip = ControlConfig().skip
    if args.shift_at < HEALTHY_STEPS:
        ap.error(f"--shift-at must be >= {HEALTHY_STEPS} (warm-up, calibration and healthy steps come first)")
    if args.steps < args.shift_at + 6:
        ap.error(f"--steps must be >= shift + 6 = {args.shift_at + 6} (room to react and measure)")
    if args.global_batch % WORKERS:
        ap.error(f"--global-batch must be a multiple of {WORKERS} (DP4 pipelines, {WORKERS} DDP workers)")
    args.command = "malleus bench malleable " + " ".join(argv)
    plot_path = args.plot or (PLOT if args.write else None)

    import logging

    import ray

    from malleus_svc.control.demo import same_device
    from malleus_svc.runtime.cluster import start_local_ray

    logging.getLogger("malleus_svc").setLevel(logging.WARNING)
    ddp_skipped = ddp_skip_reason(args.no_ddp)
    if ddp_skipped:
        log(f"[ray-ddp] {ddp_skipped}")
    emulate = [{"device": SLOW_DEVICE, "factor": args.factor, "at_step": args.shift_at, "until_step": None}]
    t_start, args.walls = time.perf_counter(), {}
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {"PYTHONPATH": os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p)}
    start_local_ray(WORKERS, log_to_driver=False, runtime_env={"env_vars": env})
    log(f"schedule: device {SLOW_DEVICE} x{args.factor:g} from step {args.shift_at} to {args.steps}; "
        f"{WORKERS} workers on {os.cpu_count()} cores")
    runs, device = {}, "auto"
    try:
        for title, static in (("static", True), ("malleus", False)):
            t0 = time.perf_counter()
            log(f"[{title}] starting ({'first plan kept' if static else 'measure, re-plan, migrate'})")
            runs[title] = coordinator_run(title, emulate, args, static, device)
            device = same_device(runs[title])      # the pace the first run sized, for every later one
            args.walls[title] = round(time.perf_counter() - t0, 1)
            log(f"[{title}] done in {args.walls[title]:.0f} s")
        if not ddp_skipped:
            t0 = time.perf_counter()
            log(f"[ray-ddp] TorchTrainer, {WORKERS} workers on the same pace, worker {SLOW_DEVICE} "
                f"x{args.factor:g} from step {args.shift_at}")
            runs["ray-ddp"] = ddp_run(emulate, args, device)
            args.walls["ray-ddp"] = round(time.perf_counter() - t0, 1)
            log(f"[ray-ddp] done in {args.walls['ray-ddp']:.0f} s")
    finally:
        ray.shutdown()
    args.walls["total"] = round(time.perf_counter() - t_start, 1)
    s = summarize(runs, emulate, args, ddp_skipped)
    md = render(s, plot_path)
    print(md)
    if plot_path:
        log(f"wrote {plot(s, Path(plot_path))}")
    if args.summary_out:
        with open(args.summary_out, "w") as fh:
            json.dump(s, fh, indent=2, default=str)
    if args.write:
        write_section(md, Path(args.write), "bench:malleable")
        log(f"updated {args.write}")
    return 0
