"""The 1F1B order of one pipeline stage: the runtime executes it and the simulator times it."""
from __future__ import annotations

from typing import Literal

Action = tuple[Literal["F", "B"], int]   # (forward or backward, micro-batch index)


def one_f_one_b(num_stages: int, stage: int, num_micro: int) -> list[Action]:
    """The ordered actions of `stage` under non-interleaved 1F1B.

    Stage j of S with m micro-batches runs min(S - j - 1, m) warm-up forwards, then alternates one
    forward and one backward, then drains the remaining backwards: at most S - j micro-batches are
    in flight, which bounds the activations a stage keeps.
    """
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} is outside a pipeline of {num_stages} stages")
    if num_micro < 1:
        raise ValueError(f"a pipeline needs at least one micro-batch, got {num_micro}")
    warmup = min(num_stages - stage - 1, num_micro)
    actions: list[Action] = [("F", i) for i in range(warmup)]
    for i in range(warmup, num_micro):
        actions += [("F", i), ("B", i - warmup)]
    actions += [("B", i) for i in range(num_micro - warmup, num_micro)]
    return actions
