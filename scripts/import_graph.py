#!/usr/bin/env python
"""The import graph of mla_convert and mla_runtime, from the code's own imports (every `import`
and `from ... import`, at module level or inside a function; none is run).

A module stands one floor above everything it imports (floor 1 imports nothing of the project).
Prints the floors, module by module and package by package (a subpackage, or a top-level module,
is one unit; mla_runtime is one unit), and every import circle; `--json` for scripts.

    python scripts/import_graph.py            # floors and circles
    python scripts/import_graph.py --json
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("mla_convert", "mla_runtime")


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules `name` imports (a `from package import name` of a submodule counts as an
    import of that submodule)."""
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in known else module for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # `import a.b.c` imports a.b.c (and its packages)
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def unit_of(module: str) -> str:
    """The package-level unit: mla_runtime, a subpackage of mla_convert, or a top-level module."""
    parts = module.split(".")
    if parts[0] == "mla_runtime":
        return "mla_runtime/"
    if len(parts) == 1:
        return "mla_convert/__init__.py"
    return "mla_convert/" + parts[1] + ("/" if (ROOT / "mla_convert" / parts[1]).is_dir() else ".py")


def floors(graph: dict[str, set[str]]) -> tuple[dict[str, int], list[list[str]]]:
    """Each node's floor, and the circles (strongly connected components of more than one node;
    their nodes share one floor)."""
    index, low, stack, on, comps, counter = {}, {}, [], set(), [], [0]

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            comps.append(comp)

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    comp_of = {v: i for i, c in enumerate(comps) for v in c}
    floor: dict[int, int] = {}
    for i, comp in enumerate(comps):  # Tarjan emits components in reverse topological order
        below = [floor[comp_of[w]] for v in comp for w in graph[v] if comp_of[w] != i]
        floor[i] = 1 + max(below, default=0)
    return {v: floor[comp_of[v]] for v in graph}, sorted(sorted(c) for c in comps if len(c) > 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args()
    known = modules()
    graph = {m: imports_of(m, p, known) for m, p in known.items()}
    module_floor, module_circles = floors(graph)
    units = {unit_of(m) for m in graph}
    unit_graph = {u: set() for u in units}
    for m, deps in graph.items():
        unit_graph[unit_of(m)] |= {unit_of(d) for d in deps if unit_of(d) != unit_of(m)}
    unit_floor, unit_circles = floors(unit_graph)
    result = {
        "module_floors": max(module_floor.values()),
        "module_circles": module_circles,
        "package_floors": max(unit_floor.values()),
        "package_circles": unit_circles,
        "modules": dict(sorted(module_floor.items(), key=lambda kv: (-kv[1], kv[0]))),
        "packages": dict(sorted(unit_floor.items(), key=lambda kv: (-kv[1], kv[0]))),
        "lines": {m: len(p.read_text().splitlines()) for m, p in known.items()},
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    for title, key, circles in (("packages", "packages", unit_circles), ("modules", "modules", module_circles)):
        print(f"{title}: {result[title[:-1] + '_floors']} floors, {len(circles)} circle(s)")
        by_floor: dict[int, list[str]] = {}
        for name, f in result[key].items():
            by_floor.setdefault(f, []).append(name)
        for f in sorted(by_floor, reverse=True):
            print(f"  floor {f:2d}: {', '.join(sorted(by_floor[f]))}")
        for c in circles:
            print(f"  circle: {' -> '.join(c)}")


if __name__ == "__main__":
    main()
