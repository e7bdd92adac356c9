"""The 'full' objective: one 1F1B iteration in closed form, priced as the event simulator runs it.

Per pipeline i with stage times t_ij (blocks × group rate + the stage's p2p, `organize.p2p_extras`)
and m_i micro-batches:
    w_i = (m_i - 1) · max_j t_ij + Σ_j t_ij
(the first micro-batch's forward fills the pipeline, the last one's backward drains it; with equal
stages this is the (m_i + S_i - 1)·z_i of 'bubble', with uneven ones far less: a short stage adds
only its own time, not the slowest stage's).

Gradient reduction: stage (i, j) finishes when the last backward has passed it, the backward share
of the stages before it earlier than w_i; its reduction starts when every stage holding one of its
blocks (in any pipeline) has finished, and lasts Σ over its blocks of grad_sync_per_block / the
smallest group holding the block (0 for a block that one pipeline holds). The iteration ends at the
latest pipeline end or reduction end. This is the simulator's dependency rule with each stage's
finish estimated, so later stages' reductions hide behind the drain as they do there.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

from ..costmodel.profile import BACKWARD_RATIO
from .problem import PlannerProblem

BACKWARD_SHARE = BACKWARD_RATIO / (1 + BACKWARD_RATIO)   # of a stage's fwd+bwd time per micro-batch


@dataclass(frozen=True)
class PipelineTimes:
    """One pipeline as the 'full' objective sees it; stages holding 0 blocks are left out."""
    micro_batches: int
    times: tuple[float, ...]     # t_ij, t0 per micro-batch
    layers: tuple[int, ...]      # blocks per stage, in order
    sizes: tuple[int, ...]       # TP group size per stage


def fill_drain(times: Sequence[float]) -> float:
    """What a pipeline takes beyond m·max(t): Σ t - max t (ILP-2's offset for 'full')."""
    return sum(times) - max(times)


def pipeline_time(micro_batches: int, times: Sequence[float]) -> float:
    return micro_batches * max(times) + fill_drain(times)


def iteration_time(problem: PlannerProblem, pipes: Sequence[PipelineTimes]) -> float:
    """The 'full' objective of an organisation (module docstring)."""
    ends = [pipeline_time(p.micro_batches, p.times) for p in pipes]
    g = problem.comm.grad_sync_per_block
    if not g:
        return max(ends)
    # Blocks in runs between consecutive stage boundaries of any pipeline: within a run every block
    # has the same holders, so the cost is per run, not per block (10,000 blocks stay cheap).
    bounds = sorted({0, problem.num_layers} | {a for p in pipes for a in itertools.accumulate(p.layers)})
    runs = list(zip(bounds, bounds[1:]))
    smallest, holders, latest = [0] * len(runs), [0] * len(runs), [0.0] * len(runs)
    stages = []   # (first run, end run) of each stage holding blocks
    for p, w in zip(pipes, ends):
        k, start, finish = 0, 0, w
        for t, n, size in zip(p.times, p.layers, p.sizes):
            first = k
            while k < len(runs) and runs[k][1] <= start + n:
                smallest[k] = size if not smallest[k] else min(smallest[k], size)
                holders[k] += 1
                latest[k] = max(latest[k], finish)
                k += 1
            stages.append((first, k))
            finish -= BACKWARD_SHARE * t
            start += n
    cost = [g * (b - a) / smallest[k] if holders[k] > 1 else 0.0 for k, (a, b) in enumerate(runs)]
    last = max(ends)
    for first, end in stages:
        sync = sum(cost[first:end])
        if sync:
            last = max(last, max(latest[first:end]) + sync)
    return last
