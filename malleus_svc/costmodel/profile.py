"""The planner's cost terms: per-device memory of a stage and communication, as plain numbers."""
from __future__ import annotations

from dataclasses import dataclass

BACKWARD_RATIO = 2.0   # a block's backward time / its forward time (weights and inputs: twice the work)


@dataclass(frozen=True)
class MemoryProfile:
    """Per-device memory model of a stage under 1F1B (the Malleus memory model), in MB.

    `layer_mb[k]` is the memory of one block at the full TP degree when the stage keeps
    d = len(layer_mb) - k micro-batches in flight (listed for d = len..1, as in the paper's code).
    """

    layer_mb: tuple[float, ...]
    embedding_mb: float
    reserved_mb: float
    safety_margin_mb: float
    gpu_memory_mb: float

    def per_layer_mb(self, in_flight: int) -> float:
        """K[d]; beyond the listed depths, extrapolate linearly (the authors' code raised IndexError)."""
        n = len(self.layer_mb)
        if in_flight <= n:
            return self.layer_mb[n - in_flight]
        step = (self.layer_mb[0] - self.layer_mb[1]) if n >= 2 else 0.0
        return self.layer_mb[0] + step * (in_flight - n)

    @property
    def budget_mb(self) -> float:
        """Memory a stage may use for blocks and embedding/head: C - δ - X0."""
        return self.gpu_memory_mb - self.safety_margin_mb - self.reserved_mb


@dataclass(frozen=True)
class CommCosts:
    """Communication terms for the `full` objective, in t0 units (all zero = ignore)."""

    p2p_intra_node: float = 0.0   # one stage boundary, one micro-batch, forward + backward, same node
    p2p_inter_node: float = 0.0   # the same across nodes
    grad_sync_per_block: float = 0.0  # all-reduce of one full block's gradients at the slowest link, once per iteration
