"""Where a model served by Hub id lies in the local Hugging Face cache, and what vLLM left out of it.
Standard library only (the plugin does not import huggingface_hub).

vLLM downloads a Hub id into the cache (`<hub cache>/models--ORG--NAME/snapshots/<commit>/`) with
the patterns of its load format: the shards its index names (or, for a model served from
params.json, `consolidated*.safetensors`), and the other files without any `*.safetensors`. So an
mla-convert output's `mla/` directory is never in the snapshot vLLM makes; the plugin then names
the exact command that fetches it (it downloads nothing itself). The cache is found as
huggingface_hub finds it: $HF_HUB_CACHE, else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub,
else ~/.cache/huggingface/hub.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from .format import MLA_DIR_NAME

_COMMIT = re.compile(r"^[0-9a-f]{40}$")
# A Hub repo id, OWNER/NAME (huggingface_hub's rules, owner required): the one pattern of both
# packages (mla_convert.settings.is_repo_id adds the length and `--` / `..` rules).
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def hub_cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path("~/.cache").expanduser())
    return Path(xdg) / "huggingface" / "hub"


@dataclass(frozen=True)
class Snapshot:
    repo_id: str
    commit: str
    path: Path

    @property
    def cache_dir(self) -> Path:
        return self.path.parent.parent.parent  # <cache>/models--ORG--NAME/snapshots/<commit>

    def fetch_command(self) -> str:
        """The command that puts the repo's `mla/` into this snapshot (as `hf download` does: blobs
        and links in the same cache, at this snapshot's commit)."""
        return (
            f"hf download {shlex.quote(self.repo_id)} --revision {self.commit} "
            f"--include '{MLA_DIR_NAME}/*' --cache-dir {shlex.quote(str(self.cache_dir))}"
        )


def snapshot_of(repo_id: str, revision: str | None = None) -> Snapshot | None:
    """The cached snapshot of `repo_id` at `revision` (a branch, tag or commit; default main)."""
    if not REPO_ID.match(repo_id or ""):
        return None
    repo_dir = hub_cache_dir() / ("models--" + repo_id.replace("/", "--"))
    rev = revision or "main"
    commit = rev if _COMMIT.match(rev) else None
    if commit is None:
        try:
            commit = (repo_dir / "refs" / rev).read_bytes().decode("ascii").strip()
        except (OSError, UnicodeDecodeError):  # no such ref, or a damaged one: no snapshot known
            return None
    path = repo_dir / "snapshots" / commit
    return Snapshot(repo_id, commit, path) if _COMMIT.match(commit) and path.is_dir() else None


def snapshot_at(path: Path) -> Snapshot | None:
    """The snapshot a directory is, when it has the cache's layout (.../models--ORG--NAME/snapshots/C)."""
    path = Path(path)
    repo, snapshots = path.parent.parent.name, path.parent.name
    if snapshots != "snapshots" or not repo.startswith("models--") or not _COMMIT.match(path.name):
        return None
    parts = repo[len("models--") :].split("--")
    if len(parts) != 2:
        return None
    return Snapshot("/".join(parts), path.name, path)


def lacks_artifacts(path: Path) -> bool:
    """A snapshot whose `mla/` holds no layer file: what vLLM's own download of an mla-convert
    output leaves (no `mla/`, or, where it took every `*.json`, `mla/manifest.json` alone)."""
    return not any((Path(path) / MLA_DIR_NAME).glob("*.safetensors"))
