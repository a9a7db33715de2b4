"""The order in which verify reads a converted directory's files. No torch here: the CLI uses it
to start reading those files while Python imports torch."""

from __future__ import annotations

import json
import os
from pathlib import Path

from mla_convert.constants import MANIFEST_NAME

FILE_THREADS = 2  # files verified at once in one process (sha256 of a file runs on one core)


def files_at_once(workers: int) -> int:
    return workers if workers > 1 else FILE_THREADS


def largest_first(sizes: dict[str, int]) -> list[str]:
    """Biggest first, so one large file does not start last; ties keep the given order."""
    return sorted(sizes, key=lambda rel: -sizes[rel])


def first_files(out_dir: Path, workers: int) -> list[Path]:
    """The files verify starts with, from the conversion manifest's list; none without one."""
    try:
        listed = json.loads((Path(out_dir) / MANIFEST_NAME).read_text())["files"]
        rels = sorted(listed)
    except (OSError, ValueError, KeyError, TypeError):
        return []
    sizes = {}
    for rel in rels:
        try:
            sizes[rel] = os.stat(Path(out_dir) / rel).st_size
        except (OSError, TypeError):
            pass
    return [Path(out_dir) / rel for rel in largest_first(sizes)[: files_at_once(workers)]]
