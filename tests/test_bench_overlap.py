"""`malleus bench overlap`: both modes run side by side and the table says what each waited for."""
from __future__ import annotations

from benchmarks import overlap


def test_the_bench_runs_both_modes_and_reports_each(capsys, tmp_path):
    md = tmp_path / "B.md"
    assert overlap.main(["--hidden", "128", "--layers", "2", "--tokens", "16", "--steps", "1", "--rounds", "1",
                         "--tflops", "1", "--write", str(md)]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| after") or line.startswith("| behind")]
    assert len(rows) == 2 and "step with the reduction behind backward / after it:" in out
    after, behind = (row.split("|") for row in rows)
    assert after[4].strip() == "-" and behind[4].strip().endswith("%")    # only the overlapped run launches early
    assert "<!-- bench:overlap -->" in md.read_text()
