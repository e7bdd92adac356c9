"""Per-device peak memory of one stage, measured on the real modules built on the meta device.

The stage's `StageModel` and its AdamW state are built on ``torch.device("meta")`` (shapes and
dtypes, no memory) and one micro-batch is run forward under `saved_tensors_hooks`, which see every
tensor autograd keeps for backward. Terms, per device, for `in_flight` micro-batches alive (1F1B
keeps min(stages - stage, micro_batches) at a stage):

  params       fp32 master weights (the embedding and head are replicated in a TP group)
  grads        fp32 gradients: the engine gives every parameter a buffer
  adam         exp_avg and exp_avg_sq, made by `torch.optim.AdamW` itself (its `step` counters
               live on the host and are left out)
  bf16         bf16 working copies of the weights, per in-flight micro-batch: the runtime has no
               persistent bf16 copy; on CUDA it runs the forward under `torch.autocast`, which casts
               each weight afresh in every micro-batch's forward, and the cast is what the matmul
               saves for backward, so every micro-batch in flight holds one copy of the matmul weights
  activations  what the forward saves for backward, per in-flight micro-batch, less the above
  boundary     the stage's pipeline tensors, in the transport's dtype (the parameters': fp32): per
               in-flight micro-batch the received activation (not the first stage) and the output kept
               for backward (not the last), plus one received and one sent gradient (the backward
               running now)
  logits       the last stage's fp32 logits the loss keeps (log-softmax output), per micro-batch

Autocast has no meta backend, so `autocast_bf16` stands in for it: it casts the floating inputs of
the model's one autocast-listed op, `F.linear`, to bf16 as CUDA autocast does (a test holds it equal
to `torch.autocast` on real CPU tensors). Attention is measured as flash-attn's varlen kernel, the
GPU path, keeps it: q, k, v (k and v at their own kv heads), the output and an fp32 log-sum-exp
[heads, tokens], O(tokens) and never the tokens x tokens scores (`FlashFootprint`). TP collectives
are not run: a group's all-reduce is replaced by the copy the real one returns (`_NoComm`).
Not counted: backward's transient gradients of activations, the CUDA context, allocator
fragmentation and NCCL buffers, which the scenario's reserved memory and safety margin cover.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, fields
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from malleus_svc.config.presets import ModelShape
from malleus_svc.runtime.attention import varlen_causal_attention
from malleus_svc.runtime.model import StageModel
from malleus_svc.runtime.tensor_parallel import SINGLE, TensorParallel

META = torch.device("meta")
ACT_DTYPE = torch.bfloat16        # what autocast computes the matmuls in on CUDA
BOUNDARY_DTYPE = torch.float32    # the transport sends in the parameters' dtype


class _NoComm(TensorParallel):
    """A TP group's place without a process group: the all-reduce returns the buffer it would fill."""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"TP rank {self.rank} is outside a group of size {self.size}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x.contiguous().clone()


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


class autocast_bf16(TorchFunctionMode):
    """CUDA autocast's effect on this model, on any device (meta included): `F.linear` runs in bf16
    on bf16 casts of its floating inputs. Casts of parameters are remembered (`weight_casts`)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight_casts: list[torch.Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            args = tuple(self._cast(a) for a in args)
            kwargs = {k: self._cast(a) for k, a in kwargs.items()}
        return func(*args, **kwargs)

    def _cast(self, a):
        if not (isinstance(a, torch.Tensor) and a.is_floating_point() and a.dtype != ACT_DTYPE):
            return a
        out = a.to(ACT_DTYPE)
        if isinstance(a, torch.nn.Parameter):
            self.weight_casts.append(out)
        return out


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata   # shared by every view of one tensor, meta or real


@dataclass(frozen=True)
class SavedBytes:
    """Bytes of unique storages one micro-batch's forward saves for backward, by kind."""

    activations: int
    bf16_weights: int
    logits: int


def saved_for_backward(model: StageModel, x: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor,
                       targets: torch.Tensor | None = None,
                       precision: Callable[[], contextlib.AbstractContextManager] = autocast_bf16) -> SavedBytes:
    """Run one forward (and, with `targets`, the engine's fp32 cross-entropy on the logits) under
    `precision()` and sort the unique storages autograd saves: parameters and the input `x` are left
    out (counted as state and as boundary), casts of parameters are `bf16_weights`, [tokens, vocab]
    tensors are `logits`, the rest `activations`."""
    saved: dict[int, torch.Tensor] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.setdefault(_storage_key(t), t)
        return t

    with precision() as mode, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x, positions, cu_seqlens)
        if targets is not None:
            F.cross_entropy(out.to(torch.float32), targets, reduction="sum")
    skip = {_storage_key(p) for p in model.parameters()} | {_storage_key(x)}
    casts = {_storage_key(t) for t in getattr(mode, "weight_casts", ())}
    totals = {"activations": 0, "bf16_weights": 0, "logits": 0}
    for key, t in saved.items():
        if key in skip:
            continue
        kind = ("bf16_weights" if key in casts else
                "logits" if tuple(t.shape) == (x.shape[0], model.shape.vocab) else "activations")
        totals[kind] += t.untyped_storage().nbytes()
    return SavedBytes(**totals)


@dataclass(frozen=True)
class StageMemory:
    """Bytes on one device of a stage; `total` is the peak without the scenario's reserved memory."""

    params: int
    grads: int
    adam: int
    bf16: int
    activations: int
    boundary: int
    logits: int

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))

    def terms(self) -> Iterator[tuple[str, int]]:
        return ((f.name, getattr(self, f.name)) for f in fields(self))


@dataclass(frozen=True)
class StageFootprint:
    """What a stage holds once (state) and per micro-batch in flight (saved), independent of depth."""

    params: int
    grads: int
    adam: int
    saved: SavedBytes
    boundary_tensor: int          # one [tokens, hidden] tensor in the boundary dtype
    has_embedding: bool
    has_head: bool

    def at_depth(self, in_flight: int) -> StageMemory:
        sides = (not self.has_embedding) + (not self.has_head)   # receives activations / sends them
        return StageMemory(params=self.params, grads=self.grads, adam=self.adam,
                           bf16=in_flight * self.saved.bf16_weights,
                           activations=in_flight * self.saved.activations,
                           boundary=(in_flight + 1) * sides * self.boundary_tensor,
                           logits=in_flight * self.saved.logits)


def stage_inputs(shape: ModelShape, micro_batch: int, seq_len: int, first: bool, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A packed micro-batch of `micro_batch` sequences of `seq_len`: the stage input (token ids on the
    first stage, fp32 hidden states elsewhere), positions and cu_seqlens (real CPU tensors, which
    rotary and attention read), and the targets."""
    tokens = micro_batch * seq_len
    cu_seqlens = torch.arange(0, tokens + 1, seq_len, dtype=torch.int32)
    positions = torch.arange(seq_len).repeat(micro_batch)
    if first:
        x = torch.zeros(tokens, dtype=torch.long, device=device)
    else:
        x = torch.zeros(tokens, shape.hidden, dtype=BOUNDARY_DTYPE, device=device, requires_grad=True)
    return x, positions, cu_seqlens, torch.zeros(tokens, dtype=torch.long, device=device)


def build_stage(shape: ModelShape, num_layers: int, *, has_embedding: bool, has_head: bool, tp: int,
                device: torch.device = META) -> StageModel:
    """A stage of `num_layers` blocks, as TP rank 0 of a group of `tp` builds it, with attention
    measured as flash-attn's (`flash_footprint`). Uninitialised on real devices."""
    group = SINGLE if tp == 1 else _NoComm(size=tp, rank=0)
    with device:
        model = StageModel(shape, (0, num_layers), has_embedding=has_embedding, has_head=has_head, tp=group)
    for block in model.blocks.values():
        block.attn.attend = flash_footprint
    return model


def _adam_state_bytes(model: StageModel) -> tuple[int, int]:
    """Gradient bytes and AdamW state bytes on the device, made by one AdamW step on meta tensors."""
    params = list(model.parameters())
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = torch.optim.AdamW(params)
    opt.step()
    state = sum(t.untyped_storage().nbytes() for s in opt.state.values() for t in s.values()
                if isinstance(t, torch.Tensor) and t.device == params[0].device)
    return sum(p.grad.untyped_storage().nbytes() for p in params), state


def stage_footprint(shape: ModelShape, num_layers: int, *, has_embedding: bool, has_head: bool, tp: int,
                    micro_batch: int, seq_len: int | None = None) -> StageFootprint:
    """Measure one stage (TP rank 0's share; every rank of a group holds the same bytes) on meta."""
    seq_len = seq_len or shape.seq_len
    model = build_stage(shape, num_layers, has_embedding=has_embedding, has_head=has_head, tp=tp)
    params = sum(p.untyped_storage().nbytes() for p in model.parameters())
    grads, adam = _adam_state_bytes(model)
    x, positions, cu_seqlens, targets = stage_inputs(shape, micro_batch, seq_len, has_embedding, META)
    saved = saved_for_backward(model, x, positions, cu_seqlens, targets if has_head else None)
    tokens = micro_batch * seq_len
    boundary = tokens * shape.hidden * BOUNDARY_DTYPE.itemsize
    return StageFootprint(params, grads, adam, saved, boundary, has_embedding, has_head)
