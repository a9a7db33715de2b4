"""Resolve SOURCE: a local checkpoint directory, or a Hub repo id through huggingface_hub."""

from __future__ import annotations

import re
from pathlib import Path

from .errors import SourceError

DEFAULT_SOURCE = "deepseek-ai/DeepSeek-R1"
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_source(source: str, revision: str | None = None) -> Path:
    """Local directory as is; otherwise a Hub repo id, resolved (cached snapshot or download)."""
    path = Path(source).expanduser()
    if path.exists():
        if not path.is_dir():
            raise SourceError(f"{source}: not a directory; SOURCE is a checkpoint directory or a Hub repo id")
        return path
    if not _REPO_ID.match(source):
        raise SourceError(f"{source}: no such directory, and not a Hub repo id (owner/name)")
    return _hub_snapshot(source, revision)


def _hub_snapshot(repo_id: str, revision: str | None) -> Path:
    import huggingface_hub
    from huggingface_hub import errors

    try:
        return Path(huggingface_hub.snapshot_download(repo_id=repo_id, revision=revision))
    except errors.GatedRepoError:
        raise SourceError(f"{repo_id}: gated repository; accept its terms on the Hub and log in (hf auth login)") from None
    except errors.RepositoryNotFoundError:
        raise SourceError(f"{repo_id}: repository not found on the Hub (or no access: log in with hf auth login)") from None
    except errors.RevisionNotFoundError:
        raise SourceError(f"{repo_id}: revision {revision!r} not found") from None
    except errors.LocalEntryNotFoundError:
        raise SourceError(
            f"{repo_id}: not in the local Hugging Face cache and the Hub cannot be reached "
            "(offline or HF_HUB_OFFLINE=1); download it first or pass a local directory"
        ) from None
    except errors.HfHubHTTPError as e:
        raise SourceError(f"{repo_id}: Hub request failed: {str(e).splitlines()[0]}") from None
