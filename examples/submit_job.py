"""Submit a malleus-svc training job with Ray's Python Jobs client, wait for it, read its metrics.

    ray start --head                                   # once, on the head node
    python examples/submit_job.py --address http://127.0.0.1:8265 --steps 20

The same as `malleus submit examples/tiny_job.yaml -- --steps 20` or
`ray job submit --working-dir . -- python -m malleus_svc.train examples/tiny_job.yaml --steps 20`.
With token authentication on (Ray's default), the client reads the token from RAY_AUTH_TOKEN,
RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token.
"""
import argparse
import json
import time
from pathlib import Path

from ray.job_submission import JobStatus, JobSubmissionClient

REPO = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--address", default=None, help="Ray dashboard, e.g. http://127.0.0.1:8265")
    ap.add_argument("--config", default="examples/tiny_job.yaml", help="job file, relative to the repository")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()

    client = JobSubmissionClient(args.address)
    # The job writes one JSON line per step here (the driver runs on the head node, i.e. this machine
    # when you submit locally; on a remote cluster, read the driver's logs or Prometheus instead).
    metrics = f"/tmp/malleus-example-{int(time.time())}.jsonl"
    job_id = client.submit_job(
        entrypoint=f"python -m malleus_svc.train {args.config} --steps {args.steps} --metrics-out {metrics}",
        runtime_env={"working_dir": str(REPO), "excludes": [".venv/", ".git/"]},  # the code travels with the job
        metadata={"malleus_job": "tiny"},   # lets `malleus status` find the job by its submission id
    )
    print(f"submitted {job_id}")

    while (status := client.get_job_status(job_id)) not in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
        time.sleep(1)
    print(f"{job_id}: {status.value}")
    if status != JobStatus.SUCCEEDED:
        print(client.get_job_logs(job_id)[-3000:])
        return 1

    lines = [json.loads(line) for line in Path(metrics).read_text().splitlines()]
    print(f"{len(lines)} steps; loss {lines[0]['loss']:.3f} -> {lines[-1]['loss']:.3f}; "
          f"plan {lines[-1]['plan_id']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
