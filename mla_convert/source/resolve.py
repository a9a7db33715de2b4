"""Resolve SOURCE: a local checkpoint directory, or a Hub repo id through huggingface_hub.

Two ways in. `resolve_source` gives a local directory to read (a Hub source downloaded into the
cache and checked). `open_planned_source` opens a source from its headers only, for planning: a
local directory as it is, a Hub source by its file list and range requests for every shard's
header, with its small files staged in a temporary directory; nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Callable
from pathlib import Path

from mla_convert.errors import ConvertError, SourceError
from mla_convert.settings import is_repo_id
from mla_convert.source import hub
from mla_convert.source.checkpoint import SourceCheckpoint, open_source


def is_hub_source(source: str) -> bool:
    """A Hub repo id that is not also an existing local path."""
    return not Path(source).expanduser().exists() and is_repo_id(source)


def resolve_source(source: str, revision: str | None = None) -> Path:
    """Local directory as is. A Hub repo id: download (or reuse the cache) and check every shard's
    size and sha256 against the Hub's list first; offline, the cached snapshot as is."""
    path = Path(source).expanduser()
    if path.exists():
        if not path.is_dir():
            raise SourceError(f"{source}: not a directory; SOURCE is a checkpoint directory or a Hub repo id")
        return path
    if not is_repo_id(source):
        raise SourceError(f"{source}: no such directory, and not a Hub repo id (owner/name)")
    if hub.offline():
        with _nor_a_directory(source):
            return hub.cached_snapshot(source, revision)
    # Snapshot by the user's ref (so the cache records it for offline use), then list exactly the
    # commit the snapshot resolved to: files and checksums cannot come from two commits.
    with _nor_a_directory(source):
        root = hub.snapshot_ref(source, revision)
    repo = hub.list_repo(source, root.name)
    hub.check_snapshot(repo, root, sorted(f for f in repo.files if f.endswith(".safetensors")))
    return root


def open_planned_source(
    source: str,
    revision: str | None,
    stream: bool,
    cleanup: contextlib.ExitStack,
    status: Callable[[str], None],
) -> tuple[SourceCheckpoint, hub.HubRepo | None]:
    """The source checkpoint from its headers, and its Hub repo when only its headers are here.

    A Hub source (online) is read from its file list and shard headers by range requests, its
    small files staged in a temporary directory that `cleanup` removes; a local one (or, offline,
    the cached snapshot) is opened where it is."""
    if stream and not is_hub_source(source):
        raise ConvertError(f"--stream needs a Hub repo id; {source!r} is a local directory")
    if not is_hub_source(source) or hub.offline():
        if stream:
            raise ConvertError("--stream downloads shards as it goes; it cannot run with HF_HUB_OFFLINE=1")
        status(f"reading the headers of {source}")
        return open_source(resolve_source(source, revision)), None
    status(f"reading the file list and shard headers of {source} on the Hub")
    with _nor_a_directory(source):
        repo = hub.list_repo(source, revision)
    temporary = tempfile.TemporaryDirectory(prefix="mla-convert-plan-", ignore_cleanup_errors=True)
    staging = Path(cleanup.enter_context(temporary))
    return open_source(staging, remote_headers=hub.prepare_staging(repo, staging)), repo


@contextlib.contextmanager
def _nor_a_directory(source: str):
    """A SOURCE spelt OWNER/NAME that is no local directory and that the Hub cannot give: the
    refusal says both, where the user may have meant a directory (its first part is one here, as in
    a mistyped `data/DeepSeek-R1`) or the Hub has no such repo; else the Hub's reason alone."""
    try:
        yield
    except SourceError as e:
        from huggingface_hub import errors

        first = Path(source).expanduser().parts[0]
        if not (Path(first).is_dir() or isinstance(e.__cause__, errors.RepositoryNotFoundError)):
            raise
        reason = str(e).removeprefix(f"{source}: ")
        where = Path(source).expanduser().absolute()
        raise SourceError(f"{source}: no such directory ({where}), and as a Hub repo id: {reason}") from e
