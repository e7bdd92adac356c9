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


# Rows read on the paced clock: judged only where the host kept its pace, else inconclusive.
PACED_ROWS = ("length-sweep", "throttled-clock")


def _passed(name: str, status: str, figure: str) -> bool:
    """Passed; or, for a row read on the paced clock, inconclusive (a skip that says so, with the
    figure): a busy host is no verdict either way."""
    if name in PACED_ROWS and status == "skip":
        print(f"{name}: {figure}")
        return figure.startswith(gpu_check.INCONCLUSIVE) and any(c.isdigit() for c in figure)
    return status == "pass"


def test_the_cpu_mode_runs_every_check_that_needs_no_cuda_and_they_pass():
    p = _script("--device", "cpu")
    print(p.stdout)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    table = _table(p.stdout)
    cuda_only = ("step-host-syncs", "collective-host-free", "watchdog-abort")
    assert list(table) == ["attention-sdpa-bf16", "attention-flash", "train-bf16", *cuda_only, "length-sweep",
                           "throttled-clock", "memory-peak", "pipeline-2-stage", "migration"]
    assert table["attention-flash"][:2] == ["skip", "no CUDA" if not torch.cuda.is_available() else "--device cpu"]
    assert table["memory-peak"][:2] == ["skip", "needs CUDA's allocator"]
    assert all(table[name][0] == "skip" for name in cuda_only)
    for name, (status, figure, tolerance) in table.items():
        if name not in ("attention-flash", "memory-peak", *cuda_only):
            assert _passed(name, status, figure) and figure and tolerance != "-", (name, status, figure)
    assert "gloo:" in table["pipeline-2-stage"][1]
    assert "bitwise" in table["migration"][1] and "NOT" not in table["migration"][1]
    assert "PacedClock" in table["throttled-clock"][1] or table["throttled-clock"][0] == "skip"
    assert p.stdout.strip().endswith("gpu_check: no check failed")


def test_a_host_that_cannot_keep_the_pace_makes_the_paced_rows_inconclusive_not_failed(monkeypatch):
    """A pace no host can hold (every op overruns, so every time read is the host's): neither row
    passes nor fails; each says so with the figure."""
    from malleus_svc.runtime import length_sweep
    from malleus_svc.runtime.device_clock import Pace

    impossible = Pace(flops_per_second=1e18, bytes_per_second=1e18)
    monkeypatch.setattr(gpu_check, "pace_for", lambda *a, **k: impossible)
    monkeypatch.setattr(length_sweep, "_group_pace", lambda *a, **k: impossible)
    shape = gpu_check.preset("tiny")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = [gpu_check.check_throttled_clock(torch.device("cpu"), shape),
                gpu_check.check_length_sweep(torch.device("cpu"), shape)]
    finally:
        torch.set_num_threads(threads)
    assert [r.status for r in rows] == ["skip", "skip"], rows
    assert "0 healthy and 0 throttled steps of 5 kept their pace" in rows[0].figure, rows[0]
    assert "0% of the mixes timed at their pace" in rows[1].figure, rows[1]
    assert all(r.figure.startswith(gpu_check.INCONCLUSIVE) for r in rows)


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
    cuda_only = ("step-host-syncs", "collective-host-free", "watchdog-abort")
    assert [r.check for r in results] == ["attention-sdpa-bf16", "attention-flash", "train-bf16", *cuda_only,
                                          "length-sweep", "throttled-clock", "memory-peak", "pipeline-2-stage, migration"]
    statuses = {r.check: r.status for r in results}
    assert all(statuses[name] == "skip" for name in ("attention-flash", "memory-peak", *cuda_only))
    assert all(_passed(r.check, r.status, r.figure) for r in results[:8]
               if r.check not in ("attention-flash", *cuda_only)), results
    assert results[-1].status == "fail"
    assert results[-1].figure == "raised RuntimeError: last line says what"
    table = format_table(results).splitlines()
    assert len(table) == 2 + len(results) and table[-1].split(" | ")[1].strip() == "fail"


def test_the_memory_check_holds_a_peak_between_the_modelled_state_and_the_model_plus_margin():
    """Every line of the memory row but the allocator's read runs here, on a peak given by hand."""
    from malleus_svc.config.scenario import Profile
    from malleus_svc.runtime.memory import stage_footprint

    shape = gpu_check.preset("tiny")
    model = stage_footprint(shape, shape.layers, has_embedding=True, has_head=True, tp=1, micro_batch=4).at_depth(1)
    state = model.params + model.grads + model.adam + model.working
    margin = int(Profile().safety_margin_mb * 2 ** 20)
    steps = []

    def given(bytes_):
        def peak_of(step, device):
            steps.append(step().global_loss)   # the measured step runs for real
            return bytes_
        return gpu_check.check_memory_peak(torch.device("cpu"), shape, peak_of=peak_of)

    assert given(model.total).status == "pass" and "+0.0%" in given(model.total).figure
    assert given(model.total + margin).status == "pass"
    assert given(model.total + margin + 1).status == "fail"
    assert given(state - 1).status == "fail"
    assert len(steps) == 5 and all(0 < loss < 20 for loss in steps)
