"""Crash safety and resume: a journal of finished shard jobs, and what a resume may keep.

Every output file is written under a hidden temporary name (io.files.partial_name) and renamed
when complete; a job is recorded in the journal (fsynced) only after all its files were renamed.
A resume trusts nothing else: it removes leftover temporary files (`remove_partials`), re-hashes
each journaled file and redoes any job whose files are missing or differ (`resumable_jobs`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from mla_convert.constants import COMPLETE, JOURNAL_NAME, MANIFEST_NAME, PARTIAL_SUFFIX
from mla_convert.errors import OutputError
from mla_convert.output.manifest import read_manifest
from mla_runtime.safetensors_file import file_digest

JobFiles = list[tuple[str, int, str]]  # a job's files: (relative path, size, sha256)


class Journal:
    def __init__(self, out_dir: Path):
        self.path = Path(out_dir) / JOURNAL_NAME

    def record(self, job_file: str, files: JobFiles) -> None:
        line = (json.dumps({"job": job_file, "files": [list(f) for f in files]}) + "\n").encode()
        try:
            with open(self.path, "ab+") as f:
                if f.seek(0, os.SEEK_END) and os.pread(f.fileno(), 1, f.tell() - 1) != b"\n":
                    line = b"\n" + line  # after a torn last line (killed mid-append): a line of its own
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            raise OutputError(f"{self.path}: cannot record progress: {e.strerror or e}") from e

    def entries(self) -> dict[str, JobFiles]:
        """Job file -> its files; a torn last line (killed mid-append) is ignored, and a journal
        that cannot be read (not a file) records nothing: a resume then redoes those jobs."""
        out: dict[str, JobFiles] = {}
        try:
            text = self.path.read_bytes().decode(errors="replace")
        except OSError:
            return out
        for line in text.splitlines():
            try:
                entry = json.loads(line)
                out[entry["job"]] = [(str(r), int(n), str(h)) for r, n, h in entry["files"]]
            except (ValueError, KeyError, TypeError):
                continue
        return out

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


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


def resumable_jobs(out_dir: Path, manifest: dict, job_outputs: dict[str, list[str]]) -> dict[str, JobFiles]:
    """The jobs of `job_outputs` (job -> its output files) whose files were all recorded as finished
    (the journal, or the manifest of a complete run) and still match their size and sha256."""
    out_dir = Path(out_dir)
    known: dict[str, tuple[int, str]] = {}
    if manifest.get("status") == COMPLETE:
        known = {rel: (v["size"], v["sha256"]) for rel, v in manifest.get("files", {}).items()}
    for files in Journal(out_dir).entries().values():
        known |= {rel: (size, sha) for rel, size, sha in files}
    done = {}
    for job, rels in job_outputs.items():
        if rels and all(rel in known and _intact(out_dir / rel, *known[rel]) for rel in rels):
            done[job] = [(rel, *known[rel]) for rel in rels]
    return done


def _intact(path: Path, size: int, sha: str) -> bool:
    try:
        return path.stat().st_size == size and file_digest(path) == (size, sha)
    except OSError:
        return False
