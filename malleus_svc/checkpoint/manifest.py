"""manifest.json: what a checkpoint is (step, data position, model, optimizer, provenance) and the
checksum and size of every file in it. Written last: a directory without one is not a checkpoint.

The manifest carries its own sha256 (over its canonical JSON without that field), so a damaged
manifest that is still valid JSON (a flipped digit of a step or of a checksum) is caught too.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from malleus_svc.config.errors import ConfigError, shorten
from malleus_svc.config.files import parse_document
from malleus_svc.config.presets import ModelShape
from malleus_svc.plan import Plan

from .errors import CheckpointError

FORMAT = "malleus-checkpoint"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class CheckpointMeta:
    """What a writer needs besides the tensors. `data` is the sampler's `state_dict()` (the data
    position is a plain number in it); `plan` and `optim` are recorded for information only: a
    checkpoint loads under any plan."""

    step: int
    shape: ModelShape
    data: Mapping[str, Any]
    plan: Plan | Mapping[str, Any] | None = None
    optim: Any = None                       # OptimConfig or a dict of it
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class FileEntry:
    sha256: str
    bytes: int
    part: int | str
    tensors: Mapping[str, Any]              # name -> shape, dtype, Adam step (informative)


@dataclass(frozen=True)
class Manifest:
    step: int
    model_shape: Mapping[str, Any]
    data: Mapping[str, Any]                 # {"sampler": state_dict, "epoch": e, "offset": o}
    files: Mapping[str, FileEntry]
    created_unix: float
    plan: Mapping[str, Any] | None = None
    optim: Mapping[str, Any] | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    @property
    def shape(self) -> ModelShape:
        return ModelShape(**self.model_shape)

    @property
    def sampler_state(self) -> Mapping[str, Any]:
        return self.data["sampler"]

    def plan_obj(self) -> Plan | None:
        return None if self.plan is None else Plan.from_dict(self.plan)

    @property
    def total_bytes(self) -> int:
        return sum(f.bytes for f in self.files.values())

    # ------------------------------------------------------------------ JSON
    def _body(self) -> dict[str, Any]:
        return {
            "format": FORMAT, "format_version": self.format_version, "step": self.step,
            "created_unix": self.created_unix,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.created_unix)),
            "model_shape": dict(self.model_shape), "data": _finite(dict(self.data)), "plan": _finite(self.plan),
            "optim": _finite(self.optim), "extra": _finite(dict(self.extra)),
            "files": {n: dataclasses.asdict(f) for n, f in sorted(self.files.items())},
        }

    def to_json(self) -> str:
        body = self._body()
        return json.dumps({**body, "manifest_sha256": _digest(body)}, indent=1, allow_nan=False) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, where: Path | None = None) -> "Manifest":
        def bad(why: str) -> CheckpointError:
            return CheckpointError(f"manifest.json: {why}", where)

        try:
            d = parse_document(text, "json", "manifest.json")
        except ConfigError as e:
            raise CheckpointError(str(e), where) from None
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise bad(f"not a {FORMAT} manifest")
        if d.get("format_version") != FORMAT_VERSION:
            raise bad(f"format_version {shorten(d.get('format_version'))} is not supported (this build reads {FORMAT_VERSION})")
        stored = d.pop("manifest_sha256", None)
        actual = _digest(d)
        if stored != actual:
            raise bad(f"manifest checksum mismatch: expected {stored}, actual {actual} (the manifest is damaged)")
        try:
            files = {n: FileEntry(sha256=str(f["sha256"]), bytes=int(f["bytes"]), part=f["part"],
                                  tensors=dict(f.get("tensors", {}))) for n, f in d["files"].items()}
            m = cls(step=int(d["step"]), model_shape=dict(d["model_shape"]), data=dict(d["data"]), files=files,
                    created_unix=float(d["created_unix"]), plan=d.get("plan"), optim=d.get("optim"),
                    extra=dict(d.get("extra") or {}), format_version=int(d["format_version"]))
            m.shape  # noqa: B018 - the model shape must be a valid ModelShape
            m.sampler_state  # noqa: B018
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            raise bad(f"missing or malformed field: {shorten(e)}") from None
        return m


def _finite(value: Any) -> Any:
    """`value` with every non-finite float replaced by None: the manifest is standard JSON, which
    readers (ours included) require, and a diverged loss in `extra` must not make it unreadable."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _digest(body: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def data_position(sampler_state: Mapping[str, Any]) -> dict[str, Any]:
    """The manifest's `data`: the sampler state itself plus epoch/offset, for people reading it."""
    out: dict[str, Any] = {"sampler": dict(sampler_state)}
    pos, n = sampler_state.get("position"), sampler_state.get("num_samples")
    if isinstance(pos, int) and isinstance(n, int) and n > 0:
        out["epoch"], out["offset"] = divmod(pos, n)
    return out


def build_manifest(meta: CheckpointMeta, files: Mapping[str, FileEntry], created_unix: float | None = None) -> Manifest:
    plan = meta.plan.to_dict() if isinstance(meta.plan, Plan) else (None if meta.plan is None else dict(meta.plan))
    optim = meta.optim
    if dataclasses.is_dataclass(optim):
        optim = dataclasses.asdict(optim)
    return Manifest(step=int(meta.step), model_shape=meta.shape.to_dict(), data=data_position(meta.data),
                    files=dict(files), created_unix=time.time() if created_unix is None else created_unix,
                    plan=plan, optim=None if optim is None else dict(optim), extra=dict(meta.extra))
