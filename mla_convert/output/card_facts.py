"""What the model card (output.card) says about a conversion: where the source came from
(`SourceRef`, which the conversion manifest records too) and the conversion's facts (`CardFacts`,
gathered by conversion.finalize from the plan)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class SourceRef:
    """Where the source came from: a Hub repo at one commit, or a local directory."""

    repo_id: str | None = None
    revision: str | None = None  # the commit, where known
    path: str | None = None  # a local directory not known to be a Hub snapshot

    @property
    def base_model(self) -> str:
        """What the card's `base_model` names: the Hub id (what the Hub links to), else the path."""
        return self.repo_id or self.path or ""

    def label(self) -> str:
        if self.repo_id is None:
            return self.path or ""
        return f"{self.repo_id}@{self.revision}" if self.revision else self.repo_id

    def as_dict(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, record) -> SourceRef:
        record = record if isinstance(record, dict) else {}
        return cls(**{k: record[k] for k in ("repo_id", "revision", "path") if isinstance(record.get(k), str)})


def source_ref(root: Path, repo_id: str | None = None, commit: str | None = None) -> SourceRef:
    """The source as the card and the manifest name it: the Hub repo and commit it was planned
    from; a directory of the Hub cache (models--OWNER--NAME/snapshots/COMMIT: a Hub source read
    offline, or given by its cache path); else the directory's absolute path."""
    if repo_id is not None:
        return SourceRef(repo_id=repo_id, revision=commit)
    root = Path(root).absolute()
    snapshots, repo_dir = root.parent, root.parent.parent
    if snapshots.name == "snapshots" and repo_dir.name.startswith("models--") and "--" in repo_dir.name[8:]:
        return SourceRef(repo_id=repo_dir.name[len("models--") :].replace("--", "/"), revision=root.name)
    return SourceRef(path=str(root))


@dataclass(frozen=True)
class CardFacts:
    """What the card says about the conversion (conversion.finalize gathers it from the plan)."""

    source: SourceRef
    fingerprint: str
    version: str
    format: str
    target: str
    fp8_max: float
    ignore: tuple[str, ...]
    architecture: str
    model_type: str
    layers: int
    mtp_layers: int
    heads: int
    mla_layers: int
    shards: int
    tensors: int
    model_bytes: int
    mla_bytes: int
    ignored_modules: int
