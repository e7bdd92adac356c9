"""The oracles: plain single-process training of the whole model on the whole global batch, and
attention over a packed row as one masked square.

No pipelines, no tensor parallelism, no gradient plumbing: one model from the same per-part
initialisation (a tied head is the embedding's own parameter, as `transformers` ties it), each
global batch's loss = its summed token cross-entropy / its loss-token count,
torch's own grad-norm clipping and AdamW (its parameter groups: weight decay by `geometry.decayed`;
the learning rate of each step set on them from the schedule). The engine's tests compare against
this. Varlen attention (flash-attn's kernel or the SDPA fallback) compares against
`masked_attention`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from malleus_svc.config.presets import ModelShape
from malleus_svc.geometry import TIED, decayed
from malleus_svc.runtime.batch import IGNORE_INDEX, MicroBatch
from malleus_svc.runtime.engine import EXP_AVG, EXP_AVG_SQ, STEP, OptimConfig
from malleus_svc.runtime.model import full_model


def reference_train(shape: ModelShape, seed: int, optim: OptimConfig,
                    global_batches: list[list[MicroBatch]], dtype: torch.dtype = torch.float32
                    ) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Train on each global batch in turn (parameters in `dtype`). Returns (loss per step, final parameters, optimizer
    state as ``name:exp_avg``, ``name:exp_avg_sq``, ``name:step``)."""
    model = full_model(shape, seed, dtype)
    if shape.tie_embeddings:
        model.head.weight = model.embedding.weight
    params = dict(model.named_parameters())      # a tied weight once, as embedding.weight
    decays = {name: decayed(name, optim.decay_embeddings) for name in params}
    groups = [{"params": [p for n, p in params.items() if decays[n] == d], "weight_decay": wd}
              for d, wd in ((True, optim.weight_decay), (False, 0.0))]
    optimizer = torch.optim.AdamW(groups, lr=optim.lr, betas=optim.betas, eps=optim.eps)
    losses = []
    for step, batch in enumerate(global_batches):
        loss_tokens = sum(mb.num_loss_tokens for mb in batch)
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for mb in batch:
            logits = model(mb.tokens, mb.positions(), mb.cu_seqlens)
            loss = F.cross_entropy(logits, mb.targets, ignore_index=IGNORE_INDEX, reduction="sum") / loss_tokens
            loss.backward()
            total += float(loss.detach())
        losses.append(total)
        if optim.grad_clip is not None and optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(list(params.values()), optim.grad_clip)
        for group in optimizer.param_groups:
            group["lr"] = optim.lr_at(step)
        optimizer.step()

    final = {name: p.detach().clone() for name, p in params.items()}
    state: dict[str, torch.Tensor] = {}
    for name, p in params.items():
        st = optimizer.state[p]
        state[name + EXP_AVG] = st["exp_avg"].clone()
        state[name + EXP_AVG_SQ] = st["exp_avg_sq"].clone()
        state[name + STEP] = torch.tensor(int(st["step"]))
    if shape.tie_embeddings:                     # both names, as the engine's state has them
        final[TIED[1]] = final[TIED[0]]
        for key in (EXP_AVG, EXP_AVG_SQ, STEP):
            state[TIED[1] + key] = state[TIED[0] + key]
    return losses, final, state


@torch.no_grad()
def reference_loss(shape: ModelShape, params: dict[str, torch.Tensor], batch: list[MicroBatch]) -> float:
    """The mean token cross-entropy of the whole model with `params` over one global batch."""
    model = full_model(shape, seed=0, dtype=next(iter(params.values())).dtype)
    model.load_full(params)
    total = sum(float(F.cross_entropy(model(mb.tokens, mb.positions(), mb.cu_seqlens), mb.targets,
                                      ignore_index=IGNORE_INDEX, reduction="sum")) for mb in batch)
    return total / sum(mb.num_loss_tokens for mb in batch)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Causal attention of q [T, Hq, d] over k, v [T, Hkv, d] packed as sequences of `lengths`: one
    SDPA call over the whole row with a block-diagonal causal mask, each key/value head repeated
    for its group of Hq / Hkv query heads by hand. Returns [T, Hq, d]."""
    tokens, heads = q.shape[:2]
    seq = torch.repeat_interleave(torch.arange(len(lengths), device=q.device),
                                  torch.tensor(lengths, device=q.device))
    pos = torch.arange(tokens, device=q.device)
    allowed = (seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None])
    group = heads // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (q, k, v)), attn_mask=allowed)
    return out[0].transpose(0, 1)
