"""Deterministic sample order for the runtime: a seeded global sampler and per-plan slicing.

The sample stream
-----------------
Epoch ``e`` is a seeded permutation of ``range(num_samples)`` (a function of ``(seed, e)`` only).
Concatenating the epochs gives one infinite stream; `GlobalSampler.position` is an index into
that stream (a plain int: the whole sampler state, apart from the configuration, so it is
trivially checkpointable). A global batch of ``B`` samples is the next ``B`` samples of the
stream, whatever the batch sizes before it.

No sample is ever dropped: every epoch's samples are each used exactly once, and a batch that
reaches the end of an epoch takes the rest of it and continues with the start of the next one
(it may then hold a sample twice, once for each epoch). Epoch ``e`` is exactly the stream
positions ``[e * num_samples, (e + 1) * num_samples)``.

The global batch size may change between steps (a new plan may change it):
``next_global_batch(size)`` takes a batch of ``size`` and makes it the size from then on.

Held-out samples
----------------
`holdout_split` sets a seeded share of the samples apart for evaluation; a sampler given the
rest (`ids`) streams only those: its permutations are of them, its positions count them.

Per-plan slicing
----------------
`split_for_plan` hands pipeline ``i`` the contiguous slice ``plan.sample_slices()[i]`` of each
global batch, cut into micro-batches of ``plan.micro_batch_size`` (a fault of the Malleus authors' code:
a Megatron-style round-robin stride lets pipelines with different micro-batch counts drift apart
in the stream; contiguous slices of every global batch cannot).
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from malleus_svc.plan import Plan

SAMPLER_STATE_VERSION = 1


class DataError(ValueError):
    """Bad data configuration or a request the data layer cannot serve; the message says what."""


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise DataError(f"{name} must be an int >= {minimum}, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise DataError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


HOLDOUT_STREAM = 0x4E1D   # the holdout's random stream, apart from the epochs' (seed, epoch) streams


def holdout_split(num_samples: int, share: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(the samples to train on, the held-out ones), both sorted: round(share x num_samples) samples
    (at least one when share > 0) drawn by a function of (seed, share) only, never trained on."""
    num_samples = _check_int("num_samples", num_samples, 1)
    held = max(1, round(share * num_samples)) if share > 0 else 0
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, HOLDOUT_STREAM])))
    chosen = np.zeros(num_samples, dtype=bool)
    chosen[rng.permutation(num_samples)[:held]] = True
    return np.flatnonzero(~chosen), np.flatnonzero(chosen)


def tail_split(num_samples: int, held: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(the samples to train on, the held-out ones) where the last `held` samples are held out (a
    corpus's held-out files come after its training files), those in a seeded order, so a few
    evaluation batches sample every held-out file."""
    num_samples = _check_int("num_samples", num_samples, 1)
    if not 0 < held < num_samples:
        raise DataError(f"the held-out files give {held} of the corpus's {num_samples} samples: "
                        "some must be held out and some left to train on")
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, HOLDOUT_STREAM])))
    return np.arange(num_samples - held), num_samples - held + rng.permutation(held)


class GlobalSampler:
    """Seeded, per-epoch permutation of ``range(num_samples)`` (or of `ids`, the samples to train
    on), cut into global batches.

    ``position`` is the number of samples consumed since the start, counted in the stream of
    concatenated epochs; ``epoch == position // num_samples`` is the epoch the next sample of the
    stream belongs to.
    """

    def __init__(self, num_samples: int, global_batch: int, seed: int = 0, ids: Sequence[int] | None = None):
        self.ids = None if ids is None else np.asarray(ids, dtype=np.int64)
        if self.ids is not None and len(self.ids) != num_samples:
            raise DataError(f"num_samples {num_samples} must count the {len(self.ids)} ids given")
        self.num_samples = _check_int("num_samples", num_samples, 1)
        self.seed = _check_int("seed", seed, 0)
        self.global_batch = self._check_size(global_batch)
        self.position = 0
        self._perms: dict[int, np.ndarray] = {}

    # ------------------------------------------------------------------ stream
    @property
    def epoch(self) -> int:
        return self.position // self.num_samples

    def _check_size(self, size: Any) -> int:
        size = _check_int("global batch size", size, 1)
        if size > self.num_samples:
            raise DataError(f"global batch size {size} is larger than the dataset ({self.num_samples} samples); "
                            f"use a global batch of at most {self.num_samples}")
        return size

    def permutation(self, epoch: int) -> np.ndarray:
        """The sample order of `epoch` (read-only; a function of (seed, epoch) only)."""
        epoch = _check_int("epoch", epoch, 0)
        perm = self._perms.get(epoch)
        if perm is None:
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, epoch])))
            perm = rng.permutation(self.num_samples)
            if self.ids is not None:
                perm = self.ids[perm]
            perm.setflags(write=False)
            if len(self._perms) >= 3:  # keep the current epoch and a couple of neighbours (peek)
                self._perms.pop(max(self._perms, key=lambda e: (abs(e - epoch), e)))
            self._perms[epoch] = perm
        return perm

    def _take(self, position: int, size: int) -> list[int]:
        """The `size` samples of the stream from `position` on (across an epoch boundary if need be)."""
        out: list[int] = []
        while len(out) < size:
            epoch, offset = divmod(position + len(out), self.num_samples)
            out += self.permutation(epoch)[offset:offset + size - len(out)].tolist()
        return out

    def next_global_batch(self, size: int | None = None) -> list[int]:
        """Consume and return the next global batch.

        `size`: if given, the global batch size for this step and every later one (a new plan
        changed it); otherwise the current `global_batch`.
        """
        if size is not None:
            self.global_batch = self._check_size(size)
        batch = self._take(self.position, self.global_batch)
        self.position += self.global_batch
        return batch

    def peek(self, k: int = 0, size: int | None = None) -> list[int]:
        """The global batch `k` steps ahead (k=0: the next one), without consuming anything.

        Assumes every batch until then has `size` samples (default: the current `global_batch`).
        """
        k = _check_int("k", k, 0)
        size = self.global_batch if size is None else self._check_size(size)
        return self._take(self.position + k * size, size)

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, int]:
        return {"version": SAMPLER_STATE_VERSION, "position": self.position, "global_batch": self.global_batch,
                "seed": self.seed, "num_samples": self.num_samples}

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        if not isinstance(d, Mapping):
            raise DataError(f"sampler state must be a dict, got {type(d).__name__}")
        missing = [k for k in ("position", "global_batch", "seed", "num_samples") if k not in d]
        if missing:
            raise DataError(f"sampler state is missing {missing}; expected the keys of GlobalSampler.state_dict()")
        version = d.get("version", SAMPLER_STATE_VERSION)
        if version != SAMPLER_STATE_VERSION:
            raise DataError(f"sampler state version {version!r} is not supported (this build reads {SAMPLER_STATE_VERSION})")
        if d["num_samples"] != self.num_samples:
            raise DataError(f"sampler state is for a dataset of {d['num_samples']} samples, this sampler has "
                            f"{self.num_samples}; resuming would not visit every sample exactly once")
        if d["seed"] != self.seed:
            raise DataError(f"sampler state was saved with seed {d['seed']}, this sampler has seed {self.seed}; "
                            f"construct the sampler with the same seed to resume")
        position = _check_int("sampler state position", d["position"], 0)
        self.global_batch = self._check_size(d["global_batch"])
        self.position = position

    def __repr__(self) -> str:
        return (f"GlobalSampler(num_samples={self.num_samples}, global_batch={self.global_batch}, seed={self.seed}, "
                f"position={self.position}, epoch={self.epoch})")


def check_assignment(indices: Sequence[int], assignment: Sequence[Sequence[Sequence[int]]], plan: Plan) -> None:
    """A given assignment (per pipeline, per micro-batch, sample ids) must use every sample of the
    global batch exactly once and give every pipeline at least one micro-batch."""
    if len(assignment) != len(plan.pipelines):
        raise DataError(f"assignment has {len(assignment)} pipelines, plan {plan.plan_id} has {len(plan.pipelines)}")
    if any(not pipe or any(not mb for mb in pipe) for pipe in assignment):
        raise DataError("assignment has a pipeline without micro-batches or an empty micro-batch")
    used = sorted(int(i) for pipe in assignment for mb in pipe for i in mb)
    if used != sorted(int(i) for i in indices):
        raise DataError(f"assignment does not use the global batch's {len(indices)} samples exactly once "
                        f"({len(used)} used)")


def split_for_plan(indices: Sequence[int], plan: Plan) -> list[list[list[int]]]:
    """Per pipeline, per micro-batch, the sample indices of one global batch under `plan`.

    Pipeline ``i`` takes the contiguous slice ``plan.sample_slices()[i]`` of `indices`, cut into
    ``plan.pipelines[i].micro_batches`` micro-batches of ``plan.micro_batch_size`` samples.
    Concatenating the result over pipelines and micro-batches gives `indices` back, in order.
    """
    indices = [int(i) for i in indices]
    if len(indices) != plan.global_batch:
        raise DataError(f"global batch has {len(indices)} samples but plan {plan.plan_id} needs exactly "
                        f"{plan.global_batch} (micro_batch_size {plan.micro_batch_size} x "
                        f"{plan.num_micro_batches} micro-batches)")
    b = plan.micro_batch_size
    out = []
    for start, end in plan.sample_slices():
        out.append([indices[j:j + b] for j in range(start, end, b)])
    return out
