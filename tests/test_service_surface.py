"""The service surface without a cluster: metrics exposition, discovery files, the dashboard's
build, deployment files (checked by their own tools: promtool, Ray's cluster-config schema), CLI
input errors, and the what-if example. The end-to-end run is tests/test_service_e2e.py."""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from malleus_svc.cli import main as cli
from malleus_svc.config import ConfigError
from malleus_svc.config.job import JobConfig
from malleus_svc.control.metrics import JobMetrics
from malleus_svc.config.scenario import parse_rate_assignments

from _plans import BASELINE, PLAN_1

REPO = Path(__file__).resolve().parent.parent


def _samples(m: JobMetrics) -> dict[tuple, float]:
    from prometheus_client import generate_latest
    out = {}
    for fam in text_string_to_metric_families(generate_latest(m.registry).decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _line(step=0, tokens=640, samples=8, secs=0.5, loss=5.0):
    return {"step": step, "tokens": tokens, "samples": samples, "iteration_seconds": secs, "loss": loss}


def test_metrics_follow_the_plan_and_the_iterations():
    m = JobMetrics("j", gpus_per_node=8)
    m.on_plan(BASELINE, 0)
    s = _samples(m)
    stages = {k: v for k, v in s.items() if k[0] == "malleus_plan_stage_layers"}
    assert sorted(stages.values()) == [16, 16, 16, 16]
    # every re-plan counter exists at zero before the first round, so increase() sees the first one
    assert s[("malleus_replans_total", (("job", "j"), ("outcome", "applied"), ("reason", "request")))] == 0

    m.on_plan(PLAN_1, 1)                  # stale stages of the old plan must disappear
    s = _samples(m)
    stages = {dict(k[1])["devices"]: v for k, v in s.items() if k[0] == "malleus_plan_stage_layers"}
    assert stages == {"7": 4, "15": 4, "4,6": 8, "0,1,2,3": 16, "8,9,10,11": 16, "12,14": 16}
    assert s[("malleus_plan_suspended_devices", (("job", "j"),))] == 2
    assert s[("malleus_plan_version", (("job", "j"),))] == 1

    rates = {d: 1.0 for d in range(16)} | {5: 4.0, 13: 2.0}
    for step in range(3):
        m.on_iteration(_line(step), {0: {"memory_bytes": 100, "peak_memory_bytes": 150}}, rates, 16, [],
                       healthy_tokens_per_second=1000.0, lengths=[10, 20, 300], length_quantiles={0.5: 20, 1.0: 300},
                       pace_held={d: 1.0 for d in range(15)} | {15: 0.8}, unmeasured=[15])
    m.on_round(["request", "rates", "rates"], "applied", 0.25)
    m.on_migration(1.5, 2e6)
    s = _samples(m)
    j = (("job", "j"),)
    assert s[("malleus_iterations_total", j)] == 3 and s[("malleus_tokens_total", j)] == 1920
    assert s[("malleus_samples_total", j)] == 24
    assert s[("malleus_tokens_per_second", j)] == pytest.approx(1280)
    assert s[("malleus_capacity_tokens_per_second", j)] == pytest.approx(1000 * (14 + 0.25 + 0.5) / 16)
    assert s[("malleus_straggling_rate", (("device", "13"), ("job", "j"), ("node", "1")))] == 2.0
    # device 15's ops missed their pace: its rate is not measured, and the dashboard shows why
    assert math.isnan(s[("malleus_straggling_rate", (("device", "15"), ("job", "j"), ("node", "1")))])
    assert s[("malleus_pace_held_ratio", (("device", "15"), ("job", "j"), ("node", "1")))] == 0.8
    assert s[("malleus_device_peak_memory_bytes", (("device", "0"), ("job", "j"), ("node", "0")))] == 150
    assert s[("malleus_sequence_length_tokens_count", j)] == 9
    assert s[("malleus_sequence_length_quantile_tokens", (("job", "j"), ("quantile", "1")))] == 300
    assert s[("malleus_replans_total", (("job", "j"), ("outcome", "applied"), ("reason", "rates")))] == 1
    assert s[("malleus_planner_solve_seconds_count", j)] == 1
    assert s[("malleus_migration_bytes_total", j)] == 2e6
    assert s[("malleus_migration_seconds_sum", j)] == 1.5
    assert not any(name.endswith("_created") for name, _ in s)


def test_metrics_endpoint_binds_loopback_and_is_discoverable(tmp_path):
    m = JobMetrics("my job/1", gpus_per_node=4)
    m.on_plan(BASELINE, 0)
    endpoint = m.serve(sd_dir=str(tmp_path))
    try:
        host, port = endpoint.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0
        body = urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=10).read().decode()
        assert 'malleus_plan_version{job="my job/1"} 0.0' in body
        sd = json.loads((tmp_path / "my_job_1.json").read_text())
        assert sd == [{"targets": [endpoint], "labels": {}}]
    finally:
        m.close()
    assert not list(tmp_path.iterdir())          # the target disappears with the job
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=5)


@pytest.mark.parametrize("metrics, field", [
    ({"port": 70000}, "metrics.port"), ({"port": -1}, "metrics.port"), ({"host": ""}, "metrics.host"),
    ({"enabled": "yes"}, "metrics.enabled"), ({"prt": 1}, "metrics.prt"), ({"sd_dir": 3}, "metrics.sd_dir"),
])
def test_metrics_config_errors_name_the_field(metrics, field):
    job = yaml.safe_load((REPO / "examples/tiny_job.yaml").read_text())
    job["metrics"] = metrics
    with pytest.raises(ConfigError) as e:
        JobConfig.from_dict(job)
    assert e.value.field == field


@pytest.mark.parametrize("item, accepted", [
    ("3", "DEVICE=RATE"), ("x=2", "non-negative integer"), ("-1=2", "non-negative integer"),
    ("1=abc", "number >= 1.0"), ("1=nan", "finite number"), ("1=inf", "finite number"), ("1=0.5", ">= 1.0"),
])
def test_rate_assignments_are_validated(item, accepted):
    with pytest.raises(ConfigError) as e:
        parse_rate_assignments([item])
    assert accepted in str(e.value) and item in str(e.value)
    assert parse_rate_assignments(["2=3", " 4=1.5"]) == {2: 3.0, 4: 1.5}


def test_cli_refuses_bad_input_before_reaching_a_cluster(tmp_path, capsys):
    bad = tmp_path / "job.yaml"
    bad.write_text((REPO / "examples/tiny_job.yaml").read_text().replace("global: 8", "global: 0"))
    assert cli(["submit", str(bad), "--working-dir", str(tmp_path), "--address", "http://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err
    assert "batch.global" in err and "Traceback" not in err
    outside = tmp_path / "elsewhere.yaml"
    shutil.copy(REPO / "examples/tiny_job.yaml", outside)
    assert cli(["submit", str(outside), "--working-dir", str(REPO / "examples"), "--address", "http://127.0.0.1:9"]) == 2
    assert "inside the working dir" in capsys.readouterr().err
    assert cli(["submit", "examples/tiny_job.yaml", "--address", "http://127.0.0.1:9"]) == 2   # nothing listens
    assert "cannot reach the Ray Jobs API" in capsys.readouterr().err


def test_dashboard_is_built_from_its_source_and_well_formed():
    subprocess.run([sys.executable, "dashboards/build_dashboard.py", "--check"], cwd=REPO, check=True)
    dash = json.loads((REPO / "dashboards/malleus.json").read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    titles = {p["title"] for p in dash["panels"]}
    for wanted in ("Straggling rate per device", "Throughput against the capacity bound", "Iteration time",
                   "Stages of the plan in force", "Migration time", "Migration bytes", "Sequence-length distribution"):
        assert wanted in titles
    for p in dash["panels"]:
        assert p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        for t in p.get("targets", []):
            assert t["refId"] and "$job" in t["expr"] and t["datasource"]["uid"] == "${datasource}"
    assert {a["name"] for a in dash["annotations"]["list"]} >= {"Plan change", "Re-plan round"}
    assert [v["name"] for v in dash["templating"]["list"]] == ["datasource", "job"]


def test_deploy_files_pass_their_own_tools():
    promtool = shutil.which("promtool")
    if promtool:
        p = subprocess.run([promtool, "check", "config", "deploy/prometheus/prometheus.yml"], cwd=REPO,
                           capture_output=True, text=True)
        assert p.returncode == 0, p.stdout + p.stderr
    cfg = yaml.safe_load((REPO / "deploy/prometheus/prometheus.yml").read_text())
    malleus = next(s for s in cfg["scrape_configs"] if s["job_name"] == "malleus")
    assert malleus["honor_labels"] is True
    assert malleus["file_sd_configs"][0]["files"] == ["/tmp/ray/malleus/metrics_sd/*.json"]

    from ray.autoscaler._private.util import prepare_config, validate_config
    validate_config(prepare_config(yaml.safe_load((REPO / "deploy/ray-cluster.yaml").read_text())))

    from malleus_svc.config.job import load_job_config
    for name in ("raycluster.yaml", "rayjob.yaml"):
        doc = yaml.safe_load((REPO / "deploy/kuberay" / name).read_text())
        spec = doc["spec"].get("rayClusterSpec", doc["spec"])
        gpus = [c["resources"]["limits"].get("nvidia.com/gpu") for g in spec["workerGroupSpecs"]
                for c in g["template"]["spec"]["containers"]]
        assert gpus and all(g == "8" for g in gpus), (name, gpus)
        envs = [e["name"] for c in spec["headGroupSpec"]["template"]["spec"]["containers"] for e in c["env"]]
        assert "RAY_AUTH_MODE" in envs and "RAY_AUTH_TOKEN" in envs     # token auth stays on
        # the job file's corpus and TensorBoard logs are on the volume every pod mounts; every pod has
        # the object store's settings, where the checkpoints go
        pods = [spec["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"] for g in spec["workerGroupSpecs"]]
        for pod in pods:
            assert {"name": "shared", "mountPath": "/shared"} in pod["containers"][0]["volumeMounts"], name
            assert {"name": "shared", "persistentVolumeClaim": {"claimName": "malleus-shared"}} in pod["volumes"], name
            assert {"secretRef": {"name": "malleus-storage"}} in pod["containers"][0]["envFrom"], name
        if doc["kind"] == "RayJob":
            entry = doc["spec"]["entrypoint"].split()
            assert entry[:3] == ["python", "-m", "malleus_svc.train"]
            job = load_job_config(REPO / entry[3])
            assert job.num_devices == 8 * spec["workerGroupSpecs"][0]["replicas"]
            shared = [job.data.files[0].path, job.logging.tensorboard]
            assert all(p.startswith("/shared/") for p in shared), shared
            assert job.checkpoint.dir.startswith("s3://") and job.checkpoint.every
            assert job.eval.enabled and job.train.schedule.decay == "cosine"
            from malleus_svc.cli import main as malleus
            assert malleus(["plan", str(REPO / entry[3])]) == 0      # the real-run job file, as `malleus plan` reads it
    prov = yaml.safe_load((REPO / "deploy/grafana/provisioning/dashboards/malleus.yaml").read_text())
    assert prov["providers"][0]["type"] == "file"
    ds = yaml.safe_load((REPO / "deploy/grafana/provisioning/datasources/malleus.yaml").read_text())
    assert ds["datasources"][0]["type"] == "prometheus"


def test_the_image_installs_the_pinned_cuda_torch_then_flash_attn_against_it_then_the_package():
    hadolint = shutil.which("hadolint")
    if hadolint:
        p = subprocess.run([hadolint, "deploy/Dockerfile"], cwd=REPO, capture_output=True, text=True)
        assert p.returncode == 0, p.stdout + p.stderr
    text = (REPO / "deploy/Dockerfile").read_text().replace("\\\n", " ")
    args = dict(line.split()[1].split("=", 1) for line in text.splitlines() if line.startswith("ARG "))
    runs = [line for line in text.splitlines() if line.startswith("RUN ")]
    setup = (REPO / "scripts/setup.sh").read_text().splitlines()
    assert f'TORCH={args["TORCH_VERSION"]}' in setup                    # the project's one torch version
    assert any('"torch==$TORCH"' in line for line in setup)
    base = next(line.split()[1] for line in text.splitlines() if line.startswith("FROM "))
    assert base.endswith("-" + args["TORCH_CUDA"])                      # torch's CUDA is the base image's (nvcc)
    torch_at = next(i for i, r in enumerate(runs) if '"torch==${TORCH_VERSION}"' in r and "${TORCH_CUDA}" in r)
    flash_at = next(i for i, r in enumerate(runs) if '"flash-attn==' in r)
    package_at = next(i for i, r in enumerate(runs) if "/home/ray/malleus-svc[gpu]" in r)
    assert torch_at < flash_at < package_at
    assert "--no-build-isolation" in runs[flash_at]
    assert "--upgrade" not in runs[package_at] and "${TORCH_VERSION}" in runs[package_at]   # and checks it kept torch


def test_what_if_example_plans_the_110b_model():
    p = subprocess.run([sys.executable, "examples/what_if_110b.py", "--rate", "3=2.5", "--rate", "17=5"], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    last = p.stdout.strip().splitlines()[-1]
    speedup = float(last.rsplit("->", 1)[1].split("x")[0])
    assert speedup > 1.5, last


# Run in a child: enabling token mode loads the token into Ray's C++ core once per process, and a
# refused token left there would be sent by every later ray.init in this test process.
_REFUSAL_CHILD = r"""
import json, os, sys
from malleus_svc.service.ray_auth import AuthRefused, connecting
noise = b"[W 1 1] gcs_client.cc:210: Failed to get cluster ID from GCS server: Unauthenticated: InvalidAuthToken\n"
out = {}
try:
    with connecting():
        for _ in range(20):
            os.write(2, noise)
        os.write(2, b"a real warning\n")
        raise ConnectionError("Failed to connect to Ray cluster")
except AuthRefused as e:
    out["none"] = str(e)
def refused():
    try:
        with connecting():
            os.write(2, noise)
            raise ConnectionError("Failed to connect to Ray cluster")
    except AuthRefused as e:
        return str(e)
os.environ["RAY_AUTH_TOKEN"] = "0" * 64            # a token, refused: the wrong one
out["wrong"] = refused()
del os.environ["RAY_AUTH_TOKEN"]                   # the wrong one in ~/.ray/auth_token
os.makedirs(os.path.expanduser("~/.ray"))
with open(os.path.expanduser("~/.ray/auth_token"), "w") as f:
    f.write("1" * 64)
out["wrong_file"] = refused()
os.remove(os.path.expanduser("~/.ray/auth_token"))
try:                                                # not a refusal: passed on as it is
    with connecting():
        raise ConnectionError("nothing listens")
except ConnectionError as e:
    out["other"] = type(e).__name__
print(json.dumps(out))
"""


def test_a_refused_token_is_one_line_and_the_core_log_of_it_is_held_back(tmp_path):
    """ray_auth without a cluster: the C++ core's lines about refused handshakes (written to fd 2,
    as the core does) disappear, other lines pass, and the refusal names its cause and the fix."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env.update(HOME=str(tmp_path), PYTHONPATH=str(REPO))    # no ~/.ray/auth_token: no token anywhere
    p = subprocess.run([sys.executable, "-c", _REFUSAL_CHILD], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert "sent none" in out["none"] and "export RAY_AUTH_TOKEN" in out["none"] and "\n" not in out["none"]
    assert "refused the authentication token from RAY_AUTH_TOKEN" in out["wrong"]
    assert f"refused the authentication token from {tmp_path}/.ray/auth_token" in out["wrong_file"]
    assert "export RAY_AUTH_TOKEN" in out["wrong_file"] and "\n" not in out["wrong_file"]
    assert out["other"] == "ConnectionError"                # a ConnectionError, and not an AuthRefused
    assert "gcs_client" not in p.stderr and "a real warning" in p.stderr


def test_the_outcome_of_an_ended_job_reads_as_its_summary():
    from malleus_svc.service.outcome import format_ended

    summary = {"job": "tiny", "state": "stopped", "error": None, "steps": 37, "steps_requested": 500,
               "first_loss": 5.56, "last_loss": 4.6, "tokens_per_second": 1673.0, "train_seconds": 3.1,
               "migrations": 1, "replans": 3, "plan_id": "0a54be630818", "ended": 0.0}
    text = format_ended({"job": "tiny", "state": "SUCCEEDED", "submission_id": "raysubmit_x", "summary": summary,
                         "ray": None})
    assert text.startswith("job tiny (Ray job raysubmit_x): SUCCEEDED, 37/500 steps, ended")
    assert "5.5600 -> 4.6000" in text and "1,673 tok/s" in text and "1 migrations in 3 re-plan rounds" in text
    failed = format_ended({"job": "tiny", "state": "FAILED", "submission_id": "raysubmit_y", "summary": None,
                           "ray": {"message": "Job entrypoint command failed with exit code 1, last available logs "
                                              "(truncated to 20,000 chars):\n" + "line\n" * 50 + "KeyError: 'x'\n"}})
    assert "error: Job entrypoint command failed with exit code 1, last available logs" in failed
    assert failed.count("\n") == 2 and "(truncated to 20,000 chars): KeyError: 'x'" in failed
    assert "no summary recorded: its driver exited before recording one" in failed
    # What a driver stopped by SIGTERM recorded from its own reading (the coordinator did not answer in time).
    cut = {**summary, "state": "terminated", "migrations": None, "ended_by": "SIGTERM to the driver"}
    text = format_ended({"job": "tiny", "state": "STOPPED", "submission_id": "raysubmit_z", "summary": cut, "ray": None})
    assert "STOPPED, 37/500 steps" in text and "ended by SIGTERM to the driver" in text
    assert "? migrations in 3 re-plan rounds" in text and "no summary recorded" not in text


def test_an_ended_job_is_found_by_name_or_id_and_an_earlier_runs_record_does_not_count():
    """service/outcome.py on a fake Ray job list and fake driver records (its data come in as
    arguments): the newest run of a name answers, with its own record only; the submission id and
    the Ray job id find a run; a record alone answers for a run Ray does not list; an unknown name
    lists the recent jobs, one per name, newest first."""
    from malleus_svc.service.outcome import ended, format_ended, recent

    def run(job, sid, rid, status, start):
        return {"job": job, "submission_id": sid, "ray_job_id": rid, "status": status, "message": None,
                "start_time": start, "end_time": start + 1}

    def rec(job, sid, state="done", ended_at=0.0):
        return {"job": job, "state": state, "error": None, "steps": 6, "steps_requested": 6, "first_loss": 5.5,
                "last_loss": 5.0, "tokens_per_second": 100.0, "train_seconds": 1.0, "migrations": 0, "replans": 0,
                "plan_id": "p", "submission_id": sid, "ray_job_id": None, "ended": ended_at}

    runs = [run("tiny", "raysubmit_new", "03000000", "STOPPED", 30), run("other", "raysubmit_o", "02000000", "FAILED", 20),
            run("tiny", "raysubmit_old", "01000000", "SUCCEEDED", 10)]           # newest first, as ray_jobs gives
    records = {"tiny": rec("tiny", "raysubmit_old"), "local": rec("local", None, ended_at=5.0)}

    newest = ended("tiny", runs, records)        # the name: its newest run, whose driver recorded nothing
    assert (newest["state"], newest["submission_id"], newest["summary"]) == ("STOPPED", "raysubmit_new", None)
    assert "no summary recorded: Ray stopped the job" in format_ended(newest)
    assert ended("03000000", runs, records)["submission_id"] == "raysubmit_new"
    for key in ("raysubmit_old", "01000000"):     # the earlier run, by either id: its own record answers
        old = ended(key, runs, records)
        assert (old["state"], old["summary"]["submission_id"]) == ("SUCCEEDED", "raysubmit_old"), key
    assert format_ended(ended("raysubmit_old", runs, records)).startswith(
        "job tiny (Ray job raysubmit_old): SUCCEEDED, 6/6 steps")

    records["tiny"] = rec("tiny", "raysubmit_new", state="terminated")     # now the newest run's
    assert ended("tiny", runs, records)["summary"]["state"] == "terminated"
    assert ended("raysubmit_old", runs, records)["summary"] is None

    local = ended("local", runs, records)        # a driver outside Ray Jobs: the record alone
    assert (local["state"], local["ray"], local["submission_id"]) == ("done", None, None)
    gone = ended("raysubmit_z", [], {"x": rec("x", "raysubmit_z")})    # Ray's list no longer has it
    assert gone["job"] == "x" and gone["summary"]["submission_id"] == "raysubmit_z"

    assert ended("nope", runs, records) is None
    assert recent(runs, records) == ["tiny (STOPPED, raysubmit_new)", "other (FAILED, raysubmit_o)", "local (done)"]
    assert recent(runs, records, limit=1) == ["tiny (STOPPED, raysubmit_new)"]
    assert recent([], {}) == []
