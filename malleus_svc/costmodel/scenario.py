"""A scenario's cost terms: what its `profile:` gives, and the analytic model for what it leaves out."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..config.scenario import Scenario
from ..plan import StateSizes
from . import analytic
from .profile import CommCosts, MemoryProfile


@dataclass(frozen=True)
class ScenarioCosts:
    memory: MemoryProfile
    tp_alpha: tuple[float, ...]
    t0_seconds: float
    comm: CommCosts
    state_sizes: StateSizes
    optimizer_per_block: float   # t0 units


def scenario_costs(sc: Scenario) -> ScenarioCosts:
    """The profile terms of `sc`: measured where the scenario gives them, analytic otherwise (config
    has already required the measured ones when the model gives only a layer count)."""
    prof, shape = sc.profile, sc.shape
    tp_alpha = prof.tp_alpha if prof.tp_alpha is not None else analytic.tp_alpha(shape, sc.tp, sc.micro_batch, sc.device)
    layer_mb, emb = prof.layer_memory_mb, prof.embedding_memory_mb
    if shape is not None and (layer_mb is None or emb is None):
        memory = analytic.memory_profile(shape, sc.tp, sc.pp, sc.micro_batch, sc.gpu_memory_mb,
                                         prof.reserved_memory_mb, prof.safety_margin_mb, sc.device,
                                         bool(sc.shard_optimizer))
        if layer_mb is not None or emb is not None:   # measured numbers say nothing of what splits
            memory = dataclasses.replace(memory, layer_mb=tuple(layer_mb or memory.layer_mb),
                                         embedding_mb=memory.embedding_mb if emb is None else emb,
                                         head_mb=memory.head_mb if emb is None else None,   # one E: the paper's
                                         replicated_layer_mb=(), replicated_embedding_mb=0.0, replicated_head_mb=0.0,
                                         activation_mb=0.0, replicated_activation_mb=0.0, recompute_input_mb=0.0,
                                         selective_freed_mb=0.0)
    else:
        memory = MemoryProfile(layer_mb=tuple(layer_mb), embedding_mb=emb, reserved_mb=prof.reserved_memory_mb,
                               safety_margin_mb=prof.safety_margin_mb, gpu_memory_mb=sc.gpu_memory_mb)
    if prof.t0_seconds is not None:
        t0 = prof.t0_seconds
    else:
        t0 = analytic.block_seconds(shape, sc.tp, sc.micro_batch, sc.device) if shape is not None else 1.0
    comm = analytic.comm_costs(shape, sc.tp, sc.dp, sc.micro_batch, sc.device) if shape is not None else CommCosts()
    sizes = dataclasses.replace(analytic.state_sizes(shape) if shape is not None else StateSizes(),
                                sharded=bool(sc.shard_optimizer))
    if prof.optimizer_seconds is not None:
        optimizer = prof.optimizer_seconds / t0
    else:   # in the analytic t0's units, as the communication terms
        optimizer = (analytic.optimizer_seconds(shape, sc.tp, sc.device)
                     / analytic.block_seconds(shape, sc.tp, sc.micro_batch, sc.device)) if shape is not None else 0.0
    return ScenarioCosts(memory=memory, tp_alpha=tuple(tp_alpha), t0_seconds=t0, comm=comm, state_sizes=sizes,
                         optimizer_per_block=optimizer)
