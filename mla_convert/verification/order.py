"""The order in which verify reads a converted directory's files. No torch here: the CLI uses it
to start reading those files while Python imports torch."""

from __future__ import annotations

import json
import os
from pathlib import Path

from mla_convert.constants import MANIFEST_NAME
from mla_convert.process import threads

WORKERS_MAX = 8  # the most worker processes --workers chooses by itself


def file_threads() -> int:
    """Files one process verifies at once. Each file's sha256 runs on a thread of its own while its
    bytes are read and checked, so one file already keeps two cores busy; a second file at once pays
    read buffers of its own (fresh memory, page faults) and gains only where cores are spare."""
    return 1 if threads.cores() <= 2 else 2


def default_workers() -> int:
    """verify's --workers when none is given: a process (one file at a time, its sha256 on a second
    thread) for every two cores, at most WORKERS_MAX; 1 on a 2-core host."""
    return max(1, min(WORKERS_MAX, threads.cores() // 2))


def files_at_once(workers: int) -> int:
    return workers if workers > 1 else file_threads()


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
