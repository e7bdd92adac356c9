"""manifest.json: what a checkpoint is (step, data position, model, optimizer, provenance) and the
checksum, size, part and pieces (rows of full tensors, see layout.py) of every file in it. Written
last, by the coordinator, from what the writers of the files reported: a directory without one is
not a checkpoint.

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
from malleus_svc.config.fields import Section
from malleus_svc.config.files import parse_document
from malleus_svc.config.limits import MAX_LAYERS, MAX_MODEL_DIM
from malleus_svc.config.presets import SIZE_FIELDS, ModelShape, RopeScaling
from malleus_svc.config.scenario import parse_shape_variant
from malleus_svc.plan import Plan

from .errors import CheckpointError

FORMAT = "malleus-checkpoint"
FORMAT_VERSION = 2      # 1: one torch.save file of whole tensors per part, no longer read


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
    tensors: Mapping[str, Any]              # name -> {"rows": [start, end) of the full tensor, "step": Adam step}


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
        return ModelShape.from_dict(self.model_shape)

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
        if d.get("format_version") == 1:
            raise bad("format_version 1 (whole tensors in .pt files, written by an older build) is not read by this "
                      f"build, which reads {FORMAT_VERSION}: resume it with the build that wrote it, or start afresh")
        if d.get("format_version") != FORMAT_VERSION:
            raise bad(f"format_version {shorten(d.get('format_version'))} is not supported (this build reads {FORMAT_VERSION})")
        stored = d.pop("manifest_sha256", None)
        actual = _digest(d)
        if stored != actual:
            raise bad(f"manifest checksum mismatch: expected {stored}, actual {actual} (the manifest is damaged)")
        try:
            m = _parse(d)
        except ConfigError as e:          # a field of the wrong type or out of range: skip, saying which
            raise bad(str(e)) from None
        return m


def _parse(d: Mapping[str, Any]) -> Manifest:
    """The manifest's fields, each checked for the type and range a writer gives it (mappings where
    mappings are, whole numbers where counts are); ConfigError names the first one that is not."""
    root = Section(d, "")
    mappings = {k: _mapping(root, k) for k in ("model_shape", "data", "files")}
    optional = {k: _mapping(root, k, optional=True) for k in ("plan", "optim", "extra")}
    sh = Section(mappings["model_shape"], "model_shape")
    shape = {f: None if f == "kv_heads" and sh.raw(f, None) is None     # None: as many as heads
             else sh.int(f, minimum=1, maximum=MAX_LAYERS if f == "layers" else MAX_MODEL_DIM) for f in SIZE_FIELDS}
    shape.update({k: dataclasses.asdict(v) if isinstance(v, RopeScaling) else v
                  for k, v in parse_shape_variant(sh).items()})
    sh.done()
    _mapping(Section(mappings["data"], "data"), "sampler")
    files = {}
    for name, f in mappings["files"].items():
        e = Section(f, f"files.{name}")
        sha, part = e.raw("sha256"), e.raw("part")
        if not isinstance(sha, str):
            raise e.error("sha256", sha, "a hex digest (text)")
        if isinstance(part, bool) or not isinstance(part, (int, str)):
            raise e.error("part", part, "a block index or a part name")
        files[name] = FileEntry(sha256=sha, bytes=e.int("bytes", minimum=0), part=part,
                                tensors=dict(_mapping(e, "tensors", optional=True) or {}))
    return Manifest(step=root.int("step", minimum=0), model_shape=shape, data=dict(mappings["data"]), files=files,
                    created_unix=root.float("created_unix", minimum=0), plan=optional["plan"],
                    optim=optional["optim"], extra=dict(optional["extra"] or {}),
                    format_version=root.int("format_version"))


def _mapping(s: Section, key: str, optional: bool = False) -> Mapping[str, Any] | None:
    v = s.raw(key, None) if optional else s.raw(key)
    if not (isinstance(v, Mapping) or (optional and v is None)):
        raise s.error(key, v, "a mapping" + (" or null" if optional else ""))
    return v


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
