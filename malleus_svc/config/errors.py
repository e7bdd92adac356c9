"""One error type for every user-facing input, with the field, the value and what is accepted."""
from __future__ import annotations

import reprlib
from typing import Any

MAX_SHOWN = 80   # characters of a value's repr in a message: a hostile value must not flood a terminal


_REPR = reprlib.Repr()     # bounded work too: a few items per level, a few levels, however large the value
_REPR.maxstring = _REPR.maxother = MAX_SHOWN
_REPR.maxlong = 40


def shorten(value: Any) -> str:
    """repr(value), cut to MAX_SHOWN characters ('...' marks a cut)."""
    try:
        text = _REPR.repr(value)
    except (ValueError, RecursionError):   # an int beyond the str-conversion limit, a deep structure
        text = f"<{type(value).__name__}>"
    return text if len(text) <= MAX_SHOWN else text[:MAX_SHOWN - 3] + "..."


def _name(text: str) -> str:
    """A field or file name as given, unless it is long or spans lines (a hostile key): then shortened."""
    return text if len(text) <= MAX_SHOWN and text.isprintable() else shorten(text)


class ConfigError(ValueError):
    def __init__(self, field: str, value: Any, accepted: str, source: str | None = None):
        self.field, self.value, self.accepted, self.source = field, value, accepted, source
        where = f"{_name(str(source))}: " if source else ""
        super().__init__(f"{where}{_name(str(field))} = {shorten(value)} is not valid: {accepted}")
