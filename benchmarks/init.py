"""Host memory and time of a worker's model initialisation: its shards drawn tile by tile on a stage
built on the meta device, beside the full tensors of the same blocks (what initialising whole and
then sharding would hold). Each row runs in a fresh process, so its peak RSS is its own."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from .planner import write_section

CASES = (("llama-70b", 1, 8), ("llama-70b", 1, 1), ("gpt-1.3b", 4, 2))   # (model, blocks, TP)

_CHILD = """
import json, resource, sys, time
from malleus_svc.config.presets import PRESETS
from malleus_svc.runtime.tensor_parallel import LocalShard
from malleus_svc.runtime.model import build_stage_model, init_part
model, blocks, tp, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
shape = PRESETS[model]
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
t = time.perf_counter()
if mode == "shards":
    m = build_stage_model(shape, (0, blocks), has_embedding=False, has_head=False, tp=LocalShard(tp, 0), seed=0)
    held = sum(p.numel() * 4 for p in m.parameters())
else:
    full = [init_part(shape, b, 0) for b in range(blocks)]   # all held at once, as before sharding
    held = sum(x.numel() * 4 for part in full for x in part.values())
print(json.dumps({"held_mib": held / 2**20, "seconds": time.perf_counter() - t,
                  "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base}))
"""


def measure(model: str, blocks: int, tp: int, mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, model, str(blocks), str(tp), mode],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="malleus bench init", description=__doc__.split("\n")[0])
    ap.add_argument("--write", metavar="MD", help="update this markdown file's init section")
    args = ap.parse_args(argv)
    rows = ["| model | blocks | TP | shards held MiB | peak MiB (shards) | s | full tensors MiB | peak MiB (full) | s |",
            "|---|---|---|---|---|---|---|---|---|"]
    for model, blocks, tp in CASES:
        print(f"{model}, {blocks} block(s), TP {tp} ...", flush=True)
        s, f = measure(model, blocks, tp, "shards"), measure(model, blocks, tp, "full")
        rows.append(f"| {model} | {blocks} | {tp} | {s['held_mib']:.0f} | {s['peak_mib']:.0f} | {s['seconds']:.1f} | "
                    f"{f['held_mib']:.0f} | {f['peak_mib']:.0f} | {f['seconds']:.1f} |")
    md = "\n".join(rows)
    print(md)
    if args.write:
        write_section(f"Command: `malleus bench init --write BENCHMARKS.md` — {time.strftime('%Y-%m-%d')}, 2-core CPU "
                      f"machine; peak MiB is the process's peak RSS above what it held before building (torch "
                      f"imported).\n\n{md}", Path(args.write), "bench:init")
    return 0
