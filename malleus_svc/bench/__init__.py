"""Benchmarks behind `malleus bench ...`: each prints a table and can write BENCHMARKS.md and plots."""
import importlib

BENCHES = ("planner", "runtime", "simulate", "malleable", "calibrate", "lengths", "lengths-runtime")


def run_bench(what: str, argv: list[str]) -> int:
    if what not in BENCHES:
        raise ValueError(f"unknown benchmark {what!r}; known: {', '.join(BENCHES)}")
    return importlib.import_module(f"{__name__}.{what.replace('-', '_')}").main(argv)
