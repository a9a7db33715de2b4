"""A model card its user edited, written again (output.card.render_card): what mla-convert wrote of
it found and written anew, everything else kept as the user has it.

mla-convert writes the front matter's IDENTITY keys (which verify compares with the manifest) and
its tags, and the body's sections (output.card_text.sections). The user may write anywhere around
those sections, add front-matter keys and tags of their own, and edit the source's card below
SOURCE_BEGIN: all of it is kept. Each section is looked for, in order, as the card was written
from the recorded facts; one found is replaced by the one for the new facts, and the text between
two found is the user's. A section not found was edited where mla-convert writes: `rewrite` says
which (`Rewritten.edited`), and keeps it as the user has it (KEEP) or writes it again over the edit
(OVERWRITE: the user's text between the found sections on either side goes with it). A changed
identity key is never kept (verify would fail the card): only OVERWRITE writes it again.
"""

from __future__ import annotations

from dataclasses import dataclass

from mla_convert.constants import CARD_METADATA_KEY
from mla_convert.output.card_text import SOURCE_BEGIN, section_name

IDENTITY = ("base_model", "base_model_relation", CARD_METADATA_KEY)  # output.card.card_identity reads these
TAGS = "tags"  # mla-convert's first, then the user's
KEEP, OVERWRITE = "keep", "overwrite"  # what `rewrite` does with a section the user edited


@dataclass(frozen=True)
class Generated:
    """What mla-convert writes of a card for one set of facts."""

    metadata: dict  # ModelCardData.to_dict(): its keys in the order it writes them
    sections: list[str]  # output.card_text.sections, the verify result in place


@dataclass(frozen=True)
class Rewritten:
    metadata: dict  # the front matter: the new facts' keys, then the user's
    body: str  # after the front matter (it starts with its blank line)
    edited: tuple[str, ...]  # what the user changed where mla-convert writes, named (IDENTITY keys first)
    identity: bool  # among them, an IDENTITY key, or a front matter that is no YAML mapping


def split(card: str) -> tuple[dict | None, str]:
    """The front matter's mapping ({} where there is none; None where it is not a YAML mapping) and the
    text after it, split as huggingface_hub's ModelCard splits them."""
    import yaml
    from huggingface_hub.repocard import REGEX_YAML_BLOCK

    match = REGEX_YAML_BLOCK.search(card)
    if match is None:
        return {}, card
    try:
        data = yaml.safe_load(match.group(2))
    except yaml.YAMLError:
        return None, card[match.end() :]
    data = {} if data is None else data
    return (data if isinstance(data, dict) else None), card[match.end() :]


def rewrite(metadata: dict | None, text: str, recorded: Generated, new: Generated, mode: str | None) -> Rewritten:
    """The card `text` (after the front matter `metadata`) with what `recorded` wrote of it replaced by
    `new`; a section the user changed kept as it is (KEEP, or `mode` None: the caller refuses the
    edits named in `edited`) or written again (OVERWRITE); IDENTITY keys always `new`'s."""
    keys = _identity_edited(metadata, recorded.metadata)
    at = text.find(SOURCE_BEGIN)
    limit = len(text) if at < 0 else at + len(SOURCE_BEGIN)  # the source's card, below, is kept as it is
    spans = _locate(text[:limit], recorded.sections)
    edited = tuple(section_name(s) for s, span in zip(recorded.sections, spans, strict=True) if span is None)
    body = _splice(text, spans, new.sections, limit, overwrite=mode == OVERWRITE)
    return Rewritten(_merged(metadata or {}, recorded.metadata, new.metadata), body, (*keys, *edited), bool(keys))


def _identity_edited(metadata: dict | None, recorded: dict) -> list[str]:
    if metadata is None:
        return ["its front matter (not a YAML mapping)"]
    return [f"the metadata's {k}" for k in IDENTITY if metadata.get(k) != recorded.get(k)]


def _locate(text: str, sections: list[str]) -> list[tuple[int, int] | None]:
    """Where each section is in `text`, in order (None: not there as written)."""
    spans, at = [], 0
    for section in sections:
        i = text.find(section, at)
        spans.append(None if i < 0 else (i, i + len(section)))
        at = at if i < 0 else i + len(section)
    return spans


def _splice(text: str, spans: list, new: list[str], limit: int, overwrite: bool) -> str:
    """`text` with each section found replaced by its new one; a run of sections not found left as
    it is, or, with `overwrite`, the text between the found ones around it (up to `limit`, the end
    of the last section's place) replaced by the new ones, spaced as the card spaces them."""
    out, at, i = [], 0, 0
    while i < len(new):
        if spans[i] is not None:
            out += [text[at : spans[i][0]], new[i]]
            at, i = spans[i][1], i + 1
            continue
        j = next((k for k in range(i, len(new)) if spans[k] is not None), len(new))
        if overwrite:
            # a blank line before each section and after the last (after the source card's marker: its card)
            after = "\n\n" if j < len(new) else "" if new[-1].endswith(SOURCE_BEGIN) else "\n"
            out.append(("\n\n" if i else "\n") + "\n\n".join(new[i:j]) + after)
            at = spans[j][0] if j < len(new) else limit
        i = j
    out.append(text[at:])
    return "".join(out)


def _merged(current: dict, recorded: dict, new: dict) -> dict:
    """`new`'s metadata, its tags followed by those the user added, then every key the user added
    (the recorded card's keys that `new` no longer writes are dropped, as mla-convert's)."""
    own = [*(recorded.get(TAGS) or ()), *(new.get(TAGS) or ())]
    theirs = current.get(TAGS)
    theirs = [theirs] if isinstance(theirs, str) else theirs if isinstance(theirs, list) else []
    tags = [*(new.get(TAGS) or ()), *(t for t in theirs if t not in own)]
    mine = set(IDENTITY) | {TAGS} | set(recorded) | set(new)
    return new | ({TAGS: tags} if tags else {}) | {k: v for k, v in current.items() if k not in mine}
