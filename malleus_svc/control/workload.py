"""Work units per device for the rate estimator (the Malleus straggling rate).

A device's work in one iteration, in t0 units (one block's forward + backward on one healthy
device of a full-size TP group, for one micro-batch of `micro_batch_size × seq_len` tokens):

    work = (blocks + embedding share + head share) × micro-batches × α(|group|) × token scale

* blocks: the stage's layer count; the embedding (first stage) and LM head + loss (last stage)
  add a small share from their FLOPs relative to one block (`part_shares`);
* α(|group|): the planner's TP shrink factor for the device's group size (scenario tp_alpha), so
  a device doing 1/k of a block in a k-way group is compared with a device doing whole blocks;
* token scale: the tokens this device's pipeline really collated over the nominal
  micro-batches × micro_batch_size × seq_len (packed variable-length batches vary).

busy / work is then a unit time comparable across devices whatever their share of the plan, and
the RateEstimator turns it into a straggling rate. Pure functions, no Ray.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

from malleus_svc.plan import Plan


def part_shares(shape) -> tuple[float, float]:
    """(embedding share, head share) of one block's compute, from FLOPs per token.

    The embedding is a lookup (its backward a scatter-add): ~0. The head is a vocab × hidden
    matmul (6 FLOPs per parameter per token forward + backward) plus the loss.
    """
    if shape is None:
        return 0.0, 0.0
    block = shape.block_flops(1, shape.seq_len)
    head = 6.0 * shape.vocab * shape.hidden
    return 0.0, (head / block) if block > 0 else 0.0


def alpha(tp_alpha: tuple[float, ...], tp: int, group_size: int) -> float:
    """α of a group of `group_size` devices when the full TP degree is `tp`."""
    r = int(round(math.log2(max(1, tp) / max(1, group_size))))
    if 0 <= r < len(tp_alpha):
        return float(tp_alpha[r])
    return 1.0


def device_work(plan: Plan, scenario, device_tokens: Mapping[int, int] | None = None,
                seq_len: int | None = None) -> dict[int, float]:
    """device -> work in t0 units this iteration under `plan` (active devices only).

    `device_tokens`: device -> tokens its pipeline collated this iteration (the worker's report);
    None means nominal full micro-batches.
    """
    shape = getattr(scenario, "shape", None)
    emb, head = part_shares(shape)
    seq = seq_len or (shape.seq_len if shape is not None else 1)
    tp = int(getattr(scenario, "tp", 1))
    tp_alpha = tuple(getattr(scenario, "tp_alpha", (1.0,)))
    out: dict[int, float] = {}
    for d, role in plan.roles().items():
        pipe = plan.pipelines[role.pipeline]
        parts = (role.layers[1] - role.layers[0]) + (emb if role.is_first else 0.0) + (head if role.is_last else 0.0)
        nominal_tokens = pipe.micro_batches * plan.micro_batch_size * seq
        scale = 1.0
        if device_tokens is not None and d in device_tokens and nominal_tokens > 0:
            scale = max(float(device_tokens[d]), 1.0) / nominal_tokens
        out[d] = parts * pipe.micro_batches * alpha(tp_alpha, tp, role.tp_size) * scale
    return out


def busy_seconds(stats: Mapping[str, Any]) -> float:
    """A device's own compute this iteration: measured compute plus any stall inside it.

    On CPU, compute_seconds is thread CPU time (independent of how many workers share the cores)
    and injected_seconds the stall the emulation hook added after each compute, both belonging to
    this device. On GPU the same field is CUDA-synchronised compute time (CUDA events would do
    too); a real straggler's slowness shows up there directly and injected_seconds is 0.
    """
    return float(stats.get("compute_seconds") or 0.0) + float(stats.get("injected_seconds") or 0.0)
