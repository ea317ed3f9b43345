"""Write README.md from nbs/index.ipynb (nbdev-readme needs quarto, which PyPI does not carry).

    python tools/make_readme.py          # rewrite README.md
    python tools/make_readme.py --check  # exit 1 if README.md is out of date
"""
import json, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def render(notebook: Path) -> str:
    "Markdown cells as they are, code cells as python blocks; cells starting with '#| hide' are left out."
    parts = []
    for cell in json.loads(notebook.read_text())["cells"]:
        source = "".join(cell["source"]).strip()
        if not source or source.startswith("#| hide"): continue
        if cell["cell_type"] == "markdown": source = source.replace("](images/", "](nbs/images/")   # paths from the root
        parts.append(source if cell["cell_type"] == "markdown" else f"```python\n{source}\n```")
    return ("\n\n".join(parts)
            + "\n\n<!-- Generated from nbs/index.ipynb by tools/make_readme.py: edit the notebook, not this file. -->\n")


def main(argv: list[str]) -> int:
    readme, text = ROOT / "README.md", render(ROOT / "nbs" / "index.ipynb")
    if "--check" in argv:
        if not readme.exists() or readme.read_text() != text:
            print("README.md is out of date with nbs/index.ipynb: run python tools/make_readme.py")
            return 1
        return 0
    readme.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
