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
    L = problem.num_layers
    smallest, holders, latest = [0] * L, [0] * L, [0.0] * L
    stages = []   # (first block, end block)
    for p, w in zip(pipes, ends):
        start, finish = 0, w
        for t, n, size in zip(p.times, p.layers, p.sizes):
            for b in range(start, start + n):
                smallest[b] = size if not smallest[b] else min(smallest[b], size)
                holders[b] += 1
                latest[b] = max(latest[b], finish)
            stages.append((start, start + n))
            finish -= BACKWARD_SHARE * t
            start += n
    cost = [g / smallest[b] if holders[b] > 1 else 0.0 for b in range(L)]
    last = max(ends)
    for a, b in stages:
        sync = sum(cost[a:b])
        if sync:
            last = max(last, max(latest[a:b]) + sync)
    return last
