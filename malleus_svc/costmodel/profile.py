"""The planner's cost terms: per-device memory of a stage and communication, as plain numbers."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

BACKWARD_RATIO = 2.0   # a block's backward time / its forward time (weights and inputs: twice the work)
# How much of a block's forward its backward runs again, by the stage's recompute mode
# (`plan.RECOMPUTE`). "selective" redoes elementwise passes only (both norms, SwiGLU's product):
# at 70B TP 8 about 30 KB of memory traffic a token against 214 MFLOP of GEMMs, 4% of the
# forward at an H100's peak (less at the MFU GEMMs reach, more at smaller hidden sizes): priced at 5%.
RECOMPUTED_FORWARD = {"none": 0.0, "selective": 0.05, "full": 1.0}


def recompute_time_factor(mode: str) -> float:
    """A block's forward + backward time in a stage of recompute `mode`, over its time in one of "none"."""
    return 1.0 + RECOMPUTED_FORWARD[mode] / (1.0 + BACKWARD_RATIO)


RECOMPUTE_TIME_FACTOR = recompute_time_factor("full")


@dataclass(frozen=True)
class MemoryProfile:
    """Per-device memory model of a stage under 1F1B (the Malleus memory model), in MB.

    `layer_mb[k]` is the memory of one block at the full TP degree when the stage keeps
    d = len(layer_mb) - k micro-batches in flight (listed for d = len..1, as in the paper's code);
    `embedding_mb` what the first stage holds beyond its blocks, and `head_mb` the last (None: the
    paper's one E, for the first, the last or a stage that is both). On a group h = tp/|g| times
    smaller, the paper scales both by h. That is exact only for what the group splits:
    `replicated_layer_mb` (same depths), `replicated_embedding_mb` and `replicated_head_mb` are the parts every member
    holds whole (norms, the activations entering a TP region or the first stage's embedding
    lookups, the final norm), which a smaller group does not multiply. Left empty, everything splits
    (the paper's model).

    With the optimizer sharded (ZeRO-1), `sharded_layer_mb` and `sharded_embedding_mb` (split by
    the group like the rest) are the parts of the above that the `pipelines`
    holding each piece split among themselves: a plan of P pipelines keeps 1/P of them per device
    (`over(P)`).

    A stage that recomputes its blocks (`Stage.recompute == "full"`) keeps per block and micro-batch
    in flight its input, `recompute_input_mb` (split by the group: each member keeps its rows), instead of the
    `activation_mb` a block saves (`replicated_activation_mb` of it not split by a smaller group),
    and holds one block's activations once, while that block is recomputed. One that recomputes
    selectively keeps `selective_freed_mb` less of them (split by the group). Left at 0 (a scenario's
    own K gives no split of it), recomputation is priced as saving nothing.
    """

    layer_mb: tuple[float, ...]
    embedding_mb: float
    reserved_mb: float
    safety_margin_mb: float
    gpu_memory_mb: float
    replicated_layer_mb: tuple[float, ...] = ()
    replicated_embedding_mb: float = 0.0
    sharded_layer_mb: float = 0.0
    sharded_embedding_mb: float = 0.0
    pipelines: int = 1
    head_mb: float | None = None
    replicated_head_mb: float = 0.0
    activation_mb: float = 0.0
    replicated_activation_mb: float = 0.0
    recompute_input_mb: float = 0.0
    selective_freed_mb: float = 0.0

    @property
    def sharded(self) -> bool:
        return self.sharded_layer_mb > 0 or self.sharded_embedding_mb > 0

    def over(self, pipelines: int) -> "MemoryProfile":
        """This model for a plan of `pipelines` pipelines (the divisor of the sharded state)."""
        return dataclasses.replace(self, pipelines=pipelines) if self.sharded else self

    @property
    def _unsharded(self) -> float:
        return 1.0 - 1.0 / self.pipelines

    def per_layer_mb(self, in_flight: int) -> float:
        """K[d]; beyond the listed depths, extrapolate linearly (the authors' code raised IndexError)."""
        return _at_depth(self.layer_mb, in_flight)

    def block_mb(self, h: float, in_flight: int, recompute: str = "none") -> float:
        """One block on a device of a group h = tp/|g| times smaller than full, `in_flight` deep, in a
        stage of recompute mode `recompute`."""
        kept = _at_depth(self.replicated_layer_mb, in_flight) if self.replicated_layer_mb else 0.0
        base = h * (self.per_layer_mb(in_flight) - kept - self.sharded_layer_mb * self._unsharded) + kept
        if recompute == "full" and self.activation_mb:
            base -= in_flight * (self.activations_mb(h) - h * self.recompute_input_mb)
        elif recompute == "selective":
            base -= in_flight * h * self.selective_freed_mb
        return base

    def selective(self) -> "MemoryProfile":
        """This model for stages that all recompute selectively."""
        depths = range(len(self.layer_mb), 0, -1)     # layer_mb lists depths len..1
        freed = self.selective_freed_mb
        return dataclasses.replace(self, layer_mb=tuple(k - d * freed for k, d in zip(self.layer_mb, depths)),
                                   activation_mb=self.activation_mb - freed, selective_freed_mb=0.0)

    def recomputing(self, largest_h: float) -> "MemoryProfile":
        """This model for stages that all recompute their blocks: each block keeps its input in place
        of its activations, and every device holds one block's activations once (as on the smallest
        group, `largest_h`: the model has no per-stage term). Itself where the activations are not
        known."""
        if not self.activation_mb:
            return self
        depths = range(len(self.layer_mb), 0, -1)     # layer_mb lists depths len..1
        saved = self.activation_mb - self.recompute_input_mb
        kept = self.replicated_activation_mb
        return dataclasses.replace(
            self, layer_mb=tuple(k - d * saved for k, d in zip(self.layer_mb, depths)),
            replicated_layer_mb=tuple(k - d * kept for k, d in zip(self.replicated_layer_mb, depths)),
            reserved_mb=self.reserved_mb + self.activations_mb(largest_h),
            activation_mb=0.0, replicated_activation_mb=0.0, recompute_input_mb=0.0, selective_freed_mb=0.0)

    def activations_mb(self, h: float) -> float:
        """What one block saves for backward per micro-batch on such a device (0: not known)."""
        return h * (self.activation_mb - self.replicated_activation_mb) + self.replicated_activation_mb

    def ends_mb(self, h: float, first: bool, last: bool) -> float:
        """What a device of such a group holds beyond its blocks for being its pipeline's `first`
        stage (the embedding) and its `last` (the head and the loss): one E for either or both
        where the profile gives one."""
        def end(total: float, kept: float) -> float:
            return h * (total - kept - self.sharded_embedding_mb * self._unsharded) + kept

        if self.head_mb is None:
            return end(self.embedding_mb, self.replicated_embedding_mb) if first or last else 0.0
        return ((end(self.embedding_mb, self.replicated_embedding_mb) if first else 0.0)
                + (end(self.head_mb, self.replicated_head_mb) if last else 0.0))

    @property
    def budget_mb(self) -> float:
        """Memory a stage may use for blocks and embedding/head: C - δ - X0."""
        return self.gpu_memory_mb - self.safety_margin_mb - self.reserved_mb


def _at_depth(rows: tuple[float, ...], in_flight: int) -> float:
    n = len(rows)
    if in_flight <= n:
        return rows[n - in_flight]
    step = (rows[0] - rows[1]) if n >= 2 else 0.0
    return rows[0] + step * (in_flight - n)


@dataclass(frozen=True)
class CommCosts:
    """Communication terms for the `full` objective, in t0 units (all zero = ignore)."""

    p2p_intra_node: float = 0.0   # one stage boundary, one micro-batch, forward + backward, same node
    p2p_inter_node: float = 0.0   # the same across nodes
    grad_sync_per_block: float = 0.0  # all-reduce of one full block's gradients at the slowest link, once per iteration
    # (link, k, share) as a job measured them (`LinkTimes`), link "intra" or "inter" node: k pairs at
    # once, each moving 1/k of a boundary, took `share` of one pair's whole. None: every device has
    # links of its own (a GPU's NVLink and NIC), so share 1/k.
    p2p_shares: tuple[tuple[str, int, float], ...] | None = None

    def p2p_share(self, k: int, same_node: bool) -> float:
        """The share of a boundary's p2p term it takes between TP groups whose smaller one has k
        devices: sequence parallelism sends each rank's rows to the ranks that hold them, k
        transfers at once, each 1/k of the tensor. Measured: on the boundary's kind of link (the
        other kind's where this one was not measured: the same hosts), at the largest k measured
        up to k; none measured, the whole."""
        if k <= 1:
            return 1.0
        if self.p2p_shares is None:
            return 1.0 / k
        link = "intra" if same_node else "inter"
        measured = [(m, s) for w, m, s in self.p2p_shares if w == link] or [(m, s) for _, m, s in self.p2p_shares]
        return max(((m, s) for m, s in measured if m <= k), default=(1, 1.0))[1]


@dataclass(frozen=True)
class LinkTimes:
    """A job's links as its workers timed them (runtime/link_probe.py), in seconds: one boundary
    tensor's round trip (forward and back) within a node and across nodes (None on one node: no
    such link), one block's fp32 gradient all-reduced among `reducers` devices, and (link, k,
    share): k pairs at once on that kind of link ("intra" or "inter" node), each with 1/k of the
    tensor, took `share` of one pair's whole round trip there (`CommCosts.p2p_share`)."""

    p2p_intra_node_s: float
    p2p_inter_node_s: float | None
    grad_sync_per_block_s: float
    reducers: int
    p2p_shares: tuple[tuple[str, int, float], ...] = ()

    def comm_costs(self, t0_seconds: float) -> CommCosts:
        """The same terms in t0 units, for the planner."""
        inter = self.p2p_intra_node_s if self.p2p_inter_node_s is None else self.p2p_inter_node_s
        return CommCosts(p2p_intra_node=self.p2p_intra_node_s / t0_seconds, p2p_inter_node=inter / t0_seconds,
                         grad_sync_per_block=self.grad_sync_per_block_s / t0_seconds, p2p_shares=self.p2p_shares)

    def describe(self) -> str:
        ms = 1e3
        inter = "" if self.p2p_inter_node_s is None else f", {self.p2p_inter_node_s * ms:.3g} ms across nodes"
        split = "".join(f"; {k} pairs at once with 1/{k} each {s:.2f}x {'within a node' if w == 'intra' else 'across nodes'}"
                        for w, k, s in self.p2p_shares)
        return (f"hand-off round trip {self.p2p_intra_node_s * ms:.3g} ms within a node{inter}{split}; gradient "
                f"all-reduce {self.grad_sync_per_block_s * ms:.3g} ms per block among {self.reducers} devices")
