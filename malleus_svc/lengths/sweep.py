"""A real length sweep on the CPU: time packed micro-batches through the runtime's own blocks,
fit `LengthCost`, and measure how well it predicts mixes it was not fitted on.

The blocks are `runtime.model.StageModel` (no embedding, no head), so attention is exactly what
the runtime runs on a CPU: one SDPA call per packed sequence (`runtime.attention`). That is why the
model has a per-sequence term d (hydraulis.md §8 "leave out": a block-diagonal mask would cost
(Σl)², per-segment calls cost Σl² plus a call overhead each).

Timing discipline (the machine is shared: 2 cores, other test suites running): one torch thread
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

This fits TP degree 1 only (a CPU process alone). Other TP degrees need the same sweep run on a
real TP group; `LengthCost.merged` combines the fits.
"""
from __future__ import annotations

import dataclasses
import math
import random
import statistics
import time
from typing import Sequence

from .cost import LengthCost, LengthError

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


def _make_blocks(shape, layers: int, seed: int):
    from ..runtime.model import StageModel
    if layers > shape.layers:
        shape = dataclasses.replace(shape, layers=layers)
    model = StageModel(shape, (0, layers), has_embedding=False, has_head=False)
    model.init_from_seed(seed)
    return model, shape


def time_micro_batches(mixes: Sequence[Mix], shape="tiny", layers: int = 2, repeats: int = 21, warmup: int = 1,
                       seed: int = 0, threads: int = 1, stat: str = "lower_half", clock: str = "thread",
                       normalise_rounds: bool = True) -> list[float]:
    """Seconds of forward + backward of each packed mix through `layers` runtime blocks: the
    `stat` ("median", "min" or "lower_half": the median of the faster half) of `repeats` rounds,
    each round first divided by how slow the machine was during it (`_normalise_rounds`).

    `clock="thread"` reads this thread's CPU time: with one torch thread the forward and the CPU
    backward both run on it, and time the OS gave to other processes is not counted (on a shared
    2-core machine that is most of the noise). `clock="wall"` reads the wall clock."""
    import torch

    from ..config.presets import ModelShape, preset
    shape = preset(shape) if not isinstance(shape, ModelShape) else shape
    if repeats < 1:
        raise LengthError("repeats", repeats, "an integer >= 1")
    if clock not in ("thread", "wall"):
        raise LengthError("clock", clock, "'thread' (this thread's CPU time) or 'wall'")
    now = time.thread_time if clock == "thread" else time.perf_counter
    if stat not in _STATS:
        raise LengthError("stat", stat, f"one of {sorted(_STATS)}")
    model, shape = _make_blocks(shape, layers, seed)
    gen = torch.Generator().manual_seed(seed)
    inputs = []
    for mix in mixes:
        if not mix or min(mix) < 1:
            raise LengthError("mix", list(mix), "a non-empty list of positive lengths")
        t = sum(mix)
        cu = torch.tensor([0, *[sum(mix[:i + 1]) for i in range(len(mix))]], dtype=torch.int32)
        pos = torch.cat([torch.arange(x) for x in mix])
        x = torch.randn(t, shape.hidden, generator=gen)
        g = torch.randn(t, shape.hidden, generator=gen)
        inputs.append((x, pos, cu, g))

    def once(i: int) -> float:
        x, pos, cu, g = inputs[i]
        for p in model.parameters():
            p.grad = None
        xr = x.detach().requires_grad_(True)
        t0 = now()
        out = model(xr, pos, cu)
        (out * g).sum().backward()
        return now() - t0

    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        order = list(range(len(mixes)))
        for _ in range(warmup):
            for i in order:
                once(i)
        rng = random.Random(seed)
        times: list[list[float]] = [[] for _ in mixes]
        for _ in range(repeats):
            rng.shuffle(order)
            for i in order:
                times[i].append(once(i))
    finally:
        torch.set_num_threads(old_threads)
    if normalise_rounds:
        times = _normalise_rounds(times)
    return [_STATS[stat](t) for t in times]


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


def run_sweep(shape="tiny", *, layers: int = 2, repeats: int = 21, warmup: int = 1, seed: int = 0,
              train_mixes: Sequence[Mix] | None = None, test_mixes: Sequence[Mix] | None = None,
              threads: int = 1, stat: str = "lower_half", clock: str = "thread",
              normalise_rounds: bool = True) -> tuple[LengthCost, dict]:
    """Time, fit (TP 1, per layer) and evaluate on held-out mixes (`heldout_mixes`: random
    lognormal packs, none fitted on). ~6-12 s on one core with the defaults. Returns the model and a report:
    coefficients, every mix's measured and predicted seconds and relative error, and the held-out
    error summary (`test_max_abs_error`, `test_mean_abs_error`)."""
    t0 = time.perf_counter()
    train = [tuple(m) for m in (train_mixes if train_mixes is not None else TRAIN_MIXES)]
    test = [tuple(m) for m in (test_mixes if test_mixes is not None else heldout_mixes(seed=seed + 1))]
    measured = time_micro_batches(train + test, shape, layers, repeats, warmup, seed, threads, stat, clock,
                                  normalise_rounds)
    m_train, m_test = measured[:len(train)], measured[len(train):]
    model, train_err = LengthCost.fit(list(zip(train, m_train)), tp=1, layers=layers)

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
        "shape": shape if isinstance(shape, str) else dataclasses.asdict(shape), "layers": layers,
        "repeats": repeats, "threads": threads, "stat": stat, "clock": clock, "normalise_rounds": normalise_rounds,
        "coeffs_per_layer": model.at(1).to_dict(),
        "train": rows(train, m_train), "test": test_rows,
        "train_max_abs_error": max(abs(e) for e in train_err),
        "test_max_abs_error": max(test_err) if test_err else None,
        "test_mean_abs_error": sum(test_err) / len(test_err) if test_err else None,
        "seconds": time.perf_counter() - t0,
    }
    return model, report
