"""Plan-agnostic sharded checkpoints (malleus_svc/checkpoint): a resume under another plan on another
number of devices continues exactly like the uninterrupted run; the workers write and read their own
pieces; damaged, truncated, incomplete or crashed checkpoints are never loaded; a file that is not
safetensors (a pickle smuggling code) is refused unread; the writer runs in the background and its
errors surface.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from malleus_svc.checkpoint import (CheckpointError, CheckpointMeta, CheckpointMismatchError, CheckpointWriter,
                                    group_meta, list_checkpoints, load_checkpoint, load_latest, read_manifest,
                                    restore_group, save_group)
from malleus_svc.checkpoint.layout import tmp_dir_name
from malleus_svc.config.errors import ConfigError
from malleus_svc.config.presets import PRESETS
from malleus_svc.runtime.engine import EXP_AVG, EXP_AVG_SQ, STEP
from malleus_svc.geometry import model_parts
from malleus_svc.runtime.model import init_part

from _plans import make_plan

REPO = Path(__file__).resolve().parent.parent
TINY = PRESETS["tiny"]


def make_state(shape=TINY, seed=0, step=3) -> dict[str, torch.Tensor]:
    """A full flat state (as WorkerGroup.full_state gives it) with non-trivial Adam moments."""
    g = torch.Generator().manual_seed(seed + 1000)
    out = {}
    for part in model_parts(shape.layers):
        for name, t in init_part(shape, part, seed).items():
            out[name] = t
            out[name + EXP_AVG] = torch.randn(t.shape, generator=g)
            out[name + EXP_AVG_SQ] = torch.rand(t.shape, generator=g)
            out[name + STEP] = torch.tensor(step)
    return out


def meta(step, shape=TINY, position=None):
    pos = 8 * step if position is None else position
    return CheckpointMeta(step=step, shape=shape,
                          data={"version": 1, "position": pos, "global_batch": 8, "seed": 3, "num_samples": 64})


def assert_same(a, b):
    assert set(a) == set(b)
    for k in sorted(a):
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def write_steps(root, steps, keep_last=None):
    with CheckpointWriter(root, keep_last=keep_last) as w:
        for s in steps:
            w.save(make_state(seed=s, step=s), meta(s))


# --------------------------------------------------------------------------- format, no Ray
def test_format_shard_files_and_a_complete_manifest(tmp_path):
    state = make_state(step=5)
    plan = make_plan([([((0,), (0, 4))], 4)], suspended=(1,), num_devices=2, layers=4, gpn=2, mbs=2)
    with CheckpointWriter(tmp_path) as w:
        result = w.save(state, dataclasses.replace(meta(5, position=70), plan=plan, extra={"job": "t"}))
    d = tmp_path / "step-00000005"
    assert result.path == d and sorted(os.listdir(tmp_path)) == ["step-00000005"]   # no working dirs left
    files = sorted(os.listdir(d))
    assert files == ["block-0000.safetensors", "block-0001.safetensors", "block-0002.safetensors",
                     "block-0003.safetensors", "embedding.safetensors", "head.safetensors", "manifest.json"]
    m = json.loads((d / "manifest.json").read_text())
    assert m["format_version"] == 2 and m["step"] == 5 and m["model_shape"] == TINY.to_dict()
    assert m["data"]["sampler"]["position"] == 70 and (m["data"]["epoch"], m["data"]["offset"]) == (1, 6)
    assert m["plan"]["plan_id"] == plan.plan_id and m["extra"] == {"job": "t"} and m["created"].endswith("Z")
    for name, entry in m["files"].items():
        assert entry["bytes"] == (d / name).stat().st_size
    assert result.bytes == sum(f.stat().st_size for f in d.iterdir())
    # A whole-tensor file holds all rows of its part's tensors (rows along the split dim: w_down's columns).
    assert m["files"]["block-0002.safetensors"]["tensors"]["blocks.2.mlp.w_down"] == {"rows": [0, TINY.ffn], "step": 5}
    from safetensors.torch import load_file
    block = load_file(str(d / "block-0002.safetensors"))
    assert sorted(block) == sorted(n for n in state if n.startswith("blocks.2.") and not n.endswith(STEP))
    assert torch.equal(block["blocks.2.mlp.w_down:exp_avg_sq"], state["blocks.2.mlp.w_down:exp_avg_sq"])
    ckpt = load_latest(tmp_path, TINY)
    assert ckpt.step == 5 and ckpt.skipped == [] and ckpt.manifest.plan_obj() == plan
    assert_same(ckpt.state, state)


def test_a_llama3_shape_round_trips_and_another_rotary_base_is_another_model(tmp_path):
    from malleus_svc.config.presets import RopeScaling

    llama3 = dataclasses.replace(TINY, norm_eps=1e-6, rope_theta=500000.0, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 16))
    with CheckpointWriter(tmp_path) as w:
        w.save(make_state(step=2), meta(2, shape=llama3))
    ckpt = load_latest(tmp_path, llama3)
    assert ckpt.manifest.shape == llama3 and ckpt.step == 2
    with pytest.raises(CheckpointError, match="rope_theta"):
        load_latest(tmp_path, dataclasses.replace(llama3, rope_theta=10000.0))


def test_a_manifest_of_the_older_format_is_refused_in_one_line(tmp_path):
    write_steps(tmp_path, [1])
    f = tmp_path / "step-00000001" / "manifest.json"
    doc = json.loads(f.read_text())
    doc.pop("manifest_sha256")
    doc["format_version"] = 1
    doc["manifest_sha256"] = hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()
    f.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(f.parent)
    assert "format_version 1" in str(e.value) and "older build" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("edit, reason", [
    (lambda t: t["blocks.1.attn.wq"].update(rows=[0, 32]), r"pieces of blocks.1.attn.wq cover rows \['\[0, 32\)'\]"),
    (lambda t: t["blocks.1.attn.wq"].update(rows=[0, 65]), r"rows = \[0, 65\] is not valid"),
    (lambda t: t["blocks.1.attn.wq"].update(step=-1), r"step = -1 is not valid"),
    (lambda t: t.update({"blocks.2.attn.wq": {"rows": [0, 64], "step": 3}}), "part 1 has no such tensor"),
])
def test_manifest_pieces_that_do_not_cover_the_model_once_are_skipped(tmp_path, edit, reason):
    """Re-signed manifests whose pieces leave rows uncovered, overrun a tensor, disagree about the
    Adam step or name a tensor of another part: skipped with the reason, the older one loaded."""
    write_steps(tmp_path, [1, 2])
    f = tmp_path / "step-00000002" / "manifest.json"
    doc = json.loads(f.read_text())
    doc.pop("manifest_sha256")
    edit(doc["files"]["block-0001.safetensors"]["tensors"])
    doc["manifest_sha256"] = hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()
    f.write_text(json.dumps(doc))
    ckpt = load_latest(tmp_path, TINY)
    assert ckpt.step == 1 and re.search(reason, ckpt.skipped[0][1]), ckpt.skipped
    assert "\n" not in ckpt.skipped[0][1]


def test_shape_mismatch_is_rejected_with_field_value_accepted(tmp_path):
    write_steps(tmp_path, [1, 2])
    other = dataclasses.replace(TINY, hidden=128)
    with pytest.raises(CheckpointMismatchError) as e:
        load_latest(tmp_path, other)     # raised, not "fall back to an older one"
    assert isinstance(e.value, ConfigError) and isinstance(e.value, CheckpointError)
    assert (e.value.field, e.value.value) == ("model_shape.hidden", 64)
    assert "hidden = 128" in e.value.accepted and "step-00000002" in str(e.value)
    # The writer refuses a state that is not the full state of the model it claims.
    with pytest.raises(CheckpointError, match="shape"):
        CheckpointWriter(tmp_path / "w").save(make_state(), meta(1, shape=dataclasses.replace(TINY, ffn=256)))
    shard = make_state()
    shard["blocks.0.attn.wq"] = shard["blocks.0.attn.wq"][:32]
    with pytest.raises(CheckpointError, match=r"blocks.0.attn.wq has shape \(32, 64\).*\(64, 64\)"):
        CheckpointWriter(tmp_path / "w").save(shard, meta(1))


def test_retention_keeps_the_last_k_and_a_step_can_be_rewritten(tmp_path):
    write_steps(tmp_path, [1, 2, 3, 4], keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000004", "step-00000003"]
    assert sorted(os.listdir(tmp_path)) == ["step-00000003", "step-00000004"]
    with CheckpointWriter(tmp_path, keep_last=2) as w:   # the same step again (resumed from an older one)
        w.save(make_state(seed=40, step=4), meta(4))
    assert_same(load_latest(tmp_path).state, make_state(seed=40, step=4))
    assert sorted(os.listdir(tmp_path)) == ["step-00000003", "step-00000004"]
    with pytest.raises(CheckpointError, match="keep_last"):
        CheckpointWriter(tmp_path, keep_last=0)


# --------------------------------------------------------------------------- corruption
def _flip(path: Path, offset_fraction=0.6):
    data = bytearray(path.read_bytes())
    i = int(len(data) * offset_fraction)
    data[i] ^= 0x40
    path.write_bytes(bytes(data))


def _truncate(path: Path):
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


@pytest.mark.parametrize("damage, reason", [
    ("flip", r"block-0001.safetensors sha256 mismatch: expected [0-9a-f]{64}, actual [0-9a-f]{64}"),
    ("truncate", r"head.safetensors has \d+ bytes, the manifest says \d+ \(truncated"),
    ("delete_file", r"embedding.safetensors is missing"),
    ("no_manifest", r"no manifest.json \(an incomplete checkpoint\)"),
    ("edit_manifest", r"manifest checksum mismatch"),
])
def test_damaged_checkpoint_falls_back_to_the_previous_good_one(tmp_path, caplog, damage, reason):
    write_steps(tmp_path, [1, 2, 3])
    d3 = tmp_path / "step-00000003"
    expected_sha = read_manifest(d3).files["block-0001.safetensors"].sha256
    if damage == "flip":
        _flip(d3 / "block-0001.safetensors")
    elif damage == "truncate":
        _truncate(d3 / "head.safetensors")
    elif damage == "delete_file":
        (d3 / "embedding.safetensors").unlink()
    elif damage == "no_manifest":
        (d3 / "manifest.json").unlink()
    else:  # still valid JSON, only the data position changed: the manifest's own checksum catches it
        text = (d3 / "manifest.json").read_text()
        assert '"position": 24' in text
        (d3 / "manifest.json").write_text(text.replace('"position": 24', '"position": 25'))
    with caplog.at_level(logging.WARNING, logger="malleus_svc.checkpoint"):
        ckpt = load_latest(tmp_path, TINY)
    assert ckpt.step == 2
    assert_same(ckpt.state, make_state(seed=2, step=2))
    assert [p.name for p, _ in ckpt.skipped] == ["step-00000003"]
    assert re.search(reason, ckpt.skipped[0][1]), ckpt.skipped
    assert any("step-00000003" in r.getMessage() and "skipping" in r.getMessage() for r in caplog.records)
    with pytest.raises(CheckpointError) as e:   # loading it directly is an error naming the file
        load_checkpoint(d3)
    assert e.value.path == d3
    if damage == "flip":
        assert expected_sha in str(e.value)


def test_incomplete_work_dirs_are_ignored_and_cleaned(tmp_path):
    write_steps(tmp_path, [1, 2])
    # A writer that died after writing every file and the manifest, before the rename: complete
    # content, but not published. pid 99999999 is above any pid_max, so never alive.
    dead = tmp_path / tmp_dir_name(3, pid=99999999)
    dead.mkdir()
    with CheckpointWriter(tmp_path / "scratch") as w:
        w.save(make_state(seed=3, step=3), meta(3))
    for f in (tmp_path / "scratch" / "step-00000003").iterdir():
        (dead / f.name).write_bytes(f.read_bytes())
    retired = tmp_path / "step-00000000.del-99999999"
    retired.mkdir()
    ckpt = load_latest(tmp_path, TINY)
    assert ckpt.step == 2 and ckpt.skipped == []       # not even considered
    CheckpointWriter(tmp_path)                          # a new writer cleans what dead writers left
    assert not dead.exists() and not retired.exists()
    mine = tmp_path / tmp_dir_name(9)                   # this process is alive: left alone
    mine.mkdir()
    CheckpointWriter(tmp_path)
    assert mine.exists()


def test_no_good_checkpoint_is_an_error_naming_each(tmp_path):
    assert load_latest(tmp_path / "nothing-here") is None
    write_steps(tmp_path, [1, 2])
    _flip(tmp_path / "step-00000001" / "embedding.safetensors")
    (tmp_path / "step-00000002" / "manifest.json").unlink()
    with pytest.raises(CheckpointError) as e:
        load_latest(tmp_path)
    assert "step-00000002: manifest.json" not in str(e.value)  # reasons are per checkpoint, named
    assert "step-00000002: no manifest.json" in str(e.value) and "step-00000001: embedding.safetensors sha256" in str(e.value)


# --------------------------------------------------------------------------- data, never code
class Payload:
    """Creates a directory when unpickled: the stand-in for code smuggled into a checkpoint."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def test_a_pickle_in_place_of_a_shard_file_is_refused_not_executed(tmp_path):
    write_steps(tmp_path, [1, 2])
    d2 = tmp_path / "step-00000002"
    marker = tmp_path / "code-ran"
    torch.save({"embedding.weight": Payload(str(marker))}, d2 / "embedding.safetensors.new")
    os.replace(d2 / "embedding.safetensors.new", d2 / "embedding.safetensors")
    _resign(d2, "embedding.safetensors")   # as an attacker with write access would: only the format stands in the way
    with pytest.raises(CheckpointError, match=r"embedding.safetensors is not a readable safetensors file"):
        load_checkpoint(d2)
    assert not marker.exists()
    ckpt = load_latest(tmp_path)
    assert ckpt.step == 1 and "not a readable safetensors file" in ckpt.skipped[0][1] and not marker.exists()
    # The payload is live: an unsafe load would have run it.
    with open(d2 / "embedding.safetensors", "rb") as f:   # a file object: torch.load reads the pickle
        torch.load(f, weights_only=False)
    assert marker.exists()


def _resign(d: Path, name: str, **entry) -> None:
    """Rewrite the manifest's entry for `name` (and its own sha256), as an attacker with write access would."""
    import hashlib

    m = read_manifest(d)
    files = dict(m.files)
    if not entry:
        data = (d / name).read_bytes()
        entry = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    files[name] = dataclasses.replace(files[name], **entry)
    (d / "manifest.json").write_text(dataclasses.replace(m, files=files).to_json())


EMB = "embedding.safetensors"


def _symlink_out(d: Path, outside: Path) -> None:
    (outside / "stolen").write_bytes((d / EMB).read_bytes())
    (d / EMB).unlink()
    (d / EMB).symlink_to(outside / "stolen")


def _fifo(d: Path, outside: Path) -> None:
    (d / EMB).unlink()
    os.mkfifo(d / EMB)


def _sparse(d: Path, outside: Path) -> None:
    with open(d / EMB, "r+b") as f:
        f.truncate(8 << 30)                      # 8 GiB of holes: a read of it all would take minutes


def _sparse_promised(d: Path, outside: Path) -> None:
    _sparse(d, outside)
    _resign(d, EMB, bytes=8 << 30)   # and a manifest that says so


def _float64(d: Path, outside: Path) -> None:
    from safetensors.torch import load_file, save_file

    good = load_file(str(d / EMB))
    good["embedding.weight:exp_avg"] = good["embedding.weight:exp_avg"].double()
    (d / EMB).unlink()
    save_file(good, str(d / EMB))
    _resign(d, EMB)


@pytest.mark.parametrize("craft, reason", [
    (_symlink_out, f"{EMB} is a symlink"), (_fifo, f"{EMB} is not a regular file"),
    (_sparse, "has 8589934592 bytes, the manifest says"), (_sparse_promised, "take at most"),
    (_float64, "expected a float32 tensor"),
])
def test_crafted_part_files_are_skipped_before_they_are_read(tmp_path, craft, reason):
    """A FIFO, a symlink out of the directory, a sparse 8 GiB file (with or without a manifest
    promising it) and a tensor of the wrong dtype: the checkpoint is skipped with the reason, in
    bounded time (nothing blocks or reads gigabytes), and the previous good one is loaded."""
    root, outside = tmp_path / "ckpt", tmp_path / "outside"
    outside.mkdir()
    write_steps(root, [1, 2])
    craft(root / "step-00000002", outside)
    done: dict = {}

    def read() -> None:
        cpu = time.thread_time()
        done.update(ckpt=load_latest(root))
        done["cpu"] = time.thread_time() - cpu

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(60)
    if reader.is_alive() and os.path.exists(root / "step-00000002" / EMB):
        with contextlib.suppress(OSError):   # unblock a reader stuck on the FIFO before failing
            os.close(os.open(root / "step-00000002" / EMB, os.O_WRONLY | os.O_NONBLOCK))
    assert not reader.is_alive(), "the reader blocked"
    assert done["cpu"] < 5, f"the reader read too much: {done['cpu']:.1f} s of CPU"   # whatever else the host runs
    ckpt = done["ckpt"]
    assert ckpt.step == 1 and len(ckpt.skipped) == 1 and reason in ckpt.skipped[0][1], ckpt.skipped


# --------------------------------------------------------------------------- asynchronous writer
def _set(doc: dict, path: str, value) -> None:
    *parents, last = path.split("/")
    for k in parents:
        doc = doc[k]
    doc[last] = value


@pytest.mark.parametrize("path, value", [
    ("files", []), ("files", "x"), ("data", ["sampler"]), ("data/sampler", 5), ("model_shape", [4, 64]),
    ("model_shape/layers", "4"), ("model_shape/hidden", 10 ** 12), ("model_shape/heads", True), ("model_shape/kv_heads", 0.5),
    ("step", "2"), ("step", 2.5), ("created_unix", "now"), ("plan", []), ("optim", 3), ("extra", "x"),
    ("files/embedding.safetensors", None), ("files/embedding.safetensors", []),
    ("files/embedding.safetensors/bytes", "100"), ("files/embedding.safetensors/sha256", 7),
    ("files/embedding.safetensors/part", False), ("files/embedding.safetensors/tensors", [1]),
])
def test_malformed_manifests_with_a_valid_checksum_are_skipped_with_the_reason(tmp_path, path, value):
    """A manifest that is valid JSON with a correct manifest_sha256 (as an attacker with write
    access, or a bug in a writer, would leave it) but a field of the wrong type or out of range: the
    checkpoint is skipped naming the field, and the older good one is loaded."""
    write_steps(tmp_path, [1, 2])
    f = tmp_path / "step-00000002" / "manifest.json"
    doc = json.loads(f.read_text())
    doc.pop("manifest_sha256")
    _set(doc, path, value)
    doc["manifest_sha256"] = hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()
    f.write_text(json.dumps(doc))
    ckpt = load_latest(tmp_path, TINY)
    assert ckpt.step == 1 and [p.name for p, _ in ckpt.skipped] == ["step-00000002"]
    reason = ckpt.skipped[0][1]
    assert reason.startswith("manifest.json: ") and path.replace("/", ".") in reason and "\n" not in reason, reason


def test_error_in_the_writer_thread_surfaces_on_the_next_call(tmp_path):
    root = tmp_path / "ckpt"
    w = CheckpointWriter(root)
    root.rmdir()
    root.write_text("the root is now a file: the thread's mkdir fails")
    w.save_async(make_state(), meta(5))                  # returns: the failure is in the thread
    with pytest.raises(CheckpointError, match="checkpoint of step 5 failed: NotADirectoryError") as e:
        w.wait()
    assert isinstance(e.value.__cause__, NotADirectoryError)
    assert w.wait() is None                               # raised once, then cleared
    # ... and the next save_async raises the previous failure before starting anything.
    w.save_async(make_state(), meta(6))
    while w.busy:                                         # let it fail, without collecting the error
        time.sleep(0.01)
    root.unlink()
    root.mkdir()
    with pytest.raises(CheckpointError, match="step 6 failed"):
        w.save_async(make_state(), meta(7))
    w.save_async(make_state(seed=7, step=7), meta(7))
    assert w.wait().step == 7
    assert load_latest(root).step == 7


def _lost_writer(folder):
    def written():
        raise RuntimeError("device 3 was lost while writing")
    return written


def _embedding_only(folder):
    from malleus_svc.checkpoint.layout import whole_pieces
    from malleus_svc.runtime.shard_files import write_part

    name, entry = write_part(folder, "embedding", 0, whole_pieces(make_state(step=4), TINY)["embedding"])
    return lambda: {name: entry}


@pytest.mark.parametrize("write_shards, reason", [
    (_lost_writer, "RuntimeError: device 3 was lost while writing"),
    (_embedding_only, r"CheckpointError: .*the pieces of blocks.0.attn_norm.weight cover rows none"),
])
def test_a_sharded_save_that_fails_surfaces_on_the_next_call_and_publishes_nothing(tmp_path, write_shards, reason):
    """The writers' files come back with an error, or do not cover the model: the save fails at the
    next call, naming why, and no directory (published or temporary) is left."""
    w = CheckpointWriter(tmp_path)
    assert w.save_shards_async(write_shards, meta(4)) == tmp_path / "step-00000004"
    with pytest.raises(CheckpointError, match="checkpoint of step 4 failed: " + reason):
        w.wait()
    assert os.listdir(tmp_path) == [] and load_latest(tmp_path) is None


def test_save_async_returns_before_the_write_and_the_state_is_the_one_handed_over(tmp_path):
    release, reached = threading.Event(), threading.Event()

    def hold(name, path):
        reached.set()
        assert release.wait(30)

    state = make_state(step=3)
    w = CheckpointWriter(tmp_path, on_file_written=hold)
    final = w.save_async(state, meta(3))
    assert reached.wait(30) and w.busy and not final.exists()
    state.clear()   # the caller's dict is its own again at once (tensors: not modified in place, see writer.py)
    release.set()
    assert w.wait().path == final
    assert_same(load_latest(tmp_path).state, make_state(step=3))


# --------------------------------------------------------------------------- crash during a write
CRASH_SCRIPT = textwrap.dedent("""
    import sys, time, torch
    from pathlib import Path
    from malleus_svc.checkpoint import CheckpointMeta, CheckpointWriter
    from malleus_svc.config.presets import ModelShape
    from malleus_svc.runtime.engine import EXP_AVG, EXP_AVG_SQ, STEP
    from malleus_svc.geometry import model_parts
    from malleus_svc.runtime.model import init_part

    root, mode = Path(sys.argv[1]), sys.argv[2]
    shape = ModelShape.from_dict(__import__("json").loads(sys.argv[3]))

    def state(step):
        out = {}
        for p in model_parts(shape.layers):
            for n, t in init_part(shape, p, step).items():
                out[n], out[n + EXP_AVG], out[n + EXP_AVG_SQ], out[n + STEP] = t, t * 0.5, t * t, torch.tensor(step)
        return out

    def meta(step):
        return CheckpointMeta(step=step, shape=shape, data={"version": 1, "position": 8 * step, "global_batch": 8,
                                                            "seed": 3, "num_samples": 64})

    if mode == "loop":      # keep writing until killed
        w = CheckpointWriter(root, keep_last=2)
        for step in range(1, 10_000):
            w.save(state(step), meta(step))
            print("saved", step, flush=True)
    else:                   # write step 1, then stop for good inside step 2 after file `mode`
        CheckpointWriter(root).save(state(1), meta(1))

        def hook(name, path):
            if name == mode:
                (root / "paused").write_text(str(path))
                time.sleep(600)

        CheckpointWriter(root, on_file_written=hook).save(state(2), meta(2))
""")


def _spawn(tmp_path, mode, shape):
    script = tmp_path / "writer.py"
    script.write_text(CRASH_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    return subprocess.Popen([sys.executable, str(script), str(tmp_path / "ckpt"), mode, json.dumps(shape.to_dict())],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _kill(proc):
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read()[-2000:]


@pytest.mark.parametrize("point", ["embedding.safetensors", "manifest.json"])
def test_sigkill_mid_write_never_yields_a_partial_checkpoint(tmp_path, point):
    proc = _spawn(tmp_path, point, TINY)
    root, paused = tmp_path / "ckpt", tmp_path / "ckpt" / "paused"
    try:
        deadline = time.monotonic() + 90
        while not paused.exists():
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "the writer never reached the pause point"
            time.sleep(0.05)
    finally:
        _kill(proc)
    ckpt = load_latest(root, TINY)
    assert ckpt.step == 1 and ckpt.skipped == [] and ckpt.manifest.sampler_state["position"] == 8
    assert not (root / "step-00000002").exists()
    tmp = root / tmp_dir_name(2, pid=proc.pid)
    assert tmp.is_dir() and (tmp / point).exists()        # the write really was under way
    CheckpointWriter(root)                                  # the next writer cleans up after the dead one
    assert not tmp.exists() and load_latest(root).step == 1


def test_sigkill_at_a_random_moment_of_repeated_writes(tmp_path):
    """No pause: a ~50 MB state written over and over with retention, killed at a random moment."""
    shape = dataclasses.replace(TINY, hidden=256, ffn=1024)
    proc = _spawn(tmp_path, "loop", shape)
    delay = random.uniform(0.0, 1.0)
    try:
        first = proc.stdout.readline()
        assert first.startswith("saved 1"), proc.stderr.read()[-3000:]
        time.sleep(delay)
    finally:
        _kill(proc)
    saved = [1] + [int(line.split()[1]) for line in proc.stdout.read().splitlines() if line.startswith("saved")]
    ckpt = load_latest(tmp_path / "ckpt", shape)
    print(f"killed {delay:.2f} s after the first save; saves reported {saved}, loaded step {ckpt.step}")
    # The newest published one is the last reported, or the next if it was published but not yet printed.
    assert ckpt.step in (saved[-1], saved[-1] + 1), (delay, saved, ckpt.step)
    assert ckpt.skipped == [], (delay, ckpt.skipped)
    assert torch.equal(ckpt.state["blocks.1.attn.wo"], init_part(shape, 1, ckpt.step)["blocks.1.attn.wo"])


# --------------------------------------------------------------------------- object storage: a real S3 server on loopback
def _objects(s3: str, prefix: str) -> dict[str, bytes]:
    """What the server holds under `prefix`, read by a client of its own (boto3, not pyarrow); the
    empty markers pyarrow leaves for a prefix emptied under it are not objects of ours."""
    import boto3

    client, bucket = boto3.client("s3"), s3.removeprefix("s3://")
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
            if not o["Key"].endswith("/")]
    return {k: client.get_object(Bucket=bucket, Key=k)["Body"].read() for k in keys}


def _put(s3: str, key: str, data: bytes) -> None:
    import boto3

    boto3.client("s3").put_object(Bucket=s3.removeprefix("s3://"), Key=key, Body=data)


def test_checkpoints_in_an_object_store_round_trip_with_retention_and_export(s3, tmp_path):
    from malleus_svc.checkpoint.hf import export_checkpoint

    root = f"{s3}/runs/a"
    write_steps(root, [2, 4, 6], keep_last=2)
    assert [str(p) for p in list_checkpoints(root)] == [f"{root}/step-00000006", f"{root}/step-00000004"]
    stored = _objects(s3, "runs/a/")
    assert sorted({k.split("/")[2] for k in stored}) == ["step-00000004", "step-00000006"]   # step 2 retired
    local = tmp_path / "local"
    write_steps(local, [6])
    # The same files, byte for byte, as a local checkpoint of the same state: only the place differs.
    for f in (local / "step-00000006").iterdir():
        if f.name != "manifest.json":
            assert stored[f"runs/a/step-00000006/{f.name}"] == f.read_bytes(), f.name
    ckpt = load_latest(root, TINY)
    assert ckpt.step == 6 and str(ckpt.path) == f"{root}/step-00000006" and ckpt.skipped == []
    assert_same(ckpt.state, make_state(seed=6, step=6))
    with CheckpointWriter(root, keep_last=2) as w:      # a step written again (resumed from an older one)
        w.save(make_state(seed=60, step=6), meta(6))
    assert_same(load_latest(root, TINY).state, make_state(seed=60, step=6))
    # Export, from the store into the store and into a folder: the same bytes.
    out, shape, step = export_checkpoint(root, f"{s3}/hf/a")
    assert (str(out), step) == (f"{s3}/hf/a", 6)
    export_checkpoint(f"{root}/step-00000006", tmp_path / "hf")
    exported = _objects(s3, "hf/a/")
    assert exported.keys() == {"hf/a/config.json", "hf/a/model.safetensors"}
    for name in ("config.json", "model.safetensors"):
        assert exported[f"hf/a/{name}"] == (tmp_path / "hf" / name).read_bytes(), name


def test_a_failed_or_partial_upload_is_never_taken_for_a_checkpoint(s3, caplog):
    root = f"{s3}/run"
    write_steps(root, [2])

    def connection_lost(name, path):
        if name != "manifest.json":
            raise OSError("connection reset by peer")

    w = CheckpointWriter(root, on_file_written=connection_lost)
    w.save_async(make_state(seed=4, step=4), meta(4))
    with pytest.raises(CheckpointError, match="step 4 failed: OSError: connection reset by peer"):
        w.wait()
    assert not _objects(s3, "run/step-00000004/"), "the failed upload's pieces were not removed"
    # A writer killed mid-upload removes nothing: its pieces stay, without the manifest.
    for key, data in _objects(s3, "run/step-00000002/").items():
        if not key.endswith("manifest.json"):
            _put(s3, key.replace("step-00000002", "step-00000008"), data)
    with caplog.at_level(logging.WARNING, logger="malleus_svc.checkpoint"):
        ckpt = load_latest(root, TINY)
    assert ckpt.step == 2
    assert [(p.name, why) for p, why in ckpt.skipped] == [("step-00000008", "no manifest.json (an incomplete checkpoint)")]


@pytest.mark.parametrize("damage, reason", [
    ("flip", r"block-0001.safetensors sha256 mismatch: expected [0-9a-f]{64}, actual [0-9a-f]{64}"),
    ("truncate", r"head.safetensors has \d+ bytes, the manifest says \d+ \(truncated"),
    ("delete_file", r"embedding.safetensors is missing"),
    ("edit_manifest", r"manifest checksum mismatch"),
    ("huge_manifest", r"manifest.json cannot be read: at most \d+ bytes"),
    ("pickle", r"embedding.safetensors is not a readable safetensors file"),
])
def test_a_damaged_object_is_refused_and_the_previous_checkpoint_used(s3, tmp_path, damage, reason):
    """The checkpoint reader's rules hold for objects: size before a byte is read, sha256 before a
    byte is used, the manifest's own checksum and size cap, data and never code."""
    from malleus_svc.config.limits import MAX_FILE_BYTES

    root = f"{s3}/run"
    write_steps(root, [1, 2, 3])
    d3 = "run/step-00000003/"
    objects = _objects(s3, d3)
    if damage == "flip":
        data = bytearray(objects[d3 + "block-0001.safetensors"])
        data[int(len(data) * 0.6)] ^= 0x40
        _put(s3, d3 + "block-0001.safetensors", bytes(data))
    elif damage == "truncate":
        _put(s3, d3 + "head.safetensors", objects[d3 + "head.safetensors"][:100])
    elif damage == "delete_file":
        import boto3
        boto3.client("s3").delete_object(Bucket=s3.removeprefix("s3://"), Key=d3 + "embedding.safetensors")
    elif damage == "edit_manifest":
        text = objects[d3 + "manifest.json"].decode()
        _put(s3, d3 + "manifest.json", text.replace('"position": 24', '"position": 25').encode())
    elif damage == "huge_manifest":
        _put(s3, d3 + "manifest.json", b" " * (MAX_FILE_BYTES + 1))
    else:   # a pickle with a valid entry: only the format stands in the way
        marker = tmp_path / "code-ran"
        torch.save({"embedding.weight": Payload(str(marker))}, tmp_path / "payload")
        data = (tmp_path / "payload").read_bytes()
        doc = json.loads(objects[d3 + "manifest.json"])
        doc["files"]["embedding.safetensors"].update(sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))
        doc.pop("manifest_sha256")
        doc["manifest_sha256"] = hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()
        _put(s3, d3 + "embedding.safetensors", data)
        _put(s3, d3 + "manifest.json", json.dumps(doc).encode())
    ckpt = load_latest(root, TINY)
    assert ckpt.step == 2 and [p.name for p, _ in ckpt.skipped] == ["step-00000003"]
    assert re.search(reason, ckpt.skipped[0][1]), ckpt.skipped
    assert_same(ckpt.state, make_state(seed=2, step=2))
    if damage == "pickle":
        assert not marker.exists()


@pytest.mark.parametrize("where", ["ftp://host/ckpt", "s3://key:secret@bucket/ckpt", "s3:///no-bucket"])
def test_a_location_that_is_not_a_directory_or_object_store_is_one_line(where, tmp_path, capsys):
    from malleus_svc.cli import main
    from malleus_svc.config.fields import Section
    from malleus_svc.config.job import parse_checkpoint

    with pytest.raises(CheckpointError) as e:
        CheckpointWriter(where)
    assert "object store" in str(e.value) and len(str(e.value).splitlines()) == 1
    with pytest.raises(ConfigError, match=r"checkpoint.dir.*object store"):
        parse_checkpoint(Section({"dir": where}, "checkpoint"))
    write_steps(tmp_path, [1])
    assert main(["export", str(tmp_path), where]) == 2
    err = capsys.readouterr().err.strip()
    assert "out_dir" in err and len(err.splitlines()) == 1, err


# --------------------------------------------------------------------------- Ray: resume under another plan
# A: 4 devices, 2 logical nodes of 2. Pipeline 0 = TP2 stage (layers 0-1) + TP1 stage (2-3);
# pipeline 1 = one device with the whole model. Global batch 2 x (2 + 2) = 8.
PLAN_A = make_plan([
    ([((0, 1), (0, 2)), ((2,), (2, 4))], 2),
    ([((3,), (0, 4))], 2),
], num_devices=4, layers=4, gpn=2, mbs=2)
# B: 3 devices of one node, one pipeline: TP1 stage (layer 0) + TP2 stage (layers 1-3). Same global batch.
PLAN_B = make_plan([
    ([((0,), (0, 1)), ((1, 2), (1, 4))], 4),
], num_devices=3, layers=4, gpn=3, mbs=2)
SPEC = {"source": "synthetic", "seq_len": 32, "num_samples": 64, "vocab": 256, "seed": 5}
K_BEFORE, N_AFTER = 2, 3


def _optim():
    """With a schedule: the learning rate changes at every step of the runs below, so a resume that
    lost the step would train on other rates."""
    from malleus_svc.config.lr_schedule import LrSchedule
    from malleus_svc.runtime.engine import OptimConfig

    return OptimConfig(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, grad_clip=0.5,
                       schedule=LrSchedule(warmup_steps=2, decay="cosine", decay_steps=K_BEFORE + N_AFTER + 1))


@contextlib.contextmanager
def _released(event):
    """Never leave the (non-daemon) writer thread held if the test fails while it is."""
    try:
        yield
    finally:
        event.set()


@pytest.fixture(scope="module")
def runs(ray_cluster, tmp_path_factory):
    """Uninterrupted: K steps under A, checkpoint (async, held open while training continues),
    N more steps under A. Resumed: a new 3-device group under B loads the checkpoint, N steps."""
    from malleus_svc.runtime.cluster import WorkerGroup
    from malleus_svc.runtime.data import GlobalSampler

    root = tmp_path_factory.mktemp("ckpt")
    out: dict = {"root": root}
    release, reached = threading.Event(), threading.Event()

    def hold_first_write(name, path):
        reached.set()
        release.wait(120)

    t_start = time.perf_counter()
    with WorkerGroup(4, 2, name="test-ckpt-a") as a, _released(release):
        n = a.set_data(SPEC, "pack", 32)
        a.apply_plan(PLAN_A, TINY, seed=4, optim=_optim())
        sampler = GlobalSampler(n, PLAN_A.global_batch, seed=3)
        for step in range(K_BEFORE):
            a.step(sampler.next_global_batch(), lr=_optim().lr_at(step))
        out["state_at_save"] = a.full_state()
        writer = CheckpointWriter(root, keep_last=2, on_file_written=hold_first_write)
        path = save_group(writer, a, sampler, K_BEFORE)
        out["busy_at_return"] = reached.wait(30) and writer.busy and not path.exists()
        ids, losses = [], []
        for step in range(K_BEFORE, K_BEFORE + N_AFTER):   # training goes on while the write is held open
            rec = a.step(sampler.next_global_batch(), lr=_optim().lr_at(step))
            ids.append([s for p in rec.sample_ids for s in p])
            losses.append(rec.loss)
        out["busy_after_training"] = writer.busy and not path.exists()
        release.set()
        out["result"] = writer.wait()
        out["a_losses"], out["a_ids"], out["a_final"] = losses, ids, a.full_state()
        # Measured: an unobstructed synchronous save of the tiny model (gather + write).
        measured = CheckpointWriter(tmp_path_factory.mktemp("measure"))
        t0 = time.perf_counter()
        state = a.full_state()
        t1 = time.perf_counter()
        measured.save_async(state, group_meta(a, sampler, K_BEFORE + N_AFTER))
        t2 = time.perf_counter()
        out["measured"] = measured.wait()
        out["gather_seconds"], out["save_async_seconds"] = t1 - t0, t2 - t1
    out["a_seconds"] = time.perf_counter() - t_start

    t_start = time.perf_counter()
    with WorkerGroup(3, 3, name="test-ckpt-b") as b:
        n = b.set_data(SPEC, "pack", 32)
        b.apply_plan(PLAN_B, TINY, seed=99, optim=_optim())   # another init: the checkpoint must override it
        t0 = time.perf_counter()
        ckpt = load_latest(root, TINY)
        out["load_seconds"] = time.perf_counter() - t0
        sampler = GlobalSampler(n, 8, seed=3)
        out["restored_step"] = restore_group(b, ckpt, sampler)
        out["b_loaded"] = b.full_state()
        ids, losses = [], []
        for step in range(out["restored_step"], out["restored_step"] + N_AFTER):   # the rate of the step resumed
            rec = b.step(sampler.next_global_batch(), lr=_optim().lr_at(step))
            ids.append([s for p in rec.sample_ids for s in p])
            losses.append(rec.loss)
        out["b_losses"], out["b_ids"], out["b_final"] = losses, ids, b.full_state()
        out["ckpt"] = ckpt
    out["b_seconds"] = time.perf_counter() - t_start
    return out


@pytest.mark.ray
def test_resume_under_another_plan_matches_the_uninterrupted_run(runs):
    ckpt = runs["ckpt"]
    assert runs["restored_step"] == K_BEFORE and ckpt.skipped == []
    assert ckpt.manifest.plan_obj() == PLAN_A and ckpt.manifest.optim["grad_clip"] == 0.5
    assert ckpt.manifest.sampler_state["position"] == K_BEFORE * 8
    # Loaded under B (3 devices, other TP/PP) == the state A had when it saved, bitwise.
    assert_same(runs["b_loaded"], runs["state_at_save"])
    assert int(runs["b_loaded"]["blocks.0.attn.wq:step"]) == K_BEFORE
    # The same global batches in the same order (data position restored) ...
    assert runs["b_ids"] == runs["a_ids"]
    # ... the same losses and final state, up to fp32 summation order (the plans reduce differently).
    assert runs["b_losses"] == pytest.approx(runs["a_losses"], rel=1e-5, abs=0)
    lr = _optim().lr
    for name, ref in runs["a_final"].items():
        got = runs["b_final"][name]
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-3 * lr, msg=lambda m, name=name: f"{name}: {m}")
        strict = torch.isclose(got, ref, rtol=1e-5, atol=1e-7)
        assert int((~strict).sum()) <= max(1, ref.numel() // 1000), f"{name}: {int((~strict).sum())} elements off"
    assert int(runs["b_final"]["head.weight:step"]) == K_BEFORE + N_AFTER
    m = runs["measured"]
    loss_diff = max(abs(x - y) / abs(y) for x, y in zip(runs["b_losses"], runs["a_losses"]))
    param_diff = max(float((runs["b_final"][k] - v).abs().max()) for k, v in runs["a_final"].items() if ":" not in k)
    print(f"\nresumed under B vs uninterrupted A: max rel loss diff {loss_diff:.2e}, max abs param diff {param_diff:.2e}")
    print(f"\ntiny checkpoint: {m.bytes} B in {m.files} files; gather (full_state) {runs['gather_seconds'] * 1e3:.1f} ms, "
          f"save_async returned after {runs['save_async_seconds'] * 1e3:.1f} ms, background write "
          f"{m.seconds * 1e3:.1f} ms; load+verify "
          f"{runs['load_seconds'] * 1e3:.1f} ms; group A {runs['a_seconds']:.1f} s, group B {runs['b_seconds']:.1f} s")


@pytest.mark.ray
def test_training_went_on_while_the_checkpoint_was_written(runs):
    assert runs["busy_at_return"], "save_async did not return before the write finished"
    assert runs["busy_after_training"], "the write finished before training went on"
    res = runs["result"]
    assert res.step == K_BEFORE and res.path.name == "step-00000002"
    # What was written is the state at the save, not the state after the steps that ran meanwhile.
    assert_same(load_checkpoint(res.path).state, runs["state_at_save"])
    assert not torch.equal(runs["a_final"]["head.weight"], runs["state_at_save"]["head.weight"])


# --------------------------------------------------------------------------- Ray: the workers write and read their own pieces
# DP 2 x PP 2 and TP 2 x PP 2 over the same 4 devices, the same global batch (2 x 4 = 8).
DP_PP = make_plan([([((0,), (0, 2)), ((1,), (2, 4))], 2), ([((2,), (0, 2)), ((3,), (2, 4))], 2)],
                  num_devices=4, layers=4, gpn=4, mbs=2)
TP_PP = make_plan([([((0, 2), (0, 2)), ((1, 3), (2, 4))], 4)], num_devices=4, layers=4, gpn=4, mbs=2)
# Large enough that a shard stands out of the driver's own noise: ~10 MiB of state per block, 24 per embedding.
SHARDED = dataclasses.replace(TINY, hidden=256, heads=4, ffn=768, vocab=8192, seq_len=32)


@pytest.mark.ray
def test_workers_write_their_own_pieces_and_another_plan_reads_them(ray_cluster, tmp_path, monkeypatch):
    """A checkpoint under DP 2 x PP 2: each file is written by the one worker that the layout names
    (one replica per piece; the driver writes none and its peak memory stays under a worker's
    shard), and each worker's peak stays within twice its own state. Resumed under TP 2 x PP 2 on the
    same workers, training goes on with the losses of the run that never stopped."""
    from malleus_svc.checkpoint import writer as writer_module
    from malleus_svc.runtime import host_memory
    from malleus_svc.runtime.cluster import WorkerGroup
    from malleus_svc.runtime.data import GlobalSampler

    def driver_must_not_write(*args, **kwargs):
        raise AssertionError("the driver wrote a shard file")

    monkeypatch.setattr(writer_module, "write_part", driver_must_not_write)
    spec = {**SPEC, "vocab": SHARDED.vocab}
    with WorkerGroup(4, 4, name="test-ckpt-sharded") as g:
        n = g.set_data(spec, "pack", 32)
        g.apply_plan(DP_PP, SHARDED, seed=4, optim=_optim())
        sampler = GlobalSampler(n, DP_PP.global_batch, seed=3)
        for _ in range(2):
            g.step(sampler.next_global_batch())
        saved = g.full_state()
        own = {d: sum(3 * s.param.numel() * 4 for s in states.values())
               for d, states in zip(g.live, g._each("export_state"))}
        held = {d: m["memory_bytes"] for d, m in zip(g.live, g._each("host_memory", True))}
        start = host_memory.resident()
        host_memory.reset_peak()
        with CheckpointWriter(tmp_path, keep_last=None) as w:
            save_group(w, g, sampler, 2, wait=True)
        driver_peak = host_memory.peak() - start
        worker_peak = {d: m["peak_memory_bytes"] - held[d] for d, m in zip(g.live, g._each("host_memory"))}
        unbroken = [g.step(sampler.next_global_batch()).loss for _ in range(3)]

        d = tmp_path / "step-00000002"
        assert sorted(p.name for p in d.iterdir()) == [
            "block-0000.d0002.safetensors", "block-0001.d0000.safetensors", "block-0002.d0003.safetensors",
            "block-0003.d0001.safetensors", "embedding.d0000.safetensors", "head.d0003.safetensors", "manifest.json"]
        print(f"\nown state per worker (MiB): { {k: round(v / 2**20, 1) for k, v in own.items()} }; peak during the "
              f"checkpoint: driver {driver_peak / 2**20:.1f} MiB, workers "
              f"{ {k: round(v / 2**20, 1) for k, v in worker_peak.items()} }")
        assert driver_peak < min(own.values()), (driver_peak, own)
        assert all(worker_peak[k] <= 2 * own[k] for k in own), (worker_peak, own)

        # Another plan on the same workers, without initialising: every worker reads its own rows.
        g.apply_plan(TP_PP, SHARDED, seed=99, optim=_optim(), init=False)
        ckpt = load_latest(tmp_path, SHARDED)
        resumed_sampler = GlobalSampler(n, TP_PP.global_batch, seed=3)
        assert restore_group(g, ckpt, resumed_sampler) == 2
        assert_same(g.full_state(), saved)
        resumed = [g.step(resumed_sampler.next_global_batch()).loss for _ in range(3)]
    assert resumed == pytest.approx(unbroken, rel=1e-5, abs=0)
    assert_same(ckpt.state, saved)     # and a tool assembles the same whole tensors


def test_a_step_directory_renamed_to_another_step_is_skipped_with_the_reason(tmp_path):
    write_steps(tmp_path, [1, 2])
    os.rename(tmp_path / "step-00000002", tmp_path / "step-00000005")
    ckpt = load_latest(tmp_path, TINY)
    assert ckpt.step == 1
    assert ckpt.skipped == [(tmp_path / "step-00000005", "manifest.json says step 2, the directory name says 5")]
