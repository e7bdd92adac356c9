"""`malleus bench lengths`: length-oblivious against length-aware data assignment, at the paper's scale.

The simulator-scale comparison, after the Hydraulis paper's evaluation. For every configuration (a model on a
fixed DP×TP×PP layout, one length distribution, healthy or with one straggling stage) it draws
many global batches from a token-budget sampler and plans each of them twice:

  oblivious  what Megatron-style packing does, blind to lengths: sequences packed, in sampler
             order, into micro-batches of at most the context length (next-fit, a sequence is
             never split); the micro-batches are dealt out as contiguous slices, a fixed number
             per pipeline (as even as the count allows; with a straggler, proportional to each
             pipeline's speed, which is the data split the Malleus planner makes). A second
             oblivious variant, "ffd", is the fixed-length packing of Hydraulis App. A.2 / Fig. 12:
             first-fit-decreasing to the context length, dealt round-robin with the same counts;
  aware      `lengths.dispatch` (greedy Alg. 1 with restarts as the incumbent, then the exact
             MILP on HiGHS under a hard time limit) sends every sequence to a pipeline, then
             `lengths.pack` packs each pipeline's sequences into micro-batches (per-V LPT + MILP,
             V pruned to Σl/UtilLen as Hydraulis does);
  repack     ablation (Hydraulis §8.4 (a)→(b)): the sampler-order assignment, each pipeline's
             sequences re-packed by `lengths.pack`: what packing alone buys, without dispatch.

Every plan is scored twice: by the formula `LengthCost.pipeline_time` (the cost model's own 1F1B
forward-flow time, per pipeline; the iteration is the slowest pipeline), and by the event simulator
(`simulate_plan`: `simulate.simulate`'s op-by-op 1F1B timeline, each micro-batch's compute its
LengthCost time × the stage's layers and rate, its p2p hand-offs the analytic activation bytes of
its tokens over NVLink or InfiniBand, then the gradient reduction of blocks several pipelines hold
and the optimizer step, as `malleus simulate` models them). Reported for both: mean
iteration time of each, the speedup of aware over oblivious, the slowest-to-fastest pipeline gap
(max − min)/max per iteration, and aware's planning time against the iteration time. Every plan
is checked: each sequence of the global batch lands in exactly one micro-batch of one pipeline,
and no micro-batch holds more than the context length.

Aware is not provably never slower than oblivious, though it optimises the same model: dispatch
minimises a lower bound (stage 1), packing then adds V·c and the fill of the largest micro-batch,
which that bound does not see, and under the MILP's time limit only the greedy incumbent bounds
stage 1. What holds by construction: aware's stage-1 objective ≤ the greedy's, and when the MILP
proves optimality (within its 0.1% gap) ≤ the oblivious assignment's own stage-1 estimate, itself ≤
the oblivious 1F1B time. The "aware slower" column counts the iterations where it lost anyway.

Per-layer cost coefficients (`analytic_coeffs`), from the analytic FLOP model
(`costmodel.analytic`, an A100/A800-class `DeviceSpec`: 312 bf16 TFLOP/s at 45% sustained,
NVLink 200 GB/s), for one transformer block on a TP group of t devices, one micro-batch packed from
sequences l_1..l_n, with full activation recomputation (see memory below):

* a (s/token²): `ModelShape.block_flops(l, l)` is exactly quadratic in l; its l² coefficient is the
  causal attention work, 3 passes × 4·h·l²/2 = 6·h·l² FLOPs (scores and values, forward and
  twice that backward, halved by the causal mask). With recomputation the forward runs twice:
  × 4/3. a = (4/3)·6·h / (t·F), F = peak × efficiency. Varlen attention never crosses a packing
  boundary, so a multiplies Σ l_i², not (Σ l_i)².
* b (s/token): the l coefficient, 6 FLOPs per block parameter per token (GEMMs), × 4/3, over t·F,
  plus the Megatron TP collectives that scale with tokens: 2 forward + 2 backward + 2 in the
  recomputed forward all-reduce equivalents of h·2 bytes per token, ring cost 2(t−1)/t over
  NVLink (none at t = 1).
* c (s/micro-batch): a small fixed cost per micro-batch and block: 80 kernel launches (about 20 per
  forward, 40 backward, 20 recomputed) at 8 µs, plus 20 µs latency per TP collective (6 of them
  when t > 1): 0.76 ms at t > 1. Hydraulis's fitted c for 7B ⟨8,1⟩ is 44 ms per 32-layer stage,
  1.4 ms per layer (their published coefficients), framework overheads included: ours is the smaller,
  launch-only estimate.
* d = 0: flash-attn varlen runs one kernel per micro-batch, whatever the number of sequences.

So b/a, the length at which attention costs as much as the GEMMs, is (block params − 2h)/h before
the TP communication term: 80K tokens for llama-32b, 104K for llama-70b (119K for 70B at TP8 with
communication). It grows with the hidden size (b ∝ params ∝ h², a ∝ h), i.e. a/b falls as the
model widens: at a fixed length the quadratic share is smaller for a wider model. Cross-check:
without recomputation, a for llama-32b at t = 8 is within 1% of Hydraulis's fitted ⟨8,1⟩ a
(2.125e-6 ms per 60-layer stage); b is 1.4× theirs (their fit implies ~63% sustained GEMM
efficiency against our 45%, and overlapped collectives).

Pipelines and memory. Micro-batches hold at most the context length (32768 tokens) for both
methods, so both get the same memory budget; `stage_max_tokens` checks that every stage can hold
it: Hydraulis's state layout (fp32 master weights and Adam moments sharded over all N devices,
12 B/param/N; bf16 weights and gradients per pipeline, 4 B/param/t), full recomputation with
sequence parallelism (each in-flight micro-batch keeps one bf16 block input per layer, 2h/t bytes
per token; under 1F1B stage s holds PP − s of them), plus one block's working set
(`analytic_bytes_per_token_per_layer`, no SP, conservative) and the last stage's fp32 logits;
5000 MiB reserved and a 4096 MiB margin on 81252 MiB devices. Without recomputation a 32K
micro-batch does not fit: 70B at TP8-PP4 holds 7.5K tokens on its first stage (23K with sequence
parallelism, 34h/t bytes per token and layer).

Straggler: one device of pipeline 0's second stage runs `--rate` (2.5) times slower (so does its
whole TP group: the slowest device decides), and that pipeline's layers are re-balanced as the Malleus planner
would leave them: the smallest bottleneck max_s rate_s·layers_s whose stages still hold a full
micro-batch (`replan_layers`; the real planner could also split the TP group or suspend the
device, which this bench does not model). The pipeline stays ~1.2× slower than the healthy ones: uneven
pipelines, which the oblivious baseline meets with speed-proportional micro-batch counts and the
aware planner with its per-pipeline cost.

Length distributions (seq_len cap 32768):
* synthetic: `SyntheticVarLen` scaled up, lognormal with mean 4096 (unclipped) and σ 1.3, clipped
  to [8, 32768]: median ~1.8K, ~1.6% of sequences at the 32K cap;
* python: the bundled Python-source corpus (`PythonSourceCorpus`, documents split), at byte level,
  with each file split into pieces of at most 131072 bytes, and lengths converted to tokens at 4
  bytes per token (⌈bytes/4⌉, BPE on code averages 3–4 characters per token): a real long-tailed
  distribution (median ~1.7K tokens, files over 128 KiB give 32K pieces).
The sampler (Hydraulis's `LLaMAFixedTokenSampler`) takes a seeded shuffle of the dataset, in
order, until the token budget is reached, and truncates the last sequence to meet it exactly;
epochs reshuffle. Budgets: D × k × 32768 tokens, k full context-length micro-batches per pipeline:
k = 2 is Hydraulis's scale (100K–200K tokens per iteration on 64 GPUs; 131K for 70B on DP2), k = 8
gives every PP4 pipeline twice its depth in full micro-batches, where fill matters less. The same
batches are drawn for the healthy and the straggler run of a configuration.

Not covered: the simulator replays the cost model's per-micro-batch times (it checks the 1F1B
order, p2p and the reduction the formula leaves out, not the cost model itself); the
measured-runtime part (CPU workers running the packed micro-batches) is `malleus bench lengths-runtime`.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from malleus_svc.config.limits import MAX_SECONDS
from malleus_svc.config.options import number_option
from malleus_svc.config.presets import ModelShape, preset
from malleus_svc.costmodel.analytic import (MB, TP_ALLREDUCES_PER_BLOCK, DeviceSpec, _allreduce_seconds, block_seconds,
                                           comm_costs)
from malleus_svc.lengths import (Coeffs, LengthCost, PipelineSpec, StageSpec, analytic_bytes_per_token_per_layer,
                                 dispatch, first_fit_decreasing, max_tokens_per_stage, pack, predicted_time)

CONTEXT = 32768                      # seq_len cap and the micro-batch capacity of both methods
BUDGETS = (2, 8)                     # token budget = D × this × CONTEXT (full micro-batches per pipeline)
UTIL_LEN = {1: 384, 2: 512, 4: 768, 8: 1024, 16: 1280}   # Hydraulis's UtilLen per TP degree (their code): V <= Σl/UtilLen
DEVICE = DeviceSpec()                # A100/A800-80GB class
GPU_MEMORY_MB = 81252
RESERVED_MB = 5000                   # CUDA/NCCL context (Hydraulis's code: 5000 MiB on A800)
SAFETY_MB = 4096
RECOMPUTE_FACTOR = 4.0 / 3.0         # forward recomputed once: (2 + 2 + 4) / (2 + 4) FLOPs
KERNELS_PER_LAYER = 80               # launches per block and micro-batch: ~20 fwd, 40 bwd, 20 recompute
LAUNCH_S = 8e-6
COLLECTIVES_PER_LAYER = 6            # TP all-reduce equivalents: 2 fwd, 2 bwd, 2 recomputed fwd
COLLECTIVE_LATENCY_S = 20e-6
BYTES_PER_TOKEN_PYTHON = 4
STRAGGLER_RATE = 2.5
HYDRAULIS_SPEEDUP = (1.32, 2.66)     # over the best baseline, end to end (Hydraulis §8)
HYDRAULIS_GAP_OURS = (0.02, 0.10)    # slowest/fastest rank gap, Fig. 12(b)
HYDRAULIS_GAP_FIXED = (0.36, 0.65)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- cost coefficients
def analytic_coeffs(shape: ModelShape, tp: int, device: DeviceSpec = DEVICE, *, recompute: bool = True,
                    kernels: int = KERNELS_PER_LAYER, launch_s: float = LAUNCH_S,
                    collectives: int | None = None, collective_latency_s: float = COLLECTIVE_LATENCY_S) -> Coeffs:
    """Per-layer a, b, c (d = 0) of one block on `tp` devices, from the analytic FLOP model
    (module docstring). `recompute=False, kernels=0, collective_latency_s=0` reproduces
    `costmodel.analytic.block_seconds` exactly."""
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    flops = device.flops_per_second * tp
    # block_flops(l, l) = a_fl·l² + b_fl·l exactly: read both coefficients off two evaluations.
    f1, f2 = shape.block_flops(1, 1), shape.block_flops(2, 2)
    a_fl = (f2 - 2.0 * f1) / 2.0
    b_fl = f1 - a_fl
    factor = RECOMPUTE_FACTOR if recompute else 1.0
    if collectives is None:
        collectives = COLLECTIVES_PER_LAYER if recompute else TP_ALLREDUCES_PER_BLOCK
    comm_per_token = collectives * _allreduce_seconds(shape.hidden * device.act_bytes, tp, device.intra_node_gbps)
    c = kernels * launch_s + (collectives * collective_latency_s if tp > 1 else 0.0)
    return Coeffs(a=factor * a_fl / flops, b=factor * b_fl / flops + comm_per_token, c=c, d=0.0)


def length_cost(shape: ModelShape, tps: Sequence[int], device: DeviceSpec = DEVICE, **kw) -> LengthCost:
    return LengthCost({t: analytic_coeffs(shape, t, device, **kw) for t in sorted(set(tps))}, "s",
                      {"source": "analytic FLOP model", "device": device})


# ----------------------------------------------------------------------------- setups and pipelines
@dataclass(frozen=True)
class Setup:
    name: str
    model: str
    nodes: int
    dp: int
    tp: int
    pp: int

    @property
    def devices(self) -> int:
        return self.nodes * 8

    def tokens_per_iteration(self, budget: int) -> int:
        """`budget` full context-length micro-batches per pipeline."""
        return self.dp * budget * CONTEXT

    def label(self) -> str:
        return f"{self.name} (DP{self.dp}-TP{self.tp}-PP{self.pp})"


SETUPS = {s.name: s for s in (
    Setup("32b-32gpu", "llama-32b", 4, 4, 2, 4),     # the Malleus paper's evaluation layout (simulate.scenarios)
    Setup("70b-32gpu", "llama-70b", 4, 2, 4, 4),
    Setup("70b-64gpu", "llama-70b", 8, 2, 8, 4),     # the Malleus paper's evaluation layout
    Setup("70b-64gpu-dp4", "llama-70b", 8, 4, 4, 4),
)}
DISTS = ("synthetic", "python")


def stage_max_tokens(setup: Setup, layers: Sequence[int], shape: ModelShape | None = None) -> list[int]:
    """Most tokens one micro-batch may hold on each stage (module docstring: memory)."""
    shape = shape or preset(setup.model)
    t, n = setup.tp, setup.devices
    per_param = 4.0 / t + 12.0 / n
    static = [lay * shape.block_params() * per_param + (RESERVED_MB * MB) for lay in layers]
    static[0] += shape.embedding_params() * per_param
    static[-1] += shape.head_params() * per_param
    stored = 2.0 * shape.hidden * DEVICE.act_bytes / 2.0 / t          # bf16 block input, SP-sharded
    working = analytic_bytes_per_token_per_layer(shape, t, DEVICE)     # one block being recomputed
    extra = [working] * len(layers)
    extra[-1] += shape.vocab * 4.0 / t                                 # fp32 logits of the last stage
    cap = (GPU_MEMORY_MB - SAFETY_MB) * MB
    return max_tokens_per_stage(list(layers), stored, static, cap, extra)


def replan_layers(setup: Setup, rates: Sequence[float], shape: ModelShape | None = None) -> list[int]:
    """Layers per stage minimising max_s rate_s·layers_s, every stage still holding CONTEXT tokens."""
    shape = shape or preset(setup.model)
    total = shape.layers
    targets = sorted({r * k for r in rates for k in range(1, total + 1)})
    for target in targets:
        caps = [int(math.floor(target / r + 1e-9)) for r in rates]
        if sum(caps) < total or min(caps) < 1:
            continue
        layers = list(caps)
        extra = sum(layers) - total
        for s in range(len(layers)):   # trim from the front: early stages keep the most micro-batches
            take = min(extra, layers[s] - 1)
            layers[s] -= take
            extra -= take
        if min(stage_max_tokens(setup, layers, shape)) >= CONTEXT:
            return layers
    raise ValueError(f"{setup.name}: no layer split with rates {list(rates)} holds {CONTEXT}-token micro-batches")


def pipelines_for(setup: Setup, straggler: bool, rate: float = STRAGGLER_RATE) -> list[PipelineSpec]:
    shape = preset(setup.model)
    if shape.layers % setup.pp:
        raise ValueError(f"{setup.name}: {shape.layers} layers do not split evenly over PP{setup.pp}")
    even = [shape.layers // setup.pp] * setup.pp
    if min(stage_max_tokens(setup, even, shape)) < CONTEXT:
        raise ValueError(f"{setup.name}: a {CONTEXT}-token micro-batch does not fit (max tokens per stage "
                         f"{stage_max_tokens(setup, even, shape)})")
    pipes = [PipelineSpec.uniform(setup.pp, even[0], setup.tp, max_tokens=CONTEXT) for _ in range(setup.dp)]
    if straggler:
        rates = [1.0] * setup.pp
        rates[min(1, setup.pp - 1)] = rate
        layers = replan_layers(setup, rates, shape)
        pipes[0] = PipelineSpec(tuple(StageSpec(lay, r, setup.tp) for lay, r in zip(layers, rates)), CONTEXT)
    return pipes


# ----------------------------------------------------------------------------- event-simulator scoring
@dataclass(frozen=True)
class SimSetup:
    """What `simulate.simulate` needs for one configuration, in seconds (t0 = 1 s): pipeline i's
    stage j is the TP group of devices (i·pp + j)·tp onward, so TP8 stages sit one per node and
    narrower ones share nodes, as a Megatron rank order would place them."""

    problem: object          # planner.PlannerProblem
    stages: tuple            # per pipeline, its plan.Stage tuple
    options: object          # simulate.SimOptions
    coeffs: Coeffs           # per-layer micro-batch time at the setup's TP degree


def sim_setup(setup: Setup, pipes: Sequence[PipelineSpec], cost: LengthCost) -> SimSetup:
    """The simulator's view of `pipes`: p2p and the gradient reduction from the same analytic model
    the scenarios use (`costmodel.analytic.comm_costs` for a CONTEXT-token micro-batch, converted to
    seconds), the optimizer step at 0.05 t0 per full-TP block (t0 of the preset's sequence length;
    the simulator's default when this bench was written, kept so its figures stay comparable)."""
    from malleus_svc.plan import Stage
    from malleus_svc.planner.problem import CommCosts, MemoryProfile, PlannerProblem
    from malleus_svc.simulate import SimOptions

    shape = preset(setup.model)
    ctx = dataclasses.replace(shape, seq_len=CONTEXT)
    t_ctx = block_seconds(ctx, setup.tp, 1, DEVICE)
    cc = comm_costs(ctx, setup.tp, setup.dp, 1, DEVICE)            # t0 units of t_ctx
    rates, stages = [1.0] * setup.devices, []
    for i, p in enumerate(pipes):
        row, start = [], 0
        for j, st in enumerate(p.stages):
            first = (i * setup.pp + j) * setup.tp
            row.append(Stage(tuple(range(first, first + setup.tp)), (start, start + st.layers)))
            rates[first] = st.rate            # one slow device slows its whole TP group (max over the group)
            start += st.layers
        stages.append(tuple(row))
    problem = PlannerProblem(
        num_nodes=setup.nodes, gpus_per_node=8, num_layers=shape.layers, dp=setup.dp, tp=setup.tp, pp=setup.pp,
        num_micro_batches=setup.dp * setup.pp, micro_batch_size=1, rates=tuple(rates),
        tp_alpha=(1.0,) * (int(math.log2(setup.tp)) + 1),           # every stage runs at the full TP degree
        memory=MemoryProfile((0.0,), 0.0, 0.0, 0.0, GPU_MEMORY_MB),  # timing only: memory is checked above
        comm=CommCosts(cc.p2p_intra_node * t_ctx, cc.p2p_inter_node * t_ctx, cc.grad_sync_per_block * t_ctx),
        t0_seconds=1.0, optimizer_per_block=0.05 * block_seconds(shape, setup.tp, 1, DEVICE))
    return SimSetup(problem, tuple(stages), SimOptions(), cost.at(setup.tp))


def simulate_plan(plan: Plan, lengths: Sequence[int], ss: SimSetup) -> tuple[float, list[float]]:
    """(iteration seconds, per-pipeline compute end) of one assignment in the event simulator's 1F1B
    timeline: micro-batch k's compute is its LengthCost time per layer (× each stage's layers and
    rate, done by the simulator), its p2p the boundary's time × its tokens / CONTEXT. A pipeline
    given no sequence runs one empty micro-batch (work 0): it still takes part in the reduction."""
    from malleus_svc.plan import Pipeline, Plan as SimPlan
    from malleus_svc.simulate import simulate

    mbs = [[[lengths[i] for i in mb] for mb in p] or [[]] for p in plan]
    sp = SimPlan(ss.problem.num_devices, ss.problem.num_layers, 1,
                 tuple(Pipeline(st, len(m)) for st, m in zip(ss.stages, mbs)))
    res = simulate(sp, ss.problem, options=ss.options,
                   work=[[ss.coeffs.micro_batch(mb) for mb in m] for m in mbs],
                   volume=[[sum(mb) / CONTEXT for mb in m] for m in mbs])
    return res.iteration_seconds, [p.compute_end for p in res.pipelines]


def describe_pipeline(p: PipelineSpec) -> str:
    return "/".join(f"{s.layers}" + (f"@{s.rate:g}x" if s.rate != 1 else "") for s in p.stages)


# ----------------------------------------------------------------------------- length distributions
def dataset_lengths(dist: str) -> tuple[np.ndarray, str]:
    """Token lengths of every sequence of the dataset, capped at CONTEXT, and how they were made."""
    if dist == "synthetic":
        from malleus_svc.runtime.datasets import SyntheticVarLen
        ds = SyntheticVarLen(num_samples=200_000, seq_len=CONTEXT - 1, vocab=2, seed=0, mean_len=4096, sigma=1.3)
        return np.asarray(ds.lengths, dtype=np.int64), "SyntheticVarLen(200000, seq_len 32767, mean 4096, σ 1.3)"
    if dist == "python":
        from malleus_svc.runtime.datasets import PythonSourceCorpus
        k = BYTES_PER_TOKEN_PYTHON
        ds = PythonSourceCorpus(seq_len=k * CONTEXT - 1, mode="documents")
        toks = -(-np.asarray(ds.lengths, dtype=np.int64) // k)
        return toks, (f"PythonSourceCorpus(documents, pieces <= {k * CONTEXT} bytes), "
                      f"{len(ds.files)} files, ⌈bytes/{k}⌉ tokens")
    raise ValueError(f"unknown distribution {dist!r}; known: {', '.join(DISTS)}")


class TokenBudgetSampler:
    """Seeded shuffles of the dataset, taken in order until `budget` tokens; the last one truncated."""

    def __init__(self, lengths: np.ndarray, budget: int, seed: int = 0):
        if budget < 1 or len(lengths) == 0:
            raise ValueError("a token budget >= 1 and a non-empty dataset are needed")
        self.lengths, self.budget = np.asarray(lengths, dtype=np.int64), int(budget)
        self.rng = np.random.default_rng(seed)
        self.order, self.pos = self.rng.permutation(len(self.lengths)), 0

    def next_batch(self) -> list[int]:
        out, total = [], 0
        while total < self.budget:
            if self.pos == len(self.order):
                self.order, self.pos = self.rng.permutation(len(self.lengths)), 0
            x = int(self.lengths[self.order[self.pos]])
            self.pos += 1
            x = min(x, self.budget - total)
            out.append(x)
            total += x
        return out


# ----------------------------------------------------------------------------- the two planners
Plan = list  # per pipeline: a list of micro-batches, each a list of indices into the global batch


def next_fit(lengths: Sequence[int], cap: int) -> list[list[int]]:
    """Sampler order, a new micro-batch whenever the next sequence does not fit (Megatron-style, no split)."""
    bins: list[list[int]] = []
    room = -1
    for i, x in enumerate(lengths):
        if x > room:
            bins.append([])
            room = cap
        bins[-1].append(i)
        room -= x
    return bins


def split_counts(m: int, pipes: Sequence[PipelineSpec]) -> list[int]:
    """Micro-batches per pipeline for m equal micro-batches: as even as possible between equal
    pipelines, proportional to speed otherwise (each goes where it ends the earliest; ties to the
    lowest index)."""
    kmax = [max(s.weight for s in p.stages) for p in pipes]
    fill = [sum(s.weight for s in p.stages) - k for p, k in zip(pipes, kmax)]
    counts = [0] * len(pipes)
    for _ in range(m):
        j = min(range(len(pipes)), key=lambda j: (kmax[j] * (counts[j] + 1) + fill[j], j))
        counts[j] += 1
    return counts


def oblivious_plan(lengths: Sequence[int], pipes: Sequence[PipelineSpec], variant: str = "sampler") -> Plan:
    if variant == "sampler":
        bins = next_fit(lengths, CONTEXT)
        counts = split_counts(len(bins), pipes)
        out, pos = [], 0
        for c in counts:                       # contiguous slices, in sampler order
            out.append(bins[pos:pos + c])
            pos += c
        return out
    if variant == "ffd":
        bins = first_fit_decreasing(lengths, CONTEXT)
        counts = split_counts(len(bins), pipes)
        out = [[] for _ in pipes]
        j = 0
        for b in bins:                         # round-robin over pipelines with quota left
            while len(out[j]) >= counts[j]:
                j = (j + 1) % len(pipes)
            out[j].append(b)
            j = (j + 1) % len(pipes)
        return out
    raise ValueError(f"unknown oblivious variant {variant!r}")


@dataclass
class AwareResult:
    plan: Plan
    planning_s: float
    dispatch_s: float
    pack_s: list[float]
    ilp_status: str
    method: str
    objective: float            # stage-1 estimate of the chosen assignment (max over pipelines)
    greedy_objective: float
    stage1_times: list[float]


def aware_plan(lengths: Sequence[int], pipes: Sequence[PipelineSpec], cost: LengthCost, *, ilp_time_limit: float,
               pack_time_limit: float, pack_total: float, seed: int = 0) -> AwareResult:
    """Stage 1 (`dispatch`) then stage 2 (`pack`, V pruned to Σl/UtilLen) for every pipeline."""
    t0 = time.perf_counter()
    d = dispatch(list(lengths), list(pipes), cost, time_limit_s=ilp_time_limit, seed=seed)
    t1 = time.perf_counter()
    plan, pack_s = repack(lengths, d.assignment, pipes, cost, pack_time_limit, pack_total)
    return AwareResult(plan, time.perf_counter() - t0, t1 - t0, pack_s, d.ilp_status, d.method, d.objective,
                       d.greedy_objective, list(d.times))


def repack(lengths: Sequence[int], assignment: Sequence[Sequence[int]], pipes: Sequence[PipelineSpec],
           cost: LengthCost, time_limit: float, total: float) -> tuple[Plan, list[float]]:
    """Stage 2 alone: `pack` each pipeline's sequences (V pruned to Σl/UtilLen); (plan, seconds per pipeline)."""
    plan, secs = [], []
    for pipe, idx in zip(pipes, assignment):
        idx = list(idx)
        t = time.perf_counter()
        util = UTIL_LEN.get(max(s.tp for s in pipe.stages))
        p = pack([lengths[i] for i in idx], pipe, cost, min_tokens=util, time_limit_s=time_limit, total_time_s=total)
        secs.append(time.perf_counter() - t)
        plan.append([[idx[k] for k in mb] for mb in p.micro_batches])
    return plan, secs


def check_exactly_once(plan: Plan, lengths: Sequence[int], pipes: Sequence[PipelineSpec], who: str) -> None:
    """Every sequence in exactly one micro-batch of one pipeline; no micro-batch over capacity."""
    seen = Counter(i for mbs in plan for mb in mbs for i in mb)
    missing = [i for i in range(len(lengths)) if seen[i] == 0]
    twice = [i for i, c in seen.items() if c > 1]
    stray = [i for i in seen if not 0 <= i < len(lengths)]
    if missing or twice or stray or len(plan) != len(pipes):
        raise AssertionError(f"{who}: exactly-once violated: missing {missing[:10]}, duplicated {twice[:10]}, "
                             f"unknown {stray[:10]}, {len(plan)} pipelines planned for {len(pipes)}")
    for j, (mbs, pipe) in enumerate(zip(plan, pipes)):
        for mb in mbs:
            if not mb or sum(lengths[i] for i in mb) > min(CONTEXT, pipe.max_tokens):
                raise AssertionError(f"{who}: pipeline {j} has an empty or over-capacity micro-batch "
                                     f"({sum(lengths[i] for i in mb)} tokens)")


def pipeline_times(plan: Plan, lengths: Sequence[int], pipes: Sequence[PipelineSpec], cost: LengthCost) -> list[float]:
    return [cost.pipeline_time([[lengths[i] for i in mb] for mb in mbs], pipe.stages)
            for mbs, pipe in zip(plan, pipes)]


def gap(times: Sequence[float]) -> float:
    top = max(times)
    return (top - min(times)) / top if top > 0 else 0.0


# ----------------------------------------------------------------------------- one configuration
METHODS = ("sampler", "ffd", "repack", "aware")
LABELS = {"sampler": "sampler-order", "ffd": "FFD", "repack": "sampler-order + pack", "aware": "aware"}


@dataclass
class Iteration:
    sequences: int
    longest: int
    times: dict[str, list[float]]             # method -> per-pipeline seconds
    micro_batches: dict[str, list[int]]       # method -> per pipeline
    planning_s: float
    dispatch_s: float
    pack_s_max: float
    ilp_status: str
    method: str
    objective: float
    greedy_objective: float
    lb_oblivious: float                       # max_j stage-1 estimate of the sampler plan's assignment
    sim_iter: dict[str, float] = field(default_factory=dict)          # method -> simulated iteration seconds
    sim_times: dict[str, list[float]] = field(default_factory=dict)   # method -> per-pipeline compute end

    def iter_s(self, m: str, sim: bool = False) -> float:
        """Iteration seconds: the formula's slowest pipeline, or (sim) the simulated iteration,
        gradient reduction and optimizer step included."""
        return self.sim_iter[m] if sim else max(self.times[m])

    def gap(self, m: str, sim: bool = False) -> float:
        return gap(self.sim_times[m] if sim else self.times[m])


@dataclass
class Config:
    setup: Setup
    dist: str
    straggler: bool
    budget: int                                 # full context-length micro-batches per pipeline
    pipes: list[PipelineSpec]
    iterations: list[Iteration] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.setup.name}/{self.dist}/{'straggler' if self.straggler else 'healthy'}/b{self.budget}"

    @property
    def tokens(self) -> int:
        return self.setup.tokens_per_iteration(self.budget)

    def mean_iter(self, m: str, sim: bool = False) -> float:
        return statistics.mean(it.iter_s(m, sim) for it in self.iterations)

    def speedup(self, base: str, sim: bool = False) -> float:
        """Throughput ratio at a fixed token budget: mean iteration time of `base` over aware's."""
        return self.mean_iter(base, sim) / self.mean_iter("aware", sim)

    def per_iter_speedups(self, base: str, sim: bool = False) -> list[float]:
        return [it.iter_s(base, sim) / it.iter_s("aware", sim) for it in self.iterations]

    def gaps(self, m: str, sim: bool = False) -> list[float]:
        return [it.gap(m, sim) for it in self.iterations]

    def planning_ratio(self, sim: bool = False) -> float:
        return statistics.mean(it.planning_s for it in self.iterations) / self.mean_iter("aware", sim)

    def to_dict(self) -> dict:
        return {"name": self.name, "setup": self.setup.name, "dist": self.dist, "straggler": self.straggler,
                "budget": self.budget, "tokens": self.tokens,
                "pipelines": [describe_pipeline(p) for p in self.pipes],
                "iterations": [dataclasses.asdict(it) for it in self.iterations]}

    def aware_slower(self) -> int:
        return sum(1 for it in self.iterations
                   if it.iter_s("aware") > min(it.iter_s("sampler"), it.iter_s("ffd")) * (1 + 1e-9))


def run_config(setup: Setup, dist: str, straggler: bool, iterations: int, *, budget: int = 8, seed: int = 0,
               ilp_time_limit: float = 2.0, pack_time_limit: float = 0.5, pack_total: float = 2.0,
               lengths_cache: dict | None = None, rate: float = STRAGGLER_RATE) -> Config:
    shape = preset(setup.model)
    cost = length_cost(shape, [setup.tp])
    pipes = pipelines_for(setup, straggler, rate)
    ss = sim_setup(setup, pipes, cost)
    cache = lengths_cache if lengths_cache is not None else {}
    if dist not in cache:
        cache[dist] = dataset_lengths(dist)
    data, _ = cache[dist]
    sampler = TokenBudgetSampler(data, setup.tokens_per_iteration(budget), seed)   # same batches healthy or not
    cfg = Config(setup, dist, straggler, budget, pipes)
    for it in range(iterations):
        lengths = sampler.next_batch()
        plans = {"sampler": oblivious_plan(lengths, pipes, "sampler"), "ffd": oblivious_plan(lengths, pipes, "ffd")}
        aw = aware_plan(lengths, pipes, cost, ilp_time_limit=ilp_time_limit, pack_time_limit=pack_time_limit,
                        pack_total=pack_total, seed=seed * 100003 + it)
        plans["aware"] = aw.plan
        # Ablation: the oblivious assignment (sampler-order slices) with length-aware packing only.
        plans["repack"], _ = repack(lengths, [[i for mb in mbs for i in mb] for mbs in plans["sampler"]], pipes, cost,
                                    pack_time_limit, pack_total)
        for m, plan in plans.items():
            check_exactly_once(plan, lengths, pipes, f"{cfg.name} iteration {it} {m}")
        lb_obl = max(predicted_time([lengths[i] for mb in mbs for i in mb], p, cost)
                     for mbs, p in zip(plans["sampler"], pipes))
        sims = {m: simulate_plan(p, lengths, ss) for m, p in plans.items()}
        cfg.iterations.append(Iteration(
            sequences=len(lengths), longest=max(lengths),
            times={m: pipeline_times(p, lengths, pipes, cost) for m, p in plans.items()},
            micro_batches={m: [len(mbs) for mbs in p] for m, p in plans.items()},
            planning_s=aw.planning_s, dispatch_s=aw.dispatch_s, pack_s_max=max(aw.pack_s, default=0.0),
            ilp_status=aw.ilp_status, method=aw.method, objective=aw.objective,
            greedy_objective=aw.greedy_objective, lb_oblivious=lb_obl,
            sim_iter={m: v[0] for m, v in sims.items()}, sim_times={m: v[1] for m, v in sims.items()}))
    return cfg


# ----------------------------------------------------------------------------- tables
def _q(xs: Sequence[float], q: float) -> float:
    return float(np.quantile(np.asarray(xs), q)) if xs else float("nan")


def setups_table(setups: Sequence[Setup], budgets: Sequence[int] = BUDGETS) -> str:
    out = ["| setup | model | devices | tokens / iteration (budgets) "
           "| coefficients per layer (a s/tok², b s/tok, c s) | b/a (tokens) "
           "| max tokens per stage (healthy) | straggler pipeline: layers@rate (κ max) |",
           "|---|---|---|---|---|---|---|---|"]
    for s in setups:
        shape = preset(s.model)
        co = analytic_coeffs(shape, s.tp)
        even = [shape.layers // s.pp] * s.pp
        strag = pipelines_for(s, True)[0]
        kmax = max(st.weight for st in strag.stages)
        out.append(f"| {s.label()} | {s.model} | {s.devices} | "
                   f"{', '.join(f'{s.tokens_per_iteration(b):,} (b{b})' for b in budgets)} | "
                   f"{co.a:.3g}, {co.b:.3g}, {co.c:.3g} | {co.b / co.a:,.0f} | "
                   f"{'/'.join(f'{x:,}' for x in stage_max_tokens(s, even, shape))} | "
                   f"{describe_pipeline(strag)} ({kmax:g} vs {even[0]}) |")
    return "\n".join(out)


def results_table(configs: Sequence[Config]) -> str:
    names = " · ".join(LABELS[m] for m in METHODS)
    head = (f"| configuration | iterations (seqs/iter) | mean iteration s: {names} "
            "| aware speedup vs sampler-order (min–max) | vs FFD (min–max) | vs sampler-order + pack "
            f"| gap mean (p90): {names} | aware planning s mean (max) | planning / iteration "
            "| dispatch ILP: optimal / time limit | aware slower |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for c in configs:
        its = c.iterations
        st = Counter(it.ilp_status for it in its)
        sp, sf = c.per_iter_speedups("sampler"), c.per_iter_speedups("ffd")
        gaps = " · ".join(f"{statistics.mean(c.gaps(m)):.3f} ({_q(c.gaps(m), 0.9):.3f})" for m in METHODS)
        plan = [it.planning_s for it in its]
        out.append(
            f"| {c.name} | {len(its)} ({statistics.mean(it.sequences for it in its):.0f}) | "
            + " · ".join(f"{c.mean_iter(m):.2f}" for m in METHODS)
            + f" | {c.speedup('sampler'):.3f}× ({min(sp):.2f}–{max(sp):.2f}) | {c.speedup('ffd'):.3f}× "
              f"({min(sf):.2f}–{max(sf):.2f}) | {c.speedup('repack'):.3f}× | {gaps} | "
              f"{statistics.mean(plan):.2f} ({max(plan):.2f}) | "
              f"{c.planning_ratio():.3f} | {st.get('optimal', 0)} / {st.get('time_limit', 0)} | {c.aware_slower()} |")
    return "\n".join(out)


def sim_table(configs: Sequence[Config]) -> str:
    """The same configurations, every plan replayed in the event simulator (`simulate_plan`)."""
    names = " · ".join(LABELS[m] for m in METHODS)
    head = (f"| configuration | simulated iteration s: {names} | aware speedup vs sampler-order (min–max) "
            f"| vs FFD (min–max) | vs sampler-order + pack | gap mean (p90): {names} "
            "| simulated / formula: sampler-order · FFD · aware | planning / simulated iteration |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for c in configs:
        sp, sf = c.per_iter_speedups("sampler", True), c.per_iter_speedups("ffd", True)
        gaps = " · ".join(f"{statistics.mean(c.gaps(m, True)):.3f} ({_q(c.gaps(m, True), 0.9):.3f})"
                          for m in METHODS)
        agree = " · ".join(f"{c.mean_iter(m, True) / c.mean_iter(m):.3f}" for m in ("sampler", "ffd", "aware"))
        out.append(
            f"| {c.name} | " + " · ".join(f"{c.mean_iter(m, True):.2f}" for m in METHODS)
            + f" | {c.speedup('sampler', True):.3f}× ({min(sp):.2f}–{max(sp):.2f}) | {c.speedup('ffd', True):.3f}× "
              f"({min(sf):.2f}–{max(sf):.2f}) | {c.speedup('repack', True):.3f}× | {gaps} | {agree} | "
              f"{c.planning_ratio(True):.3f} |")
    return "\n".join(out)


def summary(configs: Sequence[Config]) -> tuple[str, dict]:
    sp = [c.speedup("sampler") for c in configs]
    sf = [c.speedup("ffd") for c in configs]
    best = [min(c.mean_iter("sampler"), c.mean_iter("ffd")) / c.mean_iter("aware") for c in configs]
    packing = [c.mean_iter("sampler") / c.mean_iter("repack") for c in configs]
    disp = [c.speedup("repack") for c in configs]
    g = {m: statistics.mean(x for c in configs for x in c.gaps(m)) for m in METHODS}
    ratio = max(c.planning_ratio() for c in configs)
    worst_plan = max(it.planning_s / it.iter_s("aware") for c in configs for it in c.iterations)
    slower = sum(c.aware_slower() for c in configs)
    n = sum(len(c.iterations) for c in configs)
    st = Counter(it.ilp_status for c in configs for it in c.iterations)
    stage1_ok = sum(1 for c in configs for it in c.iterations if it.objective <= it.lb_oblivious * (1 + 1e-3) + 1e-12)
    # the same, every plan replayed in the event simulator
    ssp = [c.speedup("sampler", True) for c in configs]
    ssf = [c.speedup("ffd", True) for c in configs]
    sbest = [min(c.mean_iter("sampler", True), c.mean_iter("ffd", True)) / c.mean_iter("aware", True) for c in configs]
    sg = {m: statistics.mean(x for c in configs for x in c.gaps(m, True)) for m in METHODS}
    agree = {m: [it.iter_s(m, True) / it.iter_s(m) for c in configs for it in c.iterations] for m in METHODS}
    sslower = sum(1 for c in configs for it in c.iterations
                  if it.iter_s("aware", True) > min(it.iter_s("sampler", True), it.iter_s("ffd", True)) * (1 + 1e-9))
    sratio = max(c.planning_ratio(True) for c in configs)
    lines = [
        f"- Speedup of length-aware over the oblivious baselines (ratio of mean iteration times at a fixed token "
        f"budget): {min(sp):.2f}–{max(sp):.2f}× over sampler-order packing, {min(sf):.2f}–{max(sf):.2f}× over FFD, "
        f"{min(best):.2f}–{max(best):.2f}× over the better of the two per configuration (Hydraulis reports "
        f"{HYDRAULIS_SPEEDUP[0]}–{HYDRAULIS_SPEEDUP[1]}× end to end over the best baseline, with per-iteration "
        f"heterogeneous strategies, which this fixed layout does not use).",
        f"- Where it comes from (ablation, Hydraulis §8.4 (a)→(b)): length-aware packing of the oblivious assignment "
        f"alone gives {min(packing):.2f}–{max(packing):.2f}× over sampler-order; dispatching the raw sequences first "
        f"adds {min(disp):.2f}–{max(disp):.2f}×. Within one pipeline packing can only move the 1F1B fill/drain and "
        f"V·c (with varlen attention the summed work is fixed): smaller micro-batches fill faster.",
        f"- Slowest-to-fastest pipeline gap, mean over all {n} iterations: sampler-order {g['sampler']:.3f}, "
        f"FFD {g['ffd']:.3f}, sampler-order + pack {g['repack']:.3f}, aware {g['aware']:.3f} "
        f"(Hydraulis Fig. 12(b): {HYDRAULIS_GAP_FIXED[0]}–"
        f"{HYDRAULIS_GAP_FIXED[1]} for fixed-length packing, {HYDRAULIS_GAP_OURS[0]}–{HYDRAULIS_GAP_OURS[1]} for theirs).",
        f"- Planning (dispatch + packing of every pipeline, one process): at most {100 * ratio:.1f}% of the iteration "
        f"time on average per configuration, {100 * worst_plan:.1f}% in the worst iteration.",
        f"- Aware slower than the better oblivious plan in {slower} of {n} iterations. Dispatch ILP: "
        + ", ".join(f"{k} {v}" for k, v in sorted(st.items()))
        + f"; its stage-1 objective was at most the oblivious assignment's own stage-1 estimate in {stage1_ok} of {n} "
          f"(guaranteed only when the ILP proves optimality; on a time limit the greedy incumbent bounds it).",
        "- Exactly-once held for every plan (checked every iteration; a violation stops the bench).",
        f"- Event simulator (every plan replayed as a 1F1B timeline: per-micro-batch compute from its lengths, p2p "
        f"with its tokens' activation bytes, then the gradient reduction and the optimizer step): "
        f"{min(ssp):.2f}–{max(ssp):.2f}× over sampler-order, {min(ssf):.2f}–{max(ssf):.2f}× over FFD, "
        f"{min(sbest):.2f}–{max(sbest):.2f}× over the better of the two; mean gaps sampler-order "
        f"{sg['sampler']:.3f}, "
        f"FFD {sg['ffd']:.3f}, sampler-order + pack {sg['repack']:.3f}, aware {sg['aware']:.3f}; aware slower than "
        f"the better oblivious plan in {sslower} of {n} iterations; planning at most {100 * sratio:.1f}% of the "
        f"simulated iteration per configuration. Simulated / formula iteration time per iteration: "
        + ", ".join(f"{LABELS[m]} {min(v):.3f}–{max(v):.3f}" for m, v in agree.items())
        + " (the simulator adds the p2p, the reduction and the step, and times the real 1F1B order: in the steady "
          "state stage s runs the forward of micro-batch k + S − s − 1 beside the backward of k, so micro-batches of "
          "mixed sizes in sampler order stall it, which the formula's flow-shop sum does not see; FFD's and aware's "
          "slowest-first orders do not).",
    ]
    return "\n".join(lines), {"speedup_sampler": sp, "speedup_ffd": sf, "speedup_best": best, "gaps": g,
                              "speedup_packing_only": packing, "speedup_dispatch": disp,
                              "planning_ratio": ratio, "aware_slower": slower, "iterations": n,
                              "sim_speedup_sampler": ssp, "sim_speedup_ffd": ssf, "sim_speedup_best": sbest,
                              "sim_gaps": sg, "sim_aware_slower": sslower, "sim_planning_ratio": sratio,
                              "sim_over_formula": {m: (min(v), max(v)) for m, v in agree.items()}}


# ----------------------------------------------------------------------------- plot
def plot(configs: Sequence[Config], path: Path) -> Path:
    """Per token budget: speedup bars per configuration, then the per-iteration gap distributions."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    budgets = sorted({c.budget for c in configs})
    width = max(8.0, 0.62 * max(sum(c.budget == b for c in configs) for b in budgets) + 2.0)
    fig, axes = plt.subplots(2 * len(budgets), 1, figsize=(width, 3.6 * 2 * len(budgets)), squeeze=False)
    colors = {"sampler": "tab:red", "ffd": "tab:orange", "repack": "tab:purple", "aware": "tab:green"}
    for r, b in enumerate(budgets):
        group = [c for c in configs if c.budget == b]
        labels = [f"{c.setup.name}\n{c.dist}\n{'straggler' if c.straggler else 'healthy'}" for c in group]
        x = np.arange(len(group))
        ax1, ax2 = axes[2 * r][0], axes[2 * r + 1][0]
        w = 0.27
        for k, m in enumerate(("sampler", "ffd", "repack")):
            ax1.bar(x + (k - 1) * w, [c.speedup(m) for c in group], w, color=colors[m], alpha=0.8,
                    label=f"aware vs {LABELS[m]}")
        for k, m in enumerate(("sampler", "ffd", "repack")):
            ax1.plot(x + (k - 1) * w, [c.speedup(m, True) for c in group], "kx", ms=6,
                     label="event simulator" if k == 0 else None)
        ax1.axhspan(*HYDRAULIS_SPEEDUP, color="grey", alpha=0.15, label="Hydraulis end to end (1.32–2.66×)")
        ax1.axhline(1.0, color="black", lw=0.8)
        ax1.set_xticks(x, labels, fontsize=6.5)
        ax1.set_ylim(0.9, max(2.0, max(c.speedup(m, sim) for c in group for m in ("sampler", "ffd")
                                        for sim in (False, True)) * 1.1))
        ax1.set(ylabel="mean iteration time ratio",
                title=f"b{b} ({b} full 32K micro-batches per pipeline): speedup of length-aware "
                      "(bars: cost model's 1F1B time; ×: event simulator)")
        ax1.legend(fontsize=7, ncol=5, loc="upper left")
        w = 0.2
        for k, m in enumerate(METHODS):
            bp = ax2.boxplot([c.gaps(m) for c in group], positions=x + (k - 1.5) * w, widths=w * 0.9,
                             patch_artist=True, showfliers=False, manage_ticks=False)
            for box in bp["boxes"]:
                box.set(facecolor=colors[m], alpha=0.6)
            for med in bp["medians"]:
                med.set(color="black")
            ax2.plot([], [], color=colors[m], lw=6, alpha=0.6, label=LABELS[m])
            ax2.plot(x + (k - 1.5) * w, [statistics.mean(c.gaps(m, True)) for c in group], "kx", ms=5,
                     label="event simulator (mean)" if k == 0 else None)
        ax2.axhspan(*HYDRAULIS_GAP_FIXED, color="tab:red", alpha=0.08, label="Hydraulis: fixed packing")
        ax2.axhspan(*HYDRAULIS_GAP_OURS, color="tab:green", alpha=0.12, label="Hydraulis: theirs")
        ax2.set_xticks(x, labels, fontsize=6.5)
        ax2.set_ylim(0, 0.8)
        ax2.set(ylabel="(max − min) / max", title=f"b{b}: slowest-to-fastest pipeline gap per iteration "
                                                  "(cost model: quartiles, whiskers 1.5 IQR; ×: simulator mean)")
        ax2.legend(fontsize=7, ncol=6, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- markdown section
MARKER = "bench:lengths"
HEADING = """## Length-aware data assignment at paper scale

Length-oblivious packing (next-fit to 32K in sampler order, contiguous slices per pipeline; and FFD
dealt round-robin) against the length-aware planner (`lengths.dispatch` + `lengths.pack`; ablation:
the sampler-order assignment re-packed by `lengths.pack` alone) on token-budget global batches,
with per-layer costs a·Σl² + b·Σl + c from the analytic FLOP model of an A100/A800-class device.
Every plan is scored by the cost model's own 1F1B pipeline formula and replayed in the event
simulator (p2p, gradient reduction and optimizer step included); the measured-runtime part is
the next section. Derivations and assumptions: `benchmarks/lengths.py`. Plot: `benchmarks/plots/lengths.png`."""


def write_markdown(markdown: str, path: Path) -> None:
    from .planner import write_section
    start = f"<!-- {MARKER} -->"
    if not path.exists() or start not in path.read_text():
        text = path.read_text() if path.exists() else "# Benchmarks\n"
        path.write_text(text.rstrip() + "\n\n" + HEADING + "\n\n" + start + "\n<!-- /" + MARKER + " -->\n")
    write_section(markdown, path, MARKER)


# ----------------------------------------------------------------------------- entry point
def run(setups: Sequence[Setup], dists: Sequence[str], iterations: int, *, budgets: Sequence[int] = BUDGETS,
        seed: int = 0, ilp_time_limit: float = 2.0, pack_time_limit: float = 0.5, pack_total: float = 2.0,
        rate: float = STRAGGLER_RATE, log=_log) -> list[Config]:
    cache: dict = {}
    configs = []
    grid = [(b, s, d, strag) for b in budgets for s in setups for d in dists for strag in (False, True)]
    for b, s, d, strag in grid:
        t = time.perf_counter()
        c = run_config(s, d, strag, iterations, budget=b, seed=seed, ilp_time_limit=ilp_time_limit,
                       pack_time_limit=pack_time_limit, pack_total=pack_total, lengths_cache=cache, rate=rate)
        configs.append(c)
        log(f"[lengths] {c.name}: aware {c.mean_iter('aware'):.2f} s, sampler-order "
            f"{c.mean_iter('sampler'):.2f} s ({c.speedup('sampler'):.2f}x), ffd {c.mean_iter('ffd'):.2f} s "
            f"({c.speedup('ffd'):.2f}x); gaps {statistics.mean(c.gaps('sampler')):.3f} / "
            f"{statistics.mean(c.gaps('ffd')):.3f} / {statistics.mean(c.gaps('aware')):.3f}; "
            f"planning {statistics.mean(it.planning_s for it in c.iterations):.2f} s; {time.perf_counter() - t:.0f} s")
    return configs


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="malleus bench lengths", description=__doc__.split("\n")[0])
    ap.add_argument("--setups", default=",".join(SETUPS), help=f"comma-separated subset of {', '.join(SETUPS)}")
    ap.add_argument("--dists", default=",".join(DISTS), help=f"comma-separated subset of {', '.join(DISTS)}")
    ap.add_argument("--budgets", default=",".join(map(str, BUDGETS)),
                    help="token budgets, in full 32K micro-batches per pipeline (comma-separated)")
    ap.add_argument("--iterations", type=int, default=20, help="global batches per configuration")
    ap.add_argument("--seed", type=int, default=0)
    number_option(ap, "--rate", 1, 100, default=STRAGGLER_RATE, help="straggling stage's slowdown")
    number_option(ap, "--ilp-time-limit", 0.001, MAX_SECONDS, default=2.0, help="dispatch MILP seconds per iteration")
    number_option(ap, "--pack-time-limit", 0.001, MAX_SECONDS, default=0.5, help="packing MILP seconds per micro-batch count")
    number_option(ap, "--pack-total", 0.001, MAX_SECONDS, default=2.0, help="packing seconds per pipeline before LPT only")
    ap.add_argument("--quick", action="store_true",
                    help="70b-64gpu, budget 2, 3 iterations, short time limits (for tests)")
    ap.add_argument("--write", metavar="MD", help="update this markdown file's lengths section (e.g. BENCHMARKS.md)")
    ap.add_argument("--plot", metavar="PNG", help="write the figure here (e.g. benchmarks/plots/lengths.png)")
    ap.add_argument("--json", metavar="PATH", help="dump every iteration's per-pipeline times and planning data")
    args = ap.parse_args(argv)
    if args.quick:
        args.setups, args.budgets, args.iterations = "70b-64gpu", "2", min(args.iterations, 3)
        args.ilp_time_limit, args.pack_time_limit, args.pack_total = 0.5, 0.2, 0.5
    args.setups = [s for s in args.setups.split(",") if s]
    args.dists = [d for d in args.dists.split(",") if d]
    if bad := [s for s in args.setups if s not in SETUPS]:
        ap.error(f"--setups: unknown {bad}; known: {', '.join(SETUPS)}")
    if bad := [d for d in args.dists if d not in DISTS]:
        ap.error(f"--dists: unknown {bad}; known: {', '.join(DISTS)}")
    try:
        args.budgets = [int(b) for b in args.budgets.split(",") if b.strip()]
    except ValueError:
        ap.error(f"--budgets must be comma-separated integers, got {args.budgets!r}")
    if not args.budgets or min(args.budgets) < 1:
        ap.error("--budgets: at least one, each >= 1")
    if args.iterations < 1:
        ap.error("--iterations must be >= 1")
    if not 1.0 < args.rate:
        ap.error("--rate must be > 1")
    args.argv = list(argv)
    return args


def execute(args: argparse.Namespace) -> tuple[list[Config], str]:
    """Run the grid, print the markdown, write the plot and the section if asked; (configs, markdown)."""
    t0 = time.perf_counter()
    setups = [SETUPS[s] for s in args.setups]
    configs = run(setups, args.dists, args.iterations, budgets=args.budgets, seed=args.seed,
                  ilp_time_limit=args.ilp_time_limit, pack_time_limit=args.pack_time_limit,
                  pack_total=args.pack_total, rate=args.rate)
    elapsed = time.perf_counter() - t0
    text, _ = summary(configs)
    dist_notes = "; ".join(f"{d}: {dataset_lengths(d)[1]}" for d in args.dists)
    md = "\n\n".join([
        f"Device: {DEVICE.peak_tflops:g} bf16 TFLOP/s at {100 * DEVICE.efficiency:.0f}% sustained, NVLink "
        f"{DEVICE.intra_node_gbps:g} GB/s; full recomputation; micro-batches of at most {CONTEXT} tokens for both "
        f"methods. Token budget per iteration: D × budget × {CONTEXT} (b2: two full micro-batches per pipeline, the "
        f"scale of Hydraulis's 100K–200K tokens on 64 GPUs; b8: eight, 2× the pipeline depth). Straggler: one "
        f"device of pipeline 0's second stage at {args.rate:g}×, that pipeline's layers re-balanced (layers@rate "
        f"below). Distributions: {dist_notes}. Aware: dispatch MILP limit {args.ilp_time_limit:g} s (greedy "
        f"incumbent, 20 restarts), packing MILP {args.pack_time_limit:g} s per V and {args.pack_total:g} s per "
        f"pipeline, V <= Σl/UtilLen. Gap: (slowest − fastest)/slowest pipeline time per iteration.",
        setups_table(setups, args.budgets),
        "Scored by the cost model's 1F1B formula (`LengthCost.pipeline_time`):",
        results_table(configs),
        "The same plans replayed in the event simulator (`simulate.simulate` with per-micro-batch work and "
        "p2p volume; p2p at the analytic activation bytes over NVLink or InfiniBand, gradient reduction of "
        "blocks held by several pipelines over InfiniBand, optimizer step 0.05 t0 per block; gap over each "
        "pipeline's last backward):",
        sim_table(configs),
        text,
    ])
    print(md)
    if args.plot:
        _log(f"wrote {plot(configs, Path(args.plot))}")
    if args.json:
        Path(args.json).write_text(json.dumps([c.to_dict() for c in configs], indent=1))
        _log(f"wrote {args.json}")
    if args.write:
        cmd = ("malleus bench lengths " + " ".join(args.argv)).strip()
        stamp = time.strftime("%Y-%m-%d")
        load = "/".join(f"{x:.1f}" for x in os.getloadavg())
        write_markdown(f"Command: `{cmd}` — {stamp}, {os.cpu_count()}-core CPU machine (load average "
                       f"{load} at the end), one process; {elapsed:.0f} s. Planning seconds are wall time under "
                       f"that load.\n\n{md}", Path(args.write))
    _log(f"done in {elapsed:.0f} s")
    return configs, md


def main(argv: list[str]) -> int:
    execute(parse_args(argv))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main(sys.argv[1:]))
