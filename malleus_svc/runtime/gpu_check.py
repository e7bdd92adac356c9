"""What only a GPU machine can confirm, in one command: `scripts/gpu_check.sh` (or
``python -m malleus_svc.runtime.gpu_check``).

Checks, each against an oracle with a stated tolerance:

  attention-sdpa-bf16   the SDPA fallback of varlen attention in bf16 against fp64 masked attention
                        over the packed row (`reference.masked_attention`), outputs and gradients
  attention-flash       the varlen kernel (flash-attn's, else torch's), as `varlen_causal_attention`
                        calls it, against the same oracle: its error at most twice the bf16 SDPA
                        fallback's, plus 1e-3 (flash-attn's own test rule); CUDA only
  train-bf16            a few training steps on one batch of one device's Engine in mixed
                        precision (fp32 master weights, bf16 working weights and activations:
                        what GPU workers run) against fp32 single-process training
                        (`reference_train`); the loss must fall
  length-sweep          the length sweep as a job on accelerators runs it, on its own device
                        (`length_sweep.device_sweeps`: lengths up to the model's seq_len, bf16
                        kernels, TP 1 and 2 shards, collectives priced): its held-out error on
                        packs it was not fitted on (CPU: TP 2 only, 5 rounds, on the paced clock)
  step-host-syncs       a training step (compiled blocks, bf16) under CUDA's sync debug mode makes at
                        most one call that waits for the GPU, the read that ends it; CUDA only
  collective-host-free  in an NCCL world set up as workers set it up (no blocking wait), a
                        collective queued behind 0.5 s of GPU work returns to the host at once,
                        with the GPU still busy; CUDA only (the NCCL rules on CPU:
                        tests/test_watchdog.py)
  watchdog-abort        the same world, a collective behind 3 s of GPU work under a 1 s watchdog
                        (no op finishes while the host waits in a read): the watchdog aborts the
                        communicators from its thread without deadlocking the waiting host, the
                        call raises PeerLost once the read returns, the world is left, and a new
                        NCCL world built in the same process all-reduces right; CUDA only. A world
                        of one GPU has no peer to lose: that an abort releases a wait on a missing
                        peer needs two
  throttled-clock       device time of an emulated straggler: an Engine at rate 3 on the device's
                        own clock (CUDA: `CudaClock`, events and a sleep kernel; CPU: the paced
                        clock) measures 3x the device time of its healthy steps
  memory-peak           the CUDA allocator's peak over a training step of one device in mixed
                        precision against the meta-device figure (`memory.stage_footprint`):
                        at least its state, at most the model plus the planner's safety margin;
                        CUDA only
  pipeline-2-stage      two processes, one device each, a 2-stage 1F1B pipeline over
                        `P2PTransport` (NCCL on CUDA, gloo on CPU) in fp64 against `reference_train`
  migration             in the same world, `execute_migration` from that pipeline to a TP=2 plan:
                        the state arrives bitwise, and one more step under the new plan equals
                        the reference's third
The last two need two devices (skipped with one GPU).

`--device cpu` runs every check that does not need CUDA on CPU, over gloo (the flash check is then
skipped), so the code paths other than the CUDA calls themselves run in the project's tests. There
the two rows read on the paced clock judge device time only where the host kept the clock's pace; a
host too busy for that makes them inconclusive (skipped, with the figure), never passed or failed.

Prints a table (check | result | figure | tolerance). Exit status: 0 no check failed (skips
allowed), 1 a check failed, 2 bad arguments, 77 (`EXIT_NO_GPU`) no CUDA device and no
`--device cpu`: nothing was checked.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from malleus_svc.config.device import DeviceSpec
from malleus_svc.config.presets import ModelShape, preset
from malleus_svc.config.scenario import Profile
from malleus_svc.plan import Pipeline, Plan, Stage
from malleus_svc.runtime import attention
from malleus_svc.runtime.batch import MicroBatch
from malleus_svc.runtime.datasets import SyntheticVarLen, collate
from malleus_svc.runtime.device_clock import CudaClock, PacedClock, host_cores, make_clock, pace_for
from malleus_svc.runtime.engine import Engine, OptimConfig, ShardState, assemble_full, full_shard_states
from malleus_svc.runtime.length_sweep import default_repeats, device_sweeps
from malleus_svc.runtime.local_world import run_local_world
from malleus_svc.runtime.memory import stage_footprint
from malleus_svc.runtime.migrate import execute_migration, plan_migration
from malleus_svc.runtime.reference import masked_attention, reference_train

EXIT_FAILED, EXIT_NO_GPU = 1, 77
SEED = 1234
OPTIM = OptimConfig(lr=1e-3, grad_clip=1.0)

# Tolerances (see each check).
SDPA_BF16_RTOL = 3e-2          # of each tensor's largest magnitude: bf16 keeps 8 bits (CPU: about 1e-2)
FLASH_FACTOR, FLASH_SLACK = 2.0, 1e-3
TRAIN_BF16_LOSS_RTOL = 1e-2    # per step, relative to the fp32 loss
THROTTLE_RATE, THROTTLE_RTOL = 3.0, 0.10
SWEEP_HELDOUT_RTOL = 0.15      # the length cost's held-out error, as the CPU sweep is held to
EXACT_RTOL, EXACT_ATOL = 1e-5, 1e-7   # fp64 engine against the fp64 reference (the engine tests' bounds)


@dataclass(frozen=True)
class Result:
    check: str
    status: str        # "pass" | "fail" | "skip"
    figure: str
    tolerance: str


def _verdict(ok: bool) -> str:
    return "pass" if ok else "fail"


INCONCLUSIVE = "inconclusive: "


def _inconclusive(check: str, measured: str, tolerance: str) -> Result:
    """A check whose figure is host time because the host did not keep the paced clock's pace
    (CPU only): neither passed nor failed, skipped with what was measured."""
    return Result(check, "skip", f"{INCONCLUSIVE}the host did not keep pace: {measured}", tolerance)


# ---------------------------------------------------------------------------- data
def global_batches(shape: ModelShape, steps: int, micro_batches: int, micro_batch_size: int,
                   seed: int = 7) -> list[list[MicroBatch]]:
    """Packed micro-batches of the synthetic variable-length dataset, sample ids in order."""
    data = SyntheticVarLen(steps * micro_batches * micro_batch_size, shape.seq_len, shape.vocab, seed=seed)
    ids = iter(range(len(data)))
    return [[collate(data, [next(ids) for _ in range(micro_batch_size)]) for _ in range(micro_batches)]
            for _ in range(steps)]


def _loss_tokens(batch: list[MicroBatch]) -> int:
    return sum(mb.num_loss_tokens for mb in batch)


def _one_device_plan(shape: ModelShape, micro_batches: int, micro_batch_size: int) -> Plan:
    return Plan(num_devices=1, num_layers=shape.layers, micro_batch_size=micro_batch_size,
                pipelines=(Pipeline((Stage((0,), (0, shape.layers)),), micro_batches=micro_batches),))


# ---------------------------------------------------------------------------- attention
ATTN_LENGTHS = [1, 37, 128, 128, 5, 300, 64, 37]   # uneven, some repeated (batched together by SDPA)
ATTN_HEADS, ATTN_KV_HEADS, ATTN_DIM = 8, 2, 64      # grouped-query attention


def _attention_error(attend: Callable, device: torch.device) -> float:
    """Largest error of `attend(q, k, v, packing)` in bf16 against fp64 masked attention on the same
    (bf16-rounded) inputs, over the output and the q/k/v gradients, each relative to the largest
    magnitude of its reference tensor."""
    gen = torch.Generator().manual_seed(0)
    tokens = sum(ATTN_LENGTHS)
    inputs = [torch.randn(tokens, h, ATTN_DIM, generator=gen).to(torch.bfloat16)
              for h in (ATTN_HEADS, ATTN_KV_HEADS, ATTN_KV_HEADS)]
    w = torch.randn(tokens, ATTN_HEADS, ATTN_DIM, generator=gen)
    cu = torch.tensor([0, *torch.tensor(ATTN_LENGTHS).cumsum(0).tolist()], dtype=torch.int32)

    def run(fn, dtype):
        q, k, v = (t.to(device=device, dtype=dtype).requires_grad_(True) for t in inputs)
        out = fn(q, k, v)
        grads = torch.autograd.grad((out * w.to(device=device, dtype=dtype)).sum(), (q, k, v))
        return [t.detach().double().cpu() for t in (out, *grads)]

    got = run(lambda q, k, v: attend(q, k, v, attention.Packing(cu, device)), torch.bfloat16)
    ref = run(lambda q, k, v: masked_attention(q, k, v, ATTN_LENGTHS), torch.float64)
    return max(float((g - r).abs().max() / r.abs().max()) for g, r in zip(got, ref))


def check_sdpa_bf16(device: torch.device) -> Result:
    err = _attention_error(attention.sdpa_by_length, device)
    return Result("attention-sdpa-bf16", _verdict(err <= SDPA_BF16_RTOL), f"max rel err {err:.2e}",
                  f"<= {SDPA_BF16_RTOL:g}")


def check_flash(device: torch.device) -> Result:
    name = "attention-flash"
    if device.type != "cuda":
        return Result(name, "skip", "no CUDA" if not torch.cuda.is_available() else "--device cpu", "-")
    backend = attention.attention_backend(device)
    if backend == attention.SDPA:
        return Result(name, "skip", "neither flash-attn nor torch's varlen kernel is here", "-")
    flash = _attention_error(attention.varlen_causal_attention, device)   # bf16 on CUDA: one varlen call
    sdpa = _attention_error(attention.sdpa_by_length, device)
    bound = FLASH_FACTOR * sdpa + FLASH_SLACK
    return Result(name, _verdict(flash <= bound), f"{backend}: max rel err {flash:.2e} (SDPA bf16 {sdpa:.2e})",
                  f"<= {FLASH_FACTOR:g} x SDPA + {FLASH_SLACK:g} = {bound:.2e}")


# ---------------------------------------------------------------------------- one device
def check_train_bf16(device: torch.device, shape: ModelShape, steps: int = 4) -> Result:
    plan = _one_device_plan(shape, micro_batches=2, micro_batch_size=4)
    # one batch again and again: its loss must fall whatever the model (fresh batches need not at
    # first: the small preset's rose over 4 steps in fp32 too)
    batches = global_batches(shape, 1, 2, 4) * steps
    engine = Engine(shape, plan, 0, seed=SEED, optim=OPTIM, device=device, compute_dtype=torch.bfloat16)
    losses = [engine.train_step(batch, _loss_tokens(batch)).global_loss for batch in batches]
    ref, _, _ = reference_train(shape, SEED, OPTIM, batches, torch.float32)
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
    learned = losses[-1] < losses[0] and ref[-1] < ref[0]
    return Result("train-bf16", _verdict(worst <= TRAIN_BF16_LOSS_RTOL and learned),
                  f"loss rel err {worst:.2e} over {steps} steps ({ref[0]:.3f} -> {ref[-1]:.3f})"
                  + ("" if learned else "; loss did not fall"),
                  f"<= {TRAIN_BF16_LOSS_RTOL:g}, and falls")


def check_host_syncs(device: torch.device, shape: ModelShape) -> Result:
    """A training step (compiled blocks, bf16) under CUDA's sync debug mode: every call that makes
    the host wait for the GPU warns; the step may make one, the read that ends it."""
    name = "step-host-syncs"
    if device.type != "cuda":
        return Result(name, "skip", "CUDA only (on CPU: tests/test_engine.py counts the reads on meta)", "-")
    plan = _one_device_plan(shape, micro_batches=2, micro_batch_size=4)
    first, second = global_batches(shape, 2, 2, 4)
    engine = Engine(shape, plan, 0, seed=SEED, optim=OPTIM, device=device, compute_dtype=torch.bfloat16)
    engine.train_step(first, _loss_tokens(first))     # compiles, fills the allocators
    torch.cuda.synchronize(device)
    syncs: list[str] = []

    def seen(message, *_args, **_kwargs) -> None:   # where the host waited: the innermost Python frames
        if "called a synchronizing CUDA operation" in str(message):   # not the mode's own prototype notice
            frames = [f for f in traceback.extract_stack()[:-1] if not f.filename.endswith("warnings.py")]
            syncs.append(" < ".join(f"{Path(f.filename).name}:{f.lineno}" for f in reversed(frames[-3:])))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = seen
        torch.cuda.set_sync_debug_mode("warn")
        try:
            engine.train_step(second, _loss_tokens(second))
        finally:
            torch.cuda.set_sync_debug_mode(0)
    for where in syncs:
        print(f"step-host-syncs: the host waited at {where}", flush=True)
    figure = f"{len(syncs)} in a step" + (f" (first at {syncs[0]})" if syncs else "")
    return Result(name, _verdict(len(syncs) <= 1), figure, "<= 1, the step's end")


HOST_FREE_S = 0.05     # the host's time in a collective queued behind 0.5 s of GPU work


def _collectives_and_abort(rank: int, world: int) -> dict:
    """One rank of an NCCL world of one (run_local_world sets the workers' NCCL environment)."""
    import torch.distributed as dist

    from malleus_svc.runtime.groups import abort_world
    from malleus_svc.runtime.watchdog import PeerLost, Watchdog

    device = torch.device("cuda", rank)
    cycles = CudaClock().cycles_per_second()
    t = torch.ones(1 << 20, device=device)
    torch.cuda.synchronize(device)
    torch.cuda._sleep(int(0.5 * cycles))
    t0 = time.perf_counter()
    dist.all_reduce(t)
    host_s = time.perf_counter() - t0
    busy = not torch.cuda.current_stream(device).query()
    torch.cuda.synchronize(device)

    dog = Watchdog(1.0, abort_world, poll_s=0.05)
    torch.cuda._sleep(int(3 * cycles))
    dist.all_reduce(t)
    t0 = time.perf_counter()
    try:
        with dog.watch("a collective behind 3 s of GPU work"):
            t.sum().item()
        raised = ""
    except PeerLost as e:
        raised = str(e)
    waited_s = time.perf_counter() - t0
    dog.close()
    left = not dist.is_initialized()
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    x = torch.full((4,), 2.0, device=device)
    dist.all_reduce(x)
    return {"host_s": host_s, "busy": busy, "raised": raised, "waited_s": waited_s, "left": left,
            "rebuilt": x.tolist() == [2.0] * 4}


def check_collectives(device: torch.device) -> list[Result]:
    names = ("collective-host-free", "watchdog-abort")
    if device.type != "cuda":
        return [Result(n, "skip", "CUDA only (on CPU: tests/test_watchdog.py, NCCL's rules)", "-") for n in names]
    got = run_local_world(_collectives_and_abort, 1, backend="nccl")[0]
    free = Result(names[0], _verdict(got["host_s"] <= HOST_FREE_S and got["busy"]),
                  f"host {got['host_s'] * 1e3:.1f} ms, GPU {'still busy' if got['busy'] else 'already done'}",
                  f"<= {HOST_FREE_S * 1e3:g} ms, GPU busy")
    ok = bool(got["raised"]) and got["waited_s"] >= 1.0 and got["left"] and got["rebuilt"]
    abort = Result(names[1], _verdict(ok),
                   f"{'raised PeerLost' if got['raised'] else 'did not raise'} after {got['waited_s']:.1f} s; "
                   f"world {'left' if got['left'] else 'still up'}; new world {'works' if got['rebuilt'] else 'broken'}",
                   "raises, leaves the world, a new one works")
    return [free, abort]


# On CUDA the throttled ops must be GPU-bound. A launch-bound op (a small model: the GPU idles
# between kernels while the host launches them) measures its launch time when healthy, but only
# its kernels once the host runs ahead of a GPU busy with an emulated straggler's sleeps, so the
# emulated rate would fall short of the one asked for. This shape keeps an H100 busy (about 2e12
# FLOPs per micro-batch forward of ~4k tokens) in a few GB.
GPU_BOUND_SHAPE = ModelShape(layers=4, hidden=2048, heads=16, ffn=5632, vocab=32000, seq_len=2048)


def check_length_sweep(device: torch.device, shape: ModelShape) -> Result:
    # CPU: one shard on the paced clock, collectives priced: the device clock's rounds
    tps, repeats = ((1, 2), 9) if device.type == "cuda" else ((2,), default_repeats("device", 1))
    _, reports = device_sweeps(shape, tps, seq_len=shape.seq_len, device=device,
                               link_gbps=DeviceSpec().intra_node_gbps, repeats=repeats)
    worst = max(r["test_max_abs_error"] for r in reports.values())
    tolerance = f"<= {SWEEP_HELDOUT_RTOL:g}"
    on_pace = min(r["on_pace"] for r in reports.values())
    if on_pace < 1:   # some mix kept its pace in too few rounds: its time is the host's, not the device's
        return _inconclusive("length-sweep", f"{on_pace:.0%} of the mixes timed at their pace", tolerance)
    return Result("length-sweep", _verdict(worst <= SWEEP_HELDOUT_RTOL),
                  f"held-out max rel err {worst:.1%} (TP {', '.join(map(str, tps))}; "
                  f"packs up to {shape.seq_len} tokens)", tolerance)


def check_throttled_clock(device: torch.device, shape: ModelShape, steps: int = 5) -> Result:
    micro_batch_size = 8 if device.type == "cuda" else 4
    plan = _one_device_plan(shape, micro_batches=2, micro_batch_size=micro_batch_size)
    batches = global_batches(shape, 1, 2, micro_batch_size)[0]
    clock = make_clock(device.type == "cuda")
    engine = Engine(shape, plan, 0, seed=SEED, optim=OPTIM, device=device, clock=clock)
    if isinstance(clock, PacedClock):   # a CPU device keeps a pace the host can hold
        engine.rehearse(sum(mb.num_tokens for mb in batches) // len(batches))
        clock.pace = pace_for([clock.host], host_cores(), 1, utilization=0.4)

    def device_seconds() -> list[float]:
        """Each step's compute ops, the optimizer update left out (a sleep is sized per op kind), of
        the steps whose every op kept its pace: on the paced clock an op that overran takes the
        host's time, not the device's (the CUDA clock's ops always count as kept)."""
        kept = []
        for _ in range(steps):
            ops, on_pace = clock.pace_count.ops, clock.pace_count.on_pace
            seconds = engine.train_step(batches, _loss_tokens(batches)).compute_seconds
            if clock.pace_count.on_pace - on_pace == clock.pace_count.ops - ops:
                kept.append(seconds)
        return kept

    device_seconds()                    # warm-up; the CUDA clock sizes its sleeps from the last read
    healthy = device_seconds()
    clock.rate = THROTTLE_RATE
    engine.train_step(batches, _loss_tokens(batches))
    slow = device_seconds()
    tolerance = f"{THROTTLE_RATE:g}x +- {THROTTLE_RTOL:.0%}"
    if min(len(healthy), len(slow)) < (steps + 1) // 2:
        return _inconclusive("throttled-clock", f"{len(healthy)} healthy and {len(slow)} throttled steps of "
                             f"{steps} kept their pace (needs {(steps + 1) // 2} each)", tolerance)
    ratio = statistics.median(slow) / statistics.median(healthy)
    ok = abs(ratio / THROTTLE_RATE - 1) <= THROTTLE_RTOL
    return Result("throttled-clock", _verdict(ok),
                  f"{ratio:.2f}x ({statistics.median(healthy) * 1e3:.1f} -> {statistics.median(slow) * 1e3:.1f} ms "
                  f"per step on {type(clock).__name__}, medians of {len(healthy)} and {len(slow)} steps)", tolerance)


def _full_micro_batch(shape: ModelShape, sequences: int, gen: torch.Generator, first_id: int) -> MicroBatch:
    """`sequences` random sequences of exactly `seq_len` tokens, the packing `memory` measures."""
    tokens = sequences * shape.seq_len
    ids = torch.randint(shape.vocab, (tokens,), generator=gen)
    return MicroBatch(ids, torch.roll(ids, -1), torch.arange(0, tokens + 1, shape.seq_len, dtype=torch.int32),
                      tuple(range(first_id, first_id + sequences)))


def cuda_peak_bytes(step: Callable[[], object], device: torch.device) -> int:
    """The CUDA allocator's high-water mark over `step` (what it allocated; not the cache or context)."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device)


def check_memory_peak(device: torch.device, shape: ModelShape, sequences: int = 4,
                      peak_of: Callable[[Callable[[], object], torch.device], int] | None = None) -> Result:
    """A one-stage Engine in mixed precision: the allocator's peak over a training step (Adam's
    moments already made) against `memory.stage_footprint`, the meta-device figure the planner is
    held to. The figure leaves out backward's transient gradients (on an H200: twice the fp32 logits
    of a micro-batch, from the loss, plus about two [tokens, ffn] gradients), which the planner's
    safety margin covers: the peak must be at least the modelled state and at most the model plus
    that margin. `peak_of(step, device)` reads the peak (CUDA's allocator by default)."""
    name = "memory-peak"
    if peak_of is None:
        if device.type != "cuda":
            return Result(name, "skip", "needs CUDA's allocator", "-")
        peak_of = cuda_peak_bytes
    gen = torch.Generator().manual_seed(SEED)
    batch = [_full_micro_batch(shape, sequences, gen, i * sequences) for i in range(2)]
    plan = _one_device_plan(shape, micro_batches=len(batch), micro_batch_size=sequences)
    engine = Engine(shape, plan, 0, seed=SEED, optim=OPTIM, device=device, compute_dtype=torch.bfloat16)
    engine.train_step(batch, _loss_tokens(batch))
    peak = peak_of(lambda: engine.train_step(batch, _loss_tokens(batch)), device)
    model = stage_footprint(shape, shape.layers, has_embedding=True, has_head=True, tp=1,
                            micro_batch=sequences).at_depth(1)
    state = model.params + model.grads + model.adam + model.working
    margin = Profile().safety_margin_mb * 2 ** 20
    ok = state <= peak <= model.total + margin
    return Result(name, _verdict(ok),
                  f"peak {peak / 2 ** 30:.2f} GiB vs modelled {model.total / 2 ** 30:.2f} GiB "
                  f"({peak / model.total - 1:+.1%}; state {state / 2 ** 30:.2f} GiB)",
                  f"state <= peak <= model + safety margin {margin / 2 ** 30:.0f} GiB")


# ---------------------------------------------------------------------------- two devices
def two_device_plans(shape: ModelShape) -> tuple[Plan, Plan]:
    """A 2-stage pipeline (device 0 the first half of the blocks, device 1 the rest), and the TP=2
    plan it migrates to (both devices, every block, listed out of order)."""
    half = shape.layers // 2
    pipeline = Plan(num_devices=2, num_layers=shape.layers, micro_batch_size=2,
                    pipelines=(Pipeline((Stage((0,), (0, half)), Stage((1,), (half, shape.layers))),
                                        micro_batches=3),))
    tp_pair = Plan(num_devices=2, num_layers=shape.layers, micro_batch_size=2,
                   pipelines=(Pipeline((Stage((1, 0), (0, shape.layers)),), micro_batches=3),))
    return pipeline, tp_pair


def _pipeline_then_migrate(rank: int, world: int, shape: ModelShape, batches: list[list[MicroBatch]],
                           device_type: str) -> dict:
    """Two steps on the pipeline, the migration to the TP pair, one step there; on every rank."""
    pipeline, tp_pair = two_device_plans(shape)
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    dtype = torch.float64       # exact against the reference (fp64 weights compute in fp64, GPU too)
    engine = Engine(shape, pipeline, rank, seed=SEED, optim=OPTIM, device=device, dtype=dtype)
    losses = [engine.train_step(b, _loss_tokens(b)).global_loss for b in batches[:2]]
    before = engine.export_state()
    schedule = plan_migration(pipeline, tp_pair, shape, itemsize=dtype.itemsize)
    migrated, _ = execute_migration(schedule, rank, before, comm_device=device)
    engine = Engine(shape, tp_pair, rank, seed=SEED + 1, optim=OPTIM, device=device, dtype=dtype)
    engine.load_state(migrated)
    losses.append(engine.train_step(batches[2], _loss_tokens(batches[2])).global_loss)
    return {"losses": losses, "before": before, "migrated": migrated, "after": engine.export_state(),
            "moved_bytes": schedule.moved_bytes, "rounds": schedule.rounds, "backend": str(torch.distributed.get_backend())}


def _max_error(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> tuple[float, bool]:
    """(largest |got - ref| / (atol + rtol |ref|) over every element, whether all are within)."""
    worst = 0.0
    for name, r in ref.items():
        g = got[name].double()
        r = r.double()
        worst = max(worst, float(((g - r).abs() / (EXACT_ATOL + EXACT_RTOL * r.abs())).max()))
    return worst, worst <= 1.0


def check_two_devices(device: torch.device, shape: ModelShape) -> list[Result]:
    names = ("pipeline-2-stage", "migration")
    if device.type == "cuda" and torch.cuda.device_count() < 2:
        why = f"needs 2 GPUs, found {torch.cuda.device_count()}"
        return [Result(n, "skip", why, "-") for n in names]
    backend = "nccl" if device.type == "cuda" else "gloo"
    pipeline, _ = two_device_plans(shape)
    batches = global_batches(shape, 3, pipeline.num_micro_batches, pipeline.micro_batch_size)
    runs = run_local_world(_pipeline_then_migrate, 2, shape, batches, device.type, backend=backend)
    ref_losses, ref_params, ref_optim = reference_train(shape, SEED, OPTIM, batches[:2], torch.float64)
    ref3_losses, ref3_params, ref3_optim = reference_train(shape, SEED, OPTIM, batches, torch.float64)
    tolerance = f"rtol {EXACT_RTOL:g}, atol {EXACT_ATOL:g} (fp64)"

    losses = runs[0]["losses"]
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses[:2], ref_losses))
    err, ok = _max_error(assemble_full(r["before"] for r in runs), {**ref_params, **_moments(ref_optim)})
    pipeline = Result(names[0], _verdict(ok and loss_err <= EXACT_RTOL),
                      f"{runs[0]['backend']}: worst state err {err:.2g} of tol, loss rel err {loss_err:.1e}", tolerance)

    before = full_shard_states(assemble_full(r["before"] for r in runs))
    bitwise = all(_same_rows(st, before[name]) for r in runs for name, st in r["migrated"].items())
    err3, ok3 = _max_error(assemble_full(r["after"] for r in runs), {**ref3_params, **_moments(ref3_optim)})
    loss3 = abs(losses[2] - ref3_losses[2]) / abs(ref3_losses[2])
    migration = Result(names[1], _verdict(bitwise and ok3 and loss3 <= EXACT_RTOL),
                       f"{runs[0]['moved_bytes']} B in {runs[0]['rounds']} rounds, "
                       f"{'bitwise' if bitwise else 'NOT bitwise'}; next step err {err3:.2g} of tol",
                       "bitwise; then " + tolerance)
    return [pipeline, migration]


def _same_rows(shard: ShardState, full: ShardState) -> bool:
    """The shard's parameter and moments equal the full tensors' rows it covers, bit for bit."""
    dim = 0 if shard.dim is None else shard.dim
    return shard.step == full.step and all(
        torch.equal(getattr(shard, f), getattr(full, f).narrow(dim, shard.start, shard.end - shard.start))
        for f in ("param", "exp_avg", "exp_avg_sq"))


def _moments(optim_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The reference's Adam moments (its step counts are integers, compared by the engine tests)."""
    return {k: v for k, v in optim_state.items() if not k.endswith(":step")}


# ---------------------------------------------------------------------------- driver
def run_checks(device: torch.device, shape: ModelShape) -> list[Result]:
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)   # as CPU workers compute: a pace is sized for one thread's work
    try:
        return _run(device, shape)
    finally:
        torch.set_num_threads(threads)


def _run(device: torch.device, shape: ModelShape) -> list[Result]:
    results: list[Result] = []
    checks: list[tuple[str, Callable[[], Result | list[Result]]]] = [
        ("attention-sdpa-bf16", lambda: check_sdpa_bf16(device)),
        ("attention-flash", lambda: check_flash(device)),
        ("train-bf16", lambda: check_train_bf16(device, shape)),
        ("step-host-syncs", lambda: check_host_syncs(device, shape)),
        ("collective-host-free, watchdog-abort", lambda: check_collectives(device)),
        ("length-sweep", lambda: check_length_sweep(device, GPU_BOUND_SHAPE if device.type == "cuda" else shape)),
        ("throttled-clock", lambda: check_throttled_clock(device, GPU_BOUND_SHAPE if device.type == "cuda" else shape)),
        ("memory-peak", lambda: check_memory_peak(device, GPU_BOUND_SHAPE)),
        ("pipeline-2-stage, migration", lambda: check_two_devices(device, shape)),
    ]
    for name, check in checks:
        try:
            got = check()
        except Exception as e:  # noqa: BLE001 - a check that raises is a failed check, the others still run
            traceback.print_exc(file=sys.stderr)
            last = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            got = Result(name, "fail", f"raised {type(e).__name__}: {last[:120]}", "-")
        results.extend(got if isinstance(got, list) else [got])
    return results


def format_table(results: list[Result]) -> str:
    rows = [("check", "result", "figure", "tolerance")] + [(r.check, r.status, r.figure, r.tolerance) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = [" | ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (default): the GPU checks; cpu: every check that does not need CUDA, over gloo")
    p.add_argument("--model", choices=("tiny", "small"), default=None,
                   help="model preset of the training checks (default: small on cuda, tiny on cpu)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"gpu_check: no CUDA GPU is present (torch {torch.__version__}, torch.cuda.is_available() is "
              f"False); nothing checked (exit {EXIT_NO_GPU}). --device cpu runs the checks that need no GPU.")
        return EXIT_NO_GPU
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = args.model or ("small" if device.type == "cuda" else "tiny")
    shape = preset(model)
    label = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"gpu_check on {label}: torch {torch.__version__}, model {model}, "
          f"packed attention: {attention.attention_backend(device)}", flush=True)
    results = run_checks(device, shape)
    print(format_table(results))
    failed = [r.check for r in results if r.status == "fail"]
    print(f"gpu_check: {len(failed)} failed: {', '.join(failed)}" if failed else "gpu_check: no check failed")
    return EXIT_FAILED if failed else 0


if __name__ == "__main__":
    sys.exit(main())
