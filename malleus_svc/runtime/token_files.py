"""Token files on disk: the Megatron indexed format and plain nanoGPT-style arrays.

Megatron indexed (``PREFIX.bin`` + ``PREFIX.idx``): the ``.bin`` holds the token ids of every
sequence back to back; the ``.idx`` is a 9-byte magic, version 1 (u64), a dtype code (u8), the
sequence count n (u64), the document-index count d (u64), then n int32 sequence lengths, n int64
byte pointers into the ``.bin`` and d int64 document indices (a document is the sequence range
``[doc[k], doc[k+1])``). Each sequence is one document here, as in Megatron's GPT dataset.

Plain (``FILE.bin``, nanoGPT's layout): a bare array of ``uint16`` or ``uint32`` ids, one stream.
Documents come from an optional offsets file (``.npy``, int64 token offsets, first 0, ascending);
without one, the stream is cut into chunks by the dataset.

A file opens to a `TokenFile`: document start offsets and lengths (in tokens) and a memory map of
the ids opened on first read and never pickled, so a copy sent to a worker maps its own. Every
size is checked against the file sizes before a token is read: a truncated or mismatched index is
refused with what is wrong. `IndexedWriter` writes the Megatron format (`malleus prepare-data`).
"""
from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from malleus_svc.config import job as job_config
from malleus_svc.runtime.data import DataError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
# Megatron's dtype codes (megatron/core/datasets/indexed_dataset.py, DType)
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
               8: np.uint16}
# a plain .bin's ids: the names the job file accepts, as numpy dtypes
TOKEN_DTYPES = {name: np.dtype(name) for name in job_config.TOKEN_DTYPES}
_HEADER = struct.Struct("<9sQBQQ")
_SCAN_CHUNK = 1 << 24   # tokens per chunk when scanning a file for its largest id


def summary_path(prefix: str | os.PathLike) -> Path:
    """Where `malleus prepare-data` writes its summary beside ``PREFIX.bin``/``PREFIX.idx``."""
    return Path(f"{prefix}.json")


def corpus_files(prefix: str | os.PathLike) -> tuple[Path, Path, Path]:
    """The files `malleus prepare-data` writes for `prefix`: ``.bin``, ``.idx`` and the summary."""
    return Path(f"{prefix}.bin"), Path(f"{prefix}.idx"), summary_path(prefix)


class TokenFile:
    """One file of documents: ``starts[k]``/``lengths[k]`` in tokens, ids read through a memory map."""

    def __init__(self, path: Path, dtype: np.dtype, starts: np.ndarray, lengths: np.ndarray, fmt: str,
                 byte_offset: int = 0):
        self.path, self.dtype, self.format, self._offset = path, np.dtype(dtype), fmt, byte_offset
        self.starts, self.lengths = starts, lengths
        self.tokens = int(lengths.sum())
        self._map: np.memmap | None = None

    def __len__(self) -> int:
        return len(self.starts)

    def ids(self, start: int, count: int) -> np.ndarray:
        """`count` token ids from token offset `start` (a view of the memory map)."""
        if self._map is None:
            total = (self.path.stat().st_size - self._offset) // self.dtype.itemsize
            self._map = np.memmap(self.path, dtype=self.dtype, mode="r", offset=self._offset, shape=(total,))
        return self._map[start:start + count]

    def max_id(self) -> int:
        """The largest id in the file, by a chunked scan (memory stays at one chunk)."""
        top = -1
        for a in range(0, self.tokens and int(self.starts[-1] + self.lengths[-1]), _SCAN_CHUNK):
            top = max(top, int(self.ids(a, _SCAN_CHUNK).max()))
        return top

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_map": None}


def _regular(path: Path, what: str) -> int:
    if not path.exists():
        raise DataError(f"{what} {str(path)!r} does not exist")
    if not path.is_file():
        raise DataError(f"{what} {str(path)!r} is not a regular file")
    return path.stat().st_size


def open_indexed(prefix: str | os.PathLike) -> TokenFile:
    """``PREFIX.bin`` + ``PREFIX.idx`` (Megatron indexed), checked against each other."""
    idx, bin_ = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    idx_size, bin_size = _regular(idx, "index file"), _regular(bin_, "token file")
    bad = f"{idx} is not a Megatron index"
    if idx_size < _HEADER.size:
        raise DataError(f"{bad}: {idx_size} bytes, shorter than the {_HEADER.size}-byte header")
    with open(idx, "rb") as f:
        magic, version, code, n, d = _HEADER.unpack(f.read(_HEADER.size))
    if magic != MAGIC:
        raise DataError(f"{bad}: it starts with {magic!r}, not {MAGIC!r}")
    if version != VERSION:
        raise DataError(f"{bad}: version {version}, only version {VERSION} is read")
    if code not in DTYPE_CODES or not np.issubdtype(DTYPE_CODES[code], np.integer):
        raise DataError(f"{bad}: dtype code {code}; token ids need an integer code {sorted(k for k, v in DTYPE_CODES.items() if np.issubdtype(v, np.integer))}")
    dtype = np.dtype(DTYPE_CODES[code])
    want = _HEADER.size + 12 * n + 8 * d
    if idx_size not in (want, want + n):   # + n: the multimodal variant's sequence modes
        raise DataError(f"{bad}: it declares {n} sequences and {d} document indices ({want} bytes), "
                        f"but has {idx_size} bytes (truncated or from another writer)")
    lengths = np.memmap(idx, dtype=np.int32, mode="r", offset=_HEADER.size, shape=(n,))
    pointers = np.memmap(idx, dtype=np.int64, mode="r", offset=_HEADER.size + 4 * n, shape=(n,))
    docs = np.memmap(idx, dtype=np.int64, mode="r", offset=_HEADER.size + 12 * n, shape=(d,))
    if n and (lengths.min() < 0 or pointers[0] != 0
              or np.any(pointers[1:] != pointers[:-1] + lengths[:-1].astype(np.int64) * dtype.itemsize)):
        raise DataError(f"{bad}: its sequence pointers do not follow its lengths (every sequence must "
                        f"start where the previous one ends)")
    end = int(pointers[-1]) + int(lengths[-1]) * dtype.itemsize if n else 0
    if end != bin_size:
        raise DataError(f"{bin_} has {bin_size} bytes but {idx.name} describes {end}: the pair does not match "
                        f"(a truncated or replaced .bin?)")
    if d and (docs[0] != 0 or docs[-1] != n or np.any(np.diff(docs) < 0)):
        raise DataError(f"{bad}: its document indices must rise from 0 to the {n} sequences")
    starts = (np.asarray(pointers) // dtype.itemsize).astype(np.int64)
    return TokenFile(bin_, dtype, starts, np.asarray(lengths, dtype=np.int64), "megatron")


def open_plain(path: str | os.PathLike, dtype: str = "uint16", offsets: str | os.PathLike | None = None) -> TokenFile:
    """A bare ``uint16``/``uint32`` array; documents from an ``.npy`` of start offsets, else one stream."""
    path = Path(path)
    if dtype not in TOKEN_DTYPES:
        raise DataError(f"dtype {dtype!r} for {path}: use one of {list(TOKEN_DTYPES)}")
    dt = np.dtype(TOKEN_DTYPES[dtype])
    size = _regular(path, "token file")
    if size % dt.itemsize:
        raise DataError(f"{path} has {size} bytes, not a whole number of {dtype} ids (wrong dtype or truncated)")
    total = size // dt.itemsize
    if offsets is None:
        starts = np.zeros(1 if total else 0, dtype=np.int64)
    else:
        _regular(Path(offsets), "offsets file")
        try:
            starts = np.load(offsets, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError) as e:
            raise DataError(f"offsets file {str(offsets)!r} is not a .npy array ({e})") from None
        if starts.ndim != 1 or not np.issubdtype(starts.dtype, np.integer):
            raise DataError(f"offsets file {str(offsets)!r} must hold a 1-D integer array, got {starts.dtype} {starts.shape}")
        starts = np.asarray(starts, dtype=np.int64)
        if len(starts) and (starts[0] != 0 or np.any(np.diff(starts) <= 0) or starts[-1] >= total):
            raise DataError(f"offsets file {str(offsets)!r} must rise strictly from 0 and stay below the "
                            f"{total} tokens of {path}")
    lengths = np.diff(np.append(starts, total)).astype(np.int64)
    return TokenFile(path, dt, starts, lengths, "plain")


class IndexedWriter:
    """Writes ``PREFIX.bin``/``PREFIX.idx`` a batch of documents at a time; the index is written at `close`."""

    def __init__(self, prefix: str | os.PathLike, dtype: str):
        if dtype not in TOKEN_DTYPES:
            raise DataError(f"dtype {dtype!r}: use one of {list(TOKEN_DTYPES)}")
        self.prefix, self.dtype = str(prefix), np.dtype(TOKEN_DTYPES[dtype])
        self._bin: BinaryIO = open(f"{self.prefix}.bin", "wb")
        self._lengths: list[np.ndarray] = []

    def add(self, ids: np.ndarray, lengths: np.ndarray) -> None:
        """Documents of `lengths` tokens whose ids follow each other in `ids`."""
        self._bin.write(np.ascontiguousarray(ids, dtype=self.dtype).tobytes())
        self._lengths.append(np.asarray(lengths, dtype=np.int32))

    def abort(self) -> None:
        """Stop without writing the index (the caller removes what was written)."""
        self._bin.close()

    def close(self) -> None:
        self._bin.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, dtype=np.int32)
        n = len(lengths)
        code = next(k for k, v in DTYPE_CODES.items() if np.dtype(v) == self.dtype)
        pointers = np.concatenate(([0], np.cumsum(lengths, dtype=np.int64)[:-1] * self.dtype.itemsize)).astype(np.int64)
        with open(f"{self.prefix}.idx", "wb") as f:
            f.write(_HEADER.pack(MAGIC, VERSION, code, n, n + 1))
            f.write(lengths.tobytes())
            f.write(pointers[:n].tobytes())
            f.write(np.arange(n + 1, dtype=np.int64).tobytes())
