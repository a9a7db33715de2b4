"""scripts/module_map.py, the generated module map (docs/design.md points at it instead of listing
files): it names every module and package of mla_convert and mla_runtime with its docstring's first
sentence, and it fails, naming the module, where a module has no docstring."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "module_map.py"


def run_map(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def dotted_names(root: Path) -> set[str]:
    # Found here from the files, apart from the script's own walk, so that the two are compared.
    names = set()
    for package in ("mla_convert", "mla_runtime"):
        for path in (root / package).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            names.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def test_the_map_names_every_module_and_package_with_its_docstring():
    r = run_map()
    assert r.returncode == 0, r.stderr
    listed = set()
    for line in r.stdout.splitlines():
        if line.startswith("#") and "`" in line:  # a package's heading: its full name
            listed.add(line.split("`")[1])
            package = line.split("`")[1]
        elif line.startswith("- `"):  # a module of the package above: its last name, then its summary
            name, _, said = line[3:].partition("`: ")
            listed.add(f"{package}.{name}")
            assert said and said != "(no docstring)", line
    assert listed == dotted_names(ROOT)
    assert "- `plugin`: vLLM general plugin: MLA attention layers take W_UK_T / W_UV from mla-convert's artifacts." in (
        r.stdout.splitlines()
    )


def test_a_module_without_a_docstring_fails_the_map_naming_it(tmp_path):
    for package in ("mla_convert", "mla_runtime"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text(f'"""The {package} package. More here."""\n')
    (tmp_path / "mla_convert" / "said.py").write_text('"""Says what it owns, e.g. this. And more."""\nX = 1\n')
    (tmp_path / "mla_convert" / "bare.py").write_text("# a comment is no docstring\nX = 1\n")
    r = run_map("--root", str(tmp_path))
    assert r.returncode == 1
    assert "mla_convert.bare" in r.stderr and "said" not in r.stderr
    assert "- `said`: Says what it owns, e.g. this." in r.stdout.splitlines()
    assert "- `bare`: (no docstring)" in r.stdout.splitlines()
