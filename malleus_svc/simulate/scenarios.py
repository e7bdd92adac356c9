"""The evaluation grid at the Malleus paper's scale (its evaluation), as scenario dicts and traces.

Models and layouts (the paper's evaluation): LLaMA 32B (60 layers, hidden 6656) on 32 GPUs as DP4-TP2-PP4; 70B (80
layers, hidden 8192) and 110B (80 layers, hidden 8192, FFN 49152) on 64 GPUs as DP2-TP8-PP4;
sequence 4096, global batch 64, micro-batch 1, 80 GB devices (C = 81252 MB as in the authors'
code) in nodes of 8. Profiles: tp_alpha (the time model's) where the authors' code gives it (70B, 110B),
the analytic cost model otherwise (32B at TP 2); per-block memory K, E, X0 (the memory model's) for all
three (the code's measured profiles). Block time t0, p2p and gradient costs: analytic.

Straggler situations (true rates; devices chosen away from node boundaries on purpose only
where said):
  healthy   none (the reference for the capacity bound)
  mild      one device at 1.5×
  severe    one device at 5×
  authors   the authors' planner-test rates, across nodes: 12.53, 12.53, 2.57 (64 GPUs) and
            4.79, 2.34, 3.8 (32 GPUs)
  slow-node all 8 devices of one node at 2×
Traces: stragglers come and go, 20-minute phases over 2 hours.
Large clusters (planning time and quality): 70B at DP(N/32)-TP8-PP4, global batch 32·DP, with
1% of the devices straggling at rates drawn from {1.5, 2.57, 5, 12.53}.
"""
from __future__ import annotations

import copy
import random
from typing import Any

from ..config import Scenario
from .trace import Phase, Trace

PROFILES: dict[str, dict[str, Any]] = {
    "llama-32b": {"layer_memory_mb": [4608.02, 4124.24, 3641.99, 3129.95], "embedding_memory_mb": 1200,
                  "reserved_memory_mb": 5500, "safety_margin_mb": 4096},
    "llama-70b": {"tp_alpha": [1, 1.90, 3.66, 7.22],
                  "layer_memory_mb": [2895, 2685, 2485, 2295, 2110, 1933, 1769, 1647],
                  "embedding_memory_mb": 600, "reserved_memory_mb": 4700, "safety_margin_mb": 4096},
    "llama-110b": {"tp_alpha": [1, 1.91, 3.77, 7.35],
                   "layer_memory_mb": [4240, 3930, 3630, 3338, 3068, 2830, 2597, 2438],
                   "embedding_memory_mb": 500, "reserved_memory_mb": 4900, "safety_margin_mb": 4096},
}
GPU_MEMORY_MB = 81252
SETUPS = {  # name -> (model, nodes, dp, tp, pp)
    "32b-32gpu": ("llama-32b", 4, 4, 2, 4),
    "70b-64gpu": ("llama-70b", 8, 2, 8, 4),
    "110b-64gpu": ("llama-110b", 8, 2, 8, 4),
}
SITUATIONS: dict[str, dict[int, dict[int, float]]] = {   # situation -> devices in cluster -> rates
    "healthy": {32: {}, 64: {}},
    "mild": {32: {5: 1.5}, 64: {5: 1.5}},
    "severe": {32: {5: 5.0}, 64: {5: 5.0}},
    "authors": {32: {1: 4.79, 10: 2.34, 19: 3.8}, 64: {0: 12.53, 8: 12.53, 16: 2.57}},
    "slow-node": {32: {d: 2.0 for d in range(8, 16)}, 64: {d: 2.0 for d in range(8, 16)}},
}
STRAGGLER_SITUATIONS = ("mild", "severe", "authors", "slow-node")
SINGLE_DEVICE = ("mild", "severe")
LARGE_RATES = (1.5, 2.57, 5.0, 12.53)


def scenario_dict(setup: str, rates: dict[int, float] | None = None, objective: str = "full") -> dict[str, Any]:
    if setup not in SETUPS:
        raise ValueError(f"unknown setup {setup!r}; known: {', '.join(SETUPS)}")
    model, nodes, dp, tp, pp = SETUPS[setup]
    return {"name": setup, "cluster": {"nodes": nodes, "gpus_per_node": 8, "gpu_memory_mb": GPU_MEMORY_MB},
            "model": model, "parallel": {"dp": dp, "tp": tp, "pp": pp}, "batch": {"global": 64, "micro": 1},
            "profile": copy.deepcopy(PROFILES[model]), "rates": dict(rates or {}),
            "planner": {"objective": objective}}


def paper_scenario(setup: str, situation: str = "healthy") -> Scenario:
    model, nodes, *_ = SETUPS[setup]
    if situation not in SITUATIONS:
        raise ValueError(f"unknown situation {situation!r}; known: {', '.join(SITUATIONS)}")
    d = scenario_dict(setup, SITUATIONS[situation][nodes * 8])
    d["name"] = f"{setup}-{situation}"   # a name is [A-Za-z0-9._-]; the source keeps the CLI spelling
    return Scenario.from_dict(d, source=f"simulate:{setup}/{situation}")


def dynamic_trace(setup: str, phase_seconds: float = 1200.0) -> Trace:
    """Stragglers come and go: healthy, one severe, three across nodes, one recovers, a slow node,
    healthy again."""
    n = SETUPS[setup][1] * 8
    a = SITUATIONS["authors"][n]
    keys = list(a)
    phases = [
        {},
        {5: 5.0},
        {5: 5.0, **a},
        {k: a[k] for k in keys[1:]},
        {d: 2.0 for d in range(8, 16)},
        {},
    ]
    return Trace(f"{setup}/dynamic", tuple(Phase(phase_seconds, r) for r in phases))


def large_scenario(num_devices: int, seed: int = 0, fraction: float = 0.01) -> Scenario:
    """70B at DP(N/32)-TP8-PP4 with `fraction` of the devices straggling (seeded)."""
    if num_devices % 32:
        raise ValueError(f"large clusters are DP x TP8 x PP4: devices must be a multiple of 32, got {num_devices}")
    dp = num_devices // 32
    rng = random.Random(seed)
    k = max(1, round(num_devices * fraction))
    rates = {d: rng.choice(LARGE_RATES) for d in sorted(rng.sample(range(num_devices), k))}
    d = {"name": f"70b-{num_devices}gpu-seed{seed}",
         "cluster": {"nodes": num_devices // 8, "gpus_per_node": 8, "gpu_memory_mb": GPU_MEMORY_MB},
         "model": "llama-70b", "parallel": {"dp": dp, "tp": 8, "pp": 4}, "batch": {"global": 32 * dp, "micro": 1},
         "profile": copy.deepcopy(PROFILES["llama-70b"]), "rates": rates, "planner": {"objective": "full"}}
    return Scenario.from_dict(d, source=f"simulate:large-{num_devices}")
