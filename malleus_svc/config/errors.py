"""One error type for every user-facing input, with the field, the value and what is accepted."""
from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    def __init__(self, field: str, value: Any, accepted: str, source: str | None = None):
        self.field, self.value, self.accepted, self.source = field, value, accepted, source
        where = f"{source}: " if source else ""
        super().__init__(f"{where}{field} = {value!r} is not valid: {accepted}")
