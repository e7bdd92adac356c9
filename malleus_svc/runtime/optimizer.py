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

from malleus_svc.costmodel.analytic import UPDATE_PASSES


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

    def decays(self, p: torch.Tensor) -> bool:
        return p not in self.no_decay

    @staticmethod
    def new_state(like: torch.Tensor) -> dict[str, torch.Tensor]:
        """Adam's state of a tensor before its first update (torch's layout)."""
        return {"step": torch.tensor(0.0, dtype=torch.float32, device="cpu"),
                "exp_avg": torch.zeros_like(like, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(like, memory_format=torch.preserve_format)}

    @torch.no_grad()
    def step(self, lr: float | None = None, params: Iterable[torch.Tensor] | None = None) -> None:
        """One update, at `lr` (None: the constructor's), of every parameter (or of `params`) that
        has a gradient."""
        params = [p for p in (self.params if params is None else params) if p.grad is not None]
        for p in params:
            if p not in self.state:
                self.state[p] = self.new_state(p)
        self.update(params, [p.grad for p in params], [self.state[p] for p in params],
                    [self.decays(p) for p in params], lr)

    @torch.no_grad()
    def update(self, params: list[torch.Tensor], grads: list[torch.Tensor], states: list[dict[str, torch.Tensor]],
               decays: list[bool], lr: float | None = None) -> None:
        """The update of any tensors (parameters or slices of them) with their gradients and states,
        weight decay where `decays`: each state's step and moments advance in place."""
        for want, weight_decay in ((True, self.weight_decay), (False, 0.0)):
            group = [i for i, d in enumerate(decays) if d == want]
            if group:
                adamw([params[i] for i in group], [grads[i] for i in group],
                      [states[i]["exp_avg"] for i in group], [states[i]["exp_avg_sq"] for i in group], [],
                      [states[i]["step"] for i in group], amsgrad=False, beta1=self.betas[0], beta2=self.betas[1],
                      lr=self.lr if lr is None else lr, weight_decay=weight_decay, eps=self.eps, maximize=False)


def update_bytes(params: Iterable[torch.Tensor]) -> float:
    """Bytes an AdamW update moves (`UPDATE_PASSES` over the parameters' size)."""
    return UPDATE_PASSES * sum(p.numel() * p.element_size() for p in params)
