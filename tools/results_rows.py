"""The rows of benchmarks/results/*.jsonl that the project cites, and those it no longer does.

    python tools/results_rows.py            # each results file: its rows by commit, cited or not
    python tools/results_rows.py --check    # exit 1 where a file holds rows of a commit nothing cites
    python tools/results_rows.py --prune    # delete those rows (git history keeps them)

A results file holds the current numbers and the evidence of the decisions they justified, each row with its `git_sha`.
A row is cited when its commit (7 hex digits) is named in the READMEs, the notebooks, the scripts, the library, the
tests, the benchmarks or the results files' own text records. A new measurement supersedes the rows it replaces: cite the
new rows, then `--prune` deletes the old ones instead of letting the file become a log.
"""
from __future__ import annotations

import argparse, json, sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SHA_CHARS = 7                          # how the project names a commit
CITING = ("README.md", "benchmarks/README.md", "benchmarks/*.py", "benchmarks/results/*.txt", "nbs/**/*.ipynb",
          "scripts/*", "jetrl/**/*.py", "tests/*.py", "tools/*.py")


def citing_text() -> str:
    "Every text that may name a results row's commit."
    paths = {p for pattern in CITING for p in ROOT.glob(pattern) if p.is_file() and p.resolve() != Path(__file__).resolve()}
    return "\n".join(p.read_text(errors="ignore") for p in sorted(paths))


def rows_of(path: Path) -> list[tuple[str, dict | None]]:
    "The file's lines with their parsed rows (None for a line that is not a JSON object: always kept)."
    out = []
    for line in path.read_text().splitlines():
        if not line.strip(): continue
        try: row = json.loads(line)
        except json.JSONDecodeError: row = None
        out.append((line, row if isinstance(row, dict) else None))
    return out


def commit_of(row: dict | None) -> str | None:
    sha = (row or {}).get("git_sha")
    return str(sha)[:SHA_CHARS] if sha else None


def stale(row: dict | None, text: str) -> bool:
    "Whether a row names a commit that `text` does not (a row without a commit is never stale)."
    return (c := commit_of(row)) is not None and c not in text


def uncited(text: str) -> dict[Path, Counter]:
    "Per results file, the rows of each commit that `text` does not name (rows without a commit are always kept)."
    found = {}
    for path in sorted(RESULTS.rglob("*.jsonl")):
        counts = Counter(commit_of(row) for _, row in rows_of(path) if stale(row, text))
        if counts: found[path] = counts
    return found


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1 where a file holds rows of a commit nothing cites")
    mode.add_argument("--prune", action="store_true", help="delete the rows of commits nothing cites")
    args = p.parse_args(argv)
    text = citing_text()
    found = uncited(text)
    if args.prune:
        for path, counts in found.items():
            path.write_text("".join(line + "\n" for line, row in rows_of(path) if not stale(row, text)))
            print(f"{path.relative_to(ROOT)}: {sum(counts.values())} rows of {len(counts)} uncited commits deleted")
        return 0
    if not args.check:
        for path in sorted(RESULTS.rglob("*.jsonl")):
            counts = Counter(commit_of(row) for _, row in rows_of(path))
            print(f"{path.relative_to(ROOT)}: " + ", ".join(
                f"{c or 'no commit'} {n}{'' if c is None or c in text else ' (uncited)'}" for c, n in counts.items()))
    for path, counts in found.items():
        print(f"{path.relative_to(ROOT)} holds rows of commits nothing cites: "
              + ", ".join(f"{c} ({n} rows)" for c, n in counts.items())
              + ". Cite the ones that still stand for something, or delete them: python tools/results_rows.py --prune")
    return 1 if args.check and found else 0


if __name__ == "__main__":
    sys.exit(main())
