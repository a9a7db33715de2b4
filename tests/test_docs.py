"""The docs a reader follows: the README stays a user's page of at most 260 lines, and every place
that points into docs/design.md (a `design.md#anchor` link in the README, the docs or the code, or a
docstring's `docs/design.md, "Section"`) names a section design.md has, so that a rewrite of the
architecture page cannot leave a dangling pointer."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DESIGN = ROOT / "docs" / "design.md"
README_MAX_LINES = 260


def slug(heading: str) -> str:
    """A Markdown heading's anchor, as GitHub makes it."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def sources() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
    for package in ("mla_convert", "mla_runtime", "scripts", "tests"):
        files += sorted((ROOT / package).rglob("*.py"))
    return [f for f in files if f != Path(__file__).resolve()]


def test_the_readme_is_at_most_260_lines():
    assert len((ROOT / "README.md").read_text().splitlines()) <= README_MAX_LINES


def test_every_pointer_into_design_md_names_one_of_its_sections():
    headings = [line.lstrip("#").strip() for line in DESIGN.read_text().splitlines() if line.startswith("#")]
    anchors, titles = {slug(h) for h in headings}, set(headings)
    found, dangling = 0, []
    for path in sources():
        text = path.read_text()
        for anchor in re.findall(r"design\.md#([\w-]+)", text):
            found += 1
            if anchor not in anchors:
                dangling.append(f"{path.relative_to(ROOT)}: #{anchor}")
        for title in re.findall(r'docs/design\.md, "([^"]+)"', " ".join(text.split())):
            found += 1
            if title not in titles:
                dangling.append(f'{path.relative_to(ROOT)}: "{title}"')
    assert found >= 5  # the README's two links and the docstrings' section names, at least
    assert not dangling, dangling
