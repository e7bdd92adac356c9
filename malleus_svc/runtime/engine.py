"""The engine that runs one device's share of a plan for one training step, exactly.

Exact means: the update equals the one a single process computes on the whole global batch.
Three things make it so:
  * loss weighting: each micro-batch's loss is its summed token cross-entropy divided by the
    GLOBAL batch's loss-token count, and pipelines are summed, never averaged (Malleus fault 7);
  * gradient reduction: every piece of every tensor (the finest common partition of its holders'
    TP shards, see groups.py) is summed once over the pipelines, one holder per pipeline;
  * clipping by the norm over unique elements, each piece counted by exactly one device.
"""
from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

import torch
import torch.distributed as dist

from malleus_svc.config.job import TrainConfig
from malleus_svc.config.lr_schedule import LrSchedule
from malleus_svc.config.presets import ModelShape
from malleus_svc.geometry import decayed, split_dim, tensor_spec, tp_divisibility_error
from malleus_svc.plan import Plan
from malleus_svc.runtime.batch import MicroBatch
from malleus_svc.runtime.device_clock import DeviceClock, make_clock
from malleus_svc.runtime.distributed_optimizer import ShardedGradientSync
from malleus_svc.runtime.gradient_sync import GradientSync
from malleus_svc.runtime.groups import Groups, PipelinePeers
from malleus_svc.runtime.model import build_stage_model, compile_blocks
from malleus_svc.runtime.optimizer import AdamW, update_bytes
from malleus_svc.runtime.precision import WorkingWeights, compute_dtype_for
from malleus_svc.runtime.schedule import Post, Transfer, stage_program
from malleus_svc.runtime.state_owners import RunState
from malleus_svc.runtime.transport import P2PTransport, StageTransport

# Keys of optimizer state in the flat dicts of assemble_full() and reference_train().
EXP_AVG, EXP_AVG_SQ, STEP = ":exp_avg", ":exp_avg_sq", ":step"


_TRAIN = TrainConfig()


@dataclass(frozen=True)
class OptimConfig:
    """The job file's `train` section as a device runs it (config.job.TrainConfig, whose defaults these
    are): AdamW, its schedule and clipping, and whether the blocks are compiled."""
    lr: float = _TRAIN.lr                 # the peak
    betas: tuple[float, float] = _TRAIN.betas
    eps: float = _TRAIN.eps
    weight_decay: float = _TRAIN.weight_decay
    grad_clip: float | None = _TRAIN.grad_clip   # max global grad norm; None or <= 0: no clipping
    decay_embeddings: bool = _TRAIN.decay_embeddings
    schedule: LrSchedule = _TRAIN.schedule
    compile: bool | None = _TRAIN.compile        # blocks compiled (None: on CUDA only)
    shard_optimizer: bool = False       # the optimizer's state split among a piece's holders (ZeRO-1; the scenario's)
    overlap_grad_reduce: bool = True    # each gradient bucket reduced as soon as backward finishes it

    @classmethod
    def of(cls, train: TrainConfig, shard_optimizer: bool = False) -> "OptimConfig":
        return cls(lr=train.lr, betas=train.betas, eps=train.eps, weight_decay=train.weight_decay,
                   grad_clip=train.grad_clip, decay_embeddings=train.decay_embeddings, schedule=train.schedule,
                   compile=train.compile, shard_optimizer=shard_optimizer)

    def compiles_on(self, device: torch.device) -> bool:
        return self.compile if self.compile is not None else device.type == "cuda"

    def lr_at(self, step: int) -> float:
        return self.schedule.lr_at(step, self.lr)

    def make(self, named: Mapping[str, torch.nn.Parameter], tied: bool = False) -> AdamW:
        """AdamW over the model's parameters by their full-model names (weight decay by `decayed`)."""
        return AdamW(named.values(), lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay,
                     no_decay=[p for name, p in named.items() if not decayed(name, self.decay_embeddings, tied)])


@dataclass
class StepStats:
    loss: float              # this pipeline's share of the global loss (last stage; 0 elsewhere)
    loss_tokens: int         # loss tokens in this pipeline's micro-batches
    grad_norm: float         # global gradient norm before clipping
    compute_seconds: float   # device time of this device's forward/backward ops (its DeviceClock)
    update_seconds: float    # device time of the updates since the last step's end (this one's too, with `apply`)
    update_bytes: float      # what those updates moved
    flops: float             # of those ops: the work the device time was spent on
    block_ops: int           # of those ops: the blocks each ran through, summed (an accelerator's fixed costs)
    model_flops: float       # this device's share of the model's FLOPs (the devices' shares sum to the step's)
    wall_seconds: float
    comm_seconds: float      # wall time waiting in p2p and collectives
    global_loss: float = 0.0  # the whole global batch's mean loss, the same on every active device


@dataclass(frozen=True)
class ShardState:
    """One device's slice of one tensor: rows [start, end) along `dim` of the full tensor.

    Replicated tensors have dim None and the whole tensor (start 0, end full_shape[0]).
    exp_avg / exp_avg_sq are zeros and step 0 before the first optimizer step.
    """

    dim: int | None
    start: int
    end: int
    param: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: int
    full_shape: tuple[int, ...]


def validate_plan_for_model(shape: ModelShape, plan: Plan) -> None:
    """Raise ValueError if this model cannot run under this plan."""
    if plan.num_layers != shape.layers:
        raise ValueError(f"plan {plan.plan_id} has {plan.num_layers} layers, the model has {shape.layers}")
    for i, pipe in enumerate(plan.pipelines):
        for j, st in enumerate(pipe.stages):
            err = tp_divisibility_error(shape, st.tp)
            if err:
                raise ValueError(f"pipeline {i} stage {j} (devices {list(st.devices)}): {err}")


def _check_rank(plan: Plan, rank: int) -> None:
    if not 0 <= rank < plan.num_devices:
        raise ValueError(f"rank {rank} is not a device of plan {plan.plan_id} (devices 0..{plan.num_devices - 1})")
    for kind, devices in (("suspended", plan.suspended), ("excluded", plan.excluded)):
        if rank in devices:
            raise ValueError(f"rank {rank} is {kind} in plan {plan.plan_id}: it has no work, "
                             "so it builds no Engine")


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor copied to `device` without the host waiting: on CUDA from pinned memory, non-
    blocking (a copy from pageable memory synchronises the stream first)."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class Engine:
    """One device's share of a plan: its stage model, optimizer, groups and transport.

    `transport` makes the stage's point-to-point transport from (peers, device, dtype); `clock`
    times the compute ops (an unpaced PacedClock on CPU, a CudaClock on CUDA, unless given).
    `init=False` leaves the weights uninitialised, for state that `load_state` brings next.
    `dtype` is the master weights', gradients' and Adam moments'; `compute_dtype` the working
    weights', activations' and boundary tensors' (default: `precision.compute_dtype_for`).
    """

    def __init__(self, shape: ModelShape, plan: Plan, rank: int, *, seed: int = 0,
                 optim: OptimConfig = OptimConfig(), device: torch.device | None = None,
                 clock: DeviceClock | None = None, dtype: torch.dtype = torch.float32,
                 compute_dtype: torch.dtype | None = None, init: bool = True,
                 transport: Callable[[PipelinePeers, torch.device, torch.dtype], StageTransport] = P2PTransport):
        validate_plan_for_model(shape, plan)
        _check_rank(plan, rank)
        self.shape, self.plan, self.rank, self.optim = shape, plan, rank, optim
        self.device = device or (torch.device("cuda", torch.cuda.current_device())
                                 if torch.cuda.is_available() else torch.device("cpu"))
        self.clock = clock or make_clock(self.device.type == "cuda")
        self.clock.read()    # a worker's clock outlives its engines: from here on, this engine's ops only
        self.groups = Groups(plan, rank, tied=shape.tie_embeddings)
        self.groups.tp.clock = self.clock     # TP collectives are not the device's own compute
        self.role = self.groups.role
        stage = plan.pipelines[self.role.pipeline].stages[self.role.stage]
        self.num_stages = len(plan.pipelines[self.role.pipeline].stages)
        self.model = build_stage_model(shape, self.role.layers, has_embedding=self.role.is_first,
                                       has_head=self.role.is_last, tp=self.groups.tp, device=self.device,
                                       seed=seed if init else None,
                                       recompute=stage.recompute).to(dtype=dtype)
        if optim.compiles_on(self.device):
            compile_blocks(self.model)
        self.params: dict[str, torch.nn.Parameter] = dict(self.model.named_parameters())
        self.optimizer = optim.make(self.params, tied=shape.tie_embeddings)
        self.working = WorkingWeights(self.params, compute_dtype or compute_dtype_for(self.device, dtype))
        self.grad_sync = (ShardedGradientSync(self.groups, self.params, shape, self.optimizer, working=self.working)
                          if optim.shard_optimizer else GradientSync(self.groups, self.params, shape, self.optimizer))
        self.transport = transport(self.groups.peers, self.device, self.working.dtype)
        self._update_pending = False
        self._update_bytes = 0.0          # of the updates the clock has timed since its last read

    # ------------------------------------------------------------------ one step
    def train_step(self, micro_batches: list[MicroBatch], loss_tokens: int, *, apply: bool = True,
                   lr: float | None = None) -> StepStats:
        """Forward and backward over the micro-batches (1F1B), the gradient reductions, clipping, and
        (with `apply`) the optimizer update at `lr` (None: the peak). `apply=False` leaves the
        update pending until `apply_update()`: a worker group applies it only once every device has
        finished the step, so a device lost inside a collective cannot leave the survivors at
        different steps."""
        # The plan's count is the fixed assignment's; a length-aware one may use more or fewer micro-
        # batches per step (every rank of the pipeline gets the same list), but never none.
        if not micro_batches:
            raise ValueError(f"pipeline {self.role.pipeline} got no micro-batches (plan {self.plan.plan_id}): "
                             "every pipeline takes part in the gradient reduction")
        if loss_tokens < 1:
            raise ValueError(f"loss_tokens must count the global batch's loss tokens (>= 1), got {loss_tokens}")
        wall0 = time.perf_counter()
        self.transport.comm_seconds = self.groups.tp.comm_seconds = 0.0
        # no clock read here: on CUDA it would wait for the last update; this step's read at its end
        # takes that update's time (and an evaluation's) under their own kinds, not "compute"
        self._flops, self._block_ops = 0.0, 0
        self._last_micro = len(micro_batches) - 1
        self._loss = torch.zeros((), dtype=torch.float64, device=self.device)
        self._inflight: dict[int, tuple[torch.Tensor, torch.Tensor, float]] = {}
        self._update_pending = False      # an update never applied is dropped with its gradients
        self.grad_sync.reset()
        self.optimizer.zero_grad()
        for p in self.params.values():  # every parameter gets a gradient buffer, even if unused
            if p.grad is None:
                p.grad = torch.zeros_like(p)

        self._run_program(micro_batches, loss_tokens)
        self.transport.finish()

        comm0 = time.perf_counter()
        self.grad_sync.reduce()
        local_loss = self._loss if (self.role.is_last and self.role.tp_rank == 0) else torch.zeros_like(self._loss)
        totals = torch.stack([self.grad_sync.local_square_norm(), local_loss])
        if self.groups.active is not None:
            dist.all_reduce(totals, group=self.groups.active)
        comm = time.perf_counter() - comm0
        self._clip(totals[0].sqrt())
        self._update_pending = True
        if apply:
            self.apply_update(lr)
        # the step's one read of the device, once all of it is enqueued
        square_norm, global_loss, loss = torch.stack([totals[0], totals[1], self._loss]).cpu().tolist()
        device, update_bytes, self._update_bytes = self.clock.read(), self._update_bytes, 0.0

        return StepStats(
            loss=loss if self.role.is_last else 0.0,
            loss_tokens=sum(mb.num_loss_tokens for mb in micro_batches),
            grad_norm=math.sqrt(square_norm),
            compute_seconds=device.get("compute", 0.0),
            update_seconds=device.get("update", 0.0),
            update_bytes=update_bytes,
            flops=self._flops,
            block_ops=self._block_ops,
            model_flops=3.0 * sum(self.model.forward_flops(mb.cu_seqlens, model_share=True)
                                  for mb in micro_batches),
            wall_seconds=time.perf_counter() - wall0,
            comm_seconds=comm + self.transport.comm_seconds + self.groups.tp.comm_seconds,
            global_loss=global_loss,
        )

    def apply_update(self, lr: float | None = None) -> float:
        """The optimizer step of the last `train_step(apply=False)` at `lr` (None: the peak); returns
        its seconds."""
        if not self._update_pending:
            raise RuntimeError(f"rank {self.rank}: no finished train_step whose update is pending")
        t0 = time.perf_counter()
        nbytes = self.grad_sync.update_bytes()
        self._update_bytes += nbytes
        with self.clock.op("update", nbytes=nbytes):
            self.grad_sync.step(lr)
        self.grad_sync.publish()
        self.working.refresh()
        self._update_pending = False
        return time.perf_counter() - t0

    def rehearse(self, tokens: int, repeats: int = 3) -> None:
        """This stage's forward, backward and update on synthetic micro-batches, through the clock
        and changing nothing: what the host spends on the ops, to choose a pace it can hold
        (`device_clock.fit_pace`). The stage at `tokens` and a quarter of it (how an op grows),
        then its first block alone at the quarter (what a stage of one block costs beyond its
        FLOPs). No pipeline transfers; a TP group's members must rehearse together."""
        g = torch.Generator().manual_seed(0)
        scratch = [torch.nn.Parameter(torch.randn(p.shape, generator=g).to(p)) for p in self.params.values()]
        for p in scratch:
            p.grad = torch.randn(p.shape, generator=g).to(p)
        update = self.optim.make(dict(zip(self.params, scratch)))
        nbytes = update_bytes(scratch)
        small = max(1, tokens // 4)
        runs = [(tokens, False), (small, False)]
        if len(self.model.blocks) > 1 and not self.working.mixed:   # the swap below needs the module's own weights
            runs.append((small, True))
        for size, one_block in dict.fromkeys(runs):
            cu_seqlens = torch.tensor([0, size], dtype=torch.int32)
            positions = torch.arange(size).to(self.device)
            with self.model.first_block_only() if one_block else contextlib.nullcontext():
                flops, blocks = self.model.forward_flops(cu_seqlens), len(self.model.blocks)
                rows = self.groups.tp.rows(size)     # a later stage takes this rank's rows of the tokens
                for _ in range(repeats):
                    x = (torch.randint(self.shape.vocab, (size,), generator=g).to(self.device) if self.role.is_first
                         else torch.randn(rows[1] - rows[0], self.shape.hidden, generator=g)
                         .to(self.device, self.working.dtype).requires_grad_(True))
                    with self.clock.op("rehearse-forward", flops=flops, blocks=blocks):
                        out = self.working(self.model, x, positions, cu_seqlens)
                    with self.clock.op("rehearse-backward", flops=2 * flops + self.model.recompute_flops(cu_seqlens),
                                       blocks=blocks):
                        out.float().sum().backward()
                    if not one_block:
                        with self.clock.op("rehearse-update", nbytes=nbytes):
                            update.step()
        self.clock.read()
        for p in self.params.values():
            p.grad = None

    @torch.no_grad()
    def eval_step(self, micro_batches: list[MicroBatch], loss_tokens: int) -> float:
        """The loss of the micro-batches on the weights as they are: forward only through the
        pipeline, no gradient, no update, no training state touched. Each pipeline's summed token
        cross-entropy over `loss_tokens`, summed over the pipelines: the same on every active device."""
        if loss_tokens < 1:
            raise ValueError(f"loss_tokens must count the evaluated batch's loss tokens (>= 1), got {loss_tokens}")
        self._loss = torch.zeros((), dtype=torch.float64, device=self.device)
        self._run_program(micro_batches, loss_tokens, train=False)
        self.transport.finish()
        loss = self._loss if (self.role.is_last and self.role.tp_rank == 0) else torch.zeros_like(self._loss)
        if self.groups.active is not None:
            dist.all_reduce(loss, group=self.groups.active)
        return float(loss)

    def _run_program(self, micro_batches: list[MicroBatch], loss_tokens: int, train: bool = True) -> None:
        """The stage's computations with its posts between them (schedule.stage_program; forward
        only unless `train`): each post sends what the previous computation produced and receives
        what the next one needs."""
        outgoing: dict[Transfer, torch.Tensor] = {}
        incoming: dict[Transfer, torch.Tensor] = {}
        for ins in stage_program(self.num_stages, self.role.stage, len(micro_batches), forward_only=not train):
            if isinstance(ins, Post):
                sends = {t: outgoing.pop(t) for t in ins.sends}
                # every boundary tensor, either way, is one row of hidden per token of its micro-batch,
                # of which this device sends and receives its rows (sequence parallelism)
                shapes = {t: (micro_batches[t.micro].num_tokens, self.shape.hidden) for t in ins.transfers}
                incoming.update(self.transport.post(ins, sends, shapes))
            elif ins.kind == "F":
                x = incoming.pop(Transfer("recv", "activation", ins.micro), None)
                forward = self._forward if train else self._evaluate
                out = forward(ins.micro, micro_batches[ins.micro], loss_tokens, x)
                if not self.role.is_last:
                    outgoing[Transfer("send", "activation", ins.micro)] = out
            else:
                g = incoming.pop(Transfer("recv", "gradient", ins.micro), None)
                dx = self._backward(ins.micro, g)
                if not self.role.is_first:
                    outgoing[Transfer("send", "gradient", ins.micro)] = dx

    def _forward(self, i: int, mb: MicroBatch, loss_tokens: int, received: torch.Tensor | None) -> torch.Tensor:
        """Forward of micro-batch i on the received activation (the tokens on the first stage)."""
        positions = to_device(mb.positions(), self.device)
        x = received.requires_grad_(True) if received is not None else to_device(mb.tokens, self.device)
        flops = self.model.forward_flops(mb.cu_seqlens)
        blocks = len(self.model.blocks)
        with self.clock.op("compute", flops=flops, blocks=blocks):
            out = self._stage_forward(mb, loss_tokens, x, positions)
        self._flops += flops
        self._block_ops += blocks
        self._inflight[i] = (x, out, 2 * flops + self.model.recompute_flops(mb.cu_seqlens))
        return out

    def _evaluate(self, i: int, mb: MicroBatch, loss_tokens: int, received: torch.Tensor | None) -> torch.Tensor:
        """Forward of micro-batch i for an evaluation (device time the next step reads as "eval", apart)."""
        positions = to_device(mb.positions(), self.device)
        x = received if received is not None else to_device(mb.tokens, self.device)
        with self.clock.op("eval", flops=self.model.forward_flops(mb.cu_seqlens), blocks=len(self.model.blocks)):
            return self._stage_forward(mb, loss_tokens, x, positions)

    def _stage_forward(self, mb: MicroBatch, loss_tokens: int, x: torch.Tensor, positions: torch.Tensor
                       ) -> torch.Tensor:
        """The stage's output on input x: the boundary activation, or on the last stage the loss
        (added to the step's), summed over tokens and divided by the GLOBAL count, so that it sums
        to the global mean (Malleus fault 7)."""
        targets = to_device(mb.targets, self.device) if self.role.is_last else None
        out = self.working(self.model, x, positions, mb.cu_seqlens, targets)
        if self.role.is_last:
            out = out / loss_tokens
            self._loss += out.detach().double()
        return out

    def _backward(self, i: int, received: torch.Tensor | None) -> torch.Tensor | None:
        """Backward of micro-batch i from the received output gradient (the loss on the last stage);
        returns the input's gradient (None on the first stage)."""
        x, out, flops = self._inflight.pop(i)
        grad = received.to(out.dtype) if received is not None else None
        blocks = len(self.model.blocks)
        if i == self._last_micro and self.optim.overlap_grad_reduce:
            self.grad_sync.arm()      # the gradients become final in this backward: reduce them behind it
        with self.clock.op("compute", flops=flops, blocks=blocks):   # twice the forward's, and a recompute's
            torch.autograd.backward(out, grad)
        self._flops += flops
        self._block_ops += blocks
        return x.grad

    def _clip(self, grad_norm: torch.Tensor) -> None:
        clip = self.optim.grad_clip
        if clip is None or clip <= 0:
            return
        # the same rule as torch.nn.utils.clip_grad_norm_, on the device: the host reads nothing
        grads = self.grad_sync.grads()
        coef = (clip / (grad_norm + 1e-6)).clamp(max=1.0).to(grads[0].dtype)   # the masters' one dtype
        torch._foreach_mul_(grads, coef)

    # ------------------------------------------------------------------ state in and out
    def _shard_bounds(self, name: str) -> tuple[int | None, int, int, tuple[int, ...]]:
        spec = tensor_spec(self.shape, name)
        return (spec.split_dim, *spec.held_rows(self.groups.tp.rank, self.groups.tp.size), spec.shape)

    def export_state(self, copy: bool = True) -> dict[str, ShardState]:
        """Every tensor this device holds, with its Adam moments: CPU copies, or with `copy=False`
        the live tensors where they are (for a migration, which reads them before the engine goes).
        With the optimizer sharded, every active device exports at once (the moments are gathered)."""
        def take(t: torch.Tensor) -> torch.Tensor:
            return t.detach().cpu().clone() if copy else t.detach()

        out = {}
        for name, (param, exp_avg, exp_avg_sq, step) in self.grad_sync.state().items():
            dim, start, end, full = self._shard_bounds(name)
            out[name] = ShardState(dim, start, end, take(param), take(exp_avg), take(exp_avg_sq), step, full)
        return out

    def load_pretrained(self, folder: str) -> None:
        """This device's shards of a Hugging Face LLaMA folder's weights, read from the files row
        range by row range; Adam starts fresh (step 0)."""
        from malleus_svc.runtime.pretrained import read_rows, weight_files

        where, states = weight_files(Path(folder)), {}
        for name in self.params:
            dim, start, end, full = self._shard_bounds(name)
            t = read_rows(folder, self.shape, name, (start, end), where)
            states[name] = ShardState(dim, start, end, t, torch.zeros_like(t), torch.zeros_like(t), 0, full)
        self.load_state(states)

    def load_checkpoint(self, reader) -> None:
        """This device's shards out of a checkpoint's shard files (a `shard_files.ShardReader`): only
        its own rows are read, one tensor at a time."""
        self.load_state(reader.states({name: self._shard_bounds(name)[1:3] for name in self.params}))

    def load_state(self, states: Mapping[str, ShardState]) -> None:
        """Take this device's shards out of `states` (each may cover more than the shard, e.g. the full tensor)."""
        missing = [n for n in self.params if n not in states]
        if missing:
            raise ValueError(f"rank {self.rank}: no state given for {missing}")
        cut_states = {}
        for name in self.params:
            dim, start, end, full = self._shard_bounds(name)
            st = states[name]
            if tuple(st.full_shape) != full:
                raise ValueError(f"{name}: state is of a tensor of shape {tuple(st.full_shape)}, the model's is {full}")
            if st.dim != dim or not (st.start <= start and end <= st.end):
                raise ValueError(f"{name}: state covers rows [{st.start}, {st.end}) of dim {st.dim}, "
                                 f"rank {self.rank} needs [{start}, {end}) of dim {dim}")

            def cut(t: torch.Tensor) -> torch.Tensor:
                return t if dim is None else t.narrow(dim, start - st.start, end - start)

            cut_states[name] = (cut(st.param), cut(st.exp_avg), cut(st.exp_avg_sq), st.step)
        self.grad_sync.load(cut_states)
        self.working.refresh()

    def export_owned(self) -> list[RunState]:
        """With the optimizer sharded: the state this device alone holds, the live tensors, as
        `state_owners.owned_runs` names them (a migration's source). No communication."""
        return self._sharded().owned()

    def load_owned(self, states: Mapping[str, list[RunState]]) -> None:
        """With the optimizer sharded: take this device's runs out of `states` (by tensor name); every
        device of the plan calls it at once (the chunks are all-gathered into the weights)."""
        self._sharded().load_owned(states)
        self.working.refresh()

    def _sharded(self) -> ShardedGradientSync:
        if not isinstance(self.grad_sync, ShardedGradientSync):
            raise ValueError(f"rank {self.rank}: the optimizer is not sharded: its state is exported whole")
        return self.grad_sync


def full_shard_states(full: Mapping[str, torch.Tensor]) -> dict[str, ShardState]:
    """Whole tensors (as assemble_full or reference_train give them) as ShardStates that any
    device's `load_state` can cut its own shards from, e.g. to restore a checkpoint under a new plan."""
    out = {}
    for name, param in full.items():
        if ":" in name:
            continue
        dim = split_dim(name)
        step = int(full.get(name + STEP, torch.tensor(0)))
        zeros = torch.zeros_like(param)
        out[name] = ShardState(dim, 0, param.shape[0 if dim is None else dim], param,
                               full.get(name + EXP_AVG, zeros), full.get(name + EXP_AVG_SQ, zeros),
                               step, tuple(param.shape))
    return out


def assemble_full(exports: Iterable[Mapping[str, ShardState]]) -> dict[str, torch.Tensor]:
    """Rebuild full tensors from shards: ``name`` (parameter), ``name:exp_avg``, ``name:exp_avg_sq``,
    ``name:step``. Raises ValueError if copies of the same element disagree, shards disagree about
    the tensor's shape or step, or part of a tensor is missing."""
    by_name: dict[str, list[ShardState]] = {}
    for export in exports:
        for name, st in export.items():
            by_name.setdefault(name, []).append(st)
    out: dict[str, torch.Tensor] = {}
    for name, shards in sorted(by_name.items()):
        full = tuple(shards[0].full_shape)
        if any(tuple(s.full_shape) != full for s in shards):
            raise ValueError(f"{name}: shards disagree about the full shape")
        steps = {s.step for s in shards}
        if len(steps) > 1:
            raise ValueError(f"{name}: shards are at different optimizer steps {sorted(steps)}")
        rows = full[0] if shards[0].dim is None else full[shards[0].dim]
        covered = torch.zeros(rows, dtype=torch.bool)
        tensors = {key: torch.empty(full, dtype=shards[0].param.dtype) for key in ("", EXP_AVG, EXP_AVG_SQ)}
        for s in shards:
            dim = 0 if s.dim is None else s.dim
            new = ~covered[s.start:s.end]
            for key, src in (("", s.param), (EXP_AVG, s.exp_avg), (EXP_AVG_SQ, s.exp_avg_sq)):
                dst = tensors[key].narrow(dim, s.start, s.end - s.start)
                old_rows = (~new).nonzero().flatten()
                if len(old_rows) and not torch.equal(dst.index_select(dim, old_rows), src.index_select(dim, old_rows)):
                    raise ValueError(f"{name}{key}: copies of rows {old_rows.tolist()[:4]}... disagree between devices")
                dst.copy_(src)
            covered[s.start:s.end] = True
        if not bool(covered.all()):
            raise ValueError(f"{name}: rows {(~covered).nonzero().flatten().tolist()[:8]} are held by no device")
        for key, t in tensors.items():
            out[name + key] = t
        out[name + STEP] = torch.tensor(steps.pop())
    return out
