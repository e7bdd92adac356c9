"""The torch.distributed rendezvous listens on the address it is given, not on every interface
(the store has no authentication). Checked from the kernel's socket tables, for the process's own
listening sockets, against torch's `tcp://` init, which listens on all of them."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

WORLD_OF_ONE = r'''
import datetime, os, sys
import torch, torch.distributed as dist
from malleus_svc.runtime.rendezvous import join, listen
if sys.argv[1] == "rendezvous":
    s = listen("127.0.0.1")
    port = s.getsockname()[1]
    join("gloo", "127.0.0.1", port, 0, 1, datetime.timedelta(seconds=60), s)
else:
    port = 29000 + os.getpid() % 1000
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
t = torch.ones(2)
dist.all_reduce(t)
assert t.tolist() == [1.0, 1.0]
mine = set()
for fd in os.listdir("/proc/self/fd"):
    try:
        link = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        continue
    if link.startswith("socket:["):
        mine.add(link[8:-1])
for table in ("tcp", "tcp6"):
    for line in open(f"/proc/net/{table}").read().splitlines()[1:]:
        f = line.split()
        if f[3] == "0A" and f[9] in mine:          # LISTEN, one of this process's sockets
            host, p = f[1].split(":")
            print(table, host, int(p, 16), int(int(p, 16) == port))
'''


def listening(mode: str) -> list[tuple[str, str, int, bool]]:
    out = subprocess.run([sys.executable, "-c", WORLD_OF_ONE, mode], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return [(t, h, int(p), s == "1") for t, h, p, s in (line.split() for line in out.stdout.splitlines())]


LOOPBACK = "0100007F"         # 127.0.0.1 as /proc/net/tcp writes it


@pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="reads Linux's /proc socket tables")
def test_the_rendezvous_store_listens_on_the_given_address_only():
    socks = listening("rendezvous")
    assert any(store for *_, store in socks), socks               # the store's own port is among them
    assert all(t == "tcp" and h == LOOPBACK for t, h, _, _ in socks), socks


@pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="reads Linux's /proc socket tables")
def test_torch_tcp_init_listens_on_every_interface():
    """Why the rendezvous module exists: the same world through `tcp://127.0.0.1:PORT`."""
    socks = listening("tcp")
    store = [(t, h) for t, h, _, s in socks if s]
    assert store and all(h.strip("0") == "" for _, h in store), socks      # 0.0.0.0 or ::
