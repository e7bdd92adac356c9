"""Bundled token sources (no downloads) and collation into packed micro-batches.

A `TokenDataset` maps a sample index to the int64 token ids of one sequence of length between 2
and ``seq_len + 1``; the model reads ``seq[:-1]`` and predicts ``seq[1:]``.

* `SyntheticVarLen`: long-tailed (lognormal) lengths and tokens from a seeded sparse bigram
  chain, so a model can learn it (the best reachable loss is `entropy_floor` nats per token).
* `PythonSourceCorpus`: real text, the Python standard library's own ``.py`` files, at byte level.
* `TokenCorpus`: tokenized documents from disk (`token_files`), a blend of files.

`collate` turns a list of sample ids into a `MicroBatch` (packed with ``cu_seqlens``, or padded),
`length_stats` summarises a length distribution, `build_dataset` builds a source from a config dict.
"""
from __future__ import annotations

import json
import math
import os
import sysconfig
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np
import torch

from malleus_svc.config.job import CORPUS_SPLITS, DATA_MODES, DATA_SOURCES
from malleus_svc.runtime.batch import IGNORE_INDEX, MicroBatch
from malleus_svc.runtime.data import DataError, _check_int
from malleus_svc.runtime.token_files import TokenFile, open_indexed, open_plain, summary_path


@runtime_checkable
class TokenDataset(Protocol):
    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> torch.Tensor: ...


def _index(i: Any, n: int, what: str) -> int:
    if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
        raise TypeError(f"{what} index must be an int, got {type(i).__name__}")
    i = int(i)
    if i < 0:
        i += n
    if not 0 <= i < n:
        raise IndexError(f"{what} index {i} out of range for {n} samples")
    return i


# ---------------------------------------------------------------------------------------------
# synthetic
# ---------------------------------------------------------------------------------------------


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """Counter-based hash (SplitMix64 finaliser) of a uint64 array; wraps modulo 2**64."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _uniform(seed: int, stream: int, idx: np.ndarray) -> np.ndarray:
    """Uniform (0, 1) floats, a pure function of (seed, stream, index)."""
    with np.errstate(over="ignore"):
        key = _splitmix64(np.asarray([seed * 4 + stream], dtype=np.uint64))[0]
        h = _splitmix64(idx.astype(np.uint64) ^ key)
        h = _splitmix64(h + key)
    return ((h >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)


class SyntheticVarLen:
    """Synthetic variable-length token sequences with long-tailed lengths.

    Lengths: lognormal with mean `mean_len` (of the unclipped distribution; default
    ``(seq_len + 1) / 4``) and log-space std `sigma`, rounded and clipped to
    ``[min_len, seq_len + 1]`` (`min_len` defaults to ``min(8, seq_len + 1)``).
    Tokens: a seeded sparse bigram chain: the hidden state advances by one of a few seeded
    offsets (skewed probabilities) modulo `vocab`, and is emitted through a seeded permutation of
    the vocabulary. Each token depends only on the previous one, through a table with at most 4
    non-zeros per row, so the loss can fall from ``log(vocab)`` to `entropy_floor`.
    Everything is a pure function of (seed, index): random access, no state, picklable.
    """

    def __init__(self, num_samples: int, seq_len: int, vocab: int, seed: int = 0,
                 mean_len: float | None = None, sigma: float = 1.0, min_len: int | None = None):
        self.num_samples = _check_int("num_samples", num_samples, 1)
        self.seq_len = _check_int("seq_len", seq_len, 2)
        self.vocab = _check_int("vocab", vocab, 2)
        self.seed = _check_int("seed", seed, 0)
        max_len = self.seq_len + 1
        self.min_len = min(8, max_len) if min_len is None else _check_int("min_len", min_len, 2)
        if self.min_len > max_len:
            raise DataError(f"min_len {self.min_len} exceeds seq_len + 1 = {max_len}; use min_len in [2, {max_len}]")
        self.mean_len = max_len / 4 if mean_len is None else float(mean_len)
        if not (math.isfinite(self.mean_len) and self.mean_len > 0):
            raise DataError(f"mean_len must be a positive number, got {mean_len!r}")
        self.sigma = float(sigma)
        if not (math.isfinite(self.sigma) and self.sigma >= 0):
            raise DataError(f"sigma must be a finite number >= 0, got {sigma!r}")
        self._mu = math.log(self.mean_len) - self.sigma ** 2 / 2
        # the bigram chain
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, 0x5EED])))
        k = min(4, self.vocab - 1)
        self._offsets = rng.choice(np.arange(1, self.vocab), size=k, replace=False).astype(np.int64)
        probs = np.array([0.55, 0.25, 0.12, 0.08][:k])
        self._probs = probs / probs.sum()
        self._emit = rng.permutation(self.vocab).astype(np.int64)
        self._lengths: np.ndarray | None = None

    @property
    def entropy_floor(self) -> float:
        """Per-token cross-entropy (nats) of the true next-token distribution (first token excluded)."""
        p = self._probs
        return float(-(p * np.log(p)).sum())

    def _lengths_of(self, idx: np.ndarray) -> np.ndarray:
        u1 = _uniform(self.seed, 0, idx)
        u2 = _uniform(self.seed, 1, idx)
        z = np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)  # Box-Muller
        raw = np.exp(self._mu + self.sigma * z)
        return np.clip(np.rint(raw), self.min_len, self.seq_len + 1).astype(np.int64)

    def length(self, i: int) -> int:
        i = _index(i, self.num_samples, "SyntheticVarLen")
        return int(self._lengths_of(np.array([i]))[0])

    @property
    def lengths(self) -> np.ndarray:
        """Length of every sample (computed once, vectorised)."""
        if self._lengths is None:
            self._lengths = self._lengths_of(np.arange(self.num_samples))
            self._lengths.setflags(write=False)
        return self._lengths

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> torch.Tensor:
        i = _index(i, self.num_samples, "SyntheticVarLen")
        n = self.length(i)
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, 1, i])))
        start = rng.integers(self.vocab)
        steps = self._offsets[rng.choice(len(self._offsets), size=n - 1, p=self._probs)]
        state = (start + np.concatenate(([0], np.cumsum(steps)))) % self.vocab
        return torch.from_numpy(self._emit[state])

    def describe(self) -> dict[str, Any]:
        return {"source": "synthetic", "len": len(self), "seq_len": self.seq_len, "vocab": self.vocab,
                "seed": self.seed, "mean_len": self.mean_len, "sigma": self.sigma, "min_len": self.min_len,
                "entropy_floor": self.entropy_floor, "lengths": length_stats(self.lengths)}

    def __repr__(self) -> str:
        return (f"SyntheticVarLen(num_samples={self.num_samples}, seq_len={self.seq_len}, vocab={self.vocab}, "
                f"seed={self.seed}, mean_len={self.mean_len:g}, sigma={self.sigma:g}, min_len={self.min_len})")


# ---------------------------------------------------------------------------------------------
# Python standard library source
# ---------------------------------------------------------------------------------------------
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def _find_py_files(root: Path) -> list[Path]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(".")]
        found.extend(Path(dirpath, f) for f in filenames if f.endswith(".py"))
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


class PythonSourceCorpus:
    """The Python standard library's own ``.py`` files as byte-level tokens (vocab 256).

    Files are found under ``sysconfig.get_paths()["stdlib"]`` (or `root`), skipping
    ``site-packages``/``dist-packages``/``__pycache__``, and sorted by relative path. The index
    (file sizes and offsets) is built at construction from ``stat`` alone; the bytes are read once,
    on first access, into one in-memory buffer (not pickled: a copy sent to a worker re-reads).

    mode "pack": the files joined by a newline, cut into non-overlapping chunks of exactly
    ``seq_len + 1`` bytes (the incomplete last chunk is dropped).
    mode "documents": each file is its own sequence, split into pieces of at most ``seq_len + 1``
    bytes; empty files and 1-byte trailing pieces are dropped.
    `max_files`: use only the first files (in sorted order). `num_samples`: use only the first
    sequences (an error if there are fewer).
    """

    vocab = 256

    def __init__(self, seq_len: int, mode: str = "pack", max_files: int | None = None,
                 num_samples: int | None = None, root: str | os.PathLike | None = None):
        self.seq_len = _check_int("seq_len", seq_len, 2)
        if mode not in CORPUS_SPLITS:
            raise DataError(f"PythonSourceCorpus mode must be one of {list(CORPUS_SPLITS)}, got {mode!r}")
        self.mode = mode
        self.root = Path(root) if root is not None else Path(sysconfig.get_paths()["stdlib"])
        if not self.root.is_dir():
            raise DataError(f"Python source root {str(self.root)!r} is not a directory")
        files = _find_py_files(self.root)
        if max_files is not None:
            files = files[:_check_int("max_files", max_files, 1)]
        if not files:
            raise DataError(f"no .py files found under {str(self.root)!r}")
        self.files = files
        self.file_sizes = np.array([p.stat().st_size for p in files], dtype=np.int64)
        sep = np.ones(len(files), dtype=np.int64)
        sep[-1] = 0
        self.file_starts = np.concatenate(([0], np.cumsum(self.file_sizes + sep)[:-1])).astype(np.int64)
        self.total_bytes = int(self.file_sizes.sum() + sep.sum())
        n = self.seq_len + 1
        if mode == "pack":
            count = self.total_bytes // n
            self._starts = np.arange(count, dtype=np.int64) * n
            self._lens = np.full(count, n, dtype=np.int64)
        else:
            starts, lens = [], []
            for fs, size in zip(self.file_starts.tolist(), self.file_sizes.tolist()):
                for off in range(0, size, n):
                    ln = min(n, size - off)
                    if ln >= 2:
                        starts.append(fs + off)
                        lens.append(ln)
            self._starts = np.array(starts, dtype=np.int64)
            self._lens = np.array(lens, dtype=np.int64)
        if num_samples is not None:
            num_samples = _check_int("num_samples", num_samples, 1)
            if num_samples > len(self._starts):
                raise DataError(f"num_samples {num_samples} exceeds the {len(self._starts)} sequences of the "
                                f"Python source corpus (seq_len {self.seq_len}, mode {mode!r}); use at most "
                                f"{len(self._starts)} or leave num_samples out")
            self._starts, self._lens = self._starts[:num_samples], self._lens[:num_samples]
        if len(self._starts) == 0:
            raise DataError(f"the Python source corpus has no sequences of seq_len {self.seq_len} "
                            f"({self.total_bytes} bytes in {len(files)} files); lower seq_len or raise max_files")
        self._starts.setflags(write=False)
        self._lens.setflags(write=False)
        self._buf: np.ndarray | None = None

    # -- storage
    def _buffer(self) -> np.ndarray:
        if self._buf is None:
            buf = bytearray(b"\n" * self.total_bytes)
            for path, start, size in zip(self.files, self.file_starts.tolist(), self.file_sizes.tolist()):
                data = path.read_bytes()
                if len(data) != size:
                    raise DataError(f"{path} changed size since the corpus index was built "
                                    f"({size} -> {len(data)} bytes); rebuild the PythonSourceCorpus")
                buf[start:start + size] = data
            arr = np.frombuffer(buf, dtype=np.uint8)
            arr.setflags(write=False)
            self._buf = arr
        return self._buf

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_buf"] = None
        return state

    # -- dataset
    def __len__(self) -> int:
        return len(self._starts)

    def __getitem__(self, i: int) -> torch.Tensor:
        i = _index(i, len(self._starts), "PythonSourceCorpus")
        s, n = int(self._starts[i]), int(self._lens[i])
        return torch.from_numpy(self._buffer()[s:s + n].astype(np.int64))

    @property
    def lengths(self) -> np.ndarray:
        return self._lens

    @property
    def avg_length(self) -> float:
        return float(self._lens.mean())

    def file_of(self, i: int) -> Path:
        """The file the first byte of sample `i` comes from."""
        i = _index(i, len(self._starts), "PythonSourceCorpus")
        return self.files[int(np.searchsorted(self.file_starts, self._starts[i], side="right")) - 1]

    def text(self, i: int) -> str:
        """Sample `i` decoded as UTF-8 (undecodable bytes replaced), for inspection."""
        return bytes(self[i].to(torch.uint8).numpy()).decode("utf-8", errors="replace")

    def describe(self) -> dict[str, Any]:
        return {"source": "python-stdlib", "root": str(self.root), "mode": self.mode, "seq_len": self.seq_len,
                "files": len(self.files), "bytes": self.total_bytes, "len": len(self),
                "avg_length": self.avg_length, "lengths": length_stats(self._lens)}

    def __repr__(self) -> str:
        return (f"PythonSourceCorpus(seq_len={self.seq_len}, mode={self.mode!r}, files={len(self.files)}, "
                f"len={len(self)}, avg_length={self.avg_length:.1f})")


# ---------------------------------------------------------------------------------------------
# tokenized documents from disk
# ---------------------------------------------------------------------------------------------
def _open(entry: Mapping[str, Any]) -> TokenFile:
    path = str(entry["path"])
    if Path(f"{path}.idx").exists():
        return open_indexed(path)
    if path.endswith(".bin"):
        return open_plain(path, entry.get("dtype", "uint16"), entry.get("offsets"))
    raise DataError(f"token file {path!r}: neither {path}.idx + {path}.bin (Megatron indexed) exists nor does "
                    f"the path name a plain .bin")


class TokenCorpus:
    """Tokenized documents from disk, a blend of files; every sample is one document or a piece of one.

    A document of L tokens gives ``ceil((L - 1) / seq_len)`` samples of at most ``seq_len + 1``
    tokens that overlap by one token, so every next-token target is trained exactly once; 1-token
    documents give none. A file's `weight` is how many times its samples appear per epoch: 1 = once,
    2 = twice, 0.5 = a seeded half of them (the same half every epoch). The index holds about 36 bytes
    per sample; token ids stay on disk and each read maps only the sample it needs.
    Ids at or above `vocab` are refused when the corpus opens. A file's largest id (`max_ids`) is its
    entry's `max_id` if given (what the driver found: `worker_spec` passes it on, so no worker scans),
    else prepare-data's summary, else a chunked scan; `scan=False` skips the scan (the cheap checks
    before a job starts, `check_before_start`).
    """

    def __init__(self, files: Sequence[Mapping[str, Any]], seq_len: int, vocab: int, seed: int = 0,
                 scan: bool = True):
        self.seq_len = _check_int("seq_len", seq_len, 2)
        self.vocab = _check_int("vocab", vocab, 2)
        self.seed = _check_int("seed", seed, 0)
        if not files:
            raise DataError("source 'tokens' needs at least one file")
        self.files = [_open(e) for e in files]
        self.weights = [float(e.get("weight", 1.0)) for e in files]
        if not all(math.isfinite(w) and w > 0 for w in self.weights):
            raise DataError(f"file weights must be positive numbers (times per epoch), got {self.weights}")
        self.max_ids = [self._largest_id(f, e.get("max_id"), scan) for f, e in zip(self.files, files)]
        S = self.seq_len
        self._piece_starts, self._piece_lens, self._first_piece = [], [], []
        picks_file, picks_piece, lengths = [], [], []
        for k, (f, w) in enumerate(zip(self.files, self.weights)):
            L = f.lengths
            count = np.where(L >= 2, (L - 2) // S + 1, 0)
            first = np.cumsum(count) - count
            doc = np.repeat(np.arange(len(L), dtype=np.int64), count)
            j = np.arange(len(doc), dtype=np.int64) - first[doc]
            self._piece_starts.append(f.starts[doc] + j * S)
            self._piece_lens.append(np.minimum(S + 1, L[doc] - j * S))
            self._first_piece.append(first)
            n = len(doc)
            extra = int(round((w - math.floor(w)) * n))
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, 0xB1E4D, k])))
            local = np.concatenate([np.tile(np.arange(n, dtype=np.int64), math.floor(w)),
                                    np.sort(rng.permutation(n)[:extra])])
            picks_file.append(np.full(len(local), k, dtype=np.int32))
            picks_piece.append(local)
            lengths.append(self._piece_lens[k][local])
        self._file = np.concatenate(picks_file)
        self._piece = np.concatenate(picks_piece)
        if len(self._file) == 0:
            raise DataError(f"the token corpus has no document of 2 tokens or more "
                            f"({', '.join(str(f.path) for f in self.files)}): nothing to train on")
        self.lengths = np.concatenate(lengths)
        self.lengths.setflags(write=False)

    def _largest_id(self, f: TokenFile, known: Any, scan: bool) -> int | None:
        """`f`'s largest id (None: unknown without the scan), refused if the model's vocab lacks it."""
        meta = None
        if f.format == "megatron" and summary_path(f.path.with_suffix("")).is_file():
            meta = _read_summary(f)
        if meta is not None and meta.get("vocab_size", 0) > self.vocab:
            raise DataError(f"{f.path} was tokenized with a vocabulary of {meta['vocab_size']}, more than the model's "
                            f"{self.vocab}: use a model with vocab >= {meta['vocab_size']} or another tokenizer")
        if known is not None:
            top = _check_int(f"{f.path} max_id", known, -1)
        elif meta is not None:
            top = meta["max_token_id"]
        else:
            top = f.max_id() if scan else None
        if top is not None and top >= self.vocab:
            raise DataError(f"{f.path} holds token id {top}, at or above the model's vocab {self.vocab}: "
                            f"use a model with vocab > {top} or re-tokenize")
        return top

    def __len__(self) -> int:
        return len(self._file)

    def __getitem__(self, i: int) -> torch.Tensor:
        i = _index(i, len(self._file), "TokenCorpus")
        k, p = int(self._file[i]), int(self._piece[i])
        ids = self.files[k].ids(int(self._piece_starts[k][p]), int(self._piece_lens[k][p])).astype(np.int64)
        if ids.max() >= self.vocab or ids.min() < 0:
            raise DataError(f"{self.files[k].path}: sample {i} holds ids outside [0, {self.vocab}) "
                            f"(the file changed since it was opened?)")
        return torch.from_numpy(ids)

    def document_of(self, i: int) -> tuple[int, int]:
        """(file, document) that sample `i` comes from."""
        i = _index(i, len(self._file), "TokenCorpus")
        k, p = int(self._file[i]), int(self._piece[i])
        return k, int(np.searchsorted(self._first_piece[k], p, side="right")) - 1

    def describe(self) -> dict[str, Any]:
        per_file = [{"path": str(f.path), "format": f.format, "documents": len(f), "tokens": f.tokens,
                     "weight": w, "share": float(np.mean(self._file == k))}
                    for k, (f, w) in enumerate(zip(self.files, self.weights))]
        return {"source": "tokens", "seq_len": self.seq_len, "vocab": self.vocab, "len": len(self),
                "files": per_file, "lengths": length_stats(self.lengths)}

    def __repr__(self) -> str:
        return f"TokenCorpus(files={len(self.files)}, seq_len={self.seq_len}, len={len(self)})"


def _read_summary(f: TokenFile) -> dict[str, Any] | None:
    """prepare-data's summary of `f`, if it describes this very file (same document and token counts)."""
    try:
        meta = json.loads(summary_path(f.path.with_suffix("")).read_text())
    except (OSError, ValueError):
        return None
    ok = (isinstance(meta, dict) and meta.get("documents") == len(f) and meta.get("tokens") == f.tokens
          and all(isinstance(meta.get(k), int) for k in ("max_token_id", "vocab_size")))
    return meta if ok else None


# ---------------------------------------------------------------------------------------------
# collation and statistics
# ---------------------------------------------------------------------------------------------
def collate(dataset: TokenDataset, sample_ids: Sequence[int], mode: str = "pack",
            seq_len: int | None = None) -> MicroBatch:
    """One micro-batch from the sequences `sample_ids` of `dataset`, in order.

    "pack": the sequences' inputs (``seq[:-1]``) concatenated into one row, targets
    ``seq[1:]``, ``cu_seqlens`` at the boundaries; no padding (the model segments attention).
    "pad": every sequence's inputs padded to `seq_len` (default ``dataset.seq_len``) with token 0
    and IGNORE_INDEX targets; each padded sequence is one segment of ``seq_len`` tokens.
    If `seq_len` is known, a sequence longer than ``seq_len + 1`` is an error in both modes.
    """
    if mode not in DATA_MODES:
        raise DataError(f"collate mode must be one of {list(DATA_MODES)}, got {mode!r}")
    ids = tuple(int(i) for i in sample_ids)
    if not ids:
        raise DataError("collate needs at least one sample id, got none")
    if seq_len is None:
        seq_len = getattr(dataset, "seq_len", None)
        if mode == "pad" and seq_len is None:
            raise DataError("collate mode 'pad' needs seq_len (the dataset has no seq_len attribute)")
    if seq_len is not None:
        seq_len = _check_int("seq_len", seq_len, 1)
    inputs, targets = [], []
    for i in ids:
        seq = dataset[i]
        if not isinstance(seq, torch.Tensor) or seq.dim() != 1:
            raise DataError(f"sample {i}: a dataset item must be a 1-D tensor of token ids, got "
                            f"{type(seq).__name__}{'' if not isinstance(seq, torch.Tensor) else tuple(seq.shape)}")
        if seq.dtype.is_floating_point or seq.dtype == torch.bool or seq.dtype.is_complex:
            raise DataError(f"sample {i}: token ids must be an integer tensor, got {seq.dtype}")
        n = seq.numel()
        if n < 2:
            raise DataError(f"sample {i} has {n} token(s); a sequence needs at least 2 (input + target)")
        if seq_len is not None and n > seq_len + 1:
            raise DataError(f"sample {i} has {n} tokens, more than seq_len + 1 = {seq_len + 1}")
        seq = seq.to(torch.int64)
        x, y = seq[:-1], seq[1:]
        if mode == "pad" and n - 1 < seq_len:
            pad = seq_len - (n - 1)
            x = torch.cat([x, torch.zeros(pad, dtype=torch.int64)])
            y = torch.cat([y, torch.full((pad,), IGNORE_INDEX, dtype=torch.int64)])
        inputs.append(x)
        targets.append(y)
    lens = torch.tensor([0] + [x.numel() for x in inputs], dtype=torch.int64)
    return MicroBatch(tokens=torch.cat(inputs), targets=torch.cat(targets),
                      cu_seqlens=torch.cumsum(lens, 0).to(torch.int32), sample_ids=ids)


def length_stats(lengths: Sequence[int] | np.ndarray) -> dict[str, Any]:
    """Summary of a length distribution: count, total, min, mean, p50, p90, p99, max, and a
    histogram over log2 bins, a list of ``[lo, hi, count]`` for ``lo <= length < hi`` with
    ``lo = 2**k`` (every bin from the one holding min to the one holding max, empty ones included)."""
    a = np.asarray(lengths)
    if a.ndim != 1 or a.size == 0:
        raise DataError(f"length_stats needs a non-empty 1-D sequence of lengths, got shape {a.shape}")
    if not np.issubdtype(a.dtype, np.integer) or a.min() < 1:
        raise DataError("length_stats needs positive integer lengths")
    a = a.astype(np.int64)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    bins = np.floor(np.log2(a)).astype(np.int64)
    lo, hi = int(bins.min()), int(bins.max())
    counts = np.bincount(bins - lo, minlength=hi - lo + 1)
    return {"count": int(a.size), "total": int(a.sum()), "min": int(a.min()), "mean": float(a.mean()),
            "p50": float(p50), "p90": float(p90), "p99": float(p99), "max": int(a.max()),
            "histogram": [[1 << (lo + k), 1 << (lo + k + 1), int(c)] for k, c in enumerate(counts)]}


# ---------------------------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------------------------
_SPEC_KEYS = {
    "synthetic": {"source", "seq_len", "num_samples", "vocab", "seed", "mean_len", "sigma", "min_len"},
    "python-stdlib": {"source", "seq_len", "mode", "max_files", "num_samples", "vocab", "seed", "root"},
    "tokens": {"source", "seq_len", "files", "vocab", "seed"},
}
_FILE_KEYS = {"path", "weight", "dtype", "offsets", "max_id"}


def build_dataset(spec: Mapping[str, Any], *, scan: bool = True) -> TokenDataset:
    """A dataset from a config dict.

    synthetic:     source, seq_len, num_samples, vocab (required); seed, mean_len, sigma, min_len.
    tokens:        source, seq_len, files, vocab (required); seed. Each file is a mapping with
                   path (a Megatron prefix or a plain .bin) and optional weight, dtype, offsets,
                   max_id (its largest id, if known: no scan). `scan=False`: see TokenCorpus.
    python-stdlib: source, seq_len (required); mode ("pack" | "documents"), max_files,
                   num_samples (a cap), vocab (checked: byte tokens need >= 256), seed (accepted,
                   unused: the corpus order is fixed; shuffling is the sampler's job), root.
    Unknown keys are errors (they are usually typos).
    """
    if not isinstance(spec, Mapping):
        raise DataError(f"a dataset spec must be a dict, got {type(spec).__name__}")
    source = spec.get("source")
    if source not in DATA_SOURCES:
        raise DataError(f"dataset field 'source' must be one of {list(DATA_SOURCES)}, got {source!r}")
    unknown = sorted(set(spec) - _SPEC_KEYS[source])
    if unknown:
        raise DataError(f"dataset fields {unknown} are not accepted for source {source!r}; "
                        f"accepted: {sorted(_SPEC_KEYS[source])}")
    required = {"synthetic": ["seq_len", "num_samples", "vocab"], "tokens": ["seq_len", "files", "vocab"]}.get(
        source, ["seq_len"])
    missing = [k for k in required if k not in spec]
    if missing:
        raise DataError(f"dataset spec for source {source!r} is missing the required field(s) {missing}")

    def field(name: str, minimum: int) -> int:
        try:
            return _check_int(name, spec[name], minimum)
        except DataError as e:
            raise DataError(f"dataset field {e}") from None

    seq_len = field("seq_len", 2)
    if source == "synthetic":
        kwargs: dict[str, Any] = {}
        for name in ("mean_len", "sigma"):
            if name in spec:
                v = spec[name]
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    raise DataError(f"dataset field {name!r} must be a number, got {v!r}")
                kwargs[name] = v
        if "min_len" in spec:
            kwargs["min_len"] = field("min_len", 2)
        return SyntheticVarLen(num_samples=field("num_samples", 1), seq_len=seq_len, vocab=field("vocab", 2),
                               seed=field("seed", 0) if "seed" in spec else 0, **kwargs)
    if source == "tokens":
        files = spec["files"]
        if not isinstance(files, Sequence) or isinstance(files, (str, bytes)) or not all(
                isinstance(e, Mapping) and "path" in e and set(e) <= _FILE_KEYS for e in files):
            raise DataError(f"dataset field 'files' must be a list of mappings with a path and optional "
                            f"{sorted(_FILE_KEYS - {'path'})}, got {files!r}"[:300])
        return TokenCorpus(files, seq_len, field("vocab", 2), field("seed", 0) if "seed" in spec else 0, scan=scan)
    if "vocab" in spec and field("vocab", 1) < PythonSourceCorpus.vocab:
        raise DataError(f"dataset field 'vocab' is {spec['vocab']}, but python-stdlib is byte-level and needs a "
                        f"vocab of at least {PythonSourceCorpus.vocab}")
    if "seed" in spec:
        field("seed", 0)
    mode = spec.get("mode", "pack")
    if mode not in CORPUS_SPLITS:
        raise DataError(f"dataset field 'mode' must be one of {list(CORPUS_SPLITS)} for python-stdlib, got {mode!r}")
    return PythonSourceCorpus(seq_len=seq_len, mode=mode,
                              max_files=field("max_files", 1) if spec.get("max_files") is not None else None,
                              num_samples=field("num_samples", 1) if spec.get("num_samples") is not None else None,
                              root=spec.get("root"))


def worker_spec(spec: Mapping[str, Any], dataset: TokenDataset) -> Mapping[str, Any]:
    """`spec` for the workers' copies of `dataset`, built from it on the driver: a token corpus's
    files carry their largest ids, so no worker scans a file again (each reads only its samples)."""
    if not isinstance(dataset, TokenCorpus):
        return spec
    return {**spec, "files": [{**e, "max_id": m} for e, m in zip(spec["files"], dataset.max_ids)]}


def check_before_start(spec: Mapping[str, Any]) -> None:
    """The cheap checks of `spec`, before a job starts Ray or a worker: a token corpus's files open
    (index header and counts against the file sizes), their summaries fit the vocab and some
    document gives a sample; a file without summary is scanned only where the job builds the corpus."""
    if spec.get("source") == "tokens":
        build_dataset(spec, scan=False)
