"""The job's evaluation on held-out samples (`eval: {every, batches, holdout}`): which samples the
job trains on and which it holds out, when it evaluates, and the loss there, forward only through
the pipelines of the plan in force (`WorkerGroup.evaluate`). The training sampler never sees the
held-out samples and evaluating never moves it."""
from __future__ import annotations

from malleus_svc.config.job import EvalConfig


class Evaluation:
    def __init__(self, cfg: EvalConfig, seed: int):
        self.cfg, self.seed = cfg, seed
        self.batches: list[list[int]] = []        # the same global batches at every evaluation
        self.last: dict | None = None             # {step, loss} of the newest evaluation

    def sampler(self, num_samples: int, global_batch: int):
        """The sampler over the samples to train on; sets the evaluation's batches aside."""
        from malleus_svc.runtime.data import DataError, GlobalSampler, holdout_split

        train, held_out = holdout_split(num_samples, self.cfg.holdout, self.seed)
        if self.cfg.enabled:
            need = self.cfg.batches * global_batch
            if len(held_out) < need:
                raise DataError(f"eval needs {self.cfg.batches} global batches of {global_batch} held-out samples, "
                                f"eval.holdout {self.cfg.holdout:g} of the {num_samples} samples holds out "
                                f"{len(held_out)}; hold out more or evaluate fewer batches")
            self.batches = [held_out[i * global_batch:(i + 1) * global_batch].tolist()
                            for i in range(self.cfg.batches)]
        return GlobalSampler(len(train), global_batch, seed=self.seed, ids=train)

    def due(self, step: int) -> bool:
        """After every `every`-th update."""
        return self.cfg.enabled and (step + 1) % self.cfg.every == 0

    def run(self, group, step: int) -> float:
        """The loss on the held-out batches after update `step` (a WorkerGroupError if a device fails)."""
        loss = group.evaluate(self.batches)
        self.last = {"step": step, "loss": loss}
        return loss
