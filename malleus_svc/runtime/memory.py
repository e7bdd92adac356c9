"""Per-device peak memory of one stage, measured on the real modules built on the meta device.

The stage's `StageModel`, its working weights and its AdamW state are built on
``torch.device("meta")`` (shapes and dtypes, no memory) and one micro-batch is run forward the way
the engine runs it (`precision.WorkingWeights`) under `saved_tensors_hooks`, which see every tensor
autograd keeps for backward. Terms, per device, for `in_flight` micro-batches alive (1F1B keeps
min(stages - stage, micro_batches) at a stage):

  params       fp32 master weights (the embedding and head split by vocabulary rows in a TP group)
  grads        fp32 gradients: the engine gives every parameter a buffer
  adam         exp_avg and exp_avg_sq, made by the engine's AdamW itself (its `step` counters
               live on the host and are left out)
  working      the bf16 working weights the forward and backward run on: one copy, whatever the depth
  activations  what the forward saves for backward, per in-flight micro-batch, less the above; with
               recomputation each block's input instead of what it saves, plus one block's saved
               activations once (the block being recomputed in backward)
  boundary     the device's rows of the stage's pipeline tensors, in the compute dtype: per
               in-flight micro-batch the received activation (not the first stage) and the output
               kept for backward (not the last), plus one received and one sent gradient (the
               backward running now)
  logits       the last stage's loss in its backward: the logits' gradient of the device's
               vocabulary rows in the compute dtype and one chunk's fp32 transients
               (`geometry.loss_backward_bytes`); the loss keeps no logits between forward and backward

Attention is measured as flash-attn's varlen kernel, the GPU path, keeps it: q, k, v (k and v at
their own kv heads), the output and an fp32 log-sum-exp [heads, tokens], O(tokens) and never the
tokens x tokens scores (`FlashFootprint`). TP collectives are not run: a group's all-reduce,
all-gather and reduce-scatter are replaced by a tensor of the shape the real one returns
(`tensor_parallel.LocalShard`). Not counted: backward's
transient gradients (of activations, and each weight's fp32 gradient until autograd adds it into
its master's), the CUDA context, allocator fragmentation and NCCL buffers, which the scenario's
reserved memory and safety margin cover.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Iterator

import torch

from malleus_svc.config.presets import ModelShape
from malleus_svc.geometry import loss_backward_bytes, most_rows, sequence_rows
from malleus_svc.runtime.attention import varlen_causal_attention
from malleus_svc.runtime.model import StageModel
from malleus_svc.runtime.precision import GPU_COMPUTE_DTYPE, WorkingWeights
from malleus_svc.runtime.tensor_parallel import SINGLE, LocalShard

META = torch.device("meta")


class FlashFootprint(torch.autograd.Function):
    """Attention keeping for backward what flash-attn's varlen kernel keeps: q, k, v, out, lse.
    On real tensors the output is the real attention; there is no backward (measurement only)."""

    @staticmethod
    def forward(ctx, q, k, v, packing):
        out = q.new_empty(q.shape) if q.is_meta else varlen_causal_attention(q, k, v, packing)
        lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("FlashFootprint measures memory; it has no backward")


def flash_footprint(q, k, v, packing):
    return FlashFootprint.apply(q, k, v, packing)


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata   # shared by every view of one tensor, meta or real


def saved_for_backward(model: StageModel, x: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor,
                       targets: torch.Tensor | None = None, compute_dtype: torch.dtype = GPU_COMPUTE_DTYPE
                       ) -> tuple[int, WorkingWeights]:
    """Run one forward on `compute_dtype` working weights as the engine does (with `targets`, to the
    loss) and add up the unique storages autograd saves, less the parameters, the working weights
    and the input `x` (counted as state and as boundary): the activations' bytes. Returns the working
    weights too."""
    saved: dict[int, torch.Tensor] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.setdefault(_storage_key(t), t)
        return t

    working = WorkingWeights(dict(model.named_parameters()), compute_dtype)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        working(model, x, positions, cu_seqlens, targets)
    skip = {_storage_key(t) for t in (*model.parameters(), *working.tensors.values(), x)}
    return sum(t.untyped_storage().nbytes() for key, t in saved.items() if key not in skip), working


@dataclass(frozen=True)
class StageMemory:
    """Bytes on one device of a stage; `total` is the peak without the scenario's reserved memory."""

    params: int
    grads: int
    adam: int
    working: int
    activations: int
    boundary: int
    logits: int

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))

    def terms(self) -> Iterator[tuple[str, int]]:
        return ((f.name, getattr(self, f.name)) for f in fields(self))

    def sharded_over(self, pipelines: int) -> "StageMemory":
        """With the optimizer sharded among `pipelines` holders of every piece: the fp32 masters and
        Adam moments of each chunk, 1/pipelines of them (each bucket's padding, under `pipelines`
        elements, aside); the gradients stay whole."""
        return dataclasses.replace(self, params=-(-self.params // pipelines), adam=-(-self.adam // pipelines))


@dataclass(frozen=True)
class StageFootprint:
    """What a stage holds once (state) and per micro-batch in flight (saved), independent of depth."""

    params: int
    grads: int
    adam: int
    working: int
    saved: int                    # activations kept for backward per micro-batch
    boundary_tensor: int          # this rank's rows of one [tokens, hidden] tensor in the compute dtype
    loss: int                     # the loss's backward transients (0 but on the last stage)
    has_embedding: bool
    has_head: bool
    recomputed: int = 0           # with recomputation: one block's saved activations, live in its backward

    def at_depth(self, in_flight: int) -> StageMemory:
        sides = (not self.has_embedding) + (not self.has_head)   # receives activations / sends them
        return StageMemory(params=self.params, grads=self.grads, adam=self.adam, working=self.working,
                           activations=in_flight * self.saved + self.recomputed,
                           boundary=(in_flight + 1) * sides * self.boundary_tensor,
                           logits=self.loss)


def stage_inputs(shape: ModelShape, micro_batch: int, seq_len: int, first: bool, device: torch.device,
                 dtype: torch.dtype = GPU_COMPUTE_DTYPE, tp: int = 1
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A packed micro-batch of `micro_batch` sequences of `seq_len`: the stage input (token ids on the
    first stage, elsewhere the measured TP rank's rows of the hidden states, in `dtype`), positions and
    cu_seqlens (real CPU tensors, which rotary and attention read), and the targets."""
    tokens = micro_batch * seq_len
    cu_seqlens = torch.arange(0, tokens + 1, seq_len, dtype=torch.int32)
    positions = torch.arange(seq_len).repeat(micro_batch)
    if first:
        x = torch.zeros(tokens, dtype=torch.long, device=device)
    else:
        rows = sequence_rows(tokens, measured_rank(tp), tp)
        x = torch.zeros(rows[1] - rows[0], shape.hidden, dtype=dtype, device=device, requires_grad=True)
    return x, positions, cu_seqlens, torch.zeros(tokens, dtype=torch.long, device=device)


def measured_rank(tp: int) -> int:
    """The TP rank a group's memory is measured on: the last, which holds the most rows of an
    uneven split (`geometry.rows_of` rounds down)."""
    return tp - 1


def build_stage(shape: ModelShape, num_layers: int, *, has_embedding: bool, has_head: bool, tp: int,
                device: torch.device = META, recompute: str = "none") -> StageModel:
    """A stage of `num_layers` blocks, as the `measured_rank` of a group of `tp` builds it, with attention
    measured as flash-attn's (`flash_footprint`). Uninitialised on real devices."""
    group = SINGLE if tp == 1 else LocalShard(size=tp, rank=measured_rank(tp))
    with device:
        model = StageModel(shape, (0, num_layers), has_embedding=has_embedding, has_head=has_head, tp=group,
                           recompute=recompute)
    for block in model.blocks.values():
        block.attn.attend = flash_footprint
    return model


def _adam_state_bytes(model: StageModel) -> tuple[int, int]:
    """Gradient bytes and AdamW state bytes on the device, made by one step of the engine's AdamW
    on meta tensors."""
    from malleus_svc.runtime.engine import OptimConfig

    named = dict(model.named_parameters())
    params = list(named.values())
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = OptimConfig().make(named)
    opt.step()
    state = sum(t.untyped_storage().nbytes() for s in opt.state.values() for t in s.values()
                if isinstance(t, torch.Tensor) and t.device == params[0].device)
    return sum(p.grad.untyped_storage().nbytes() for p in params), state


def stage_footprint(shape: ModelShape, num_layers: int, *, has_embedding: bool, has_head: bool, tp: int,
                    micro_batch: int, seq_len: int | None = None, recompute: str = "none") -> StageFootprint:
    """Measure one stage on meta: the share of the last TP rank, which holds the most (ranks differ
    by a row of what a group's size does not divide: a vocabulary, a micro-batch's tokens)."""
    seq_len = seq_len or shape.seq_len
    model = build_stage(shape, num_layers, has_embedding=has_embedding, has_head=has_head, tp=tp,
                        recompute=recompute)
    params = sum(p.untyped_storage().nbytes() for p in model.parameters())
    grads, adam = _adam_state_bytes(model)
    x, positions, cu_seqlens, targets = stage_inputs(shape, micro_batch, seq_len, has_embedding, META, tp=tp)
    saved, working = saved_for_backward(model, x, positions, cu_seqlens, targets if has_head else None)
    rows = sequence_rows(micro_batch * seq_len, measured_rank(tp), tp)     # a boundary tensor's rows on this rank
    boundary = (rows[1] - rows[0]) * shape.hidden * GPU_COMPUTE_DTYPE.itemsize
    loss = (loss_backward_bytes(most_rows(shape.vocab, tp), micro_batch * seq_len, GPU_COMPUTE_DTYPE.itemsize)
            if has_head else 0)
    recomputed = 0
    if recompute == "full":
        # the forward saved each block's input (the checkpoint does, where the hooks see it); in
        # backward one block at a time saves what it always does
        one = build_stage(shape, 1, has_embedding=False, has_head=False, tp=tp)
        x1, positions, cu_seqlens, _ = stage_inputs(shape, micro_batch, seq_len, False, META, tp=tp)
        recomputed = saved_for_backward(one, x1, positions, cu_seqlens)[0]
    return StageFootprint(params, grads, adam, working.nbytes, saved, boundary, loss, has_embedding, has_head,
                          recomputed)
