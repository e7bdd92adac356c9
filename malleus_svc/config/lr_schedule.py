"""The learning rate at each step: a pure function of the step, so that it is the same under any
plan and across migrations, node losses, coordinator restarts and resumes from a checkpoint.

Steps count updates from 0; update `step` is the (step + 1)-th. Warm-up rises linearly from 0 and
reaches the peak `lr` at update `warmup_steps`; the decay then takes it to `min_lr` at update
`decay_steps` and holds it there:
  constant  the peak throughout (after any warm-up);
  linear    a straight line from the peak to min_lr;
  cosine    half a cosine from the peak to min_lr;
  wsd       warm-up, stable, decay: the peak, then a straight line to min_lr over the last
            `decay_fraction` of the steps between warm-up and decay_steps.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

DECAYS = ("constant", "linear", "cosine", "wsd")


@dataclass(frozen=True)
class LrSchedule:
    warmup_steps: int = 0
    decay: str = "constant"
    decay_steps: int | None = None   # None: no decay phase (constant only)
    min_lr: float = 0.0
    decay_fraction: float = 0.2      # wsd only

    def lr_at(self, step: int, lr: float) -> float:
        n = step + 1
        if n <= self.warmup_steps:
            return lr * n / self.warmup_steps
        if self.decay == "constant":
            return lr
        start = self.warmup_steps
        if self.decay == "wsd":
            start = self.decay_steps - self.decay_fraction * (self.decay_steps - self.warmup_steps)
        if n <= start:
            return lr
        progress = min((n - start) / (self.decay_steps - start), 1.0)
        if self.decay == "cosine":
            return self.min_lr + (lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
        return lr - (lr - self.min_lr) * progress     # linear, and wsd's decay
