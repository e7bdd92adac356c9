"""`malleus submit CONFIG`: a training job submitted through Ray's Jobs API.

A malleus job is the Ray job `python -m malleus_svc.train CONFIG`, so this is exactly what

    ray job submit --working-dir . -- python -m malleus_svc.train CONFIG

does, plus what the raw CLI cannot: the job file is validated here first (a bad file fails in a
second, not after an upload and a cluster start-up), a job of the same name that is still running is
refused, and the metadata records the malleus job name so `malleus status` finds the job by its
submission id as well as by its name.

Address: `--address` (the Ray dashboard, e.g. http://head:8265), else RAY_API_SERVER_ADDRESS or
RAY_ADDRESS, as for `ray job submit` (Ray's own resolution: those variables win over the argument).
Authentication: service/ray_auth.py (the token `ray start --head` found is used without
RAY_AUTH_MODE=token; a refusal is one line).
"""
from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path
from typing import Sequence

from malleus_svc.config.errors import ConfigError

TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
# Never uploaded with the working dir (Ray also honours the project's .gitignore).
EXCLUDES = [".venv/", ".git/", "__pycache__/", "*.pyc", ".pytest_cache/", ".hypothesis/"]


def entrypoint(config_rel: str, train_args: Sequence[str] = (), python: str = "python") -> str:
    return " ".join([python, "-m", "malleus_svc.train", shlex.quote(config_rel), *map(shlex.quote, train_args)])


def job_client(address: str | None):
    from ray.job_submission import JobSubmissionClient

    from .ray_auth import AuthRefused, connecting

    try:
        with connecting():
            return JobSubmissionClient(address)
    except AuthRefused:               # its line names the cause already
        raise
    except ConnectionError as e:
        raise ConnectionError(f"cannot reach the Ray Jobs API at {address or '(RAY_ADDRESS / local)'}: "
                              f"{str(e).rstrip('.')}. Start a cluster (`ray start --head`) or pass "
                              "--address http://HEAD:8265") from None


def submit(config: str, *, address: str | None = None, working_dir: str = ".", train_args: Sequence[str] = (),
           submission_id: str | None = None, python: str = "python") -> tuple[str, str]:
    """Validate `config`, submit it; (submission id, malleus job name)."""
    from malleus_svc.config.job import load_job_config

    wd = Path(working_dir).resolve()
    if not wd.is_dir():
        raise ConfigError("--working-dir", working_dir, "an existing directory (uploaded as the job's working dir)")
    cfg_path = Path(config).resolve()
    job = load_job_config(cfg_path)          # ConfigError names the field, the value, what is accepted
    try:
        rel = cfg_path.relative_to(wd).as_posix()
    except ValueError:
        raise ConfigError("config", config, f"a file inside the working dir {wd} (it travels with the upload); "
                          "move it there or pass --working-dir") from None
    client = job_client(address)
    running = [j.submission_id for j in client.list_jobs()
               if (j.metadata or {}).get("malleus_job") == job.name and getattr(j.status, "value", j.status) not in TERMINAL]
    if running:
        raise ConfigError("name", job.name, f"a job name not in use: {', '.join(running)} still runs as "
                          f"{job.name!r}; stop it (malleus stop {job.name}) or rename the job")
    sid = client.submit_job(
        entrypoint=entrypoint(rel, train_args, python),
        runtime_env={"working_dir": str(wd), "excludes": EXCLUDES},
        submission_id=submission_id,
        metadata={"malleus_job": job.name, "malleus_config": rel},
    )
    return sid, job.name


def follow(address: str | None, submission_id: str, out=sys.stdout) -> str:
    """Stream the job's logs until it ends (Ray's tail_job_logs websocket); its final status."""
    import asyncio

    client = job_client(address)

    async def tail() -> None:
        async for chunk in client.tail_job_logs(submission_id):
            out.write(chunk)
            out.flush()

    asyncio.run(tail())
    while (status := _status(client, submission_id)) not in TERMINAL:  # the stream ends just before
        time.sleep(0.5)
    return status


def _status(client, submission_id: str) -> str:
    s = client.get_job_status(submission_id)
    return getattr(s, "value", str(s))
