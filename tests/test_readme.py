"""The README stays a user's page: short, with the user's sections, and no project history (dates,
commit hashes, stop or issue numbers). History belongs in commit messages, figures in
docs/benchmarks.md."""

from __future__ import annotations

import re
from pathlib import Path

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()

SECTIONS = [
    "Quick start",
    "Supported checkpoints",
    "Converting a checkpoint",
    "What the output holds",
    "Verifying a conversion",
    "Serving with vLLM",
    "Environment variables",
    "Exit codes",
    "Troubleshooting",
    "How it works",
]

HISTORY = {
    "a date": r"\b20\d\d-\d\d-\d\d\b",
    "a commit hash": r"(?<![\w/.-])(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b",
    "a stop number": r"\b[Ss]top \d+\b",
    "an issue number": r"(?:\b[Ii]ssue\s*#?\d+|(?<![\w/])#\d+\b)",
}


def test_readme_is_at_most_260_lines():
    assert len(README.splitlines()) <= 260


def test_readme_has_the_user_sections_in_order():
    headings = [line[3:].strip() for line in README.splitlines() if line.startswith("## ")]
    assert headings == SECTIONS


def test_readme_carries_no_project_history():
    found = {what: re.findall(pattern, README) for what, pattern in HISTORY.items()}
    assert {what: hits for what, hits in found.items() if hits} == {}


def test_the_history_patterns_catch_what_they_name():
    # the check above is only as good as its patterns
    samples = {
        "a date": "measured 2026-11-30 on machine C",
        "a commit hash": "as of commit 8d32c25, the reader",
        "a stop number": "since stop 9 the writer",
        "an issue number": "the targets of issue #5 and #12",
    }
    for what, text in samples.items():
        assert re.search(HISTORY[what], text), what
    assert not re.search(HISTORY["a commit hash"], "see docs/design.md#gaudi2 and deadbeef-free text")
