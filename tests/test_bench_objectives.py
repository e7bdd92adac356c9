"""`malleus bench objectives`: rank correlations and plan comparisons of one scenario, and its section."""
from benchmarks import objectives
from malleus_svc.config.scenario import OBJECTIVES
from malleus_svc.planner.build import build_problem
from malleus_svc.simulate.scenarios import paper_scenario


def test_one_scenario_row_is_consistent():
    row = objectives.run_one("70b-64gpu/severe", build_problem(paper_scenario("70b-64gpu", "severe")))
    assert row.candidates >= 5
    assert set(row.spearman) == set(row.kendall) == set(OBJECTIVES)
    assert all(-1 <= row.spearman[o] <= 1 for o in OBJECTIVES)
    assert set(row.sim) == {*OBJECTIVES, *objectives.OTHERS}
    assert row.ratio(objectives.REFERENCE) == 1.0
    assert row.best_known <= min(row.sim.values())
    assert row.sim["static"] > row.sim[objectives.REFERENCE]       # a 5x straggler stalls the static plan


def test_main_writes_its_section(tmp_path, capsys):
    md = tmp_path / "B.md"
    md.write_text("# Benchmarks\n\n<!-- bench:objectives -->\nold\n<!-- /bench:objectives -->\n")
    assert objectives.main(["--sizes", "16", "--seeds", "1", "--write", str(md)]) == 0
    out = capsys.readouterr().out
    text = md.read_text()
    assert "old" not in text and "malleus bench objectives --sizes 16 --seeds 1" in text
    assert "16 devices, seed 0" in out and "best known / full" in out
    # 15 grid scenarios + 1 random situation, one line each in both tables
    assert out.count("| 16 devices, seed 0 |") == 2 and out.count("| 110b-64gpu/authors |") == 2
