"""The one reader of YAML and JSON input files: scenario, job, plan and checkpoint manifest.

A hostile file gets one ConfigError line, in bounded time and memory: the size is capped
(limits.MAX_FILE_BYTES), bytes must be UTF-8, YAML anchors and aliases are refused (an alias
bomb of a kilobyte expands to gigabytes when walked), so are duplicate keys (which one would
count?), nesting deeper than limits.MAX_DEPTH, more values than limits.MAX_VALUES (JSON) or
MAX_YAML_VALUES (counted before anything is built: a small value costs ~100 bytes once parsed),
integers too large for a float, and NaN/Infinity.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import yaml

from .errors import ConfigError
from .limits import MAX_DEPTH, MAX_FILE_BYTES, MAX_INT_DIGITS, MAX_VALUES, MAX_YAML_BYTES, MAX_YAML_VALUES

_BaseLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)   # libyaml when built with it: faster
_NESTING = f"lists and mappings nested at most {MAX_DEPTH} deep (limits.MAX_DEPTH)"
_VALUES = {"json": f"at most {MAX_VALUES} values in a JSON file (limits.MAX_VALUES)",
           "yaml": f"at most {MAX_YAML_VALUES} values in a YAML file (limits.MAX_YAML_VALUES)"}
_NUMBERS = (f"finite numbers a float holds (|x| < 1.8e308), integers of at most {MAX_INT_DIGITS} digits "
            "(limits.MAX_INT_DIGITS)")


class _Refused(Exception):
    """Raised inside a parser hook; becomes a ConfigError naming the file."""

    def __init__(self, field: str, value: Any, accepted: str):
        super().__init__(field)
        self.field, self.value, self.accepted = field, value, accepted


def read_document(path: str | Path, fmt: str | None = None) -> Any:
    """Parse a YAML or JSON file (`fmt`, else by suffix: .json is JSON, anything else YAML)."""
    p = Path(path)
    fmt = fmt or ("json" if p.suffix.lower() == ".json" else "yaml")
    return parse_document(read_bytes(p), fmt, str(p))


def read_mapping(path: str | Path) -> dict:
    """A YAML or JSON file whose top level is a mapping with string keys (field names)."""
    data = read_document(path)
    if not isinstance(data, dict):
        raise ConfigError("file", str(path), "expected a mapping at the top level")
    for key in data:
        if not isinstance(key, str):
            raise ConfigError("key", key, "top-level keys are field names (strings)", str(path))
    return data


def read_bytes(p: Path) -> bytes:
    """A file's bytes, at most MAX_FILE_BYTES of them (ConfigError otherwise)."""
    if not p.is_file():      # also refuses FIFOs and devices, whose reads might never end
        raise ConfigError("file", str(p), "not a regular file" if p.exists() else "no such file")
    try:
        with p.open("rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise ConfigError("file", str(p), f"cannot be read ({e.strerror})") from None
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError("file", str(p), f"at most {MAX_FILE_BYTES} bytes (limits.MAX_FILE_BYTES)")
    return data


def parse_document(data: bytes | str, fmt: str, source: str) -> Any:
    """Parse YAML or JSON text (`fmt`: "yaml" or "json"); any problem is one ConfigError."""
    cap = MAX_FILE_BYTES if fmt == "json" else MAX_YAML_BYTES
    if len(data) > cap:
        raise ConfigError("file", source, f"a {fmt.upper()} file of at most {cap} bytes "
                          f"(limits.MAX_{'FILE' if fmt == 'json' else 'YAML'}_BYTES)")
    text = _decode(data, source)
    kind = fmt.upper()
    try:
        doc = _parse_json(text) if fmt == "json" else _parse_yaml(text)
        _check_depth(doc)
        return doc
    except _Refused as e:
        raise ConfigError(e.field, e.value, e.accepted, source) from None
    except RecursionError:       # the JSON parser's own depth limit, reached before ours is checked
        raise ConfigError("nesting", f"over {sys.getrecursionlimit()}", _NESTING, source) from None
    except (yaml.YAMLError, ValueError, OverflowError) as e:   # JSONDecodeError is a ValueError
        raise ConfigError("file", source, f"not valid {kind}: {_one_line(e)}") from None


def _decode(data: bytes | str, source: str) -> str:
    if isinstance(data, str):
        return data
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ConfigError("file", source, f"expected UTF-8 text; byte {data[e.start]:#04x} at offset "
                          f"{e.start} is not") from None


def _one_line(e: Exception) -> str:
    """A parser's message, on one line and short: what is wrong and where."""
    problem, mark = getattr(e, "problem", None), getattr(e, "problem_mark", None)
    if problem and mark is not None:
        context = getattr(e, "context", None)
        text = f"{context + ' ' if context else ''}{problem} at line {mark.line + 1}, column {mark.column + 1}"
    else:
        text = " ".join(str(e).split())
    return text if len(text) <= 200 else text[:197] + "..."


# ---------------------------------------------------------------------- JSON
def _parse_json(text: str) -> Any:
    # Every value but the first follows a comma or opens a container: an upper bound, in C time.
    values = text.count(",") + text.count("[") + text.count("{") + 1
    if values > MAX_VALUES:
        raise _Refused("values", f"up to {values}", _VALUES["json"])
    return json.loads(text, object_pairs_hook=_json_object, parse_int=_json_int,
                      parse_float=_json_float, parse_constant=_json_constant)


def _json_object(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise _Refused("key", key, "appears twice in one object; give each key once")
        out[key] = value
    return out


def _json_int(literal: str) -> int:
    if len(literal.lstrip("-")) > MAX_INT_DIGITS:
        raise _Refused("number", literal, _NUMBERS)
    return _fits_float(int(literal), literal)


def _json_float(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise _Refused("number", literal, _NUMBERS)
    return value


def _json_constant(literal: str) -> Any:
    raise _Refused("number", literal, f"{_NUMBERS}; NaN and Infinity are not standard JSON")


def _fits_float(value: int, literal: str) -> int:
    try:
        float(value)
    except OverflowError:
        raise _Refused("number", literal, _NUMBERS) from None
    return value


# ---------------------------------------------------------------------- YAML
class _StrictLoader(_BaseLoader):
    """The safe loader, refusing duplicate or unhashable keys and numbers no float holds."""

    def construct_mapping(self, node: yaml.Node, deep: bool = False) -> dict:
        if not isinstance(node, yaml.MappingNode):
            raise yaml.constructor.ConstructorError(None, None, f"expected a mapping, found {node.id}",
                                                    node.start_mark)
        out: dict = {}
        for key_node, value_node in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                seen = key in out
            except TypeError:
                raise _Refused("key", key, "keys are names or numbers, not lists or mappings") from None
            if seen:
                raise _Refused("key", key, "appears twice in one mapping; give each key once")
            out[key] = self.construct_object(value_node, deep=deep)
        return out

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        literal = str(node.value)
        if sum(c.isalnum() for c in literal) > MAX_INT_DIGITS:
            raise _Refused("number", literal, _NUMBERS)
        return _fits_float(super().construct_yaml_int(node), literal)

    def construct_yaml_float(self, node: yaml.ScalarNode) -> float:
        value = super().construct_yaml_float(node)
        if not math.isfinite(value):
            raise _Refused("number", node.value, f"{_NUMBERS}; not .nan or .inf")
        return value


_StrictLoader.add_constructor("tag:yaml.org,2002:int", _StrictLoader.construct_yaml_int)
_StrictLoader.add_constructor("tag:yaml.org,2002:float", _StrictLoader.construct_yaml_float)


def _parse_yaml(text: str) -> Any:
    _check_events(text)       # before anything is built: aliases and depth cost nothing to refuse here
    loader = _StrictLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def _check_events(text: str) -> None:
    depth = 0
    values = 0
    for event in yaml.parse(text, Loader=_BaseLoader):
        if isinstance(event, (yaml.ScalarEvent, yaml.CollectionStartEvent)):   # a value (keys count too)
            values += 1
            if values > MAX_YAML_VALUES:
                raise _Refused("values", f"over {MAX_YAML_VALUES}", _VALUES["yaml"])
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
            name = ("*" if isinstance(event, yaml.AliasEvent) else "&") + str(event.anchor)
            raise _Refused("anchor", name, "YAML anchors and aliases (&name, *name) are not accepted: "
                           "write the value out")
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_DEPTH:
                raise _Refused("nesting", depth, _NESTING)
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1


# ---------------------------------------------------------------------- both
def _check_depth(doc: Any) -> None:
    """Nesting at most MAX_DEPTH; iterative, so a deep document cannot overflow the stack here."""
    stack = [(doc, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        if depth > MAX_DEPTH:
            raise _Refused("nesting", depth, _NESTING)
        stack.extend((child, depth + 1) for child in children)
