"""Hostile input files (scenario, job, plan, checkpoint manifest) get one clear line, in bounded
time and memory: never a traceback, a hang or an exhausted machine. The reader is
malleus_svc/config/files.py, the limits malleus_svc/config/limits.py."""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from malleus_svc import cli
from malleus_svc.checkpoint.errors import CheckpointError
from malleus_svc.checkpoint.manifest import Manifest
from malleus_svc.config import ConfigError, Scenario
from malleus_svc.config.errors import shorten
from malleus_svc.config.files import parse_document
from malleus_svc.config.job import JobConfig, load_job_config
from malleus_svc.config.limits import MAX_DEVICES, MAX_FILE_BYTES, MAX_LAYERS, MAX_RATE, MAX_YAML_BYTES
from malleus_svc.plan import Plan, PlanError

REPO = Path(__file__).resolve().parent.parent
GOOD = {"name": "ok", "cluster": {"nodes": 1, "gpus_per_node": 4, "gpu_memory_mb": 16000}, "model": "tiny",
        "parallel": {"dp": 2, "tp": 1, "pp": 2}, "batch": {"global": 8, "micro": 1}}
DEEP = 100_000


def alias_bomb() -> str:
    """A ~1 KB YAML document that expands to 9**10 strings when its aliases are followed."""
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, 10):
        p = f"*a{i - 1}"
        lines.append(f"a{i}: &a{i} [{', '.join([p] * 9)}]")
    lines.append("cluster: *a9")
    return "\n".join(lines) + "\n"


def refused(tmp_path: Path, capsys, name: str, content: str | bytes, *args: str) -> str:
    """Run `malleus plan` on a file with this content; it must exit 2 with one line, returned."""
    f = tmp_path / name
    f.write_bytes(content if isinstance(content, bytes) else content.encode())
    assert cli.main(["plan", str(f), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("malleus: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert len(err) < 600, err
    return err


def good_with(**changes) -> str:
    d = json.loads(json.dumps(GOOD))
    for path, value in changes.items():
        *parents, last = path.split("__")
        node = d
        for k in parents:
            node = node.setdefault(k, {})
        node[last] = value
    return json.dumps(d)


# ---------------------------------------------------------------------- bounded refusals
def big_yaml() -> str:
    """A YAML list of small values just under the size cap (about 260,000 values)."""
    return "name: big\nrates:\n" + "- 1\n" * (MAX_YAML_BYTES // 4 - 8)


def big_json() -> str:
    """A JSON list of small values just under the size cap (about 8 million values)."""
    n = MAX_FILE_BYTES // 2 - 32
    return '{"name": "big", "rates": [' + ",".join(["1"] * n) + "]}"


def huge_batch() -> str:
    """A valid scenario whose one iteration is 10**6 micro-batches: planned in a moment, but each is
    an event of `simulate`."""
    return good_with(batch__global=10 ** 6)


@pytest.mark.parametrize("command, suffix, make, says", [
    ("plan", ".yaml", alias_bomb, "aliases"),
    ("plan", ".yaml", big_yaml, "MAX_YAML_VALUES"),
    ("plan", ".json", big_json, "MAX_VALUES"),
    ("simulate", ".json", huge_batch, "forward and backward ops"),
], ids=["alias-bomb", "yaml-under-the-size-cap", "json-under-the-size-cap", "simulate-a-huge-batch"])
def test_hostile_files_are_refused_fast_in_bounded_memory(tmp_path, command, suffix, make, says):
    f = tmp_path / f"hostile{suffix}"
    f.write_text(make())
    # CPU time and peak memory of the refusal alone (imports done first), in a fresh process: the
    # work it does, whatever else the host runs
    probe = textwrap.dedent(f"""
        import json, resource, time, sys
        from malleus_svc import cli
        import malleus_svc.simulate, malleus_svc.planner
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t = time.process_time()
        rc = cli.main([{command!r}, {str(f)!r}])
        seconds = time.process_time() - t
        grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
        print(json.dumps({{"rc": rc, "cpu_seconds": seconds, "grown_mb": grown_mb}}))
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["rc"] == 2 and got["cpu_seconds"] < 2.0 and got["grown_mb"] < 200, got
    assert out.stderr.count("\n") == 1 and says in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_the_alias_bomb_is_one_line_from_the_command_line(tmp_path):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(alias_bomb())
    assert len(bomb.read_bytes()) < 1200
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, "-m", "malleus_svc.cli", "plan", str(bomb)], capture_output=True,
                         text=True, env=env, timeout=120)
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "Traceback" not in run.stderr, run.stderr
    assert "aliases" in run.stderr


# ---------------------------------------------------------------------- output paths, and plans that do not fit
@pytest.mark.parametrize("command, flag", [(["plan", "paper-fig4-16gpu"], "--output"), (["demo"], "--summary-out"),
                                           (["train", "examples/tiny_job.yaml"], "--metrics-out")])
def test_outputs_that_cannot_be_written_are_one_line_before_any_work(tmp_path, capsys, monkeypatch, command, flag):
    """A missing folder, or a folder where a file is asked for: one line naming the option and the
    path when the arguments are parsed (for the demo and train: before Ray starts), nothing created."""
    monkeypatch.chdir(REPO)
    missing = tmp_path / "no-such-folder" / "out.json"
    for path, why in ((missing, "its folder does not exist"), (tmp_path, "is a folder")):
        with pytest.raises(SystemExit) as e:
            cli.main([*command, flag, str(path)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.endswith(f": error: {flag} {shorten(str(path))}: {why}\n"), err
        assert err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []


def test_export_into_a_file_is_one_line(tmp_path, capsys):
    (tmp_path / "taken").write_text("")
    assert cli.main(["export", str(tmp_path), str(tmp_path / "taken")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "a folder to write (or to create), not a file" in err, err


def test_a_plan_with_a_stage_the_job_cannot_have_is_one_line_before_ray_starts(tmp_path, capsys):
    """`train --plan`: a TP group of 2 in a job whose groups are 1 device (tiny_job: tp 1)."""
    from malleus_svc import train
    from malleus_svc.plan import Pipeline, Stage
    plan = Plan(num_devices=4, num_layers=4, micro_batch_size=2, gpus_per_node=4,
                pipelines=(Pipeline((Stage((0, 1), (0, 4)),), 4),), suspended=(2, 3))
    plan.save(tmp_path / "plan.json")
    assert train.main([str(REPO / "examples" / "tiny_job.yaml"), "--plan", str(tmp_path / "plan.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pipeline 0 stage 0 has 2 devices" in err and "1 devices on one node" in err, err


def test_a_job_the_planner_cannot_fit_is_one_line_from_the_training_entry_point(tmp_path, capsys):
    """`python -m malleus_svc.train` is what a submitted Ray job runs: an infeasible job (a tiny GPU
    memory) is refused in one line before Ray starts."""
    from malleus_svc import train
    job = (REPO / "examples" / "tiny_job.yaml").read_text().replace("gpu_memory_mb: 16000", "gpu_memory_mb: 1")
    (tmp_path / "job.yaml").write_text(job)
    assert train.main([str(tmp_path / "job.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: infeasible: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert "shard_optimizer leaves it to the workers: true plans it sharded" in err   # the file says nothing
    (tmp_path / "job.yaml").write_text(job.replace("pp: 2}", "pp: 2, shard_optimizer: true}"))
    assert train.main([str(tmp_path / "job.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: infeasible: ") and "shard_optimizer" not in err, err


# ---------------------------------------------------------------------- one line for each kind of hostile file
@pytest.mark.parametrize("name, content, says", [
    ("dup.yaml", "cluster: {nodes: 1}\ncluster: {nodes: 2}\n", "key = 'cluster'"),
    ("dupnested.yaml", "cluster: {nodes: 1, nodes: 2}\n", "appears twice"),
    ("dup.json", '{"cluster": {"nodes": 1, "nodes": 2}}', "appears twice"),
    ("bytes.yaml", b"name: \xff\xfe\n", "UTF-8"),
    ("bytes.json", b'{"name": "\xc3\x28"}', "UTF-8"),
    ("deep.yaml", "x: " + "[" * DEEP + "]" * DEEP + "\n", "nest"),
    ("deepblock.yaml", "".join(" " * i + "- \n" for i in range(0, 400, 2)), "nested at most"),
    ("deep.json", "[" * DEEP + "]" * DEEP, "nested at most"),
    ("deepobj.json", '{"a": ' * DEEP + "1" + "}" * DEEP, "nested at most"),
    ("digits.yaml", "cluster: {nodes: " + "9" * 5001 + "}\n", "MAX_INT_DIGITS"),
    ("digits.json", '{"cluster": {"nodes": ' + "9" * 5001 + "}}", "MAX_INT_DIGITS"),
    ("hex.yaml", "cluster: {nodes: 0x" + "f" * 300 + "}\n", "1.8e308"),
    ("e400.json", '{"cluster": {"gpu_memory_mb": 1e400}}', "number = '1e400'"),
    ("e400.yaml", "cluster: {gpu_memory_mb: 1.0e+400}\n", "1.8e308"),
    ("nan.json", '{"rates": {"1": NaN}}', "NaN and Infinity"),
    ("inf.json", '{"rates": {"1": -Infinity}}', "NaN and Infinity"),
    ("nan.yaml", "rates: {1: .nan}\n", "not .nan"),
    ("anchor.yaml", "cluster: &c {nodes: 1}\n", "anchors and aliases"),
    ("intkey.yaml", "1: 2\n", "top-level keys are field names"),
    ("nullkey.yaml", "~: 2\n", "top-level keys are field names"),
    ("listkey.yaml", "? [1, 2]\n: 3\n", "not lists or mappings"),
    ("python.yaml", "cluster: !!python/object/apply:os.system [echo hi]\n", "not valid YAML"),
    ("date.yaml", "name: 2001-13-45\n", "not valid YAML"),
    ("two.yaml", "a: 1\n---\nb: 2\n", "single document"),
    ("list.json", "[1, 2]", "mapping at the top level"),
    ("empty.json", "", "not valid JSON"),
])
def test_hostile_scenario_files_get_one_line(tmp_path, capsys, name, content, says):
    assert says in refused(tmp_path, capsys, name, content)


def test_files_over_the_size_cap_are_refused_unread(tmp_path, capsys):
    assert "MAX_YAML_BYTES" in refused(tmp_path, capsys, "big.yaml", "#" * (MAX_YAML_BYTES + 1))
    big = tmp_path / "big.json"
    with big.open("wb") as f:          # sparse: the cap, not the disk, is what is tested
        f.truncate(MAX_FILE_BYTES + 1)
    assert cli.main(["plan", str(big)]) == 2
    assert "MAX_FILE_BYTES" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["../../etc/passwd", "a b", "x" * 65, "", "tab\there", "名前", 7, None, ["a"]])
def test_bad_names_are_refused(tmp_path, capsys, name):
    assert "name = " in refused(tmp_path, capsys, "s.json", good_with(name=name))


@pytest.mark.parametrize("name", ["ok", "tiny", "llama70b-64gpu", "paper-fig4-16gpu", "a.b_c-1", "x" * 64])
def test_good_names_are_kept(name):
    assert Scenario.from_dict({**GOOD, "name": name}).name == name


@pytest.mark.parametrize("changes, says", [
    ({"rates": {"1": MAX_RATE * 10}}, "rates[1]"),
    ({"rates": {"1": 1e300}}, "<= 1000000"),
    ({"cluster__nodes": MAX_DEVICES + 1}, "cluster.nodes"),
    ({"cluster__nodes": 300, "cluster__gpus_per_node": 256}, "MAX_DEVICES"),
    ({"cluster__gpu_memory_mb": 1e12}, "cluster.gpu_memory_mb"),
    ({"model": {"preset": "tiny", "layers": MAX_LAYERS + 1}}, "model.layers"),
    ({"model": {"preset": "tiny", "hidden": 10 ** 15}}, "model.hidden"),
    ({"batch__global": 10 ** 8}, "batch.global"),
    ({"profile__t0_seconds": 1e10}, "profile.t0_seconds"),
    ({"profile__tp_alpha": [1, 0.5]}, "profile.tp_alpha"),
    ({"planner__time_limit_s": 1e300}, "planner.time_limit_s"),
    ({"cluster__nodes": 10 ** 300}, "cluster.nodes"),
])
def test_out_of_range_numbers_are_refused(tmp_path, capsys, changes, says):
    err = refused(tmp_path, capsys, "s.json", good_with(**changes))
    assert says in err and "is not valid" in err, err


def test_tp_alpha_is_at_least_one_and_non_decreasing():
    prof = {"tp_alpha": [1, 2, 1.5], "layer_memory_mb": [100, 90], "embedding_memory_mb": 10}
    d = {**GOOD, "cluster": {"nodes": 1, "gpus_per_node": 4}, "model": {"layers": 8},
         "parallel": {"dp": 1, "tp": 4, "pp": 1}, "profile": prof}
    with pytest.raises(ConfigError, match="non-decreasing"):
        Scenario.from_dict(d)
    prof["tp_alpha"] = [1, 0.9, 2]
    with pytest.raises(ConfigError, match=">= 1.0"):
        Scenario.from_dict(d)
    prof["tp_alpha"] = [1, 2, 2]
    assert Scenario.from_dict(d).profile.tp_alpha == (1.0, 2.0, 2.0)


def test_job_files_go_through_the_same_reader(tmp_path):
    f = tmp_path / "job.yaml"
    f.write_text((REPO / "examples/tiny_job.yaml").read_text() + "train: {steps: 1}\n")
    with pytest.raises(ConfigError, match="appears twice"):
        load_job_config(f)
    job = yaml.safe_load((REPO / "examples/tiny_job.yaml").read_text())
    job["control"] = {"collective_timeout_s": 1e12}
    with pytest.raises(ConfigError, match="control.collective_timeout_s"):
        JobConfig.from_dict(job)


def test_long_values_are_shortened_in_messages():
    e = ConfigError("name", "x" * 10_000, "short")
    assert len(str(e)) < 150 and "..." in str(e)
    e = ConfigError("key\nwith a newline", 10 ** 5000, "short", source="f.yaml")
    assert "\n" not in str(e)


# ---------------------------------------------------------------------- plans and manifests
def plan_dict() -> dict:
    from malleus_svc.plan import Pipeline, Stage
    return Plan(num_devices=2, num_layers=4, micro_batch_size=1,
                pipelines=(Pipeline((Stage((0,), (0, 2)), Stage((1,), (2, 4))), 2),)).to_dict()


@pytest.mark.parametrize("text, says", [
    ('{"num_devices": 2, "num_devices": 3}', "appears twice"),
    ("[" * DEEP + "]" * DEEP, "nested at most"),
    ('{"num_devices": NaN}', "NaN"),
    ('{"num_devices": ' + "9" * 5001 + "}", "MAX_INT_DIGITS"),
    (b"\xff", "UTF-8"),
])
def test_hostile_plan_files_are_one_plan_error(tmp_path, capsys, text, says):
    f = tmp_path / "plan.json"
    f.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(PlanError, match=says) as e:
        Plan.load(f)
    assert "\n" not in str(e.value)
    # the CLI's --previous reads it the same way
    scenario = tmp_path / "s.json"
    scenario.write_text(json.dumps(GOOD))
    assert cli.main(["plan", str(scenario), "--previous", str(f)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err


@pytest.mark.parametrize("field, value", [("num_devices", 10 ** 18), ("num_layers", 10 ** 12),
                                          ("micro_batch_size", 10 ** 15), ("gpus_per_node", 10 ** 300)])
def test_plan_sizes_are_bounded_before_anything_is_built(field, value):
    d = plan_dict()
    d[field] = value
    d.pop("global_batch")
    with pytest.raises(PlanError, match="config.limits"):
        Plan.from_json(json.dumps(d))


@pytest.mark.parametrize("path, value, says", [
    ("pipelines/0/stages/0/devices/0", 0.5, "pipelines[0].stages[0].devices[0] must be an integer, got 0.5"),
    ("pipelines/0/stages/1/devices/0", True, "pipelines[0].stages[1].devices[0] must be an integer, got True"),
    ("pipelines/0/stages/1/devices/0", "1", "pipelines[0].stages[1].devices[0] must be an integer, got '1'"),
    ("pipelines/0/stages/1/layers", [2, 4.0], "pipelines[0].stages[1].layers[1] must be an integer"),
    ("pipelines/0/stages/1/layers", [2], "pipelines[0].stages[1].layers must be [start, end)"),
    ("pipelines/0/stages/0", "x", "pipelines[0].stages[0] must be an object"),
    ("pipelines/0/micro_batches", 1.5, "pipelines[0].micro_batches must be an integer"),
    ("pipelines/0", [], "pipelines[0] must be an object"), ("pipelines", {}, "pipelines must be a list"),
    ("num_devices", 2.0, "num_devices must be an integer"), ("num_layers", False, "num_layers must be an integer"),
    ("excluded", "01", "excluded must be a list"), ("suspended", [0.0], "suspended[0] must be an integer"),
    ("objective", 3, "objective must be a string"), ("objective_value", "fast", "objective_value must be a finite number or null"),
    ("solve_seconds", True, "solve_seconds must be a finite number or null"), ("inputs", [1], "inputs must be an object"),
    ("global_batch", 2.0, "global_batch must be an integer"),
])
def test_previous_plans_take_whole_numbers_and_typed_fields_only(tmp_path, capsys, path, value, says):
    """`--previous` plans: device ids, layers and counts are ints as the writer writes them (a
    fraction is not truncated, a bool is not a number), the informative fields are of their type;
    one line names the field."""
    d = plan_dict()
    *parents, last = path.split("/")
    node = d
    for k in parents:
        node = node[int(k) if k.isdigit() else k]
    node[int(last) if last.isdigit() else last] = value
    with pytest.raises(PlanError, match=re.escape(says)):
        Plan.from_json(json.dumps(d))
    f, scenario = tmp_path / "bad.json", tmp_path / "s.json"
    f.write_text(json.dumps(d))
    scenario.write_text(json.dumps(GOOD))
    assert cli.main(["plan", str(scenario), "--previous", str(f)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("malleus: error: ") and err.count("\n") == 1 and says in err, err


def test_plan_numbers_beyond_any_float_are_refused_in_words():
    d = plan_dict()
    d["objective_value"] = 10 ** 400          # from a Python caller (a file refuses it earlier)
    with pytest.raises(PlanError, match="objective_value must be a finite number or null"):
        Plan.from_dict(d)


def test_plans_are_written_as_standard_json():
    from dataclasses import replace
    plan = replace(Plan.from_dict(plan_dict()), objective_value=math.inf, predicted_iteration_seconds=math.nan)
    text = plan.to_json()
    assert "Infinity" not in text and "NaN" not in text
    assert Plan.from_json(text) == plan


def test_manifests_refuse_duplicates_and_are_written_as_standard_json():
    with pytest.raises(CheckpointError, match="appears twice"):
        Manifest.from_json('{"format": "x", "format": "y"}')
    from malleus_svc.checkpoint.manifest import CheckpointMeta, build_manifest
    from malleus_svc.config import PRESETS
    meta = CheckpointMeta(step=3, shape=PRESETS["tiny"], data={"position": 3, "num_samples": 8},
                          extra={"records": [{"step": 1, "loss": math.nan}], "rate": math.inf})
    text = build_manifest(meta, {}).to_json()
    assert "NaN" not in text and "Infinity" not in text
    back = Manifest.from_json(text)
    assert back.extra["records"][0]["loss"] is None and back.step == 3


# ---------------------------------------------------------------------- fuzz: a config or a ConfigError
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

keys = (st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
        | st.sampled_from(sorted(GOOD) + ["rates", "profile", "planner", "excluded"]))
leaves = (st.none() | st.booleans() | st.integers(-(10 ** 400), 10 ** 400) | st.floats()
          | st.text(max_size=12) | st.sampled_from([1, 2, 4, 8, 16000, "tiny", 1e308, -0.0]))
docs = st.recursive(leaves, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(keys, inner, max_size=5), max_leaves=20)


@st.composite
def nested(draw):
    """A document, or GOOD with one section replaced by a generated one, wrapped in lists up to 200 deep."""
    doc = draw(docs)
    if draw(st.booleans()):
        doc = {**GOOD, draw(st.sampled_from(sorted(GOOD) + ["rates", "profile"])): doc}
    for _ in range(draw(st.integers(0, 200)) if draw(st.booleans()) else 0):
        doc = [doc]
    return doc


def load_or_refuse(data: bytes | str, fmt: str) -> None:
    """The reader and the scenario/job parsers: a value or a ConfigError, nothing else."""
    try:
        doc = parse_document(data, fmt, "fuzz")
        if isinstance(doc, dict) and all(isinstance(k, str) for k in doc):
            Scenario.from_dict({k: v for k, v in doc.items() if k != "data"}, source="fuzz")
            JobConfig.from_dict(doc, source="fuzz")
    except ConfigError as e:
        assert "\n" not in str(e) and len(str(e)) < 1000, str(e)


@FUZZ
@given(st.binary(max_size=400), st.sampled_from(["yaml", "json"]))
def test_arbitrary_bytes_give_a_config_or_a_config_error(data, fmt):
    load_or_refuse(data, fmt)
    try:
        Plan.from_json(data)
    except PlanError as e:
        assert "\n" not in str(e)


@FUZZ
@given(nested())
def test_generated_yaml_gives_a_config_or_a_config_error(doc):
    load_or_refuse(yaml.safe_dump(doc, width=1 << 20), "yaml")


@FUZZ
@given(nested())
def test_generated_json_gives_a_config_or_a_config_error(doc):
    try:
        text = json.dumps(doc)
    except (TypeError, ValueError):     # keys json cannot write (or an int beyond str conversion)
        return
    load_or_refuse(text, "json")
    try:
        Plan.from_json(text)
    except PlanError as e:
        assert "\n" not in str(e)


# ---------------------------------------------------------------------- numbers on command lines
PREP = ["prepare-data", "in.txt", "--tokenizer", "t.json", "--out", "o"]
NUMBER_OPTIONS = [   # every number option of every malleus subcommand: (command, flag, an integer?)
    (["simulate", "paper-fig4-16gpu"], "--backward-ratio", False), (["demo"], "--factor", False),
    (["demo"], "--steps", True), (["demo"], "--global-batch", True), (["demo"], "--nodes", True),
    (["train", "examples/tiny_job.yaml"], "--steps", True), (["train", "examples/tiny_job.yaml"], "--metrics-port", True),
    (PREP, "--train-tokenizer", True), (PREP, "--workers", True),
    (["bench", "malleable"], "--factor", False), (["bench", "prepare-data"], "--mb", False),
    (["bench", "lengths-runtime"], "--factor", False), (["bench", "lengths-runtime"], "--time-limit", False),
    (["bench", "planner-scale"], "--budget", False), (["bench", "planner-reference"], "--steps", True),
    (["bench", "simulate"], "--planner-timeout", False),
    (["bench", "simulate"], "--restart-seconds", False), (["bench", "simulate"], "--checkpoint-minutes", False),
    (["bench", "lengths"], "--rate", False), (["bench", "lengths"], "--ilp-time-limit", False),
    (["bench", "lengths"], "--pack-time-limit", False), (["bench", "lengths"], "--pack-total", False),
]


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e400", "-5", "abc", "", "9" * 5000, "2.5"])
@pytest.mark.parametrize("command, flag, integer", NUMBER_OPTIONS, ids=[f"{c[0]}-{c[1] if c[0] == 'bench' else ''}{f}"
                                                                         for c, f, _ in NUMBER_OPTIONS])
def test_number_options_refuse_bad_values_in_one_line(capsys, monkeypatch, command, flag, integer, value):
    """Not a number, not finite, out of range (or a fraction for a count): exit 2 and one line with
    the accepted range, before the command does anything (no usage block, no traceback)."""
    if value == "2.5" and not integer:
        value = "1e300"                   # above every float option's range
    monkeypatch.chdir(REPO)
    with pytest.raises(SystemExit) as e:
        cli.main([*command, f"{flag}={value}"])     # = : "-inf" is a value, not an option
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and f"error: {flag} must be " in err and " in [" in err, err
    assert len(err) < 300, err


def test_every_number_option_checks_its_range():
    """argparse's type=float takes nan and inf: no command parses a number that way."""
    for path in [*(REPO / "malleus_svc").rglob("*.py"), *(REPO / "benchmarks").rglob("*.py")]:
        text = path.read_text()
        assert "type=float" not in text.replace("`type=float`", ""), path
        assert path.relative_to(REPO).parts[0] == "benchmarks" or "type=int" not in text, path
