"""The job's evaluation on held-out samples (`eval: {every, batches, holdout}`): which samples the
job trains on and which it holds out (a seeded share, or the samples of held-out files, which
`JobConfig.dataset_spec` puts after the training files), when it evaluates, and the loss there,
forward only through the pipelines of the plan in force (`WorkerGroup.evaluate`). The training
sampler never sees the held-out samples and evaluating never moves it."""
from __future__ import annotations

from typing import Any, Mapping

from malleus_svc.config.job import EvalConfig


class Evaluation:
    def __init__(self, cfg: EvalConfig, seed: int, dataset_spec: Mapping[str, Any] | None = None):
        self.cfg, self.seed, self.spec = cfg, seed, dataset_spec
        self.batches: list[list[int]] = []        # the same global batches at every evaluation
        self.last: dict | None = None             # {step, loss} of the newest evaluation

    def sampler(self, num_samples: int, global_batch: int):
        """The sampler over the samples to train on; sets the evaluation's batches aside."""
        from malleus_svc.runtime.data import DataError, GlobalSampler, holdout_split, tail_split

        if self.cfg.files:
            train, held_out = tail_split(num_samples, self._held_out_file_samples(), self.seed)
            what = f"the held-out files give {len(held_out)}"
        else:
            train, held_out = holdout_split(num_samples, self.cfg.holdout, self.seed)
            what = f"eval.holdout {self.cfg.holdout:g} of the {num_samples} samples holds out {len(held_out)}"
        if self.cfg.enabled:
            need = self.cfg.batches * global_batch
            if len(held_out) < need:
                raise DataError(f"eval needs {self.cfg.batches} global batches of {global_batch} held-out samples, "
                                f"{what}; hold out more or evaluate fewer batches")
            self.batches = [held_out[i * global_batch:(i + 1) * global_batch].tolist()
                            for i in range(self.cfg.batches)]
        return GlobalSampler(len(train), global_batch, seed=self.seed, ids=train)

    def _held_out_file_samples(self) -> int:
        """The samples of the held-out files: the corpus's last files, opened here without a scan."""
        from malleus_svc.runtime.datasets import build_dataset

        if self.spec is None:
            raise ValueError("held-out files need the job's dataset spec (JobConfig.dataset_spec)")
        return len(build_dataset({**self.spec, "files": self.spec["files"][-len(self.cfg.files):]}, scan=False))

    def due(self, step: int) -> bool:
        """After every `every`-th update."""
        return self.cfg.enabled and (step + 1) % self.cfg.every == 0

    def run(self, group, step: int) -> float:
        """The loss on the held-out batches after update `step` (a WorkerGroupError if a device fails)."""
        loss = group.evaluate(self.batches)
        self.last = {"step": step, "loss": loss}
        return loss
