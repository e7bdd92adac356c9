"""`malleus prepare-data` throughput on a text corpus, beside the `tokenizers` batch encoder alone.

The corpus is the Python standard library's source, copied as .txt files until it reaches --mb
megabytes; the tokenizer is a byte-level BPE trained on its first files. The encoder alone gets the
texts already in memory and all cores (Rust threads); prepare-data reads the files with `datasets`,
tokenizes in --workers processes and writes the .bin/.idx. Both must count the same tokens.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sysconfig
import tempfile
import time
from pathlib import Path

from malleus_svc.config.options import number_option
from .planner import write_section


def build_corpus(folder: Path, megabytes: float) -> list[Path]:
    sources = sorted(p for p in Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")
                     if "site-packages" not in p.parts and "__pycache__" not in p.parts)
    files, total, i = [], 0, 0
    while total < megabytes * 1e6:
        text = sources[i % len(sources)].read_text(errors="replace").encode()   # a few are not utf-8
        path = folder / f"{i:06d}.txt"
        path.write_bytes(text)
        files.append(path)
        total, i = total + len(text), i + 1
    return files


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="malleus bench prepare-data", description=__doc__.split("\n")[0])
    number_option(ap, "--mb", 0.001, 1e6, default=200.0, help="corpus size in MB (default 200)")
    ap.add_argument("--vocab", type=int, default=32_000, help="BPE vocabulary (default 32000)")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="prepare-data processes (default: cores)")
    ap.add_argument("--write", metavar="MD", help="update this markdown file's prepare-data section")
    args = ap.parse_args(argv)
    os.environ["TOKENIZERS_PARALLELISM"] = "true"   # the encoder alone uses every core
    import datasets
    from tokenizers import Tokenizer

    from malleus_svc.prepare_data import prepare, train_tokenizer

    work = Path(tempfile.mkdtemp(prefix="malleus-prep-"))
    try:
        print(f"writing a {args.mb:g} MB text corpus ...", flush=True)
        (work / "docs").mkdir()
        files = build_corpus(work / "docs", args.mb)
        megabytes = sum(f.stat().st_size for f in files) / 1e6
        print(f"training a {args.vocab}-id byte-level BPE on the first 20 MB ...", flush=True)
        sample, size = [], 0
        for f in files:
            if size > 20e6:
                break
            sample.append(f.read_text(errors="replace"))
            size += len(sample[-1])
        train_tokenizer(datasets.Dataset.from_dict({"text": sample}), args.vocab, str(work / "tokenizer.json"))

        texts = [f.read_text(errors="replace") for f in files]
        tok = Tokenizer.from_file(str(work / "tokenizer.json"))
        print("the tokenizers batch encoder alone ...", flush=True)
        t = time.perf_counter()
        alone = sum(len(e.ids) for a in range(0, len(texts), 1000)
                    for e in tok.encode_batch(texts[a:a + 1000], add_special_tokens=False))
        alone_s = time.perf_counter() - t
        del texts
        print(f"malleus prepare-data with {args.workers} processes ...", flush=True)
        summary = prepare([str(work / "docs")], str(work / "tokenizer.json"), str(work / "out" / "corpus"),
                          workers=args.workers)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    tokens = summary["tokens"] - summary["documents"]   # less one end-of-document token each
    if tokens != alone:
        raise SystemExit(f"prepare-data counted {tokens} tokens, the encoder alone {alone}")
    ratio = (tokens / summary["seconds"]) / (alone / alone_s)
    md = (f"| corpus | documents | tokens | encoder alone (all cores) | prepare-data ({args.workers} processes, "
          f"read + tokenize + write) | ratio |\n|---|---|---|---|---|---|\n"
          f"| {megabytes:.0f} MB | {summary['documents']:,} | {tokens:,} | {alone / alone_s:,.0f} tokens/s "
          f"({alone_s:.1f} s) | {tokens / summary['seconds']:,.0f} tokens/s ({summary['seconds']:.1f} s) | "
          f"{ratio:.2f} |")
    print(md)
    if args.write:
        write_section(f"Command: `malleus bench prepare-data --write BENCHMARKS.md` — {time.strftime('%Y-%m-%d')}, "
                      f"{os.cpu_count()}-core CPU machine, byte-level BPE of {args.vocab} ids.\n\n{md}",
                      Path(args.write), "bench:prepare-data")
    return 0
