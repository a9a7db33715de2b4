"""What the model card (output.card) says about a conversion: where the source came from
(`SourceRef`, which the conversion manifest records too) and the conversion's facts (`CardFacts`,
gathered by conversion.finalize from the plan)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class SourceRef:
    """Where the source came from (a Hub repo at one commit, or a local directory), and the Hub
    model the card names as its base."""

    repo_id: str | None = None
    revision: str | None = None  # the commit, where known
    path: str | None = None  # a local directory not known to be a Hub snapshot (the manifest's, never the card's)
    base_model: str | None = None  # a Hub model id, or None: the card then has no base_model

    def label(self) -> str:
        """The source as the card's body names it: never a local path (the card is public)."""
        if self.repo_id is not None:
            return f"{self.repo_id}@{self.revision}" if self.revision else self.repo_id
        return self.base_model or ""

    def as_dict(self) -> dict:
        record = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        return record | {"base_model": self.base_model}  # recorded even when None: not a legacy record

    @classmethod
    def from_dict(cls, record) -> SourceRef:
        record = record if isinstance(record, dict) else {}
        ref = cls(**{k: record[k] for k in ("repo_id", "revision", "path") if isinstance(record.get(k), str)})
        if "base_model" in record:
            base = record["base_model"]
            return dataclasses.replace(ref, base_model=base if isinstance(base, str) else None)
        # Recorded before base_model was: the card named the Hub id, else the path.
        return dataclasses.replace(ref, base_model=ref.repo_id or ref.path)


def source_ref(
    root: Path, repo_id: str | None = None, commit: str | None = None, base_model: str | None = None
) -> SourceRef:
    """The source as the card and the manifest name it: the Hub repo and commit it was planned
    from; a directory of the Hub cache (models--OWNER--NAME/snapshots/COMMIT: a Hub source read
    offline, or given by its cache path); else the directory's absolute path. `base_model` (the
    user's --base-model) is the card's base; else the Hub id, where there is one; else none yet
    (output.card.with_source_card may take the source card's own)."""
    if repo_id is not None:
        return SourceRef(repo_id=repo_id, revision=commit, base_model=base_model or repo_id)
    root = Path(root).absolute()
    snapshots, repo_dir = root.parent, root.parent.parent
    if snapshots.name == "snapshots" and repo_dir.name.startswith("models--") and "--" in repo_dir.name[8:]:
        repo_id = repo_dir.name[len("models--") :].replace("--", "/")
        return SourceRef(repo_id=repo_id, revision=root.name, base_model=base_model or repo_id)
    return SourceRef(path=str(root), base_model=base_model)


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
    config_name: str = "config.json"  # params.json for a member's own layout
    int4_experts: bool = False  # the source's pack-quantized INT4 experts, copied as they are
    repo_id: str | None = None  # the Hub repo the card is written for (upload); None: a local directory
    repo_revision: str | None = None  # its branch, where not main

    def record(self) -> dict:
        """What the conversion manifest keeps of these (all but the source, which it records on its
        own), so that `mla-convert card` can write the card again without the source."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()
                if k != "source"}  # fmt: skip

    @classmethod
    def from_record(cls, record: dict, source: SourceRef) -> CardFacts:
        """The facts as record() kept them; TypeError or KeyError when the record is not one."""
        fields = {f.name for f in dataclasses.fields(cls)} - {"source"}
        values = {k: record[k] for k in fields if k in record}
        for f in dataclasses.fields(cls):  # a damaged record: its values of the types record() writes
            if f.name in values and not _RECORDED_TYPES.get(str(f.type), lambda v: True)(values[f.name]):
                raise TypeError(f"card.{f.name} {str(values[f.name])[:40]!r} is not a {f.type}")
        values["ignore"] = tuple(values.get("ignore") or ())
        return cls(source=source, **values)


def _number(v, kinds) -> bool:
    return isinstance(v, kinds) and not isinstance(v, bool)


_RECORDED_TYPES = {
    "str": lambda v: isinstance(v, str),
    "int": lambda v: _number(v, int),
    "float": lambda v: _number(v, (int, float)),
    "bool": lambda v: isinstance(v, bool),
    "str | None": lambda v: v is None or isinstance(v, str),
    "tuple[str, ...]": lambda v: v is None or (isinstance(v, list) and all(isinstance(x, str) for x in v)),
}
