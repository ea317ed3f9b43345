"Tests of tools/run_notebooks.py, the notebook runner for machines without nbdev (the GPU check)."
import json, sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import run_notebooks as R  # noqa: E402


def notebook(path, *sources):
    cells = [{"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None, "source": s} for s in sources]
    path.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    return path


def test_flags_pick_the_cells_and_a_failure_names_its_cell(tmp_path, monkeypatch):
    monkeypatch.setattr(R, "ROOT", tmp_path)
    assert R.cell_flags("#| cuda\nx = 1") == {"cuda"} and R.cell_flags("#| export\nx = 1") == set()
    good = notebook(tmp_path / "good.ipynb", "x = 2", "#| cuda\nraise RuntimeError('no GPU here')", "assert x == 2")
    bad = notebook(tmp_path / "bad.ipynb", "x = 2", "#| export\ny = x + 1", "assert y == 4, 'y is 3'")
    assert R.run_notebook(good, set(), 60)["passed"]                            # the cuda cell is skipped
    gpu = R.run_notebook(good, {"cuda"}, 60)
    assert not gpu["passed"] and gpu["cell"] == 1 and "no GPU here" in gpu["error"]
    failed = R.run_notebook(bad, set(), 60)
    assert not failed["passed"] and failed["cell"] == 2 and "y is 3" in failed["error"]
    out = tmp_path / "report.txt"
    assert R.main([str(good), str(bad), "--out", str(out)]) == 1
    report = out.read_text()
    assert "PASS good.ipynb" in report and "FAIL bad.ipynb" in report and "1 of 2 notebooks passed" in report


def test_a_cell_function_has_its_source(tmp_path, monkeypatch):
    "Triton's @jit reads a kernel's source with inspect.getsource: a cell's functions must have theirs, as in IPython."
    monkeypatch.setattr(R, "ROOT", tmp_path)
    nb = notebook(tmp_path / "src.ipynb", "import inspect\ndef kernel(x):\n    return x + 1",
                  "assert 'return x + 1' in inspect.getsource(kernel)")
    assert R.run_notebook(nb, set(), 60)["passed"]
