"""`convert SOURCE --out DIR --upload OWNER/NAME`: a conversion published on the Hub as it goes,
on a host whose disk holds a few shards (`--max-disk`).

Four stages overlap, each on its own thread (the conversion on the calling thread or its worker
processes): the downloader (--stream) fetches the next job's source shards; the converter writes a
job's files, hashing them as it writes; the checker runs verify's per-file checks on each file
just written, against the source bytes it was made from, while those are still on disk
(verification.written), then lets those shards go; the uploader hands each checked file to the
client's preupload, with the sha256 the converter computed (no second hash: the client is given
it), commits the files in batches (FILES_PER_COMMIT or half the budget, sooner when the disk
budget has a waiter, spaced to keep under the Hub's rate of commits), and deletes a file only once
the commit holding it succeeded. What makes the repo a model (config,
index, the manifests, the card written for OWNER/NAME, the side files) goes in the last commit: a
branch cut short never holds config.json.

Each file's lifecycle is journaled (output.journal: hashed, checked, sent, committed): killed
anywhere, `--resume` asks the Hub what the branch holds and reads the journal; it never sends again
what the branch holds, converts again only what is neither there nor on disk, and downloads only
the shards those jobs (and the checks still to do) read. Every refusal of `upload` comes before the
first byte here too (publish.upload.hub_state: the token, the Hub in reach; the repo and branch,
another model, the card's metadata), and so does the budget's (publish.disk_plan).

Transient failures (a 5xx, a 429 with its Retry-After, a reset connection, a timeout) are tried
again after a wait (source.hub.retrying); anything else is one line, exit 2, the state kept for a
--resume. A commit whose answer was lost is not sent twice: the branch is asked first.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mla_convert.constants import (
    CARD_NAME,
    GITATTRIBUTES_NAME,
    LEFT_RUNNING_THREAD_PREFIX,
    MANIFEST_NAME,
    STAGING_DIR_NAME,
)
from mla_convert.conversion.finalize import card_facts
from mla_convert.conversion.sink import Run, Sink
from mla_convert.conversion.stages import CHECK, UPLOAD, StageClock
from mla_convert.errors import ConvertError, OutputError, SourceError, UploadError
from mla_convert.output.card import build_card, read_source_card, render_card, with_source_card
from mla_convert.output.card_facts import SourceRef
from mla_convert.output.journal import CHECKED, COMMITTED, SENT, Held, JobFiles, Journal, known_files
from mla_convert.output.manifest import readable_manifest
from mla_convert.plan.planner import Plan
from mla_convert.process.interrupts import crash_point
from mla_convert.publish import remote as R
from mla_convert.publish.contents import git_blob_sha1
from mla_convert.publish.disk_plan import (
    DiskPlan,
    default_budget,
    disk_plan,
    file_sizes,
    parse_size,
    resume_minimum,
)
from mla_convert.publish.upload import hub_state
from mla_convert.results import ConversionResult
from mla_convert.settings import MessageFn, Options, RunSettings, UploadOptions
from mla_convert.source import hub
from mla_convert.units import gb
from mla_runtime.safetensors_file import file_digest

FILES_PER_COMMIT = 50  # the Hub asks for under 100 files a commit
COMMITS_PER_HOUR = 100  # the Hub answers 429 past about 128 commits an hour
RATE_WINDOW = 3600.0  # seconds: the hour of COMMITS_PER_HOUR
CHECK_THREAD_NAME = LEFT_RUNNING_THREAD_PREFIX + "check"
UPLOAD_THREAD_NAME = LEFT_RUNNING_THREAD_PREFIX + "hub-upload"
POLL = 0.2  # seconds: how often a waiting stage looks at the others' state
_STOP = "stop"  # tells a stage thread to end


class CheckFailed(ConvertError):
    """A file failed verify's checks before it was sent: it is not uploaded."""

    exit_code = 1


@dataclass(frozen=True)
class Target:
    """Where `convert --upload` publishes, and how (UploadOptions' meaning)."""

    repo_id: str
    revision: str = "main"
    create: bool = False
    private: bool = False
    overwrite: bool = False
    max_disk: int | None = None  # bytes; None: publish.disk_plan.default_budget


@dataclass
class _Local:
    """An output file on its way up: where it is in its lifecycle, and the room it holds."""

    rel: str
    size: int
    sha256: str
    room: int  # bytes of the budget it holds until deleted
    op: object = None  # the client's CommitOperationAdd, once preuploaded


class HubSink(Sink):
    """The sink (conversion.sink) of `convert --upload`: see the module docstring."""

    active = True

    def __init__(self, target: Target, out_dir: Path, resume: bool, dry_run: bool, status: MessageFn | None = None):
        self.t, self.out_dir, self.resume, self.dry_run = target, Path(out_dir), resume, dry_run
        self.status = status or (lambda message: None)
        self.clock = StageClock()
        self.remote = R.Remote(target.repo_id, target.revision)
        self.budget = None
        self.plan: Plan | None = None
        self.needed: DiskPlan | None = None
        self.sizes: dict[str, int] = {}
        self.shard_sizes: dict[str, int] | None = None  # a Hub source's shards (None: a local source)
        self._held: dict[str, R.RemoteFile] = {}
        self.missing: tuple[str, ...] = ()  # what --create makes
        self.deletions: tuple[str, ...] = ()  # another model's files the last commit deletes (--overwrite)
        self.kept_local: dict[str, JobFiles] = {}  # kept jobs' files still on disk, by job
        self.recheck: list[str] = []
        self.error: BaseException | None = None
        self.checks: queue.Queue = queue.Queue()
        self.stopped = threading.Event()  # the run failed: nothing more is checked, sent or committed
        self.uploads: queue.Queue = queue.Queue()
        self.done = threading.Event()  # the last commit landed
        self.threads: list[threading.Thread] = []
        self.commit_times: collections.deque[float] = collections.deque()
        self.commits: list[str] = []
        self.counts = collections.Counter()  # checked, sent and skipped files and bytes
        self._head: str | None = None

    # --- before the first byte --------------------------------------------------------------------

    @property
    def held(self) -> Held:
        """What the branch holds at its recorded sha256 (its LFS files), for --resume."""
        return {p: (rf.size, rf.sha256) for p, rf in self._held.items() if rf.sha256 is not None}

    def planned(self, plan: Plan, repo: hub.HubRepo | None, origin: SourceRef | None = None) -> dict:
        """Every refusal of the upload and of the budget, from the plan and the Hub; the result's
        fields (a dry run's are all it gives)."""
        self.plan = plan
        shard_sizes = None
        if repo is not None:
            shard_sizes = {f: repo.files[f].size or 0 for f in set(plan.source.weight_map.values())}
        self.shard_sizes = shard_sizes
        self.needed, self.sizes = disk_plan(plan, shard_sizes), file_sizes(plan)
        limit = self.t.max_disk if self.t.max_disk is not None else default_budget(self.needed, self.out_dir)
        if limit < self.needed.minimum:
            raise OutputError(
                f"--max-disk {gb(limit)} is too small for this conversion: it needs at least {gb(self.needed.minimum)} "
                f"on disk at once (the largest job's source shards and output files); give --max-disk "
                f"{-(-self.needed.minimum // 10**6)}MB or more"
            )
        from mla_convert.output.budget import DiskBudget

        self.budget = DiskBudget(limit)
        self.budget.force(self.needed.staged)  # in --out from the start: the bookkeeping, a Hub source's small files
        fields = {
            "upload_repo": self.t.repo_id,
            "upload_revision": self.t.revision,
            "disk_budget": limit,
            "disk_budget_min": self.needed.minimum,
            "disk_peak_planned": min(limit, self.needed.everything),
        }
        self.status(f"asking the Hub about {self.t.repo_id}")
        private, held = hub_state(self.remote)
        self._check_target(plan, private, held)
        self._held = held or {}
        self._validate_card(plan, origin)
        return fields

    def _check_target(self, plan: Plan, private: bool | None, held: dict[str, R.RemoteFile] | None) -> None:
        t, where = self.t, f"{self.t.repo_id} (branch {self.t.revision})"
        if private is None:
            if not t.create:
                raise UploadError(
                    f"{t.repo_id}: no such model repo on the Hub (or the token cannot see it); pass --create to make it"
                )
            self.missing = ("repo",) if t.revision == "main" else ("repo", "branch")
            return
        if t.private and not private:
            raise UploadError(
                f"{t.repo_id} exists and is public; --private does not change that: make it private on the Hub "
                "first, or leave out --private"
            )
        if held is None:
            if not t.create:
                raise UploadError(f"{where}: no such branch; pass --create to make it (from main)")
            self.missing = ("branch",)
            return
        writes = plan.writes() | {MANIFEST_NAME}
        known = known_files(self.out_dir, readable_manifest(self.out_dir) or {}) if self.resume else {}
        foreign = sorted(p for p in held if p not in writes and p != GITATTRIBUTES_NAME)
        differ, unknown = [], []
        for p in sorted(set(held) & writes):
            rf = held[p]
            if p not in known:
                unknown.append(p)
            elif rf.sha256 is not None and (rf.size, rf.sha256) != known[p]:
                differ.append(p)
        if (foreign or differ) and not t.overwrite:
            from mla_convert.output.out_dir import first_and_others

            what = "; ".join(x for x in (f"{first_and_others(differ)} differ from this run's" if differ else "",
                                         f"{first_and_others(foreign)} not of this conversion" if foreign else "") if x)  # fmt: skip
            raise UploadError(
                f"{where} holds another model ({what}); pass --overwrite to replace its files (what this conversion "
                "does not write is deleted by the last commit), or upload to another repo or --upload-branch"
            )
        if unknown and not (self.resume or t.overwrite):
            from mla_convert.output.out_dir import first_and_others

            raise UploadError(
                f"{where} already holds {first_and_others(unknown)}, which this run did not send; pass --resume with the --out "
                "of the run that sent them, or --overwrite to replace them"
            )
        self.deletions = tuple(foreign)

    def _validate_card(self, plan: Plan, origin: SourceRef | None) -> None:
        """The card as it will be written for the repo, through the Hub's own validation."""
        if not plan.options.card:
            return
        src = plan.source
        source_card = src.root / CARD_NAME if CARD_NAME in src.side_files else None
        origin = with_source_card(origin or SourceRef(path=str(src.root)), source_card)
        facts = dataclasses.replace(card_facts(plan, origin), repo_id=self.t.repo_id,
                                    repo_revision=self.t.revision if self.t.revision != "main" else None)  # fmt: skip
        text = build_card(facts, read_source_card(source_card) if source_card is not None else None)
        self.remote.validate_card(self.out_dir / CARD_NAME, text)

    # --- the run ----------------------------------------------------------------------------------

    def _sort_kept(self, kept: dict[str, JobFiles], lifecycle: dict) -> tuple[dict, dict, list[str]]:
        """The kept jobs' files on the branch and on disk (by job), and the jobs whose files on disk
        the journal does not record as checked (their source shards are needed again)."""
        on_branch, local, recheck = {}, {}, []
        for job, files in kept.items():
            on_branch[job] = [f for f in files if self.held.get(f[0]) == (f[1], f[2])]
            local[job] = [f for f in files if self.held.get(f[0]) != (f[1], f[2])]
            if local[job] and not all(
                lifecycle.get(rel) and lifecycle[rel].reached(CHECKED) for rel, _, _ in local[job]
            ):
                recheck.append(job)
        return on_branch, local, recheck

    def resumed(self, kept: dict[str, JobFiles]) -> dict:
        """--resume: the budget against what the earlier run left. Its files on disk hold their room
        until committed, the unchecked ones until checked, and each check needs its job's source
        shards again: a budget that cannot hold them is refused now, naming the smallest that
        works (the default grows to it). The result's fields."""
        if not self.resume:
            return {}
        _, local, recheck = self._sort_kept(kept, Journal(self.out_dir).files())
        unchecked = {job: sum(size for _, size, _ in local[job]) for job in recheck}
        todo = [job.file for job in self.plan.shards if job.file not in kept]
        minimum = resume_minimum(self.plan, self.shard_sizes, self.needed, unchecked, todo, _leftovers(self.out_dir))
        limit = self.budget.limit if self.t.max_disk is not None else max(self.budget.limit, minimum)
        if limit < minimum:
            raise OutputError(
                f"--max-disk {gb(limit)} is too small to resume this run: the files it left in {self.out_dir} "
                f"unchecked ({gb(sum(unchecked.values()))}), the source shards to check them against and those "
                "it downloaded ahead need at least "
                f"{gb(minimum)} on disk at once; give --max-disk {-(-minimum // 10**6)}MB or more"
            )
        self.budget.limit = limit
        return {
            "disk_budget": limit,
            "disk_budget_min": minimum,
            "disk_peak_planned": min(limit, self.needed.everything),
        }

    def to_check(self, kept: dict[str, JobFiles]) -> list[str]:
        """Sort the kept jobs' files: on the branch (journaled as committed, their local copies
        deleted), or on disk (their room counted; checked again where the journal does not say
        they were). Returns the jobs to check, whose source shards are needed again."""
        journal = Journal(self.out_dir)
        lifecycle = journal.files()
        on_branch, local, self.recheck = self._sort_kept(kept, lifecycle)
        head = None
        for job in kept:
            for rel, size, _ in on_branch[job]:
                record = lifecycle.get(rel)
                if record is None or not record.on_hub:
                    head = head or self.remote.head()
                    journal.advance([rel], COMMITTED, repo=self.t.repo_id, revision=self.t.revision, commit=head)
                (self.out_dir / rel).unlink(missing_ok=True)
                self.counts["skipped_files"] += 1
                self.counts["skipped_bytes"] += size
            for _, size, _ in local[job]:
                self.budget.force(size)
            if local[job]:
                self.kept_local[job] = local[job]
        return list(self.recheck)

    def extra(self, job: str) -> int:
        return sum(self.sizes[rel] for rel in self.plan.job_outputs()[job])

    def admit(self, job: str, timeout: float | None) -> bool:
        self.raise_error()
        return self.budget.reserve(self.extra(job), timeout)

    def started(self, run: Run, sources) -> None:
        """Make what --create makes, start the checker and the uploader, hand them the kept jobs."""
        self.run, self.sources, self.journal = run, sources, run.journal
        self.plan = run.plan  # a streamed source's is rooted in --out's staging directory by now
        if "repo" in self.missing:
            self.status(f"creating {self.t.repo_id}")
            self.remote.create_repo(self.t.private)
        if "branch" in self.missing:
            self.remote.create_branch()
        for job, files in self.kept_local.items():
            if job in self.recheck:
                self.checks.put((job, files, True))
            else:
                self.uploads.put(files)
        for target, name in ((self._checker, CHECK_THREAD_NAME), (self._uploader, UPLOAD_THREAD_NAME)):
            thread = threading.Thread(target=self._guarded(target), name=name, daemon=True)
            thread.start()
            self.threads.append(thread)

    def written(self, job: str, files: JobFiles, release: Callable[[], None] | None = None) -> None:
        self.raise_error()
        self.checks.put((job, files, False))

    def finishing(self) -> None:
        """Room for the last stage's small files, once the data commits have freed it."""
        self.raise_error()
        self.budget.reserve(self.needed.last_stage)

    def finished(self, files: dict[str, dict]) -> dict:
        """The card written for the repo (as `upload` writes it), the last stage's files journaled,
        then sent in the last commit once every data file is committed. The result's fields."""
        self.raise_error()
        if self.plan.options.card:
            render_card(self.out_dir, repo_id=self.t.repo_id, revision=self.t.revision)
        manifest = readable_manifest(self.out_dir) or {}
        jobs = {rel for rels in self.plan.job_outputs().values() for rel in rels}
        last = [
            (rel, m["size"], m["sha256"]) for rel, m in sorted(manifest.get("files", {}).items()) if rel not in jobs
        ]
        own = file_digest(self.out_dir / MANIFEST_NAME)
        last.append((MANIFEST_NAME, own.size, own.sha256))
        self.journal.record(None, last)
        self.checks.put(("last", last))  # after every job still being checked: the queues keep the order
        while not self.done.wait(POLL):
            self.raise_error()
        self.raise_error()
        sent = self.counts
        return {
            "upload_url": f"{R.endpoint()}/{self.t.repo_id}"
            + ("" if self.t.revision == "main" else f"/tree/{self.t.revision}"),
            "disk_peak": self.budget.peak,
            "checked_files": sent["checked_files"],
            "uploaded_files": sent["sent_files"],
            "uploaded_bytes": sent["sent_bytes"],
            "skipped_files": sent["skipped_files"],
            "skipped_bytes": sent["skipped_bytes"],
            "commits": tuple(self.commits),
            "created": self.missing or None,
            "deleted": self.deletions or None,
            "stage_seconds": self.clock.seconds(),
        }

    def close(self, error: BaseException | None) -> None:
        if error is not None:
            # The run failed: the threads stop after the file at hand, sending and committing
            # nothing more (a library caller's process goes on; its --resume must not race them).
            self.stopped.set()
            if self.budget is not None:
                self.budget.close(error if self.error is None else self.error)
        for q in (self.checks, self.uploads):
            q.put(_STOP)
        for thread in self.threads:
            thread.join(timeout=5 if error is None else 0.2)

    # --- the threads ------------------------------------------------------------------------------

    def raise_error(self) -> None:
        if self.error is not None:
            raise self.error

    def _guarded(self, work: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                work()
            except BaseException as e:  # handed to the converting thread (raise_error), and to the budget's waiters
                if self.error is None:
                    self.error = e
                if self.budget is not None:
                    self.budget.close(e)

        return run

    def _checker(self) -> None:
        while (item := self.checks.get()) != _STOP and not self.stopped.is_set():
            if item[0] == "last":
                self.uploads.put(item)
                continue
            job, files, downloaded_again = item
            if downloaded_again:
                while not self.sources.wait(job, POLL):
                    self.raise_error()
            with self.clock.busy(CHECK):
                failures = _check(self.plan, self.out_dir, files)
            if failures:
                more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
                _raise_read_failure(failures, more, self.plan.source.root)
                raise CheckFailed(
                    f"{failures[0].line()}{more}; not uploaded: the conversion wrote a file verify rejects. Rerun "
                    "the same command with --resume (the file is written again); if it fails again, report it"
                )
            rels = [rel for rel, _, _ in files]
            crash_point(f"check:{job}")
            self.journal.advance(rels, CHECKED)
            self.counts["checked_files"] += len(files)
            self.sources.release(job)
            self.uploads.put(files)

    def _uploader(self) -> None:
        batch: list[_Local] = []
        while True:
            try:
                item = self.uploads.get(timeout=POLL)
            except queue.Empty:
                item = None
            if item == _STOP or self.stopped.is_set():
                return
            if isinstance(item, tuple) and item[0] == "last":
                if batch:
                    self._commit(batch, "data")
                    batch = []
                last = [self._send(f) for f in item[1]]
                crash_point("last-commit")
                self._commit(last, "last", self.deletions)
                _remove_empty_dirs(self.out_dir)
                self.done.set()
                continue
            for f in item or ():
                if self.stopped.is_set():
                    return
                local = self._send(f)
                if local is not None:
                    batch.append(local)
            if self.stopped.is_set():
                return
            room = sum(f.room for f in batch)
            full = len(batch) >= FILES_PER_COMMIT or room >= self.budget.limit // 2
            wanted = self.uploads.empty() and self.budget.waiting > 0 and self._spaced()
            if batch and (full or wanted):
                self._commit(batch, "data")
                batch = []

    def _send(self, f: tuple[str, int, str]) -> _Local | None:
        """One file to the Hub's storage (its room reserved); None when the branch holds it already."""
        from huggingface_hub import CommitOperationAdd

        rel, size, sha = f
        path = self.out_dir / rel
        rf = self._held.get(rel)
        if (
            rf is not None
            and rf.size == size
            and (rf.sha256 == sha or (rf.sha256 is None and rf.blob_id == _blob(path)))
        ):
            self._head = self._head or self.remote.head()  # a commit of the branch holds it
            self.journal.advance([rel], COMMITTED, repo=self.t.repo_id, revision=self.t.revision, commit=self._head)
            self._delete(_Local(rel, size, sha, self._room(rel, size)))
            self.counts["skipped_files"] += 1
            self.counts["skipped_bytes"] += size
            return None
        op = CommitOperationAdd(rel, str(path))
        if op.upload_info.size != size:
            raise OutputError(f"{path}: {op.upload_info.size} bytes, {size} recorded when it was written; not uploaded")
        op.upload_info.sha256 = bytes.fromhex(sha)  # the converter's: the client hashes nothing again
        with self.clock.busy(UPLOAD):
            self.remote.preupload([op])
        crash_point(f"preupload:{rel}")
        if op._upload_mode == "lfs":  # its bytes are on the Hub (a small file's go with the commit)
            self.journal.advance([rel], SENT)
        return _Local(rel, size, sha, self._room(rel, size), op)

    def _room(self, rel: str, size: int) -> int:
        return self.sizes.get(rel, size)

    def _commit(self, batch: list[_Local | None], what: str, deletions: tuple[str, ...] = ()) -> None:
        batch = [f for f in batch if f is not None]
        if not batch and not deletions:
            return
        self._wait_for_rate()
        n = len(self.commits) + 1
        size = sum(f.size for f in batch)
        message = f"mla-convert convert --upload, part {n}: {len(batch)} files, {gb(size)}"
        if what == "last":
            message = f"mla-convert convert --upload, part {n} (last: what makes it a model): {len(batch)} files"
        with self.clock.busy(UPLOAD):
            oid = self.remote.commit([f.op for f in batch], list(deletions), message, _landed(self.remote, batch))
        self.commit_times.append(time.monotonic())
        self.commits.append(oid)
        crash_point(f"commit:{n}")
        self.journal.advance([f.rel for f in batch], COMMITTED, repo=self.t.repo_id, revision=self.t.revision,
                             commit=oid)  # fmt: skip
        self.counts["sent_files"] += len(batch)
        self.counts["sent_bytes"] += size
        for f in batch:
            self._delete(f)

    def _delete(self, f: _Local) -> None:
        """A committed file: deleted here, its room given back; the manifest stays, with the journal
        (what was converted, and where each file went)."""
        if f.rel != MANIFEST_NAME:
            (self.out_dir / f.rel).unlink(missing_ok=True)
            self.budget.release(f.room)

    def _spaced(self) -> bool:
        """Whether a commit for room may go now: at once while the last hour saw fewer than half
        the Hub's rate, else once an even share of the hour has passed since the last (the batch
        grows meanwhile, and the run keeps under the rate without stopping)."""
        now = time.monotonic()
        recent = sum(1 for t in self.commit_times if t > now - RATE_WINDOW)
        return recent < COMMITS_PER_HOUR // 2 or now - self.commit_times[-1] >= RATE_WINDOW / COMMITS_PER_HOUR

    def _wait_for_rate(self) -> None:
        """At most COMMITS_PER_HOUR commits in any hour."""
        while len(self.commit_times) >= COMMITS_PER_HOUR:
            wait = self.commit_times[0] + RATE_WINDOW - time.monotonic()
            if wait <= 0:
                self.commit_times.popleft()
                continue
            self.status(f"waiting {wait:.0f} s: the Hub takes about {COMMITS_PER_HOUR} commits an hour")
            time.sleep(min(wait, POLL * 10))
            self.raise_error()


def _check(plan: Plan, out_dir: Path, files: JobFiles) -> list:
    from mla_convert.verification.written import check_job_files

    return check_job_files(plan, out_dir, files)


def _leftovers(out_dir: Path) -> set[str]:
    """The source shards an earlier --stream run left in its staging directory, whole or not."""
    staging = out_dir / STAGING_DIR_NAME
    found = set()
    for path in [*staging.rglob("*.safetensors"), *staging.rglob(f".*{hub.DOWNLOAD_SUFFIX}")]:
        name = path.name[1 : -len(hub.DOWNLOAD_SUFFIX)] if path.name.endswith(hub.DOWNLOAD_SUFFIX) else path.name
        found.add(path.with_name(name).relative_to(staging).as_posix())
    return found


def _raise_read_failure(failures: list, more: str, source_root: Path) -> None:
    """A check that could not read its bytes (a source shard, or the file just written) says so:
    the conversion is not at fault, and --resume checks the file again."""
    read = next((f for f in failures if f.check == "read"), None)
    if read is None:
        return
    if str(source_root) in read.found:  # the reader's message names the file it could not read
        raise SourceError(
            f"{read.line()}{more}; not uploaded: a source shard it was made from could not be read to check it "
            "against; check the source and the disk, then rerun the same command with --resume"
        )
    raise OutputError(
        f"{read.line()}{more}; not uploaded: the file just written could not be read back to check it; check "
        "the disk, then rerun the same command with --resume (the file is written again)"
    )


def _remove_empty_dirs(root: Path) -> None:
    """The directories the deleted files leave empty (mla/, a side file's), deepest first."""
    for dirpath, _, _ in sorted(os.walk(root), key=lambda entry: -len(entry[0])):
        if Path(dirpath) != root:
            with contextlib.suppress(OSError):
                os.rmdir(dirpath)  # only if empty


def _blob(path: Path) -> str | None:
    try:
        return git_blob_sha1(path)
    except OSError:
        return None


def _landed(remote: R.Remote, batch: list[_Local]) -> Callable[[], bool]:
    """Whether the branch holds every file of `batch` already: a commit whose answer was lost."""

    def landed() -> bool:
        held = remote.files() or {}
        return all((rf := held.get(f.rel)) is not None and rf.size == f.size and (rf.sha256 in (None, f.sha256))
                   for f in batch)  # fmt: skip

    return landed


def convert_and_upload(
    source: str | Path,
    out_dir: str | Path,
    repo_id: str,
    options: Options,
    settings: RunSettings,
    upload_options: UploadOptions,
    max_disk: int | str | None = None,
) -> ConversionResult:
    """`mla_convert.convert(..., upload=repo_id)`: see the module docstring. A Hub source is
    streamed (its shards within the budget); --overwrite replaces an earlier output in `out_dir`
    and another model's files in the branch."""
    from mla_convert.conversion.pipeline import convert
    from mla_convert.publish.upload import check_names
    from mla_convert.source.resolve import is_hub_source

    if upload_options.skip_verify:
        raise ConvertError("skip_verify: `convert --upload` checks each file as it is written, before it is sent")
    revision = check_names(repo_id, upload_options.revision)
    if is_hub_source(str(source)) and not settings.stream:
        settings = dataclasses.replace(settings, stream=True)
    target = Target(
        repo_id, revision, upload_options.create, upload_options.private,
        settings.overwrite or upload_options.overwrite, parse_size(max_disk),
    )  # fmt: skip
    sink = HubSink(target, Path(out_dir), settings.resume, settings.dry_run, settings.status)
    try:
        return convert(source, out_dir, options, settings, sink=sink)
    except UploadError as e:
        if R.RESUMES not in str(e) or not (Path(out_dir) / MANIFEST_NAME).is_file():
            raise
        raise UploadError(str(e).replace(R.RESUMES, RESUMES)) from e


RESUMES = "finish it with the same command and --resume: what the branch holds is not sent again"
