"""Resolve SOURCE: a local checkpoint directory, or a Hub repo id through huggingface_hub."""

from __future__ import annotations

import re
from pathlib import Path

from .errors import SourceError

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_hub_source(source: str) -> bool:
    """A Hub repo id that is not also an existing local path."""
    return not Path(source).expanduser().exists() and bool(_REPO_ID.match(source))


def resolve_source(source: str, revision: str | None = None) -> Path:
    """Local directory as is. A Hub repo id: download (or reuse the cache) and check every shard's
    size and sha256 against the Hub's list first; offline, the cached snapshot as is."""
    path = Path(source).expanduser()
    if path.exists():
        if not path.is_dir():
            raise SourceError(f"{source}: not a directory; SOURCE is a checkpoint directory or a Hub repo id")
        return path
    if not _REPO_ID.match(source):
        raise SourceError(f"{source}: no such directory, and not a Hub repo id (owner/name)")
    from . import hub

    if hub.offline():
        return hub.cached_snapshot(source, revision)
    # Snapshot by the user's ref (so the cache records it for offline use), then list exactly the
    # commit the snapshot resolved to: files and checksums cannot come from two commits.
    root = hub.snapshot_ref(source, revision)
    repo = hub.list_repo(source, root.name)
    hub.check_snapshot(repo, root, sorted(f for f in repo.files if f.endswith(".safetensors")))
    return root
