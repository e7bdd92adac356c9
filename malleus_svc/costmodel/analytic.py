"""Analytic defaults for the planner's profile, computed from a model's shape.

A scenario without a `profile` still plans sensibly: block time from FLOPs at a sustained rate,
TP collectives from activation bytes over the intra-node link, per-block memory under 1F1B from
parameter/optimizer bytes plus activations per in-flight micro-batch (the Malleus memory model, and the
cost models of the AMP and Galvatron papers). Measured profiles replace these numbers
(`profile:` in the scenario); these are deliberately simple and documented, not tuned.
"""
from __future__ import annotations

from ..config.device import DeviceSpec
from ..config.presets import ModelShape
from ..geometry import loss_backward_bytes, most_rows
from ..plan import StateSizes
from .profile import CommCosts, MemoryProfile

MB = 1024.0 * 1024.0

# Mixed-precision AdamW without ZeRO: bf16 weights (2) + fp32 master (4) + fp32 grads (4) + Adam m, v (8).
TRAIN_STATE_BYTES_PER_PARAM = 18.0
# What migrates at an iteration boundary: fp32 master weights and the two Adam moments.
MIGRATED_BYTES_PER_PARAM = 12.0
# What a sharded optimizer (ZeRO-1) splits among the pipelines holding a piece: the fp32 master and
# Adam's m and v (the bf16 working copy and the fp32 gradients stay whole).
SHARDED_BYTES_PER_PARAM = 12.0
# Passes an AdamW update makes over its fp32 state: it reads parameter, gradient and both moments,
# and writes all but the gradient back (memory-bound: its time is these bytes over the bandwidth).
UPDATE_PASSES = 7
UPDATE_BYTES_PER_PARAM = UPDATE_PASSES * 4.0


def _allreduce_seconds(nbytes: float, ranks: int, gbps: float) -> float:
    """Ring all-reduce: each rank sends and receives 2 (n-1)/n of the buffer."""
    if ranks <= 1:
        return 0.0
    return 2.0 * (ranks - 1) / ranks * nbytes / (gbps * 1e9)


# A block's TP traffic in all-reduces of its hidden state, under sequence parallelism: each of its
# two regions all-gathers the hidden state and reduce-scatters it forward, the reverse backward,
# and all-gathers its input again in backward (kept as rows, not whole). An all-gather or a
# reduce-scatter moves half an all-reduce.
TP_ALLREDUCES_PER_BLOCK = 5


def tp_comm_seconds_per_token(hidden: int, tp: int, act_bytes: float, gbps: float) -> float:
    """A block's TP collectives per token (`TP_ALLREDUCES_PER_BLOCK`)."""
    return TP_ALLREDUCES_PER_BLOCK * _allreduce_seconds(hidden * act_bytes, tp, gbps)


def block_seconds(shape: ModelShape, tp: int, micro_batch: int, device: DeviceSpec,
                  seq_len: int | None = None) -> float:
    """Forward + backward time of one block for one micro-batch on a TP group of `tp` devices."""
    s = seq_len or shape.seq_len
    tokens = micro_batch * s
    compute = shape.block_flops(tokens, s) / (tp * device.flops_per_second)
    return compute + tokens * tp_comm_seconds_per_token(shape.hidden, tp, device.act_bytes, device.intra_node_gbps)


def optimizer_seconds(shape: ModelShape, tp: int, device: DeviceSpec) -> float:
    """One block's AdamW update on each device of a TP group of `tp`."""
    return UPDATE_BYTES_PER_PARAM * shape.block_params() / tp / (device.memory_gbps * 1e9)


def tp_alpha(shape: ModelShape, tp: int, micro_batch: int, device: DeviceSpec) -> tuple[float, ...]:
    """Slowdown of a block on tp/2^r devices instead of tp, r = 0..log2(tp)."""
    base = block_seconds(shape, tp, micro_batch, device)
    sizes, t = [], tp
    while t >= 1:
        sizes.append(t)
        if t == 1:
            break
        t //= 2
    return tuple(block_seconds(shape, t, micro_batch, device) / base for t in sizes)


def activation_mb(shape: ModelShape, tp: int, micro_batch: int, device: DeviceSpec) -> float:
    """Megatron's count of the activations one block keeps for backward, per micro-batch, per device
    (flash attention, no sequence parallelism: the 10·s·b·h part is replicated in the TP group,
    24·s·b·h/t is split). What this runtime keeps is `block_activation_bytes`."""
    sbh = micro_batch * shape.seq_len * shape.hidden
    return sbh * (10.0 + 24.0 / tp) * (device.act_bytes / 2.0) / MB


def block_activation_bytes(shape: ModelShape, tp: int, device: DeviceSpec, selective: bool = False
                           ) -> tuple[float, float]:
    """Bytes per token one block of this runtime keeps for backward (flash attention, compute in
    `act_bytes`): (replicated in the TP group, this device's share of the split part).
    With sequence parallelism nothing is replicated. Between the TP regions a device keeps its rows
    of both norms' inputs and outputs (the outputs enter the regions, which all-gather them again in
    backward) and their fp32 1/rms (rotary's fp32 tables are the stage's, shared by its blocks);
    inside them, its heads' rotated q and k, v, attention output and flash's fp32 log-sum-exp, and
    its ffn rows of SwiGLU's gate, up, silu(gate) and their product. `selective` recomputation
    keeps neither the norms' outputs nor silu(gate) and the product."""
    a, d = device.act_bytes, shape.head_dim
    kv = shape.n_kv_heads * d
    norms, swiglu = (2, 2) if selective else (4, 4)
    return 0.0, (norms * a * shape.hidden + 2 * 4 + a * (2 * shape.hidden + 2 * kv + swiglu * shape.ffn)
                 + 4 * shape.heads) / tp


def memory_profile(shape: ModelShape, tp: int, pp: int, micro_batch: int, gpu_memory_mb: float,
                   reserved_mb: float, safety_margin_mb: float, device: DeviceSpec,
                   shard_optimizer: bool = False) -> MemoryProfile:
    """This runtime's memory at TP degree `tp` (what `malleus memory` measures on the meta device):
    K[d] for d = max(pp, 2)..1 in-flight micro-batches and E for the embedding or head, each with
    the part a smaller TP group does not split. A block: fp32 master weights, gradients and Adam
    moments and a bf16 working copy (`TRAIN_STATE_BYTES_PER_PARAM`), split over the group but for
    its norms, plus its activations per micro-batch in flight. The embedding and the head are split
    by vocabulary rows, and so is the loss's backward (`geometry.loss_backward_bytes` of the
    device's rows), as are the first stage's embedding output per micro-batch in flight and the
    last stage's final-norm input and 1/rms (a device keeps its rows); whole on each member are the
    final norm's weight and the output the loss gathers, with each token's fp32 log-sum-exp. With
    `shard_optimizer`, the fp32 masters and Adam moments of the split part of a block and of the
    embedding or head are what the plan's pipelines split among themselves. A stage that recomputes
    keeps each block's input (its rows of it) in place of its activations; one that recomputes
    selectively, its activations less the norms' outputs and SwiGLU's elementwise ones."""
    tokens = micro_batch * shape.seq_len
    norms = 2 * shape.hidden
    state_split = (shape.block_params() - norms) * TRAIN_STATE_BYTES_PER_PARAM / tp / MB
    state_kept = norms * TRAIN_STATE_BYTES_PER_PARAM / MB
    act_kept, act_split = (tokens * b / MB for b in block_activation_bytes(shape, tp, device))
    depths = range(max(pp, 2), 0, -1)
    layer_mb = tuple(state_split + state_kept + d * (act_split + act_kept) for d in depths)
    kept_mb = tuple(state_kept + d * act_kept for d in depths)
    vocab_rows = shape.vocab * shape.hidden     # the embedding's, or the head's without its norm
    hidden_rows = tokens * shape.hidden * device.act_bytes / tp / MB     # a device's rows of a hidden state
    state = vocab_rows * TRAIN_STATE_BYTES_PER_PARAM / tp / MB
    first = state + max(pp, 2) * hidden_rows
    last_kept = (shape.hidden * TRAIN_STATE_BYTES_PER_PARAM + tokens * (shape.hidden * device.act_bytes + 4)) / MB
    last = (state + loss_backward_bytes(most_rows(shape.vocab, tp), tokens, device.act_bytes) / MB
            + hidden_rows + tokens * 4 / tp / MB + last_kept)
    sharded = SHARDED_BYTES_PER_PARAM / MB if shard_optimizer else 0.0
    return MemoryProfile(layer_mb=layer_mb, embedding_mb=first, head_mb=last,
                         reserved_mb=reserved_mb, safety_margin_mb=safety_margin_mb, gpu_memory_mb=gpu_memory_mb,
                         replicated_layer_mb=kept_mb, replicated_head_mb=last_kept,
                         sharded_layer_mb=(shape.block_params() - norms) / tp * sharded,
                         sharded_embedding_mb=vocab_rows / tp * sharded,
                         activation_mb=act_split + act_kept, replicated_activation_mb=act_kept,
                         recompute_input_mb=hidden_rows,
                         selective_freed_mb=act_split - tokens * block_activation_bytes(shape, tp, device, True)[1] / MB)


def comm_costs(shape: ModelShape, tp: int, dp: int, micro_batch: int, device: DeviceSpec) -> CommCosts:
    """p2p per stage boundary per micro-batch and the per-block gradient all-reduce, in t0 units."""
    t0 = block_seconds(shape, tp, micro_batch, device)
    act = micro_batch * shape.seq_len * shape.hidden * device.act_bytes
    p2p_intra = 2.0 * act / (device.intra_node_gbps * 1e9) / t0
    p2p_inter = 2.0 * act / (device.inter_node_gbps * 1e9) / t0
    grad_bytes = shape.block_params() * 4.0  # fp32 gradients
    grad_sync = _allreduce_seconds(grad_bytes, max(dp, 2), device.inter_node_gbps) / t0
    return CommCosts(p2p_intra_node=p2p_intra, p2p_inter_node=p2p_inter, grad_sync_per_block=grad_sync)


def state_sizes(shape: ModelShape) -> StateSizes:
    """Bytes that migrate per part (fp32 master weights + Adam moments), for plan diffs."""
    return StateSizes.of(shape, MIGRATED_BYTES_PER_PARAM)
