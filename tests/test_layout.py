"""The layout's rules, from the code's own imports (docs/design.md, "Packages and modules"): no
import circle between modules or packages; every package imports only the layers declared below
it (nothing runs back up, nothing sideways); mla_runtime never imports mla_convert; the public API
is the one docs/api.md describes. No caps on sizes or counts: a module stays small because it owns
one thing, and a new layer is one line in LAYERS."""

import importlib.util
import inspect
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Top to bottom. A package may import the packages of any layer below its own, never one of its
# own layer or above. Adding a layer (or a package to one) is a decision made here, in review.
LAYERS = [
    {"mla_convert/__main__.py"},
    {"mla_convert/__init__.py", "mla_convert/cli/"},
    {"mla_convert/api.py"},
    {"mla_convert/demo/", "mla_convert/publish/"},
    {"mla_convert/conversion/", "mla_convert/verification/"},
    {"mla_convert/plan/"},
    {"mla_convert/kernels/", "mla_convert/output/", "mla_convert/source/"},
    {"mla_convert/envs.py", "mla_convert/io/", "mla_convert/settings.py"},
    {"mla_convert/formats/"},
    {"mla_convert/constants.py"},
    {
        "mla_convert/errors.py",
        "mla_convert/process/",
        "mla_convert/registry.py",
        "mla_convert/results.py",
        "mla_convert/units.py",
        "mla_convert/version.py",
        "mla_runtime/",
    },
]


def _import_graph():
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
    ig = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ig)
    known = ig.modules()
    return ig, {name: ig.imports_of(name, path, known) for name, path in known.items()}


def test_no_import_circle_between_modules_or_packages():
    ig, graph = _import_graph()
    _, module_circles = ig.floors(graph)
    units = {ig.unit_of(m) for m in graph}
    unit_graph = {u: set() for u in units}
    for m, deps in graph.items():
        unit_graph[ig.unit_of(m)] |= {ig.unit_of(d) for d in deps if ig.unit_of(d) != ig.unit_of(m)}
    _, unit_circles = ig.floors(unit_graph)
    assert module_circles == [] and unit_circles == []


def test_every_package_imports_only_the_layers_below_it():
    ig, graph = _import_graph()
    layer_of = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}
    units = {ig.unit_of(m) for m in graph}
    assert units <= set(layer_of), f"packages missing from LAYERS: {sorted(units - set(layer_of))}"
    upward = sorted(
        f"{m} imports {d}"
        for m, deps in graph.items()
        for d in deps
        if ig.unit_of(d) != ig.unit_of(m) and layer_of[ig.unit_of(d)] <= layer_of[ig.unit_of(m)]
    )
    assert not upward, upward


def test_the_runtime_never_imports_the_converter():
    _, graph = _import_graph()
    for name, deps in graph.items():
        if name.startswith("mla_runtime"):
            assert not {m for m in deps if m.startswith("mla_convert")}, name


def test_the_public_api_is_keyword_only_past_its_positional_arguments():
    # docs/api.md: convert(source, out_dir, *, ...), verify(out_dir, *, ...), upload(out_dir, repo_id, *, ...)
    import mla_convert

    positional = {"convert": ["source", "out_dir"], "verify": ["out_dir"], "upload": ["out_dir", "repo_id"]}
    for name, expected in positional.items():
        params = inspect.signature(getattr(mla_convert, name)).parameters.values()
        assert [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD] == expected, name
        assert all(p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY, p.VAR_KEYWORD) for p in params), name
    assert {"convert", "verify", "upload"} <= set(mla_convert.__all__)


def test_importing_the_package_imports_no_torch():
    code = "import sys, mla_convert, mla_runtime.plugin; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "False"


def test_the_command_line_imports_no_command_s_machinery_before_it_runs():
    """Loading the CLI (every command is registered at start-up) imports none of verify's checks,
    the converter's pipeline or the Hub code: a command pays for its own, and verify's read-ahead
    starts before them."""
    code = (
        "import sys, mla_convert.cli.app; "
        "print(sorted(m for m in sys.modules if m.startswith(('mla_convert.verification.', "
        "'mla_convert.conversion.', 'mla_convert.publish.', 'mla_convert.source.hub'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() in ("[]", "['mla_convert.verification.order']"), out.stdout


def test_no_global_statement_in_the_product():
    # A run's state belongs to its owner (process.resources) and the plugin's to mla_runtime.serving;
    # a process setting is an attribute of one owning object, never a rebound module variable.
    import ast

    found = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for package in ("mla_convert", "mla_runtime")
        for path in sorted((ROOT / package).rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Global)
    ]
    assert not found, found


def test_no_test_module_imports_another_test_module():
    # What tests share lives in tests/support (its __init__ says where); a test module imported by
    # another runs its module-level code, and its fixtures, twice and couples the two files.
    import ast

    tests = ROOT / "tests"
    test_modules = {p.stem for p in tests.glob("test_*.py")} | {"conftest"}
    found = []
    for path in sorted(tests.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif (  # importlib.import_module("test_x") / __import__("test_x")
                isinstance(node, ast.Call)
                and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__")
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                names = [node.args[0].value]
            else:
                continue
            for name in names:
                parts = name.split(".")
                if parts[0] in test_modules or (parts[0] == "tests" and len(parts) > 1 and parts[1] in test_modules):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {name}")
    assert not found, found
