"""The job's checkpoints: one writer (a second would race the first's write in flight), the
newest good one to resume from, and saves whose failure never stops training."""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)

RECORDS_KEPT = 256   # metrics lines saved with each checkpoint


def first_plan(job, ckpt, initial, restarted: bool):
    """The plan a run starts under: a restarted coordinator's (or an unplanned job's) checkpoint's
    plan if it fits the job (any plan would do), else the given one, else the planner's."""
    from malleus_svc.runtime.trainer import check_plan_for_job, make_plan
    if ckpt is not None and (restarted or initial is None):
        try:
            return check_plan_for_job(ckpt.manifest.plan_obj(), job, f"{ckpt.path.name} plan")
        except Exception as e:
            log.warning("checkpoint plan does not fit the job (%s); planning afresh", e)
    return check_plan_for_job(initial, job) if initial else make_plan(job)


class JobCheckpoints:
    def __init__(self, cfg, shape):
        self.cfg, self.shape = cfg, shape
        self._writer = None

    @property
    def enabled(self) -> bool:
        return self.cfg.enabled

    def due(self, step: int) -> bool:
        return bool(self.cfg.every) and step % self.cfg.every == 0

    def writer(self):
        from malleus_svc.checkpoint import CheckpointWriter
        if self._writer is None:
            self._writer = CheckpointWriter(self.cfg.dir, keep_last=self.cfg.keep)
        return self._writer

    def last_written(self) -> dict | None:
        """The newest checkpoint this run wrote: {path, step}, or None."""
        results = self._writer.results if self._writer is not None else []
        return {"path": str(results[-1].path), "step": results[-1].step} if results else None

    def latest(self, on_error):
        """The newest checkpoint that verifies (None without checkpoints); damaged ones are skipped,
        a wrong model raises. `on_error(text)` hears of a failed last write."""
        if not self.enabled:
            return None
        from malleus_svc.checkpoint import CheckpointError, load_latest
        try:
            self.writer().wait()    # a recovery reads what the last save wrote, never half of it
        except CheckpointError as e:   # that save failed: the previous checkpoint is the good one
            on_error(f"the last checkpoint write failed: {e}")
        return load_latest(self.cfg.dir, self.shape)

    def save(self, group, sampler, step: int, extra: dict) -> str | None:
        """Gather (synchronous), write (in the background); the reason if it failed."""
        from malleus_svc.checkpoint import CheckpointError, save_group
        from malleus_svc.runtime.cluster import WorkerGroupError
        try:
            save_group(self.writer(), group, sampler, step, extra=extra)
        except CheckpointError as e:
            return f"checkpoint at step {step} failed: {e}"
        except WorkerGroupError as e:   # a worker lost while gathering: the next step fails and recovers
            return f"checkpoint at step {step} skipped: {str(e).splitlines()[0]}"
        return None

    def finish(self, group, sampler, step: int, extra: dict) -> str | None:
        """At the end: the final state too (so a later run resumes from the end), then wait for the writes."""
        if self._writer is None:
            return None
        err = self.save(group, sampler, step, extra) if self.cfg.every and step % self.cfg.every else None
        self._writer.wait()
        return err
