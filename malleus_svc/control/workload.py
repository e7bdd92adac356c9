"""Work units per device for the rate estimator (the Malleus straggling rate).

Each active device reports, per iteration, the device time of its compute ops (its DeviceClock:
CUDA events on a GPU, the paced clock on CPU; waiting for peers and TP collectives left out) and
the FLOPs those ops did, which the engine counts from its own modules and micro-batches. Its work
in t0 units is those FLOPs over t0's (one block's forward + backward over one nominal micro-batch
of `micro_batch_size × seq_len` tokens), so busy / work is a unit time comparable across devices
whatever their share of the plan: more blocks, a TP shard, the LM head, longer or shorter
sequences. The RateEstimator turns it into a straggling rate. Pure functions, no Ray.

An emulated accelerator with a fixed time per block an op runs through (`device_clock.Pace`)
prices work as its clock does: the device's FLOPs and block passes over t0's (one block, two ops:
forward and backward), so busy / work is rate × t0 exactly, whatever the micro-batches' sizes.
"""
from __future__ import annotations

from typing import Any, Mapping

from malleus_svc.plan import Plan


def t0_flops(scenario, plan: Plan, seq_len: int | None = None) -> float:
    """FLOPs of t0: one block's forward + backward over one nominal micro-batch."""
    seq = seq_len or scenario.shape.seq_len
    return scenario.shape.block_flops(plan.micro_batch_size * seq, seq)


def device_work(plan: Plan, scenario, devices: Mapping[int, Mapping[str, Any]],
                seq_len: int | None = None, pace=None) -> dict[int, float]:
    """device -> work in t0 units this iteration, from each active device's reported FLOPs (and
    block passes, under a `pace` with a time per block)."""
    unit = t0_flops(scenario, plan, seq_len)
    roles = plan.roles()
    if pace is None or not pace.block_seconds:
        return {d: float(s.get("flops") or 0.0) / unit for d, s in devices.items() if d in roles}
    t0 = pace.nominal(flops=unit, blocks=2)
    return {d: pace.nominal(flops=float(s.get("flops") or 0.0), blocks=int(s.get("block_ops") or 0)) / t0
            for d, s in devices.items() if d in roles}


def busy_seconds(stats: Mapping[str, Any]) -> float:
    """A device's own compute this iteration (or its probe's): device time on its DeviceClock."""
    return float(stats.get("compute_seconds") or 0.0)
