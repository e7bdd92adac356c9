"""A minimal custom model trained under malleus-svc, from Python (no YAML).

    python examples/custom_model.py                  # a local Ray cluster of 3 CPU workers
    python examples/custom_model.py --address auto   # an existing cluster

The model is a decoder of your own shape (depth, width, heads, FFN, vocabulary, context); the
runtime builds it stage by stage on the workers, shards it across tensor-parallel groups and keeps
it equal to a single-process run. Here 3 devices train 6 blocks; device 2 is emulated 3x slow from
step 8, so the job re-plans around it while it trains. (Arbitrary nn.Modules are not pluggable yet:
the runtime needs to know how to split blocks across stages and shards.)
"""
import argparse
import json

import ray

from malleus_svc.config.job import JobConfig
from malleus_svc.runtime.cluster import start_local_ray
from malleus_svc.train import run_through_coordinator

JOB = {
    "name": "custom",
    "cluster": {"nodes": 1, "gpus_per_node": 3, "gpu_memory_mb": 16000},
    # Your model: 6 blocks of width 96, 4 heads (2 KV heads: grouped-query attention), SwiGLU FFN 256.
    "model": {"layers": 6, "hidden": 96, "heads": 4, "kv_heads": 2, "ffn": 256, "vocab": 256, "seq_len": 64},
    "parallel": {"dp": 1, "tp": 1, "pp": 3},
    "batch": {"global": 12, "micro": 2},
    "data": {"source": "python-stdlib", "seq_len": 64, "max_files": 20},   # Python's own sources, bytes
    "train": {"steps": 30, "lr": 2.0e-3},
    "emulate": [{"device": 2, "factor": 3.0, "at_step": 8}],             # demo only: a straggler appears
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--address", default=None)
    ap.add_argument("--steps", type=int, default=JOB["train"]["steps"])
    ap.add_argument("--metrics-out", default=None)
    args = ap.parse_args()

    job = JobConfig.from_dict(JOB)          # validated like a job file: bad fields raise ConfigError
    if args.address:
        ray.init(address=args.address)
    else:
        start_local_ray(job.num_devices)
    try:
        rc = run_through_coordinator(job, None, args.steps, metrics_out=args.metrics_out)  # None: the planner plans
    finally:
        ray.shutdown()
    if rc == 0 and args.metrics_out:
        lines = [json.loads(x) for x in open(args.metrics_out)]
        print(f"custom model: {len(lines)} steps, loss {lines[0]['loss']:.3f} -> {lines[-1]['loss']:.3f}, "
              f"plans used {sorted({x['plan_id'] for x in lines})}")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
