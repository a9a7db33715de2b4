"""Crash safety and resume: a journal of finished shard jobs, and the checks a resume needs.

Every output file is written under a hidden temporary name (`partial_name`) and renamed when
complete; a job is recorded in the journal (fsynced) only after all its files were renamed. A resume
trusts nothing else: it removes leftover temporary files, re-hashes each journaled file and redoes
any job whose files are missing or differ.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from mla_runtime.safetensors_file import file_sha256

from .errors import OutputError
from .manifest import COMPLETE, MANIFEST_NAME, read_manifest

JOURNAL_NAME = ".mla-convert-journal.jsonl"
PARTIAL_SUFFIX = ".partial"


def partial_name(path: Path) -> Path:
    """The hidden name an output file is written under until it is complete."""
    return path.with_name(f".{path.name}{PARTIAL_SUFFIX}")


class Journal:
    def __init__(self, out_dir: Path):
        self.path = Path(out_dir) / JOURNAL_NAME

    def record(self, job_file: str, files: list[tuple[str, int, str]]) -> None:
        line = json.dumps({"job": job_file, "files": [list(f) for f in files]}) + "\n"
        try:
            with open(self.path, "a") as f:
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            raise OutputError(f"{self.path}: cannot record progress: {e.strerror or e}") from None

    def entries(self) -> dict[str, list[tuple[str, int, str]]]:
        """Job file -> its files; a torn last line (killed mid-append) is ignored."""
        out: dict[str, list[tuple[str, int, str]]] = {}
        if not self.path.exists():
            return out
        for line in self.path.read_text().splitlines():
            try:
                entry = json.loads(line)
                out[entry["job"]] = [(str(r), int(n), str(h)) for r, n, h in entry["files"]]
            except (ValueError, KeyError, TypeError):
                continue
        return out

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def remove_partials(out_dir: Path) -> int:
    n = 0
    for p in Path(out_dir).rglob(f".*{PARTIAL_SUFFIX}"):
        p.unlink(missing_ok=True)
        n += 1
    return n


def completed_jobs(
    out_dir: Path, options: dict, fingerprint: str, job_outputs: dict[str, list[str]]
) -> dict[str, list[tuple[str, int, str]]]:
    """Check that `out_dir` holds a conversion of the same source with the same options, and
    return the jobs (of `job_outputs`: job -> its output files) whose files were all recorded as
    finished (journal, or the manifest of a complete run) and still match size and sha256."""
    out_dir = Path(out_dir)
    try:
        manifest = read_manifest(out_dir)
    except (OSError, ValueError) as e:
        raise OutputError(
            f"{out_dir / MANIFEST_NAME}: unreadable ({e}); cannot resume, start over with --overwrite"
        ) from None
    if manifest is None:
        raise OutputError(f"{out_dir}: no {MANIFEST_NAME}; this is not an mla-convert output and cannot be resumed")
    recorded = manifest.get("options", {})
    diffs = [f"{k} recorded {recorded.get(k)!r}, requested {v!r}" for k, v in options.items() if recorded.get(k) != v]
    if diffs:
        raise OutputError(f"{out_dir}: cannot resume with different options: {'; '.join(diffs)}")
    if manifest.get("source_fingerprint") != fingerprint:
        raise OutputError(
            f"{out_dir}: cannot resume: it was converted from a different source (fingerprint "
            f"{str(manifest.get('source_fingerprint'))[:12]}..., this source {fingerprint[:12]}...)"
        )
    remove_partials(out_dir)
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
        return path.stat().st_size == size and file_sha256(path) == (size, sha)
    except OSError:
        return False


def crash_point(name: str) -> None:
    """Test hook: MLA_CONVERT_CRASH_AT=NAME kills this process with SIGKILL here, exactly as a
    power cut or the OOM killer would (no cleanup handlers run). Inert unless that variable is set."""
    if os.environ.get("MLA_CONVERT_CRASH_AT") == name:
        os.kill(os.getpid(), signal.SIGKILL)
