"""Hugging Face LLaMA weights in and out (checkpoint/hf.py, config/hf_config.py): the project's
model and `transformers.LlamaForCausalLM` loaded from an exported folder give the same logits;
import then export is bitwise; a job starts from such a folder; what is not a LLaMA the project
can train is refused in one line."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from malleus_svc.checkpoint import CheckpointWriter
from malleus_svc.checkpoint.hf import WEIGHTS_FILE, pretrained_state, read_pretrained, write_hf
from malleus_svc.cli import main
from malleus_svc.config import ConfigError
from malleus_svc.config.presets import PRESETS, ModelShape, RopeScaling
from malleus_svc.config.scenario import Scenario
from malleus_svc.runtime.model import full_model

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

REPO = Path(__file__).resolve().parent.parent
TINY = PRESETS["tiny"]
GQA = ModelShape(layers=3, hidden=96, heads=6, ffn=160, vocab=120, seq_len=48, kv_heads=2)


def _params(shape: ModelShape, seed: int) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in full_model(shape, seed).named_parameters()}


@pytest.mark.parametrize("shape", [TINY, GQA], ids=["mha", "gqa"])
def test_transformers_gives_the_same_logits_from_the_exported_folder(shape, tmp_path):
    params = _params(shape, seed=3)
    write_hf(params, shape, tmp_path)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ours = full_model(shape, seed=3).eval()
    tokens = torch.randint(0, shape.vocab, (shape.seq_len,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = hf(tokens[None]).logits[0]
        mine = ours(tokens, torch.arange(shape.seq_len), torch.tensor([0, shape.seq_len], dtype=torch.int32))
    assert theirs.shape == mine.shape == (shape.seq_len, shape.vocab)
    assert torch.allclose(theirs, mine, atol=1e-4, rtol=0), (theirs - mine).abs().max()


def test_import_then_export_is_bitwise(tmp_path):
    write_hf(_params(GQA, seed=1), GQA, tmp_path / "a")
    shape, state = read_pretrained(tmp_path / "a")
    assert shape == GQA
    write_hf(state, shape, tmp_path / "b")
    a = safetensors_torch.load_file(str(tmp_path / "a" / WEIGHTS_FILE))
    b = safetensors_torch.load_file(str(tmp_path / "b" / WEIGHTS_FILE))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) and a[k].dtype == torch.float32 for k in a)
    assert (tmp_path / "a" / "config.json").read_text() == (tmp_path / "b" / "config.json").read_text()
    assert all(float(state[k].abs().sum()) == 0 for k in state if k.endswith((":exp_avg", ":exp_avg_sq")))


def _logits(hf, shape: ModelShape, params: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' logits and the project's model's with `params`, on one random row."""
    ours = full_model(shape, seed=0).eval()
    ours.load_full(params)
    tokens = torch.randint(0, shape.vocab, (shape.seq_len,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return hf(tokens[None]).logits[0], ours(tokens, torch.arange(shape.seq_len),
                                                torch.tensor([0, shape.seq_len], dtype=torch.int32))


def _saved_by_transformers(folder: Path, seed: int, **config):
    """A random GQA `LlamaForCausalLM` of `config` (random norm weights too, so no tensor is left at
    its default), saved by `save_pretrained` into `folder`."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=GQA.vocab, hidden_size=GQA.hidden, intermediate_size=GQA.ffn,
                                      num_hidden_layers=GQA.layers, num_attention_heads=GQA.heads,
                                      num_key_value_heads=GQA.kv_heads, max_position_embeddings=GQA.seq_len,
                                      **{"tie_word_embeddings": False, **config})
    hf = transformers.LlamaForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    hf.save_pretrained(folder, safe_serialization=True)
    return hf


def test_a_folder_saved_by_transformers_itself_imports_with_its_logits_and_exports_bitwise(tmp_path):
    """Not our own export: a `LlamaForCausalLM` saved by `save_pretrained`; the project reads it,
    gives transformers' logits, and writes the same tensors back, bit for bit."""
    from malleus_svc.config.presets import NORM_EPS, ROPE_BASE

    hf = _saved_by_transformers(tmp_path / "hf", 11, rms_norm_eps=NORM_EPS, rope_theta=ROPE_BASE)
    shape, state = read_pretrained(tmp_path / "hf")
    assert shape == GQA
    theirs, mine = _logits(hf, shape, state)
    assert torch.allclose(theirs, mine, atol=1e-4, rtol=0), (theirs - mine).abs().max()

    write_hf(state, shape, tmp_path / "out")
    saved = safetensors_torch.load_file(str(tmp_path / "hf" / WEIGHTS_FILE))
    again = safetensors_torch.load_file(str(tmp_path / "out" / WEIGHTS_FILE))
    assert set(saved) == set(again) and len(saved) == 3 + 9 * GQA.layers
    assert all(again[k].dtype == saved[k].dtype == torch.float32 and torch.equal(again[k], saved[k]) for k in saved)


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}


def test_a_llama3_folder_with_its_rotary_scaling_imports_with_its_logits_and_exports_bitwise(tmp_path):
    """A Llama 3.2 class model (rotary base 500,000, Llama 3's rotary scaling, another RMSNorm
    epsilon, the head tied to the embedding) saved by `transformers`: the same logits from the
    project's model, the same files written back (one copy of the tied matrix); the config as
    `transformers` 4 wrote it (rope_theta, rope_scaling) reads to the same shape."""
    hf = _saved_by_transformers(tmp_path / "hf", 12, rms_norm_eps=1e-6, tie_word_embeddings=True,
                                rope_parameters={"rope_theta": 500000.0, **LLAMA3})
    shape, state = read_pretrained(tmp_path / "hf")
    assert (shape.rope_theta, shape.norm_eps, shape.tie_embeddings) == (500000.0, 1e-6, True)
    assert shape.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 16)
    assert torch.equal(state["head.weight"], state["embedding.weight"])
    ours = full_model(shape, seed=0).eval()
    ours.load_state_dict({n: state[n] for n, _ in ours.named_parameters()})
    plain = full_model(dataclasses.replace(shape, rope_scaling=None), seed=0).eval()
    plain.load_state_dict(ours.state_dict())
    tokens = torch.randint(0, shape.vocab, (shape.seq_len,), generator=torch.Generator().manual_seed(1))
    args = (tokens, torch.arange(shape.seq_len), torch.tensor([0, shape.seq_len], dtype=torch.int32))
    with torch.no_grad():
        theirs, mine, unscaled = hf(tokens[None]).logits[0], ours(*args), plain(*args)
    assert torch.allclose(theirs, mine, atol=1e-4, rtol=0), (theirs - mine).abs().max()
    assert (theirs - unscaled).abs().max() > 1e-2          # the scaling matters at these positions

    write_hf(state, shape, tmp_path / "out")
    saved = safetensors_torch.load_file(str(tmp_path / "hf" / WEIGHTS_FILE))
    again = safetensors_torch.load_file(str(tmp_path / "out" / WEIGHTS_FILE))
    assert set(saved) == set(again) and all(torch.equal(again[k], saved[k]) for k in saved)
    assert "lm_head.weight" not in again and json.loads((tmp_path / "out" / "config.json").read_text())[
        "tie_word_embeddings"] is True
    reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(tokens[None]).logits[0], theirs)

    v4 = json.loads((tmp_path / "hf" / "config.json").read_text())
    v4.pop("rope_parameters", None)
    v4.update(rope_theta=500000.0, rope_scaling=LLAMA3)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(v4))
    assert read_pretrained(tmp_path / "hf")[0] == shape


def test_malleus_export_writes_a_checkpoint_transformers_loads(tmp_path, capsys):
    from test_checkpoint import make_state, meta
    with CheckpointWriter(tmp_path / "ckpt") as w:
        w.save(make_state(seed=2, step=5), meta(5))
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 0
    assert "exported step 5" in capsys.readouterr().out
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    state = make_state(seed=2, step=5)
    assert torch.equal(hf.model.layers[2].self_attn.k_proj.weight, state["blocks.2.attn.wk"])
    assert torch.equal(hf.lm_head.weight, state["head.weight"])
    capsys.readouterr()                                  # transformers' own progress bar
    assert main(["export", str(tmp_path / "nothing"), str(tmp_path / "hf2")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no checkpoint here" in err


def test_a_tied_head_starts_as_the_embedding(tmp_path):
    params = _params(TINY, seed=4)
    write_hf(params, TINY, tmp_path)
    full = safetensors_torch.load_file(str(tmp_path / WEIGHTS_FILE))
    del full["lm_head.weight"]
    safetensors_torch.save_file(full, str(tmp_path / WEIGHTS_FILE))
    state = pretrained_state(tmp_path, TINY)
    assert torch.equal(state["head.weight"], params["embedding.weight"])


def _scenario(folder, **model) -> dict:
    return {"name": "hf", "cluster": {"nodes": 1, "gpus_per_node": 4, "gpu_memory_mb": 16000},
            "model": {"from_pretrained": str(folder), **model}, "parallel": {"dp": 2, "tp": 1, "pp": 2},
            "batch": {"global": 8, "micro": 2}}


@pytest.mark.parametrize("edit, field", [
    ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "architectures"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": -1.0}}, "rope_theta"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0}}, "rope_parameters"),    # no factors
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}}, "rope_parameters"),
    ({"rope_parameters": None, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling"),
    ({"rms_norm_eps": 0}, "rms_norm_eps"),
    ({"attention_bias": True}, "attention_bias"),
    ({"num_key_value_heads": 5}, "num_key_value_heads"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_what_the_model_is_not_is_refused_naming_the_field(tmp_path, edit, field):
    write_hf(_params(TINY, seed=0), TINY, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **edit}))
    with pytest.raises(ConfigError) as e:
        Scenario.from_dict(_scenario(tmp_path))
    assert field in e.value.field and "\n" not in str(e.value)


def test_the_shape_comes_from_the_config_and_a_tensor_of_another_shape_is_refused(tmp_path):
    write_hf(_params(TINY, seed=0), TINY, tmp_path)
    sc = Scenario.from_dict(_scenario(tmp_path, seq_len=32))
    assert sc.shape == ModelShape(**{**TINY.to_dict(), "seq_len": 32}) and sc.pretrained == str(tmp_path)
    full = safetensors_torch.load_file(str(tmp_path / WEIGHTS_FILE))
    full["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 3)
    safetensors_torch.save_file(full, str(tmp_path / WEIGHTS_FILE))
    with pytest.raises(ConfigError, match=r"model.layers.1.mlp.up_proj.weight of shape \(128, 64\)"):
        pretrained_state(tmp_path, TINY)
    with pytest.raises(ConfigError, match="config.json"):
        Scenario.from_dict(_scenario(tmp_path / "missing"))


def _train(job: dict, folder: Path, ray_cluster: str) -> list[float]:
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    out = folder / "metrics.jsonl"
    proc = subprocess.run([sys.executable, "-m", "malleus_svc.train", str(path), "--steps", "3", "--static",
                           "--metrics-out", str(out), "--address", ray_cluster],
                          cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(x)["loss"] for x in out.read_text().splitlines()]


@pytest.mark.ray
def test_a_job_starts_from_a_pretrained_folder(ray_cluster, tmp_path):
    """The tiny job from a folder holding exactly its seed-0 initial weights trains exactly as the
    job that initialises them itself. The fine-tuning example starts from a Llama 3.2-shaped model
    saved by transformers (tied head, Llama 3 rotary scaling): another model's weights, which train
    as one weight across the devices (the embedding on the first stages, the head on the last) and
    leave as a folder transformers loads with the project's logits."""
    from malleus_svc.checkpoint import load_latest

    base = yaml.safe_load((REPO / "examples/tiny_job.yaml").read_text())
    base["metrics"] = {"enabled": False}
    write_hf(_params(TINY, seed=base["train"]["seed"]), TINY, tmp_path / "same")
    runs = {}
    for name, model in (("own", "tiny"), ("same", {"from_pretrained": str(tmp_path / "same")})):
        (tmp_path / name).mkdir(exist_ok=True)
        runs[name] = _train({**base, "name": f"hf-{name}", "model": model}, tmp_path / name, ray_cluster)
    assert runs["same"] == pytest.approx(runs["own"], rel=1e-6, abs=0) and len(runs["own"]) == 3

    work = tmp_path / "finetune"
    proc = subprocess.run([sys.executable, "examples/finetune_llama3.py", "--steps", "4", "--work", str(work),
                           "--address", ray_cluster], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    losses = [json.loads(x)["loss"] for x in (work / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 4 and abs(losses[0] - runs["own"][0]) > 1e-3
    _, start = read_pretrained(work / "llama3-stand-in")
    ckpt = load_latest(work / "checkpoints")
    shape, state = ckpt.manifest.shape, ckpt.state
    assert shape.tie_embeddings and shape.rope_scaling is not None and ckpt.step == 4
    assert torch.equal(state["head.weight"], state["embedding.weight"])                 # still one weight
    assert not torch.equal(state["embedding.weight"], start["embedding.weight"])        # and it trained
    hf = transformers.LlamaForCausalLM.from_pretrained(work / "hf", dtype=torch.float32).eval()
    assert "lm_head.weight" not in safetensors_torch.load_file(str(work / "hf" / WEIGHTS_FILE))
    theirs, mine = _logits(hf, shape, state)
    assert torch.allclose(theirs, mine, atol=1e-4, rtol=0), (theirs - mine).abs().max()


def _shards_of_folder(rank: int, world: int, folder: str):
    from malleus_svc.plan import Pipeline, Plan, Stage
    from malleus_svc.runtime.engine import Engine

    plan = Plan(num_devices=2, num_layers=GQA.layers, micro_batch_size=1,
                pipelines=(Pipeline((Stage((0, 1), (0, GQA.layers)),), micro_batches=1),))
    engine = Engine(GQA, plan, rank, init=False)
    engine.load_pretrained(folder)
    return {n: p.detach().clone() for n, p in engine.params.items()}


def test_each_worker_reads_only_its_own_rows_of_a_pretrained_folder(tmp_path):
    """Under TP 2 each rank's tensors are its slices of the folder's weights, read by row range
    (no process builds the full state); the driver's check reads headers only."""
    from _mp import run_on_gloo
    from malleus_svc.runtime.model import take_shard
    from malleus_svc.runtime.pretrained import check_pretrained

    params = _params(GQA, seed=7)
    write_hf(params, GQA, tmp_path)
    check_pretrained(tmp_path, GQA)
    for rank, got in enumerate(run_on_gloo(_shards_of_folder, 2, str(tmp_path))):
        assert set(got) == set(params)
        for name, t in got.items():
            assert torch.equal(t, take_shard(name, params[name], rank, 2)), name
    with pytest.raises(ConfigError, match="of shape"):
        check_pretrained(tmp_path, ModelShape(layers=3, hidden=96, heads=6, ffn=192, vocab=120, seq_len=48, kv_heads=2))
