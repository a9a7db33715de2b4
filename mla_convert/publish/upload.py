"""`mla-convert upload DIR REPO_ID`: a finished conversion to one branch of a Hub model repo.

    job = prepare("/data/R1-channel-fp8", "org/R1-channel-fp8", UploadOptions(create=True))  # every check
    result = run(job)                                                                        # the commits

`prepare` does everything that can refuse the upload before any byte goes up, and before it
writes anything: the directory is exactly what its manifest lists (publish.contents); there is a
token and the Hub answers (both named at once when neither holds); the Hub has the repo and branch
(or --create will make them), and what the branch holds is either this upload's files already (a
resume: they are skipped) or another model's (refused unless --overwrite); the Hub accepts the
card's metadata; and verify's structure and integrity checks pass (every file hashed;
--skip-verify). Only then is the card written for the repo (and recorded in the manifest), as it
was compared with the branch.

`run` makes the repo and the branch if asked, then hands the files the branch does not hold at the
same sha256 to the client's own upload_folder, in two calls (publish.contents): the data, then
what makes the repo a model. The client sends and commits them (with hf_xet, its streamed Xet
pipeline, in commits of its choosing; without, one create_commit over LFS). An interrupted upload
is resumed by the same command: it lists the branch again and sends only what is not there, and
the Hub's storage skips content it holds already.
"""

from __future__ import annotations

import functools
import queue
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from mla_convert.constants import CARD_NAME, GITATTRIBUTES_NAME, LEFT_RUNNING_THREAD_PREFIX
from mla_convert.errors import UploadError
from mla_convert.output.card import BASE_MODEL_HINT, render_card
from mla_convert.output.card_facts import SourceRef
from mla_convert.output.out_dir import first_and_others
from mla_convert.publish import remote as R
from mla_convert.publish.contents import Contents, UploadFile, commits_of, git_blob_sha1, read_contents, rewritten
from mla_convert.results import UploadResult
from mla_convert.settings import MessageFn, ProgressFactory, UploadOptions, is_repo_id
from mla_convert.units import gb

UPLOAD_THREAD_NAME = LEFT_RUNNING_THREAD_PREFIX + "upload"  # an interrupted command does not wait for it
TICK_SECONDS = 1.0  # how often the progress is told that time passed (for the log lines)


@dataclass
class UploadJob:
    """A prepared upload; `run` fills in `done`, which an interrupted command reports."""

    contents: Contents
    repo_id: str
    revision: str
    private: bool
    dry_run: bool
    commits: list[list[UploadFile]]  # every commit of the upload, in order
    on_hub: frozenset[str] = frozenset()  # files the branch holds already
    deletions: tuple[str, ...] = ()  # the other model's files the last commit deletes (--overwrite)
    missing: tuple[str, ...] = ()  # what --create makes: "repo", "branch"
    verified: str = ""
    done: list[str] = field(default_factory=list)  # the commits made so far
    deleted: tuple[str, ...] = ()  # what the last commit, once made, deleted
    sent_files: int = 0
    sent_bytes: int = 0
    card: str | None = None  # results.UploadResult.card
    base_model_hint: str | None = None

    def to_send(self) -> list[list[UploadFile]]:
        return [[f for f in commit if f.rel not in self.on_hub] for commit in self.commits]


def prepare(
    out_dir: str | Path,
    repo_id: str,
    options: UploadOptions | None = None,
    *,
    check_progress: ProgressFactory | None = None,
    status: MessageFn | None = None,
) -> UploadJob:
    """Every check, in that order; UploadError (or VerificationError) naming what to do if one fails.
    A dry run reads the manifest and the sizes only: no network, no hashing. `check_progress`:
    for verify's reading of every file."""
    status = status or (lambda message: None)
    options = options or UploadOptions()
    revision = check_names(repo_id, options.revision)
    status(f"reading {out_dir}")
    contents = read_contents(Path(out_dir))
    if options.dry_run:
        job = UploadJob(contents, repo_id, revision, options.private, True, commits_of(list(contents.files)))
        job.verified = "not run (a dry run reads the manifest and the file sizes only)"
        job.card, job.base_model_hint = _card_state(contents, repo_id, written=False)
        return job
    status(f"asking the Hub about {repo_id}")
    remote = R.Remote(repo_id, revision)
    private, held = hub_state(remote)
    # The card names the repo (download and serve lines): the directory and the repo hold the same
    # card, written here only once nothing can refuse the upload; until then, as it will be.
    card = _card_for(contents, repo_id, revision)
    planned = contents if card is None or not card.changed else rewritten(contents, card.text, card.manifest)
    job = UploadJob(planned, repo_id, revision, options.private, False, commits_of(list(planned.files)))
    job.card, job.base_model_hint = _card_state(planned, repo_id, card is not None and card.changed)
    _compare_with_hub(job, private, held, options.create, options.overwrite)
    if card is not None:
        remote.validate_card(contents.root / CARD_NAME, card.text)
    gone = [f.rel for f in contents.sent if not (contents.root / f.rel).exists()]
    if options.skip_verify:
        job.verified = "skipped (--skip-verify)"
    elif gone:  # the directory is not all here: its files were checked one by one before they were sent
        job.verified = f"by `convert --upload`, each file before it was sent ({len(gone)} sent and deleted here)"
    else:
        status(f"checking {out_dir}: structure and integrity")
        job.verified = _verify(contents.root, check_progress)
    if card is not None and card.changed:
        render_card(contents.root, repo_id=repo_id, revision=revision)
        job.contents = read_contents(contents.root)
        if _listing(job.contents) != _listing(planned):
            raise UploadError(f"{contents.root}: changed while it was checked; run the command again")
    return job


def _listing(contents: Contents) -> list[tuple[str, int, str]]:
    return [(f.rel, f.size, f.sha256) for f in contents.files]


def hub_state(remote: R.Remote) -> tuple[bool | None, dict[str, R.RemoteFile] | None]:
    """(whether the repo is private, None: no such repo; what the branch holds, None: no such
    branch). Without a token the Hub is only asked whether it answers (the repo may be one the
    token would see): no token and no Hub are both said, in one line."""
    token = R.token_problem()
    try:
        private = remote.visibility()
        held = remote.files() if private is not None and token is None else None
    except R.Unreachable as e:
        raise UploadError("; also, ".join(x for x in (token, str(e)) if x)) from e
    except UploadError:
        if token is None:
            raise
        private, held = None, None
    if token is not None:
        raise UploadError(token)
    return private, held


def _card_for(contents: Contents, repo_id: str, revision: str):
    """The card as it will be written for `repo_id` (output.card.RenderedCard, nothing written);
    None for a conversion with --no-card (the source's README goes up as it is)."""
    if not (contents.manifest.get("options") or {}).get("card"):
        return None
    return render_card(contents.root, repo_id=repo_id, revision=revision, write=False)


def _card_state(contents: Contents, repo_id: str, written: bool) -> tuple[str | None, str | None]:
    """What the result says of the card: for which repo it is written, and, when it names no base
    model, how to set it."""
    manifest = contents.manifest
    if not (manifest.get("options") or {}).get("card"):
        return None, None
    card = f"written for {repo_id}" if written else f"already written for {repo_id}"
    if (manifest.get("card") or {}).get("repo_id") != repo_id and not written:
        card = f"to be written for {repo_id}"  # a dry run writes nothing
    base = SourceRef.from_dict(manifest.get("source")).base_model
    return card, None if base else BASE_MODEL_HINT.replace("DIR", str(contents.root), 1)


def check_names(repo_id: str, revision: str | None) -> str:
    if not is_repo_id(repo_id):
        raise UploadError(f"REPO_ID {repo_id!r}: expected OWNER/NAME, a model repo on the Hub")
    revision = revision or "main"
    if re.fullmatch(r"[0-9a-f]{40}", revision):
        raise UploadError(f"--revision {revision}: a commit cannot be uploaded to; give a branch name")
    return revision


def _compare_with_hub(
    job: UploadJob, private: bool | None, held: dict[str, R.RemoteFile] | None, create: bool, overwrite: bool
) -> None:
    """What the branch holds (`hub_state`): this upload's files (skipped), or another model's
    (refused unless --overwrite, when the last commit deletes what the manifest does not list)."""
    where = f"{job.repo_id} (branch {job.revision})"
    if private is None:
        if not create:
            raise UploadError(f"{job.repo_id}: no such model repo on the Hub (or the token cannot see it); "
                              "pass --create to make it")  # fmt: skip
        _check_sent(job, {}, where)
        job.missing = ("repo",) if job.revision == "main" else ("repo", "branch")
        return
    if job.private and not private:
        raise UploadError(
            f"{job.repo_id} exists and is public; --private does not change that: make it private on the Hub "
            "first, or leave out --private"
        )
    if held is None:
        if not create:
            raise UploadError(f"{where}: no such branch; pass --create to make it (from main)")
        _check_sent(job, {}, where)
        job.missing = ("branch",)
        return
    local = job.contents.by_rel()
    on_hub, differ, foreign = set(), [], []
    for path, rf in sorted(held.items()):
        f = local.get(path)
        if path == GITATTRIBUTES_NAME:
            continue
        if f is None:
            foreign.append(path)
        elif _same(job, f, rf):
            on_hub.add(path)
        else:
            differ.append(path)
    _check_sent(job, held, where)
    if (differ or foreign) and not overwrite:
        what = "; ".join(
            x for x in (f"{first_and_others(differ)} differ from this directory's" if differ else "",
                        f"{first_and_others(foreign)} not in its manifest" if foreign else "") if x
        )  # fmt: skip
        raise UploadError(
            f"{where} holds another model ({what}); pass --overwrite to replace its files with this directory's "
            "(what the manifest does not list is deleted), or upload to another repo or --revision"
        )
    job.on_hub, job.deletions = frozenset(on_hub), tuple(foreign)


def _check_sent(job: UploadJob, held: dict[str, R.RemoteFile], where: str) -> None:
    """Each file `convert --upload` committed and deleted here must be on this branch, as it was
    committed: it cannot be sent again from here."""
    for f in job.contents.sent:
        rf = held.get(f.rel)
        if (job.contents.root / f.rel).exists() or (rf is not None and _same_sent(job, f, rf)):
            continue
        to = f.sent_to
        raise UploadError(
            f"{job.contents.root / f.rel}: committed to {to.repo} (branch {to.revision}) by `convert --upload` and "
            f"deleted here, and {where} does not hold it; upload to that repo, or convert again"
        )


def _same(job: UploadJob, f: UploadFile, rf: R.RemoteFile) -> bool:
    """Whether the branch's `rf` is this upload's `f`: the same size and sha256 (an LFS file), or
    git object id (a file kept in git, from its bytes here, or, where `convert --upload` committed
    it to this branch and deleted it here, the commit the journal records)."""
    path = job.contents.root / f.rel
    if rf.size != f.size:
        return False
    if rf.sha256 is not None:
        return rf.sha256 == f.sha256
    if f.data is None and not path.is_file():
        return f.sent_to is not None and _same_sent(job, f, rf)
    return rf.blob_id is not None and git_blob_sha1(path, f.data) == rf.blob_id


def _same_sent(job: UploadJob, f: UploadFile, rf: R.RemoteFile) -> bool:
    """A file `convert --upload` committed and deleted here, and the branch's `rf`: the same, where
    the branch keeps its sha256; where it does not (a small file kept in git), where the journal
    says it was committed to this repo and branch, at this size."""
    to = f.sent_to
    if rf.size != f.size:
        return False
    if rf.sha256 is not None:
        return rf.sha256 == f.sha256
    return (to.repo, to.revision) == (job.repo_id, job.revision)


def _verify(root: Path, progress: ProgressFactory | None) -> str:
    from mla_convert.verification.api import verify

    report = verify(root, data_checks=False, progress_factory=progress)
    checks = sum(g.checked for g in report.groups.values())
    if not report.ok:
        failures = report.failures()
        failed = sum(g.failed for g in report.groups.values())
        raise UploadError(
            f"{root}: not uploaded: {failed} of {checks} structure and integrity checks failed, the first "
            f"{failures[0].line()}; `mla-convert verify {root}` lists them (--skip-verify uploads without them)"
        )
    return f"structure and integrity: {checks} checks passed in {report.seconds:.1f} s"


def run(
    job: UploadJob, progress_factory: ProgressFactory | None = None, status: MessageFn | None = None
) -> UploadResult:
    """The commits of a prepared upload (nothing for a dry run): see the module docstring."""
    t0 = time.perf_counter()
    if job.dry_run:
        return _result(job, None)
    try:
        _commit_all(job, progress_factory, status or (lambda message: None))
    except KeyboardInterrupt as e:
        e.upload_state = job  # what is on the Hub, for the command's last line
        raise
    return _result(job, round(time.perf_counter() - t0, 3))


def _commit_all(job: UploadJob, progress_factory: ProgressFactory | None, status: MessageFn) -> None:
    remote = R.Remote(job.repo_id, job.revision)
    if "repo" in job.missing:
        status(f"creating {job.repo_id}")
        remote.create_repo(job.private)
    if "branch" in job.missing:
        remote.create_branch()
    calls = job.to_send()
    advance = progress_factory(sum(f.size for c in calls for f in c)) if progress_factory else None
    for i, files in enumerate(calls, start=1):
        last = i == len(calls)
        deletions = list(job.deletions) if last else []
        if not files and not deletions:
            continue
        status(f"uploading part {i} of {len(calls)} to {job.repo_id}")
        size = sum(f.size for f in files)
        message = f"mla-convert upload, part {i} of {len(calls)}: {len(files)} files, {gb(size)}"
        rels = [f.rel for f in files]
        send = functools.partial(remote.upload_files, job.contents.root, rels, deletions, message)
        job.done.append(_waiting(send, advance))
        job.deleted = tuple(deletions)
        job.sent_files += len(files)
        job.sent_bytes += size
        if advance:
            advance(size)


def _waiting(call: Callable[[], str], advance: Callable[[int], None] | None) -> str:
    """`call()` on a daemon thread (an interrupt ends the command at once, without waiting for it:
    cli.startup), telling `advance` every TICK_SECONDS that time passed (a log line is due every
    interval even mid-call: the client reports no bytes); its result, or its exception, here."""
    outcome: queue.Queue = queue.Queue()

    def work() -> None:
        try:
            outcome.put((call(), None))
        except BaseException as e:  # handed to the calling thread
            outcome.put((None, e))

    threading.Thread(target=work, name=UPLOAD_THREAD_NAME, daemon=True).start()
    while True:
        try:
            result, error = outcome.get(timeout=TICK_SECONDS)
        except queue.Empty:
            if advance:
                advance(0)
            continue
        if error is not None:
            raise error
        return result


def _result(job: UploadJob, seconds: float | None) -> UploadResult:
    files = job.contents.files
    skipped = [f for f in files if f.rel in job.on_hub]
    sent = [f for c in job.to_send() for f in c]
    url = f"{R.endpoint()}/{job.repo_id}" + ("" if job.revision == "main" else f"/tree/{job.revision}")
    plan = tuple({"commit": i, "path": f.rel, "size": f.size} for i, c in enumerate(job.commits, start=1) for f in c)
    return UploadResult(
        dir=str(job.contents.root), repo=job.repo_id, revision=job.revision, url=url, dry_run=job.dry_run,
        files=len(files), bytes=job.contents.bytes,
        uploaded_files=job.sent_files, uploaded_bytes=job.sent_bytes,
        skipped_files=len(skipped), skipped_bytes=sum(f.size for f in skipped), commits=tuple(job.done),
        deleted=job.deleted, created=job.missing if not job.dry_run else (),
        verified=job.verified, seconds=seconds, plan=plan if job.dry_run else (), card=job.card,
        base_model_hint=job.base_model_hint, would_upload_files=len(sent) if job.dry_run else None,
        would_upload_bytes=sum(f.size for f in sent) if job.dry_run else None,
    )  # fmt: skip
