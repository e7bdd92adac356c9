"""A checkpoint's shard files, written and read by the processes that hold the shards.

A shard file is one writer's pieces of one model part, in safetensors format: for each tensor it
holds, keys ``name``, ``name:exp_avg`` and ``name:exp_avg_sq`` with rows [start, end) of the full
tensor along its axis (`geometry.TensorSpec.axis`). Which rows a file holds is the manifest's to
say (checkpoint/manifest.py), in the full tensor's coordinates, so any plan reads any checkpoint.

A worker writes its own pieces (`pieces_written` picks one holder per piece: DP replicas do not
write the same bytes twice) from a snapshot, in a thread, while training goes on (`ShardWrite`);
it reads only the rows it needs from memory-mapped files whose size and sha256 it checks first
(`ShardReader`). No process holds more of the model than its own shards.

The checkpoint's folder is a directory every worker and the coordinator see (a shared file system
across nodes; the coordinator publishes what the workers wrote into it), or an object-store prefix
(runtime/storage.py): files are then written locally and uploaded, and downloaded, hashed on the
way, into a local spool before they are read.
"""
from __future__ import annotations

import hashlib
import os
import stat
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch

from malleus_svc.config.locations import Uri, location
from malleus_svc.config.presets import ModelShape
from malleus_svc.geometry import EMBEDDING, HEAD, Part, model_parts, part_tensors, tensor_spec
from malleus_svc.plan import Plan

from .engine import EXP_AVG, EXP_AVG_SQ, ShardState
from .storage import Bucket

MOMENTS = ("", EXP_AVG, EXP_AVG_SQ)       # the keys of a tensor's piece: parameter, Adam moments
SUFFIX = ".safetensors"
_CHUNK = 8 << 20                           # hashing reads this much at a time: memory stays bounded


class ShardFileError(ValueError):
    """A shard file cannot be written, or is not what the manifest says; the message names the file."""


def write_durably(path: Path, data: bytes) -> None:
    """Create `path` (it must not exist) with `data`, flushed and fsynced to disk."""
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def part_stem(part: Part) -> str:
    if part == EMBEDDING:
        return "embedding"
    if part == HEAD:
        return "head"
    return f"block-{int(part):04d}"


def file_name(part: Part, device: int | None = None) -> str:
    """`block-0002.safetensors` (a whole-tensor writer) or `block-0002.d0003.safetensors` (device 3's pieces)."""
    return part_stem(part) + ("" if device is None else f".d{int(device):04d}") + SUFFIX


def pieces_written(plan: Plan, device: int, shape: ModelShape) -> dict[Part, list[str]]:
    """The tensors of each part that `device` writes into a checkpoint under `plan`.

    One stage holding the part writes it: the part's holder in pipeline k mod (number of
    holders), k the part's place in the model, which spreads the writing over the pipelines. In
    that stage TP rank r writes its rows of every split tensor and rank 0 the replicated ones, so
    the pieces of each tensor cover it exactly once.
    """
    out: dict[Part, list[str]] = {}
    for k, part in enumerate(model_parts(shape.layers)):
        holders = plan.holders(part)
        stage = holders[k % len(holders)][1]
        if device not in stage.devices:
            continue
        rank = stage.devices.index(device)
        names = [t.name for t in part_tensors(shape, part) if t.split_dim is not None or rank == 0]
        if names:
            out[part] = names
    return out


def snapshot(st: ShardState) -> ShardState:
    """A CPU copy of a piece that training cannot change under a writer (one copy, also from a GPU)."""
    def take(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to("cpu", copy=True).contiguous()

    return ShardState(st.dim, st.start, st.end, take(st.param), take(st.exp_avg), take(st.exp_avg_sq),
                      int(st.step), tuple(st.full_shape))


def write_part(folder: str | Path, part: Part, device: int | None,
               states: Mapping[str, ShardState]) -> tuple[str, dict]:
    """One safetensors file of these pieces (CPU, contiguous), durably (into an object store: written
    locally, then uploaded); (file name, manifest entry)."""
    from safetensors.torch import save_file

    where = location(folder)
    if isinstance(where, Uri):
        with tempfile.TemporaryDirectory(prefix="malleus-upload-") as spool:
            name, entry = write_part(spool, part, device, states)
            bucket = Bucket(where)
            if bucket.size(name) is not None:
                raise ShardFileError(f"{name} already exists in {where}")
            bucket.upload(Path(spool) / name, name)
        return name, entry
    name = file_name(part, device)
    path = where / name
    if path.exists():
        raise ShardFileError(f"{name} already exists in {folder}")
    tensors = {n + key: t for n, st in states.items() for key, t in zip(MOMENTS, (st.param, st.exp_avg, st.exp_avg_sq))}
    save_file(tensors, str(path), metadata={"format": "malleus-shard"})   # straight from the tensors' memory
    sha, size = _digest(path, sync=True)
    return name, {"part": part, "sha256": sha, "bytes": size,
                  "tensors": {n: {"rows": [st.start, st.end], "step": int(st.step)} for n, st in states.items()}}


class ShardWrite:
    """This device's pieces of one checkpoint: snapshotted when made, written by a thread of their
    own; `result()` waits and gives the files' manifest entries (or raises what went wrong)."""

    def __init__(self, folder: str | Path, device: int | None, parts: dict[Part, dict[str, ShardState]]):
        self.folder, self.device = location(folder), device
        self._parts = parts
        self._entries: dict[str, dict] = {}
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"shard-write-{device}")
        self._thread.start()

    def _run(self) -> None:
        try:
            while self._parts:
                part, states = self._parts.popitem()   # each snapshot freed once written
                name, entry = write_part(self.folder, part, self.device, states)
                self._entries[name] = entry
        except BaseException as e:  # raised by result()
            self._error = e

    def result(self) -> dict[str, dict]:
        self._thread.join()
        if self._error is not None:
            e = self._error
            raise ShardFileError(f"device {self.device}: writing its shard files into {self.folder} failed: "
                                 f"{type(e).__name__}: {e}") from e
        return self._entries


# ---------------------------------------------------------------------------- reading
def verify_file(folder: Path, name: str, sha256: str, size: int) -> None:
    """Before a byte of it is used: a regular file of `folder` (a symlink could point anywhere, a
    FIFO blocks a read forever) of the size the manifest says (a sparse or swapped file is refused
    unread), whose sha256 matches; read in chunks, so memory stays bounded."""
    path = Path(folder) / name
    try:
        st = path.lstat()
    except FileNotFoundError:
        raise ShardFileError(f"{name} is missing") from None
    except OSError as e:
        raise ShardFileError(f"{name} cannot be read: {e}") from None
    if not stat.S_ISREG(st.st_mode):
        kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a regular file"
        raise ShardFileError(f"{name} is {kind}; a checkpoint holds only the regular files it wrote")
    _check_size(name, st.st_size, size)
    try:
        actual, read = _digest(path, limit=size + 1)
    except OSError as e:
        raise ShardFileError(f"{name} cannot be read: {e}") from None
    _check_read(name, sha256, size, actual, read)


def fetch_object(folder: Uri, name: str, sha256: str, size: int, spool: Path) -> Path:
    """An object-store file as a local copy in `spool`, of the size the manifest says (checked before
    the download, which reads at most one byte more) and whose sha256 matches."""
    bucket = Bucket(folder)
    try:
        got = bucket.size(name)
        if got is None:
            raise ShardFileError(f"{name} is missing")
        _check_size(name, got, size)
        actual, read = bucket.download(name, spool / name, size)
    except OSError as e:
        raise ShardFileError(f"{name} cannot be read: {e}") from None
    _check_read(name, sha256, size, actual, read)
    return spool / name


def _check_size(name: str, got: int, size: int) -> None:
    if got != size:
        raise ShardFileError(f"{name} has {got} bytes, the manifest says {size} (truncated or overwritten)")


def _check_read(name: str, sha256: str, size: int, actual: str, read: int) -> None:
    if read != size:
        raise ShardFileError(f"{name} has {read} bytes, the manifest says {size} (changed while read)")
    if actual != sha256:
        raise ShardFileError(f"{name} sha256 mismatch: expected {sha256}, actual {actual} (the file is damaged)")


def _digest(path: Path, sync: bool = False, limit: int | None = None) -> tuple[str, int]:
    h, n = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while limit is None or n < limit:
            chunk = f.read(_CHUNK if limit is None else min(_CHUNK, limit - n))
            if not chunk:
                break
            h.update(chunk)
            n += len(chunk)
        if sync:
            os.fsync(f.fileno())
    return h.hexdigest(), n


def piece_shape(shape: ModelShape, name: str, start: int, end: int) -> tuple[int, ...]:
    spec = tensor_spec(shape, name)
    return tuple(end - start if k == spec.axis else n for k, n in enumerate(spec.shape))


def check_header(folder: Path, name: str, expected: Mapping[str, tuple[int, ...]]) -> None:
    """The file is safetensors holding exactly the keys `expected`, float32, of those shapes
    (its header only: no tensor data is read)."""
    from safetensors import safe_open

    try:
        with safe_open(str(Path(folder) / name), framework="pt") as f:
            keys = set(f.keys())
            if keys != set(expected):
                raise ShardFileError(f"{name} holds {sorted(keys)[:6]}, the manifest says {sorted(expected)[:6]}")
            for key, want in expected.items():
                sl = f.get_slice(key)
                got, dtype = tuple(sl.get_shape()), sl.get_dtype()
                if dtype != "F32" or got != tuple(want):
                    raise ShardFileError(f"{name}: {key} is {dtype} of shape {got}, expected a float32 tensor of shape {tuple(want)}")
    except ShardFileError:
        raise
    except Exception as e:  # noqa: BLE001 - any refusal of the header is a bad file
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ShardFileError(f"{name} is not a readable safetensors file: {type(e).__name__}: {first}") from None


@dataclass(frozen=True)
class Piece:
    """Rows [start, end) of a tensor, held by one file."""

    file: str
    start: int
    end: int


class ShardReader:
    """Rows of full tensors out of a checkpoint's shard files: only the rows asked for are read, from
    memory-mapped files each verified (size, sha256) the first time it is opened (from an object
    store: downloaded into a spool of this reader's, which `close` removes).

    `table` is what `checkpoint.Checkpoint.table()` gives, plain data that travels to a worker:
    {"files": {file: [sha256, bytes]}, "pieces": {tensor: [[file, start, end], ...]}, "steps": {tensor: step}}.
    """

    def __init__(self, folder: str | Path, shape: ModelShape, table: Mapping, verified: Iterable[str] = ()):
        self.folder, self.shape = location(folder), shape
        self.files = {f: (str(sha), int(n)) for f, (sha, n) in table["files"].items()}
        self.pieces = {t: [Piece(str(f), int(a), int(b)) for f, a, b in ps] for t, ps in table["pieces"].items()}
        self.steps = {t: int(s) for t, s in table["steps"].items()}
        self.verified = set(verified)      # local files known good (a download is verified anyway)
        self._local: dict[str, Path] = {}  # file -> its verified local copy
        self._spool: tempfile.TemporaryDirectory | None = None

    def verify(self, wanted: Mapping[str, tuple[int, int]]) -> None:
        """Verify every file that holds some of the wanted rows, before any is read."""
        for name, (start, end) in wanted.items():
            for p in self._overlapping(name, start, end):
                self._path(p.file)

    def _path(self, file: str) -> Path:
        if file not in self._local:
            if isinstance(self.folder, Uri):
                if self._spool is None:
                    self._spool = tempfile.TemporaryDirectory(prefix="malleus-download-")
                self._local[file] = fetch_object(self.folder, file, *self.files[file], Path(self._spool.name))
            else:
                if file not in self.verified:
                    verify_file(self.folder, file, *self.files[file])
                self._local[file] = self.folder / file
        return self._local[file]

    def close(self) -> None:
        """Remove the downloaded copies."""
        if self._spool is not None:
            self._spool.cleanup()
        self._spool, self._local = None, {}

    def __enter__(self) -> "ShardReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _overlapping(self, name: str, start: int, end: int) -> list[Piece]:
        if name not in self.pieces:
            raise ShardFileError(f"the checkpoint holds no {name}")
        got = [p for p in self.pieces[name] if p.start < end and start < p.end]
        covered = sum(min(end, p.end) - max(start, p.start) for p in got)
        if covered != end - start:
            raise ShardFileError(f"the checkpoint's pieces of {name} do not cover rows [{start}, {end})")
        return sorted(got, key=lambda p: p.start)

    def state(self, name: str, start: int, end: int) -> ShardState:
        """Rows [start, end) of tensor `name` with its Adam moments and step."""
        from safetensors import safe_open

        spec = tensor_spec(self.shape, name)
        self.verify({name: (start, end)})
        parts: dict[str, list[torch.Tensor]] = {key: [] for key in MOMENTS}
        for p in self._overlapping(name, start, end):
            index = [slice(None)] * len(spec.shape)
            index[spec.axis] = slice(max(start, p.start) - p.start, min(end, p.end) - p.start)
            with safe_open(str(self._path(p.file)), framework="pt") as f:
                for key in MOMENTS:
                    parts[key].append(f.get_slice(name + key)[tuple(index)])
        out = {key: ts[0] if len(ts) == 1 else torch.cat(ts, dim=spec.axis) for key, ts in parts.items()}
        return ShardState(spec.split_dim, start, end, out[""], out[EXP_AVG], out[EXP_AVG_SQ],
                          self.steps[name], spec.shape)

    def states(self, wanted: Mapping[str, tuple[int, int]]) -> Mapping[str, ShardState]:
        """The wanted rows of each tensor, read one tensor at a time as they are used."""
        self.verify(wanted)
        return _Lazy(self, dict(wanted))


class _Lazy(Mapping):
    def __init__(self, reader: ShardReader, wanted: dict[str, tuple[int, int]]):
        self.reader, self.wanted = reader, wanted

    def __getitem__(self, name: str) -> ShardState:
        return self.reader.state(name, *self.wanted[name])

    def __iter__(self):
        return iter(self.wanted)

    def __len__(self) -> int:
        return len(self.wanted)
