"""Run a function on N local processes joined by a gloo process group (for the engine tests).

Each process uses one torch thread (the test machine has few cores), initialises
torch.distributed through a TCP store on a free local port, runs ``fn(rank, world_size, *args)``
and hands back what it returns (via torch.save).
"""
from __future__ import annotations

import gc
import os
import socket
import tempfile
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from malleus_svc.runtime.groups import prepare_world


def _worker(rank: int, world_size: int, init_method: str, out_dir: str, fn: Callable, args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    prepare_world()   # as a worker does right after joining its world
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"{rank}.pt"))
        del result
    finally:
        # free what fn left in reference cycles (a DDP module and its reducer) while its process
        # group is still up: freed at interpreter exit instead, after the group, it can abort
        gc.collect()
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_on_gloo(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """fn's return value on each rank, in rank order. `fn` must be a module-level function."""
    with tempfile.TemporaryDirectory() as tmp:
        store, out = f"tcp://127.0.0.1:{_free_port()}", os.path.join(tmp, "out")
        os.mkdir(out)
        mp.spawn(_worker, args=(world_size, store, out, fn, args), nprocs=world_size, join=True)
        return [torch.load(os.path.join(out, f"{r}.pt"), weights_only=False) for r in range(world_size)]
