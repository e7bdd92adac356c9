"""A real length sweep on the CPU: time packed micro-batches through the runtime's own blocks,
fit `LengthCost`, and measure how well it predicts mixes it was not fitted on.

The blocks are `runtime.model.StageModel` (no embedding, no head), so attention is exactly what
the runtime runs on a CPU: one SDPA call per packed sequence (`runtime.attention`). That is why the
model has a per-sequence term d (a block-diagonal mask would cost
(Σl)², per-segment calls cost Σl² plus a call overhead each).

Timing discipline (the machine may be shared with other work): one torch thread
(the stand-in workers each get one core); this thread's CPU time, not the wall clock (with one
thread the forward and the CPU backward both run on it, and time the OS hands to other processes
is not counted); a warm-up pass; `repeats` rounds, each running every mix once in a shuffled
order, each round divided by how slow the machine was during it; per mix, the median of its
faster half of rounds (interference only ever adds time). Medians of plain wall times drifted
by 10-60% between runs under load; this held-out error stayed under 8% in 8 runs at load 3-6.

Range: sequences up to 256 tokens, micro-batches up to 512. Beyond ~384 tokens the CPU SDPA
kernel's time steps irregularly with length (blocking and cache effects: single 512-token
sequences came out 13-22% slower than any a·l² + b·l fit to the rest), which is a property of
that kernel, not of the model; the tiny preset itself trains on sequences of at most 65.

TP degrees. `run_sweep(tp=t)` with t > 1 runs the same sweep on a real TP group: t fresh
processes in a gloo group, each holding its shard of the runtime's own Megatron-sharded blocks
(`runtime.tensor_parallel`), each fed its rows of the same inputs; ranks start every mix together (a
barrier outside the timed region). Each rank measures two parts: compute, its thread CPU time
(gloo reduces on its own threads, so collectives are not in it), and communication, its wall
time inside TP collectives. The group computes as slowly as its slowest rank (max over ranks),
and its collectives cost what the least-waiting rank saw (min over ranks: the others' extra wait
is a peer's lateness, already in the max, or a time slice the OS gave another process). On 2
shared cores the collectives of the tiny model are half its TP-2 time and, per mix, far noisier
than compute (one all-reduce of a few KB takes 0.8-2 ms, set by when the OS wakes both ranks),
so compute gets the full a, b, d, c fit and communication a separate two-coefficient fit over all
mixes (b_comm·Σl + c_comm: every block all-reduces each token's hidden state a fixed number of
times), added to b and c. Fitting the noisy totals with four coefficients gave held-out errors of
17-27% at load 7-12; this split gave 9-15% with 21 repeats. `run_sweeps` fits several degrees
and merges them (`LengthCost.merged`). How many rounds a sweep needs depends on what it reads in
wall time (`default_repeats`): on the paced device clock an op never beats its pace, so compute
alone is exact after a few rounds and only a group's collectives need more.

On an accelerator (`Place`: one of the job's own devices, `device_sweeps`) the sweep runs where the job
trains, not on the head: the job's real lengths (every mix scaled so the longest sequence is the
job's `seq_len`, `mixes_for`), the kernels it runs (bf16 blocks, flash-attn varlen), timed on the
device's clock. Each TP degree t times the shard one rank of a group holds, alone
(`tensor_parallel.LocalShard`: its kernels are a group member's), and the group's collectives are
priced per token by the analytic cost model (`costmodel.analytic.tp_comm_seconds_per_token`): the
devices of a TP group are the job's, busy training, and cannot be borrowed to time them.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import pickle
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from ..lengths.cost import LengthCost, LengthError, nnls
from .rendezvous import listen

Mix = Sequence[int]

# Fitting mixes: lone sequences across the range (the quadratic), many short ones (the per-sequence
# term), equal token counts packed differently (separates a from b), mixed packs as the planner makes.
TRAIN_MIXES: tuple[tuple[int, ...], ...] = (
    (16,), (32,), (64,), (96,), (128,), (192,), (256,),
    (16,) * 4, (16,) * 16, (32,) * 8, (32,) * 16, (64,) * 4, (64,) * 8, (128,) * 2, (128,) * 4, (256,) * 2,
    (256, 64, 32, 16, 16), (256, 128, 64, 32, 16, 16), (192, 192, 64, 64), (160, 96, 48, 24), (96,) * 5, (48,) * 10,
)
MAX_LEN = 256      # longest sequence swept (see run_sweep)
MAX_TOKENS = 512   # largest micro-batch swept


def default_repeats(clock: str, tp: int) -> int:
    """Rounds per mix when a sweep is not told. A group's collectives are wall time on a shared
    CPU: 21 rounds. On the device clock an op never beats its pace, so the fastest of a few rounds
    is its paced time unless the host's load rose past the pace in all of them: 5. The thread and
    wall clocks time compute on a shared CPU too: 9."""
    if tp > 1:
        return 21
    return 5 if clock == "device" else 9


def heldout_mixes(count: int = 10, seed: int = 1, max_tokens: int = MAX_TOKENS, max_len: int = MAX_LEN,
                  median_len: float = 60.0, sigma: float = 1.0, min_len: int = 8) -> list[tuple[int, ...]]:
    """Random long-tailed packs (lognormal lengths, a random token budget), none of them fitted on."""
    rng = random.Random(seed)
    out = []
    while len(out) < count:
        budget = rng.randint(max_tokens // 8, max_tokens)
        mix: list[int] = []
        while True:
            x = int(min(max(round(math.exp(rng.gauss(math.log(median_len), sigma))), min_len), max_len))
            if sum(mix) + x > budget:
                break
            mix.append(x)
        if mix and tuple(mix) not in TRAIN_MIXES:
            out.append(tuple(mix))
    return out


@dataclasses.dataclass(frozen=True)
class Place:
    """Where a sweep runs when it runs on one of the job's own devices: the torch device, the compute
    dtype, and the TP link's GB/s for the collectives. Its clock is the device's kind
    (`device_clock.make_clock`): CUDA events on a GPU, the paced clock on a CPU."""

    device: object
    dtype: object
    link_gbps: float


def mixes_for(seq_len: int) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """The fitting and held-out mixes scaled to a job whose longest sequence is `seq_len` tokens.

    No fitting pack repeats a length: an accelerator's attention makes one call per distinct length
    (`attention.sdpa_by_length`), so a pack of 16 equal sequences would cost one call where real
    packs, whose lengths rarely repeat, cost one per sequence, which is what the planner charges d
    for. (On an H200 a call cost 0.35 ms per block, a tenth of a small pack's time.)"""
    k = seq_len / MAX_LEN

    def scaled(mix: Mix) -> tuple[int, ...]:
        out: list[int] = []
        for x in (max(1, min(seq_len, round(x * k))) for x in mix):
            # the nearest free length within a quarter of x, alternately below and above (the pack's
            # tokens stay about the same); a short sequence with no free neighbour repeats
            near = (x + step * sign for step in range(1, x // 4 + 1) for sign in (-1, 1))
            out.append(next((y for y in near if y <= seq_len and y not in out), x) if x in out else x)
        return tuple(out)

    test = heldout_mixes(max_tokens=round(MAX_TOKENS * k), max_len=seq_len, median_len=60.0 * k,
                         min_len=max(1, round(8 * k)))
    return [scaled(m) for m in TRAIN_MIXES], test


def _make_blocks(shape, layers: int, seed: int, tp=None):
    from .model import StageModel
    from .tensor_parallel import SINGLE
    if layers > shape.layers:
        shape = dataclasses.replace(shape, layers=layers)
    model = StageModel(shape, (0, layers), has_embedding=False, has_head=False, tp=tp or SINGLE)
    model.init_from_seed(seed)
    return model, shape


def time_micro_batches(mixes: Sequence[Mix], shape="tiny", layers: int = 2, repeats: int = 21, warmup: int = 1,
                       seed: int = 0, threads: int = 1, stat: str | None = None, clock: str = "thread",
                       normalise_rounds: bool = True, tp: int = 1) -> list[float]:
    """Seconds of forward + backward of each packed mix through `layers` runtime blocks: the
    `stat` ("median", "min" or "lower_half": the median of the faster half) of `repeats` rounds,
    each round first divided by how slow the machine was during it (`_normalise_rounds`; not
    device time, which load does not stretch); by default `_stat_for(clock)`.

    `clock="thread"` reads this thread's CPU time: with one torch thread the forward and the CPU
    backward both run on it, and time the OS gave to other processes is not counted (on a shared
    2-core machine that is most of the noise). `clock="wall"` reads the wall clock. `clock="device"`
    reads the paced device clock the CPU workers train on (device_clock.py), paced for the host
    after the warm-up, its ops not holding the wall (`PacedClock.hold`): the cost of the emulated
    accelerator, whatever else the machine does. `tp` > 1 times the blocks sharded over a TP group
    of that many processes (module docstring)."""
    comp, comm, _ = _timed_parts(mixes, shape, layers, repeats, warmup, seed, threads, stat, clock,
                                 normalise_rounds, tp)
    return [a + b for a, b in zip(comp, comm)]


def _timed_parts(mixes, shape, layers, repeats, warmup, seed, threads, stat, clock, normalise_rounds, tp,
                 place: Place | None = None) -> tuple[list[float], list[float], float]:
    """(compute, TP communication) seconds of each mix, each part normalised and summarised on its own;
    with a `place`, compute alone, on that device (the collectives are priced, not timed). Third,
    the share of mixes whose compute summary rests on rounds that kept their pace (`_on_pace`)."""
    from ..config.presets import ModelShape, preset
    from ..geometry import tp_divisibility_error
    shape = preset(shape) if not isinstance(shape, ModelShape) else shape
    if repeats < 1:
        raise LengthError("repeats", repeats, "an integer >= 1")
    if clock not in ("thread", "wall", "device"):
        raise LengthError("clock", clock, "'thread' (this thread's CPU time), 'wall' or 'device' (the paced "
                                          "device clock)")
    stat = _stat_for(stat, clock)
    if stat not in _STATS:
        raise LengthError("stat", stat, f"one of {sorted(_STATS)}")
    if not (isinstance(tp, int) and tp >= 1) or tp_divisibility_error(shape, tp):
        raise LengthError("tp", tp, tp_divisibility_error(shape, tp) if isinstance(tp, int) and tp >= 1
                          else "an integer >= 1")
    for mix in mixes:
        if not mix or min(mix) < 1:
            raise LengthError("mix", list(mix), "a non-empty list of positive lengths")
    args = ([tuple(m) for m in mixes], shape, layers, repeats, warmup, seed, threads, clock)
    if place is not None:
        from .tensor_parallel import LocalShard
        parts = _rank_times(*args, tp=LocalShard(tp, 0), place=place)
    else:
        parts = _rank_times(*args) if tp == 1 else _group_times(tp, args)
    out = []
    # Compute as asked. TP collectives are wall time even on the device clock: their fastest round
    # is an outlier as often as not (a few ms either way on a 1-6 ms mix), their faster half's
    # median is not. Device time needs no normalising: an op on pace takes its pace whatever the
    # load, and dividing a round in which others overran would take it below that.
    for times, summary, wall in zip(parts[:2], (stat, "lower_half"), (clock != "device", True)):
        if normalise_rounds and wall and any(x > 0 for t in times for x in t):
            times = _normalise_rounds(times)
        out.append([_STATS[summary](t) for t in times])
    return out[0], out[1], _on_pace(parts[2], stat)


def _on_pace(held: list[list[float]], stat: str) -> float:
    """The share of mixes whose summary is their paced device time. An op on pace takes exactly its
    pace and one that overran takes longer, so the rounds that kept pace are the fastest: the
    summary is paced when enough of them did (the fastest one for "min", the faster half for
    "lower_half", more than half for "median")."""
    def needed(n: int) -> int:
        return {"min": 1, "lower_half": (n + 1) // 2, "median": n // 2 + 1}[stat]
    return sum(sum(h) >= needed(len(h)) for h in held) / len(held)


def _rank_times(mixes, shape, layers, repeats, warmup, seed, threads, clock, tp=None, place: Place | None = None):
    """Per mix, per round: (compute, communication) seconds of this process, or with a TP group
    (`tp`, a `TensorParallel`) the group's (module docstring), and whether the round kept its pace
    (1.0, or 0.0 where the paced clock's op overran and its device time is the host's wall time).
    Every rank builds the same inputs and round orders from `seed`, so they run the same mix at the
    same time. With a `place`, the blocks and inputs live on its device in its dtype and a clock of
    its kind times them."""
    import torch
    import torch.distributed as dist

    from .device_clock import PacedClock, make_clock

    model, shape = _make_blocks(shape, layers, seed, tp)
    tp = model.tp
    where, dtype = (torch.device(place.device), place.dtype) if place else (torch.device("cpu"), torch.float32)
    model = model.to(where, dtype)
    device = make_clock(where.type == "cuda") if place else PacedClock() if clock == "device" else None
    if isinstance(device, PacedClock):
        device.hold = False     # the sweep's wall time is nobody's wait (PacedClock.hold)
    tp.clock = device       # the device's time leaves its TP collectives out
    # (compute, communication) clocks: compute is this thread's CPU time (gloo reduces on its own
    # threads, so collectives are not in it) and communication the wall time inside TP collectives
    # (0 without a group); "wall" puts everything in the first.
    if clock == "thread":
        def now() -> tuple[float, float]:
            return time.thread_time(), tp.comm_seconds
    elif clock == "device":
        elapsed = [0.0]      # device time so far: a clock that only runs inside ops

        def now() -> tuple[float, float]:
            elapsed[0] += sum(device.read().values())
            return elapsed[0], tp.comm_seconds
    else:
        def now() -> tuple[float, float]:
            return time.perf_counter(), 0.0
    gen = torch.Generator().manual_seed(seed)
    inputs = []
    for mix in mixes:
        cu = torch.tensor([0, *[sum(mix[:i + 1]) for i in range(len(mix))]], dtype=torch.int32)
        pos = torch.cat([torch.arange(x) for x in mix])
        x = torch.randn(sum(mix), shape.hidden, generator=gen).to(where, dtype)
        g = torch.randn(sum(mix), shape.hidden, generator=gen).to(where, dtype)
        inputs.append((x, pos.to(where), cu, g))

    def once(i: int) -> tuple[float, float, bool]:
        """(compute, communication) seconds of mix i, and whether its op kept its pace (off the
        paced clock, always)."""
        x, pos, cu, g = inputs[i]
        for p in model.parameters():
            p.grad = None
        rows = slice(*tp.rows(x.shape[0]))          # a TP rank's rows of the stage's input and output
        xr, g = x[rows].detach().requires_grad_(True), g[rows]
        if tp.group is not None:
            dist.barrier(group=tp.group)
        c0, m0 = now()
        kept = device.pace_count.on_pace if isinstance(device, PacedClock) else None
        with device.op("compute", flops=flops[i]) if device else contextlib.nullcontext():
            out = model(xr, pos, cu)
            (out * g).sum().backward()
        c1, m1 = now()
        return c1 - c0, m1 - m0, kept is None or device.pace_count.on_pace > kept

    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        order = list(range(len(mixes)))
        flops = [3 * model.forward_flops(cu) for _, _, cu, _ in inputs]     # forward + backward
        for _ in range(warmup):
            for i in order:
                once(i)
        if isinstance(device, PacedClock):   # paced from here on, at a pace every rank can hold on every mix
            device.pace = _group_pace([_op_cost(device, lambda: once(i)) for i in order], tp)
        rng = random.Random(seed)
        comp = torch.zeros(len(mixes), repeats, dtype=torch.float64)
        comm = torch.zeros_like(comp)
        held = torch.zeros_like(comp)
        for r in range(repeats):
            rng.shuffle(order)
            for i in order:
                comp[i, r], comm[i, r], held[i, r] = once(i)
    finally:
        torch.set_num_threads(old_threads)
    if tp.group is not None:
        # The group computes as slowly as its slowest member; its collectives cost what the least
        # waiting member saw (the others' extra wait is that member's lateness, or a time slice the
        # OS gave another process: counted once, in compute, or not at all).
        dist.all_reduce(comp, op=dist.ReduceOp.MAX, group=tp.group)
        comm.neg_()
        dist.all_reduce(comm, op=dist.ReduceOp.MAX, group=tp.group)
        comm.neg_()
        dist.all_reduce(held, op=dist.ReduceOp.MIN, group=tp.group)   # on pace only if every rank was
    return comp.tolist(), comm.tolist(), held.tolist()


def _op_cost(device, run) -> "HostCost":
    """What the host spent on the one op that `run` times on the (unpaced) `device` clock."""
    from dataclasses import fields

    from .device_clock import HostCost
    before = {f.name: getattr(device.host, f.name) for f in fields(HostCost)}
    run()
    return HostCost(**{name: getattr(device.host, name) - v for name, v in before.items()})


def _group_pace(costs, tp):
    """A pace that every op of `costs` (one per mix, timed while the whole group computed) allows,
    the same on every rank of a TP group: small mixes cost the host more per FLOP than large ones,
    so the costliest op per FLOP, on the costliest rank, sets it."""
    import torch
    import torch.distributed as dist

    from .device_clock import HostCost, host_cores, pace_for
    worst = torch.tensor([max(c.flop_cpu_seconds / c.flops for c in costs),
                          max(c.flop_wall_seconds / c.flops for c in costs)], dtype=torch.float64)
    if tp.group is not None:
        dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=tp.group)
    cpu, wall = worst.tolist()
    cost = HostCost(flops=1.0, flop_cpu_seconds=cpu, flop_wall_seconds=wall, nbytes=1.0, byte_cpu_seconds=1.0)
    return pace_for([cost], host_cores(), 1 if tp.group is None else tp.size)   # processes computing


def _tp_rank_main(argv: list[str]) -> None:
    """One TP rank, run as `python -m malleus_svc.runtime.length_sweep RANK SIZE PORT DIR FD` by
    `_group_times`: join the gloo group (rank 0 serves it on the inherited listening socket FD),
    time (arguments pickled in DIR/args), rank 0 writes the group's times to DIR/times."""
    import datetime

    import torch.distributed as dist

    from .rendezvous import join
    from .tensor_parallel import TensorParallel
    rank, size, port, folder, fd = int(argv[0]), int(argv[1]), int(argv[2]), Path(argv[3]), int(argv[4])
    args = pickle.loads((folder / "args").read_bytes())
    join("gloo", "127.0.0.1", port, rank, size, datetime.timedelta(minutes=10),
         socket.socket(fileno=fd) if rank == 0 else None)
    try:
        times = _rank_times(*args, tp=TensorParallel(size, rank, dist.group.WORLD))
    finally:
        dist.destroy_process_group()
    if rank == 0:
        (folder / "times").write_bytes(pickle.dumps(times))


def _group_times(size: int, args: tuple, timeout_s: float = 900.0):
    """`_rank_times` on a TP group of `size` fresh Python processes. Plain subprocesses, not
    multiprocessing: spawn re-imports the caller's __main__ (a script, a Ray worker), fork is
    unsafe in threaded callers (the coordinator). A rank that fails ends the others (they would
    wait for it in a collective)."""
    root = str(Path(__file__).resolve().parents[2])   # the children import this package from here
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    with tempfile.TemporaryDirectory(prefix="malleus-tp-sweep-") as tmp:
        folder = Path(tmp)
        (folder / "args").write_bytes(pickle.dumps(args))
        procs = []
        with listen("127.0.0.1") as listener:      # rank 0 inherits it and serves the rendezvous there
            port, fd = listener.getsockname()[1], listener.fileno()
            for r in range(size):
                with open(folder / f"rank{r}.log", "wb") as log:
                    procs.append(subprocess.Popen(
                        [sys.executable, "-m", __name__, str(r), str(size), str(port), tmp, str(fd if r == 0 else -1)],
                        stdout=log, stderr=subprocess.STDOUT, env=env, pass_fds=(fd,) if r == 0 else ()))
        deadline = time.monotonic() + timeout_s
        try:
            while any(p.poll() is None for p in procs):
                if any(p.returncode for p in procs) or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if any(p.returncode for p in procs) or not (folder / "times").exists():
            logs = "\n".join(f"rank {r} (exit {p.returncode}): {(folder / f'rank{r}.log').read_text()[-2000:]}"
                             for r, p in enumerate(procs))
            raise RuntimeError(f"TP{size} length sweep failed (or ran past {timeout_s:g} s):\n{logs}")
        return pickle.loads((folder / "times").read_bytes())


def _normalise_rounds(times: list[list[float]]) -> list[list[float]]:
    """Divide each round by how slow the machine was during it.

    A round runs every mix once in well under a second; bursts of load from other processes (or
    a frequency change) last longer and slow a whole round alike. Its factor is the median, over
    mixes, of this round's time over the mix's median time (a two-way multiplicative model, robust
    to a few odd samples). Needs >= 3 mixes and >= 3 rounds; otherwise returns `times` unchanged.
    """
    if len(times) < 3 or min(len(t) for t in times) < 3:
        return times
    base = [statistics.median(t) for t in times]
    rounds = len(times[0])
    factors = [statistics.median(times[i][r] / base[i] for i in range(len(times))) for r in range(rounds)]
    return [[t[r] / factors[r] for r in range(rounds)] for t in times]


def _lower_half(xs: Sequence[float]) -> float:
    """Median of the faster half: interference from other processes only ever adds time."""
    s = sorted(xs)
    return statistics.median(s[:max(1, (len(s) + 1) // 2)])


_STATS = {"median": statistics.median, "min": min, "lower_half": _lower_half}


def _stat_for(stat: str | None, clock: str) -> str:
    """The summary of a mix's rounds: as asked, else "min" on the device clock (an op never beats
    its pace, so interference only adds and the fastest round is the cleanest), else "lower_half"."""
    return stat or ("min" if clock == "device" else "lower_half")


def run_sweep(shape="tiny", *, layers: int = 2, repeats: int | None = None, warmup: int = 1, seed: int = 0,
              train_mixes: Sequence[Mix] | None = None, test_mixes: Sequence[Mix] | None = None,
              threads: int = 1, stat: str | None = None, clock: str = "thread",
              normalise_rounds: bool = True, tp: int = 1, place: Place | None = None) -> tuple[LengthCost, dict]:
    """Time, fit (TP degree `tp`, per layer) and evaluate on held-out mixes (`heldout_mixes`:
    random lognormal packs, none fitted on). On this 2-core machine, with the default rounds on
    the device clock, seconds at TP 1 and tens of seconds at TP 2 (start-up, collectives). Returns
    the model and a report: coefficients, every mix's measured and predicted seconds and relative
    error, and the held-out error summary (`test_max_abs_error`, `test_mean_abs_error`). With a
    `place` (module docstring), `clock` must be "device": the place's clock times compute, and the
    collectives are priced.
    `repeats` (rounds per mix) defaults to `default_repeats`."""
    t0 = time.perf_counter()
    if place is not None and clock != "device":
        raise LengthError("clock", clock, "'device': a sweep on the job's device reads that device's clock")
    if repeats is None:
        repeats = default_repeats(clock, 1 if place is not None else tp)   # a place times no collective
    train = [tuple(m) for m in (train_mixes if train_mixes is not None else TRAIN_MIXES)]
    test = [tuple(m) for m in (test_mixes if test_mixes is not None else heldout_mixes(seed=seed + 1))]
    stat = _stat_for(stat, clock)
    comp, comm, on_pace = _timed_parts(train + test, shape, layers, repeats, warmup, seed, threads, stat, clock,
                                       normalise_rounds, tp, place)
    if place is not None and tp > 1:
        comm = [_priced_comm(shape, tp, mix, layers, place) for mix in train + test]
    measured = [a + b for a, b in zip(comp, comm)]
    m_train, m_test = measured[:len(train)], measured[len(train):]
    model, _ = LengthCost.fit(list(zip(train, comp[:len(train)])), tp=tp, layers=layers)
    if any(comm):   # TP collectives: fitted on their own (module docstring), added to b and c
        model = _with_comm(model, tp, train, comm[:len(train)], layers)
    train_err = [model.predict(m, layers=layers) / y - 1.0 for m, y in zip(train, m_train)]

    def rows(mixes, secs):
        out = []
        for mix, s in zip(mixes, secs):
            p = model.predict(mix, layers=layers)
            out.append({"lengths": list(mix), "tokens": sum(mix), "measured_s": s, "predicted_s": p,
                        "rel_error": p / s - 1.0})
        return out

    test_rows = rows(test, m_test)
    test_err = [abs(r["rel_error"]) for r in test_rows]
    report = {
        "shape": shape if isinstance(shape, str) else dataclasses.asdict(shape), "layers": layers, "tp": tp,
        "repeats": repeats, "threads": threads, "stat": stat, "clock": clock, "normalise_rounds": normalise_rounds,
        # the share of mixes timed at their pace: below 1, some mix kept its pace in too few rounds,
        # and the fit holds host time, not the device's (`_on_pace`)
        "on_pace": on_pace if clock == "device" else None,
        "coeffs_per_layer": model.at(tp).to_dict(),
        "comm_share": sum(comm) / sum(measured),
        "train": rows(train, m_train), "test": test_rows,
        "train_max_abs_error": max(abs(e) for e in train_err),
        "test_max_abs_error": max(test_err) if test_err else None,
        "test_mean_abs_error": sum(test_err) / len(test_err) if test_err else None,
        "seconds": time.perf_counter() - t0,
    }
    return model, report


def _priced_comm(shape, tp: int, mix: Mix, layers: int, place: Place) -> float:
    """Seconds a TP group's collectives take for `mix` through `layers` blocks, by the analytic model."""
    from ..config.presets import ModelShape, preset
    from ..costmodel.analytic import tp_comm_seconds_per_token
    shape = preset(shape) if not isinstance(shape, ModelShape) else shape
    return layers * sum(mix) * tp_comm_seconds_per_token(shape.hidden, tp, place.dtype.itemsize, place.link_gbps)


def _with_comm(model: LengthCost, tp: int, mixes: Sequence[Mix], comm: Sequence[float], layers: int) -> LengthCost:
    """`model` plus the TP collectives' time, b_comm·Σl + c_comm per layer (the collectives move
    every token's hidden state, a fixed number of times per block), least squares in relative
    terms. Communication waits on the OS scheduler on a shared CPU, so each mix's value is far
    noisier than its compute; two coefficients over all mixes average that noise out, where a
    four-coefficient fit of the totals would chase it."""
    x = np.array([[sum(m), 1.0] for m in mixes])
    y = np.array(comm) / layers
    w = 1.0 / np.maximum(y, 1e-12)
    b, c = nnls(x * w[:, None], y * w)
    k = model.at(tp)
    return LengthCost({tp: dataclasses.replace(k, b=k.b + float(b), c=k.c + float(c))}, model.unit)


def device_sweeps(shape, tps: Sequence[int], *, seq_len: int, device, link_gbps: float, layers: int = 2,
                  repeats: int = 9) -> tuple[LengthCost, dict[int, dict]]:
    """`run_sweeps` on one of the job's own devices (module docstring): its lengths up to `seq_len`,
    its compute dtype and kernels, each TP degree's shard alone and the collectives priced at `link_gbps`."""
    import torch

    from .precision import compute_dtype_for
    device = torch.device(device)
    train, test = mixes_for(int(seq_len))
    place = Place(device, compute_dtype_for(device, torch.float32), float(link_gbps))
    return run_sweeps(shape, tps=list(tps), layers=layers, repeats=repeats, clock="device", place=place,
                      train_mixes=train, test_mixes=test)


def run_sweeps(shape="tiny", tps: Sequence[int] = (1, 2), **kwargs) -> tuple[LengthCost, dict[int, dict]]:
    """`run_sweep` once per TP degree (each on its own group, or its shard on a `place`), merged into
    one `LengthCost`. Returns the model and each degree's report (held-out error per degree)."""
    if not tps:
        raise LengthError("tps", list(tps), "at least one TP degree")
    model, reports = None, {}
    for t in sorted(set(tps)):
        m, reports[t] = run_sweep(shape, tp=t, **kwargs)
        model = m if model is None else model.merged(m)
    return model, reports


if __name__ == "__main__":   # a TP rank of `_group_times`
    _tp_rank_main(sys.argv[1:])
    # Its results are written and its group destroyed: leave without the interpreter's teardown, in
    # which torch 2.13's gloo, after reduce-scatters and all-gathers, now and then ends the process
    # with std::terminate (an exit status the parent would take for a failed rank).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
