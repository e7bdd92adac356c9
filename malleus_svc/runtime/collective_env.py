"""How NCCL must treat a failed or timed-out collective so that the survivors of a lost peer live.

torch's default for NCCL (TORCH_NCCL_ASYNC_ERROR_HANDLING=3) tears the whole process down when its
watchdog sees a collective fail or time out: every survivor of a lost peer would die with it, and
each recovery would fall back to the checkpoint. Recovery from replicas (cluster.WorkerGroup)
needs what gloo does by itself: the collective raises in the calling thread at the timeout, the
process stays up, and it leaves the old world for a new one. So, before the process group exists
(ProcessGroupNCCL reads these when it is built):
  TORCH_NCCL_ASYNC_ERROR_HANDLING=2  the watchdog aborts the failed communicator, nothing more;
  TORCH_NCCL_BLOCKING_WAIT=1         `wait()` blocks and raises at the group's timeout.
A value the job sets itself in the workers' environment is kept, with a warning if it would take
the survivors down. gloo reads none of these.
"""
from __future__ import annotations

import logging
from typing import MutableMapping

log = logging.getLogger(__name__)

SURVIVABLE_NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_BLOCKING_WAIT": "1"}
# Values under which a failed collective takes the process with it (or never raises).
_FATAL = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": {"1", "3"}, "TORCH_NCCL_BLOCKING_WAIT": {"0"}}


def prepare_collective_env(backend: str, environ: MutableMapping[str, str]) -> dict[str, str]:
    """Set the NCCL error handling survivors need in `environ` (os.environ) before the world is
    built; returns what is now in force. A no-op for gloo."""
    if backend != "nccl":
        return {}
    for key, value in SURVIVABLE_NCCL_ENV.items():
        have = environ.setdefault(key, value)
        if have in _FATAL[key]:
            log.warning("%s=%s is set for the workers: a lost peer will take the survivors down with it, "
                        "so recovery falls back to the checkpoint (%s keeps them up)", key, have, value)
    return {key: environ[key] for key in SURVIVABLE_NCCL_ENV}
