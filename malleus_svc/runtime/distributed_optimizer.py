"""The distributed optimizer (ZeRO-1): the optimizer's state of each piece split among the pipelines
holding it: Adam's moments, and the fp32 masters where a working copy computes (mixed precision).

Megatron's distributed optimizer, over this runtime's reduction groups (gradient_sync.py): every
piece that several pipelines hold is reduced in buckets, and each bucket is cut into as many equal
chunks as its group has members, the member of group rank k owning chunk k (the last padded with
zeros). A step then:
  * reduce-scatters each bucket, so a member receives the summed gradient of its own chunk only;
  * counts its own chunks in the global norm (each element once) and clips them;
  * updates its own chunk of the fp32 masters with the chunk's Adam moments, which only it holds;
  * all-gathers the updated chunks into every member's weights (`publish`): the parameters, or with
    a working copy, that copy, whose other masters are freed after the first update; then copies a
    tied weight's update into its second copy.
What no other pipeline holds (a piece of one pipeline) is updated where it lies, as without sharding.
The update is elementwise, so it equals the replicated one up to the order of the gradient sums.

A chunk's moments (and shed masters) exist on one device only. A checkpoint's export gathers them
among the members (`state`), so a checkpoint stays plan-agnostic. A migration does not: each
device gives the runs it owns (`owned`, named as `state_owners` derives them from the plan alone),
each element goes to its owner under the next plan, and the new engines all-gather their chunks
into their weights (`load_owned`). A device lost takes its chunks with it, and the job restores a
checkpoint.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Iterator, Mapping

import torch
import torch.distributed as dist

from malleus_svc.config.presets import ModelShape
from malleus_svc.geometry import tensor_spec
from malleus_svc.runtime.gradient_sync import (GRAD_BUCKET_BYTES, Bucket, GradientSync, Item, TensorState, narrow,
                                               unflatten)
from malleus_svc.runtime.groups import Groups
from malleus_svc.runtime.optimizer import AdamW, update_bytes
from malleus_svc.runtime.precision import WorkingWeights
from malleus_svc.runtime.state_owners import Run, RunState, chunk_of, chunk_run, find, overlaps, unshared_run


@dataclass
class _Chunked(Bucket):
    """A bucket cut in equal chunks, one per member; this device owns elements [lo, hi). Items lie in
    the bucket axis-major (`state_owners`), so a chunk is a range of each tensor's rows whatever the
    TP degree, and a migration can move it as such."""
    chunk: int = 0                        # elements per member: the bucket padded to members x chunk
    lo: int = 0
    hi: int = 0
    runs: list[tuple[int, int, bool]] = field(default_factory=list)   # [a, e) of the own chunk, decayed?
    grad: torch.Tensor | None = None      # the own chunk's reduced gradient, from reduce to step
    master: torch.Tensor | None = None    # the own chunk's fp32 master weights, from the first step on
    moments: tuple[torch.Tensor, ...] = ()                            # exp_avg, exp_avg_sq of the own chunk
    states: list[dict[str, torch.Tensor]] = field(default_factory=list)   # Adam's, one per run (views of those)

    @property
    def padded(self) -> int:
        return self.chunk * dist.get_world_size(self.group)

    def overlaps(self) -> Iterator[tuple[Item, int, int, int]]:
        """(item, a, e, start): elements [a, e) of the own chunk are the item's from flat index `start`."""
        return overlaps(self.items, self.sizes, self.lo, self.hi)

    def own(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The own chunk's elements of `tensors` (by name, each shaped like its parameter), padded."""
        out = next(iter(tensors.values())).new_zeros(self.chunk)
        for item, a, e, start in self.overlaps():
            out[a:e] = axis_major(tensors[item[0]], item).reshape(-1)[start:start + e - a]
        return out

    def flatten(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The whole bucket of `tensors` (by name), padded: what the reduce-scatter reads."""
        flat = next(iter(tensors.values())).new_empty(self.padded)
        offset = 0
        for item, n in zip(self.items, self.sizes):
            view = axis_major(tensors[item[0]], item)
            flat[offset:offset + n].view(view.shape).copy_(view)
            offset += n
        flat[offset:].zero_()
        return flat

    def gather_into(self, own: torch.Tensor, tensors: Mapping[str, torch.Tensor]) -> None:
        """Every member's chunk of `own`'s kind, all-gathered into `tensors` (by name)."""
        flat = own.new_empty(self.padded)
        dist.all_gather_single(flat, own, group=self.group)
        unflatten(flat, [axis_major(tensors[item[0]], item) for item in self.items])


def axis_major(t: torch.Tensor, item: Item) -> torch.Tensor:
    """The item's rows of `t` with their axis first (a view)."""
    view = narrow(t, item)
    return view if not item[1] else view.movedim(item[1], 0)


class ShardedGradientSync(GradientSync):
    """GradientSync whose pieces held by several pipelines are reduce-scattered and updated by chunk."""

    def __init__(self, groups: Groups, params: Mapping[str, torch.nn.Parameter], shape: ModelShape,
                 optimizer: AdamW, bucket_bytes: int = GRAD_BUCKET_BYTES, working: WorkingWeights | None = None):
        super().__init__(groups, params, shape, optimizer, bucket_bytes)
        self.working = working if working is not None and working.mixed else None
        self.steps = 0                                # updates of the chunks (all of them at once)
        bucketed = {it for items in self.buckets.values() for it in items}
        self.local_norm_items = [it for it in self.norm_items if it not in bucketed]
        # updated here whole: what no bucket reduces (a tied weight held twice, both copies); the rest
        # is updated by chunk, elsewhere but for the own chunk
        local = set(self.layout.unshared)
        if self.tied_names and self.tied_names[0] in local:
            local |= set(self.tied_names)
        self.local = {name: p for name, p in params.items() if name in local}
        self.elsewhere = sorted(name for name in params if name not in local)
        self.weights = {name: p.detach() for name, p in params.items()}

    @property
    def chunked(self) -> list[_Chunked]:
        return self.launch_order

    def _bucket(self, key: tuple[int, ...], index: int, items: list[Item]) -> _Chunked:
        base = super()._bucket(key, index, items)
        # its group rank (world ranks follow device ids), read without torch: a device whose world
        # was aborted still names its chunks
        chunk, lo, hi = chunk_of(sum(base.sizes), len(key), key.index(self.rank))
        b = _Chunked(**{f.name: getattr(base, f.name) for f in fields(Bucket)}, chunk=chunk, lo=lo, hi=hi)
        for item, a, e, _ in b.overlaps():     # runs of one weight-decay rule: one Adam tensor each
            decays = self.optimizer.decays(self.params[item[0]])
            if b.runs and b.runs[-1][1] == a and b.runs[-1][2] == decays:
                b.runs[-1] = (b.runs[-1][0], e, decays)
            else:
                b.runs.append((a, e, decays))
        return b

    # ------------------------------------------------------------------ the step
    def _launch(self, b: _Chunked) -> None:
        """Start the bucket's reduce-scatter: this device receives its own chunk's sum."""
        self._fold_tied(b)
        b.flat = b.flatten({name: self.params[name].grad for name in b.names})
        b.grad = b.flat.new_empty(b.chunk)
        b.work = dist.reduce_scatter_single(b.grad, b.flat, group=b.group, async_op=True)

    def _finish(self, b: _Chunked) -> None:
        b.work.wait()
        b.work = b.flat = None

    def local_square_norm(self) -> torch.Tensor:
        views = [self._view(item) for item in self.local_norm_items] + [b.grad for b in self.chunked]
        if not views:
            return torch.zeros((), dtype=torch.float64, device=next(iter(self.params.values())).device)
        return torch.stack(torch._foreach_norm(views, 2, dtype=torch.float64)).square().sum()

    def grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.local.values()] + [b.grad for b in self.chunked]

    def update_bytes(self) -> float:
        return update_bytes([*self.local.values(), *(b.grad for b in self.chunked if b.grad is not None)])

    @torch.no_grad()
    def step(self, lr: float | None) -> None:
        self.optimizer.step(lr, self.local.values())
        for b in self.chunked:
            if not b.moments:
                self._set_moments(b, tuple(b.grad.new_zeros(b.chunk) for _ in range(2)))
            if b.master is None:
                b.master = b.own(self.weights)
            self.optimizer.update([b.master[a:e] for a, e, _ in b.runs], [b.grad[a:e] for a, e, _ in b.runs],
                                  b.states, [d for *_, d in b.runs], lr)
            b.grad = None
        self.steps += 1
        if self.working is not None and not self.working.external:
            self._shed_masters()

    def _set_moments(self, b: _Chunked, moments: tuple[torch.Tensor, torch.Tensor]) -> None:
        b.moments = moments
        b.states = [{"step": torch.tensor(float(self.steps)), "exp_avg": moments[0][a:e],
                     "exp_avg_sq": moments[1][a:e]} for a, e, _ in b.runs]

    def _shed_masters(self) -> None:
        """With a working copy to compute on, the full fp32 masters of what is updated elsewhere are
        not needed: their storage goes (the parameters stay, shapes and gradients whole), and the
        working copy takes the gathered chunks instead of a refresh."""
        for name in self.elsewhere:
            self.params[name].untyped_storage().resize_(0)
        self.working.external = set(self.elsewhere)

    def _restore_masters(self) -> None:
        """Whole masters again (a load writes them): the chunks are cut from them at the next step."""
        if self.working is not None and self.working.external:
            for name in self.elsewhere:
                p = self.params[name]
                p.untyped_storage().resize_(p.numel() * p.element_size())
            self.working.external = set()
        for b in self.chunked:
            b.master = None

    @property
    def _targets(self) -> dict[str, torch.Tensor]:
        """Where updated weights go: the working copy once the masters are shed, else the masters."""
        if self.working is not None and self.working.external:
            return self.working.tensors
        return self.weights

    @torch.no_grad()
    def publish(self) -> None:
        """Every member's updated chunks into every member's weights, then a tied weight into its
        second copy."""
        targets = self._targets
        for b in self.chunked:
            b.gather_into(b.master, targets)
        if len(self.tied_names) == 2:
            targets[self.tied_names[1]].copy_(targets[self.tied_names[0]])

    # ------------------------------------------------------------------ state in and out
    @torch.no_grad()
    def state(self) -> dict[str, TensorState]:
        """As GradientSync's, with the chunks' moments (and shed masters) gathered whole: every active
        device calls this at once."""
        out = super().state()
        shed = self.working is not None and bool(self.working.external)
        kinds = ([0] if shed else []) + ([1, 2] if self.steps else [])
        for which in kinds:      # 0: the masters, 1 and 2: the moments
            full = {name: torch.zeros_like(self.params[name]) for name in self.elsewhere}
            for b in self.chunked:
                b.gather_into(b.master if which == 0 else b.moments[which - 1], full)
            if len(self.tied_names) == 2 and self.tied_names[1] in full:
                full[self.tied_names[1]] = full[self.tied_names[0]]
            for name, t in full.items():
                entry = list(out[name])
                entry[which], entry[3] = t, self.steps
                out[name] = tuple(entry)
        return out

    @torch.no_grad()
    def load(self, states: Mapping[str, TensorState]) -> None:
        self._restore_masters()
        super().load({name: st for name, st in states.items() if name in self.local})
        for name in self.elsewhere:
            self.params[name].copy_(states[name][0].to(self.params[name].device))
        steps = {st[3] for name, st in states.items() if name in self.elsewhere}
        if len(steps) > 1:
            raise ValueError(f"rank {self.rank}: the state's tensors are at different steps {sorted(steps)}")
        self.steps = steps.pop() if steps else 0
        for b in self.chunked:
            b.moments, b.states = (), []
            if self.steps:
                self._set_moments(b, tuple(b.own({name: st[which].to(self.weights[name]) for name, st in states.items()})
                                           for which in (1, 2)))

    # ------------------------------------------------------------------ owned state (a migration's)
    def _unshared_run(self, name: str) -> tuple[Run, int]:
        """The run of an unshared tensor (all this device holds of it), and its axis."""
        run = unshared_run(self.shape, self.layout, name, self.groups.tp.rank, self.groups.tp.size)
        return run, tensor_spec(self.shape, name).axis

    @torch.no_grad()
    def owned(self) -> list[RunState]:
        """The state this device alone holds, as `state_owners.owned_runs` names it: its chunks and
        its unshared tensors (viewed axis-major), the live tensors, copied by nothing. No
        communication: a device can give it with its peers lost."""
        out = []
        for b in self.chunked:
            master = b.master if b.master is not None else b.own(self.weights)
            moments = b.moments or (torch.zeros_like(master), torch.zeros_like(master))
            for item, a, e, start in b.overlaps():
                out.append(RunState(chunk_run(self.shape, self.layout, item, a, e, start),
                                    (master[a:e], moments[0][a:e], moments[1][a:e]), self.steps))
        for name in self.layout.unshared:
            p = self.params[name]
            run, axis = self._unshared_run(name)
            st = self.optimizer.state.get(p)
            tensors = (p, st["exp_avg"], st["exp_avg_sq"]) if st else (p, torch.zeros_like(p), torch.zeros_like(p))
            out.append(RunState(run, tuple(t.detach().movedim(axis, 0) for t in tensors), int(st["step"]) if st else 0))
        return out

    @torch.no_grad()
    def load_owned(self, states: Mapping[str, list[RunState]]) -> None:
        """Take the runs this device owns out of `states` (by tensor), then all-gather every member's
        chunks into the weights (`publish`): every device of the plan calls this at once."""
        self._restore_masters()
        steps, cut = set(), {}
        for b in self.chunked:
            own = [next(iter(self.weights.values())).new_zeros(b.chunk) for _ in range(3)]
            for item, a, e, start in b.overlaps():
                tensors, step = find(states, chunk_run(self.shape, self.layout, item, a, e, start))
                for dst, src in zip(own, tensors):
                    dst[a:e] = src
                steps.add(step)
            cut[id(b)] = own
        for name in self.layout.unshared:
            p = self.params[name]
            run, axis = self._unshared_run(name)
            tensors, step = find(states, run)
            whole = [t.reshape(p.movedim(axis, 0).shape).movedim(0, axis).to(p) for t in tensors]
            copies = [n for n in self.tied_names if n in self.local] if name in self.tied_names else [name]
            super().load({n: (*whole, step) for n in copies})     # a tied weight held twice: both copies
            steps.add(step)
        if len(steps) > 1:
            raise ValueError(f"rank {self.rank}: the state's runs are at different steps {sorted(steps)}")
        self.steps = steps.pop() if steps else 0
        for b in self.chunked:
            master, m, v = cut[id(b)]
            b.master, b.moments, b.states = master, (), []
            if self.steps:
                self._set_moments(b, (m, v))
        self.publish()
