"""`malleus bench step` on CPU, small: our row always, torchtitan's beside it where its `bench` extra
is installed (CI does not install it: it needs triton, hundreds of MB), and its figures' formulas."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from benchmarks import step
from malleus_svc.cli import main
from malleus_svc.config.presets import ModelShape

SMALL = ["--device", "cpu", "--hidden", "64", "--ffn", "128", "--heads", "4", "--kv-heads", "2", "--seq-len", "64",
         "--blocks", "2", "--steps", "2", "--warmup", "1"]
HAS_TORCHTITAN = importlib.util.find_spec("torchtitan") is not None


def _rows(out: str) -> dict[str, list[str]]:
    lines = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| implementation")]
    return {cells[0]: cells[1:] for cells in ([c.strip() for c in line.strip("|").split("|")] for line in lines)}


def test_the_cpu_bench_prints_our_row_and_torchtitans_or_how_to_get_it(capsys):
    assert main(["bench", "step", *SMALL, "--no-packed"]) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    tokens_per_s, tflops, mfu, peak, kernels, step_ms, host_ms = rows["malleus"]
    assert float(tokens_per_s.replace(",", "")) > 0 and float(kernels) > 0 and float(step_ms) > 0
    assert mfu == peak == "-"              # no peak FLOP/s or allocator on CPU
    if HAS_TORCHTITAN:
        assert "torchtitan" in rows and "ours / torchtitan tokens/s" in out
    else:
        assert "torchtitan" not in rows and "no torchtitan row" in out and "malleus-svc[bench]" in out


def test_packed_documents_on_cpu_with_torchtitan_is_one_clear_line(capsys):
    assert main(["bench", "step", *SMALL, "--packed"]) == 2
    out = capsys.readouterr().out.strip()
    assert "\n" not in out and "no CPU backward" in out and "--no-packed" in out


def test_model_flops_are_the_stated_formula():
    shape = ModelShape(layers=3, hidden=64, heads=4, ffn=128, vocab=256, seq_len=64, kv_heads=2)
    lengths = [5, 20, 39]
    per_block = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128          # q and out, k and v (2 kv heads of 16), MLP
    pairs = sum(n * (n + 1) // 2 for n in lengths)
    forward = 2 * 3 * per_block * sum(lengths) + 4 * 3 * 64 * pairs
    assert step.model_flops(shape, 3, lengths) == pytest.approx(3 * forward)


def test_packed_documents_fill_the_row_and_one_document_is_the_row():
    lengths = step.document_lengths(8192, packed=True)
    assert sum(lengths) == 8192 and len(lengths) > 1 and min(lengths[:-1]) >= 16
    assert step.document_lengths(8192, packed=False) == [8192]
    assert step.peak_tflops(torch.device("cpu")) is None


def test_the_recomputing_rows_come_with_their_price_beside_the_planners(capsys):
    assert main(["bench", "step", *SMALL, "--no-packed", "--no-torchtitan", "--recompute", "selective,full"]) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    assert {"malleus", "malleus (selective)", "malleus (full)"} <= set(rows)
    for mode, price in (("selective", "1.017"), ("full", "1.333")):
        line = next(l for l in out.splitlines() if l.startswith(f"{mode} / storing step time:"))
        assert float(line.split(":")[1].split()[0]) > 0 and f"prices it at {price}" in line
    assert main(["bench", "step", *SMALL, "--no-torchtitan", "--recompute", "partial"]) == 2
    assert "--recompute takes selective, full" in capsys.readouterr().out
