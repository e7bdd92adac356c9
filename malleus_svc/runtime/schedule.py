"""What one pipeline stage does in a training step, in order: the 1F1B actions and, for each, the
boundary tensor it receives before computing and sends after. Pure: `transport.py` moves the
tensors, the engine computes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from malleus_svc.geometry import one_f_one_b


@dataclass(frozen=True)
class StageStep:
    kind: Literal["F", "B"]
    micro: int
    receive: bool   # F: the activation from the previous stage; B: the gradient from the next one
    send: bool      # F: the output to the next stage; B: the input's gradient to the previous one


def stage_steps(num_stages: int, stage: int, num_micro: int) -> list[StageStep]:
    """The steps of `stage` of a pipeline of `num_stages` running `num_micro` micro-batches."""
    has_prev, has_next = stage > 0, stage < num_stages - 1
    return [StageStep(kind, i, receive=has_prev if kind == "F" else has_next,
                      send=has_next if kind == "F" else has_prev)
            for kind, i in one_f_one_b(num_stages, stage, num_micro)]
