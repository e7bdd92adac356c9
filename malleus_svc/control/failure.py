"""What to do when devices fail or leave, and when to look for them again.

The mechanisms are the worker group's (WorkerGroup.recover replaces lost workers and rebuilds the
survivors' world, planning around devices gone for good; rejoin takes returning ones back); the
policy decides where the state comes from and when to look for returning devices."""
from __future__ import annotations

import time
from enum import Enum

from malleus_svc.config.job import ControlConfig

from .requests import MalleusError


class Restore(str, Enum):
    REPLICAS = "replicas"       # the survivors hold every slice: redo the step on the same batch
    CHECKPOINT = "checkpoint"   # rewind to the newest good checkpoint


class FailurePolicy:
    def __init__(self, rejoin_check_s: float = ControlConfig.rejoin_check_s):
        self.rejoin_check_s = float(rejoin_check_s)
        self._next_rejoin_check = 0.0

    def restore_from(self, report, has_checkpoint: bool, why: str | None) -> Restore:
        """After WorkerGroup.recover: from the replicas when they sufficed, else the checkpoint."""
        if report.source == "replicas":
            return Restore.REPLICAS
        if not has_checkpoint:
            raise MalleusError(f"devices {report.lost} were lost and the survivors cannot rebuild the model "
                               f"({why}); there is no checkpoint to restore it from "
                               "(set checkpoint.dir and checkpoint.every)")
        return Restore.CHECKPOINT

    @staticmethod
    def planned_around(report, old_plan_id: str) -> bool:
        """Devices gone for good: the group runs a plan without them now (a membership change)."""
        return report.plan_id != old_plan_id

    def rejoin_due(self, gone) -> bool:
        """While devices are gone, look for them every `rejoin_check_s` seconds."""
        if not gone or time.monotonic() < self._next_rejoin_check:
            return False
        self._next_rejoin_check = time.monotonic() + self.rejoin_check_s
        return True
