"""The output's model card, README.md: what the converted checkpoint is, for the Hub and its reader.

The metadata goes through huggingface_hub's `ModelCardData`, the Hub's model-card schema: the
base model (the source's Hub id, else its path), `base_model_relation: quantized` for channel FP8,
the source card's license, library and pipeline tag, the tags, and the card's own entry
(CARD_METADATA_KEY: version, format, target, source revision and fingerprint), which verify
compares with the manifest (`card_identity` against `recorded_identity`). The body
(output.card_text) says what was converted and how, what the MLA artifacts give, how to serve it,
what verify checks and what was not verified; the source's card follows, unchanged, under a
heading of its own.

Nothing here touches the network: a card is built from a string (never `ModelCard.load` of a
name, which downloads) and never validated against the Hub (`ModelCard.validate` posts to it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mla_convert.constants import CARD_METADATA_KEY, CARD_NAME, CHANNEL_FP8, TOOL_NAME
from mla_convert.errors import OutputError, SourceError
from mla_convert.io.files import WrittenFile, write_bytes_atomic
from mla_convert.output import card_text
from mla_convert.output.card_facts import CardFacts, SourceRef
from mla_convert.output.manifest import read_manifest, write_manifest
from mla_convert.results import VerifyReport

# What the card takes from the source card's metadata, as it is there.
SOURCE_METADATA = ("license", "license_name", "license_link", "library_name", "pipeline_tag")
QUANTIZED = "quantized"  # the Hub's base_model_relation for a quantized derivative


@dataclass(frozen=True)
class SourceCard:
    metadata: dict
    text: str  # the body, its front matter taken off (the whole file where that does not parse)


def read_source_card(path: Path) -> SourceCard:
    """The source's README.md: its metadata and its body. A front matter that does not parse is no
    reason to stop a conversion: the card then keeps that file whole and takes no metadata from it."""
    import yaml
    from huggingface_hub import ModelCard
    from huggingface_hub.repocard import REGEX_YAML_BLOCK

    try:
        text = path.read_bytes().decode("utf-8-sig", errors="replace")
    except OSError as e:
        raise SourceError(f"{path}: cannot read the source's model card ({e.strerror or e})") from e
    if REGEX_YAML_BLOCK.search(text) is None:  # ModelCard would warn about it on stderr
        return SourceCard({}, text)
    try:
        card = ModelCard(text, ignore_metadata_errors=True)
    except (ValueError, TypeError, yaml.YAMLError):
        return SourceCard({}, text)
    return SourceCard(card.data.to_dict(), card.text)


def _relation(fmt: str) -> str | None:
    return QUANTIZED if fmt == CHANNEL_FP8 else None


def format_tags(fmt: str) -> list[str]:
    return ["fp8", "compressed-tensors"] if fmt == CHANNEL_FP8 else ["bf16"]


def card_metadata(facts: CardFacts, source: SourceCard | None):
    """The card's metadata as a huggingface_hub ModelCardData."""
    from huggingface_hub import ModelCardData

    meta = source.metadata if source is not None else {}
    own = {
        "version": facts.version,
        "format": facts.format,
        "target": facts.target,
        "ignore": list(facts.ignore),
        "source_revision": facts.source.revision,
        "source_fingerprint": facts.fingerprint,
    }
    return ModelCardData(
        base_model=facts.source.base_model,
        tags=[*format_tags(facts.format), "gaudi", TOOL_NAME, facts.model_type],
        **{k: meta[k] for k in SOURCE_METADATA if isinstance(meta.get(k), str)},
        base_model_relation=_relation(facts.format),
        **{CARD_METADATA_KEY: {k: v for k, v in own.items() if v is not None}},
    )


def build_card(facts: CardFacts, source: SourceCard | None) -> str:
    """The whole README.md: metadata, then the body, then the source's card."""
    from huggingface_hub import ModelCard

    data = card_metadata(facts, source)
    body = card_text.body(facts, source.text if source is not None else None)
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body}"))


def write_card(out_dir: Path, facts: CardFacts, source_card: Path | None) -> WrittenFile:
    """README.md in `out_dir`, written atomically; `source_card`: the source's README.md, if any."""
    source = read_source_card(source_card) if source_card is not None else None
    return write_bytes_atomic(Path(out_dir) / CARD_NAME, build_card(facts, source).encode())


# --- what verify checks ---------------------------------------------------------------------------


def card_identity(metadata: dict) -> dict:
    """What the card's metadata says the checkpoint is: the fields verify compares with the manifest."""
    own = metadata.get(CARD_METADATA_KEY)
    own = own if isinstance(own, dict) else {}
    return {
        "base_model": metadata.get("base_model"),
        "base_model_relation": metadata.get("base_model_relation"),
        "format": own.get("format"),
        "target": own.get("target"),
        "source_revision": own.get("source_revision"),
        "source_fingerprint": own.get("source_fingerprint"),
    }


def recorded_identity(manifest: dict) -> dict:
    """The same fields as the conversion manifest records them."""
    options = manifest.get("options") if isinstance(manifest.get("options"), dict) else {}
    source = SourceRef.from_dict(manifest.get("source"))
    fmt = options.get("format")
    return {
        "base_model": source.base_model or None,
        "base_model_relation": _relation(fmt),
        "format": fmt,
        "target": options.get("target"),
        "source_revision": source.revision,
        "source_fingerprint": manifest.get("source_fingerprint"),
    }


# --- a verify result, recorded afterwards -----------------------------------------------------------


def record_verification(out_dir: Path, report: VerifyReport) -> WrittenFile | None:
    """Put `report`'s result into the card's verification section, and the card's new size and
    sha256 into the manifest (the demo does so once it has verified; verify itself writes
    nothing). None when the output has no card of its own (--no-card)."""
    out_dir = Path(out_dir)
    manifest = read_manifest(out_dir) or {}
    if not (manifest.get("options") or {}).get("card"):
        return None
    path = out_dir / CARD_NAME
    text = path.read_text(encoding="utf-8")
    begin, end = text.find(card_text.VERIFY_BEGIN), text.find(card_text.VERIFY_END)
    if begin < 0 or end < begin:
        raise OutputError(f"{path}: no verification section to record verify's result in")
    head = text[: begin + len(card_text.VERIFY_BEGIN)]
    written = write_bytes_atomic(path, f"{head}\n{card_text.verify_result(report)}\n{text[end:]}".encode())
    files = dict(manifest["files"]) | {CARD_NAME: {"size": written.size, "sha256": written.sha256}}
    write_manifest(
        out_dir, manifest["status"], manifest["options"], manifest["source_fingerprint"], files, manifest.get("source")
    )
    return written
