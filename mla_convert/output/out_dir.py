"""The output directory, before the first byte is written: where it may be, whether this process can
write there, what `--overwrite` may delete, and whether its filesystem has room.

`--overwrite` replaces an earlier mla-convert output only. One is recognised by what the tool
leaves in it first (its conversion manifest naming mla-convert, the journal, or the --stream
staging directory), and only files the tool writes are deleted: any other file makes it refuse,
naming that file, so a wrong --out never costs the user a file. So does a file the tool wrote
that has changed since (an edited README.md): its size, or its sha256 where it was modified after
the manifest or journal recorded it, is not the recorded one.

The lock file (output.lock) is the running command's own, and none of this looks at it.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from mla_convert.constants import (
    JOURNAL_NAME,
    LOCK_NAME,
    MANIFEST_NAME,
    MLA_DIR_NAME,
    MLA_MANIFEST_NAME,
    PROBE_NAME,
    STAGING_DIR_NAME,
    TOOL_NAME,
)
from mla_convert.errors import OutputError
from mla_convert.io.files import files_under as _all_files_under
from mla_convert.io.files import is_partial_name
from mla_convert.output.journal import Journal
from mla_convert.output.manifest import readable_manifest
from mla_runtime.safetensors_file import file_digest

TOOL_FILES = frozenset({MANIFEST_NAME, JOURNAL_NAME, PROBE_NAME})
MLA_FILE = re.compile(rf"{MLA_DIR_NAME}/(layer-\d+\.safetensors|{re.escape(MLA_MANIFEST_NAME)})")


def check_location(out_dir: Path, src_root: Path) -> None:
    out_real, src_real = out_dir.resolve(), src_root.resolve()
    if out_real == src_real or src_real in out_real.parents:
        raise OutputError(f"{out_dir}: --out is the source or inside it; pick a directory outside {src_root}")
    if out_real in src_real.parents:
        raise OutputError(f"{out_dir}: --out contains the source {src_root}; pick a directory outside it")


def nearest_existing(path: Path) -> Path:
    """`path`, or its nearest ancestor that exists (what a new --out is created in)."""
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_writable(out_dir: Path) -> None:
    """Refuse, before anything else happens, an --out this process cannot create or write into."""
    if out_dir.exists() and not out_dir.is_dir():
        raise OutputError(f"{out_dir}: exists and is not a directory")
    where = nearest_existing(out_dir)
    if os.access(where, os.W_OK | os.X_OK):
        return
    try:
        read_only = bool(os.statvfs(where).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    what = f"{where} is on a read-only filesystem" if read_only else f"no permission to write in {where}"
    raise OutputError(f"{out_dir}: cannot write the output: {what}; pick another --out")


def files_under(root: Path) -> list[str]:
    """Every file under `root` (io.files.files_under), but the lock file of the command running."""
    return [rel for rel in _all_files_under(root) if rel != LOCK_NAME]


Record = tuple[int | None, str | None, float]  # a file's recorded size and sha256, and when it was recorded


def _recorded_files(out_dir: Path) -> tuple[bool, dict[str, Record]]:
    """(is an mla-convert output, the files its manifest and journal record)."""
    recorded: dict[str, Record] = {}
    ours = (out_dir / JOURNAL_NAME).is_file() or (out_dir / STAGING_DIR_NAME).is_dir()
    manifest = readable_manifest(out_dir)
    if manifest is not None and manifest.get("tool") == TOOL_NAME:
        ours = True
        if isinstance(manifest.get("files"), dict):
            when = _mtime(out_dir / MANIFEST_NAME)
            for rel, meta in manifest["files"].items():
                meta = meta if isinstance(meta, dict) else {}
                recorded[rel] = (meta.get("size"), meta.get("sha256"), when)
    when = _mtime(out_dir / JOURNAL_NAME)
    for files in Journal(out_dir).entries().values():
        recorded |= {rel: (size, sha, when) for rel, size, sha in files}
    return ours, recorded


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return float("inf")


def _changed(path: Path, record: Record) -> bool:
    """Whether a file the tool recorded is no longer what it wrote: another size, or modified after
    it was recorded and another sha256 (a file untouched since is not hashed again)."""
    size, sha, recorded_at = record
    try:
        st = path.lstat()
    except OSError:  # gone: nothing of the user's to lose
        return False
    if stat.S_ISLNK(st.st_mode):  # deleted as itself, never its target: nothing of the user's is lost
        return False
    if size is not None and st.st_size != size:
        return True
    if sha is None or st.st_mtime <= recorded_at:
        return False
    try:
        return file_digest(path).sha256 != sha
    except OSError:
        return True


def is_earlier_output(out_dir: Path) -> bool:
    return _recorded_files(out_dir)[0]


@dataclass(frozen=True)
class Earlier:
    """What --overwrite deletes from --out: the files of an earlier output, and their bytes."""

    out_dir: Path
    files: tuple[str, ...]
    nbytes: int

    def delete(self) -> None:
        """Remove those files, then the directories they leave empty; nothing else."""
        for rel in self.files:
            (self.out_dir / rel).unlink(missing_ok=True)
        shutil.rmtree(self.out_dir / STAGING_DIR_NAME, ignore_errors=True)
        parents = {p for rel in self.files for p in Path(rel).parents if p != Path(".")}
        for rel in sorted(parents, key=lambda p: -len(p.parts)):
            try:
                (self.out_dir / rel).rmdir()  # only if empty: a directory also holding other things stays
            except OSError:
                pass


def earlier_output(out_dir: Path, writes: Iterable[str]) -> Earlier:
    """The files --overwrite would delete from a non-empty `out_dir`, which must be an earlier
    mla-convert output holding nothing else. `writes`: the files this conversion writes (an
    interrupted earlier run of it may have left them without recording them)."""
    ours, recorded = _recorded_files(out_dir)
    files = files_under(out_dir)
    if not ours:
        raise OutputError(
            f"{out_dir}: --overwrite replaces only an earlier mla-convert output (one with {MANIFEST_NAME}), and "
            f"this directory is not one (it holds {first_and_others(files)}); pick another --out, or empty it yourself"
        )
    known = TOOL_FILES | set(recorded) | set(writes)
    own, foreign = [], []
    for rel in files:
        parts = Path(rel).parts
        if (
            rel in known
            or parts[0] == STAGING_DIR_NAME
            or is_partial_name(parts[-1])
            or MLA_FILE.fullmatch(Path(rel).as_posix())
        ):
            own.append(rel)
        else:
            foreign.append(rel)
    if foreign:
        raise OutputError(
            f"{out_dir}: --overwrite would delete {first_and_others(foreign)}, which mla-convert did not write; "
            "move it out of --out first (only an earlier output's own files are replaced)"
        )
    changed = [rel for rel in own if rel in recorded and _changed(out_dir / rel, recorded[rel])]
    if changed:
        raise OutputError(
            f"{out_dir}: --overwrite would replace {first_and_others(changed)}, which mla-convert wrote but which has changed "
            f"since (not the size and sha256 that {MANIFEST_NAME} or the journal records); move it out of --out "
            "first (only an earlier output's own, unchanged files are replaced)"
        )
    nbytes = sum(_size(out_dir / rel) for rel in own)  # the staging directory's files among them
    return Earlier(out_dir, tuple(rel for rel in own if Path(rel).parts[0] != STAGING_DIR_NAME), nbytes)


def first_and_others(files: list[str]) -> str:
    """ "A", or "A and N other files": the first of `files` and how many more, for a message."""
    return files[0] + (f" and {len(files) - 1} other file{'s' * (len(files) > 2)}" if len(files) > 1 else "")


def _size(path: Path) -> int:
    try:
        return path.lstat().st_size
    except OSError:
        return 0


def is_empty(out_dir: Path) -> bool:
    return not out_dir.exists() or all(p.name == LOCK_NAME for p in out_dir.iterdir())


def disk_free(path: Path) -> int:
    """Bytes an unprivileged process may still write on the filesystem that holds (or will hold) `path`."""
    return shutil.disk_usage(nearest_existing(path)).free


def same_filesystem(a: Path, b: Path) -> bool:
    return nearest_existing(a).stat().st_dev == nearest_existing(b).stat().st_dev
