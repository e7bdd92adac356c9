"""The torch.distributed rendezvous, listening on one address only.

With `init_method="tcp://ip:port"`, rank 0's TCPStore listens on every interface of its host, and
the store has no authentication: anyone who reaches the port can write into the rendezvous. Here
rank 0 opens the listening socket itself, on the address the other ranks are given (the node's
cluster address, or 127.0.0.1 for a world on one host), and hands it to the store, which then
listens there only. The port is held from the moment it is chosen, so no other process can take
it before the store does.
"""
from __future__ import annotations

import datetime
import socket


def listen(host: str) -> socket.socket:
    """A socket listening on `host` at a port the OS picks (`getsockname()[1]`), for rank 0's store."""
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind((host, 0))
        s.listen()
    except OSError:
        s.close()
        raise
    return s


def join(backend: str, addr: str, port: int, rank: int, world_size: int, timeout: datetime.timedelta,
         listener: socket.socket | None = None, group_timeout: datetime.timedelta | None = None) -> None:
    """`init_process_group` over a TCPStore at addr:port. Rank 0 passes the `listen(addr)` socket
    and the store takes it over; the other ranks connect to it. The store waits `timeout`, the
    group's collectives `group_timeout` (default: the same)."""
    import torch.distributed as dist

    if rank == 0:
        if listener is None:
            raise ValueError("rank 0 serves the rendezvous: it needs the socket from rendezvous.listen()")
        store = dist.TCPStore(addr, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False,
                              master_listen_fd=listener.detach())
    else:
        store = dist.TCPStore(addr, port, world_size, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=group_timeout or timeout)
