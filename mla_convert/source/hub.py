"""Hub sources through huggingface_hub: resolve a repo id to one commit, list its files with size
and sha256, read shard headers by range request, download shards and check their sha256, and
stream shards for --stream (fetch in plan order, delete each once nothing pending needs it, within
a disk budget where one is given). A download that fails for the network, a 5xx or a 429 is tried
again after a wait (`RETRY_WAITS`, or the Hub's Retry-After); anything else is one line.

Token, cache, endpoint and offline mode are huggingface_hub's own (HF_TOKEN, HF_HOME,
HF_ENDPOINT, HF_HUB_OFFLINE).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mla_convert.constants import CONFIG_NAME, LEFT_RUNNING_THREAD_PREFIX, WRITE_AUTO
from mla_convert.errors import SourceError, network_errors
from mla_convert.io.headers import header_length, parse_header
from mla_convert.process.interrupts import crash_point
from mla_runtime.safetensors_file import HASH_CHUNK, ShardHeader, file_digest


@dataclass(frozen=True)
class RemoteFile:
    path: str
    size: int | None
    sha256: str | None  # the Hub records it for LFS (large) files


@dataclass(frozen=True)
class HubRepo:
    repo_id: str
    commit: str
    files: dict[str, RemoteFile]

    def label(self, filename: str) -> str:
        return f"{self.repo_id}@{self.commit[:12]}/{filename}"


@contextlib.contextmanager
def hub_errors(repo_id: str, revision: str | None):
    """huggingface_hub's exceptions -> one-line SourceErrors that say what to do."""
    from huggingface_hub import errors

    try:
        yield
    except errors.GatedRepoError as e:
        raise SourceError(f"{repo_id}: gated repository; accept its terms on the Hub and log in (hf auth login)") from e
    except errors.RepositoryNotFoundError as e:
        raise SourceError(
            f"{repo_id}: repository not found on the Hub (or no access: log in with hf auth login)"
        ) from e
    except errors.RevisionNotFoundError as e:
        raise SourceError(f"{repo_id}: revision {revision!r} not found") from e
    except (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled) as e:
        raise SourceError(
            f"{repo_id}: not in the local Hugging Face cache and the Hub cannot be reached "
            "(offline or HF_HUB_OFFLINE=1); download it first or pass a local directory"
        ) from e
    except errors.HfHubHTTPError as e:
        raise SourceError(f"{repo_id}: Hub request failed: {http_error_line(e)}") from e
    except (OSError, *network_errors()) as e:  # connection refused, DNS, a dropped connection, ...
        from huggingface_hub import constants

        raise SourceError(
            f"{repo_id}: cannot reach the Hub at {constants.ENDPOINT} ({type(e).__name__}: {e}); check the "
            "network, or HF_ENDPOINT and the proxy settings"
        ) from e


def http_error_line(e) -> str:
    """A huggingface_hub HTTP error in one line: its first line (status and URL), the server's
    own message, and the request id the Hub's support asks for, whichever lines carried them."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    line = lines[0] if lines else type(e).__name__
    response = getattr(e, "response", None)
    status = getattr(response, "status_code", None)
    if isinstance(status, int) and str(status) not in line:
        line = f"{status}: {line}"
    server = getattr(e, "server_message", None)
    if server and server.strip() not in line:
        line += f": {' '.join(server.split())}"
    request_id = getattr(e, "request_id", None)
    if request_id and request_id not in line:
        line += f" (request id {request_id})"
    return line


RETRY_WAITS = (1.0, 2.0, 4.0, 8.0, 16.0)  # seconds before each new try of a request that failed transiently
TRANSIENT_STATUSES = (408, 429, 500, 502, 503, 504)
WAIT_POLL = 0.2  # seconds: how often a wait for a job's shards looks for a failure elsewhere


def transient(e: BaseException | None) -> float | None:
    """How long the Hub asks to wait before `e`'s request is tried again (0: no time given), or
    None when trying again will not help: `e` or a cause is a timeout, a network error, a 5xx or a
    429 (with its Retry-After)."""
    from huggingface_hub import errors

    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, errors.OfflineModeIsEnabled):
            return None
        if isinstance(e, errors.HfHubHTTPError) and e.response is not None:
            if e.response.status_code not in TRANSIENT_STATUSES:
                return None
            try:
                return float(e.response.headers.get("retry-after") or 0)
            except ValueError:
                return 0.0
        if isinstance(e, (ConnectionError, TimeoutError, *network_errors())):
            return 0.0
        e = e.__cause__ or e.__context__
    return None


def retrying(call: Callable[[], object], waits: tuple[float, ...] | None = None) -> object:
    """`call()`, tried again after each wait of `waits` (default RETRY_WAITS) while it fails
    transiently (`transient`); the last failure, or one that is not transient, is raised."""
    for wait in (*(RETRY_WAITS if waits is None else waits), None):
        try:
            return call()
        except Exception as e:
            asked = transient(e)
            if wait is None or asked is None:
                raise
            time.sleep(max(wait, asked))
    raise AssertionError("unreachable")


def offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def list_repo(repo_id: str, revision: str | None) -> HubRepo:
    """One commit of the repo and its files with sizes and sha256 (one API call)."""
    from huggingface_hub import HfApi

    with hub_errors(repo_id, revision):
        info = HfApi().model_info(repo_id, revision=revision, files_metadata=True)
    files = {
        s.rfilename: RemoteFile(s.rfilename, s.size, s.lfs.sha256 if s.lfs else None) for s in (info.siblings or [])
    }
    return HubRepo(repo_id, info.sha, files)


def snapshot(repo: HubRepo, ignore_patterns=None, local_dir: Path | None = None) -> Path:
    from huggingface_hub import snapshot_download

    with hub_errors(repo.repo_id, repo.commit):
        return Path(
            snapshot_download(
                repo.repo_id,
                revision=repo.commit,
                ignore_patterns=ignore_patterns,
                local_dir=local_dir,
            )
        )


def snapshot_ref(repo_id: str, revision: str | None) -> Path:
    """Download (or reuse) the snapshot of a branch, tag or commit; its folder name is the commit."""
    from huggingface_hub import snapshot_download

    with hub_errors(repo_id, revision):
        return Path(snapshot_download(repo_id, revision=revision))


def cached_snapshot(repo_id: str, revision: str | None) -> Path:
    """Offline: the cached snapshot as is (nothing to check it against)."""
    from huggingface_hub import snapshot_download

    with hub_errors(repo_id, revision):
        return Path(snapshot_download(repo_id, revision=revision, local_files_only=True))


def remote_header(repo: HubRepo, filename: str, local_path: Path) -> ShardHeader:
    """A shard's header by two range requests; errors name `local_path`, where it will live."""
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    size = repo.files[filename].size if filename in repo.files else None
    if size is None:
        raise SourceError(f"{repo.label(filename)}: not in the repository's file list")
    url = hf_hub_url(repo.repo_id, filename, revision=repo.commit)
    headers = build_hf_headers()

    def get_range(start: int, end: int) -> bytes:
        def once():
            r = get_session().get(url, headers={**headers, "range": f"bytes={start}-{end}"}, follow_redirects=True)
            hf_raise_for_status(r)
            return r

        with hub_errors(repo.repo_id, repo.commit):
            r = retrying(once)
        return r.content[: end - start + 1]

    n = header_length(local_path, get_range(0, 7), size)
    return parse_header(local_path, get_range(8, 8 + n - 1), size)


def cache_dir() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def bytes_to_download(repo: HubRepo) -> int:
    """What a snapshot download of `repo` still has to fetch: its files not yet in the cache."""
    from huggingface_hub import try_to_load_from_cache

    return sum(
        f.size or 0
        for f in repo.files.values()
        if not isinstance(try_to_load_from_cache(repo.repo_id, f.path, revision=repo.commit), str)
    )


def check_file(repo: HubRepo, filename: str, path: Path) -> str | None:
    """None if `path` has the size and sha256 the Hub lists for `filename`, else what differs."""
    expected = repo.files.get(filename)
    if expected is None:
        return "not in the repository's file list"
    size = path.stat().st_size
    if expected.size is not None and size != expected.size:
        return f"size {size}, the Hub lists {expected.size}"
    if expected.sha256 and (got := file_digest(path).sha256) != expected.sha256:
        return f"sha256 {got[:16]}..., the Hub lists {expected.sha256[:16]}..."
    return None


def fetch_checked(repo: HubRepo, filename: str, local_dir: Path | None = None, write_mode: str = WRITE_AUTO) -> Path:
    """Download (or take from the cache) and check size + sha256; a bad copy is fetched once more,
    a second bad copy is refused, never converted. Into `local_dir` (--stream's staging) the bytes
    are hashed as they arrive (`_receive`), not read again, and written as `write_mode` says
    (io.disk_write's modes: the run's --write-io)."""
    from huggingface_hub import hf_hub_download

    if local_dir is not None:
        return _fetch_into(repo, filename, Path(local_dir), write_mode)
    for attempt in range(2):
        with hub_errors(repo.label(filename), repo.commit):
            path = Path(
                retrying(
                    lambda attempt=attempt: hf_hub_download(
                        repo.repo_id, filename, revision=repo.commit, force_download=attempt > 0
                    )
                )
            )
        problem = check_file(repo, filename, path)
        if problem is None:
            return path
        _discard(path)
    raise SourceError(f"{repo.label(filename)}: downloaded twice and still corrupt ({problem}); not converted")


DOWNLOAD_SUFFIX = ".download"  # a shard being downloaded into the staging directory: .NAME.download


def download_name(path: Path) -> Path:
    """Where `path` is downloaded to until it is whole and checked."""
    return path.with_name(f".{path.name}{DOWNLOAD_SUFFIX}")


def _fetch_into(repo: HubRepo, filename: str, staging: Path, write_mode: str) -> Path:
    """`filename` into `staging`, checked as it arrives; a whole copy an earlier run left is checked
    (read once), a partial one continued. `write_mode` WRITE_AUTO is resolved here, once for both
    tries."""
    from mla_convert.io import disk_write

    dest = staging / filename
    expected = repo.files.get(filename)
    if expected is None:
        raise SourceError(f"{repo.label(filename)}: not in the repository's file list")
    if dest.exists():
        if check_file(repo, filename, dest) is None:
            return dest
        dest.unlink()
    dest.parent.mkdir(parents=True, exist_ok=True)
    if write_mode == WRITE_AUTO:
        write_mode = disk_write.resolve_mode(dest.parent)[0]
    for attempt in range(2):
        with hub_errors(repo.label(filename), repo.commit):
            size, sha = _receive(repo, filename, dest, write_mode, fresh=attempt > 0)
        problem = _differs(expected, size, sha)
        if problem is None:
            os.replace(download_name(dest), dest)
            return dest
    download_name(dest).unlink(missing_ok=True)
    raise SourceError(f"{repo.label(filename)}: downloaded twice and still corrupt ({problem}); not converted")


def _differs(expected: RemoteFile, size: int, sha: str) -> str | None:
    if expected.size is not None and size != expected.size:
        return f"size {size}, the Hub lists {expected.size}"
    if expected.sha256 and sha != expected.sha256:
        return f"sha256 {sha[:16]}..., the Hub lists {expected.sha256[:16]}..."
    return None


def _receive(repo: HubRepo, filename: str, dest: Path, write_mode: str, fresh: bool) -> tuple[int, str]:
    """Download `filename` to download_name(dest): its (size, sha256). The body goes into the
    staging buffers of an io.disk_write file written in `write_mode` (WRITE_DIRECT: no copy through
    the page cache; source.hub_body reads the socket straight into them where it can), hashed
    there as it arrives. A connection lost mid-body (or a 5xx, a timeout) is continued from
    the bytes already received, by a range request, after a wait (`retrying`); an earlier run's
    partial download too (the whole blocks it wrote, hashed first), unless `fresh`."""
    from huggingface_hub import constants, hf_hub_url
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    from mla_convert.io import disk_write
    from mla_convert.source import hub_body

    url = hf_hub_url(repo.repo_id, filename, revision=repo.commit)
    headers = build_hf_headers()
    partial = download_name(dest)
    kept, sha = (0, None) if fresh else _written_prefix(partial)
    out = [disk_write.open_for_write(partial, write_mode, append_at=kept, sha256=sha, in_order=True)]

    def from_the_start() -> None:  # the range was not taken
        out[0].close()
        out[0] = disk_write.open_for_write(partial, write_mode, in_order=True)

    def once() -> None:
        f = out[0]
        start = f.size
        wanted = repo.files[filename].size
        if wanted is not None and start >= wanted:
            return
        ranged = {"range": f"bytes={start}-"} if start else {}
        lean = hub_body.plain_get(url, {**headers, **ranged}, constants.HF_HUB_DOWNLOAD_TIMEOUT)
        if lean is not None:
            with lean:
                if start and lean.status != 206:
                    from_the_start()
                hub_body.receive(lean, out[0])
            return
        with get_session().stream(
            "GET", url, headers={**headers, **ranged}, follow_redirects=True,
            timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT,
        ) as r:  # fmt: skip
            if r.status_code >= 400:
                r.read()  # the server's message, for the error
            hf_raise_for_status(r)
            if start and r.status_code != 206:
                from_the_start()
            for block in r.iter_bytes():
                out[0].write(block)

    try:
        retrying(once)
        size = out[0].size
        return size, out[0].finish()
    finally:
        out[0].close()  # after a failure: what is on disk is a prefix of what came (in_order)


def _written_prefix(partial: Path):
    """(bytes kept, their sha256) of an earlier run's partial download: its whole ALIGN blocks, the
    rest dropped (a direct write continues at a block boundary); (0, None) where there is none."""
    import hashlib

    from mla_convert.io.disk_write import ALIGN

    try:
        f = open(partial, "rb")  # noqa: SIM115 (closed below; a missing file is no prefix)
    except FileNotFoundError:
        return 0, None
    with f:
        keep = os.fstat(f.fileno()).st_size // ALIGN * ALIGN
        sha, left = hashlib.sha256(), keep
        while left and (chunk := f.read(min(HASH_CHUNK, left))):
            sha.update(chunk)
            left -= len(chunk)
    return keep - left, sha


def _discard(path: Path) -> None:
    """Remove a bad download, and its cache blob when `path` is a cache symlink."""
    real = path.resolve()
    path.unlink(missing_ok=True)
    if real != path:
        real.unlink(missing_ok=True)


def check_snapshot(repo: HubRepo, root: Path, files: list[str]) -> None:
    """Before converting from a downloaded snapshot: every shard's size and sha256 against the
    Hub's list; a corrupted one is re-fetched (once) rather than converted."""
    for rel in files:
        if check_file(repo, rel, root / rel) is not None:
            fetch_checked(repo, rel)


DOWNLOAD_THREAD_NAME = LEFT_RUNNING_THREAD_PREFIX + "download"


class ShardStreamer:
    """Downloads the shards each job needs, in job order, and deletes a shard once no pending job
    needs it. Downloads stay within a window of `ahead + 1` jobs starting at the oldest unfinished
    one, so what is on disk is at most the inputs of those jobs, even when jobs finish out of order.

    With a `budget` (output.budget.DiskBudget), a job's new shards and `extra[job]` (the bytes of
    its output files) are reserved together before its first download, in job order, and a shard's
    room is released when it is deleted; shards an earlier run left in `staging` are counted (or
    deleted, where no job needs them). `busy`: a context for each download (the stage clock's).
    `write_mode`: how the shards are written (io.disk_write's modes; the run's, resolved for --out).
    """

    def __init__(
        self,
        repo: HubRepo,
        staging: Path,
        jobs: list[tuple[str, list[str]]],
        ahead: int = 1,
        *,
        budget=None,
        extra: dict[str, int] | None = None,
        busy: Callable[[], contextlib.AbstractContextManager] | None = None,
        write_mode: str = WRITE_AUTO,
    ):
        self.repo, self.staging, self.jobs, self.ahead = repo, staging, jobs, ahead
        self.write_mode = write_mode
        self.budget, self.extra, self.busy = budget, extra or {}, busy or contextlib.nullcontext
        self.users: dict[str, int] = {}
        for _, files in jobs:
            for f in files:
                self.users[f] = self.users.get(f, 0) + 1
        self.ready: dict[str, threading.Event] = {job: threading.Event() for job, _ in jobs}
        self.cond = threading.Condition()
        self.finished: set[str] = set()
        self.oldest_unfinished = 0  # index into jobs
        self.fetched: set[str] = set()
        self.reserved: set[str] = set()  # shards whose room the budget holds
        self.on_disk = 0
        self.peak_on_disk = 0
        self.error: BaseException | None = None
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name=DOWNLOAD_THREAD_NAME, daemon=True)
        if budget is not None:
            self._count_leftovers()

    def size(self, filename: str) -> int:
        return self.repo.files[filename].size or 0

    def _count_leftovers(self) -> None:
        """What an earlier run left in `staging`: a shard a job needs is counted in the budget (its
        download, whole or not, goes on); one none needs is deleted."""
        for path in [*self.staging.rglob("*.safetensors"), *self.staging.rglob(f".*{DOWNLOAD_SUFFIX}")]:
            rel = path.relative_to(self.staging).as_posix()
            if path.name.endswith(DOWNLOAD_SUFFIX):  # a download cut short: its shard's
                rel = path.with_name(path.name[1 : -len(DOWNLOAD_SUFFIX)]).relative_to(self.staging).as_posix()
            if rel in self.users and rel not in self.reserved:
                self.budget.force(self.size(rel))
                self.reserved.add(rel)
            else:
                path.unlink(missing_ok=True)

    def __enter__(self) -> ShardStreamer:
        self.thread.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        # After an error or Ctrl-C the download under way is not waited for (a 4 GB shard can take
        # minutes, and a stalled connection longer): it stops with the process, into the staging
        # directory, which a --resume checks again.
        self.thread.join(timeout=60 if exc_type is None else 0.5)

    def _run(self) -> None:
        try:
            for k, (job, files) in enumerate(self.jobs):
                with self.cond:
                    self.cond.wait_for(lambda k=k: self.stopping or k <= self.oldest_unfinished + self.ahead)
                    if self.stopping:
                        return
                if self.budget is not None:
                    new = sorted(set(files) - self.reserved)
                    self.budget.reserve(sum(map(self.size, new)) + self.extra.get(job, 0))
                    self.reserved |= set(new)
                for f in files:
                    if f not in self.fetched:
                        with self.busy():
                            fetch_checked(self.repo, f, local_dir=self.staging, write_mode=self.write_mode)
                        crash_point(f"download:{f}")
                        with self.cond:
                            self.fetched.add(f)
                            self.on_disk += (self.staging / f).stat().st_size
                            self.peak_on_disk = max(self.peak_on_disk, self.on_disk)
                self.ready[job].set()
        except BaseException as e:  # handed to the converting thread in wait_for
            self.error = e
            for ev in self.ready.values():
                ev.set()

    def wait_for(self, job: str, timeout: float | None = None) -> bool:
        """True once `job`'s shards are on disk (False on timeout); a download error is raised here,
        and so is the error the budget was closed with (a later stage failed: the window that lets
        the download go on may never move again)."""
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            left = WAIT_POLL if end is None else min(WAIT_POLL, max(0.0, end - time.monotonic()))
            ready = self.ready[job].wait(left)
            if self.error is not None:
                raise self.error
            if ready or (end is not None and time.monotonic() >= end):
                return ready
            if self.budget is not None:
                self.budget.check()

    def release(self, job: str, files: list[str]) -> None:
        """`job` is durably written (and checked, where it is): delete the shards nothing pending
        needs, give back their room, move the window."""
        with self.cond:
            for f in files:
                self.users[f] -= 1
                if self.users[f] == 0 and f in self.fetched:
                    path = self.staging / f
                    self.on_disk -= path.stat().st_size
                    path.unlink()
                if self.users[f] == 0 and f in self.reserved:
                    self.reserved.discard(f)
                    self.budget.release(self.size(f))
            self.finished.add(job)
            while self.oldest_unfinished < len(self.jobs) and self.jobs[self.oldest_unfinished][0] in self.finished:
                self.oldest_unfinished += 1
            self.cond.notify_all()


def prepare_staging(repo: HubRepo, staging: Path) -> dict[str, ShardHeader]:
    """Small files (config, index, tokenizer, code, ...) into `staging`; shard headers by range
    request. Returns file -> header for every shard the index names."""
    import json

    staging.mkdir(parents=True, exist_ok=True)
    from mla_convert.source.model_config import read_model_config

    snapshot(repo, ignore_patterns=["*.safetensors"], local_dir=staging)
    from mla_convert.source import members

    own = members.own_config_files()
    if not any((staging / name).exists() for name in (CONFIG_NAME, *own)):
        nor = "".join(f" (nor a {name})" for name in own)
        raise SourceError(f"{repo.label(CONFIG_NAME)}: the repository has no {CONFIG_NAME}{nor}")
    model = read_model_config(staging)  # config.json, or a member's own config file
    index_name, index_path = model.index_name, staging / model.index_name
    if index_path.exists():
        try:
            shards = sorted(set(json.loads(index_path.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise SourceError(f"{repo.label(index_name)}: no valid weight_map") from e
    else:
        shards = [model.single_file_name]
    headers = {}
    for rel in shards:
        if not isinstance(rel, str) or os.path.isabs(rel) or ".." in Path(rel).parts:
            raise SourceError(f"{repo.label(index_name)}: shard {rel!r} must be a relative path inside the repository")
        headers[rel] = remote_header(repo, rel, staging / rel)
    return headers


def remove_staging(staging: Path) -> None:
    shutil.rmtree(staging, ignore_errors=True)
