"""The layout's rules, from the code's own imports and definitions (docs/design.md, "Packages and
modules"): no import circle between modules or packages, at most 10 package floors, mla_runtime
never importing mla_convert, no module over 450 lines and no function over 60 lines or 8
parameters (a Typer command's options are its signature: excepted)."""

import ast
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted(p for pkg in ("mla_convert", "mla_runtime") for p in (ROOT / pkg).rglob("*.py"))
COMMANDS = ROOT / "mla_convert" / "cli"


def _graph() -> dict:
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "import_graph.py"), "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)


def test_no_import_circle_and_at_most_ten_package_floors():
    graph = _graph()
    assert graph["module_circles"] == [] and graph["package_circles"] == []
    # 10: __main__, cli, api, publish and demo (above verification and conversion), ... down to errors
    assert graph["package_floors"] <= 10, graph["packages"]


def test_the_runtime_never_imports_the_converter():
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
    ig = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ig)
    known = ig.modules()
    for name, path in known.items():
        if name.startswith("mla_runtime"):
            assert not {m for m in ig.imports_of(name, path, known) if m.startswith("mla_convert")}, name


def test_modules_and_functions_stay_small():
    too_long, too_big = [], []
    for path in SOURCES:
        text = path.read_text()
        rel = path.relative_to(ROOT)
        if len(text.splitlines()) > 450:
            too_long.append(f"{rel}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            a = node.args
            params = [*a.posonlyargs, *a.args, *a.kwonlyargs] + [x for x in (a.vararg, a.kwarg) if x]
            params = [p for p in params if p.arg not in ("self", "cls")]
            lines = node.end_lineno - node.lineno + 1
            command = path.parent == COMMANDS and path.name.endswith("_cmd.py") and node.col_offset == 0
            if lines > 60 or (len(params) > 8 and not command):
                too_big.append(f"{rel}:{node.lineno} {node.name}: {lines} lines, {len(params)} parameters")
    assert not too_long, too_long
    assert not too_big, too_big
