"""verify, integrity group: the model card (README.md) is the one the conversion wrote. Its size and
sha256 are checked with every other file's (integrity); here, that the manifest lists it and that
its metadata, read back with huggingface_hub's ModelCard, names the source and the format the
manifest records (output.card: card_identity against recorded_identity).

An output written with --no-card (its README.md the source's, or none) has no card to check; nor
has one written before cards existed (no `card` among its recorded options).
"""

from __future__ import annotations

from pathlib import Path

from mla_convert.constants import CARD_NAME, MANIFEST_NAME
from mla_convert.output.card import card_identity, recorded_identity
from mla_convert.verification.report import INTEGRITY, Tally

CHECK = "card"


def check_card(root: Path, manifest: dict, tally: Tally) -> None:
    if not (manifest.get("options") or {}).get("card"):
        return
    if not tally.expect(
        CARD_NAME in manifest["files"],
        INTEGRITY,
        CHECK,
        MANIFEST_NAME,
        expected=f"{CARD_NAME}, the model card, among the files",
        found="not listed",
    ):
        return
    metadata = _metadata(root / CARD_NAME, tally)
    if metadata is None:
        return
    found, expected = card_identity(metadata), recorded_identity(manifest)
    for key, value in expected.items():
        tally.expect(
            found[key] == value,
            INTEGRITY,
            CHECK,
            CARD_NAME,
            expected=f"{key} {value!r} ({MANIFEST_NAME})",
            found=f"{key} {found[key]!r}",
        )


def _metadata(path: Path, tally: Tally) -> dict | None:
    """The card's metadata, or None with a failure when it is missing or unreadable. A Path, never a
    name: ModelCard.load downloads from the Hub whatever is not a local file."""
    import yaml
    from huggingface_hub import ModelCard
    from huggingface_hub.repocard import REGEX_YAML_BLOCK

    if not path.is_file():
        return None  # reported by integrity as a missing file
    try:
        if REGEX_YAML_BLOCK.search(path.read_text(encoding="utf-8-sig")) is None:
            tally.fail(INTEGRITY, CHECK, CARD_NAME, expected="a model card with its metadata", found="no metadata")
            return None
        return ModelCard.load(path).data.to_dict()
    except (OSError, ValueError, TypeError, UnicodeDecodeError, yaml.YAMLError) as e:
        tally.fail(INTEGRITY, CHECK, CARD_NAME, expected="a model card with its metadata", found=str(e).strip()[:200])
        return None
