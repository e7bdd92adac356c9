"""The 'full' objective: one 1F1B iteration in closed form, priced as the event simulator runs it.

Per pipeline i with stage times t_ij (blocks × group rate + the stage's p2p, `organize.p2p_extras`)
and m_i micro-batches:
    w_i = (m_i - 1) · max_j t_ij + Σ_j t_ij
(the first micro-batch's forward fills the pipeline, the last one's backward drains it; with equal
stages this is the (m_i + S_i - 1)·z_i of 'bubble', with uneven ones far less: a short stage adds
only its own time, not the slowest stage's).

Gradient reduction, behind the last backward (as the runtime overlaps it): stage (i, j) finishes
when the last backward has passed it, the backward share of the stages before it earlier than w_i,
and that backward passes its blocks one by one, from its last to its first, each taking an equal part
of the stage's backward share. A block's reduction may start once every stage holding it (in any
pipeline) has passed it, and lasts grad_sync_per_block / the smallest group holding the block (0 for
a block that one pipeline holds); a stage reduces its blocks one after another, in backward's order.
Then each stage takes its optimizer step (`update_time`: `optimizer_per_block` per block, tp/|g| of
it on a smaller group, 1/P with the optimizer sharded, at the stage's slowest device's rate), and the
iteration ends when every stage has stepped. This is the simulator's dependency rule with each
stage's finish estimated, so reductions hide behind the backward and the drain as they do there.
"""
from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass
from typing import Mapping, Sequence

from ..costmodel.profile import BACKWARD_RATIO, RECOMPUTED_FORWARD
from .problem import PlannerProblem

def backward_share(recompute: str = "none") -> float:
    """A stage's backward share of its fwd+bwd time per micro-batch, with what its backward runs of
    the forward again (recompute mode `recompute`)."""
    again = RECOMPUTED_FORWARD[recompute]
    return (BACKWARD_RATIO + again) / (1 + BACKWARD_RATIO + again)


@dataclass(frozen=True)
class PipelineTimes:
    """One pipeline as the 'full' objective sees it; stages holding 0 blocks are left out."""
    micro_batches: int
    times: tuple[float, ...]     # t_ij, t0 per micro-batch
    layers: tuple[int, ...]      # blocks per stage, in order
    sizes: tuple[int, ...]       # TP group size per stage
    recompute: tuple[str, ...] = ()    # per stage: its recompute mode (none: no stage recomputes)
    rates: tuple[float, ...] = ()      # per stage: its group rate y (none: healthy groups)


def fill_drain(times: Sequence[float]) -> float:
    """What a pipeline takes beyond m·max(t): Σ t - max t (ILP-2's offset for 'full')."""
    return sum(times) - max(times)


def pipeline_time(micro_batches: int, times: Sequence[float]) -> float:
    return micro_batches * max(times) + fill_drain(times)


def update_time(problem: PlannerProblem, rate: float, size: int, blocks: int, pipelines: int) -> float:
    """A stage's optimizer step: its blocks' state, tp/|g| times a full-size group member's (1/P of
    it with the optimizer sharded over the P pipelines, which all hold every block), at its slowest
    device's speed (the group rate over α(|g|); at least healthy, as the rate was snapped)."""
    shared = pipelines if problem.memory.sharded else 1
    return (problem.optimizer_per_block * blocks * (problem.tp / size) * max(1.0, rate / problem.alpha(size))
            / shared)


def iteration_time(problem: PlannerProblem, pipes: Sequence[PipelineTimes] | Mapping[PipelineTimes, int]) -> float:
    """The 'full' objective of an organisation (module docstring): its pipelines, or each distinct
    pipeline with its number of copies."""
    # Equal pipelines (data-parallel replicas) end, reduce and step alike: each is walked once.
    copies = pipes if isinstance(pipes, Mapping) else collections.Counter(pipes)
    num_pipelines = sum(copies.values())
    ends = [pipeline_time(p.micro_batches, p.times) for p in copies]
    g = problem.comm.grad_sync_per_block
    if not g and not problem.optimizer_per_block:
        return max(ends)
    # Blocks in runs between consecutive stage boundaries of any pipeline: within a run every block
    # has the same holders, so the cost is per run, not per block (10,000 blocks stay cheap).
    bounds = sorted({0, problem.num_layers} | {a for p in copies for a in itertools.accumulate(p.layers)})
    runs = list(zip(bounds, bounds[1:]))
    smallest, holders = [0] * len(runs), [0] * len(runs)
    # when every holder has passed the run's last block (the first one backward reaches), and its first
    first_ready, last_ready = [0.0] * len(runs), [0.0] * len(runs)
    stages = []   # (first run, end run, its last backward's end, its optimizer step) of each stage
    for (p, count), w in zip(copies.items(), ends):
        k, start, finish = 0, 0, w
        n_st = len(p.times)
        for t, n, size, rc, y in zip(p.times, p.layers, p.sizes, p.recompute or ("none",) * n_st,
                                     p.rates or (1.0,) * n_st):
            backward = backward_share(rc) * t
            first, per_block = k, backward / n
            while k < len(runs) and runs[k][1] <= start + n:
                a, b = runs[k]
                smallest[k] = size if not smallest[k] else min(smallest[k], size)
                holders[k] += count
                first_ready[k] = max(first_ready[k], finish - (b - 1 - start) * per_block)
                last_ready[k] = max(last_ready[k], finish - (a - start) * per_block)
                k += 1
            stages.append((first, k, finish, update_time(problem, y, size, n, num_pipelines)))
            finish -= backward
            start += n
    last = max(ends)
    for first, end, finish, update in stages:
        # A stage reduces its runs last first, each block of a run in g / smallest as soon as it is
        # passed: with blocks passed at a steady pace the queue ends at one of the run's ends (the last
        # block passed, then one reduction; or the first passed, then all of them), or behind the run
        # before. Then it steps.
        queue = 0.0
        for k in range(end - 1, first - 1, -1):
            if g and holders[k] > 1:
                n, each = runs[k][1] - runs[k][0], g / smallest[k]
                queue = max(queue + n * each, first_ready[k] + n * each, last_ready[k] + each)
        last = max(last, max(finish, queue) + update)
    return last
