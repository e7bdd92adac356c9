"""The service surface end to end, with real components only.

A real `ray start --head` (token authentication on, a token of this test's own), the real `ray job
submit` CLI, Ray's real JobSubmissionClient (examples/submit_job.py), `malleus submit/status/
replan/rates/stop` from other processes, and a real Prometheus server (Debian's `prometheus`,
installed by scripts/setup.sh) configured from deploy/prometheus/prometheus.yml, scraping the job's
coordinator; every PromQL expression of dashboards/malleus.json must return data through
Prometheus's HTTP API.

The head runs in a temp dir of its own, so `ray.init()` elsewhere in the session never joins it,
and is torn down by signalling its process group (never `ray stop`, which would kill every Ray
cluster on the machine).
"""
from __future__ import annotations

import json
import math
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from _host import inconclusive

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
JOB = "tiny"   # examples/tiny_job.yaml

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(what: str, check, timeout: float, every: float = 1.0):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except Exception as e:  # not yet (a server starting, a job not yet registered)
            last = e
        else:
            if last:
                return last
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; last: {last!r}")


class JobsAPI:
    """Ray's Jobs API on a head's dashboard, from this process with the head's token: a poll costs
    an HTTP request, where a `ray`/`malleus` command costs a process that imports and connects (a
    second of CPU each, on a 2-core machine busy training)."""

    def __init__(self, dashboard: str, token: str):
        from ray.job_submission import JobSubmissionClient
        self.client = JobSubmissionClient(dashboard, headers={"Authorization": f"Bearer {token}"})

    def state(self, sid: str) -> str:
        return self.client.get_job_status(sid).value

    def logs(self, sid: str) -> str:
        return self.client.get_job_logs(sid)

    def wait_ready(self) -> None:
        """Ready when a trivial job runs: the Jobs API answers before its agent has registered."""
        def trivial_job() -> bool:
            sid = self.client.submit_job(entrypoint="true")
            _wait("the trivial job", lambda: self.state(sid) in ("SUCCEEDED", "FAILED"), 60, 1)
            return self.state(sid) == "SUCCEEDED"
        _wait("the Ray head's Jobs API", trivial_job, 240, 3)


def _kill_group(proc: subprocess.Popen) -> None:
    # `ray start --block` does not exit on SIGTERM by itself: give its children a moment, then kill.
    for sig, wait in ((signal.SIGTERM, 3), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


class Head:
    def __init__(self):
        self.dir = Path(tempfile.mkdtemp(prefix="mls", dir="/tmp"))   # short: Unix socket paths are short
        token = self.dir / "token"
        token.write_text(secrets.token_hex(32))
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token), PATH=f"{BIN}:{env.get('PATH', '')}",
                   RAY_USAGE_STATS_ENABLED="0")
        self.env = env
        self.gcs_port, self.dash_port, agent_port = _free_port(), _free_port(), _free_port()
        self.gcs = f"127.0.0.1:{self.gcs_port}"
        self.dashboard = f"http://127.0.0.1:{self.dash_port}"
        self.temp = self.dir / "ray"
        self.proc = subprocess.Popen(
            [str(BIN / "ray"), "start", "--head", "--block", f"--temp-dir={self.temp}", f"--port={self.gcs_port}",
             f"--dashboard-port={self.dash_port}", "--dashboard-host=127.0.0.1", "--num-cpus=8",
             # the agent's default port (52365) is taken by any other local cluster (the session one)
             f"--dashboard-agent-listen-port={agent_port}",
             "--node-ip-address=127.0.0.1", "--disable-usage-stats"],
            env=env, stdout=open(self.dir / "head.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self.jobs = _wait("the Jobs API to answer", lambda: JobsAPI(self.dashboard, token.read_text()), 240, 1)
            self.jobs.wait_ready()
        except AssertionError as e:
            raise AssertionError(f"{e}\nhead log: {(self.dir / 'head.log').read_text()[-1500:]}") from None

    def run(self, *cmd: str, check: bool = True, timeout: float = 180) -> subprocess.CompletedProcess:
        exe = str(BIN / cmd[0]) if (BIN / cmd[0]).exists() else cmd[0]
        p = subprocess.run([exe, *cmd[1:]], env=self.env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
        if check and p.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} exited {p.returncode}\nstdout: {p.stdout[-3000:]}\n"
                                 f"stderr: {p.stderr[-3000:]}")
        return p

    def malleus(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return self.run("malleus", *args, check=check)

    def status(self, job: str) -> dict:
        return json.loads(self.malleus("status", job, "--address", self.gcs, "--json").stdout)

    def close(self):
        _kill_group(self.proc)
        shutil.rmtree(self.dir, ignore_errors=True)


class Prometheus:
    def __init__(self, head: Head):
        exe = shutil.which("prometheus")
        if exe is None:
            if os.environ.get("MALLEUS_REQUIRE_PROMETHEUS"):
                pytest.fail("prometheus is not installed (scripts/setup.sh installs Debian's package)")
            pytest.skip("prometheus is not installed (scripts/setup.sh installs Debian's package)")
        cfg = yaml.safe_load((REPO / "deploy/prometheus/prometheus.yml").read_text())
        cfg["global"]["scrape_interval"] = "1s"
        for sc in cfg["scrape_configs"]:    # the deploy config, pointed at this head's temp dir
            for sd in sc["file_sd_configs"]:
                sd["files"] = [f.replace("/tmp/ray", str(head.temp)) for f in sd["files"]]
                sd["refresh_interval"] = "1s"
        path = head.dir / "prometheus.yml"
        path.write_text(yaml.safe_dump(cfg))
        self.url = f"http://127.0.0.1:{_free_port()}"
        self.proc = subprocess.Popen(
            [exe, f"--config.file={path}", f"--storage.tsdb.path={head.dir / 'tsdb'}",
             f"--web.listen-address={self.url[7:]}"],
            stdout=open(head.dir / "prometheus.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
        _wait("Prometheus ready", lambda: urllib.request.urlopen(f"{self.url}/-/ready", timeout=2).status == 200, 60)

    def api(self, path: str, **params) -> dict:
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params, doseq=True)}"
        with urllib.request.urlopen(url, timeout=30) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]

    def range_values(self, expr: str, start: float, end: float) -> list[float]:
        data = self.api("query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step="1")
        return [float(v) for series in data["result"] for _, v in series["values"]]

    def close(self):
        _kill_group(self.proc)


@pytest.fixture(scope="module")
def head():
    h = Head()
    try:
        yield h
    finally:
        h.close()


@pytest.fixture(scope="module")
def prometheus(head):
    p = Prometheus(head)
    try:
        yield p
    finally:
        p.close()


def dashboard_queries() -> list[str]:
    dash = json.loads((REPO / "dashboards/malleus.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [a["expr"] for a in dash["annotations"]["list"] if "expr" in a]
    return exprs


def test_ray_job_is_controllable_and_observed(head, prometheus, tmp_path):
    """`ray job submit` -> status / bad requests / health-check example / replan / stop from other
    processes -> SUCCEEDED; the metrics file, the coordinator's history and Prometheus agree."""
    t_start = time.time()
    metrics_file = tmp_path / "metrics.jsonl"
    sid = f"malleus-e2e-{secrets.token_hex(3)}"
    head.run("ray", "job", "submit", "--address", head.dashboard, "--working-dir", ".", "--submission-id", sid,
             "--no-wait", "--", "python", "-m", "malleus_svc.train", "examples/tiny_job.yaml", "--steps", "100000",
             "--metrics-out", str(metrics_file))

    # Found by its Ray submission id from another process, training and calibrated.
    st = _wait("the job to train and calibrate", lambda: (s := head.status(sid))["calibrated"] and s, 240, 2)
    assert st["job"] == JOB and st["submission_id"] == sid and st["state"] == "training"
    assert re.fullmatch(r"127\.0\.0\.1:\d+", st["metrics_endpoint"]), st["metrics_endpoint"]  # loopback by default

    # Bad requests: one clear line, exit 2, nothing changed.
    before = head.status(JOB)
    bad = [
        (("rates", JOB, "--set", "1=-2"), "finite number >= 1.0"),
        (("rates", JOB, "--set", "1=nan"), "finite number >= 1.0"),
        (("rates", JOB, "--set", "one=2"), "device id is a non-negative integer"),
        (("rates", JOB, "--set", "1:2"), "DEVICE=RATE"),
        (("rates", JOB, "--set", "99=2.0"), "unknown device 99"),
        (("replan", JOB, "--reason", " "), "reason must be a non-empty string"),
        (("status", "no-such-job"), "no malleus job 'no-such-job'"),
    ]
    for args, message in bad:
        p = head.malleus(*args, "--address", head.gcs, check=False)
        assert p.returncode == 2, (args, p.returncode, p.stdout, p.stderr)
        assert message in p.stderr and "Traceback" not in p.stderr, (args, p.stderr)
    after = head.status(JOB)
    assert after["external_rates"] == before["external_rates"] == {}
    assert not any(r["kind"] == "external-rates" for h in _history(head) for r in h.get("requests", []))

    # The health-check example hands the job an external rate and asks for a re-plan.
    endpoint = st["metrics_endpoint"]    # waited on below: its counters move when a round ends
    migrations = _metric(endpoint, "malleus_migration_seconds_count")
    signal_file = tmp_path / "health.json"
    signal_file.write_text(json.dumps({"1": 4.0, "replan": "health-check example"}))
    out = head.run("python", "examples/health_check.py", JOB, "--signal", str(signal_file), "--address", head.gcs,
                   "--rounds", "1", "--interval", "0").stdout
    assert "set_rates {1: 4.0}" in out, out
    assert head.status(JOB)["external_rates"] == {"1": 4.0}
    # A device 4x slower than the rest: the planner moves work off it, live.
    _wait("a migration", lambda: _metric(endpoint, "malleus_migration_seconds_count") > migrations, 120, 1)
    _wait("a migration away from device 1", lambda: any(
        h["outcome"] == "applied" and "1=4.0" in h["reason"] for h in _history(head)), 120, 2)

    # An operator's re-plan through the CLI shows up in the history (and below, in Prometheus).
    requested = _metric(endpoint, "malleus_replans_total", 'reason="request"')
    head.malleus("replan", JOB, "--reason", "e2e check", "--address", head.gcs)
    _wait("the operator's round", lambda: _metric(endpoint, "malleus_replans_total", 'reason="request"') > requested,
          120, 1)
    _wait("the operator's round to end", lambda: any("request: e2e check" in h["reason"] for h in _history(head)), 120, 2)
    shown = head.malleus("rates", JOB, "--address", head.gcs).stdout
    assert "1=4.00*" in shown, shown

    time.sleep(6)   # a few more scrapes after the last event
    t_stop = time.time()
    stop = head.malleus("stop", JOB, "--address", head.gcs)
    assert "stopping" in stop.stdout
    _wait("the Ray job to succeed", lambda: head.jobs.state(sid) == "SUCCEEDED", 180, 1)

    # The metrics file: one line per step, in order, and the plan changed on the way.
    lines = [json.loads(x) for x in metrics_file.read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(len(lines))) and len(lines) >= 10
    assert len({x["plan_id"] for x in lines}) >= 2
    assert all(x["tokens"] > 0 and x["samples"] > 0 and x["iteration_seconds"] > 0 for x in lines)
    assert all(("eval_loss" in x) == ((x["step"] + 1) % 5 == 0) for x in lines)   # the example's eval.every

    # Prometheus scraped it: the operator's request is counted, and every dashboard query has data.
    end = time.time()
    req = prometheus.range_values(f'sum(malleus_replans_total{{job="{JOB}",reason="request"}})', t_start, end)
    assert req and max(req) >= 1, req
    steps_seen = prometheus.range_values(f'malleus_iterations_total{{job="{JOB}"}}', t_start, end)
    assert steps_seen and max(steps_seen) > 0, steps_seen
    assert JOB in prometheus.api("label/job/values", **{"match[]": "malleus_plan_version"})
    empty = []
    for expr in dashboard_queries():
        q = expr.replace("$job", JOB).replace("$__rate_interval", "10s")
        if not any(math.isfinite(v) for v in prometheus.range_values(q, t_start, end)):
            empty.append(expr)
    assert not empty, f"dashboard queries with no data: {empty}"
    # Prometheus saw (nearly) every step: judged where it kept up, every scrape of the coordinator
    # answered within its 1 s timeout while it trained (on a host too busy for that, the last
    # steps' count may never have been scraped).
    ups = prometheus.range_values(f'up{{instance="{endpoint}"}}', t_start, t_stop)
    assert ups, f"Prometheus never scraped the coordinator at {endpoint}"
    if min(ups) < 1:
        inconclusive(f"Prometheus's scrapes of the coordinator failed at {ups.count(0.0)} of {len(ups)} seconds")
    assert max(steps_seen) >= 0.8 * len(lines), (max(steps_seen), len(lines))


def _metric(endpoint: str, name: str, label: str = "") -> float:
    """The sum of a metric's samples for the job (with `label`, e.g. 'reason="request"') as the
    coordinator's endpoint serves it now."""
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=30) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and f'job="{JOB}"' in line and label in line)


def _history(head: Head) -> list[dict]:
    p = head.run("python", "-c", "import json, malleus_svc; "
                 f"print(json.dumps(malleus_svc.connect({JOB!r}, address={head.gcs!r}).history()))")
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_python_client_example_and_malleus_submit(head, tmp_path):
    """examples/submit_job.py (Ray's JobSubmissionClient) and `malleus submit --follow` each run a
    short job to SUCCEEDED with the expected number of steps; a bad job file never reaches Ray."""
    out = head.run("python", "examples/submit_job.py", "--address", head.dashboard, "--steps", "12", timeout=300).stdout
    assert re.search(r"SUCCEEDED", out) and "12 steps;" in out, out

    metrics = tmp_path / "follow.jsonl"
    p = head.malleus("submit", "examples/tiny_job.yaml", "--address", head.dashboard, "--follow", "--",
                     "--steps", "6", "--metrics-out", str(metrics))
    assert p.stdout.strip().splitlines()[0].startswith("raysubmit_"), p.stdout
    assert "SUCCEEDED" in p.stderr
    assert [json.loads(x)["step"] for x in metrics.read_text().splitlines()] == list(range(6))

    bad = tmp_path / "bad.yaml"
    bad.write_text((REPO / "examples/tiny_job.yaml").read_text().replace("steps: 10", "steps: -3"))
    p = head.malleus("submit", str(bad), "--address", head.dashboard, "--working-dir", str(tmp_path), check=False)
    assert p.returncode == 2 and "train.steps" in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_custom_model_example_on_the_cluster(head, tmp_path):
    out = tmp_path / "custom.jsonl"
    p = head.run("python", "examples/custom_model.py", "--address", head.gcs, "--steps", "14",
                 "--metrics-out", str(out), timeout=300)
    assert "custom model: 14 steps" in p.stdout, p.stdout[-2000:]
    losses = [json.loads(x)["loss"] for x in out.read_text().splitlines()]
    assert losses[-1] < losses[0] - 0.5, losses      # it learns (byte-level Python: ~5.6 -> well below)


def test_own_data_example_tokenizes_trains_exports_and_generates(head, tmp_path):
    """examples/own_data.py end to end: prepare-data on a folder of text, a Ray job on the corpus,
    `export`, then transformers loads the folder and generates."""
    p = head.run("python", "examples/own_data.py", "--address", head.dashboard, "--work", str(tmp_path),
                 "--steps", "8", timeout=400)
    assert "documents" in p.stdout and re.search(r"own data: 8 steps", p.stdout), p.stdout[-2000:]
    losses = [json.loads(x)["loss"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 8 and losses[-1] < losses[0], losses
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["num_key_value_heads"] == 2 and config["vocab_size"] == 512
    generated = re.search(r"generated: '(.*)'", p.stdout)
    assert generated and generated.group(1).startswith("def ") and len(generated.group(1)) > 8, p.stdout[-500:]
