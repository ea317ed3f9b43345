"""jetrl's modules as a graph of imports, and the rules the house keeps.

    python tools/import_graph.py            # the graph (module: the jetrl modules it imports), then the checks
    python tools/import_graph.py --check    # exit 1 on a cycle, a module over the size limit, or a jetrl import in a function

Every `import` / `from ... import` of a jetrl module counts, at module level or inside a function: a cycle hidden in a
function is still a cycle. A package (jetrl/kernels/) counts as its modules; `from . import x` in a package's
__init__ counts as importing jetrl.kernels.x.
"""
from __future__ import annotations

import ast, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jetrl"
MAX_MODULE_LINES = 700                 # a module holds one concept: beyond this, split it
GENERATED = {"jetrl._modidx"}          # nbdev's index of the docs, not code anyone reads

def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py")) if module_name(p) not in GENERATED}

def _resolve(node: ast.ImportFrom, here: str, is_package: bool) -> str:
    "The absolute module a `from X import ...` names."
    if not node.level: return node.module or ""
    base = here.split(".") if is_package else here.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))

def imports(path: Path, known: set[str]) -> list[tuple[str, int, bool]]:
    "(imported jetrl module, line, inside a function) for every import of a jetrl module in `path`."
    here, tree = module_name(path), ast.parse(path.read_text(), str(path))
    found = []
    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((a.name, child.lineno, in_function) for a in child.names if a.name in known)
            elif isinstance(child, ast.ImportFrom):
                target = _resolve(child, here, path.name == "__init__.py")
                for a in child.names:                       # `from pkg import sub` imports the submodule
                    sub = f"{target}.{a.name}"
                    if sub in known: found.append((sub, child.lineno, in_function))
                    elif target in known: found.append((target, child.lineno, in_function))
            visit(child, inner)
    visit(tree, False)
    return sorted({(m, line, f) for m, line, f in found if m != here})

def graph() -> tuple[dict[str, set[str]], list[str]]:
    "The import graph, and the jetrl imports made inside functions ('module:line -> imported')."
    mods = modules()
    edges, local = {m: set() for m in mods}, []
    for m, path in mods.items():
        for target, line, in_function in imports(path, set(mods)):
            edges[m].add(target)
            if in_function: local.append(f"{path.relative_to(ROOT)}:{line} imports {target} inside a function")
    return edges, local

def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    "The strongly connected components of more than one module (Tarjan's algorithm): each one a cycle or more."
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]
    def strongconnect(v):
        index[v] = low[v] = counter[0]; counter[0] += 1; stack.append(v); on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index: strongconnect(w); low[v] = min(low[v], low[w])
            elif w in on_stack: low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop(); on_stack.discard(w); component.append(w)
                if w == v: break
            if len(component) > 1: out.append(sorted(component))
    for v in sorted(edges):
        if v not in index: strongconnect(v)
    return out

def problems() -> list[str]:
    "Every broken rule, one line each (empty: the house is in order)."
    edges, local = graph()
    found = [f"import cycle among {' <-> '.join(c)}" for c in cycles(edges)] + local
    for m, path in modules().items():
        n = len(path.read_text().splitlines())
        if n > MAX_MODULE_LINES: found.append(f"{path.relative_to(ROOT)} has {n} lines (at most {MAX_MODULE_LINES}): split it")
    return found

def main(argv: list[str]) -> int:
    if "--check" not in argv:
        edges, _ = graph()
        for m in sorted(edges):
            lines = len(modules()[m].read_text().splitlines())
            print(f"{m} ({lines} lines): {', '.join(sorted(edges[m])) or '-'}")
    found = problems()
    for p in found: print(p)
    if not found: print("0 import cycles, no jetrl import inside a function, no module over "
                        f"{MAX_MODULE_LINES} lines")
    return 1 if found else 0

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
