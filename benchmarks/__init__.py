"""Benchmarks behind `malleus bench ...` (or `python -m benchmarks ...`) in a source checkout: each
prints a table and can write BENCHMARKS.md and plots. Not part of the installed package."""
from __future__ import annotations

import argparse
import importlib
import textwrap

BENCHES = ("planner", "planner-scale", "planner-reference", "objectives", "runtime", "simulate", "malleable",
           "rates", "calibrate", "lengths", "lengths-runtime", "prepare-data", "init", "host-memory", "step", "detect", "overlap")


class _WholeNames(argparse.HelpFormatter):
    """Wraps help between words only, so that a name such as prepare-data is never split at its hyphen."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


def main(argv: list[str] | None = None, prog: str = "malleus bench") -> int:
    ap = argparse.ArgumentParser(prog=prog, formatter_class=_WholeNames, description="Benchmarks that print tables and write BENCHMARKS.md "
                                 f"rows; `{prog} NAME --help` for each one's options.")
    ap.add_argument("what", choices=BENCHES, metavar="NAME", help="one of: " + ", ".join(BENCHES))
    ap.add_argument("rest", nargs=argparse.REMAINDER, help="the benchmark's own arguments")
    args = ap.parse_args(argv)
    return importlib.import_module(f"{__name__}.{args.what.replace('-', '_')}").main(args.rest)
