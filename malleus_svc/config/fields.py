"""Small readers that pull one typed, checked value out of a mapping (or raise ConfigError)."""
from __future__ import annotations

import math
from typing import Any, Iterable, Mapping

from .errors import ConfigError
from .limits import MAX_NUMBER

_MISSING = object()


class Section:
    """A mapping read field by field; unknown keys are reported once reading is done."""

    def __init__(self, data: Any, path: str, source: str | None = None):
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise ConfigError(path, data, "expected a mapping (key: value pairs)", source)
        self.data, self.path, self.source = data, path, source
        self._read: set[str] = set()

    def _field(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def error(self, key: str, value: Any, accepted: str) -> ConfigError:
        return ConfigError(self._field(key), value, accepted, self.source)

    def raw(self, key: str, default: Any = _MISSING) -> Any:
        self._read.add(key)
        if key in self.data:
            return self.data[key]
        if default is _MISSING:
            raise ConfigError(self._field(key), None, "this field is required", self.source)
        return default

    def has(self, key: str) -> bool:
        return key in self.data

    def section(self, key: str, required: bool = False) -> "Section":
        return Section(self.raw(key, _MISSING if required else None), self._field(key), self.source)

    def int(self, key: str, default: Any = _MISSING, minimum: int | None = None,
            maximum: float = MAX_NUMBER) -> int:
        """`maximum`: one of config.limits; every number has one (hostile sizes must not reach the planner)."""
        v = self.raw(key, default)
        if isinstance(v, bool) or not isinstance(v, int):
            if isinstance(v, float) and v.is_integer():
                v = int(v)
            else:
                raise self.error(key, v, "expected an integer")
        if minimum is not None and v < minimum:
            raise self.error(key, v, f"expected an integer >= {minimum}")
        if v > maximum:
            raise self.error(key, v, f"expected an integer <= {maximum:.16g} (config.limits)")
        return v

    def float(self, key: str, default: Any = _MISSING, minimum: float | None = None,
              exclusive: bool = False, maximum: float = MAX_NUMBER) -> float:
        v = self.raw(key, default)
        return check_float(v, self._field(key), minimum, exclusive, self.source, maximum)

    def bool(self, key: str, default: Any = _MISSING) -> bool:
        v = self.raw(key, default)
        if not isinstance(v, bool):
            raise self.error(key, v, "expected true or false")
        return v

    def choice(self, key: str, choices: Iterable[str], default: Any = _MISSING) -> str:
        v = self.raw(key, default)
        choices = tuple(choices)
        if v not in choices:
            raise self.error(key, v, f"expected one of {', '.join(choices)}")
        return v

    def float_list(self, key: str, default: Any = _MISSING, minimum: float | None = None,
                   exclusive: bool = False, maximum: float = MAX_NUMBER) -> tuple[float, ...] | None:
        v = self.raw(key, default)
        if v is None:
            return None
        if not isinstance(v, (list, tuple)) or not v:
            raise self.error(key, v, "expected a non-empty list of numbers")
        return tuple(check_float(x, f"{self._field(key)}[{i}]", minimum, exclusive, self.source, maximum)
                     for i, x in enumerate(v))

    def done(self) -> None:
        unknown = sorted(((key_name(k), k) for k in self.data if str(k) not in self._read), key=lambda t: t[0])   # any type
        if unknown:
            known = ", ".join(sorted(self._read))
            name, key = unknown[0]
            raise ConfigError(self._field(name), self.data[key], f"unknown field; known fields here: {known}",
                              self.source)


def key_name(k: Any) -> str:
    """A key (of any type) as a field name: as written, or quoted when blank (an empty name names nothing)."""
    text = str(k)
    return text if text.strip() else repr(text)


def check_float(v: Any, field: str, minimum: float | None = None, exclusive: bool = False,
                source: str | None = None, maximum: float = MAX_NUMBER) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(field, v, "expected a number", source)
    try:
        v = float(v)
    except OverflowError:      # an int no float holds (from Python callers; files refuse it earlier)
        raise ConfigError(field, v, f"expected a number <= {maximum:.16g} (config.limits)", source) from None
    if not math.isfinite(v):
        raise ConfigError(field, v, "expected a finite number", source)
    if minimum is not None and (v <= minimum if exclusive else v < minimum):
        raise ConfigError(field, v, f"expected a number {'>' if exclusive else '>='} {minimum}", source)
    if v > maximum:
        raise ConfigError(field, v, f"expected a number <= {maximum:.16g} (config.limits)", source)
    return v
