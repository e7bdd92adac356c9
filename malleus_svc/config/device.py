"""The `device:` section of a scenario: sustained speeds of one accelerator and its links."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceSpec:
    """Sustained speeds of one accelerator and its links (defaults: an A800/A100-80GB class node)."""

    peak_tflops: float = 312.0          # dense bf16
    efficiency: float = 0.45            # sustained fraction of peak for transformer blocks
    intra_node_gbps: float = 200.0      # NVLink, per direction, GB/s
    inter_node_gbps: float = 25.0       # 200 Gb/s InfiniBand per GPU, GB/s
    memory_gbps: float = 1600.0         # HBM, sustained GB/s (about 80% of an A100-80GB's 2039)
    act_bytes: float = 2.0              # bf16 activations

    @property
    def flops_per_second(self) -> float:
        return self.peak_tflops * 1e12 * self.efficiency
