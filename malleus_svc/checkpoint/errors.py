"""Checkpoint errors: every message names the checkpoint (and file) and says what is wrong."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from malleus_svc.config.errors import ConfigError
from malleus_svc.config.locations import location


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, found, verified or loaded.

    `path` is the checkpoint directory or file concerned (None when there is none), `reason` the
    message without the path (what `load_latest` reports for a skipped checkpoint).
    """

    def __init__(self, reason: str, path: str | Path | None = None):
        self.path = _where(path)
        self.reason = reason
        super().__init__(f"checkpoint {self.path}: {reason}" if self.path is not None else reason)


class CheckpointMismatchError(CheckpointError, ConfigError):
    """A sound checkpoint that does not fit the job (e.g. another model shape).

    Also a ConfigError (field, value, accepted): it is the job's configuration, not the file, that
    is wrong, so `load_latest` raises it instead of falling back to an older checkpoint (those
    were written by the same job and would not fit either).
    """

    def __init__(self, field: str, value: Any, accepted: str, path: str | Path | None = None):
        ConfigError.__init__(self, field, value, accepted, source=None if path is None else f"checkpoint {path}")
        self.path = _where(path)
        self.reason = f"{field} = {value!r} is not valid: {accepted}"


def _where(path: str | Path | None) -> Path | str | None:
    try:
        return None if path is None else location(path)
    except ValueError:       # not a location we write to: named as given
        return str(path)
