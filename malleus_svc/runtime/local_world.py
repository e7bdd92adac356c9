"""Run a function on N local processes joined by one torch.distributed world, as torchrun would.

Rank r is process r: it gets torchrun's environment (`MASTER_ADDR` 127.0.0.1, `MASTER_PORT`, `RANK`,
`WORLD_SIZE`, `LOCAL_RANK`), uses one torch thread (hosts here have few cores), and, under NCCL,
GPU r. It joins the world (gloo or NCCL) through a store that rank 0 serves on 127.0.0.1 only
(runtime/rendezvous.py; the port is held from the start), with a bounded collective timeout, runs
``fn(rank, world_size, *args)`` and hands back what it returns (through torch.save). A rank that
raises ends the others (`torch.multiprocessing.start_processes`), so a failure cannot leave peers
waiting.
"""
from __future__ import annotations

import datetime
import gc
import os
import socket
import tempfile
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from malleus_svc.runtime.collective_env import prepare_collective_env
from malleus_svc.runtime.groups import prepare_world, set_collective_timeout
from malleus_svc.runtime.rendezvous import join, listen

DEFAULT_TIMEOUT_S = 120.0


def _worker(rank: int, world_size: int, backend: str, listener: socket.socket, timeout_s: float, out_dir: str,
            fn: Callable, args: tuple) -> None:
    port = listener.getsockname()[1]
    if rank != 0:            # every rank receives a copy of the listening socket; rank 0 serves it
        listener.close()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    prepare_collective_env(backend, os.environ)   # as a worker: a failed collective raises, it never hangs
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    timeout = datetime.timedelta(seconds=timeout_s)
    join(backend, "127.0.0.1", port, rank, world_size, timeout, listener if rank == 0 else None)
    set_collective_timeout(timeout)     # subgroups too
    try:
        prepare_world()
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"{rank}.pt"))
        del result
    finally:
        # free what fn left in reference cycles (a DDP module and its reducer) while its process
        # group is still up: freed at interpreter exit instead, after the group, it can abort
        gc.collect()
        dist.destroy_process_group()


def _start_method() -> str:
    """forkserver, whose server imports torch and the runtime once: each rank is a fork of it rather
    than a fresh interpreter importing torch again (seconds of CPU per rank on a small host; the
    engine tests ran in half the time). The server itself never computes, so forking it is safe."""
    import multiprocessing
    multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "malleus_svc.runtime.engine"])
    return "forkserver"


def run_local_world(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
                    timeout_s: float = DEFAULT_TIMEOUT_S) -> list[Any]:
    """fn's return value on each rank, in rank order. `fn` must be a module-level function."""
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise RuntimeError(f"an NCCL world of {world_size} needs {world_size} GPUs, "
                           f"this machine has {torch.cuda.device_count()}")
    with tempfile.TemporaryDirectory() as tmp, listen("127.0.0.1") as listener:
        out = os.path.join(tmp, "out")
        os.mkdir(out)
        mp.start_processes(_worker, args=(world_size, backend, listener, timeout_s, out, fn, args),
                           nprocs=world_size, join=True, start_method=_start_method())
        return [torch.load(os.path.join(out, f"{r}.pt"), weights_only=False) for r in range(world_size)]
