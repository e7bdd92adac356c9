"""The run as TensorBoard event files (`logging: {tensorboard: DIR}`), written by the job's driver
from the metrics lines and events it reads from the coordinator, through torch's `SummaryWriter`
(the `tensorboard` package's format): `tensorboard --logdir DIR` shows it."""
from __future__ import annotations

from typing import Any, Mapping

# metrics-line key -> TensorBoard tag
SCALARS = {"loss": "train/loss", "eval_loss": "eval/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
           "tokens_per_second": "throughput/tokens_per_second", "mfu": "throughput/mfu",
           "pace_held": "devices/pace_held"}
PLAN_EVENTS = ("applied", "kept", "failed", "resumed")


class TensorBoardLog:
    def __init__(self, log_dir: str):
        self.log_dir = log_dir
        self._writer = None

    def _open(self, first_step: int):
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            # A run resumed at step k supersedes what an earlier run wrote from k on.
            self._writer = SummaryWriter(self.log_dir, purge_step=first_step or None)
        return self._writer

    def line(self, line: Mapping[str, Any]) -> None:
        """One step's metrics line: its scalars, and the straggling rate of every device."""
        step = line["step"]
        w = self._open(step)
        for key, tag in SCALARS.items():
            if line.get(key) is not None:
                w.add_scalar(tag, line[key], step)
        for device, rate in (line.get("rates") or {}).items():
            w.add_scalar(f"rates/device_{device}", rate, step)

    def event(self, ev: Mapping[str, Any]) -> None:
        """A coordinator event: plan changes and re-plan rounds as text, at their step."""
        if ev["kind"] in PLAN_EVENTS:
            self._open(ev["step"]).add_text("plans", f"{ev['kind']}: {ev['text']}", ev["step"])

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
