"""The sampled sequence lengths as the coordinator sees them: statistics per batch, drift of the
distribution (a reason to re-plan), the planner's length profile, and the length-aware
assignment of each batch (prepared one step ahead)."""
from __future__ import annotations

import logging
from collections import deque

from malleus_svc.config.job import ControlConfig
from malleus_svc.planner.build import length_profile

log = logging.getLogger(__name__)


def drift_detector():
    """The coordinator's drift detector: the defaults, whose detection bound lengths/stats.py states."""
    from malleus_svc.lengths import DriftDetector
    return DriftDetector()


class LengthView:
    def __init__(self, job, window: int = ControlConfig.length_window):
        self.job = job
        self.recent: deque = deque(maxlen=window)
        self.last_stats: dict | None = None
        self.last_drift: dict | None = None
        self.drift = drift_detector()
        self._drift_lengths = None         # the batch that showed a drift (until the new window fills)
        self._profile, self._profile_key = None, None
        self.cost = None                   # lengths.LengthCost when data.assignment is length-aware
        self.lookahead = None

    @staticmethod
    def of_batch(group, ids: list[int]):
        """The lengths of a global batch's samples (None if the dataset keeps no length table)."""
        lengths = getattr(group.dataset, "lengths", None)
        if lengths is None:
            return None
        import numpy as np
        return np.asarray(lengths)[np.asarray(ids, dtype=np.int64)]

    def observe_stats(self, lengths) -> None:
        from malleus_svc.runtime.datasets import length_stats
        self.last_stats = length_stats(lengths)
        self.recent.append(self.last_stats)

    def observe_drift(self, lengths, step: int) -> str | None:
        """One batch's lengths into the drift detector; the drift's reason when the distribution moved."""
        rep = self.drift.observe(int(n) for n in lengths)
        if not rep.drifted:
            return None
        self.last_drift = {"step": step, **rep.to_dict()}
        # the next window of batches (all after the shift) is the new reference; rebasing on the
        # recent window instead, half old and half new, would report the same shift again
        self.drift = drift_detector()
        from malleus_svc.lengths import LengthHistogram
        self._drift_lengths = LengthHistogram.of(int(n) for n in lengths)
        return rep.reason

    def profile(self):
        """The planner's view of the sampled lengths (lengths/expected.py). None before any batch,
        and under padding (every micro-batch is then the fixed-length one)."""
        if self.job.data.mode == "pad":
            return None
        hist = self.drift.lifetime if self.drift.lifetime.count else self._drift_lengths
        if hist is None or not hist.count:
            return None
        key = (id(hist), hist.count)
        if key != self._profile_key:
            try:
                self._profile = length_profile(self.job.scenario, hist, self.cost, seq_len=self.job.data.seq_len)
            except Exception as e:   # never let the length view stop planning: plan at fixed length
                log.warning("length profile unavailable (%s); planning with fixed-length micro-batches", e)
                self._profile = None
            self._profile_key = key
        return self._profile

    def start_length_aware(self, group, paced: bool) -> str:
        """Fit the per-layer time of a micro-batch from its sequence lengths, for every TP degree up
        to the job's (a re-plan may split TP groups). A job on accelerators sweeps on one of its own
        devices, at its real lengths and kernels (`WorkerGroup.length_sweep`); a CPU job sweeps here,
        on the paced device clock when its workers run on it (`paced`). Returns what was fitted."""
        from malleus_svc.geometry import tp_divisibility_error
        from malleus_svc.runtime.length_sweep import run_sweeps

        from .assign import Lookahead
        shape, sc = self.job.shape, self.job.scenario
        tps = sorted(t for t in sc.tp_sizes if tp_divisibility_error(shape, t) is None)
        if group.use_gpu:
            self.cost, reports = group.length_sweep(shape, tps, self.job.data.seq_len, sc.device.intra_node_gbps)
        else:
            self.cost, reports = run_sweeps(shape, tps=tps, layers=min(2, shape.layers),
                                            clock="device" if paced else "thread")
        self.lookahead = Lookahead()
        return "length cost fitted, held-out error " + ", ".join(
            f"TP{t} {r.get('test_max_abs_error', float('nan')):.1%}" for t, r in sorted(reports.items()))

    def assignment(self, group, sampler, plan, ids: list[int], rates, last_iteration_seconds):
        """This batch's length-aware assignment (prepared during the last step) and the next one's
        prepared now; None under the fixed split."""
        if self.lookahead is None:
            return None
        from .assign import assign, planning_time_limit
        lengths = group.dataset.lengths
        limit = planning_time_limit(last_iteration_seconds)   # planned while a step trains

        def deal(batch):
            # a sample of l tokens trains l - 1 (inputs and shifted targets): the budget counts those
            return assign(batch, [int(lengths[i]) - 1 for i in batch], plan, self.cost, rates,
                          plan.micro_batch_size * self.job.data.seq_len, time_limit_s=limit)
        out = self.lookahead.take((plan.plan_id, tuple(ids)), deal, ids)
        nxt = sampler.peek(0, plan.global_batch)
        self.lookahead.prepare((plan.plan_id, tuple(nxt)), deal, nxt)
        return out

    def close(self) -> None:
        if self.lookahead is not None:
            self.lookahead.close()
