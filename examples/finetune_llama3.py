"""Fine-tune a Llama 3 model from its Hugging Face folder, its head still tied to its embedding, and
hand the result back to transformers.

    python examples/finetune_llama3.py                           # a small Llama-3.2-shaped stand-in, CPU
    python examples/finetune_llama3.py --from ~/models/Llama-3.2-1B --tokens data/corpus --gpus 8

Without --from, `transformers` makes and saves a small random model of Llama 3.2's kind (rotary base
500,000, Llama 3's rotary scaling, tied embeddings) to stand in for a download. The job it writes
(`finetune.yaml` under --work) starts from the folder (each worker reads its own rows of it),
warms the learning rate up and decays it with a cosine, evaluates on held-out samples and
checkpoints; the last checkpoint is exported as a folder that `transformers` loads, still tied.
--tokens is a corpus made with the model's own tokenizer (`malleus prepare-data DOCS --tokenizer
FOLDER/tokenizer.json --out DIR`); without it, synthetic samples of the model's vocabulary stand in.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent


def stand_in_model(folder: Path) -> Path:
    """A 4-layer Llama 3.2-shaped model (random weights), saved by transformers as a download is."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def job_file(work: Path, model: Path, tokens: str | None, steps: int, gpus: int) -> Path:
    from malleus_svc.config.hf_config import shape_of_folder

    shape = shape_of_folder(model)
    seq_len = min(shape.seq_len, 64 if tokens is None else 2048)
    data = ({"source": "tokens", "seq_len": seq_len, "files": [tokens]} if tokens else
            {"source": "synthetic", "seq_len": seq_len, "num_samples": 512, "vocab": shape.vocab})
    job = {
        "name": "finetune-llama3",
        "cluster": {"nodes": 1, "gpus_per_node": gpus, "gpu_memory_mb": 80000},
        "model": {"from_pretrained": str(model), "seq_len": seq_len},
        "parallel": {"dp": gpus // 2, "tp": 1, "pp": 2},   # the embedding and the tied head on other devices
        "batch": {"global": 4 * gpus, "micro": 2},
        "data": data,
        # fine-tuning rates: a short warm-up, a cosine to a tenth of the peak
        "train": {"steps": steps, "lr": 2.0e-4, "warmup_steps": max(1, steps // 10), "decay": "cosine",
                  "min_lr": 2.0e-5, "weight_decay": 0.1, "grad_clip": 1.0},
        "eval": {"every": max(1, steps // 2), "batches": 1, "holdout": 0.05},
        "checkpoint": {"dir": str(work / "checkpoints"), "every": steps},
        "metrics": {"enabled": False},
    }
    path = work / "finetune.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--from", dest="model", help="a Llama 3.x folder (config.json, *.safetensors); default: a stand-in")
    ap.add_argument("--tokens", help="a corpus prepared with the model's tokenizer (default: synthetic samples)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--gpus", type=int, default=4, help="devices of one node (CPU workers without GPUs)")
    ap.add_argument("--address", help="a running Ray cluster (host:port); default: a local one for this job")
    ap.add_argument("--work", help="where the job file, checkpoints and exported folder go (default: a temp dir)")
    args = ap.parse_args()

    work = Path(args.work or tempfile.mkdtemp(prefix="malleus-finetune-"))
    work.mkdir(parents=True, exist_ok=True)
    model = Path(args.model) if args.model else stand_in_model(work / "llama3-stand-in")
    job = job_file(work, model, args.tokens, args.steps, args.gpus)
    metrics = work / "metrics.jsonl"
    cmd = [sys.executable, "-m", "malleus_svc.train", str(job), "--metrics-out", str(metrics)]
    if args.address:
        cmd += ["--address", args.address]
    if subprocess.run(cmd, cwd=REPO).returncode:
        return 1
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    evals = [(x["step"], round(x["eval_loss"], 4)) for x in lines if "eval_loss" in x]
    print(f"loss {lines[0]['loss']:.4f} -> {lines[-1]['loss']:.4f} over {len(lines)} steps; eval loss {evals}")

    import torch
    import transformers

    from malleus_svc.checkpoint import load_latest
    from malleus_svc.checkpoint.hf import export_checkpoint

    state = load_latest(work / "checkpoints").state
    tied = torch.equal(state["head.weight"], state["embedding.weight"])   # trained as one weight
    out, _, step = export_checkpoint(work / "checkpoints", work / "hf")
    tuned = transformers.LlamaForCausalLM.from_pretrained(out)
    print(f"exported step {step} to {out} (head and embedding equal after training: {tied}); transformers "
          f"ties them: {tuned.lm_head.weight.data_ptr() == tuned.model.embed_tokens.weight.data_ptr()}")
    return 0 if tied else 1


if __name__ == "__main__":
    sys.exit(main())
