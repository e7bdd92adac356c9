"""Numbers and output files on command lines: checked when the arguments are parsed, or refused in
one line (exit 2).

argparse's own `type=float` takes nan and inf, and a bad value prints the whole usage; a number
option added here says what it accepts instead, in one line. An output file is checked before the
command does any work, so a mistyped folder does not cost a training run.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from .errors import shorten


def number_option(parser: argparse.ArgumentParser, flag: str, low: float, high: float, *, integer: bool = False,
                  **kwargs: Any) -> argparse.Action:
    """`parser.add_argument(flag, **kwargs)` for a number in [low, high] (an int if `integer`).
    Anything else (text, nan, inf, out of range, 5,000 digits) ends the program with
    "PROG: error: FLAG must be ... in [LOW, HIGH], got VALUE" and exit code 2."""
    kind = "an integer" if integer else "a finite number"

    def parse(text: str) -> float | int:
        try:
            value = int(text) if integer else float(text)
        except ValueError:
            value = None
        if value is None or not low <= value <= high:      # nan compares false: refused too
            parser.exit(2, f"{parser.prog}: error: {flag} must be {kind} in [{_show(low)}, {_show(high)}], "
                           f"got {shorten(text)}\n")
        return value

    parse.__name__ = "integer" if integer else "number"
    return parser.add_argument(flag, type=parse, **kwargs)


def output_file_option(parser: argparse.ArgumentParser, *flags: str, **kwargs: Any) -> argparse.Action:
    """`parser.add_argument(*flags, **kwargs)` for a file the command writes: its folder must exist,
    it must not be a folder, and it must be writable; anything else ends the program with
    "PROG: error: FLAG PATH: why" and exit code 2. Nothing is created."""
    def parse(text: str) -> str:
        path = Path(text)
        why = ("is a folder" if path.is_dir() else
               "its folder does not exist" if not path.parent.is_dir() else
               "cannot be written" if not os.access(path if path.exists() else path.parent, os.W_OK) else None)
        if why:
            parser.exit(2, f"{parser.prog}: error: {flags[-1]} {shorten(text)}: {why}\n")
        return text

    return parser.add_argument(*flags, type=parse, **kwargs)


def _show(x: float) -> str:
    """A bound as people write it: 1000000 rather than 1e+06, 0.01 as it is."""
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e16 else f"{x:g}"
