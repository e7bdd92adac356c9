"""Benchmarks behind `malleus bench ...`: each prints a table and can write BENCHMARKS.md and plots."""


def run_bench(what: str, argv: list[str]) -> int:
    if what == "planner":
        from .planner import main
    else:  # argparse restricts `what`; this guards direct callers
        raise ValueError(f"unknown benchmark {what!r}; known: planner")
    return main(argv)
