"""How NCCL must treat a failed or timed-out collective so that the survivors of a lost peer live.

torch's default for NCCL (TORCH_NCCL_ASYNC_ERROR_HANDLING=3) tears the whole process down when its
watchdog sees a collective fail or time out: every survivor of a lost peer would die with it, and
each recovery would fall back to the checkpoint. Recovery from replicas (cluster.WorkerGroup)
needs what gloo does by itself: the step raises at the timeout, the process stays up, and it leaves
the old world for a new one. So, before the process group exists (ProcessGroupNCCL reads it when
it is built):
  TORCH_NCCL_ASYNC_ERROR_HANDLING=2  torch's watchdog only aborts a failed communicator.
The step raises through the runtime's own watchdog (runtime/watchdog.py), which aborts the world's
communicators when a step's device makes no progress for the collective timeout. `wait()` stays non-blocking
(TORCH_NCCL_BLOCKING_WAIT unset): it orders streams, and the host runs ahead of the GPU.
torch's own NCCL watchdog times each collective from when the host enqueued it, and the host now
runs up to a step ahead: its timeout is a backstop, `NCCL_BACKSTOP` times the runtime's, so that a
long healthy step is never aborted by it (`group_timeout`).
A value the job sets itself in the workers' environment is kept, with a warning if it would take
the survivors down or hold the host on every collective. gloo reads none of these.
"""
from __future__ import annotations

import datetime
import logging
from typing import MutableMapping

log = logging.getLogger(__name__)

SURVIVABLE_NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
NCCL_BACKSTOP = 4
# Values the job may set that cost it: what each does, and what the runtime would rather have.
_TEARDOWN = "a lost peer will take the survivors down with it, so recovery falls back to the checkpoint (2 keeps them up)"
_COSTLY = {
    ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"): _TEARDOWN,
    ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3"): _TEARDOWN,
    ("TORCH_NCCL_BLOCKING_WAIT", "1"): "every collective and pipeline receive holds the host until the GPU has "
                                       "finished it, so the host cannot run ahead (unset it: the runtime's "
                                       "watchdog detects a lost peer without it)",
}


def prepare_collective_env(backend: str, environ: MutableMapping[str, str]) -> dict[str, str]:
    """Set the NCCL error handling survivors need in `environ` (os.environ) before the world is
    built; returns the NCCL settings now in force. A no-op for gloo."""
    if backend != "nccl":
        return {}
    for key, value in SURVIVABLE_NCCL_ENV.items():
        environ.setdefault(key, value)
    for (key, value), why in _COSTLY.items():
        if environ.get(key) == value:
            log.warning("%s=%s is set for the workers: %s", key, value, why)
    return {key: environ[key] for key in (*SURVIVABLE_NCCL_ENV, "TORCH_NCCL_BLOCKING_WAIT") if key in environ}


def group_timeout(backend: str, timeout: datetime.timedelta) -> datetime.timedelta:
    """The process groups' own collective timeout for a world whose runtime watchdog times out at
    `timeout`: gloo's collectives are the detection there (they raise at it); NCCL's a backstop."""
    return timeout * NCCL_BACKSTOP if backend == "nccl" else timeout
