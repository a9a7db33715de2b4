"""The conversion manifest: what was converted, how, and every output file's size and sha256.

Written with status 'incomplete' before the first output file and rewritten as 'complete' last,
so an interrupted conversion is recognisable as such.
"""

from __future__ import annotations

import json
from pathlib import Path

from mla_convert.constants import MANIFEST_NAME, TOOL_NAME
from mla_convert.io.files import write_bytes_atomic
from mla_convert.version import __version__


def manifest_bytes(
    status: str,
    options: dict,
    source_fingerprint: str,
    files: dict[str, dict],
    source: dict | None = None,
    card: dict | None = None,
) -> bytes:
    """`source`: where the source came from (output.card_facts.SourceRef.as_dict), recorded once
    known; `card`: what the model card says of the conversion (CardFacts.record), so that it can be
    written again without the source."""
    doc = {
        "tool": TOOL_NAME,
        "version": __version__,
        "status": status,
        "options": options,
        "source_fingerprint": source_fingerprint,
        "files": {k: files[k] for k in sorted(files)},
    }
    if source is not None:
        doc["source"] = source
    if card is not None:
        doc["card"] = card
    return manifest_doc_bytes(doc)


def manifest_doc_bytes(doc: dict) -> bytes:
    """A manifest document's bytes, as written."""
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()


def write_manifest(
    out_dir: Path,
    status: str,
    options: dict,
    fingerprint: str,
    files: dict[str, dict],
    source: dict | None = None,
    card: dict | None = None,
) -> None:
    data = manifest_bytes(status, options, fingerprint, files, source, card)
    write_bytes_atomic(Path(out_dir) / MANIFEST_NAME, data)


def read_manifest(out_dir: Path) -> dict | None:
    """The manifest in `out_dir`, None when there is none; OSError or ValueError when it cannot be
    read, is not JSON, or is an mla-convert manifest with a field of another type (manifest_problem)."""
    path = Path(out_dir) / MANIFEST_NAME
    if not path.exists():
        return None
    manifest = json.loads(path.read_text())
    problem = manifest_problem(manifest) if is_conversion_manifest(manifest) else None
    if problem:
        raise ValueError(problem)
    return manifest


def is_conversion_manifest(manifest) -> bool:
    """Whether a parsed manifest is one mla-convert wrote: an object with its tool name and files."""
    return isinstance(manifest, dict) and manifest.get("tool") == TOOL_NAME and isinstance(manifest.get("files"), dict)


# The manifest's entries the commands read, and their types (those of earlier versions may be absent).
_ENTRY_TYPES = {"status": str, "version": str, "source_fingerprint": str, "options": dict, "source": dict, "card": dict}
_OPTION_TYPES = {"format": str, "target": str, "ignore": list, "card": bool}


def manifest_problem(manifest) -> str | None:
    """What makes a parsed manifest one the commands cannot read, in a few words naming the entry;
    None for a manifest of mla-convert's (a damaged file reads as one line, never a traceback)."""
    if not is_conversion_manifest(manifest):
        return "no tool/files entries"
    wrong = [k for k, kind in _ENTRY_TYPES.items() if manifest.get(k) is not None and not isinstance(manifest[k], kind)]
    options = manifest.get("options") if not wrong else None
    wrong += [
        f"options.{k}" for k, kind in _OPTION_TYPES.items() if k in (options or {}) and not isinstance(options[k], kind)
    ]
    if wrong:
        return f"{wrong[0]} {str(_entry(manifest, wrong[0]))[:60]!r} is not of its type"
    for rel, meta in manifest["files"].items():  # an entry without size or sha256 is a failed check, not unreadable
        size, sha = (meta.get("size", 0), meta.get("sha256", "")) if isinstance(meta, dict) else (None, None)
        if not (isinstance(size, int) and not isinstance(size, bool) and size >= 0 and isinstance(sha, str)):
            return f"files[{rel!r}] must be an object with an integer size and a sha256 string, not {str(meta)[:60]!r}"
    return None


def _entry(manifest: dict, name: str):
    top, _, option = name.partition(".")
    return manifest[top][option] if option else manifest[top]


def readable_manifest(out_dir: Path) -> dict | None:
    """The manifest, or None when it is missing, unreadable or not a JSON object: for the callers
    that only ask what --out holds (an earlier output? finished?), where a damaged manifest is
    just not one."""
    try:
        manifest = json.loads((Path(out_dir) / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None
