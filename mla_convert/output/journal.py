"""Crash safety and resume: the journal of a run's output files, each through one lifecycle, and
what a resume may keep.

An output file goes through these states, each recorded (one appended line, fsynced) only once it
is true, so that a run killed anywhere leaves a journal that claims nothing false:

- WRITTEN, HASHED: written under a hidden temporary name (io.files.partial_name), hashed as it is
  written, renamed when complete. A shard job is recorded after all its files were renamed, with
  each file's size and sha256: its files enter the journal HASHED (the converter never holds a
  written file whose hash it does not know, so WRITTEN is never recorded on its own).
- CHECKED: verify's per-file checks passed on it (`convert --upload`, before it is sent).
- SENT: its bytes are in the Hub's storage, not yet in a commit (the Hub may drop them).
- COMMITTED: a commit of the branch holds it (the repo, branch and commit are recorded); only then
  is the local copy deleted.

A resume trusts nothing else: it removes leftover temporary files (`remove_partials`), re-hashes
each journaled file still on disk and redoes any job whose files are neither there intact nor on
the Hub at their recorded size and sha256 (`resumable_jobs`). Resume, publish.contents, verify's
integrity group and the upload read the states (`Journal.files`) instead of assuming that every
file of the manifest is on disk.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

from mla_convert.constants import COMPLETE, JOURNAL_NAME, MANIFEST_NAME, PARTIAL_SUFFIX
from mla_convert.errors import OutputError
from mla_convert.output.manifest import read_manifest
from mla_runtime.safetensors_file import file_digest

JobFiles = list[tuple[str, int, str]]  # a job's files: (relative path, size, sha256)
Held = dict[str, tuple[int, str]]  # what a Hub branch holds: path -> (size, sha256)

WRITTEN, HASHED, CHECKED, SENT, COMMITTED = "written", "hashed", "checked", "sent", "committed"
STATES = (WRITTEN, HASHED, CHECKED, SENT, COMMITTED)  # in lifecycle order


@dataclass(frozen=True)
class FileRecord:
    """One output file as the journal last recorded it."""

    rel: str
    size: int
    sha256: str
    state: str  # STATES
    job: str | None = None  # the shard job that wrote it; None: written by the run's last stage
    repo: str | None = None  # COMMITTED: where
    revision: str | None = None
    commit: str | None = None

    def reached(self, state: str) -> bool:
        return STATES.index(self.state) >= STATES.index(state)

    @property
    def on_hub(self) -> bool:
        """A commit holds it: the local copy may be gone."""
        return self.state == COMMITTED


class Journal:
    def __init__(self, out_dir: Path):
        self.path = Path(out_dir) / JOURNAL_NAME

    def record(self, job_file: str | None, files: JobFiles) -> None:
        """`files` are written and hashed (a shard job's, or with `job_file` None the last stage's)."""
        self._append({"job": job_file, "files": [list(f) for f in files]})

    def advance(
        self, rels: Iterable[str], state: str, *, repo: str | None = None, revision: str | None = None,
        commit: str | None = None,
    ) -> None:  # fmt: skip
        """`rels` reached `state` (CHECKED, SENT, or COMMITTED in `commit` of `repo`'s `revision`)."""
        if state not in STATES[2:]:
            raise ValueError(f"not a state a file advances to: {state!r}")
        entry = {"state": state, "paths": sorted(rels)}
        if state == COMMITTED:
            entry |= {"repo": repo, "revision": revision, "commit": commit}
        self._append(entry)

    def _append(self, entry: dict) -> None:
        line = (json.dumps(entry) + "\n").encode()
        try:
            with open(self.path, "ab+") as f:
                if f.seek(0, os.SEEK_END) and os.pread(f.fileno(), 1, f.tell() - 1) != b"\n":
                    line = b"\n" + line  # after a torn last line (killed mid-append): a line of its own
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            raise OutputError(f"{self.path}: cannot record progress: {e.strerror or e}") from e

    def _lines(self) -> list[dict]:
        """Every whole entry, in order; a torn last line (killed mid-append) and stray lines are
        ignored, and a journal that cannot be read (not a file) has none: a resume then redoes."""
        try:
            text = self.path.read_bytes().decode(errors="replace")
        except OSError:
            return []
        out = []
        for line in text.splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict):
                out.append(entry)
        return out

    def entries(self) -> dict[str, JobFiles]:
        """Shard job file -> its files, as last recorded."""
        out: dict[str, JobFiles] = {}
        for entry in self._lines():
            files = _files_of(entry)
            if files is not None and isinstance(entry.get("job"), str):
                out[entry["job"]] = files
        return out

    def files(self) -> dict[str, FileRecord]:
        """Every file the journal names -> its last state. A file written again (its job redone)
        starts over at HASHED; a state recorded for a file never written is ignored."""
        out: dict[str, FileRecord] = {}
        for entry in self._lines():
            files = _files_of(entry)
            if files is not None:
                job = entry.get("job") if isinstance(entry.get("job"), str) else None
                out |= {rel: FileRecord(rel, size, sha, HASHED, job) for rel, size, sha in files}
                continue
            state, rels = entry.get("state"), entry.get("paths")
            if state not in STATES[2:] or not isinstance(rels, list):
                continue
            where = {k: entry.get(k) if isinstance(entry.get(k), str) else None for k in ("repo", "revision", "commit")}
            for rel in rels:
                if isinstance(rel, str) and rel in out:
                    out[rel] = replace(out[rel], state=state, **(where if state == COMMITTED else {}))
        return out

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def _files_of(entry: dict) -> JobFiles | None:
    """A record's files [(rel, size, sha256)], None when the entry is not a whole record."""
    if "files" not in entry or not ("job" in entry and (entry["job"] is None or isinstance(entry["job"], str))):
        return None
    try:
        return [(str(r), int(n), str(h)) for r, n, h in entry["files"]]
    except (ValueError, TypeError):
        return None


def remove_partials(out_dir: Path) -> int:
    """Delete the hidden temporary files an interrupted run left under `out_dir`; how many."""
    n = 0
    for p in Path(out_dir).rglob(f".*{PARTIAL_SUFFIX}"):
        p.unlink(missing_ok=True)
        n += 1
    return n


def check_resumable(out_dir: Path, options: dict, fingerprint: str) -> dict:
    """The manifest of `out_dir`, if it holds a conversion of the same source (`fingerprint`) with
    the same `options`; OutputError saying why it cannot be resumed otherwise."""
    out_dir = Path(out_dir)
    try:
        manifest = read_manifest(out_dir)
    except (OSError, ValueError) as e:
        raise OutputError(
            f"{out_dir / MANIFEST_NAME}: unreadable ({e}); cannot resume, start over with --overwrite"
        ) from e
    if manifest is None:
        raise OutputError(f"{out_dir}: no {MANIFEST_NAME}; this is not an mla-convert output and cannot be resumed")
    if not isinstance(manifest, dict):
        raise OutputError(
            f"{out_dir / MANIFEST_NAME}: not an mla-convert manifest; cannot resume, start over with --overwrite"
        )
    recorded = manifest.get("options", {})
    diffs = [f"{k} recorded {recorded.get(k)!r}, requested {v!r}" for k, v in options.items() if recorded.get(k) != v]
    if diffs:
        raise OutputError(f"{out_dir}: cannot resume with different options: {'; '.join(diffs)}")
    if manifest.get("source_fingerprint") != fingerprint:
        raise OutputError(
            f"{out_dir}: cannot resume: it was converted from a different source (fingerprint "
            f"{str(manifest.get('source_fingerprint'))[:12]}..., this source {fingerprint[:12]}...)"
        )
    return manifest


def known_files(out_dir: Path, manifest: dict) -> dict[str, tuple[int, str]]:
    """What the run recorded of each file: path -> (size, sha256), from the manifest of a complete
    run and the journal (the journal's later)."""
    known: dict[str, tuple[int, str]] = {}
    if manifest.get("status") == COMPLETE and isinstance(manifest.get("files"), dict):
        for rel, v in manifest["files"].items():
            if isinstance(v, dict) and isinstance(v.get("size"), int) and isinstance(v.get("sha256"), str):
                known[rel] = (v["size"], v["sha256"])
    for files in Journal(out_dir).entries().values():
        known |= {rel: (size, sha) for rel, size, sha in files}
    return known


def resumable_jobs(
    out_dir: Path, manifest: dict, job_outputs: dict[str, list[str]], rehash: bool = True, held: Held | None = None
) -> dict[str, JobFiles]:
    """The jobs of `job_outputs` (job -> its output files) whose files were all recorded as finished
    (the journal, or the manifest of a complete run), each still on disk at its size and sha256
    (its size alone without `rehash`: a dry run's estimate) or held by the Hub's branch (`held`:
    path -> (size, sha256)) at the recorded ones."""
    out_dir = Path(out_dir)
    known = known_files(out_dir, manifest)
    held = held or {}
    done = {}
    for job, rels in job_outputs.items():
        if rels and all(rel in known and _kept(out_dir / rel, *known[rel], rehash, held.get(rel)) for rel in rels):
            done[job] = [(rel, *known[rel]) for rel in rels]
    return done


def _kept(path: Path, size: int, sha: str, rehash: bool, on_hub: tuple[int, str] | None) -> bool:
    return on_hub == (size, sha) or _intact(path, size, sha, rehash)


def _intact(path: Path, size: int, sha: str, rehash: bool = True) -> bool:
    try:
        return path.stat().st_size == size and (not rehash or file_digest(path) == (size, sha))
    except OSError:
        return False
