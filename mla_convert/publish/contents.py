"""What `upload` sends: exactly the files a finished conversion's manifest lists, and the manifest,
in a fixed order and in two calls of the client's upload_folder.

The order (docs/design.md, "The model card and the upload"): the model shards, the MLA layer
files, the other files (tokenizer, code, ...) in a first call; then, in a last one, what makes the
repo a model: config.json (params.json), the index, mla/manifest.json, the card and the conversion
manifest. Until that call lands the repo holds no config, so nothing loads a half-uploaded model.

`read_contents` refuses a directory whose manifest is not a finished conversion's, that lacks a
file it lists (or holds it at another size), or that holds any file it does not list, hidden
ones too (a `.partial` file, a journal, a staging directory): the directory is not what was
converted. A file `convert --upload` committed to a repo and then deleted here is not lacking: the
journal (output.journal) records where it is, and the directory keeps that journal. It reads sizes
only; verify's checks (publish.upload) read the bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from mla_convert.constants import (
    CARD_NAME,
    COMPLETE,
    CONFIG_NAME,
    CONSOLIDATED_INDEX_NAME,
    INDEX_NAME,
    JOURNAL_NAME,
    LOCK_NAME,
    MANIFEST_NAME,
    MLA_DIR_NAME,
    MLA_MANIFEST_NAME,
    PARAMS_JSON_NAME,
)
from mla_convert.errors import UploadError
from mla_convert.output.card import CARD_EDITED_HINT
from mla_convert.output.journal import FileRecord, Journal
from mla_convert.output.manifest import manifest_problem
from mla_convert.output.out_dir import first_and_others
from mla_runtime.safetensors_file import HASH_CHUNK

# What makes the repo a model (a member's own layout: params.json and its index), in the last call.
LAST = (
    CONFIG_NAME, PARAMS_JSON_NAME, INDEX_NAME, CONSOLIDATED_INDEX_NAME, f"{MLA_DIR_NAME}/{MLA_MANIFEST_NAME}",
    CARD_NAME, MANIFEST_NAME,
)  # fmt: skip
FORBIDDEN_PARTS = (".git", ".cache")  # the Hub refuses paths through these


@dataclass(frozen=True)
class UploadFile:
    rel: str  # relative to the directory, "/"-separated: also its path in the repo
    size: int
    sha256: str  # as the manifest records it (for the manifest itself: computed here)
    sent_to: FileRecord | None = None  # committed by `convert --upload` (its repo, branch, commit): maybe deleted here
    data: bytes | None = field(default=None, repr=False, compare=False)  # its bytes, where not yet written (rewritten)


@dataclass(frozen=True)
class Contents:
    root: Path
    manifest: dict
    files: tuple[UploadFile, ...]  # in upload order, the conversion manifest last

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files)

    def by_rel(self) -> dict[str, UploadFile]:
        return {f.rel: f for f in self.files}

    @property
    def sent(self) -> tuple[UploadFile, ...]:
        """The files `convert --upload` committed (and may have deleted here)."""
        return tuple(f for f in self.files if f.sent_to is not None)


def read_contents(out_dir: Path) -> Contents:
    root = Path(out_dir)
    if not root.is_dir():
        raise UploadError(f"{root}: no such directory" if not root.exists() else f"{root}: not a directory")
    path = root / MANIFEST_NAME
    try:
        manifest = json.loads(path.read_bytes())
    except FileNotFoundError as e:
        raise UploadError(
            f"{root}: not an mla-convert output (no {MANIFEST_NAME}); upload a converted directory"
        ) from e
    except (OSError, ValueError) as e:
        raise UploadError(f"{path}: unreadable conversion manifest ({e})") from e
    problem = manifest_problem(manifest)
    if problem:
        raise UploadError(f"{path}: not an mla-convert manifest ({problem})")
    if manifest.get("status") != COMPLETE:
        raise UploadError(
            f"{root}: the conversion did not finish (manifest status {manifest.get('status')!r}); finish it with "
            "`mla-convert convert ... --resume` first"
        )
    listed = _with_lifecycle(_listed(root, manifest["files"]), Journal(root).files())
    _check_directory(root, listed, card=bool((manifest.get("options") or {}).get("card")))
    own = UploadFile(MANIFEST_NAME, path.stat().st_size, _sha256(path))
    return Contents(root, manifest, (*upload_order(listed), own))


def rewritten(contents: Contents, card: str, manifest: bytes) -> Contents:
    """`contents` as they will be once the card (README.md) and the manifest recording it are
    written with these bytes (each file's `data`): nothing is written here."""
    data = {CARD_NAME: card.encode(), MANIFEST_NAME: manifest}
    files = tuple(
        replace(f, size=len(data[f.rel]), sha256=hashlib.sha256(data[f.rel]).hexdigest(), data=data[f.rel])
        if f.rel in data
        else f
        for f in contents.files
    )
    return Contents(contents.root, json.loads(manifest), files)


def _listed(root: Path, files: dict) -> list[UploadFile]:
    out = []
    for rel, meta in sorted(files.items()):
        size, sha = (meta.get("size"), meta.get("sha256")) if isinstance(meta, dict) else (None, None)
        parts = rel.split("/")
        if not (isinstance(size, int) and isinstance(sha, str)) or os.path.isabs(rel) or ".." in parts:
            raise UploadError(
                f"{root / MANIFEST_NAME}: entry {rel!r} is not a file of the directory with size and sha256"
            )
        if any(p in FORBIDDEN_PARTS for p in parts):
            raise UploadError(f"{root / rel}: the Hub takes no file under a {'/'.join(FORBIDDEN_PARTS)} folder")
        out.append(UploadFile(rel, size, sha))
    return out


def _with_lifecycle(listed: list[UploadFile], lifecycle: dict[str, FileRecord]) -> list[UploadFile]:
    """The listed files, those the journal records as committed at the manifest's size and sha256
    marked as sent (where to is in the record)."""
    out = []
    for f in listed:
        record = lifecycle.get(f.rel)
        sent = record is not None and record.on_hub and (record.size, record.sha256) == (f.size, f.sha256)
        out.append(UploadFile(f.rel, f.size, f.sha256, record) if sent else f)
    return out


def _check_directory(root: Path, listed: list[UploadFile], card: bool = False) -> None:
    """Every listed file there at its size (but those sent and deleted here), and nothing else
    (hidden files included; the journal where it records files sent). `card`: README.md is
    mla-convert's card, which its user may edit (and record)."""
    on_disk = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in filenames:
            full = os.path.join(dirpath, name)
            on_disk[os.path.relpath(full, root).replace(os.sep, "/")] = os.lstat(full).st_size
    expected = {f.rel: f.size for f in listed}
    sent = {f.rel for f in listed if f.sent_to is not None}
    own = {MANIFEST_NAME, LOCK_NAME} | ({JOURNAL_NAME} if sent else set())
    unlisted = sorted(set(on_disk) - set(expected) - own)  # LOCK_NAME: this upload's own
    if unlisted:
        raise UploadError(
            f"{root}: holds {first_and_others(unlisted)} that its manifest does not list; not uploaded: move "
            f"{'it' if len(unlisted) == 1 else 'them'} out of the directory (it must be what was converted)"
        )
    expected = {rel: size for rel, size in expected.items() if not (rel in sent and rel not in on_disk)}
    missing = [rel for rel in expected if rel not in on_disk]
    if missing:
        raise UploadError(f"{root}: lacks {first_and_others(missing)} that its manifest lists; not uploaded")
    resized = [rel for rel, size in expected.items() if on_disk[rel] != size]
    if resized:
        rel = resized[0]
        why = "the file changed after the conversion"
        if card and rel == CARD_NAME:
            why = CARD_EDITED_HINT.replace("DIR", str(root), 1)
        raise UploadError(
            f"{root / rel}: {on_disk[rel]} bytes, the manifest records {expected[rel]}; not uploaded ({why})"
        )


def upload_order(files: list[UploadFile]) -> list[UploadFile]:
    """Model shards, MLA layer files, other files, then LAST's (each group by path)."""

    def rank(f: UploadFile) -> tuple:
        if f.rel in LAST:
            return (3, LAST.index(f.rel))
        if f.rel.startswith(f"{MLA_DIR_NAME}/"):
            return (1, f.rel)
        return (0 if f.rel.endswith(".safetensors") and "/" not in f.rel else 2, f.rel)

    return sorted(files, key=rank)


def commits_of(files: list[UploadFile]) -> list[list[UploadFile]]:
    """`files` (in upload order) in the upload's calls: every file but LAST's, then LAST's."""
    data, last = [f for f in files if f.rel not in LAST], [f for f in files if f.rel in LAST]
    return [c for c in (data, last) if c]


def exact_pattern(rel: str) -> str:
    """A glob (the client's allow_patterns, fnmatch) that matches `rel` and nothing else."""
    return re.sub(r"([*?\[])", r"[\1]", rel)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def git_blob_sha1(path: Path, data: bytes | None = None) -> str:
    """The git object id of a file's bytes (`data`, where given): how the Hub names a file it does
    not keep in LFS."""
    if data is not None:
        return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
    h = hashlib.sha1(b"blob %d\0" % path.stat().st_size)
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()
