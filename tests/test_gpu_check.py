"""scripts/gpu_check.sh and the module behind it (runtime/gpu_check.py): on CPU, every check that
needs no CUDA runs for real (gloo for the two-process checks) and passes; without a GPU and without
--device cpu it says so in one line and exits 77."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from malleus_svc.runtime import gpu_check
from malleus_svc.runtime.gpu_check import EXIT_NO_GPU, format_table

REPO = Path(__file__).resolve().parents[1]


def _script(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(["bash", "scripts/gpu_check.sh", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)


def _table(stdout: str) -> dict[str, list[str]]:
    rows = [line.split(" | ") for line in stdout.splitlines() if line.count(" | ") == 3]
    return {r[0].strip(): [c.strip() for c in r[1:]] for r in rows[1:]}


def test_the_cpu_mode_runs_every_check_that_needs_no_cuda_and_they_pass():
    p = _script("--device", "cpu")
    print(p.stdout)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    table = _table(p.stdout)
    assert list(table) == ["attention-sdpa-bf16", "attention-flash", "train-bf16", "length-sweep",
                           "throttled-clock", "pipeline-2-stage", "migration"]
    assert table["attention-flash"][:2] == ["skip", "no CUDA" if not torch.cuda.is_available() else "--device cpu"]
    for name, (status, figure, tolerance) in table.items():
        if name != "attention-flash":
            assert status == "pass" and figure and tolerance != "-", (name, figure)
    assert "gloo:" in table["pipeline-2-stage"][1]
    assert "bitwise" in table["migration"][1] and "NOT" not in table["migration"][1]
    assert "PacedClock" in table["throttled-clock"][1]
    assert p.stdout.strip().endswith("gpu_check: no check failed")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_it_says_so_in_one_line_and_exits_with_its_own_code():
    p = _script()
    assert p.returncode == EXIT_NO_GPU == 77, p.stdout + p.stderr
    assert p.stdout.count("\n") == 1 and "no CUDA GPU is present" in p.stdout and "--device cpu" in p.stdout
    assert p.stderr == ""


def test_bad_arguments_exit_two():
    with pytest.raises(SystemExit) as e:
        gpu_check.main(["--device", "tpu"])
    assert e.value.code == 2


def test_the_attention_check_tells_a_leak_between_sequences_from_bf16_rounding():
    # one causal attention over the whole row, boundaries ignored: what a kernel that mishandled
    # cu_seqlens would compute
    def leaky(q, k, v, packing):
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in (q, k, v)), is_causal=True)
        return out.transpose(0, 1)

    honest = gpu_check._attention_error(gpu_check.attention.sdpa_by_length, torch.device("cpu"))
    wrong = gpu_check._attention_error(leaky, torch.device("cpu"))
    assert honest <= gpu_check.SDPA_BF16_RTOL < wrong, (honest, wrong)


def test_a_check_that_raises_is_a_failed_row_and_the_others_still_run(monkeypatch):
    def broken(device, shape):
        raise RuntimeError("NCCL error: unhandled system error\nlast line says what")

    monkeypatch.setattr(gpu_check, "check_two_devices", broken)   # the failure; the other checks run for real
    results = gpu_check.run_checks(torch.device("cpu"), gpu_check.preset("tiny"))
    assert [(r.check, r.status) for r in results] == [
        ("attention-sdpa-bf16", "pass"), ("attention-flash", "skip"), ("train-bf16", "pass"),
        ("length-sweep", "pass"), ("throttled-clock", "pass"), ("pipeline-2-stage, migration", "fail")]
    assert results[-1].figure == "raised RuntimeError: last line says what"
    table = format_table(results).splitlines()
    assert len(table) == 2 + len(results) and table[-1].split(" | ")[1].strip() == "fail"
