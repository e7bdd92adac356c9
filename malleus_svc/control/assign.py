"""Length-aware assignment of one global batch: which pipeline trains which sequences, in which
micro-batches (Hydraulis's two-stage assignment; the algorithms are in malleus_svc/lengths).

The plan fixes the pipelines (their stages, layers and devices) and the global batch; this only
re-deals the batch's sequences each iteration so that pipelines finish together in *time*, not
in sample count: (1) `lengths.dispatch` balances predicted pipeline times under the stages'
straggling rates, (2) `lengths.pack` packs each pipeline's share into micro-batches minimising
its 1F1B time. The token budget of a micro-batch stays the fixed assignment's
(micro_batch_size × seq_len), so memory never exceeds what the plan was checked for. Gradient
weighting counts tokens (each micro-batch's loss is scaled by its share of the global batch's
loss tokens), so the update is the same whatever the assignment.

`Lookahead` computes the assignment of step t+1 on a thread while step t trains (the sampler is
deterministic, so the next batch is known): planning is off the training path.
"""
from __future__ import annotations

import concurrent.futures as cf
from typing import Mapping, Sequence

from malleus_svc.lengths import LengthCost, PipelineSpec, dispatch, pack
from malleus_svc.plan import Plan

MILP_MIN_S = 0.05   # a time limit below this: greedy only (see assign)


def assign(ids: Sequence[int], lengths: Sequence[int], plan: Plan, cost: LengthCost,
           rates: Mapping[int, float], token_budget: int, time_limit_s: float = 0.5) -> list[list[list[int]]]:
    """Per pipeline, per micro-batch, the sample ids: every id of `ids` exactly once, every pipeline
    at least one micro-batch (each pipeline takes part in the gradient reduction). Below
    `MILP_MIN_S` the MILPs are skipped: building their Pyomo models alone takes longer than that,
    so the greedy dispatch and LPT packing (the MILPs' own incumbents) are the answer."""
    ids = [int(i) for i in ids]
    lens = [int(n) for n in lengths]
    specs = [PipelineSpec.from_plan(p, rates, max_tokens=token_budget) for p in plan.pipelines]
    exact = time_limit_s >= MILP_MIN_S
    d = dispatch(lens, specs, cost, time_limit_s=time_limit_s, solver="auto" if exact else "greedy")
    shares = [list(a) for a in d.assignment]
    for j, share in enumerate(shares):            # an empty pipeline takes the shortest sequence of the fullest
        if not share:
            donor = max(range(len(shares)), key=lambda k: len(shares[k]))
            k = min(shares[donor], key=lambda i: lens[i])
            shares[donor].remove(k)
            share.append(k)
    out = []
    for share, spec in zip(shares, specs):
        packing = pack([lens[i] for i in share], spec, cost, capacity=token_budget, time_limit_s=time_limit_s,
                       total_time_s=4 * time_limit_s if exact else 0.0)
        out.append([[ids[share[i]] for i in mb] for mb in packing.micro_batches])
    return out


def planning_time_limit(iteration_seconds: float | None) -> float:
    """The MILPs' time limit when the next step's assignment is planned while this one trains: it
    must take well under an iteration (and takes CPU from the workers meanwhile). `assign` runs up
    to 1 + 4 x pipelines limits in the worst case; under the limit the greedy incumbents stand, and
    below MILP_MIN_S they are all there is."""
    return 0.5 if iteration_seconds is None else min(0.5, max(0.02, 0.05 * iteration_seconds))


class Lookahead:
    """The next step's assignment, computed while this one trains; thrown away if its inputs changed."""

    def __init__(self):
        self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="malleus-assign")
        self._key = None
        self._future: cf.Future | None = None

    def prepare(self, key, fn, *args) -> None:
        self._key, self._future = key, self._pool.submit(fn, *args)

    def take(self, key, fn, *args):
        """The prepared answer if it was prepared for `key`, else computed now."""
        if self._future is not None and self._key == key:
            fut, self._future = self._future, None
            return fut.result()
        return fn(*args)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
