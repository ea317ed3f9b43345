"Tests of tools/run_notebooks.py, the notebook runner for machines without nbdev (the GPU check)."
import json, os, sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import run_notebooks as R  # noqa: E402


def notebook(path, *sources):
    cells = [{"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None, "source": s} for s in sources]
    path.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    return path


def test_directives_pick_the_cells_nbdev_runs():
    assert R.cell_flags("#| cuda\nx = 1") == {"cuda"} and R.cell_flags("#| export\nx = 1") == set()
    assert R.cell_flags("\n#|hide\n#| slow\nx = 1") == {"slow"} and R.cell_flags("x = 1\n#| cuda") == set()
    assert not R.runs("#| eval: false\nx = 1", {"cuda"}) and not R.runs("#|eval:false\nx = 1", set())
    assert R.runs("#| eval: true\nx = 1", set()) and R.runs("#| export\nx = 1", set())
    assert not R.runs("#| cuda\nx = 1", set()) and R.runs("#| cuda\nx = 1", {"cuda"})


def test_flags_pick_the_cells_and_a_failure_names_its_cell(tmp_path, monkeypatch):
    monkeypatch.setattr(R, "ROOT", tmp_path)
    good = notebook(tmp_path / "good.ipynb", "x = 2", "#| cuda\nraise RuntimeError('no GPU here')",
                    "#| eval: false\nraise RuntimeError('never run')", "assert x == 2")
    bad = notebook(tmp_path / "bad.ipynb", "x = 2", "#| export\ny = x + 1", "assert y == 4, 'y is 3'")
    ok = R.run_notebook(good, set(), 60)
    assert ok["status"] == "PASS" and ok["cells"] == 2                        # the cuda and eval: false cells skipped
    gpu = R.run_notebook(good, {"cuda"}, 60)
    assert gpu["status"] == "FAIL" and gpu["cell"] == 1 and "no GPU here" in gpu["error"]
    failed = R.run_notebook(bad, set(), 60)
    assert failed["status"] == "FAIL" and failed["cell"] == 2 and "y is 3" in failed["error"]
    out, log = tmp_path / "report.txt", tmp_path / "log.txt"
    assert R.main([str(good), str(bad), "--out", str(out), "--log", str(log), "--title", "a test", "--jobs", "2"]) == 1
    report = out.read_text()
    assert report.startswith("# a test\n# command: python tools/run_notebooks.py ") and "git sha:" in report
    assert "PASS good.ipynb" in report and "FAIL bad.ipynb" in report and "1 of 2 notebooks passed" in report
    assert "AssertionError: y is 3" in log.read_text()


def test_cells_have_their_source_display_and_the_path(tmp_path, monkeypatch):
    "Triton's @jit reads a kernel's source with inspect.getsource: a cell's functions must have theirs, as in IPython."
    monkeypatch.setattr(R, "ROOT", tmp_path)
    monkeypatch.setenv("PYTHONPATH", "/some/where")
    nb = notebook(tmp_path / "src.ipynb", "import inspect, os, sys\ndef kernel(x):\n    return x + 1",
                  "assert 'return x + 1' in inspect.getsource(kernel)", "display('shown')",
                  f"assert sys.path[1:3] == [{str(tmp_path)!r}, '/some/where'], sys.path",   # the repo, then what was set
                  "assert os.environ['IN_TEST'] == '1'")
    assert R.run_notebook(nb, set(), 60)["status"] == "PASS"


def test_a_timeout_kills_the_notebook_and_what_it_started(tmp_path, monkeypatch):
    monkeypatch.setattr(R, "ROOT", tmp_path)
    pid_file = tmp_path / "child.pid"
    nb = notebook(tmp_path / "slow.ipynb", "x = 1",
                  f"import subprocess, sys, time\nchild = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                  f"open({str(pid_file)!r}, 'w').write(str(child.pid))\ntime.sleep(60)")
    r = R.run_notebook(nb, set(), 3)
    assert r["status"] == "FAIL" and r["cell"] == 1 and "timed out after 3 s" in r["error"] and r["seconds"] < 30
    child = int(pid_file.read_text())
    try: os.kill(child, 0); alive = not Path(f"/proc/{child}/stat").read_text().split()[2] == "Z"
    except ProcessLookupError: alive = False
    assert not alive


def test_a_thread_left_running_does_not_hold_the_end(tmp_path, monkeypatch):
    "As a kernel shut down: a worker thread a cell started (a widget's) does not keep the notebook's process alive."
    monkeypatch.setattr(R, "ROOT", tmp_path)
    nb = notebook(tmp_path / "thread.ipynb", "import threading, time\nthreading.Thread(target=time.sleep, args=(60,)).start()")
    r = R.run_notebook(nb, set(), 30)
    assert r["status"] == "PASS" and r["seconds"] < 20


def test_the_deadline_stops_starting_notebooks(tmp_path, monkeypatch):
    monkeypatch.setattr(R, "ROOT", tmp_path)
    first = notebook(tmp_path / "a.ipynb", "import time\ntime.sleep(2)")
    second = notebook(tmp_path / "b.ipynb", "x = 1")
    out = tmp_path / "report.txt"
    assert R.main([str(first), str(second), "--deadline", "10", "--start-margin", "9", "--out", str(out)]) == 1
    report = out.read_text()
    assert "PASS a.ipynb" in report and "NOT RUN b.ipynb" in report and "1 of 2 notebooks passed, 0 failed, 1 not run" in report
