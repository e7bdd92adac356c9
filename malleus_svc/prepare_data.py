"""`malleus prepare-data`: text, JSON lines or Parquet files into a tokenized corpus on disk.

    malleus prepare-data DOCS/ --tokenizer tokenizer.json --out data/corpus
    -> data/corpus.bin + data/corpus.idx (Megatron indexed) + data/corpus.json (this summary)

Hugging Face `datasets` reads the local files (one document per text file, line or paragraph; one
per JSON line or Parquet row, from a field) and tokenizes them in several processes with a
`tokenizers` tokenizer; every document ends with the end-of-document token. The job reads the
result with ``data: {source: tokens, files: [data/corpus]}``. The summary beside it records the
tokenizer's vocabulary and the largest id, so a job checks them against its model without a scan.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from .config import ConfigError
from .config.options import number_option
from .runtime.datasets import length_stats
from .runtime.token_files import TOKEN_DTYPES, IndexedWriter, corpus_files, summary_path

FORMATS = {".txt": "text", ".text": "text", ".md": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
TEXT_UNITS = {"file": "document", "line": "line", "paragraph": "paragraph"}   # datasets' text builder's sample_by
ENCODING_ERRORS = ("strict", "replace", "ignore")
EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>")


def _inputs(paths: list[str]) -> dict[str, list[str]]:
    """Input files by format; a directory gives every file under it with a known suffix."""
    by_format: dict[str, list[str]] = {}
    for p in map(Path, paths):
        if p.is_dir():
            files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in FORMATS)
        elif p.is_file():
            if p.suffix not in FORMATS:
                raise ConfigError("input", str(p), f"a file ending in one of {sorted(FORMATS)} or a directory")
            files = [p]
        else:
            raise ConfigError("input", str(p), "an existing file or directory")
        for f in files:
            by_format.setdefault(FORMATS[f.suffix], []).append(str(f))
    if not by_format:
        raise ConfigError("input", paths, f"no file ending in one of {sorted(FORMATS)} was found there")
    return by_format


def _tokenizer(path: str, eod: str | None):
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(path)
    except Exception as e:   # tokenizers raises a bare Exception for a missing or malformed file
        raise ConfigError("--tokenizer", path, f"a tokenizers tokenizer.json ({str(e).splitlines()[0][:120]})") from None
    names = [eod] if eod else [t for t in EOD_CANDIDATES if tok.token_to_id(t) is not None][:1]
    if not names or tok.token_to_id(names[0]) is None:
        raise ConfigError("--eod", eod, f"a token of the tokenizer's vocabulary (none of {list(EOD_CANDIDATES)} is "
                          f"in it: name its end-of-document token)")
    return tok, tok.token_to_id(names[0])


def _undecodable(files: list[str]) -> tuple[str, str] | None:
    """The first file that is not utf-8, and where (asked only once reading has failed)."""
    for f in files:
        try:
            with open(f, encoding="utf-8") as fh:
                while fh.read(1 << 20):
                    pass
        except UnicodeDecodeError as e:
            return f, f"{e.reason} at byte {e.start}"
    return None


def _load(by_format: dict[str, list[str]], field: str, unit: str, cache: str, encoding_errors: str = "strict"):
    """One `datasets.Dataset` with a single "text" column."""
    import datasets

    parts = []
    for fmt, files in sorted(by_format.items()):
        kwargs = {"sample_by": TEXT_UNITS[unit], "encoding_errors": encoding_errors} if fmt == "text" else {}
        try:
            ds = datasets.load_dataset(fmt, data_files=files, split="train", cache_dir=cache, **kwargs)
        except datasets.exceptions.DatasetGenerationError as e:
            bad = _undecodable(files) if isinstance(e.__cause__, UnicodeDecodeError) else None
            if bad:
                raise ConfigError("input", bad[0], f"utf-8 text ({bad[1]}); --encoding-errors replace or ignore "
                                  "reads it anyway") from None
            reason = str(e.__cause__ or e).splitlines()[0][:200]
            raise ConfigError("input", f"{len(files)} {fmt} file(s)", f"readable {fmt} records ({reason})") from None
        column = "text" if fmt == "text" else field
        if column not in ds.column_names:
            raise ConfigError("--field", field, f"a field of the {fmt} records (they have {ds.column_names})")
        parts.append(ds.select_columns([column]).rename_column(column, "text") if column != "text"
                     else ds.select_columns(["text"]))
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def train_tokenizer(ds, vocab_size: int, path: str, eod: str = EOD_CANDIDATES[0]) -> None:
    """A byte-level BPE tokenizer of `vocab_size` ids trained on the "text" column of `ds`, saved at `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[eod], show_progress=True,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((b["text"] for b in ds.iter(batch_size=1000)), trainer, length=len(ds))
    tok.save(path)


def _encoder(tokenizer_path: str, eod_id: int):
    """A batched map function; each process loads the tokenizer once (a closure would pickle it per batch)."""
    state: dict[str, Any] = {}

    def encode(batch: dict[str, list]) -> dict[str, list]:
        if "tok" not in state:
            from tokenizers import Tokenizer
            state["tok"] = Tokenizer.from_file(tokenizer_path)
        texts = [t for t in batch["text"] if isinstance(t, str) and t.strip()]
        return {"ids": [e.ids + [eod_id] for e in state["tok"].encode_batch(texts, add_special_tokens=False)]}

    return encode


def prepare(inputs: list[str], tokenizer: str, out: str, *, field: str = "text", unit: str = "file",
            eod: str | None = None, dtype: str = "auto", workers: int | None = None, batch: int = 1000,
            train_vocab: int | None = None, encoding_errors: str = "strict") -> dict[str, Any]:
    """Tokenize `inputs` into ``OUT.bin``/``OUT.idx``; returns (and writes beside them) the summary.
    `train_vocab`: first train a byte-level BPE of that many ids on the inputs and save it at `tokenizer`.

    All or nothing: everything is written under a temporary directory (on the output's file system)
    and renamed into place at the end, so a failure leaves an existing corpus (and tokenizer) as it
    was and no file behind. The arguments and the tokenizer are checked before anything is created."""
    started = time.perf_counter()
    if train_vocab is not None and not 258 <= train_vocab <= 1 << 20:
        raise ConfigError("--train-tokenizer", train_vocab, "a vocabulary of 258 to 1048576 ids")
    by_format = _inputs(inputs)
    if train_vocab is None:
        tok, eod_id = _tokenizer(tokenizer, eod)
        _id_dtype(dtype, tok.get_vocab_size(with_added_tokens=True))
    else:
        _id_dtype(dtype, train_vocab)
    workers = max(1, workers or min(8, os.cpu_count() or 1))
    try:
        work = Path(tempfile.mkdtemp(prefix=f".{Path(out).name}.prepare-", dir=_existing(Path(out).absolute().parent)))
    except OSError as e:
        raise ConfigError("output", out, f"a place this process can write ({e.strerror or e})") from None
    try:
        cache, tokenizer_used, staged = str(work / "cache"), tokenizer, str(work / "corpus")
        if train_vocab is not None:
            tokenizer_used = str(work / "tokenizer.json")
            train_tokenizer(_load(by_format, field, unit, cache, encoding_errors), train_vocab, tokenizer_used,
                            eod or EOD_CANDIDATES[0])
            tok, eod_id = _tokenizer(tokenizer_used, eod)
        vocab_size = tok.get_vocab_size(with_added_tokens=True)
        dtype, limit = _id_dtype(dtype, vocab_size)
        ds = _load(by_format, field, unit, cache, encoding_errors)
        if len(ds) == 0:
            raise ConfigError("input", inputs, "files holding at least one document")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false" if workers > 1 else "true")
        ids = ds.map(_encoder(tokenizer_used, eod_id), batched=True, batch_size=batch,
                     num_proc=workers if workers > 1 else None, remove_columns=["text"], desc="tokenizing")
        if len(ids) == 0:
            raise ConfigError("input", inputs, "files holding at least one non-blank document")
        lengths, top = _write(ids, staged, dtype, limit)
        seconds = time.perf_counter() - started
        summary = {"inputs": {fmt: len(files) for fmt, files in by_format.items()}, "tokenizer": str(tokenizer),
                   "vocab_size": vocab_size, "eod_id": eod_id, "dtype": dtype, "documents": int(len(lengths)),
                   "tokens": int(lengths.sum()), "max_token_id": top, "seconds": round(seconds, 3),
                   "tokens_per_s": round(float(lengths.sum()) / seconds, 1), "lengths": length_stats(lengths)}
        summary_path(staged).write_text(json.dumps(summary, indent=1) + "\n")
        try:
            if tokenizer_used != tokenizer:   # first: a corpus never lands without the tokenizer that made it
                Path(tokenizer).parent.mkdir(parents=True, exist_ok=True)
                shutil.move(tokenizer_used, tokenizer)
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            for src, dst in zip(corpus_files(staged), corpus_files(out)):
                os.replace(src, dst)
        except OSError as e:
            raise ConfigError("output", out, f"a place this process can write ({e.strerror or e})") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return summary


def _id_dtype(dtype: str, vocab_size: int) -> tuple[str, int]:
    """The token id dtype ("auto": the narrowest that holds `vocab_size` ids) and its id limit."""
    if dtype == "auto":
        dtype = "uint16" if vocab_size <= 1 << 16 else "uint32"
    limit = int(np.iinfo(TOKEN_DTYPES[dtype]).max) + 1
    if vocab_size > limit:
        raise ConfigError("--dtype", dtype, f"a dtype that holds the tokenizer's {vocab_size} ids (uint32)")
    return dtype, limit


def _existing(folder: Path) -> Path:
    """`folder`, or its nearest ancestor that exists (where new folders would be made)."""
    while not folder.exists():
        folder = folder.parent
    return folder


def _write(ids, out: str, dtype: str, limit: int) -> tuple[np.ndarray, int]:
    from tqdm.auto import tqdm

    writer, lengths, top = IndexedWriter(out, dtype), [], -1
    with tqdm(total=len(ids), desc="writing", unit="doc") as bar:
        for table in ids.with_format("arrow").iter(batch_size=10_000):
            column = table.column("ids").combine_chunks()
            flat = column.flatten().to_numpy()
            n = np.diff(column.offsets.to_numpy())
            top = max(top, int(flat.max()))
            if top >= limit:
                writer.abort()
                raise ConfigError("--dtype", dtype, f"a dtype that holds token id {top} (the tokenizer made it)")
            writer.add(flat, n)
            lengths.append(n)
            bar.update(len(n))
    writer.close()
    return np.concatenate(lengths), top


def print_summary(s: dict[str, Any], out: str) -> None:
    ls = s["lengths"]
    print(f"{s['documents']:,} documents, {s['tokens']:,} tokens ({s['dtype']}, vocab {s['vocab_size']:,}, "
          f"end-of-document id {s['eod_id']}) in {s['seconds']:.1f} s, {s['tokens_per_s']:,.0f} tokens/s")
    print(f"document length: min {ls['min']}, mean {ls['mean']:.1f}, p50 {ls['p50']:.0f}, p90 {ls['p90']:.0f}, "
          f"p99 {ls['p99']:.0f}, max {ls['max']}")
    top = max(c for _, _, c in ls["histogram"])
    for lo, hi, c in ls["histogram"]:
        print(f"  {lo:>8}-{hi - 1:<8} {c:>10,} {'#' * round(40 * c / top) if top else ''}")
    print(f"wrote {out}.bin, {out}.idx and {out}.json; train on it with  data: {{source: tokens, files: [{out}]}}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="malleus prepare-data", description=__doc__.split("\n\n")[0])
    ap.add_argument("inputs", nargs="+", help="files or directories: .txt/.md (text), .jsonl/.json, .parquet")
    ap.add_argument("--tokenizer", required=True, help="a Hugging Face tokenizers tokenizer.json (written there "
                    "with --train-tokenizer)")
    number_option(ap, "--train-tokenizer", 258, 1 << 20, integer=True, metavar="VOCAB", default=None,
                    help="first train a byte-level BPE tokenizer of VOCAB ids on the inputs")
    ap.add_argument("--out", required=True, help="output prefix: writes OUT.bin, OUT.idx and OUT.json")
    ap.add_argument("--field", default="text", help="the text field of JSON and Parquet records (default: text)")
    ap.add_argument("--unit", choices=sorted(TEXT_UNITS), default="file",
                    help="what one document of a text file is (default: the whole file)")
    ap.add_argument("--eod", default=None, help=f"end-of-document token (default: the first of {list(EOD_CANDIDATES)} "
                    "the tokenizer has)")
    ap.add_argument("--dtype", choices=("auto", *TOKEN_DTYPES), default="auto",
                    help="token id width (auto: uint16 when the vocabulary fits)")
    ap.add_argument("--encoding-errors", choices=ENCODING_ERRORS, default="strict",
                    help="text files that are not utf-8: refuse them (strict, the default), or replace or drop "
                    "the bad bytes")
    number_option(ap, "--workers", 1, 1024, integer=True, default=None,
                  help="tokenizing processes (default: cores, at most 8)")
    args = ap.parse_args(argv)
    summary = prepare(args.inputs, args.tokenizer, args.out, field=args.field, unit=args.unit, eod=args.eod,
                      dtype=args.dtype, workers=args.workers, train_vocab=args.train_tokenizer,
                      encoding_errors=args.encoding_errors)
    print_summary(summary, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
