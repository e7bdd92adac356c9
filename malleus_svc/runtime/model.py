"""The LLaMA-style decoder, cut into parts that any stage can build on its own.

Parts: "embedding" (token embedding), block i (RMSNorm, attention with rotary positions, RMSNorm,
SwiGLU MLP, both with residuals), "head" (final RMSNorm and the LM head, which with the targets
computes the loss over chunks of tokens, `geometry.loss`).

Every tensor has a stable full-model name (``blocks.3.attn.wq``, ``embedding.weight``, ...) and
is initialised tile by tile, each tile from a generator seeded by (seed, name, tile) alone. A
device builds its stage on the meta device, allocates only its own shards and draws only the tiles
they overlap, identical to what any other plan (or the single-process reference) would hold.
Names, full shapes and TP split dims come from `geometry.tensors`: each parameter is that table's
shard for this device's TP group (q/k/v and gate/up column-parallel, out and down row-parallel;
the embedding, the head and its loss vocab-parallel; norm weights replicated), and between those
regions each TP rank holds its rows of the tokens (sequence parallelism: `tensor_parallel`).
"""
from __future__ import annotations

import contextlib
import hashlib
import math
from functools import cached_property
from typing import Callable, Iterator, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from malleus_svc.config.presets import ModelShape
from malleus_svc.costmodel.profile import RECOMPUTED_FORWARD
from malleus_svc.geometry import (EMBEDDING, HEAD, TIED, Part, TensorSpec, loss_chunk_tokens, part_tensors, shard_rows,
                                  split_dim, tp_divisibility_error)
from malleus_svc.plan import RECOMPUTE
from malleus_svc.runtime.attention import Packing, RotaryTables, apply_rotary, varlen_causal_attention
from malleus_svc.runtime.batch import IGNORE_INDEX
from malleus_svc.runtime.precision import master_of, weight_grad
from malleus_svc.runtime.tensor_parallel import (SINGLE, TensorParallel, gather_from_region, gather_from_sequence,
                                                 reduce_scatter_to_sequence)

INIT_STD = 0.02


def take_shard(name: str, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's shard of the full tensor `name` (the tensor itself if replicated)."""
    dim = split_dim(name)
    if dim is None or tp_size == 1:
        return full
    start, end = shard_rows(full.shape[dim], tp_rank, tp_size)
    return full.narrow(dim, start, end - start)


def _parameter(spec: TensorSpec, tp: TensorParallel) -> nn.Parameter:
    """An uninitialised parameter of this TP rank's shard shape (`init_from_seed` fills it)."""
    return nn.Parameter(torch.empty(spec.shard_shape(tp.size, tp.rank)))


def _by_local_name(shape: ModelShape, part: Part) -> dict[str, TensorSpec]:
    """The part's tensors keyed by their name inside the part's module (``attn.wq``)."""
    prefix = "" if isinstance(part, str) else f"blocks.{part}."
    return {t.name[len(prefix):]: t for t in part_tensors(shape, part)}


# ---------------------------------------------------------------------------- initialisation
TILE = 1024   # rows and columns of one initialisation tile


def _tile(seed: int, name: str, i: int, j: int, rows: int, cols: int) -> torch.Tensor:
    """Standard normal tile (i, j) of tensor `name`: a pure function of its arguments."""
    digest = hashlib.sha256(f"malleus-init/{seed}/{name}/{i}/{j}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
    return torch.randn(rows, cols, generator=gen)


def init_block(shape: ModelShape, spec: TensorSpec, seed: int, rows: tuple[int, int] | None = None,
               cols: tuple[int, int] | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows x cols of the full initial tensor `spec` (whole dims where not given), into `out` (any
    device or dtype) or a new fp32 tensor. Draws only the tiles the block overlaps, one at a time."""
    full = spec.shape if len(spec.shape) == 2 else (spec.shape[0], 1)
    (r0, r1), (c0, c1) = rows or (0, full[0]), cols or (0, full[1])
    if out is None:
        out = torch.empty((r1 - r0, c1 - c0) if len(spec.shape) == 2 else (r1 - r0,))
    if spec.name.endswith("norm.weight"):
        return out.fill_(1.0)
    # Residual-branch outputs get a smaller scale so the residual stream does not grow with depth.
    std = INIT_STD / math.sqrt(2 * shape.layers) if spec.name.endswith(("attn.wo", "mlp.w_down")) else INIT_STD
    view = out.view(r1 - r0, c1 - c0)
    name = TIED[0] if shape.tie_embeddings and spec.name in TIED else spec.name   # a tied head starts as the embedding
    with torch.no_grad():
        for i in range(r0 // TILE, (r1 - 1) // TILE + 1):
            for j in range(c0 // TILE, (c1 - 1) // TILE + 1):
                ti0, tj0 = i * TILE, j * TILE
                tile = _tile(seed, name, i, j, min(TILE, full[0] - ti0), min(TILE, full[1] - tj0))
                a0, a1, b0, b1 = max(r0, ti0), min(r1, ti0 + TILE), max(c0, tj0), min(c1, tj0 + TILE)
                view[a0 - r0:a1 - r0, b0 - c0:b1 - c0] = tile[a0 - ti0:a1 - ti0, b0 - tj0:b1 - tj0] * std
    return out


def init_part(shape: ModelShape, part: Part, seed: int) -> dict[str, torch.Tensor]:
    """Full (unsharded) fp32 tensors of one part, a pure function of (shape, part, seed)."""
    return {t.name: init_block(shape, t, seed) for t in part_tensors(shape, part)}


# ---------------------------------------------------------------------------- modules
class _MasterGradLinear(torch.autograd.Function):
    """F.linear(x, weight) for a working weight: its gradient goes to `master`, written by one
    weight-gradient GEMM in the master's dtype (`precision.weight_grad`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.dtype = master.dtype
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad @ weight if ctx.needs_input_grad[0] else None
        return grad_x, None, weight_grad(grad, x, ctx.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T; for a working weight, with the gradient going to its master (`precision`)."""
    master = master_of(weight)
    return F.linear(x, weight) if master is None else _MasterGradLinear.apply(x, weight, master)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x / rms(x) * weight in x's dtype, 1/rms per token in at least fp32)."""
    rstd = torch.rsqrt(x.to(torch.promote_types(x.dtype, torch.float32)).pow(2).mean(-1, keepdim=True) + eps)
    return _normalized(x, weight, rstd), rstd


def _normalized(x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """The norm's output from its input and 1/rms (forward, and a backward that recomputes it)."""
    return (x.to(rstd.dtype) * rstd * weight).to(x.dtype)


def _rms_norm_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(the input's gradient in x's dtype, the weight's in at least fp32)."""
    xhat = x.to(rstd.dtype) * rstd
    g = grad.to(rstd.dtype)
    grad_weight = (g * xhat).reshape(-1, x.shape[-1]).sum(0)
    gx = g * weight
    return (rstd * (gx - xhat * (gx * xhat).mean(-1, keepdim=True))).to(x.dtype), grad_weight


def _to_weight_or_master(grad: torch.Tensor, weight: torch.Tensor, to_master: bool):
    """A replicated weight's gradient: to its master unrounded, else to the weight in its dtype."""
    return (None, grad) if to_master else (grad.to(weight.dtype), None)


def _linears_backward(grads, tp: TensorParallel, whole: Callable[[], torch.Tensor], weights, dtypes
                      ) -> tuple[torch.Tensor, list, list]:
    """(this rank's rows of the input's gradient summed over the linears, the weights' gradients,
    their masters'): a weight with a master (`linear`) gives its gradient to the master, in the
    master's dtype. `whole()` gives the whole input: in a TP group a gather the caller started,
    which runs while the input's gradient is computed, as that gradient's reduce-scatter runs
    while the weights' are (Megatron's overlap of sequence parallelism's backward collectives)."""
    # summed last linear first, as autograd sums the input gradients of separate linears: the same bits
    grad_whole = sum(g @ w for g, w in reversed(list(zip(grads, weights))))
    inputs = whole()     # one collective in flight at a time, in the same order on every rank
    rows = tp.start_reduce_scatter_sequence(grad_whole) if tp.size > 1 else lambda: grad_whole
    to_weights = [weight_grad(g, inputs, w.dtype) if d is None else None for g, w, d in zip(grads, weights, dtypes)]
    to_masters = [None if d is None else weight_grad(g, inputs, d) for g, d in zip(grads, dtypes)]
    return rows(), to_weights, to_masters


class _GatheredLinears(torch.autograd.Function):
    """F.linear(every rank's rows of x, w) for each weight, this rank holding rows `x`: the entry of
    column-parallel layers under sequence parallelism. One all-gather serves all the weights;
    backward keeps only this rank's rows and all-gathers them again (Megatron's sequence
    parallelism), and reduce-scatters the input's gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TensorParallel, tokens: int, *weights_then_masters) -> tuple[torch.Tensor, ...]:
        n = len(weights_then_masters) // 2
        weights, masters = weights_then_masters[:n], weights_then_masters[n:]
        ctx.save_for_backward(x, *weights)
        ctx.tp, ctx.tokens, ctx.dtypes = tp, tokens, [None if m is None else m.dtype for m in masters]
        whole = tp.gather_sequence(x, tokens)
        return tuple(F.linear(whole, w) for w in weights)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        x, *weights = ctx.saved_tensors
        whole = ctx.tp.start_gather_sequence(x, ctx.tokens)
        grad_x, to_weights, to_masters = _linears_backward(grads, ctx.tp, whole, weights, ctx.dtypes)
        return grad_x, None, None, *to_weights, *to_masters


class _NormedLinears(torch.autograd.Function):
    """F.linear(rmsnorm(x), w) for each column-parallel weight (every rank's rows of it under
    sequence parallelism), keeping for backward only x and its 1/rms: backward normalises x again
    (selective recomputation: a norm's output is as large as its input and costs no GEMM to redo)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, norm_weight: torch.Tensor, eps: float, norm_master: torch.Tensor | None,
                tp: TensorParallel, tokens: int, *weights_then_masters) -> tuple[torch.Tensor, ...]:
        n = len(weights_then_masters) // 2
        weights, masters = weights_then_masters[:n], weights_then_masters[n:]
        normed, rstd = _rms_norm(x, norm_weight, eps)
        ctx.save_for_backward(x, norm_weight, rstd, *weights)
        ctx.tp, ctx.tokens, ctx.norm_to_master = tp, tokens, norm_master is not None
        ctx.dtypes = [None if m is None else m.dtype for m in masters]
        whole = normed if tp.size == 1 else tp.gather_sequence(normed, tokens)
        return tuple(F.linear(whole, w) for w in weights)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        x, norm_weight, rstd, *weights = ctx.saved_tensors
        tp = ctx.tp
        normed = _normalized(x, norm_weight, rstd)
        whole = (lambda: normed) if tp.size == 1 else tp.start_gather_sequence(normed, ctx.tokens)
        grad_normed, to_weights, to_masters = _linears_backward(grads, tp, whole, weights, ctx.dtypes)
        grad_x, grad_norm = _rms_norm_backward(grad_normed, x, norm_weight, rstd)
        to_norm, to_norm_master = _to_weight_or_master(grad_norm, norm_weight, ctx.norm_to_master)
        return grad_x, to_norm, None, to_norm_master, None, None, *to_weights, *to_masters


def column_parallel(x: torch.Tensor, tp: TensorParallel, tokens: int, *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The micro-batch's `tokens` rows (this rank holds `x`, its own) times each column-parallel weight."""
    if tp.size == 1:
        return tuple(linear(x, w) for w in weights)
    return _GatheredLinears.apply(x, tp, tokens, *weights, *(master_of(w) for w in weights))


def normed_column_parallel(x: torch.Tensor, norm: "RMSNorm", tp: TensorParallel, tokens: int, *weights: torch.Tensor,
                           selective: bool = False) -> tuple[torch.Tensor, ...]:
    """`column_parallel(norm(x), ...)`; `selective`: the norm's output recomputed in backward."""
    if not selective:
        return column_parallel(norm(x), tp, tokens, *weights)
    return _NormedLinears.apply(x, norm.weight, norm.eps, master_of(norm.weight), tp, tokens, *weights,
                                *(master_of(w) for w in weights))


class _SwiGLUDown(torch.autograd.Function):
    """F.linear(silu(gate) * up, w_down), keeping for backward gate and up only: backward forms
    silu(gate) * up again (selective recomputation: elementwise, as large as gate itself)."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, master: torch.Tensor | None):
        ctx.save_for_backward(gate, up, weight)
        ctx.dtype = None if master is None else master.dtype
        return F.linear(F.silu(gate) * up, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up, weight = ctx.saved_tensors
        silu = F.silu(gate)
        grad_w = weight_grad(grad, silu * up, ctx.dtype or weight.dtype)
        grad_h = grad @ weight
        # the ops autograd runs through silu(gate) * up, so that stored and recomputed agree bitwise
        grad_gate = torch.ops.aten.silu_backward(grad_h * up, gate)
        return grad_gate, grad_h * silu, *((grad_w, None) if ctx.dtype is None else (None, grad_w))


def row_parallel(x: torch.Tensor, weight: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """x times a row-parallel weight, summed over the group, this rank's rows of the sum."""
    return reduce_scatter_to_sequence(linear(x, weight), tp)


class _MasterGradEmbedding(torch.autograd.Function):
    """F.embedding(tokens, weight) for a working weight: the rows' gradients summed into one dense
    gradient in the master's dtype (the op F.embedding's own backward runs) for `master`."""

    @staticmethod
    def forward(ctx, tokens: torch.Tensor, weight: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(tokens)
        ctx.rows, ctx.dtype = weight.shape[0], master.dtype
        return F.embedding(tokens, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (tokens,) = ctx.saved_tensors
        dense = torch.ops.aten.embedding_dense_backward(grad.to(ctx.dtype), tokens, ctx.rows, -1, False)
        return None, None, dense


class _RMSNormFunction(torch.autograd.Function):
    """x / rms(x) * weight with statistics in at least fp32, keeping for backward only the input (in
    its own dtype) and one reciprocal rms per token, as fused kernels do: autograd over the plain
    expression would keep two fp32 copies of the input per norm."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, master: torch.Tensor | None) -> torch.Tensor:
        out, rstd = _rms_norm(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.to_master = master is not None
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        grad_x, grad_weight = _rms_norm_backward(grad, x, weight, rstd)
        to_weight, to_master = _to_weight_or_master(grad_weight, weight, ctx.to_master)
        return grad_x, to_weight, None, to_master


class RMSNorm(nn.Module):
    def __init__(self, spec: TensorSpec, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(spec.shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFunction.apply(x, self.weight, self.eps, master_of(self.weight))


class Attention(nn.Module):
    def __init__(self, shape: ModelShape, tp: TensorParallel, specs: Mapping[str, TensorSpec]):
        super().__init__()
        self.tp, self.head_dim = tp, shape.head_dim
        self.attend = varlen_causal_attention   # runtime.memory swaps in flash-attn's saved-tensor footprint
        for name in ("wq", "wk", "wv", "wo"):
            setattr(self, name, _parameter(specs[f"attn.{name}"], tp))

    def forward(self, x: torch.Tensor, norm: RMSNorm, rope: tuple[torch.Tensor, torch.Tensor], packing: Packing,
                selective: bool = False) -> torch.Tensor:
        """Attention over norm(x), `selective`: the norm's output recomputed in backward."""
        tokens, d = packing.num_tokens, self.head_dim
        q, k, v = (t.view(tokens, -1, d) for t in
                   normed_column_parallel(x, norm, self.tp, tokens, self.wq, self.wk, self.wv, selective=selective))
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        o = self.attend(q, k, v, packing).reshape(tokens, -1)
        return row_parallel(o, self.wo, self.tp)


class SwiGLU(nn.Module):
    def __init__(self, tp: TensorParallel, specs: Mapping[str, TensorSpec]):
        super().__init__()
        self.tp = tp
        for name in ("w_gate", "w_up", "w_down"):
            setattr(self, name, _parameter(specs[f"mlp.{name}"], tp))

    def forward(self, x: torch.Tensor, norm: RMSNorm, tokens: int, selective: bool = False,
                by_policy: bool = False) -> torch.Tensor:
        """The MLP over norm(x), `selective`: the norm's output and silu(gate) * up recomputed in
        backward; `by_policy` (compiled): the product under `selective_policy`, which the compiler obeys."""
        gate, up = normed_column_parallel(x, norm, self.tp, tokens, self.w_gate, self.w_up, selective=selective)
        if not selective:
            return row_parallel(F.silu(gate) * up, self.w_down, self.tp)
        if by_policy and torch.is_grad_enabled():
            out = checkpoint(_swiglu_down, gate, up, self.w_down, use_reentrant=False, preserve_rng_state=False,
                             context_fn=_selective_contexts)
        else:
            out = _SwiGLUDown.apply(gate, up, self.w_down, master_of(self.w_down))
        return reduce_scatter_to_sequence(out, self.tp)


def _swiglu_down(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return linear(F.silu(gate) * up, weight)


class Block(nn.Module):
    """`selective`: backward recomputes both norms' outputs and SwiGLU's product instead of keeping
    them (no GEMM, no collective redone): about 45% less kept per token for a few elementwise passes.
    Eagerly the autograd functions above do it; compiled (`by_policy`, `compile_blocks`), the parts
    the compiler traces follow `selective_policy` instead."""

    def __init__(self, shape: ModelShape, tp: TensorParallel, selective: bool = False):
        super().__init__()
        specs = _by_local_name(shape, 0)   # every block has the same tensors; names say which block
        self.selective = selective
        self.by_policy = False
        self.attn_norm = RMSNorm(specs["attn_norm.weight"], shape.norm_eps)
        self.attn = Attention(shape, tp, specs)
        self.mlp_norm = RMSNorm(specs["mlp_norm.weight"], shape.norm_eps)
        self.mlp = SwiGLU(tp, specs)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], packing: Packing) -> torch.Tensor:
        if self.by_policy and self.attn.tp.size == 1 and torch.is_grad_enabled():
            # one graph: the storing code, all of it under the policy; recomputed on the weights it
            # runs on now (as `_run_block`: a working copy is bound only for this call)
            return checkpoint(_storing_layers, x, self, dict(self.named_parameters()), rope, packing,
                              use_reentrant=False, preserve_rng_state=False, context_fn=_selective_contexts)
        return self._layers(x, rope, packing, self.selective)

    def _layers(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], packing: Packing,
                selective: bool) -> torch.Tensor:
        x = x + self.attn(x, self.attn_norm, rope, packing, selective)
        return x + self.mlp(x, self.mlp_norm, packing.num_tokens, selective, self.by_policy)


def _storing_layers(x: torch.Tensor, block: Block, weights: Mapping[str, torch.Tensor], rope, packing: Packing
                    ) -> torch.Tensor:
    # functional_call's rebinding, without its call of the block's forward (which would come back here)
    with _reparametrize_module(block, weights):
        return block._layers(x, rope, packing, False)


# The ops whose outputs selective recomputation keeps, by name (the attention kernels' own ops are
# registered only where their libraries are imported): the GEMMs and attention. Whatever else a block
# computes is elementwise or a norm's reduction, cheap to redo.
_KEPT_OPS = frozenset({
    "aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention", "aten::_flash_attention_forward",
    "aten::_efficient_attention_forward", "flash_attn::_flash_attn_varlen_forward", "torch_attn::_varlen_attn"})


def selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Selective recomputation as a checkpoint policy, which the compiler's partitioner obeys where
    it would otherwise choose for itself what a block keeps for backward."""
    kept = getattr(op, "name", None) and op.name() in _KEPT_OPS
    return CheckpointPolicy.MUST_SAVE if kept else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    return create_selective_checkpoint_contexts(selective_policy)


class Embedding(nn.Module):
    """Megatron's vocab-parallel embedding: TP rank r holds vocabulary rows [first, first + rows),
    looks up the tokens that fall there (zeros for the others) and the group sums the lookups."""

    def __init__(self, spec: TensorSpec, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.weight = _parameter(spec, tp)
        self.first = shard_rows(spec.shape[0], tp.rank, tp.size)[0]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        outside = None
        if self.tp.size > 1:
            tokens = tokens - self.first
            outside = (tokens < 0) | (tokens >= self.weight.shape[0])
            tokens = tokens.masked_fill(outside, 0)
        master = master_of(self.weight)
        x = F.embedding(tokens, self.weight) if master is None else _MasterGradEmbedding.apply(tokens, self.weight, master)
        return x if outside is None else reduce_scatter_to_sequence(x.masked_fill(outside.unsqueeze(-1), 0), self.tp)


class _ChunkedHeadLoss(torch.autograd.Function):
    """sum over tokens of cross_entropy(x @ weight.T, targets), the logits in at least fp32, over
    `chunk` tokens at a time: forward keeps only x (and the targets); backward recomputes each
    chunk's logits and their gradient, keeps that gradient in the compute dtype for the whole
    micro-batch (what the plain expression's backward hands its matrix multiply), then takes x's and
    the weight's gradients in one GEMM each, as the plain expression's backward does. No fp32
    [tokens, vocab] tensor of the whole micro-batch ever exists (`geometry.loss`).

    Vocab-parallel (a TP group of `tp.size`, this rank's `weight` the vocabulary rows from `first`):
    Megatron's cross-entropy. Per chunk the group all-reduces each token's largest logit, then its
    sum of exponentials and its target's logit (held by one rank) in one call, so every rank has
    the loss without any rank seeing all logits; forward keeps each token's log-sum-exp, and
    backward, with no communication, takes this rank's slice of softmax minus one-hot. x's
    gradient is then this rank's partial sum, which the TP region's entry sums over the group."""

    @staticmethod
    def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), targets,
                               ignore_index=IGNORE_INDEX, reduction="sum")

    @staticmethod
    def _local_targets(targets: torch.Tensor, first: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(each target's row in this rank's slice, clamped in range; whether this rank holds it)."""
        local = targets - first
        held = (local >= 0) & (local < rows)
        return local.clamp(0, rows - 1).unsqueeze(-1), held

    @staticmethod
    def _vocab_parallel(logits: torch.Tensor, targets: torch.Tensor, tp: TensorParallel, first: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed cross-entropy of a chunk, each token's log-sum-exp over the whole vocabulary)."""
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        top = tp.all_reduce(logits.max(-1).values, dist.ReduceOp.MAX)
        local, held = _ChunkedHeadLoss._local_targets(targets, first, logits.shape[-1])
        target_logit = torch.where(held, logits.gather(-1, local).squeeze(-1), 0.0)
        summed = tp.all_reduce(torch.stack(((logits - top.unsqueeze(-1)).exp().sum(-1), target_logit)))
        lse = top + summed[0].log()
        return torch.where(targets != IGNORE_INDEX, lse - summed[1], 0.0).sum(), lse

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int,
                master: torch.Tensor | None, tp: TensorParallel, first: int) -> torch.Tensor:
        ctx.chunk, ctx.master_dtype, ctx.tp, ctx.first = chunk, None if master is None else master.dtype, tp, first
        if tp.size == 1:
            ctx.save_for_backward(x, weight, targets)
            return sum(_ChunkedHeadLoss._cross_entropy(F.linear(x[s:s + chunk], weight), targets[s:s + chunk])
                       for s in range(0, x.shape[0], chunk))
        losses, lses = zip(*(_ChunkedHeadLoss._vocab_parallel(F.linear(x[s:s + chunk], weight), targets[s:s + chunk],
                                                              tp, first) for s in range(0, x.shape[0], chunk)))
        ctx.save_for_backward(x, weight, targets, torch.cat(lses))
        return sum(losses)

    @staticmethod
    def _grad_logits(ctx, x: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor | None,
                     grad: torch.Tensor) -> torch.Tensor:
        """One chunk's logits' gradient, recomputed."""
        if lse is None:
            with torch.enable_grad():    # scaled here, not by grad_outputs (whose check imports sympy)
                logits = F.linear(x, w).requires_grad_(True)
                loss = _ChunkedHeadLoss._cross_entropy(logits, targets) * grad
            return torch.autograd.grad(loss, (logits,))[0]
        logits = F.linear(x, w)
        probs = (logits.to(lse.dtype) - lse.unsqueeze(-1)).exp()
        local, held = _ChunkedHeadLoss._local_targets(targets, ctx.first, logits.shape[-1])
        probs.scatter_add_(-1, local, -held.to(probs.dtype).unsqueeze(-1))
        return (probs * ((targets != IGNORE_INDEX) * grad).unsqueeze(-1)).to(logits.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, targets, *lse = ctx.saved_tensors
        lse = lse[0] if lse else None
        grad_logits = x.new_empty(x.shape[0], weight.shape[0])
        w = weight.detach()
        for s in range(0, x.shape[0], ctx.chunk):
            part = slice(s, s + ctx.chunk)
            grad_logits[part] = _ChunkedHeadLoss._grad_logits(ctx, x[part].detach(), w, targets[part],
                                                              None if lse is None else lse[part], grad)
        grad_x = grad_logits @ weight
        if ctx.master_dtype is not None:   # a working weight: its master takes the gradient, in fp32
            return grad_x, None, None, None, weight_grad(grad_logits, x, ctx.master_dtype), None, None
        return grad_x, grad_logits.t() @ x, None, None, None, None, None


class LMHead(nn.Module):
    """The head, vocab-parallel in a TP group (rows from `first`), and its chunked cross-entropy."""

    def __init__(self, spec: TensorSpec, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.weight = _parameter(spec, tp)
        self.vocab = spec.shape[0]
        self.first = shard_rows(self.vocab, tp.rank, tp.size)[0]
        self.chunk = loss_chunk_tokens(spec.shard_shape(tp.size)[0])   # rank 0's: the group's chunks must agree

    def forward(self, x: torch.Tensor, tokens: int) -> torch.Tensor:
        """The logits of every token (this rank holds `x`, its rows) over the whole vocabulary."""
        logits = linear(gather_from_sequence(x, self.tp, tokens), self.weight)
        return gather_from_region(logits, self.tp, self.vocab)

    def loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The summed cross-entropy of every token's logits (this rank holds `x`, its rows) against
        targets, chunk by chunk of tokens."""
        return _ChunkedHeadLoss.apply(gather_from_sequence(x, self.tp, targets.shape[0]), self.weight, targets,
                                      self.chunk, master_of(self.weight), self.tp, self.first)


class StageModel(nn.Module):
    """The parts one device holds: optionally the embedding, blocks [start, end), optionally the head.

    `named_parameters()` yields full-model names (``blocks.3.attn.wq``), holding this TP rank's shard.
    `recompute` (`plan.RECOMPUTE`): "full", a block keeps only its input for backward and runs its
    forward again there (non-reentrant activation checkpointing; the blocks draw no random numbers);
    "selective", it recomputes only its norms' outputs and SwiGLU's product (`Block`; compiled, what
    `selective_policy` does not keep).
    """

    def __init__(self, shape: ModelShape, layers: tuple[int, int], *, has_embedding: bool,
                 has_head: bool, tp: TensorParallel = SINGLE, recompute: str = "none"):
        super().__init__()
        err = tp_divisibility_error(shape, tp.size)
        if err:
            raise ValueError(err)
        if recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {recompute!r}")
        self.shape, self.tp, self.layers, self.recompute = shape, tp, layers, recompute
        self.rotary = RotaryTables(shape.head_dim, shape.rope_theta, shape.rope_scaling)
        self.embedding = Embedding(_by_local_name(shape, EMBEDDING)["embedding.weight"], tp) if has_embedding else None
        self.blocks = nn.ModuleDict({str(i): Block(shape, tp, recompute == "selective") for i in range(*layers)})
        head = _by_local_name(shape, HEAD) if has_head else None
        self.final_norm = RMSNorm(head["final_norm.weight"], shape.norm_eps) if head else None
        self.head = LMHead(head["head.weight"], tp) if head else None

    @property
    def parts(self) -> list[Part]:
        return ([EMBEDDING] if self.embedding is not None else []) + list(range(*self.layers)) + \
               ([HEAD] if self.head is not None else [])

    def load_full(self, full: Mapping[str, torch.Tensor]) -> None:
        """Copy this TP rank's shard of every held tensor out of full (unsharded) tensors."""
        for name, param in self.named_parameters():
            shard = take_shard(name, full[name], self.tp.rank, self.tp.size)
            if shard.shape != param.shape:
                raise ValueError(f"{name}: shard shape {tuple(shard.shape)} != parameter shape {tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(shard)

    def init_from_seed(self, seed: int) -> None:
        """Fill this TP rank's shards with their blocks of the full initial tensors, drawn on the host
        a tile at a time and written into the parameter wherever it lives."""
        specs = {t.name: t for part in self.parts for t in part_tensors(self.shape, part)}
        for name, param in self.named_parameters():
            spec = specs[name]
            span = [None, None]
            if spec.split_dim is not None and self.tp.size > 1:
                span[spec.split_dim] = shard_rows(spec.shape[spec.split_dim], self.tp.rank, self.tp.size)
            init_block(self.shape, spec, seed, *span, out=param.data)

    def forward_flops(self, cu_seqlens: torch.Tensor, model_share: bool = False) -> float:
        """FLOPs of this stage's forward over one micro-batch (its backward costs twice as much): 2 per
        weight per token for the matrix multiplies (the embedding is a lookup), and 4 per attended
        (query, key) pair per attention channel, causal and within each packed sequence. With
        `model_share`, a replicated matrix (none in this model: the head is split by vocabulary
        rows) would count 1/t on each rank: the rank's share of the model's FLOPs, which the group's
        ranks sum to (for MFU)."""
        weights, share, _, _ = self._flop_counts
        return self._flops(cu_seqlens, share if model_share else weights)

    def recompute_flops(self, cu_seqlens: torch.Tensor) -> float:
        """Work the backward adds by running the blocks' forward again, in FLOPs: all of it under
        "full"; under "selective" elementwise passes that run no GEMM, counted as the share of the
        forward the cost model prices them at (`RECOMPUTED_FORWARD`). A device's measured rate is
        its time over this work, and the planner prices the mode with the same share: one source
        for it, so that the rate does not count the recomputation the planner adds again."""
        share = RECOMPUTED_FORWARD[self.recompute]
        return share * self._flops(cu_seqlens, self._flop_counts[3]) if share else 0.0

    def _flops(self, cu_seqlens: torch.Tensor, weights: float) -> float:
        bounds = cu_seqlens.tolist()
        pairs = sum((b - a) * (b - a + 1) // 2 for a, b in zip(bounds, bounds[1:]))
        return 2.0 * weights * bounds[-1] + 4.0 * self._flop_counts[2] * pairs

    @contextlib.contextmanager
    def first_block_only(self) -> Iterator[None]:
        """The stage as if it held only its first block (a rehearsal's way to time a one-block
        stage): forward and `forward_flops` see that block alone until the context ends."""
        blocks, first = self.blocks, next(iter(self.blocks))
        self.blocks = nn.ModuleDict({first: blocks[first]})
        self.__dict__.pop("_flop_counts", None)
        try:
            yield
        finally:
            self.blocks = blocks
            self.__dict__.pop("_flop_counts", None)

    @cached_property
    def _flop_counts(self) -> tuple[int, float, int, int]:
        """(weights of the stage's matrix multiplies, this rank's share of them in the model's, its
        attention channels, the blocks' weights alone): fixed for the stage, counted once (every
        micro-batch asks)."""
        matrices = [(name, p.numel()) for name, p in self.named_parameters()
                    if p.dim() == 2 and not name.startswith("embedding.")]
        share = sum(n / (self.tp.size if split_dim(name) is None else 1) for name, n in matrices)
        channels = sum(block.attn.wq.shape[0] for block in self.blocks.values())
        blocks = sum(n for name, n in matrices if name.startswith("blocks."))
        return sum(n for _, n in matrices), share, channels, blocks

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor,
                targets: torch.Tensor | None = None) -> torch.Tensor:
        """Tokens [T] (first stage) or this TP rank's rows of the hidden states -> its rows of the
        hidden states, or on the last stage the logits of all T tokens, or with `targets` the summed
        cross-entropy against them (`LMHead.loss`). Between TP regions, and across stage boundaries,
        each rank holds its rows of the tokens (sequence parallelism: `geometry.sequence_rows`)."""
        tokens = positions.shape[0]
        if self.embedding is not None:
            x = self.embedding(x)
        # what every layer's attention needs of the positions and the boundaries, made once, the
        # tables in the dtype rotary computes in (at least fp32) so that no layer casts them again
        packing = Packing(cu_seqlens, x.device)
        rope = self.rotary(positions, packing.max_len, x.device, torch.promote_types(x.dtype, torch.float32))
        for block in self.blocks.values():
            if self.recompute == "full" and torch.is_grad_enabled():
                # recomputed on the weights it runs on now (a working copy is bound only for this call);
                # x a top-level argument, which the checkpoint saves for backward
                x = checkpoint(_run_block, x, block, dict(block.named_parameters()), rope, packing,
                               use_reentrant=False, preserve_rng_state=False)
            else:
                x = block(x, rope, packing)
        if self.head is None:
            return x
        x = self.final_norm(x)
        return self.head(x, tokens) if targets is None else self.head.loss(x, targets)


def _run_block(x: torch.Tensor, block: Block, weights: Mapping[str, torch.Tensor], rope, packing: Packing
               ) -> torch.Tensor:
    return functional_call(block, weights, (x, rope, packing))


def compile_blocks(model: StageModel) -> StageModel:
    """Regional compilation: each block compiled on its own, in place (parameter names unchanged), so
    that its norms, rotary and SwiGLU fuse into a few kernels while the stage's Python (pipeline,
    transport, collectives between blocks) stays eager. One compilation serves every block of the
    same shape; a new micro-batch length makes the compiled code dynamic in it (once).

    The compiler's partitioner picks for itself what a compiled block keeps for backward, and keeps
    the very outputs the selective autograd functions free; so a selective block is compiled under
    `selective_policy`, which it obeys: the whole block as one checkpoint where it is one graph (TP
    1). A TP group's collectives break the graph, and a checkpoint in pieces would run eagerly and
    issue its collectives again in backward; there the norms' function, which holds the
    all-gather, runs eagerly anyway, and only SwiGLU's product is recomputed under the policy."""
    for block in model.blocks.values():
        block.by_policy = block.selective
        block.compile()
    return model


def build_stage_model(shape: ModelShape, layers: tuple[int, int], *, has_embedding: bool, has_head: bool,
                      tp: TensorParallel = SINGLE, device: torch.device | str = "cpu",
                      seed: int | None = None, recompute: str = "none") -> StageModel:
    """A stage built on the meta device, then only its own shards allocated on `device`; filled from
    `seed`, or left uninitialised (seed None) when state is about to be loaded into it."""
    with torch.device("meta"):
        model = StageModel(shape, layers, has_embedding=has_embedding, has_head=has_head, tp=tp,
                           recompute=recompute)
    # as Module.to_empty, without its import of sympy at every worker's start (NOTES.md, Runtime)
    assert not list(model.buffers()), "a stage holds parameters only"
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            setattr(module, name, torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                                     requires_grad=p.requires_grad))
    if seed is not None:
        model.init_from_seed(seed)
    return model


def full_model(shape: ModelShape, seed: int, dtype: torch.dtype = torch.float32) -> StageModel:
    """The whole model on one device (TP size 1), as the reference uses it."""
    return build_stage_model(shape, (0, shape.layers), has_embedding=True, has_head=True, seed=seed).to(dtype)

