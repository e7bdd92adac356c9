"""Run a function on N local processes joined by a gloo process group (for the engine tests).

`runtime/local_world.py` does the work: each process uses one torch thread, joins the world
through 127.0.0.1 on a free port, runs ``fn(rank, world_size, *args)`` and hands back what it
returns.
"""
from __future__ import annotations

from typing import Any, Callable

from malleus_svc.runtime.local_world import run_local_world


def run_on_gloo(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """fn's return value on each rank, in rank order. `fn` must be a module-level function."""
    return run_local_world(fn, world_size, *args, backend="gloo")
