"""`mla-convert verify OWNER/NAME`: a conversion published on the Hub, checked where it is.

    report = verify_repo("org/R1-channel-fp8")                  # no tensor data downloaded
    report = verify_repo("org/R1-channel-fp8", download=True, max_disk=40 * 10**9, source="/data/R1")

Without `download`, from one listing of the branch (each file's size, and the sha256 the Hub keeps
of an LFS file) and the files it keeps in git, fetched (the conversion manifest, the card, the
config, the index: the Hub names a git file by the sha1 of its bytes and the manifest records
sha256, so those bytes are needed; they are small):
- the manifest is a finished conversion's;
- every file it lists is on the branch, at the size and sha256 it records;
- the branch holds nothing else: only the manifest and the Hub's own .gitattributes beside them
  (what `upload` puts there);
- the card's metadata names the source and format the manifest records (card).
Structure, values, source and MLA are skipped: they read the files.

With `download`, every check of a local verify (and `source`): the branch is mirrored in a work
directory, its git files as they are and each LFS file as a stand-in (its header over a hole, by
two range requests: the header pass reads nothing else), and verify runs on that directory
(api.verify_with). Its data pass downloads each file in turn over its stand-in, checks it as a
local verify does (data_pass.run_file_task), and deletes it once no check needs it (an MLA layer
file reads its kv_b_proj from a model shard, which stays until then); the next files download
while one is checked. The order is planned first: the files on disk at once never pass
`max_disk`, and a budget below what the plan needs is refused before the first byte.

Errors (no network, no such repo or revision, no manifest, a budget too small) are one
VerificationError line (exit 2); a failed check is a failure in the report (exit 1).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import struct
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from mla_convert.constants import GITATTRIBUTES_NAME, LEFT_RUNNING_THREAD_PREFIX, MANIFEST_NAME
from mla_convert.errors import ConvertError, SourceError, VerificationError
from mla_convert.output.manifest import is_conversion_manifest
from mla_convert.settings import MessageFn, Options, ProgressFactory
from mla_convert.source import hub
from mla_convert.units import gb
from mla_convert.verification.api import verify_with
from mla_convert.verification.bounds import TOLERANCES
from mla_convert.verification.card import check_card
from mla_convert.verification.data_pass import run_file_task
from mla_convert.verification.report import INTEGRITY, MLA, SOURCE, STRUCTURE, VALUES, Tally, as_report
from mla_convert.verification.tasks import FileResult, FileTask

FETCH_THREAD_NAME = LEFT_RUNNING_THREAD_PREFIX + "verify-download"
HASH_CHUNK = 1 << 20
MAX_HEADER = 100 << 20  # safetensors' own limit on a header; a longer one is read that far (and refused)
NOT_READ = "not downloaded (--download reads every file)"


@dataclass(frozen=True)
class HubFile:
    path: str
    size: int
    sha256: str | None  # an LFS file's, as the Hub records it
    blob_id: str | None  # a git file's object id (sha1 of its bytes)


@dataclass(frozen=True)
class Branch:
    repo_id: str
    revision: str
    commit: str
    files: dict[str, HubFile]  # the Hub's .gitattributes left out

    @property
    def label(self) -> str:
        return f"{self.repo_id} ({self.revision}, commit {self.commit[:12]})"

    def lfs(self) -> list[str]:
        return sorted(p for p, f in self.files.items() if f.sha256 is not None)

    def git(self) -> list[str]:
        return sorted(p for p, f in self.files.items() if f.sha256 is None)


def verify_repo(
    repo_id: str,
    *,
    revision: str | None = None,
    source: str | Path | None = None,
    download: bool = False,
    max_disk: int | None = None,
    progress_factory: ProgressFactory | None = None,
    status: MessageFn | None = None,
    notice: MessageFn | None = None,
):
    """The report on the conversion published at `repo_id` (branch or commit `revision`, default
    main): see the module docstring. `max_disk` (bytes, with `download`): what the work directory
    may hold at once (default: what the plan needs, plus one file downloading ahead). `status`:
    what runs now; `notice`: what was downloaded, and the most on disk at once."""
    t0 = time.perf_counter()
    status = status or (lambda message: None)
    if source is not None and not download:
        raise VerificationError("--source compares every tensor with the source: it needs --download")
    if max_disk is not None and not download:
        raise VerificationError("--max-disk bounds what --download holds at once: it needs --download")
    status(f"asking the Hub about {repo_id}")
    branch = list_branch(repo_id, revision or "main")
    base = Path(tempfile.mkdtemp(prefix="mla-convert-verify-"))
    try:
        root, scratch = base / "repo", base / "download"
        root.mkdir()
        status(f"fetching the small files of {branch.label}")
        digests = {rel: _fetch(branch, rel, root, scratch) for rel in branch.git()}
        if MANIFEST_NAME in branch.files and MANIFEST_NAME not in digests:  # kept in LFS: fetched all the same
            _fetch(branch, MANIFEST_NAME, root, scratch)
        manifest = _read_manifest(branch, root)
        if not download:
            report = _listing_report(branch, manifest, root, digests)
            return dataclasses.replace(report, seconds=round(time.perf_counter() - t0, 3))
        status(f"reading the shard headers of {branch.label}")
        for rel in branch.lfs():
            if rel != MANIFEST_NAME:
                _stand_in(branch, rel, root)
        fetcher = _Fetcher(branch, root, scratch, max_disk, sum(f.size for f in map(branch.files.get, digests)))
        report = verify_with(root, source, fetcher.run, label=branch.label, progress_factory=progress_factory)
        if notice is not None:
            notice(
                f"downloaded {gb(fetcher.downloaded)} from {branch.label}; at most {gb(fetcher.peak)} on disk at once"
            )
        return dataclasses.replace(report, seconds=round(time.perf_counter() - t0, 3))
    finally:
        shutil.rmtree(base, ignore_errors=True)


# ---- the branch


@contextlib.contextmanager
def _hub_errors(repo_id: str, revision: str):
    try:
        with hub.hub_errors(repo_id, revision):
            yield
    except SourceError as e:
        raise VerificationError(str(e)) from e


def list_branch(repo_id: str, revision: str) -> Branch:
    """The files of one commit of the repo, with sizes and what the Hub records of their bytes."""
    from huggingface_hub import HfApi, errors

    with _hub_errors(repo_id, revision):
        try:
            info = HfApi().model_info(repo_id, revision=revision, files_metadata=True)
        except errors.RepositoryNotFoundError as e:
            if isinstance(e, errors.GatedRepoError):
                raise
            raise VerificationError(
                f"{repo_id}: no such directory here, and no such model repo on the Hub (or the token cannot see it: "
                "log in with hf auth login)"
            ) from e
    files = {
        s.rfilename: HubFile(s.rfilename, s.size or 0, s.lfs.sha256 if s.lfs else None, None if s.lfs else s.blob_id)
        for s in info.siblings or []
        if s.rfilename != GITATTRIBUTES_NAME
    }
    return Branch(repo_id, revision, info.sha, files)


def _fetch(branch: Branch, rel: str, root: Path, scratch: Path) -> tuple[str, str]:
    """Download `rel` (of the branch's commit) to root/rel; its (sha256, git blob sha1)."""
    from huggingface_hub import hf_hub_download

    with _hub_errors(branch.repo_id, branch.revision):
        got = Path(hf_hub_download(branch.repo_id, rel, revision=branch.commit, local_dir=scratch))
    dest = root / rel
    dest.parent.mkdir(parents=True, exist_ok=True)
    os.replace(got, dest)
    sha256, sha1 = hashlib.sha256(), hashlib.sha1(b"blob %d\0" % dest.stat().st_size)
    with open(dest, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            sha256.update(chunk)
            sha1.update(chunk)
    return sha256.hexdigest(), sha1.hexdigest()


def _read_manifest(branch: Branch, root: Path) -> dict:
    where = f"{branch.label}: {MANIFEST_NAME}"
    if MANIFEST_NAME not in branch.files:
        raise VerificationError(f"{branch.label}: not an mla-convert output: no {MANIFEST_NAME} on the branch")
    try:
        manifest = json.loads((root / MANIFEST_NAME).read_bytes())
    except ValueError as e:
        raise VerificationError(f"{where}: unreadable conversion manifest ({e})") from e
    if not is_conversion_manifest(manifest):
        raise VerificationError(f"{where}: not an mla-convert manifest (no tool/files entries)")
    return manifest


# ---- without --download: the listing against the manifest


def _listing_report(branch: Branch, manifest: dict, root: Path, digests: dict[str, tuple[str, str]]):
    tally = Tally()
    status = manifest.get("status")
    tally.expect(
        status == "complete", INTEGRITY, "status", MANIFEST_NAME,
        expected="status 'complete'", found=f"status {status!r}: the conversion did not finish",
    )  # fmt: skip
    for rel, (_, sha1) in sorted(digests.items()):
        tally.expect(
            sha1 == branch.files[rel].blob_id, INTEGRITY, "download", rel,
            expected=f"git blob {branch.files[rel].blob_id} (the Hub's record)", found=f"{sha1} (the bytes fetched)",
        )  # fmt: skip
    listed: dict = manifest["files"]
    for rel in sorted(listed):
        meta = listed[rel] if isinstance(listed[rel], dict) else {}
        f = branch.files.get(rel)
        if f is None:
            tally.fail(INTEGRITY, "missing-file", rel, expected=f"{meta.get('size')} bytes", found="not on the branch")
            continue
        tally.expect(f.size == meta.get("size"), INTEGRITY, "size", rel, expected=meta.get("size"), found=f.size)
        sha256 = f.sha256 if f.sha256 is not None else digests[rel][0]
        whose = "the Hub's record" if f.sha256 is not None else "of its bytes"
        tally.expect(
            sha256 == meta.get("sha256"), INTEGRITY, "sha256", rel,
            expected=meta.get("sha256"), found=f"{sha256} ({whose})",
        )  # fmt: skip
    for rel in sorted(set(branch.files) - set(listed) - {MANIFEST_NAME}):
        tally.fail(
            INTEGRITY, "unlisted-file", rel,
            expected="only the files the manifest lists, as upload puts them", found="a file the conversion did not write",
        )  # fmt: skip
    check_card(root, manifest, tally)
    options = manifest.get("options") or {}
    skipped = dict.fromkeys((STRUCTURE, VALUES, MLA), NOT_READ) | {SOURCE: "no --source given"}
    info = {
        "dir": branch.label, "source": None, "format": options.get("format"), "target": options.get("target"),
        "fp8_max": _fp8_max(options), "files": len(branch.files), "tensors": 0, "mla_layers": 0, "workers": 1,
        "readers": "none", "readers_reason": "no tensor values read", "tolerances": TOLERANCES,
    }  # fmt: skip
    return as_report(tally, skipped, info)


def _fp8_max(options: dict) -> float | None:
    try:
        return Options(format=options["format"], target=options["target"]).fp8_max
    except (ConvertError, KeyError, TypeError):  # an unusable record: the report says nothing of the range
        return None


# ---- with --download: a mirror of stand-ins, each file brought in for its check


def _stand_in(branch: Branch, rel: str, root: Path) -> None:
    """root/rel at the file's size, its first bytes the file's own (a safetensors header: its 8-byte
    length and the header, by two range requests), a hole after them: what the header pass reads
    of it is what it would read of the file."""
    size = branch.files[rel].size
    head = b""
    if rel.endswith(".safetensors") and size >= 8:
        head = _range(branch, rel, 0, 7)
        n = min(struct.unpack("<Q", head)[0], size - 8, MAX_HEADER)
        head += _range(branch, rel, 8, 8 + n - 1) if n > 0 else b""
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(size)


def _range(branch: Branch, rel: str, start: int, end: int) -> bytes:
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    url = hf_hub_url(branch.repo_id, rel, revision=branch.commit)
    with _hub_errors(branch.repo_id, branch.revision):
        r = get_session().get(
            url, headers={**build_hf_headers(), "range": f"bytes={start}-{end}"}, follow_redirects=True
        )
        hf_raise_for_status(r)
    return r.content[: end - start + 1]


class _Fetcher:
    """The data pass over the mirror: each task's LFS files downloaded over their stand-ins (the
    next ones while a task is checked), the task run as a local verify runs it, each file deleted
    once no task left needs it; within `budget` bytes with the `base` of git files already here."""

    def __init__(self, branch: Branch, root: Path, scratch: Path, budget: int | None, base: int):
        self.branch, self.root, self.scratch, self.budget, self.base = branch, root, scratch, budget, base
        self.on_disk = self.peak = base
        self.downloaded = 0
        self.cond = threading.Condition()
        self.error: BaseException | None = None
        self.stopping = False

    def run(self, tasks: list[FileTask], root: Path, workers: int, progress_factory) -> dict[str, FileResult]:
        position = {rel: i for i, rel in enumerate(self.branch.lfs())}
        needs = {t.rel: self._needs(t, set(position)) for t in tasks}
        order = sorted(tasks, key=lambda t: _order_key(t, needs[t.rel], position))
        users: dict[str, int] = {}
        for t in order:
            for rel in needs[t.rel]:
                users[rel] = users.get(rel, 0) + 1
        self._check_budget(order, needs, dict(users))
        ready = {t.rel: threading.Event() for t in order}
        thread = threading.Thread(
            target=self._download, args=(order, needs, ready), name=FETCH_THREAD_NAME, daemon=True
        )
        sizes = sum(self.branch.files[t.rel].size for t in order if t.rel in self.branch.files)
        advance = progress_factory(sizes) if progress_factory else None
        results = {}
        thread.start()
        try:
            for t in order:
                ready[t.rel].wait()
                if self.error is not None:
                    raise self.error
                results[t.rel] = self._check(t, advance)
                self._release(needs[t.rel], users)
        finally:
            with self.cond:
                self.stopping = True
                self.cond.notify_all()
            thread.join(timeout=0.5)
        return {t.rel: results[t.rel] for t in tasks}

    def _needs(self, task: FileTask, remote: set[str]) -> tuple[str, ...]:
        """The LFS files a task reads: its own, and a partner's (a channel scale, an MLA layer's
        kv_b_proj and its scale)."""
        refs = [j.scale for j in task.tensors.values()]
        if task.mla is not None:
            refs += [task.mla.kv_b, task.mla.kv_b_scale]
        paths = [Path(r.path) for r in refs if r is not None]
        rels = {task.rel} | {p.relative_to(self.root).as_posix() for p in paths if p.is_relative_to(self.root)}
        return tuple(sorted(rels & remote))

    def _check_budget(self, order: list[FileTask], needs: dict, users: dict[str, int]) -> None:
        """The plan's peak (one task at a time, in order) within the budget and the free space,
        else refused before the first download."""
        present: set[str] = set()
        peak, at_peak = 0, ()
        for t in order:
            present |= set(needs[t.rel])
            held = sum(self.branch.files[r].size for r in present)
            if held > peak:
                peak, at_peak = held, tuple(sorted(present))
            for rel in needs[t.rel]:
                users[rel] -= 1
                if users[rel] == 0:
                    present.discard(rel)
        largest = max((self.branch.files[r].size for r in self.branch.lfs()), default=0)
        if self.budget is None:
            self.budget = self.base + peak + largest
        elif self.budget < self.base + peak:
            raise VerificationError(
                f"--max-disk {gb(self.budget)}: checking {self.branch.repo_id} needs at least {gb(self.base + peak)} "
                f"on disk at once ({', '.join(at_peak)} with its small files); pass at least that"
            )
        free = shutil.disk_usage(self.root).free
        if free < peak:
            raise VerificationError(
                f"{self.root.parent}: {gb(free)} free, checking {self.branch.repo_id} needs {gb(peak)} at once; free "
                "some space, or set TMPDIR to a filesystem with more"
            )

    def _download(self, order: list[FileTask], needs: dict, ready: dict[str, threading.Event]) -> None:
        fetched: set[str] = set()
        try:
            for t in order:
                for rel in needs[t.rel]:
                    if rel in fetched:
                        continue
                    size = self.branch.files[rel].size
                    with self.cond:
                        self.cond.wait_for(lambda size=size: self.stopping or self.on_disk + size <= self.budget)
                        if self.stopping:
                            return
                        self.on_disk += size
                        self.peak = max(self.peak, self.on_disk)
                    _fetch_over(self.branch, rel, self.root, self.scratch)
                    fetched.add(rel)
                    self.downloaded += size
                ready[t.rel].set()
        except BaseException as e:  # raised in the checking thread
            self.error = e
            for ev in ready.values():
                ev.set()

    def _check(self, task: FileTask, advance) -> FileResult:
        result = run_file_task(task, advance)
        f = self.branch.files.get(task.rel)
        if f is not None and f.sha256 is not None and result.sha256 is not None:
            result.tally.expect(
                result.sha256 == f.sha256, INTEGRITY, "hub-sha256", task.rel,
                expected=f"{f.sha256} (the Hub's record)", found=f"{result.sha256} (the bytes downloaded)",
            )  # fmt: skip
        return result

    def _release(self, rels: tuple[str, ...], users: dict[str, int]) -> None:
        with self.cond:
            for rel in rels:
                users[rel] -= 1
                if users[rel] == 0:
                    (self.root / rel).unlink(missing_ok=True)
                    self.on_disk -= self.branch.files[rel].size
            self.cond.notify_all()


def _order_key(task: FileTask, needs: tuple[str, ...], position: dict[str, int]) -> tuple:
    """Git files first; then by the last LFS file a task reads, its own task before the ones that
    read it too (an MLA layer file right after the shard holding its kv_b_proj)."""
    last = max((position[r] for r in needs), default=-1)
    return (last, 0 if position.get(task.rel, -2) == last else 1, task.rel)


def _fetch_over(branch: Branch, rel: str, root: Path, scratch: Path) -> None:
    """`rel` downloaded over its stand-in."""
    from huggingface_hub import hf_hub_download

    with _hub_errors(branch.repo_id, branch.revision):
        got = Path(hf_hub_download(branch.repo_id, rel, revision=branch.commit, local_dir=scratch))
    os.replace(got, root / rel)
