"""The output's model card, README.md: what the converted checkpoint is, for the Hub and its reader.

The metadata goes through huggingface_hub's `ModelCardData`, the Hub's model-card schema: the
base model, a Hub model id or nothing (never a path: output.card_facts.source_ref), with
`base_model_relation: quantized` for channel FP8,
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

import dataclasses
import hashlib
from dataclasses import dataclass
from pathlib import Path

from mla_convert import formats
from mla_convert.constants import CARD_METADATA_KEY, CARD_NAME, COMPLETE, MANIFEST_NAME, TOOL_NAME
from mla_convert.errors import OutputError, SourceError, with_flags
from mla_convert.io.files import WrittenFile, write_bytes_atomic
from mla_convert.output import card_edits, card_text
from mla_convert.output.card_facts import CardFacts, SourceRef
from mla_convert.output.manifest import is_conversion_manifest, manifest_doc_bytes, read_manifest
from mla_convert.results import VerifyReport
from mla_convert.settings import is_repo_id

# What the card takes from the source card's metadata, as it is there.
SOURCE_METADATA = ("license", "license_name", "license_link", "library_name", "pipeline_tag")


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


def _relation(fmt: str, base_model: str | None) -> str | None:
    """The format's relation (formats.Format.base_model_relation: quantized for channel FP8; none
    for bf16, a dtype conversion that is none of the Hub's four relations: adapter, merge,
    quantized, finetune); none without a base model to relate to, or for a format no longer known."""
    output = formats.find(fmt)
    return output.base_model_relation if output is not None and base_model else None


def base_model_of(metadata: dict) -> str | None:
    """A source card's own base_model (a fine-tune names its base), where it is one Hub model id."""
    base = metadata.get("base_model")
    if isinstance(base, list) and len(base) == 1:
        base = base[0]
    return base if is_repo_id(base) else None


def with_source_card(origin: SourceRef, source_card: Path | None) -> SourceRef:
    """`origin` with the source card's own base_model where it has none of its own (no
    --base-model, no Hub id)."""
    if origin.base_model is not None or source_card is None:
        return origin
    return dataclasses.replace(origin, base_model=base_model_of(read_source_card(source_card).metadata))


BASE_MODEL_HINT = (
    "the model card names no base model (the source is a local directory with no Hub id); set it with "
    "`mla-convert card DIR --base-model OWNER/NAME`"
)

# Where README.md is not the card the manifest records (verify, upload): how an edit of it is recorded.
CARD_EDITED_HINT = "edited by hand? `mla-convert card DIR` records the edit, keeping your text"


def format_tags(fmt: str) -> list[str]:
    """The Hub tags of the output's format (formats.Format.tags)."""
    return list(formats.get(fmt).tags)


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
        base_model=facts.source.base_model or None,
        tags=[*format_tags(facts.format), "gaudi", TOOL_NAME, facts.model_type],
        **{k: meta[k] for k in SOURCE_METADATA if isinstance(meta.get(k), str)},
        base_model_relation=_relation(facts.format, facts.source.base_model),
        **{CARD_METADATA_KEY: {k: v for k, v in own.items() if v is not None}},
    )


def build_card(facts: CardFacts, source: SourceCard | None, verify_result: str | None = None) -> str:
    """The whole README.md: metadata, then the body, then the source's card; `verify_result`: the
    verification section's result, when one was recorded."""
    from huggingface_hub import ModelCard

    data = card_metadata(facts, source)
    body = card_text.body(facts, source.text if source is not None else None)
    if verify_result is not None:
        body = _with_verify_result(body, verify_result)
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body}"))


def _verify_span(text: str) -> tuple[int, int] | None:
    begin, end = text.find(card_text.VERIFY_BEGIN), text.find(card_text.VERIFY_END)
    return None if begin < 0 or end < begin else (begin + len(card_text.VERIFY_BEGIN), end)


def _with_verify_result(text: str, result: str) -> str:
    begin, end = _verify_span(text)
    return f"{text[:begin]}\n{result.strip(chr(10))}\n{text[end:]}"


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
        "base_model_relation": _relation(fmt, source.base_model),
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
    if _verify_span(text) is None:
        raise OutputError(f"{path}: no verification section to record verify's result in")
    written = write_bytes_atomic(path, _with_verify_result(text, card_text.verify_result(report)).encode())
    _record_card(out_dir, manifest, written)
    return written


def _record_card(out_dir: Path, manifest: dict, written: WrittenFile, **changes) -> None:
    write_bytes_atomic(Path(out_dir) / MANIFEST_NAME, _with_card(manifest, written, **changes))


def _with_card(manifest: dict, written: WrittenFile, **changes) -> bytes:
    """The manifest's bytes with the card `written` recorded, and `changes` to its other entries."""
    files = dict(manifest["files"]) | {CARD_NAME: {"size": written.size, "sha256": written.sha256}}
    return manifest_doc_bytes(manifest | changes | {"files": files})


# --- the card written again, without the source (mla-convert card, upload) ------------------------

# What the manifest's card record adds where the card it records holds text its user wrote: a section
# of mla-convert's not found there is then the user's, kept (output.card_edits), not another
# version's wording of it (a card of another version, as it wrote it, is written again whole).
EDITED = "edited"


@dataclass(frozen=True)
class RenderedCard:
    path: Path
    changed: bool  # False: the card was already this one (nothing written)
    base_model: str | None
    repo_id: str | None
    text: str = ""  # the card
    manifest: bytes | None = None  # the manifest recording it, where it changes
    user_text: bool = False  # it holds text its user wrote (kept)


def render_card(
    out_dir: Path,
    *,
    base_model: str | None = None,
    repo_id: str | None = None,
    revision: str | None = None,
    write: bool = True,
    keep: bool = False,
    overwrite: bool = False,
) -> RenderedCard:
    """Write `out_dir`'s card again from what its manifest records (CardFacts.record, the source)
    and what the card holds of the source (its metadata and card text) and of verify (the result):
    with `base_model` and `repo_id` (and its branch, `revision`) when given, else the recorded ones.
    What its user wrote is kept (output.card_edits): text around mla-convert's sections, metadata
    keys and tags. A section of mla-convert's the user edited since the card was recorded is refused
    (OutputError naming it) unless `keep` (kept as edited) or `overwrite` (written again); one edited
    in a card recorded so is kept. The card, then the manifest with the card's size and sha256 (and
    the base model, the repo), each atomically; interrupted between the two, the same call writes
    both again. Nothing is written when the card is already the one it would write (nor with `write`
    False: what would be written is returned). OutputError when `out_dir` is not a finished
    conversion with a card."""
    out_dir = Path(out_dir)
    for name, value in (("base_model", base_model), ("repo_id", repo_id)):
        if value is not None and not is_repo_id(value):
            why = "expected a Hub model id, OWNER/NAME, not a path or a URL"
            flag = "--" + name.replace("_", "-")
            raise with_flags(OutputError(f"{name}={value!r}: {why}"), f"{flag} {value!r}: {why}")
    if keep and overwrite:
        raise with_flags(OutputError("keep and overwrite: choose one"), "--keep and --overwrite: choose one")
    manifest, recorded = _recorded_card(out_dir)
    facts = recorded
    if base_model is not None:
        facts = dataclasses.replace(facts, source=dataclasses.replace(facts.source, base_model=base_model))
    if repo_id is not None:  # a branch other than main is named with it: `revision` (None: main)
        facts = dataclasses.replace(facts, repo_id=repo_id, repo_revision=revision if revision != "main" else None)
    path = out_dir / CARD_NAME
    try:
        data = path.read_bytes()
        old = data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise OutputError(f"{path}: cannot read the model card ({e})") from e
    entry = manifest["files"].get(CARD_NAME) or {}
    as_recorded = entry.get("sha256") == hashlib.sha256(data).hexdigest()
    was_edited = (manifest.get("card") or {}).get(EDITED) is True
    mode = card_edits.OVERWRITE if overwrite else card_edits.KEEP if keep or as_recorded else None
    text, user_text = _rewritten(out_dir, old.replace("\r\n", "\n"), recorded, facts, mode, as_recorded, was_edited)
    done = RenderedCard(path, True, facts.source.base_model, facts.repo_id, text, None, user_text)
    if text == old and as_recorded and user_text == was_edited:
        return dataclasses.replace(done, changed=False)
    changes = {"source": facts.source.as_dict(), "card": facts.record() | ({EDITED: True} if user_text else {})}
    if not write:
        data = text.encode()
        written = WrittenFile(path, len(data), hashlib.sha256(data).hexdigest())
        return dataclasses.replace(done, manifest=_with_card(manifest, written, **changes))
    written = write_bytes_atomic(path, text.encode())
    _record_card(out_dir, manifest, written, **changes)
    return done


def _rewritten(
    out_dir: Path, old: str, recorded: CardFacts, facts: CardFacts, mode: str | None, as_recorded: bool, edited: bool
) -> tuple[str, bool]:
    """The card `old` written for `facts` (output.card_edits; `recorded`: the facts it was written
    for): its text, and whether it holds text its user wrote. A card as recorded, recorded as
    holding nothing its user wrote (not `edited`), where a section is not found, is another
    version's wording: written again whole. OutputError for an edit not recorded that `mode` does not resolve: None refuses every one,
    KEEP one of what verify checks."""
    source, result = _source_in(old), _verify_result_in(old)
    metadata, body = card_edits.split(old)
    with_source = source is not None
    before = card_edits.Generated(card_metadata(recorded, source).to_dict(), _sections(recorded, with_source, result))
    after = card_edits.Generated(card_metadata(facts, source).to_dict(), _sections(facts, with_source, result))
    new = card_edits.rewrite(metadata, body, before, after, mode)
    built = build_card(facts, source, result)
    if new.edited and as_recorded and not edited:
        return built, False
    if new.edited and not as_recorded and (mode is None or (new.identity and mode == card_edits.KEEP)):
        raise _edited_inside(out_dir, new)
    text = f"---\n{_yaml(new.metadata)}\n---\n{new.body}"
    return text, text != built


def _sections(facts: CardFacts, with_source: bool, verify_result: str | None) -> list[str]:
    sections = card_text.sections(facts, with_source)
    if verify_result is None:
        return sections
    return [_with_verify_result(s, verify_result) if _verify_span(s) else s for s in sections]


def _yaml(metadata: dict) -> str:
    """The front matter, as ModelCardData.to_yaml writes it."""
    from huggingface_hub.utils import yaml_dump

    return yaml_dump({k: v for k, v in metadata.items() if v is not None}, sort_keys=False).strip()


def _edited_inside(out_dir: Path, new: card_edits.Rewritten) -> OutputError:
    """The refusal of an edit where mla-convert writes, each way it can be resolved worded for the
    library and for the command line."""
    path, what = out_dir / CARD_NAME, ", ".join(new.edited)
    command = f"`mla-convert card {out_dir}"
    if new.identity:
        why = f"{path}: edited where mla-convert writes what verify checks against {MANIFEST_NAME} ({what})"
        base = " (a base model is set with base_model=)"
        return with_flags(
            OutputError(f"{why}; card(..., overwrite=True) writes it again{base}"),
            f"{why}; {command} --overwrite` writes it again (a base model is set with --base-model)",
        )
    why = f"{path}: edited inside what mla-convert writes ({what})"
    either = "your text around it is kept either way"
    return with_flags(
        OutputError(f"{why}; card(..., keep=True) keeps it as you wrote it, overwrite=True writes it again ({either})"),
        f"{why}; {command} --keep` keeps it as you wrote it, {command} --overwrite` writes it again ({either})",
    )


def _recorded_card(out_dir: Path) -> tuple[dict, CardFacts]:
    where = out_dir / MANIFEST_NAME
    try:
        manifest = read_manifest(out_dir)
    except (OSError, ValueError) as e:
        raise OutputError(f"{where}: unreadable conversion manifest ({e})") from e
    if manifest is None or not is_conversion_manifest(manifest):
        raise OutputError(f"{out_dir}: not an mla-convert output (no {MANIFEST_NAME})")
    if manifest.get("status") != COMPLETE:
        raise OutputError(
            f"{out_dir}: the conversion did not finish; finish it with `mla-convert convert ... --resume`"
        )
    if not (manifest.get("options") or {}).get("card"):
        why = "its README.md is the source's, not a card to write"
        raise with_flags(
            OutputError(f"{out_dir}: converted with card=False: {why}"), f"{out_dir}: converted with --no-card: {why}"
        )
    record = manifest.get("card")
    try:
        facts = CardFacts.from_record(record, SourceRef.from_dict(manifest.get("source")))
    except (TypeError, KeyError, AttributeError) as e:
        raise OutputError(
            f"{where}: records no facts for the card (an earlier mla-convert wrote it and did not keep them); "
            "convert again to get a card that can be written again"
        ) from e
    return manifest, facts


def _source_in(card: str) -> SourceCard | None:
    """What the card holds of the source's card: its metadata (the fields SOURCE_METADATA takes)
    and its text, below SOURCE_BEGIN."""
    at = card.find(card_text.SOURCE_BEGIN)
    if at < 0:
        return None
    metadata = card_edits.split(card)[0] or {}  # a damaged front matter: no metadata kept from it
    return SourceCard(metadata, card[at + len(card_text.SOURCE_BEGIN) :].strip("\n"))


def _verify_result_in(card: str) -> str | None:
    span = _verify_span(card)
    if span is None:
        return None
    result = card[span[0] : span[1]].strip("\n")
    return None if result.startswith("**Result**: not run") else result
