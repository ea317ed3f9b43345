"The house's rules, checked on the library as committed: no import cycles, no jetrl import inside a function, no module over 700 lines."
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import import_graph as G  # noqa: E402


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
