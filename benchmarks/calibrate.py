"""`malleus bench calibrate`: fit the simulator's cost coefficients on the real runtime, then
compare its predicted iteration time with the measured one for several hand-built plans.

Set-up: 2 CPU workers (one logical node of 2 devices, one logical CPU each), the `small` preset
(8 blocks), padded fixed-length synthetic data (every micro-batch is `micro × seq_len` tokens, so
compute per micro-batch is constant). The scenario's baseline layout is TP2, so t0 is one block
fwd+bwd for one micro-batch on the TP2 group and tp_alpha = (1, t(TP1) / t(TP2)).

What a pipeline hand-off costs here (measured, see BENCHMARKS.md): the runtime posts an isend and
goes on; the receiver blocks in irecv until the tensor is there. One hand-off of a 128 KiB
activation costs a fraction of a millisecond end to end. What made PP2 (and DP2) slower than
single-device runs predict is not the hand-off but the host: with both devices computing, every
other thread on the host (Ray's, the OS's, other jobs') is taken out of a worker's compute, while
a single-device run leaves a core to them (measured on a host with as many cores as devices). A
replay of measured PP2 steps (instrumented workers, quiet machine) through the 1F1B graph with
each op's measured wall time and zero hand-off reproduces the measured schedule to 0.5-4%; with
each op's thread CPU time it is 4-21% short.

The clock (`--clock`). By default (`device`) the workers run on the emulated-accelerator device
clock (runtime/device_clock.py): after the group starts, one pace is sized from a rehearsal under a
DP2 plan (`WorkerGroup.pace`, both devices computing at once) and kept for the whole bench, so every
plan runs on the same emulated device. A paced op computes, then waits without a core until its
nominal time: two devices no longer slow each other down, κ should fit to about 0 and compute,
optimizer and hand-off alone should predict every plan. `host` runs the workers unpaced, as before
the clock existed: what follows about κ is about that mode.

So the simulator has two physical terms besides compute and gradient reduction, each measured
directly or fitted on runs that are not the evaluated plans:
  * hand-off latency per micro-batch per boundary, forward (activation, device 0 → 1) and
    backward (gradient, 1 → 0): fixed cost + bytes / bandwidth, measured by a ping-pong of
    isend / blocking irecv over gloo between two processes (the runtime's transport pattern) at
    three message sizes, evaluated at the runtime's boundary tensor (micro × seq_len × hidden
    fp32); a delay on no stream (`SimOptions.handoff`);
  * co-run interference κ (`SimOptions.corun_slowdown`): while the other device of the node
    computes (another stage or pipeline), compute runs 1 + κ times longer; fitted by 1-D least
    squares (relative residuals) through the simulator on the profiling runs in which both
    devices compute at once.

Profiling and fit, in this order:
  1. links, between two fresh processes before the workers start: the hand-off ping-pong, and
     the gradient all-reduce of a DP2 plan (the whole model's fp32 gradient in one buffer, as
     GradientSync sends it), whose lower quartile / 8 blocks is grad_sync_per_block;
  2. single-stage runs at TP1 (device 1 suspended) and TP2 for m = 2, 6, 10: least squares on
     T = m·L·t_g + opt·L·(tp/g) + D gives t1, t2, the optimizer seconds per full-TP block and D,
     a per-iteration constant the simulator does not model (fit A: D = 0; fit B: D fitted);
  3. κ from five runs in which both devices compute at once: PP2 (blocks 3/5, m = 4 and 10;
     5/3, m = 6) and DP2 (m = 2/2 and 6/6). Each run alone gives κ to about ±0.1 (the machine's
     speed drifts by several percent from minute to minute), which moves a PP2 prediction by ±6%.

Measuring: every plan (profiling and validation) is measured in each of `--rounds` interleaved
rounds (apply the plan, one warm-up step, `--steps` timed steps; odd rounds in reverse order), so
the fit and the validation see the same machine. The estimate of a plan's iteration time is the
10th percentile of all its timed steps (`ESTIMATOR`): on a shared machine other processes only
ever add time, so a low quantile is the plan's own time, and the 10th percentile is a far steadier
statistic than the minimum (one lucky step no longer decides a whole plan). The minimum, the fit
on minima and its errors are shown beside it, with the median, the 1-minute load average over the
plan's steps (the bench's own two busy workers count about 2 of it) and the busiest device's
compute thread CPU time at the fastest step (wall − CPU: waiting, and time other threads took).

Validation (plans not used in the fit): uniform PP2, uneven-layers PP2, DP2 uneven data,
TP2 vs split (TP1 with the other device suspended), each at m = 8 (DP: 5 + 3). Reported:
`simulate(plan, problem).iteration_seconds` and its error (fit A), fit B's `simulate() + D`.
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from malleus_svc.plan import Pipeline, Plan, Stage
from malleus_svc.runtime.rendezvous import join, listen
from .planner import write_section
from .ranks import kendall, spearman

LAYERS = 8       # the `small` preset
DEVICES = 2
TARGET = 0.15
# The iteration-time statistic of the fit and the validation. Up to run 10 it was the minimum, which
# let one plan's luckiest step decide; rescoring runs 6-10 offline with the 10th percentile brought
# the worst error per run from 5.9-16.2% to 5.1-11.1%. Runs 11+ were measured with it.
ESTIMATOR = "q10"
# Micro-batch counts of the single-stage profiling runs. They bracket the validation plans' m = 8,
# so the compute fit interpolates: an independent error σ in each run's estimate becomes 1.5σ at
# m = 8 when extrapolated from m = 2, 4, 6 (the slope's error times the lever arm), 0.7σ from 2, 6, 10.
SINGLE_M = (2, 6, 10)


# ----------------------------------------------------------------------------- plans
def make_plan(pipes, suspended=(), micro_batch_size: int = 1) -> Plan:
    """pipes: [([(devices, (start, end)), ...], micro_batches), ...] on 2 devices, 1 node, 8 blocks."""
    return Plan(num_devices=DEVICES, num_layers=LAYERS, micro_batch_size=micro_batch_size, gpus_per_node=DEVICES,
                pipelines=tuple(Pipeline(tuple(Stage(tuple(d), tuple(l)) for d, l in stages), m)
                                for stages, m in pipes),
                suspended=tuple(suspended))


def single_stage(group: int, m: int, mbs: int = 1) -> Plan:
    if group == 2:
        return make_plan([([((0, 1), (0, LAYERS))], m)], micro_batch_size=mbs)
    return make_plan([([((0,), (0, LAYERS))], m)], suspended=(1,), micro_batch_size=mbs)


def pp2(split: int, m: int, mbs: int = 1) -> Plan:
    return make_plan([([((0,), (0, split)), ((1,), (split, LAYERS))], m)], micro_batch_size=mbs)


def dp2(m0: int, m1: int, mbs: int = 1) -> Plan:
    return make_plan([([((0,), (0, LAYERS))], m0), ([((1,), (0, LAYERS))], m1)], micro_batch_size=mbs)


def profile_plans(mbs: int = 1) -> dict[str, tuple[str, Plan]]:
    """name -> (kind, plan); kind: 'single' (compute fit) or 'corun' (κ: both devices compute at once)."""
    out: dict[str, tuple[str, Plan]] = {}
    for g in (1, 2):
        for m in SINGLE_M:
            out[f"tp{g} 1-stage m={m}"] = ("single", single_stage(g, m, mbs))
    out["PP2 3/5 m=4"] = ("corun", pp2(3, 4, mbs))
    out["PP2 5/3 m=6"] = ("corun", pp2(5, 6, mbs))
    out["PP2 3/5 m=10"] = ("corun", pp2(3, 10, mbs))
    out["DP2 m=2/2"] = ("corun", dp2(2, 2, mbs))
    out["DP2 m=6/6"] = ("corun", dp2(6, 6, mbs))
    return out


def pace_plan(mbs: int = 1) -> Plan:
    """The plan the device clock's pace is sized under: both devices run every op kind at once."""
    return dp2(1, 1, mbs)


def validation_plans(mbs: int = 1) -> dict[str, Plan]:
    return {
        "uniform PP2 (4/4 blocks, m=8)": pp2(4, 8, mbs),
        "uneven layers PP2 (2/6 blocks, m=8)": pp2(2, 8, mbs),
        "uneven data DP2 (m=5/3)": dp2(5, 3, mbs),
        "TP2 group (8 blocks, m=8)": single_stage(2, 8, mbs),
        "split: TP1 + 1 suspended (8 blocks, m=8)": single_stage(1, 8, mbs),
    }


# ----------------------------------------------------------------------------- fitting (pure)
@dataclass(frozen=True)
class ComputeFit:
    t1: float              # s, one block fwd+bwd for one micro-batch on 1 device
    t2: float              # s, the same on the TP2 group
    opt_per_block: float   # s, optimizer step of one block at full TP (2); a TP1 device pays 2x
    dispatch: float        # s, per-iteration constant outside the simulator
    residual_rms: float


@dataclass(frozen=True)
class Terms:
    """The simulator's terms besides compute, in seconds (converted to t0 units in calibrated_problem)."""
    handoff: tuple[float, float] = (0.0, 0.0)   # s per micro-batch per boundary: (activation, gradient)
    corun: float = 0.0                           # κ, dimensionless
    sync: float = 0.0                            # s per block: all-reduce of a whole block's gradient
                                                 # (a holder in a TP group of g reduces its 1/g shard)
    p2p: float = 0.0                             # s per boundary per micro-batch on the sender (CommCosts): 0 here,
                                                 # the runtime's sender does not block (see the hand-off)
    overlap: bool = True                         # the runtime reduced behind the last backward (the recorded
                                                 # runs 6-20 predate that: they reduced after it)


@dataclass(frozen=True)
class Handoff:
    """Ping-pong fit per direction: one-way seconds = fixed + bytes / bandwidth."""
    fixed: tuple[float, float]       # s (0 → 1, 1 → 0)
    bandwidth: tuple[float, float]   # bytes / s
    sizes: tuple[int, ...] = ()
    q25: tuple[tuple[float, ...], tuple[float, ...]] = ((), ())       # s per size, per direction (the fit's data)
    median: tuple[tuple[float, ...], tuple[float, ...]] = ((), ())    # s per size, per direction (shown)

    def seconds(self, nbytes: int) -> tuple[float, float]:
        return tuple(max(0.0, f + nbytes / b) if b > 0 else max(0.0, f) for f, b in zip(self.fixed, self.bandwidth))


def fit_compute(rows: Sequence[tuple[int, int, int, float]], tp: int = 2, constant: bool = True) -> ComputeFit:
    """Least squares on single-stage runs. rows: (group size g in {1, tp}, blocks L, micro-batches m,
    measured iteration seconds). Model: T = m·L·t_g + opt·L·(tp/g) + D, with D = 0 when not
    `constant` (every second then lands in a term the simulator has)."""
    A, y = [], []
    for g, L, m, T in rows:
        if g not in (1, tp):
            raise ValueError(f"group size {g} is neither 1 nor {tp}")
        A.append([m * L if g == 1 else 0.0, m * L if g == tp else 0.0, L * tp / g] + ([1.0] if constant else []))
        y.append(T)
    A, y = np.asarray(A, float), np.asarray(y, float)
    if np.linalg.matrix_rank(A) < A.shape[1]:
        raise ValueError("the runs do not determine t1, t2, optimizer (and constant): need >= 2 micro-batch "
                         "counts per group size and both group sizes, with different tp/g·L")
    coef, *_ = np.linalg.lstsq(A, y, rcond=None)
    res = y - A @ coef
    coef = [float(c) for c in coef] + ([] if constant else [0.0])
    return ComputeFit(*coef, residual_rms=float(np.sqrt(np.mean(res ** 2))))


def fit_line(sizes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """(fixed s, bandwidth bytes/s) of seconds ≈ fixed + size / bandwidth; bandwidth inf if flat."""
    x, y = np.asarray(sizes, float), np.asarray(seconds, float)
    if len(set(x.tolist())) < 2:
        raise ValueError("need at least two message sizes to separate fixed cost and bandwidth")
    slope, fixed = np.polyfit(x, y, 1)
    return float(fixed), (float(1.0 / slope) if slope > 0 else math.inf)


def fit_monotone(f: Callable[[float], float], lo: float = 0.0, hi: float = 4.0, tol: float = 1e-5) -> float:
    """argmin of a unimodal f on [lo, hi] by golden section (the κ fit's sum of squared errors)."""
    g = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = f(c), f(d)
    while b - a > tol:
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = f(d)
    return min((lo, (a + b) / 2, hi), key=f)   # an end point when the minimum lies there


def scenario_dict(fit: ComputeFit, mbs: int, seq_len: int) -> dict:
    """The calibrated scenario, TP slowdown left at its neutral [1, 1]: `calibrated_problem` sets the
    measured one on the problem itself (a CPU's TP1 block can beat its TP2 one, see there)."""
    return {"name": "calibrated-cpu", "cluster": {"nodes": 1, "gpus_per_node": DEVICES, "gpu_memory_mb": 16000},
            "model": "small", "parallel": {"dp": 1, "tp": 2, "pp": 1},
            "batch": {"global": 8 * mbs, "micro": mbs},
            "profile": {"tp_alpha": [1.0, 1.0], "t0_seconds": fit.t2}}


def calibrated_problem(fit: ComputeFit, mbs: int, seq_len: int, terms: Terms = Terms()):
    """(PlannerProblem, SimOptions) carrying the fitted coefficients (in t0 units)."""
    import dataclasses

    from malleus_svc.config.scenario import Scenario
    from malleus_svc.costmodel.profile import CommCosts
    from malleus_svc.planner.build import build_problem
    from malleus_svc.simulate.timeline import SimOptions

    sc = Scenario.from_dict(scenario_dict(fit, mbs, seq_len))
    t0 = fit.t2
    comm = CommCosts(p2p_intra_node=terms.p2p / t0, p2p_inter_node=terms.p2p / t0, grad_sync_per_block=terms.sync / t0)
    # The measured slowdown of a halved group goes on the problem, not through the scenario file: on
    # the host clock, two workers sharing two cores made a TP1 block faster than a TP2 one
    # (t1/t2 = 0.70-0.80 in runs 9 and 16), which a scenario may not say (tp_alpha >= 1 there: on
    # accelerators a halved group does the same work on half the devices).
    problem = dataclasses.replace(build_problem(sc, comm=comm), tp_alpha=(1.0, fit.t1 / fit.t2),
                                  optimizer_per_block=max(0.0, fit.opt_per_block) / t0)
    return problem, SimOptions(handoff=(terms.handoff[0] / t0, terms.handoff[1] / t0),
                               corun_slowdown=terms.corun, overlap_grad_reduce=terms.overlap)


def sim_seconds(plan: Plan, fit: ComputeFit, mbs: int, seq_len: int, terms: Terms = Terms()) -> float:
    from malleus_svc.simulate.timeline import simulate

    problem, opts = calibrated_problem(fit, mbs, seq_len, terms)
    return simulate(plan, problem, options=opts).iteration_seconds


def fit_corun(runs: Sequence[tuple[Plan, float]], fit: ComputeFit, mbs: int, seq_len: int, terms: Terms) -> float:
    """κ minimising Σ ((simulate(κ) + D − T) / T)² over the runs (relative: runs of different lengths
    count alike). Each simulated time grows monotonically and nearly linearly with κ, so the
    objective is close to a parabola, which the golden-section search needs (unimodal)."""
    import dataclasses

    def sse(k: float) -> float:
        t = dataclasses.replace(terms, corun=k)
        return sum(((sim_seconds(p, fit, mbs, seq_len, t) + fit.dispatch - T) / T) ** 2 for p, T in runs)

    return fit_monotone(sse)


def calibrate_from(prof: dict, mbs: int, seq_len: int, constant: bool, handoff: tuple[float, float] = (0.0, 0.0),
                   sync: float = 0.0, overlap: bool = True) -> tuple[ComputeFit, Terms]:
    """(compute fit, terms) from profiling results {name: (kind, plan, seconds)} and the measured
    hand-off seconds (activation, gradient) at the runtime's boundary tensor and gradient
    all-reduce seconds per block: compute from the 'single' runs, then κ from the 'corun' runs."""
    import dataclasses

    rows = [(plan.pipelines[0].stages[0].tp, LAYERS, plan.pipelines[0].micro_batches, T)
            for kind, plan, T in prof.values() if kind == "single"]
    fit = fit_compute(rows, constant=constant)
    terms = Terms(handoff=tuple(handoff), sync=sync, overlap=overlap)
    corun = [(plan, T) for kind, plan, T in prof.values() if kind == "corun"]
    if corun:
        terms = dataclasses.replace(terms, corun=fit_corun(corun, fit, mbs, seq_len, terms))
    return fit, terms


# ----------------------------------------------------------------------------- measuring
@dataclass
class Samples:
    """Timed steps of one plan over all rounds."""
    times: list[float] = field(default_factory=list)    # driver's iteration seconds
    loads: list[float] = field(default_factory=list)    # 1-minute load average after each step
    cpu: list[float] = field(default_factory=list)      # busiest device's compute thread CPU seconds
    pace_ops: int = 0                                     # paced ops in the timed steps (device clock)
    pace_on: int = 0                                      # of which computed within their device time

    QUANTILES = {"min": 0.0, "q10": 0.1, "q25": 0.25, "median": 0.5}

    def stat(self, which: str = ESTIMATOR) -> float:
        return float(np.quantile(self.times, self.QUANTILES[which]))

    def summary(self) -> dict:
        i = int(np.argmin(self.times))
        return {"min_s": self.stat("min"), "q10_s": self.stat("q10"), "q25_s": self.stat("q25"),
                "median_s": self.stat("median"),
                "steps": len(self.times), "load1_min": min(self.loads), "load1_max": max(self.loads),
                "cpu_at_min_s": self.cpu[i], "times_s": list(self.times),
                "pace_ops": self.pace_ops, "pace_held": self.pace_held()}

    def pace_held(self) -> float | None:
        return self.pace_on / self.pace_ops if self.pace_ops else None


def measure_rounds(group, plans: dict[str, Plan], shape, sampler, rounds: int, steps: int, optim,
                   log=None) -> dict[str, Samples]:
    """Every plan, `rounds` times in turn: apply it, one warm-up step, `steps` timed steps. Interleaving
    puts the profiling and validation runs under the same machine load."""
    out = {name: Samples() for name in plans}
    last: dict[int, tuple[int, int]] = {}   # per device, its cumulative (paced ops, on pace)
    for r in range(rounds):   # odd rounds backwards: a drift in machine load does not favour one end
        for name, plan in (list(plans.items()) if r % 2 == 0 else list(plans.items())[::-1]):
            if log:
                log(f"round {r + 1}/{rounds}: {name}")
            group.apply_plan(plan, shape, seed=0, optim=optim)
            for k in range(steps + 1):
                ids = [sampler.next_index() for _ in range(plan.global_batch)]
                rec = group.step(ids)
                ops, on = pace_delta(last, rec.devices)
                if k:
                    out[name].pace_ops += ops
                    out[name].pace_on += on
                    out[name].times.append(rec.iteration_seconds)
                    out[name].loads.append(os.getloadavg()[0])
                    out[name].cpu.append(max(float(s.get("compute_seconds") or 0.0) for s in rec.devices.values()))
    return out


def pace_delta(last: dict[int, tuple[int, int]], reports: dict[int, dict]) -> tuple[int, int]:
    """(paced ops, on pace) since each reporting device's previous report; `last` is updated. The
    workers' counts are cumulative; a report is read before the step's update, so an update is
    counted with the next step (a plan's first timed step carries its warm-up's update)."""
    ops = on = 0
    for d, r in reports.items():
        now = (int(r.get("pace_ops") or 0), int(r.get("pace_on") or 0))
        before = last.get(d, (0, 0))
        ops, on = ops + now[0] - before[0], on + now[1] - before[1]
        last[d] = now
    return ops, on


def pace_group(group, plan: Plan, shape, tokens: int, optim):
    """Pace every worker once, sized from a rehearsal under `plan` (both devices computing the whole
    model at once): every plan then runs on the same emulated device. The pace is the workers'
    clock's, which outlives the Engine that apply_plan rebuilds, so it holds for every later plan."""
    group.apply_plan(plan, shape, seed=0, optim=optim)
    return group.pace(tokens)


class _Sampler:
    def __init__(self, n: int):
        self.n, self.i = n, 0

    def next_index(self) -> int:
        self.i = (self.i + 1) % self.n
        return self.i


class LinkPeer:
    """One side of the link measurements between the two cores: its own gloo world of two
    processes. `pingpong`: the runtime's transport pattern (isend posted, blocking irecv, sends
    waited for at the end); timestamps are CLOCK_MONOTONIC (time.perf_counter), common to the
    processes of one machine, so one-way times are exact. `allreduce`: the gradient reduction of
    a DP2 plan (one flat fp32 buffer of the whole model, as GradientSync sends it)."""

    def __init__(self, rank: int):
        import torch

        torch.set_num_threads(1)
        self.rank = rank

    def endpoint(self) -> tuple[str, int]:
        """Rank 0: the rendezvous address, listening until `init` hands it to the store."""
        self.listener = listen("127.0.0.1")
        return "127.0.0.1", self.listener.getsockname()[1]

    def init(self, addr: str, port: int) -> bool:
        join("gloo", addr, port, self.rank, 2, datetime.timedelta(minutes=5), getattr(self, "listener", None))
        return True

    def pingpong(self, sizes: Sequence[int], repeats: int, warmup: int = 5) -> dict[int, list[tuple[float, float]]]:
        """{bytes: [(post of my send, completion of my receive), ...]} per round trip."""
        import torch
        import torch.distributed as dist

        out = {}
        peer = 1 - self.rank
        for n in sizes:
            send = torch.randn(n // 4)
            recv = torch.empty(n // 4)
            marks, pending = [], []
            for k in range(warmup + repeats):   # sends are waited for at the end, as P2PTransport.finish()
                if self.rank == 0:
                    t_post = time.perf_counter()
                    pending.append(dist.isend(send, dst=peer, tag=2 * k))
                    dist.irecv(recv, src=peer, tag=2 * k + 1).wait()
                    t_done = time.perf_counter()
                else:
                    dist.irecv(recv, src=peer, tag=2 * k).wait()
                    t_done = t_post = time.perf_counter()
                    pending.append(dist.isend(send, dst=peer, tag=2 * k + 1))
                if k >= warmup:
                    marks.append((t_post, t_done))
            for w in pending:
                w.wait()
            out[n] = marks
        return out

    def allreduce(self, floats: int, repeats: int, warmup: int = 2) -> list[float]:
        """Seconds of each all-reduce of `floats` fp32 elements, started after a barrier."""
        import torch
        import torch.distributed as dist

        buf = torch.randn(floats)
        out = []
        for k in range(warmup + repeats):
            dist.barrier()
            t = time.perf_counter()
            dist.all_reduce(buf)
            if k >= warmup:
                out.append(time.perf_counter() - t)
        return out

    def close(self) -> bool:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        return True


def one_way(marks: dict[int, dict[int, list[tuple[float, float]]]]) -> dict[int, tuple[list[float], list[float]]]:
    """{bytes: (0 → 1 seconds, 1 → 0 seconds)} from both peers' (post, done) marks: a message
    from 0 is received by 1 at done₁, posted at post₀; the reply the other way."""
    out = {}
    for n in marks[0]:
        a, b = marks[0][n], marks[1][n]
        out[n] = ([db - pa for (pa, _), (_, db) in zip(a, b)], [da - pb for (_, da), (pb, _) in zip(a, b)])
    return out


def fit_handoff(one: dict[int, tuple[list[float], list[float]]]) -> Handoff:
    """Per direction, a line through the lower quartiles of the one-way times of each size: the
    hand-off when the receiving thread gets a core at once, which is what the minimum iteration
    times (the estimate used) see. The median is kept beside it: on a loaded machine a woken
    receiver waits for the scheduler, milliseconds in the tail."""
    sizes = tuple(sorted(one))
    q25 = tuple(tuple(float(np.quantile(one[n][d], 0.25)) for n in sizes) for d in (0, 1))
    med = tuple(tuple(float(statistics.median(one[n][d])) for n in sizes) for d in (0, 1))
    lines = [fit_line(sizes, q25[d]) for d in (0, 1)]
    return Handoff(fixed=(lines[0][0], lines[1][0]), bandwidth=(lines[0][1], lines[1][1]), sizes=sizes,
                   q25=q25, median=med)


def measure_links(sizes: Sequence[int], repeats: int, grad_floats: int,
                  reduce_repeats: int = 20) -> tuple[Handoff, list[float]]:
    """(hand-off fit, all-reduce seconds of `grad_floats` per repeat: the slower rank's) between two
    fresh processes (Ray actors, no CPU reserved: they run before the workers start)."""
    import ray

    actor = ray.remote(num_cpus=0)(LinkPeer)
    peers = [actor.remote(r) for r in (0, 1)]
    try:
        addr, port = ray.get(peers[0].endpoint.remote())
        ray.get([p.init.remote(addr, port) for p in peers], timeout=120)
        marks = ray.get([p.pingpong.remote(list(sizes), repeats) for p in peers], timeout=300)
        reduce = ray.get([p.allreduce.remote(grad_floats, reduce_repeats) for p in peers], timeout=300)
        ray.get([p.close.remote() for p in peers], timeout=60)
    finally:
        for p in peers:
            ray.kill(p)
    return fit_handoff(one_way({0: marks[0], 1: marks[1]})), [max(a, b) for a, b in zip(*reduce)]


def model_floats(shape) -> int:
    """Parameters (= gradient elements) of the whole model: what a DP2 plan of TP1 stages all-reduces."""
    from malleus_svc.geometry import model_parts, part_tensors

    return sum(t.numel for p in model_parts(shape.layers) for t in part_tensors(shape, p))


def boundary_bytes(mbs: int, seq_len: int, hidden: int, itemsize: int = 4) -> int:
    """Bytes of one stage-boundary tensor (activation or its gradient): micro × seq_len × hidden, fp32."""
    return mbs * seq_len * hidden * itemsize


def run(steps: int, rounds: int, mbs: int, seq_len: int, repeats: int = 100,
        clock: str = "device") -> tuple[dict, list[dict]]:
    from malleus_svc.config.presets import PRESETS
    from malleus_svc.runtime.cluster import WorkerGroup
    from malleus_svc.runtime.engine import OptimConfig

    def log(msg: str) -> None:
        print(f"[bench calibrate] {msg}", file=sys.stderr, flush=True)

    shape = PRESETS["small"]
    nbytes = boundary_bytes(mbs, seq_len, shape.hidden)
    floats = model_floats(shape)
    log(f"links: hand-off ping-pong ({nbytes} B boundary tensor), all-reduce of {floats} fp32 ...")
    hand, reduce = measure_links((nbytes // 4, nbytes, 4 * nbytes), repeats, floats)
    handoff_s = hand.seconds(nbytes)
    sync_s = float(np.quantile(reduce, 0.25)) / LAYERS   # embedding and head folded in, as in t1
    spec = {"source": "synthetic", "seq_len": seq_len, "num_samples": 1024, "vocab": shape.vocab, "seed": 0}
    sampler = _Sampler(1024)
    optim = OptimConfig()
    profiles = profile_plans(mbs)
    valid = validation_plans(mbs)
    plans = {**{n: p for n, (_, p) in profiles.items()}, **valid}
    t_start = time.time()
    with WorkerGroup(DEVICES, DEVICES) as group:
        group.set_data(spec, "pad", seq_len)
        pace = None
        if clock == "device":
            pace = pace_group(group, pace_plan(mbs), shape, mbs * seq_len, optim)
            log(f"device clock: {pace.flops_per_second / 1e9:.2f} GFLOP/s, {pace.bytes_per_second / 1e9:.2f} GB/s")
        samples = measure_rounds(group, plans, shape, sampler, rounds, steps, optim, log)
    unpaced = [n for n, s in samples.items() if pace is not None and not s.pace_ops]
    if unpaced:   # the pace was lost on the way (a rebuilt clock): the figures would be host time
        raise RuntimeError(f"device clock: no paced ops in {unpaced}")
    prof = {n: (kind, p, samples[n].stat()) for n, (kind, p) in profiles.items()}
    fits = {c: calibrate_from(prof, mbs, seq_len, constant=c, handoff=handoff_s, sync=sync_s,
                              overlap=optim.overlap_grad_reduce) for c in (False, True)}
    prof_min = {n: (kind, p, samples[n].stat("min")) for n, (kind, p) in profiles.items()}
    by_min = calibrate_from(prof_min, mbs, seq_len, constant=False, handoff=handoff_s, sync=sync_s,
                            overlap=optim.overlap_grad_reduce)
    coeffs = {("with_constant" if c else "simulator_terms"): _coeff_dict(*f) for c, f in fits.items()}
    coeffs["simulator_terms_by_min"] = _coeff_dict(*by_min)
    coeffs["estimator"] = ESTIMATOR
    coeffs["profile"] = {n: samples[n].summary() for n in profiles}
    coeffs["handoff"] = {"boundary_bytes": nbytes, "fixed_s": list(hand.fixed), "bandwidth_Bps": list(hand.bandwidth),
                         "sizes": list(hand.sizes), "q25_s": [list(m) for m in hand.q25],
                         "median_s": [list(m) for m in hand.median],
                         "at_boundary_s": list(handoff_s)}
    coeffs["allreduce"] = {"floats": floats, "seconds": reduce, "q25_s": float(np.quantile(reduce, 0.25)),
                           "median_s": float(np.median(reduce)), "per_block_s": sync_s,
                           "overlapped": optim.overlap_grad_reduce}
    coeffs["measure_seconds"] = time.time() - t_start
    coeffs["clock"] = clock
    if pace is not None:
        ops, on = sum(s.pace_ops for s in samples.values()), sum(s.pace_on for s in samples.values())
        coeffs["pace"] = {"flops_per_second": pace.flops_per_second, "bytes_per_second": pace.bytes_per_second,
                          "sized_under": "DP2 m=1/1", "ops": ops, "held": on / ops}
    out = []
    a, a_terms = fits[False]
    b, b_terms = fits[True]
    for name, plan in valid.items():
        s = samples[name]
        T, T_min = s.stat(), s.stat("min")
        pred = sim_seconds(plan, a, mbs, seq_len, a_terms)
        pred_min = sim_seconds(plan, by_min[0], mbs, seq_len, by_min[1])
        pred_d = sim_seconds(plan, b, mbs, seq_len, b_terms) + b.dispatch
        bare = sim_seconds(plan, a, mbs, seq_len, Terms(sync=a_terms.sync))   # no hand-off, no κ
        out.append({"plan": name, "measured_s": T, "min_s": T_min, "median_s": s.stat("median"),
                    "load1_min": min(s.loads), "load1_max": max(s.loads), "steps": len(s.times),
                    "predicted_s": pred, "error": (pred - T) / T, "error_by_min": (pred_min - T_min) / T_min,
                    "predicted_with_constant_s": pred_d, "error_with_constant": (pred_d - T) / T,
                    "predicted_without_handoff_corun_s": bare, "error_without_handoff_corun": (bare - T) / T,
                    "cpu_at_min_s": s.summary()["cpu_at_min_s"], "times_s": list(s.times),
                    "pace_ops": s.pace_ops, "pace_held": s.pace_held()})
    fitted = [(sim_seconds(p, a, mbs, seq_len, a_terms), samples[n].stat()) for n, (_, p) in profiles.items()]
    coeffs["ranks"] = rank_agreement([(r["predicted_s"], r["measured_s"]) for r in out], fitted)
    return coeffs, out


def rank_agreement(validation: Sequence[tuple[float, float]], fitted: Sequence[tuple[float, float]]) -> dict:
    """Does the simulator (fit A) order plans as the runtime does? Spearman and Kendall over the
    validation plans (not fitted on), and over those with the profiling plans (fitted on) added;
    pairs are (predicted s, measured s)."""
    out = {}
    for name, pairs in (("validation", list(validation)), ("all", list(validation) + list(fitted))):
        pred, meas = [a for a, _ in pairs], [b for _, b in pairs]
        out[name] = {"plans": len(pairs), "spearman": spearman(pred, meas), "kendall": kendall(pred, meas)}
    return out


def _ranks_line(coeffs: dict) -> str:
    r = coeffs.get("ranks")
    if not r:
        return ""
    v, a = r["validation"], r["all"]
    return (f"Rank agreement, simulate() (fit A) vs measured: Spearman {v['spearman']:+.2f}, Kendall "
            f"{v['kendall']:+.2f} over the {v['plans']} validation plans; {a['spearman']:+.2f} / {a['kendall']:+.2f} "
            f"over all {a['plans']} plans (the profiling runs included, which the fit saw).\n\n")


def _coeff_dict(fit: ComputeFit, terms: Terms) -> dict:
    return {"t1_s": fit.t1, "t2_s": fit.t2, "tp_alpha": [1.0, fit.t1 / fit.t2], "t0_seconds": fit.t2,
            "optimizer_per_block_s": fit.opt_per_block, "dispatch_s": fit.dispatch,
            "handoff_s": list(terms.handoff), "corun_slowdown": terms.corun,
            "grad_sync_per_block_s": terms.sync, "fit_rms_s": fit.residual_rms}


def _describe(c: dict) -> str:
    return (f"t0 (TP2 block, 1 micro-batch) = {c['t0_seconds'] * 1e3:.2f} ms, tp_alpha = [1, {c['tp_alpha'][1]:.3f}] "
            f"(TP1 block {c['t1_s'] * 1e3:.2f} ms), optimizer {c['optimizer_per_block_s'] * 1e3:.2f} ms per full-TP "
            f"block{' (negative: used as 0)' if c['optimizer_per_block_s'] < 0 else ''}, co-run interference "
            f"κ = {c['corun_slowdown']:.3f}, grad sync {c['grad_sync_per_block_s'] * 1e3:.2f} ms per block "
            f"(measured), "
            f"unmodelled per-iteration constant D = {c['dispatch_s'] * 1e3:.1f} ms; single-stage fit RMS "
            f"{c['fit_rms_s'] * 1e3:.1f} ms")


def _profile_line(name: str, s: dict) -> str:
    held = f", kept pace {s['pace_held']:.1%}" if s.get("pace_held") is not None else ""
    return (f"{name}: {s['q10_s']:.3f} s (min {s['min_s']:.3f}, load {s['load1_min']:.1f}–{s['load1_max']:.1f}, "
            f"compute {s['cpu_at_min_s']:.3f}{held})")


def _clock_line(coeffs: dict) -> str:
    p = coeffs.get("pace")
    if not p:
        return "Clock: host (workers unpaced, sharing the host's cores).\n\n"
    return (f"Clock: device. One pace for the whole bench, sized by `WorkerGroup.pace` from a rehearsal under "
            f"{p['sized_under']}: {p['flops_per_second'] / 1e9:.2f} GFLOP/s, {p['bytes_per_second'] / 1e9:.2f} GB/s "
            f"for the update; {p['held']:.1%} of {p['ops']} paced ops in the timed steps kept pace.\n\n")


def _share(x: float | None) -> str:
    return "–" if x is None else f"{x:.1%}"


def table(coeffs: dict, rows: list[dict]) -> str:
    h = coeffs["handoff"]
    sizes = ", ".join(f"{n // 1024}" for n in h["sizes"])
    hand = (f"Hand-off (ping-pong, isend + blocking irecv over gloo, {sizes} KiB; line through each size's "
            f"lower quartile): forward (0 → 1) {h['fixed_s'][0] * 1e6:.0f} µs + bytes / "
            f"{h['bandwidth_Bps'][0] / 1e9:.2f} GB/s, backward (1 → 0) {h['fixed_s'][1] * 1e6:.0f} µs + bytes / "
            f"{h['bandwidth_Bps'][1] / 1e9:.2f} GB/s; at the {h['boundary_bytes'] // 1024} KiB boundary tensor "
            f"{h['at_boundary_s'][0] * 1e3:.3f} / {h['at_boundary_s'][1] * 1e3:.3f} ms per micro-batch (medians "
            f"{' / '.join(', '.join(f'{x * 1e3:.2f}' for x in m) for m in h['median_s'])} ms: a woken receiver "
            f"waits for a core on a loaded machine).\n\n")
    r = coeffs.get("allreduce")
    if r:
        hand += (f"Gradient all-reduce (DP2: {r['floats'] * 4 / 2 ** 20:.1f} MiB fp32 over gloo, after a barrier): "
                 f"lower quartile {r['q25_s'] * 1e3:.1f} ms, median {r['median_s'] * 1e3:.1f} ms; grad sync "
                 f"{r['per_block_s'] * 1e3:.2f} ms per block (embedding and head folded in, as in t1).\n\n")
    prof = " · ".join(_profile_line(k, v) for k, v in coeffs["profile"].items())
    head = (_clock_line(coeffs) + hand + f"Fit A (simulator terms only, D = 0): {_describe(coeffs['simulator_terms'])}.\n\n"
            f"Fit B (with a per-iteration constant D outside the simulator): {_describe(coeffs['with_constant'])}.\n\n"
            f"Profiling runs (10th percentile of the iteration s over all rounds; compute: the busiest device's "
            f"compute seconds at the fastest step, thread CPU time on the host clock, device time on the "
            f"device clock): {prof}.\n\n")
    out = ["| plan | measured s (q10) | min s | median s | load1 | simulate() s, fit A | error A | "
           "error A, min estimator | fit A without hand-off and κ | simulate() + D s, fit B | error B | A within 15% | "
           "kept pace |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['plan']} | {r['measured_s']:.3f} | {r['min_s']:.3f} | {r['median_s']:.3f} | "
                   f"{r['load1_min']:.1f}–{r['load1_max']:.1f} | {r['predicted_s']:.3f} | {r['error']:+.1%} | "
                   f"{r['error_by_min']:+.1%} | {r['error_without_handoff_corun']:+.1%} | "
                   f"{r['predicted_with_constant_s']:.3f} | {r['error_with_constant']:+.1%} | "
                   f"{'yes' if abs(r['error']) <= TARGET else 'no'} | {_share(r.get('pace_held'))} |")
    notes = []
    for label, key in (("A", "simulator_terms"), ("B", "with_constant")):
        c = coeffs[key]
        small = [n for n, v in (("optimizer", c["optimizer_per_block_s"] * LAYERS), ("D", c["dispatch_s"]))
                 if v != 0.0 and (v < 0 or abs(v) < 3 * c["fit_rms_s"])]
        if small:
            notes.append(f"fit {label}: {' and '.join(small)} within 3x the fit RMS ({c['fit_rms_s'] * 1e3:.1f} ms) "
                         "of zero, or negative: not identified by these runs")
    tail = ("\n\nNot identified: " + "; ".join(notes) + ".") if notes else ""
    return head + _ranks_line(coeffs) + "\n".join(out) + tail


def rescore(path: Path, which: str, mbs: int = 1, seq_len: int = 128) -> list[float]:
    """Fit-A errors of the validation plans of a recorded run (its `--json`), refitted with another
    statistic of the same step times: how the estimator was chosen (BENCHMARKS.md, calibration)."""
    import json

    d = json.loads(Path(path).read_text())
    co, valid = d.get("coefficients", {}), validation_plans(mbs)
    if "times_s" not in next(iter(d.get("rows", [])), {}) or "allreduce" not in co:
        raise ValueError(f"{path}: not the --json of a `malleus bench calibrate` run that keeps every step time "
                         "(runs 6 on, as in benchmarks/calibrate/)")

    def est(times) -> float:
        return Samples(times=list(times)).stat(which)

    prof = {n: (kind, p, est(co["profile"][n]["times_s"])) for n, (kind, p) in profile_plans(mbs).items()}
    fit, terms = calibrate_from(prof, mbs, seq_len, constant=False, handoff=co["handoff"]["at_boundary_s"],
                                sync=co["allreduce"]["per_block_s"], overlap=co["allreduce"].get("overlapped", False))
    return [(sim_seconds(valid[r["plan"]], fit, mbs, seq_len, terms) - est(r["times_s"])) / est(r["times_s"])
            for r in d["rows"]]


def rescore_table(paths: Sequence[str]) -> str:
    out = ["| run | " + " | ".join(f"worst error, {w}" for w in Samples.QUANTILES) + " |",
           "|---|" + "---|" * len(Samples.QUANTILES)]
    for path in paths:
        worst = [max(rescore(Path(path), w), key=abs) for w in Samples.QUANTILES]
        out.append(f"| {Path(path).stem} | " + " | ".join(f"{e:+.1%}" for e in worst) + " |")
    return "\n".join(out)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="malleus bench calibrate", description=__doc__.split("\n")[0])
    ap.add_argument("--clock", choices=("device", "host"), default="device",
                    help="device: workers paced as emulated accelerators (no co-run interference); "
                         "host: unpaced, sharing the host's cores (κ measures that sharing)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per plan per round (one more warms up)")
    ap.add_argument("--rounds", type=int, default=8, help="interleaved rounds over all plans")
    ap.add_argument("--micro", type=int, default=1, help="samples per micro-batch")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--write", metavar="MD", help="update this markdown file's calibrate section")
    ap.add_argument("--json", metavar="PATH", help="also dump the fitted coefficients and rows as JSON")
    ap.add_argument("--rescore", nargs="+", metavar="JSON",
                    help="measure nothing: refit recorded runs (their --json) with each step-time statistic")
    return ap


def main(argv: list[str]) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.rescore:
        try:
            print(rescore_table(args.rescore))
        except (OSError, ValueError) as e:
            ap.error(str(e))
        return 0
    if args.steps < 1 or args.rounds < 1:
        ap.error("--steps and --rounds must be >= 1")
    import ray

    from malleus_svc.runtime.cluster import start_local_ray

    load0 = os.getloadavg()
    start_local_ray(DEVICES, include_dashboard=False, log_to_driver=False)
    try:
        coeffs, rows = run(args.steps, args.rounds, args.micro, args.seq_len, clock=args.clock)
    finally:
        ray.shutdown()
    load = os.getloadavg()
    md = table(coeffs, rows)
    print(md)
    if args.json:
        import json
        Path(args.json).write_text(json.dumps({"coefficients": coeffs, "rows": rows,
                                               "load_start": load0, "load_end": load}, indent=1))
    print(f"load average at the start: {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}; at the end: "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", file=sys.stderr)
    if args.write:
        cmd = ("malleus bench calibrate " + " ".join(argv)).strip()
        worst = max(rows, key=lambda r: abs(r["error"]))
        write_section(f"Command: `{cmd}` — {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()}-core CPU machine, "
                      f"{DEVICES} CPU worker actors on the {args.clock} clock, `small` preset, padded seq_len {args.seq_len}, "
                      f"micro-batch {args.micro}, {args.rounds} interleaved rounds × {args.steps} timed steps per "
                      f"plan; load average (1/5/15 min) {load0[0]:.2f}/{load0[1]:.2f}/{load0[2]:.2f} at the start, "
                      f"{load[0]:.2f}/{load[1]:.2f}/{load[2]:.2f} at the end; worst fit-A error "
                      f"{worst['error']:+.1%} ({worst['plan']}).\n\n{md}",
                      Path(args.write), "bench:calibrate")
    return 0
