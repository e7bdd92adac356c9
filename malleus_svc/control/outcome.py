"""A job's final summary, kept on the cluster after the job and its coordinator are gone.

The driver (train.py) records it in the Ray cluster's internal key-value store: the GCS keeps it,
so it outlives the job and any node, and it reads the same from every machine that can join the
cluster. One record per job name, the newest run's; `malleus status` reads it (service/outcome.py).
"""
from __future__ import annotations

import json
import time

from .coordinator import NAMESPACE

PREFIX = "outcome:"


def record(summary: dict) -> None:
    """(in a process connected to the cluster) Keep `summary` (the coordinator's, plus what the
    driver knows) as the outcome of job summary["job"]."""
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(PREFIX + summary["job"], json.dumps({**summary, "ended": time.time()}, default=str),
                                 overwrite=True, namespace=NAMESPACE)


def recorded() -> dict[str, dict]:
    """Every recorded outcome on the connected cluster, by job name."""
    from ray.experimental import internal_kv

    out = {}
    for key in internal_kv._internal_kv_list(PREFIX, namespace=NAMESPACE):
        raw = internal_kv._internal_kv_get(key, namespace=NAMESPACE)
        if raw:
            rec = json.loads(raw)
            out[rec["job"]] = rec
    return out
