"""Bring your own data: tokenize a folder of text, train on it as a Ray job, export the model and
generate a few tokens from it with Hugging Face transformers.

    ray start --head                                    # once
    python examples/own_data.py --address http://127.0.0.1:8265 --text MY_DOCS/ --steps 20

Without --text, 60 files of Python's standard library stand in for the folder. Without --tokenizer,
a byte-level BPE is trained on the folder first (no download). The corpus, checkpoints and the
exported folder go under --work: on a cluster of several nodes it must be a directory every node
sees, since each worker reads the samples it trains from there.
"""
from __future__ import annotations

import argparse
import json
import sysconfig
import tempfile
import time
from pathlib import Path

import yaml
from ray.job_submission import JobStatus, JobSubmissionClient

from malleus_svc.checkpoint.hf import export_checkpoint
from malleus_svc.prepare_data import prepare, print_summary

REPO = Path(__file__).resolve().parent.parent


def stand_in_text(folder: Path, count: int = 60) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for p in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:count]:
        (folder / f"{p.stem}.txt").write_text(p.read_text(errors="replace"))
    return folder


def job_file(work: Path, corpus: str, vocab: int, steps: int) -> Path:
    job = {
        "name": "own-data",
        "cluster": {"nodes": 1, "gpus_per_node": 4, "gpu_memory_mb": 16000},
        # a small LLaMA with grouped-query attention; the vocabulary rounded up to a multiple of 64
        "model": {"layers": 4, "hidden": 128, "heads": 4, "kv_heads": 2, "ffn": 256,
                  "vocab": -(-vocab // 64) * 64, "seq_len": 128},
        "parallel": {"dp": 2, "tp": 1, "pp": 2},
        "batch": {"global": 16, "micro": 2},
        "data": {"source": "tokens", "seq_len": 128, "files": [corpus]},
        "train": {"steps": steps, "lr": 3.0e-3},
        "checkpoint": {"dir": str(work / "checkpoints"), "every": steps},
    }
    path = work / "job.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--address", default=None, help="Ray dashboard, e.g. http://127.0.0.1:8265")
    ap.add_argument("--text", help="a folder of .txt/.md/.jsonl/.parquet files (default: Python's stdlib source)")
    ap.add_argument("--tokenizer", help="a tokenizer.json to use (default: train one on the folder)")
    ap.add_argument("--work", help="where the corpus, checkpoints and exported model go (default: a temp dir)")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="malleus-own-data-")).resolve()
    work.mkdir(parents=True, exist_ok=True)

    # 1. tokenize
    text = Path(args.text) if args.text else stand_in_text(work / "text")
    tokenizer = args.tokenizer or str(work / "tokenizer.json")
    summary = prepare([str(text)], tokenizer, str(work / "data" / "corpus"),
                      train_vocab=None if args.tokenizer else 512)
    print_summary(summary, str(work / "data" / "corpus"))

    # 2. train as a Ray job
    client = JobSubmissionClient(args.address)
    metrics = work / "metrics.jsonl"
    job = job_file(work, str(work / "data" / "corpus"), summary["vocab_size"], args.steps)
    job_id = client.submit_job(
        entrypoint=f"python -m malleus_svc.train {job} --metrics-out {metrics}",
        runtime_env={"working_dir": str(REPO), "excludes": [".venv/", ".git/"]},
        metadata={"malleus_job": "own-data"})
    print(f"submitted {job_id}")
    while (status := client.get_job_status(job_id)) not in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
        time.sleep(1)
    if status != JobStatus.SUCCEEDED:
        print(f"{job_id}: {status.value}\n{client.get_job_logs(job_id)[-3000:]}")
        return 1
    losses = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]

    # 3. export, and 4. generate with transformers from the exported folder
    out, _, step = export_checkpoint(work / "checkpoints", work / "hf")
    import torch
    import transformers

    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=tokenizer, eos_token="<|endoftext|>")
    tok.save_pretrained(out)   # the folder is then complete: AutoTokenizer and AutoModel load it
    model = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    prompt = tok("def ", return_tensors="pt")
    with torch.no_grad():
        ids = model.generate(**prompt, max_new_tokens=24, do_sample=False, pad_token_id=tok.eos_token_id)
    print(f"own data: {len(losses)} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}; exported step {step} to {out}")
    print(f"generated: {tok.decode(ids[0])!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
