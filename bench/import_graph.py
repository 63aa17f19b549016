"""The import graph of the pvegpu package: modules, import edges, levels (the longest chain of imports) and cycles.

Usage: python3 bench/import_graph.py [CHECKOUT] [--folders]

Every import is counted wherever it stands (a function's lazy import is still a dependency), except those under
``if TYPE_CHECKING:`` (types only, never run). ``--folders`` collapses ``adapters/``, ``sim/`` and ``reset/`` into one
node each, as a reader of the tree sees them. Compare two releases: ``git worktree add /tmp/old <commit>``, then run
this on both.
"""

from __future__ import annotations

import ast
import os
import sys


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    out: list[ast.Import | ast.ImportFrom] = []

    def walk(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and isinstance(child.test, ast.Name) and child.test.id == "TYPE_CHECKING":
                for n in child.orelse:
                    walk(n)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                out.append(child)
            walk(child)

    walk(tree)
    return out


def graph(root: str, folders: bool = False) -> dict[str, set[str]]:
    mods: dict[str, tuple[str, bool]] = {}
    for d, _dirs, files in os.walk(os.path.join(root, "pvegpu")):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(d, f), root)[:-3].replace(os.sep, ".")
                mods[rel.removesuffix(".__init__")] = (os.path.join(d, f), f == "__init__.py")

    def node(m: str) -> str:
        parts = m.split(".")
        return ".".join(parts[:2]) if folders and len(parts) > 2 and parts[1] in ("adapters", "sim", "reset") else m

    edges: dict[str, set[str]] = {}
    for name, (path, init) in mods.items():
        package = name if init else name.rpartition(".")[0]
        deps: set[str] = set()
        for imp in _imports(ast.parse(open(path, encoding="utf-8").read())):
            if isinstance(imp, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - imp.level + 1] if imp.level else []
                target = ".".join(base + ([imp.module] if imp.module else [])) if imp.level else imp.module or ""
                deps.update(f"{target}.{a.name}" if f"{target}.{a.name}" in mods else target for a in imp.names)
            else:
                deps.update(a.name for a in imp.names)
        edges.setdefault(node(name), set()).update(node(d) for d in deps if d in mods)
    for k in edges:
        edges[k].discard(k)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    color: dict[str, int] = {}
    found: list[list[str]] = []

    def dfs(m: str, stack: list[str]) -> None:
        color[m] = 1
        stack.append(m)
        for d in sorted(edges.get(m, ())):
            if color.get(d) == 1:
                found.append(stack[stack.index(d):] + [d])
            elif d not in color:
                dfs(d, stack)
        stack.pop()
        color[m] = 2

    for m in sorted(edges):
        if m not in color:
            dfs(m, [])
    return found


def levels(edges: dict[str, set[str]]) -> int:
    memo: dict[str, int] = {}

    def depth(m: str, seen: frozenset[str]) -> int:
        if m in memo:
            return memo[m]
        v = 1 + max((depth(d, seen | {m}) for d in edges.get(m, ()) if d not in seen), default=0)
        memo[m] = v
        return v

    return max(depth(m, frozenset()) for m in edges)


def main(argv: list[str]) -> int:
    args = [a for a in argv if not a.startswith("--")]
    e = graph(args[0] if args else ".", folders="--folders" in argv)
    cyc = cycles(e)
    print(f"nodes {len(e)}, import edges {sum(map(len, e.values()))}, levels {levels(e)}, cycles {len(cyc)}")
    for c in cyc:
        print("  cycle: " + " -> ".join(c))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
