"""The house's rules, checked on the library as committed: no import cycles, no jetrl import inside a function, no module over
700 lines; every row of a results file is of a commit the project cites."""
import json, sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import import_graph as G  # noqa: E402
import results_rows as R  # noqa: E402


def test_the_checker_finds_a_cycle_and_a_local_import(tmp_path, monkeypatch):
    pkg = tmp_path / "jetrl"; pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import f\n")
    (pkg / "b.py").write_text("def f():\n    from jetrl.a import f as g\n    return g\n")
    (pkg / "c.py").write_text("x = 1\n" * (G.MAX_MODULE_LINES + 1))
    monkeypatch.setattr(G, "ROOT", tmp_path); monkeypatch.setattr(G, "PACKAGE", pkg)
    found = G.problems()
    assert any("cycle among jetrl.a <-> jetrl.b" in p for p in found), found
    assert any("b.py:2 imports jetrl.a inside a function" in p for p in found), found
    assert any("c.py has 701 lines" in p for p in found), found


def test_jetrl_keeps_the_house_rules():
    assert G.problems() == []


def test_results_rows_of_an_uncited_commit_are_found_and_pruned(tmp_path, monkeypatch):
    results = tmp_path / "benchmarks" / "results"; results.mkdir(parents=True)
    (tmp_path / "README.md").write_text("The step took 1.0 s (`step.jsonl`, 2026-12-01, aaaaaaa).\n")
    rows = [{"step_s": 1.0, "git_sha": "a" * 40}, {"step_s": 2.0, "git_sha": "b" * 40}, {"note": "no commit"}]
    (results / "step.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setattr(R, "ROOT", tmp_path); monkeypatch.setattr(R, "RESULTS", results)
    assert R.main(["--check"]) == 1                            # bbbbbbb's row: cited nowhere
    assert R.main(["--prune"]) == 0 and R.main(["--check"]) == 0
    kept = (results / "step.jsonl").read_text()
    assert "aaaaaaa" in kept and "bbbbbbb" not in kept and "no commit" in kept


def test_every_results_row_is_of_a_cited_commit():
    assert R.uncited(R.citing_text()) == {}
