"""Run notebooks as a learner would, where nbdev is not installed (the GPU machine): each notebook's code cells in
order, in one fresh Python process per notebook, cells flagged with a test flag skipped unless that flag is given.

    python tools/run_notebooks.py --flags cuda --out benchmarks/results/notebooks_h200.txt     # every notebook
    python tools/run_notebooks.py nbs/00_fp8.ipynb nbs/walkthrough/03_off_policy.ipynb           # some

It reads the flags nbdev reads (`#| cuda`, `#| slow`, `#| vllm` on a cell's first lines; the project's `tst_flags`),
runs the rest as `nbdev-test` would (exported and hidden cells too), and prints one line per notebook: PASS or FAIL,
seconds, and for a failure the cell and the error's last line. The report (--out) holds the command and those lines.
Exit status 1 if any notebook failed.
"""
from __future__ import annotations

import argparse, json, os, subprocess, sys, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEST_FLAGS = ("cuda", "slow", "vllm")          # pyproject.toml's [tool.nbdev] tst_flags

def cell_flags(source: str) -> set[str]:
    "The test flags of a cell: `#| name` lines at its top that name a test flag."
    flags = set()
    for line in source.splitlines():
        if not line.startswith("#|"): break
        flags |= {word for word in line[2:].split() if word in TEST_FLAGS}
    return flags

def code_cells(notebook: Path, flags: set[str]) -> list[tuple[int, str]]:
    "(index, source) of the code cells to run: those whose test flags are all in `flags`."
    cells = json.loads(notebook.read_text())["cells"]
    return [(i, "".join(c["source"])) for i, c in enumerate(cells)
            if c["cell_type"] == "code" and cell_flags("".join(c["source"])) <= flags]

RUNNER = r'''
import json, linecache, sys, traceback
cells = json.loads(sys.stdin.read())
namespace = {"__name__": "__main__"}
for index, source in cells:
    filename = f"<cell {index}>"
    # as IPython does: the cell's source in linecache, so that inspect.getsource (Triton's @jit needs it) finds it
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    try: exec(compile(source, filename, "exec"), namespace)
    except BaseException as error:
        print(json.dumps({"cell": index, "error": f"{type(error).__name__}: {error}"[:500]}), file=sys.stderr)
        print(source[-300:], file=sys.stderr)
        traceback.print_exc()
        sys.exit(1)
'''

def run_notebook(notebook: Path, flags: set[str], timeout_s: float) -> dict:
    "Run one notebook in a fresh process, from its own folder (as nbdev-test does); returns its result."
    cells = code_cells(notebook, flags)
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-c", RUNNER], input=json.dumps(cells), cwd=notebook.parent, text=True,
                              capture_output=True, timeout=timeout_s, env=os.environ | {"PYTHONPATH": str(ROOT)})
        status, err = proc.returncode, proc.stderr
    except subprocess.TimeoutExpired:
        status, err = 124, json.dumps({"cell": None, "error": f"timed out after {timeout_s:.0f} s"})
    result = {"notebook": str(notebook.relative_to(ROOT)), "passed": status == 0, "seconds": round(time.perf_counter() - start, 1),
              "cells": len(cells)}
    if status:
        found = [json.loads(line) for line in err.splitlines() if line.startswith('{"cell"')]
        result |= found[-1] if found else {"cell": None, "error": (err.strip().splitlines() or ["no output"])[-1][:500]}
    return result

def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("notebooks", nargs="*", type=Path, help="default: nbs/*.ipynb and nbs/walkthrough/*.ipynb")
    p.add_argument("--flags", default="", help="comma-separated test flags whose cells run too (e.g. cuda)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per notebook")
    p.add_argument("--out", type=Path, help="write the report here")
    args = p.parse_args(argv)
    flags = {f for f in args.flags.split(",") if f}
    unknown = flags - set(TEST_FLAGS)
    if unknown: p.error(f"unknown flags {sorted(unknown)}: the test flags are {list(TEST_FLAGS)}")
    notebooks = [n.resolve() for n in args.notebooks] or sorted((ROOT / "nbs").glob("*.ipynb")) + sorted((ROOT / "nbs" / "walkthrough").glob("*.ipynb"))
    missing = [str(n) for n in notebooks if not n.is_file()]
    if missing: p.error(f"no such notebook: {missing}")
    lines = [f"# python tools/run_notebooks.py {' '.join(argv if argv is not None else sys.argv[1:])}"]
    results = []
    for notebook in notebooks:
        r = run_notebook(notebook, flags, args.timeout); results.append(r)
        line = f"{'PASS' if r['passed'] else 'FAIL'} {r['notebook']} {r['seconds']} s, {r['cells']} cells"
        if not r["passed"]: line += f"; cell {r['cell']}: {r['error']}"
        print(line, flush=True); lines.append(line)
    lines.append(f"# {sum(r['passed'] for r in results)} of {len(results)} notebooks passed")
    if args.out: args.out.write_text("\n".join(lines) + "\n")
    return 0 if all(r["passed"] for r in results) else 1

if __name__ == "__main__":
    sys.exit(main())
