"""What the planner should assume a micro-batch costs under the observed length distribution.

The planner (`planner.PlannerProblem`) times everything in t0, one block's forward + backward of
a fixed-length micro-batch: `micro_batch_size` samples of `seq_len` tokens, M = global batch /
micro-batch size of them per iteration. Real samples are shorter and long-tailed, and the
runtime packs them into micro-batches of at most that token budget B = micro_batch_size × seq_len
(`control.assign`). `expected_micro_batch` takes a representative global batch from the observed
lengths (a `LengthHistogram` or the lengths themselves: one sample per quantile), packs it to B
(`first_fit_decreasing`: the fullest micro-batches, the fewest of them) and prices every
micro-batch with the `LengthCost` (a·Σl² + b·Σl + d·n + c), relative to the fixed-length one:

* `time_ratio`: the mean packed micro-batch's time / the fixed micro-batch's;
* `count_ratio`: packed micro-batches per global batch / M;
* `work_ratio` = time_ratio × count_ratio: what one of the planner's M micro-batch slots costs on
  average. The planner keeps M (the plan's global batch is counted in samples), so this is the
  factor on t0. Why not time_ratio alone: with short samples fewer micro-batches run, and the
  steady state of every pipeline (m_i · z_i) is work, not micro-batch count;
* `token_ratio`: mean tokens per sample / seq_len, the factor on the activation bytes p2p moves
  per slot;
* `memory_tokens`: the tokens one micro-batch must be able to hold: the `quantile` (default 1.0,
  the fullest) of the packed micro-batches' tokens, never below the longest sequence, never above B.
  Below B only when packing cannot fill B (few samples per global batch); a plan made for it is
  safe only while the assignment packs to at most `memory_tokens` (pass it as the token budget).

`LengthProfile.apply(problem)` rescales a PlannerProblem accordingly (see there); a fixed-length
distribution (every sample seq_len tokens) gives all ratios exactly 1 and leaves it unchanged.
The fill and drain of 1F1B are still charged per slot ((S − 1) · z), as the planner's model has it.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .cost import Coeffs, LengthCost, LengthError
from .packing import first_fit_decreasing
from .stats import LengthHistogram

MAX_SAMPLES = 1024   # a larger global batch is represented by this many quantiles (ratios are per sample)


@dataclass(frozen=True)
class LengthProfile:
    """Expected micro-batch time and memory under a length distribution, relative to fixed-length ones."""

    time_ratio: float
    count_ratio: float
    token_ratio: float
    memory_tokens: int
    token_budget: int
    samples: int             # size of the representative global batch

    @property
    def work_ratio(self) -> float:
        return self.time_ratio * self.count_ratio

    @property
    def memory_ratio(self) -> float:
        return self.memory_tokens / self.token_budget

    @property
    def is_fixed(self) -> bool:
        return self.work_ratio == 1.0 and self.token_ratio == 1.0 and self.memory_tokens == self.token_budget

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "work_ratio": self.work_ratio, "memory_ratio": self.memory_ratio}

    def apply(self, problem):
        """`problem` (a planner.PlannerProblem) with its per-micro-batch terms for this distribution:

        * t0_seconds × work_ratio: predicted seconds follow the expected work;
        * p2p per micro-batch (t0 units) × token_ratio / work_ratio: its bytes follow the tokens, and
          the unit t0 changed; the gradient reduction and the optimizer step (per iteration, not per
          micro-batch) / work_ratio. So when short samples make compute cheaper, communication and
          the update weigh more in the objective;
        * the activation part of each per-layer memory K[d] × memory_ratio, with K[d] = state + d · act
          fitted through the profile's end points (exact for the analytic profile), and likewise its
          replicated part; K stays as it is when it lists one depth only. So do what recomputation
          frees or keeps of them (a block's activations, its input, what selective frees): they
          follow the tokens too, and left whole they would free more than K now holds. The
          embedding/head term is left as it is (conservative).
        tp_alpha is left as it is."""
        if self.is_fixed:
            return problem
        w, c, mem = self.work_ratio, problem.comm, problem.memory
        comm = dataclasses.replace(c, p2p_intra_node=c.p2p_intra_node * self.token_ratio / w,
                                   p2p_inter_node=c.p2p_inter_node * self.token_ratio / w,
                                   grad_sync_per_block=c.grad_sync_per_block / w)
        if len(mem.layer_mb) >= 2 and self.memory_ratio != 1.0:
            r = self.memory_ratio
            mem = dataclasses.replace(mem, layer_mb=self._scale_activations(mem.layer_mb),
                                      replicated_layer_mb=self._scale_activations(mem.replicated_layer_mb),
                                      activation_mb=mem.activation_mb * r,
                                      replicated_activation_mb=mem.replicated_activation_mb * r,
                                      recompute_input_mb=mem.recompute_input_mb * r,
                                      selective_freed_mb=mem.selective_freed_mb * r)
        return dataclasses.replace(problem, t0_seconds=problem.t0_seconds * w, comm=comm, memory=mem,
                                   optimizer_per_block=problem.optimizer_per_block / w)

    def _scale_activations(self, k: tuple[float, ...]) -> tuple[float, ...]:
        """Rows listed for d = len(k) .. 1 micro-batches in flight, their per-depth part × memory_ratio."""
        if len(k) < 2:
            return k
        act = (k[0] - k[-1]) / (len(k) - 1)
        return tuple(v - (1.0 - self.memory_ratio) * (len(k) - n) * act for n, v in enumerate(k))


def representative(observed: LengthHistogram | Sequence[int], n: int) -> list[int]:
    """n lengths, one per quantile (k + 0.5) / n of the observed distribution."""
    qs = [(k + 0.5) / n for k in range(n)]
    if isinstance(observed, LengthHistogram):
        return [max(1, round(observed.quantile(q))) for q in qs]
    a = np.asarray(observed, dtype=np.int64)
    return [int(x) for x in np.quantile(a, qs, method="inverted_cdf")]


def expected_micro_batch(observed: LengthHistogram | Sequence[int], cost: LengthCost, *, micro_batch_size: int,
                         seq_len: int, global_batch: int, tp: int | None = None,
                         quantile: float = 1.0) -> LengthProfile | None:
    """The `LengthProfile` of the observed lengths for a job whose planner assumes fixed-length
    micro-batches (module docstring); None when nothing was observed yet. `global_batch` (samples,
    a multiple of micro_batch_size) sets how many samples are packed together; `tp` picks the
    cost's TP degree (a cost fitted for one degree only is used as it is: only ratios are taken)."""
    count = observed.count if isinstance(observed, LengthHistogram) else len(observed)
    if count == 0:
        return None
    for name, v in (("micro_batch_size", micro_batch_size), ("seq_len", seq_len), ("global_batch", global_batch)):
        if not (isinstance(v, int) and v >= 1):
            raise LengthError(name, v, "an integer >= 1")
    if global_batch % micro_batch_size:
        raise LengthError("global_batch", global_batch, f"a multiple of micro_batch_size ({micro_batch_size})")
    if not 0.0 < quantile <= 1.0:
        raise LengthError("quantile", quantile, "a quantile in (0, 1]")
    co = _coeffs(cost, tp)
    budget = micro_batch_size * seq_len
    n = min(global_batch, max(1, MAX_SAMPLES // micro_batch_size) * micro_batch_size)
    slots = n // micro_batch_size
    # A sample trains on at most seq_len tokens, as the fixed-length micro-batch assumes.
    lens = [min(x, seq_len) for x in representative(observed, n)]
    bins = [[lens[i] for i in b] for b in first_fit_decreasing(lens, budget)]
    fixed = co.micro_batch([seq_len] * micro_batch_size)
    # Sums of per-micro-batch ratios: exactly 1 per micro-batch (so exactly 1 overall) at fixed lengths.
    rel = math.fsum(co.micro_batch(b) / fixed for b in bins)
    tokens = sorted(sum(b) for b in bins)
    fullest = tokens[min(len(tokens) - 1, max(0, math.ceil(quantile * len(tokens)) - 1))]
    return LengthProfile(time_ratio=rel / len(bins), count_ratio=len(bins) / slots,
                         token_ratio=math.fsum(x / seq_len for x in lens) / n,
                         memory_tokens=min(budget, max(fullest, max(lens))), token_budget=budget, samples=n)


def analytic_cost(shape, tp: int, device=None) -> LengthCost:
    """a·l² + b·l per layer read off the planner's own block time (`costmodel.analytic.block_seconds`,
    exactly quadratic in the sequence length), so ratios are relative to the scenario's analytic t0."""
    from ..costmodel.analytic import DeviceSpec, block_seconds
    device = device or DeviceSpec()
    t1, t2 = (block_seconds(shape, tp, 1, device, seq_len=s) for s in (1, 2))
    a = (t2 - 2.0 * t1) / 2.0
    return LengthCost({tp: Coeffs(a=a, b=t1 - a)}, "s", {"source": "costmodel.analytic.block_seconds"})


def _coeffs(cost: LengthCost, tp: int | None) -> Coeffs:
    if tp is not None and tp not in cost.coeffs and len(cost.coeffs) == 1:
        return cost.at(None)
    return cost.at(tp)
