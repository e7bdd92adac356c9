"""`malleus bench` finds the `benchmarks` folder of a source checkout, and an install without it
(a wheel) answers in one line instead of a traceback."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import BENCHES
from malleus_svc.cli import main

REPO = Path(__file__).resolve().parent.parent


def test_bench_help_lists_every_benchmark(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: malleus bench") and all(name in out for name in BENCHES)


@pytest.mark.parametrize("name", BENCHES)
def test_each_benchmark_has_its_own_help(name, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", name, "--help"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: malleus bench {name}")


def test_unknown_benchmark_is_one_clear_line(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "nope"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'nope'" in err and "lengths-runtime" in err


def test_python_m_benchmarks():
    r = subprocess.run([sys.executable, "-m", "benchmarks", "--help"], cwd=REPO, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("usage: python -m benchmarks")


def test_without_a_checkout_bench_says_so_in_one_line(tmp_path):
    # The installed layout of a wheel: malleus_svc alone in a site directory, no benchmarks beside it;
    # on the path also a folder named benchmarks that holds only data (not the package).
    site = tmp_path / "site"
    shutil.copytree(REPO / "malleus_svc", site / "malleus_svc", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "run.json").write_text("{}")
    code = (f"import sys; sys.path[:0] = [{str(site)!r}, {str(tmp_path)!r}]; from malleus_svc.cli import main; "
            "sys.exit(main(['bench', 'planner']))")
    r = subprocess.run([sys.executable, "-I", "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "benchmarks need a source checkout" in r.stderr


def test_bench_prepare_data_runs_on_a_tiny_corpus(capsys, monkeypatch):
    """A smoke run: prepare-data and the encoder alone count the same tokens (the bench exits otherwise)."""
    pytest.importorskip("tokenizers")
    pytest.importorskip("datasets")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")   # restored afterwards: the bench sets it
    assert main(["bench", "prepare-data", "--mb", "0.2", "--vocab", "300", "--workers", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    cells = [c.strip() for c in rows[-1].strip("|").split("|")]
    assert len(rows) == 2 and len(cells) == 6 and cells[3].count("tokens/s") == cells[4].count("tokens/s") == 1
    assert int(cells[2].replace(",", "")) > 0 and float(cells[5]) > 0
