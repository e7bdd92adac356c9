"""AdamW over one device's parameters: torch's own update (the functional `adamw`, torch's `adam`
with decoupled weight decay: the kernel `torch.optim.AdamW.step` runs), on state kept here in
torch's layout, per parameter: `step` (a float32 scalar on the host), `exp_avg` and `exp_avg_sq`
(like the parameter), made at its first update. Updates equal `torch.optim.AdamW`'s bit for bit
(a test), with weight decay per parameter (torch's parameter groups) and the learning rate given
per update (the job's schedule). Not `torch.optim.AdamW` itself: it imports torch's compiler on
first use, a third of a CPU worker's start-up (NOTES.md, Runtime).
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch.optim.adamw import adamw


class AdamW:
    def __init__(self, params: Iterable[torch.nn.Parameter], *, lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float, no_decay: Iterable[torch.nn.Parameter] = ()):
        self.params = list(params)
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.no_decay = set(no_decay)
        self.state: dict[torch.nn.Parameter, dict[str, torch.Tensor]] = {}

    def zero_grad(self) -> None:
        """Zero the gradients in place (their buffers stay: the engine accumulates into them)."""
        for p in self.params:
            if p.grad is not None:
                p.grad.zero_()

    @torch.no_grad()
    def step(self, lr: float | None = None) -> None:
        """One update, at `lr` (None: the constructor's), of every parameter that has a gradient."""
        params = [p for p in self.params if p.grad is not None]
        for p in params:
            if p not in self.state:
                self.state[p] = {"step": torch.tensor(0.0, dtype=torch.float32, device="cpu"),
                                 "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                 "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
        decayed = [p for p in params if p not in self.no_decay]
        kept = [p for p in params if p in self.no_decay]
        for group, weight_decay in ((decayed, self.weight_decay), (kept, 0.0)):
            states = [self.state[p] for p in group]
            if group:
                adamw(group, [p.grad for p in group], [s["exp_avg"] for s in states],
                      [s["exp_avg_sq"] for s in states], [], [s["step"] for s in states], amsgrad=False,
                      beta1=self.betas[0], beta2=self.betas[1], lr=self.lr if lr is None else lr,
                      weight_decay=weight_decay, eps=self.eps, maximize=False)
