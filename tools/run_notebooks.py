"""Run notebooks as a learner would, where nbdev is not installed (the GPU machine): each notebook's code cells in
order, in one fresh Python process per notebook, cells flagged with a test flag skipped unless that flag is given.

    python tools/run_notebooks.py --flags cuda --out benchmarks/results/notebooks_h200.txt     # every notebook
    python tools/run_notebooks.py nbs/00_fp8.ipynb nbs/walkthrough/03_off_policy.ipynb           # some
    python tools/run_notebooks.py --flags cuda --jobs 4 --deadline 540 --log nb.log --out nb.txt # what tools/gpu_notebooks.sh runs

It reads the directives nbdev reads (`#| cuda`, `#| slow`, `#| vllm` at a cell's top: the project's `tst_flags`;
`#| eval: false`, which nbdev never runs) and runs the rest as `nbdev-test` would (exported and hidden cells too,
from the notebook's folder, `IN_TEST=1`). Each cell is compiled with its source in `linecache`, as IPython does, so
`inspect.getsource` (Triton's `@jit` reads it) finds a cell's functions; `display` is IPython's (a print without it).

One line per notebook: PASS or FAIL, seconds, cells run, and for a failure the cell (its index in the notebook) and
the error's last line. A notebook past `--timeout`, or past `--deadline` (seconds for the whole run), is killed with
every process it started; a notebook not started before the deadline is reported NOT RUN. The report (--out) is
rewritten as each notebook ends, so that a run cut short still leaves one. --log collects every notebook's output.
Exit status 1 if any notebook failed or did not run.
"""
from __future__ import annotations

import argparse, datetime, json, os, re, shlex, signal, subprocess, sys, tempfile, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEST_FLAGS = ("cuda", "slow", "vllm")          # pyproject.toml's [tool.nbdev] tst_flags
DIRECTIVE = re.compile(r"\s*#\s*\|\s*([^\s:]+)\s*:?\s?(.*?)\s*$")     # `#| name` or `#| name: value` (fastcore.nbio)
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
LOG_HEAD, LOG_TAIL = 20_000, 200_000           # characters of one notebook's output that --log keeps

def directives(source: str) -> dict[str, str]:
    "A cell's directives, as nbdev reads them: `#| name value` lines at its top (blank lines and %% magics among them)."
    found = {}
    for line in source.splitlines():
        m = DIRECTIVE.match(line)
        if m: found[m[1]] = "" if m[2] == "true" else m[2]
        elif line.strip() and not re.match(r"\s*%%\w+", line): break
    return found

def cell_flags(source: str) -> set[str]:
    "The test flags of a cell: the directives that name one (nbdev skips a cell whose directives name a skipped flag)."
    return set(directives(source)) & set(TEST_FLAGS)

def runs(source: str, flags: set[str]) -> bool:
    "Does nbdev-test (with `--flags` `flags`) run this code cell? Not with `#| eval: false`, nor with a flag not given."
    return directives(source).get("eval") not in ("false", "False") and cell_flags(source) <= flags

def code_cells(notebook: Path, flags: set[str]) -> list[tuple[int, str]]:
    "(index in the notebook, source) of the code cells to run."
    cells = json.loads(notebook.read_text())["cells"]
    sources = [(i, "".join(c["source"])) for i, c in enumerate(cells) if c["cell_type"] == "code"]
    return [(i, s) for i, s in sources if runs(s, flags)]

RUNNER = r'''
import json, linecache, os, sys, time, traceback
progress = sys.argv[1]
cells = json.loads(open(sys.argv[2]).read())
try: from IPython.display import display
except ImportError:
    def display(*objs, **kwargs):
        for obj in objs: print(repr(obj))
namespace = {"__name__": "__main__", "__builtins__": __builtins__, "display": display}
def note(**fields):                       # written whole or not at all: a kill mid-write leaves the last note
    with open(progress + ".tmp", "w") as f: json.dump(fields, f)
    os.replace(progress + ".tmp", progress)
for ran, (index, source) in enumerate(cells):
    filename = f"<cell {index}>"
    # as IPython does: the cell's source in linecache, so that inspect.getsource (Triton's @jit needs it) finds it
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    note(cell=index, ran=ran)
    print(f"----- cell {index}", flush=True)
    start = time.perf_counter()
    try: exec(compile(source, filename, "exec"), namespace)
    except BaseException as error:
        traceback.print_exc()
        note(cell=index, ran=ran, error=f"{type(error).__name__}: {error}".strip()[:500])
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(1)
    print(f"----- cell {index}: {time.perf_counter() - start:.1f} s", flush=True)
note(cell=None, ran=len(cells))
sys.stdout.flush(); sys.stderr.flush()
os._exit(0)      # as a kernel shut down: threads a cell left running (a widget's worker) do not hold the exit
'''

def child_env(threads: int | None = None) -> dict[str, str]:
    "The notebook's environment: the repository first on PYTHONPATH (what was there stays after it), as nbdev-test."
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env |= {"IN_TEST": "1", "PYTHONUNBUFFERED": "1"} | {k: v for k, v in NO_MULTICAST.items() if k not in env}
    if threads and "OMP_NUM_THREADS" not in env: env["OMP_NUM_THREADS"] = str(threads)
    return env

def kill_group(proc: subprocess.Popen):
    "End the notebook's process and every process it started (its own process group), then reap it."
    try: os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError): pass
    try: proc.wait(timeout=10)
    except subprocess.TimeoutExpired: pass

class Job:
    """One notebook running in its own process, in a process group of its own (so that a timeout ends its children too;
    the same session as the runner, so that whatever ends the runner's session ends them as well)."""
    def __init__(self, notebook: Path, flags: set[str], timeout_s: float, workdir: Path, env: dict[str, str]):
        self.notebook, self.timeout_s, self.start = notebook, timeout_s, time.perf_counter()
        self.cells = code_cells(notebook, flags)
        stem = str(notebook.relative_to(ROOT) if notebook.is_relative_to(ROOT) else notebook).replace(os.sep, "_")
        self.progress, self.output = workdir / f"{stem}.progress", workdir / f"{stem}.out"
        (cells_file := workdir / f"{stem}.cells.json").write_text(json.dumps(self.cells))
        with open(self.output, "w") as out:
            self.proc = subprocess.Popen([sys.executable, "-c", RUNNER, str(self.progress), str(cells_file)],
                                         stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         cwd=notebook.parent, env=env, process_group=0)

    def seconds(self) -> float: return time.perf_counter() - self.start

    def poll(self) -> dict | None:
        "The result once the notebook has ended (or was killed at its timeout), else None."
        status = self.proc.poll()
        if status is None and self.seconds() <= self.timeout_s: return None
        if status is None: return self.stop(f"timed out after {self.timeout_s:.0f} s")
        kill_group(self.proc)                            # also the processes a finished notebook left running
        return self._result(status == 0, None if status >= 0 else f"killed by signal {signal.Signals(-status).name}",
                            None if status <= 0 else f"exit status {status}")

    def stop(self, why: str) -> dict:
        "Kill the notebook (and what it started) now: a failure, at the cell it was running."
        kill_group(self.proc)
        return self._result(False, why)

    def _result(self, passed: bool, why: str | None, fallback: str | None = None) -> dict:
        progress = json.loads(self.progress.read_text()) if self.progress.exists() else {"cell": None, "ran": 0}   # no cell began
        result = {"notebook": name(self.notebook), "status": "PASS" if passed else "FAIL", "seconds": round(self.seconds(), 1),
                  "cells": len(self.cells), "ran": progress.get("ran", 0)}
        if not passed: result |= {"cell": progress.get("cell"), "error": why or progress.get("error") or fallback or "no error"}
        return result

def run_notebook(notebook: Path, flags: set[str], timeout_s: float) -> dict:
    "Run one notebook and wait for its result."
    with tempfile.TemporaryDirectory(prefix="run_notebooks_") as workdir:
        job = Job(notebook.resolve(), flags, timeout_s, Path(workdir), child_env())
        while (result := job.poll()) is None: time.sleep(0.1)
        return result

def name(notebook: Path) -> str:
    return str(notebook.relative_to(ROOT)) if notebook.is_relative_to(ROOT) else str(notebook)

def line(r: dict) -> str:
    if r["status"] == "NOT RUN": return f"NOT RUN {r['notebook']}: {r['error']}"
    text = f"{r['status']} {r['notebook']} {r['seconds']} s, {r['cells']} cells"
    if r["status"] == "FAIL":
        where = "before any cell" if r.get("cell") is None else f"cell {r['cell']} (code cell {r['ran'] + 1} of the {r['cells']} to run)"
        text += f"; {where}: {' '.join(r['error'].split())}"
    return text

def git_sha() -> str:
    if os.environ.get("JETRL_GIT_SHA"): return os.environ["JETRL_GIT_SHA"]
    try: return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                               timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError): return "unknown"

def gpu_name() -> str:
    try: names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                text=True, timeout=30).stdout.split("\n")
    except (OSError, subprocess.SubprocessError): return "no GPU"
    names = [n.strip() for n in names if n.strip()]
    return f"{len(names)} x {names[0]}" if names else "no GPU"

def report(header: list[str], order: list[str], results: dict[str, dict], running: set[str], footer: str = "") -> str:
    lines = list(header)
    for nb in order:
        if nb in results: lines.append(line(results[nb]))
        elif nb in running: lines.append(f"RUNNING {nb}")
        else: lines.append(f"PENDING {nb}")
    return "\n".join(lines + ([footer] if footer else [])) + "\n"

def append_log(log: Path, result: dict, output: Path):
    text = output.read_text(errors="replace") if output.exists() else ""
    if len(text) > LOG_HEAD + LOG_TAIL:
        text = f"{text[:LOG_HEAD]}\n[... {len(text) - LOG_HEAD - LOG_TAIL} characters left out ...]\n{text[-LOG_TAIL:]}"
    with open(log, "a") as f: f.write(f"===== {line(result)}\n{text}\n")

def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("notebooks", nargs="*", type=Path,
                   help="run in this order, each once (default: nbs/*.ipynb and nbs/walkthrough/*.ipynb)")
    p.add_argument("--flags", default="", help="comma-separated test flags whose cells run too (e.g. cuda)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per notebook")
    p.add_argument("--deadline", type=float, default=None,
                   help="seconds for the whole run: running notebooks are killed at it, and none starts in its last --start-margin")
    p.add_argument("--start-margin", type=float, default=30, help="seconds before the deadline after which no notebook starts")
    p.add_argument("--jobs", type=int, default=1, help="notebooks run at once")
    p.add_argument("--title", default=None, help="the report's first line")
    p.add_argument("--command", default=None, help="the command to name in the report (default: this runner's)")
    p.add_argument("--out", type=Path, help="write the report here")
    p.add_argument("--log", type=Path, help="write every notebook's output here")
    args = p.parse_args(argv)
    flags = {f for f in args.flags.split(",") if f}
    unknown = flags - set(TEST_FLAGS)
    if unknown: p.error(f"unknown flags {sorted(unknown)}: the test flags are {list(TEST_FLAGS)}")
    if args.jobs < 1: p.error("--jobs is at least 1")
    notebooks = (list(dict.fromkeys(n.resolve() for n in args.notebooks))        # each once, in the order given
                 or sorted((ROOT / "nbs").glob("*.ipynb")) + sorted((ROOT / "nbs" / "walkthrough").glob("*.ipynb")))
    missing = [str(n) for n in notebooks if not n.is_file()]
    if missing: p.error(f"no such notebook: {missing}")

    runner = "python tools/run_notebooks.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    started = datetime.datetime.now(datetime.timezone.utc)
    header = [f"# {args.title or 'Notebooks, each in one fresh process, cells in order'}",
              f"# command: {args.command or runner}"] + ([f"# runner: {runner}"] if args.command else []) + [
              f"# date: {started:%Y-%m-%d %H:%M} UTC, git sha: {git_sha()}, GPU: {gpu_name()}",
              f"# flags: {','.join(sorted(flags)) or 'none'} (cells flagged {', '.join(sorted(set(TEST_FLAGS) - flags)) or 'nothing'} "
              f"and `eval: false` skipped); --jobs {args.jobs}, --timeout {args.timeout:.0f} s per notebook"
              + (f", --deadline {args.deadline:.0f} s" if args.deadline else "")]
    if args.log: args.log.write_text("\n".join(header) + "\n")
    order = [name(n) for n in notebooks]
    env = child_env(max(1, (os.cpu_count() or 1) // args.jobs))     # the cores shared among the notebooks
    t0, results, running, queue = time.perf_counter(), {}, [], list(notebooks)

    def write(footer=""):
        text = report(header, order, results, {name(j.notebook) for j in running}, footer)
        if args.out: args.out.write_text(text)
        return text

    def stop(signum, frame): raise KeyboardInterrupt(f"signal {signum}")
    previous_handler = signal.signal(signal.SIGTERM, stop)     # a SIGTERM too ends the notebooks first (finally, below)
    with tempfile.TemporaryDirectory(prefix="run_notebooks_") as workdir:
        try:
            while queue or running:
                left = args.deadline - (time.perf_counter() - t0) if args.deadline else float("inf")
                while queue and len(running) < args.jobs:
                    notebook = queue.pop(0)
                    if left < args.start_margin:
                        results[name(notebook)] = {"notebook": name(notebook), "status": "NOT RUN",
                                                   "error": f"fewer than {args.start_margin:.0f} s of the --deadline were left"}
                        print(line(results[name(notebook)]), flush=True)
                        continue
                    running.append(Job(notebook, flags, min(args.timeout, left), Path(workdir), env))
                    write()
                for job in list(running):
                    if (r := job.poll()) is None: continue
                    running.remove(job); results[r["notebook"]] = r
                    print(line(r), flush=True)
                    if args.log: append_log(args.log, r, job.output)
                    write()
                time.sleep(0.2)
        except KeyboardInterrupt as stopped:                # Ctrl-C or SIGTERM: the notebooks running end as failures
            for job in running: results[name(job.notebook)] = job.stop(f"the run was interrupted ({stopped})")
            running.clear()
        finally:
            for job in running: kill_group(job.proc)       # leave no notebook running, whatever ended the loop
            signal.signal(signal.SIGTERM, previous_handler)
    counts = {s: sum(r["status"] == s for r in results.values()) for s in ("PASS", "FAIL", "NOT RUN")}
    footer = (f"# {counts['PASS']} of {len(order)} notebooks passed, {counts['FAIL']} failed, {counts['NOT RUN']} not run"
              f"{'' if len(results) == len(order) else f', {len(order) - len(results)} never reached'}; "
              f"{time.perf_counter() - t0:.0f} s in all")
    print(footer, flush=True)
    write(footer)
    return 0 if counts["PASS"] == len(order) else 1

if __name__ == "__main__":
    sys.exit(main())
