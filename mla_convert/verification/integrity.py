"""verify, integrity group: the directory as its manifests record it. Every file's size and sha256
as mla-convert-manifest.json lists them (status complete), no unlisted file, the artifacts as
mla/manifest.json lists them; and, with --source, that the directory is this source's conversion
(the recorded fingerprint, the config the source implies, its side files copied)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from mla_convert.constants import CARD_NAME, COMPLETE, MANIFEST_NAME, MLA_DIR_NAME
from mla_convert.output.card import CARD_EDITED_HINT
from mla_convert.output.journal import FileRecord, Journal
from mla_convert.plan.planner import Plan
from mla_convert.source.checkpoint import SourceCheckpoint
from mla_convert.verification.report import INTEGRITY, MLA, SOURCE, Tally
from mla_convert.verification.structure import Structure
from mla_convert.verification.tasks import FileResult
from mla_runtime.format import MlaManifest, layer_file_name


def check_source_identity(
    root: Path, src: SourceCheckpoint, plan: Plan, fingerprint: str, manifest: dict, tally: Tally
) -> None:
    """The output was converted from this source, and its config (config.json, or params.json) is
    what the source implies."""
    tally.expect(
        src.fingerprint() == fingerprint,
        SOURCE,
        "fingerprint",
        MANIFEST_NAME,
        expected=f"{src.fingerprint()} (fingerprint of --source)",
        found=fingerprint,
    )
    try:
        config = json.loads((root / plan.config_name).read_text())
    except (OSError, ValueError):
        return  # reported by the structure checks
    if not isinstance(config, dict):
        return  # reported by the structure checks too ("must be a JSON object")
    keys = sorted(k for k in set(config) | set(plan.config) if config.get(k) != plan.config.get(k))
    tally.expect(
        not keys,
        SOURCE,
        "config",
        plan.config_name,
        expected="the source's config with the conversion's quantization_config",
        found=f"differs in {keys}",
    )
    for rel in src.side_files:
        tally.expect(
            rel in manifest["files"] and (root / rel).is_file(),
            INTEGRITY,
            "side-file",
            rel,
            expected="copied from the source",
            found="missing",
        )


def check_integrity(
    root: Path, manifest: dict, structure: Structure, results: dict[str, FileResult], tally: Tally
) -> None:
    """Every file's size and sha256 as the manifests record them; no file missing or unlisted."""
    status = manifest.get("status")
    if not tally.expect(
        status == COMPLETE,
        INTEGRITY,
        "status",
        MANIFEST_NAME,
        expected=f"status {COMPLETE!r}",
        found=f"status {status!r}: the conversion did not finish",
    ):
        return
    files: dict = manifest["files"]
    sent = _sent(files, Journal(root).files())
    card = bool((manifest.get("options") or {}).get("card"))
    _check_listed_files(files, results, sent, tally, card)
    _check_unlisted_files(root, files, tally)
    if structure.mla_manifest is not None:
        _check_against_mla_manifest(structure.mla_manifest, results, tally)
    for i in sorted(set(structure.mla_layers) - set(structure.mla_headers)):
        if f"{MLA_DIR_NAME}/{layer_file_name(i)}" in sent:
            continue
        tally.fail(
            MLA,
            "artifact",
            f"{MLA_DIR_NAME}/{layer_file_name(i)}",
            f"layer {i}",
            expected="W_UK_T and W_UV of this layer",
            found="no readable artifact file",
        )


def _sent(files: dict, lifecycle: dict[str, FileRecord]) -> set[str]:
    """The listed files committed to the Hub at the size and sha256 the manifest lists."""
    return {
        rel
        for rel, meta in files.items()
        if (r := lifecycle.get(rel)) is not None
        and r.on_hub
        and isinstance(meta, dict)
        and (meta.get("size"), meta.get("sha256")) == (r.size, r.sha256)
    }


def _check_listed_files(files: dict, results: dict[str, FileResult], sent: set[str], tally: Tally, card: bool) -> None:
    """Each file the conversion manifest lists is there, with the recorded size and sha256 (or
    committed to the Hub at those); `card`: README.md is mla-convert's card, which its user may edit."""
    for rel in sorted(files):
        meta, r = files[rel], results.get(rel)
        if (r is None or r.size is None) and rel in sent:
            tally.ok(INTEGRITY)
        elif r is None or r.size is None:
            tally.fail(INTEGRITY, "missing-file", rel, expected=f"{meta.get('size')} bytes", found="missing")
        elif r.sha256 is not None:
            tally.expect(r.size == meta.get("size"), INTEGRITY, "size", rel, expected=meta.get("size"), found=r.size)
            found = f"{r.sha256} ({CARD_EDITED_HINT})" if card and rel == CARD_NAME else r.sha256
            tally.expect(
                r.sha256 == meta.get("sha256"), INTEGRITY, "sha256", rel, expected=meta.get("sha256"), found=found
            )


def _check_unlisted_files(root: Path, files: dict, tally: Tally) -> None:
    """No file on disk that the conversion manifest does not list."""
    for rel in _files_on_disk(root):
        if rel != MANIFEST_NAME:
            tally.expect(
                rel in files,
                INTEGRITY,
                "unlisted-file",
                rel,
                expected="only files the manifest lists",
                found="a file the conversion did not write",
            )


def _check_against_mla_manifest(mla_manifest: MlaManifest, results: dict[str, FileResult], tally: Tally) -> None:
    """Each artifact file read has the size and sha256 the MLA manifest records."""
    for e in mla_manifest.layers:
        rel = f"{MLA_DIR_NAME}/{e.file}"
        r = results.get(rel)
        if r is not None and r.sha256 is not None:
            tally.expect(
                (r.size, r.sha256) == (e.size, e.sha256),
                INTEGRITY,
                "mla-manifest",
                rel,
                expected=f"{e.size} bytes, sha256 {e.sha256} (mla/manifest.json)",
                found=f"{r.size} bytes, sha256 {r.sha256}",
            )


def _files_on_disk(root: Path) -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        out += [os.path.relpath(os.path.join(dirpath, f), root) for f in filenames if not f.startswith(".")]
    return sorted(out)
