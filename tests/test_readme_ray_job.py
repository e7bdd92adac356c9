"""The README's "Run it as a Ray job" commands, typed as they are, against a head started with
Ray's defaults: no RAY_AUTH_* variable anywhere, a home holding the token Ray's own
`ray get-auth-token --generate` wrote (as any earlier local Ray run leaves it), so `ray start
--head` turns token authentication on by itself. Then what a newcomer without the token sees, and
what `malleus status` says once a job has ended, for each end: stopped by `malleus stop`, run to
completion, failed on the cluster, stopped by Ray's `ray job stop`.

One head for the module (the README's `ray start --head`), with a temp dir, ports and home of its
own (so RAY_ADDRESS points the commands at it), torn down by signalling its process group, never
`ray stop`.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from test_service_e2e import JobsAPI, _free_port, _kill_group, _wait

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def readme_job_commands() -> list[str]:
    """The command lines of the README's Ray-job block, comments dropped."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Run it as a Ray job"):]
    block = section[section.index("```bash\n") + 8:]
    block = block[:block.index("```")]
    return [re.split(r"\s{2,}#", line)[0].strip() for line in block.splitlines() if line.strip()]


class DefaultHead:
    def __init__(self):
        self.dir = Path(tempfile.mkdtemp(prefix="mlr", dir="/tmp"))     # short: Unix socket paths are short
        self.home = self.dir / "home"
        self.home.mkdir()
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env.update(HOME=str(self.home), PATH=f"{BIN}:{env.get('PATH', '')}", RAY_USAGE_STATS_ENABLED="0")
        self.env = env
        subprocess.run([str(BIN / "ray"), "get-auth-token", "--generate"], env=env, check=True, capture_output=True)
        self.gcs_port, self.dash_port = _free_port(), _free_port()
        self.dashboard = f"http://127.0.0.1:{self.dash_port}"
        self.proc = None

    def start(self, command: str) -> None:
        """The README's `ray start --head`, plus only what keeps it apart from other clusters here."""
        args = shlex.split(command)
        assert args == ["ray", "start", "--head"], args
        self.proc = subprocess.Popen(
            [str(BIN / "ray"), *args[1:], "--block", f"--temp-dir={self.dir / 'ray'}", f"--port={self.gcs_port}",
             f"--dashboard-port={self.dash_port}", "--dashboard-host=127.0.0.1",
             f"--dashboard-agent-listen-port={_free_port()}", "--num-cpus=8"],
            env=self.env, stdout=open(self.dir / "head.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
        _wait("the head's GCS address", self._address, 120, 2)
        self.env["RAY_ADDRESS"] = self.address
        token = (self.home / ".ray" / "auth_token").read_text().strip()    # the one Ray generated
        self.jobs = _wait("the Jobs API to answer", lambda: JobsAPI(self.dashboard, token), 240, 1)
        self.jobs.wait_ready()

    def _address(self) -> bool:
        log = (self.dir / "head.log").read_text()
        m = re.search(r"ray start --address='([^']+)'", log)
        if m:
            self.address = m.group(1)
        return bool(m)

    def run(self, command: str, check: bool = True, env: dict | None = None, timeout: float = 240):
        """A README line in a clean environment; `malleus` is this checkout's CLI, `ray` the venv's."""
        args = shlex.split(command)
        exe = {"malleus": [sys.executable, "-m", "malleus_svc.cli"], "ray": [str(BIN / "ray")]}[args[0]]
        run_env = dict(env or self.env)
        if args[0] == "ray":      # Ray's own CLI needs token mode spelled out (README)
            run_env["RAY_AUTH_MODE"] = "token"
        p = subprocess.run(exe + args[1:], env=run_env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
        if check and p.returncode != 0:
            raise AssertionError(f"{command} exited {p.returncode}\nstdout: {p.stdout[-3000:]}\n"
                                 f"stderr: {p.stderr[-3000:]}")
        return p

    def close(self):
        if self.proc is not None:
            _kill_group(self.proc)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def head():
    h = DefaultHead()
    try:
        h.start(readme_job_commands()[0])
        yield h
    finally:
        h.close()


def ended_status(head, sid: str, state: str) -> tuple[str, dict]:
    """`malleus status SID` (text, --json) once the job has ended in `state` (the live coordinator
    answers before that, Ray's final state only after)."""
    _wait(f"Ray job {sid} to end", lambda: head.jobs.state(sid) in ("SUCCEEDED", "FAILED", "STOPPED"), 240, 1)
    _wait(f"Ray job {sid} to end {state}", lambda: re.match(
        rf"job \w+ \(Ray job {sid}\): {state}", head.run(f"malleus status {sid}").stdout) is not None, 60, 2)
    return head.run(f"malleus status {sid}").stdout, json.loads(head.run(f"malleus status {sid} --json").stdout)


def test_the_readme_job_commands_work_as_typed(head):
    commands = readme_job_commands()
    assert commands[0] == "ray start --head" and commands[1].startswith("malleus submit examples/tiny_job.yaml")
    assert "Token authentication is enabled" in (head.dir / "head.log").read_text()   # Ray's default with a token
    assert not any(k.startswith("RAY_AUTH") for k in head.env)

    sid = head.run(commands[1]).stdout.split()[0]
    assert sid.startswith("raysubmit_")
    status_cmd = commands[2]
    assert status_cmd == "malleus status tiny"
    # the driver says so once its job trains (then every tenth of its steps)
    _wait("the job to train", lambda: "[tiny] 4 workers" in head.jobs.logs(sid), 240, 1)
    assert "training" in head.run(status_cmd).stdout.splitlines()[0]
    for command in commands[3:]:
        if command.startswith("prometheus"):        # a separate tool, checked in test_service_e2e
            continue
        if command == "malleus stop tiny":
            assert "stopping tiny" in head.run(command).stdout
            _wait("the Ray job to end", lambda: head.jobs.state(sid) == "SUCCEEDED", 240, 1)
            continue
        p = head.run(command)
        assert "Traceback" not in p.stderr, (command, p.stderr)
    # The last README line: the job has ended, its outcome answers.
    out = head.run(status_cmd).stdout
    assert re.match(rf"job tiny \(Ray job {sid}\): SUCCEEDED, \d+/500 steps", out), out
    assert "loss" in out and "tok/s" in out and "re-plan rounds" in out, out
    st = json.loads(head.run(status_cmd + " --json").stdout)
    assert st["state"] == "SUCCEEDED" and st["summary"]["state"] == "stopped" and st["submission_id"] == sid
    assert 0 < st["summary"]["steps"] < 500 and st["summary"]["last_loss"] < st["summary"]["first_loss"] + 1
    assert st["summary"]["replans"] >= 1             # the README's `malleus replan` is in it

    # An unknown name lists what ran; by the submission id, the same outcome.
    p = head.run("malleus status nope", check=False)
    assert p.returncode == 2 and f"recent jobs: tiny (SUCCEEDED, {sid})" in p.stderr, p.stderr
    assert json.loads(head.run(f"malleus status {sid} --json").stdout)["summary"] == st["summary"]

    # Without the token (another home), or with another cluster's: one line that says which.
    bare = head.env | {"HOME": str(head.dir)}
    wrong = head.env | {"RAY_AUTH_TOKEN": secrets.token_hex(32)}
    filed = head.env | {"HOME": str(head.dir / "other")}          # another cluster's token in ~/.ray/auth_token
    (head.dir / "other" / ".ray").mkdir(parents=True)
    (head.dir / "other" / ".ray" / "auth_token").write_text(secrets.token_hex(32))
    cases = [(command, env, cause)
             for env, cause in ((bare, "this client sent none"),
                                (wrong, "refused the authentication token from RAY_AUTH_TOKEN"),
                                (filed, f"refused the authentication token from {head.dir / 'other' / '.ray' / 'auth_token'}"))
             for command in ("malleus status tiny", "malleus submit examples/tiny_job.yaml")]
    with ThreadPoolExecutor(len(cases)) as pool:    # independent clients: side by side
        answers = list(pool.map(lambda c: head.run(c[0], check=False, env=c[1]), cases))
    for (command, _, cause), p in zip(cases, answers):
        assert p.returncode == 2 and p.stderr.count("\n") == 1, (command, p.stderr)
        assert cause in p.stderr and "export RAY_AUTH_TOKEN" in p.stderr, (command, p.stderr)


def test_status_of_a_job_that_ran_all_its_steps(head):
    sid = head.run("malleus submit examples/tiny_job.yaml -- --steps 6").stdout.split()[0]
    text, st = ended_status(head, sid, "SUCCEEDED")
    assert re.match(rf"job tiny \(Ray job {sid}\): SUCCEEDED, 6/6 steps, ended ", text), text
    assert "loss" in text and "tok/s" in text and "error" not in text and "ended by" not in text, text
    s = st["summary"]
    assert st["state"] == "SUCCEEDED" and s["state"] == "done" and s["error"] is None and s["submission_id"] == sid
    assert s["steps"] == 6 and s["first_loss"] > 0 and s["last_loss"] > 0 and s["tokens_per_second"] > 0


def submit_tokens_job(head, name: str, corpus: bytes, ignored: bool = False) -> str:
    """Submit the tiny job renamed `name`, training on `corpus` (a plain uint16 file beside it, which
    git ignores, so the upload leaves it behind, if `ignored`); its submission id."""
    wd = head.dir / name
    (wd / "data").mkdir(parents=True)
    if ignored:
        (wd / ".gitignore").write_text("data/\n")
    (wd / "data" / "corpus.bin").write_bytes(corpus)
    job = (REPO / "examples" / "tiny_job.yaml").read_text().replace("name: tiny", f"name: {name}")
    job = re.sub(r"data:\n(  .*\n)+", "data: {source: tokens, files: [data/corpus.bin], seq_len: 64, vocab: 256}\n", job)
    (wd / "job.yaml").write_text(job)
    return head.run(f"malleus submit {wd / 'job.yaml'} --working-dir {wd}").stdout.split()[0]


def test_status_of_a_job_that_failed_on_the_cluster(head):
    """Its corpus is a plain uint16 file without a summary that holds one id beyond the model's
    vocabulary: only the scan that the job makes once its coordinator is up finds it, so the job
    fails on the cluster after it started. The driver records why, and Ray's FAILED state answers."""
    ids = [i % 256 for i in range(8192)]
    ids[5000] = 300
    sid = submit_tokens_job(head, "broken", b"".join(i.to_bytes(2, "little") for i in ids))
    text, st = ended_status(head, sid, "FAILED")
    assert re.match(rf"job broken \(Ray job {sid}\): FAILED, 0/10 steps", text), text
    assert "error: data: " in text and "data/corpus.bin" in text and "token id 300" in text, text
    s = st["summary"]
    assert s["state"] == "failed" and s["steps"] == 0 and s["submission_id"] == sid
    assert "exit code 2" in st["ray"]["message"]


def test_status_of_a_job_whose_data_is_missing_on_the_cluster(head):
    """Its data file exists here but git ignores it, so the upload leaves it behind: the driver
    refuses the job before Ray's workers start, records nothing, and status says so beside Ray's
    own failure message."""
    sid = submit_tokens_job(head, "missing", bytes(512), ignored=True)
    text, st = ended_status(head, sid, "FAILED")
    assert re.match(rf"job missing \(Ray job {sid}\): FAILED\n", text), text
    assert "data/corpus.bin' does not exist" in text and "no summary recorded" in text, text
    assert st["summary"] is None and "exit code 2" in st["ray"]["message"]


def test_status_of_a_job_stopped_by_ray_job_stop(head):
    """`ray job stop` sends the driver SIGTERM, then SIGKILL 3 s later: the driver records what the
    coordinator holds in between, and status says how it ended."""
    sid = head.run("malleus submit examples/tiny_job.yaml -- --steps 500").stdout.split()[0]
    _wait("the job to train a few steps",     # the driver's progress lines: steps 1, 11, 21, ...
          lambda: max(map(int, re.findall(r"step (\d+)/500", head.jobs.logs(sid))), default=0) >= 3, 240, 1)
    head.run(f"ray job stop {sid}")
    text, st = ended_status(head, sid, "STOPPED")
    assert re.match(rf"job tiny \(Ray job {sid}\): STOPPED, \d+/500 steps", text), text
    assert "ended by SIGTERM to the driver" in text and "loss" in text and "no summary" not in text, text
    s = st["summary"]
    assert st["state"] == "STOPPED" and s["state"] == "terminated" and s["submission_id"] == sid
    assert 3 <= s["steps"] < 500 and s["last_loss"] is not None and s["plan_id"]
