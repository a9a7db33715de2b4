"""A local stand-in for the Hugging Face Hub, for running the real `huggingface_hub` client in tests.

`FakeHub` serves model repos from local directories over plain HTTP on 127.0.0.1 (ephemeral port, daemon
threads). It implements only what `huggingface_hub` 2.4 uses to resolve, list and download files:

    GET  /api/models/{repo_id}[/revision/{rev}][?blobs=true]   model_info / repo_info (`sha`, `siblings`)
    GET  /api/models/{repo_id}/tree/{rev}[/{path}]              list_repo_tree (recursive, expand, paginated)
    POST /api/models/{repo_id}/paths-info/{rev}                 get_paths_info
    HEAD/GET /{repo_id}/resolve/{rev}/{path}                    hf_hub_download / snapshot_download (Range too)
    GET  /api/agent-harnesses                                   best-effort telemetry lookup (empty registry)

and, for uploads (fake_hub_upload.py, which lists them with what it checks): create_repo, create_branch,
validate-yaml (ModelCard.validate), preupload, the LFS batch API with basic and multipart transfers and
verify, and NDJSON commits, which become commits of the repo that the endpoints above then serve;
the sink (`sink=True`: uploaded LFS bytes hashed, checked and dropped), the bytes received per path,
and the upload-side faults (an error status, a connection cut mid-body, a stall) by request kind.

A file's bytes go out by sendfile (plain GETs and ranges alike), its holes from a buffer of zeros: a
large sparse source (its weights file holes) is served without passing through the page cache, and
`add_repo(..., known_sha256=)` takes digests its writer computed instead of hashing it again.
`cpu_seconds` is the CPU time its threads spent answering; `GET /_fake/state` (`state()`) reports
it with the commits, the bytes received and each repo's tree, for a server in another process (fake_hub_serve.py: `python -m
support.fake_hub_serve`, wait4 measuring its CPU apart from the client's).

Files matching `lfs_patterns` (default `*.safetensors`) are LFS files: the listings carry
`lfs: {oid: <sha256>, size, pointerSize}` (model_info's siblings: `lfs: {sha256, size, pointerSize}`) and
resolve answers `ETag`/`X-Linked-Etag: "<sha256>"` and `X-Linked-Size`. Other files are plain git blobs whose
`oid`/`ETag` is the git blob sha1 (so `HfApi.verify_repo_checksums` works against this server too).
Errors carry an `X-Request-Id` (as the real Hub's do) and the `X-Error-Code` the client maps to its exceptions: `RepoNotFound` (-> RepositoryNotFoundError,
also for a private repo asked without its token: 401), `RevisionNotFound`, `EntryNotFound`.
Xet is never offered (no `X-Xet-*` headers, no `xetHash`), so the client always uses plain HTTP.

Faults, for tests: `corrupt` (serve other bytes than the advertised sha256; same length by default, which the
client does NOT detect: it only checks sizes), `advertise_sha256` (list a wrong sha256 for good bytes), `fail`
(answer an HTTP error status N times), `truncate` (send a full Content-Length but close the connection early,
N times: the client retries after ~1 s, with a Range request past the whole 10 MiB chunks it got), `stall`
(send a download's headers, then nothing until the server stops: the network lost mid-download). Every
request is recorded in `requests`;
`count()` / `downloads()` query that log.

Environment: `install(monkeypatch, hf_home)` points the client at the server for this process AND for
subprocesses: it sets the env vars (`HF_ENDPOINT`, `HF_HOME`, `HF_HUB_CACHE`, `HF_HUB_DISABLE_XET=1`,
`HF_HUB_DISABLE_TELEMETRY=1`, ...; `os.environ` is what `subprocess` children inherit) and, because
`huggingface_hub.constants` reads them once at import time, patches the already-imported constants too
(`ENDPOINT`, `HUGGINGFACE_CO_URL_TEMPLATE`, cache/token paths, offline/xet/telemetry flags, the module-level
`HfApi` used by `huggingface_hub.model_info` & co). All of it is undone by the monkeypatch.

Tests take the `fake_hub` fixture (tests/conftest.py: a started hub, installed, stopped afterwards), or build
their own:

    with FakeHub({"org/tiny": (ckpt_dir, None)}) as hub:
        hub.install(monkeypatch, tmp_path / "hf_home")
        ...
"""

from __future__ import annotations

import errno
import fnmatch
import hashlib
import json
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlencode, urlsplit

import pytest

from support.fake_hub_upload import (
    UPLOAD_ACTIONS,
    UPLOAD_KINDS,
    CommitRecord,
    Dropped,
    PreuploadRecord,
    UploadEndpoints,
    upload_kind,
)

__all__ = ["ENV_UNSET", "UPLOAD_KINDS", "CommitRecord", "FakeHub", "PreuploadRecord", "RequestRecord"]

_DATE = "2026-01-01T00:00:00.000Z"
_CHUNK = 1 << 20
_SENDFILE_CHUNK = 16 << 20  # bytes per sendfile call: bytes_sent moves at least this often
_ZEROS = memoryview(bytes(1 << 20))  # a hole's bytes, sent from here
WRITE_TOKEN = "hf_fake_write_token"  # conftest's `hub` adds it and sets HF_TOKEN to it
STATE_PATH = "/_fake/state"  # GET: the server's own state as JSON (FakeHub.state), for a server in another process
_SHA_RE_CHARS = set("0123456789abcdef")

# Env vars removed by `install` so that nothing from the developer's machine leaks into a test (tokens, other
# endpoints or caches, offline mode). Tests set HF_TOKEN / HF_HUB_OFFLINE themselves when they need them.
ENV_UNSET = (
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "HF_TOKEN_PATH",
    "HF_OIDC_RESOURCE",
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "HUGGINGFACE_HUB_CACHE",
    "HUGGINGFACE_ASSETS_CACHE",
    "HF_ASSETS_CACHE",
    "HF_XET_CACHE",
    "HUGGINGFACE_CO_STAGING",
    "HF_HUB_DISABLE_IMPLICIT_TOKEN",
    "HF_HUB_ENABLE_HF_TRANSFER",
    "HF_XET_HIGH_PERFORMANCE",
    "XDG_CACHE_HOME",
)


# --------------------------------------------------------------------------------------------- data model


@dataclass
class _File:
    path: str  # repo path, "/"-separated
    disk: Path | None  # None: the sink kept no bytes
    size: int
    sha256: str
    git_oid: str  # git blob sha1 of the file (plain) or of its LFS pointer (LFS)
    lfs: bool
    pointer_size: int | None


@dataclass
class _Commit:
    sha: str
    directory: Path
    files: dict[str, _File]
    dirs: set[str]


@dataclass
class _Repo:
    repo_id: str
    private: bool = False
    token: str | None = None
    refs: dict[str, str] = field(default_factory=dict)  # branch/tag name -> commit sha
    commits: dict[str, _Commit] = field(default_factory=dict)


@dataclass
class RequestRecord:
    """One request the server answered (recorded before the body is sent, so it is visible to the test as soon
    as the client has the response)."""

    method: str
    path: str  # URL path, percent-decoded, without the query
    query: dict[str, list[str]]
    status: int
    kind: str  # "info" | "tree" | "paths-info" | "resolve" | "other", or an upload's (fake_hub_upload.py)
    # ("create", "branch", "validate-yaml", "preupload", "lfs-batch", "lfs-upload", "lfs-part", "lfs-complete",
    # "lfs-verify", "commit"); status -1: a dropped connection
    repo_id: str | None = None
    revision: str | None = None  # as asked (branch name or sha)
    filename: str | None = None  # resolve only
    authorization: str | None = None
    range: str | None = None
    bytes_sent: int = 0  # body bytes handed to the socket (counted before each write: final once the client has them)


@dataclass
class _Countdown:
    remaining: int | None  # None: forever

    def take(self) -> bool:
        if self.remaining is None:
            return True
        if self.remaining <= 0:
            return False
        self.remaining -= 1
        return True


def _git_blob_sha1(path: Path | None = None, data: bytes | None = None) -> str:
    h = hashlib.sha1()
    if data is not None:
        h.update(b"blob %d\0" % len(data))
        h.update(data)
        return h.hexdigest()
    assert path is not None
    h.update(b"blob %d\0" % path.stat().st_size)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _send_span(conn: socket.socket, fh, start: int, limit: int, rec: RequestRecord) -> None:
    """`limit` bytes of the file from `start`: its data by sendfile, its holes (SEEK_HOLE) from a
    buffer of zeros. sendfile of a hole would make the kernel allocate and clear a page-cache page
    for every 4 KiB of it, which at DeepSeek-R1's size costs the server more than the client's
    whole download. `rec.bytes_sent` is counted before each write: the client may return as soon
    as it has the last byte."""
    fd, end = fh.fileno(), start + limit
    while rec.bytes_sent < limit:
        at = start + rec.bytes_sent
        try:
            data_at = os.lseek(fd, at, os.SEEK_DATA)
        except OSError as e:  # ENXIO: only a hole is left; EINVAL: the filesystem cannot say
            data_at = end if e.errno == errno.ENXIO else at
        if data_at > at:
            want = min(data_at, end, at + len(_ZEROS)) - at
            rec.bytes_sent += want
            conn.sendall(_ZEROS[:want])
            continue
        try:
            hole_at = os.lseek(fd, at, os.SEEK_HOLE)
        except OSError:
            hole_at = end
        want = min(hole_at, end, at + _SENDFILE_CHUNK) - at
        rec.bytes_sent += want
        sent = conn.sendfile(fh, at, want)
        if sent < want:
            rec.bytes_sent -= want - sent
            return


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


def _is_sha(rev: str) -> bool:
    return len(rev) == 40 and set(rev) <= _SHA_RE_CHARS


def _truthy(values: list[str] | None) -> bool:
    return bool(values) and values[-1].lower() in ("1", "true", "yes")


class _HubError(Exception):
    def __init__(
        self, status: int, code: str | None, message: str, commit: str | None = None, headers: dict | None = None
    ):
        super().__init__(message)
        self.status, self.code, self.message, self.commit = status, code, message, commit
        self.headers = headers or {}


# --------------------------------------------------------------------------------------------- server


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, hub: FakeHub, host: str):
        self.hub = hub
        self.conns: set[socket.socket] = set()
        self.conns_lock = threading.Lock()
        super().__init__((host, 0), _Handler)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = 30  # idle keep-alive connections die eventually even if nobody closes them
    server: _Server

    def setup(self):
        super().setup()
        with self.server.conns_lock:
            self.server.conns.add(self.connection)

    def finish(self):
        try:
            super().finish()
        finally:
            with self.server.conns_lock:
                self.server.conns.discard(self.connection)

    def log_message(self, format, *args):
        pass

    def do_GET(self):
        self.server.hub._handle(self, "GET")

    def do_HEAD(self):
        self.server.hub._handle(self, "HEAD")

    def do_POST(self):
        self.server.hub._handle(self, "POST")

    def do_PUT(self):
        self.server.hub._handle(self, "PUT")


# --------------------------------------------------------------------------------------------- FakeHub


class FakeHub(UploadEndpoints):
    """A fake Hugging Face Hub serving model repos from local directories. See the module docstring.

    `repos`: {repo_id: (directory, commit_sha or None)}, each served as branch "main" (see `add_repo`).
    Uploads: an LFS object above `multipart_threshold` bytes goes in parts of `chunk_size`; `sink`:
    uploaded LFS bytes are hashed, checked and dropped (fake_hub_upload.py).
    `cpu_seconds`: the CPU time (user + system) the server's threads spent answering requests.
    """

    def __init__(
        self,
        repos: dict[str, tuple[str | Path, str | None]] | None = None,
        *,
        lfs_patterns: tuple[str, ...] = ("*.safetensors",),
        tree_page_size: int = 1000,
        tree_expand_page_size: int = 50,
        host: str = "127.0.0.1",
        multipart_threshold: int = 2 * 1024 * 1024,
        chunk_size: int = 1024 * 1024,
        sink: bool = False,
    ):
        self.lfs_patterns = tuple(lfs_patterns)
        self.tree_page_size = tree_page_size  # the Hub's caps: 1000 entries a page, 50 with expand=True
        self.tree_expand_page_size = tree_expand_page_size
        self.host = host
        self.requests: list[RequestRecord] = []
        self.cpu_seconds = 0.0
        self.cpu_by_role: dict[str, float] = {}  # "download" (resolve, listings) and "upload" (the rest)
        self.hf_home: Path | None = None  # set by install()
        self.cache_dir: Path | None = None  # HF_HUB_CACHE, set by install()
        self._repos: dict[str, _Repo] = {}
        self._lock = threading.RLock()
        self._corrupt: dict[tuple[str, str], tuple[bytes | None, _Countdown]] = {}
        self._advertised: dict[tuple[str, str], str] = {}
        self._fail: dict[tuple[str, str | None], list[tuple[str | None, int, _Countdown, str | None]]] = {}
        self._truncate: dict[tuple[str, str], tuple[int | None, _Countdown]] = {}
        self._stall: dict[tuple[str, str], _Countdown] = {}
        self._unstall = threading.Event()  # set by stop(): stalled answers end with the server
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._monkeypatch: pytest.MonkeyPatch | None = None
        classes = {"HubError": _HubError, "Repo": _Repo, "Commit": _Commit, "File": _File}
        self._init_upload(classes, multipart_threshold, chunk_size, sink)
        for repo_id, (directory, sha) in (repos or {}).items():
            self.add_repo(repo_id, directory, sha)

    # ---- lifecycle

    def start(self) -> FakeHub:
        if self._server is not None:
            return self
        self._unstall.clear()
        self._server = _Server(self, self.host)
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="FakeHub", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        self._unstall.set()
        server.shutdown()
        server.server_close()
        with server.conns_lock:
            conns = list(server.conns)
        for conn in conns:  # wake up handler threads parked on idle keep-alive connections
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._thread = None

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("FakeHub is not started")
        return self._server.server_address[1]

    @property
    def endpoint(self) -> str:
        """e.g. http://127.0.0.1:41234 (no trailing slash), the value of HF_ENDPOINT."""
        return f"http://{self.host}:{self.port}"

    # ---- repos

    def add_repo(
        self,
        repo_id: str,
        directory: str | Path,
        sha: str | None = None,
        *,
        revision: str = "main",
        private: bool = False,
        token: str | None = None,
        known_sha256: dict[str, str] | None = None,
    ) -> str:
        """Serve `directory` (all files under it, recursively) as commit `sha` of model repo `repo_id`, with
        branch/tag `revision` pointing at it. Call again with another directory and revision to add a second
        commit to the same repo. The files are hashed now: change them afterwards and what is served no longer
        matches what is listed. `private=True` (or a `token`) makes the repo answer 401 RepoNotFound unless the
        request carries `Authorization: Bearer <token>`. Returns the commit sha (derived from the content when
        `sha` is None). `known_sha256` ({repo path: sha256}): taken as the sha256 of those files
        instead of hashing them (a large source whose digests its writer computed). Thread-safe;
        works while the server runs."""
        if repo_id.count("/") > 1 or not all(repo_id.split("/")):
            raise ValueError(f"repo_id must be 'name' or 'namespace/name': {repo_id!r}")
        directory = Path(directory)
        if not directory.is_dir():
            raise ValueError(f"{directory}: not a directory")
        files: dict[str, _File] = {}
        dirs: set[str] = set()
        for p in sorted(directory.rglob("*")):
            rel = p.relative_to(directory).as_posix()
            if rel.split("/")[0] in (".git", ".cache"):
                continue
            if p.is_dir():
                dirs.add(rel)
            elif p.is_file():
                files[rel] = self._describe(rel, p, (known_sha256 or {}).get(rel))
        if sha is None:
            h = hashlib.sha1(repo_id.encode())
            for rel, f in files.items():
                h.update(f"{rel}\0{f.git_oid}\n".encode())
            sha = h.hexdigest()
        if not _is_sha(sha):
            raise ValueError(f"commit sha must be 40 lowercase hex digits: {sha!r}")
        with self._lock:
            repo = self._repos.setdefault(repo_id, _Repo(repo_id))
            repo.private = repo.private or private or token is not None
            repo.token = token if token is not None else repo.token
            if repo.private and repo.token is None:
                raise ValueError("a private repo needs a token")
            repo.commits[sha] = _Commit(sha, directory, files, dirs)
            repo.refs[revision] = sha
        return sha

    def _describe(self, rel: str, p: Path, sha256: str | None = None) -> _File:
        size = p.stat().st_size
        sha256 = sha256 or _sha256_file(p)
        name = rel.rsplit("/", 1)[-1]
        lfs = any(fnmatch.fnmatch(rel, pat) or fnmatch.fnmatch(name, pat) for pat in self.lfs_patterns)
        if lfs:
            pointer = _lfs_pointer(sha256, size)
            return _File(rel, p, size, sha256, _git_blob_sha1(data=pointer), True, len(pointer))
        return _File(rel, p, size, sha256, _git_blob_sha1(p), False, None)

    def commit_sha(self, repo_id: str, revision: str = "main") -> str:
        with self._lock:
            return self._repos[repo_id].refs[revision]

    def file_info(self, repo_id: str, path: str, revision: str = "main") -> dict:
        """What the server knows of a file: {size, sha256 (true, of the file on disk), git_oid, lfs (bool),
        advertised_sha256 (what the listings and ETag say)}."""
        with self._lock:
            repo = self._repos[repo_id]
            f = repo.commits[repo.refs.get(revision, revision)].files[path]
            return {
                "size": f.size,
                "sha256": f.sha256,
                "git_oid": f.git_oid,
                "lfs": f.lfs,
                "advertised_sha256": self._advertised.get((repo_id, path), f.sha256),
            }

    # ---- faults

    def corrupt(self, repo_id: str, path: str, body: bytes | None = None, *, times: int | None = None) -> None:
        """Serve `body` instead of the file's bytes on the next `times` GETs (None: until `clear_faults`), while
        listings, ETag and X-Linked-Size keep advertising the real sha256 and size. Default body: the file with
        its last byte flipped (same length, so the client's size check passes and only a sha256 check catches
        it; a body of another length makes the client fail with its 'Consistency check failed' OSError)."""
        with self._lock:
            self._corrupt[(repo_id, path)] = (body, _Countdown(times))

    def advertise_sha256(self, repo_id: str, path: str, sha256: str) -> None:
        """List (tree, paths-info, model_info) and ETag a wrong sha256 for `path`, still serving its real bytes."""
        with self._lock:
            self._advertised[(repo_id, path)] = sha256

    def fail(
        self,
        repo_id: str,
        path: str | None = None,
        *,
        status: int = 500,
        times: int = 1,
        method: str | None = "GET",
        message: str | None = None,
    ) -> None:
        """Answer the next `times` requests for file `path` of `repo_id` (resolve), or for any request about the
        repo when `path` is None, with HTTP `status`; `method` "GET"/"HEAD"/"POST" or None for any.
        How the client reacts: a file GET is retried only on 408/429 (a 5xx raises HfHubHTTPError); a failed
        HEAD falls back to the cache, else is retried with backoff (sleeps of 1 s and up) on 5xx. `message`: the
        X-Error-Message (default "Injected failure N")."""
        with self._lock:
            self._fail.setdefault((repo_id, path), []).append((method, status, _Countdown(times), message))

    def truncate(self, repo_id: str, path: str, *, at: int | None = None, times: int = 1) -> None:
        """On the next `times` GETs of `path`, announce the full Content-Length but close the connection after
        `at` body bytes (default: half). The client retries after ~1 s: with `Range: bytes=<n>-` where n counts
        the whole `constants.DOWNLOAD_CHUNK_SIZE` (10 MiB) chunks it had received, from scratch when n is 0."""
        with self._lock:
            self._truncate[(repo_id, path)] = (at, _Countdown(times))

    def stall(self, repo_id: str, path: str, *, times: int = 1) -> None:
        """On the next `times` whole-file GETs of `path` (range requests go through), send the headers and
        then nothing until the server stops: the network going away in the middle of a download."""
        with self._lock:
            self._stall[(repo_id, path)] = _Countdown(times)

    def state(self) -> dict:
        """What a test in another process asks of the server (GET /_fake/state): its CPU seconds
        (all, and by role: "download" for resolve and listings, "upload" for the rest), requests, commits and preuploads, the bytes received, and each repo's main branch
        (path -> [size, sha256, bytes received for it])."""
        with self._lock:
            repos = [r for r in self._repos.values() if "main" in r.refs]
            commits = [c.__dict__ for c in self.commits]
            preuploads = [r.__dict__ for r in self.preuploads]
            n_requests = len(self.requests)
            cpu, by_role = self.cpu_seconds, dict(self.cpu_by_role)
        branches = {}
        for repo in repos:
            received, sizes = self.received_by_path(repo.repo_id), self.tree_sizes(repo.repo_id)
            branches[repo.repo_id] = {p: [size, sha, received[p]] for p, (size, sha) in sizes.items()}
        return {
            "cpu_seconds": cpu, "cpu_by_role": by_role, "requests": n_requests, "commits": commits, "preuploads": preuploads,
            "received_bytes": self.received_bytes, "repos": branches,
        }  # fmt: skip

    def clear_faults(self) -> None:
        with self._lock:
            self._corrupt.clear()
            self._advertised.clear()
            self._fail.clear()
            self._truncate.clear()
            self._stall.clear()
            self._faults.clear()
        self._release.set()

    # ---- request log

    def count(
        self,
        *,
        method: str | None = None,
        kind: str | None = None,
        repo_id: str | None = None,
        filename: str | None = None,
        status: int | tuple[int, ...] | None = None,
    ) -> int:
        """Number of recorded requests matching every given filter (kind: info/tree/paths-info/resolve/other)."""
        statuses = (status,) if isinstance(status, int) else status
        with self._lock:
            return sum(
                1
                for r in self.requests
                if (method is None or r.method == method)
                and (kind is None or r.kind == kind)
                and (repo_id is None or r.repo_id == repo_id)
                and (filename is None or r.filename == filename)
                and (statuses is None or r.status in statuses)
            )

    def downloads(self, repo_id: str, filename: str) -> int:
        """Number of GETs of a file's bytes answered 200/206 (injected truncations included), any revision."""
        return self.count(method="GET", kind="resolve", repo_id=repo_id, filename=filename, status=(200, 206))

    def reset_requests(self) -> None:
        with self._lock:
            self.requests.clear()

    # ---- environment

    def env(self, hf_home: str | Path) -> dict[str, str]:
        """Env vars pointing a `huggingface_hub` process at this server with its cache under `hf_home`.
        (Also remove `ENV_UNSET` from a child's environment; `install` does both for os.environ.)"""
        return client_env(self.endpoint, hf_home)

    def install(self, monkeypatch: pytest.MonkeyPatch, hf_home: str | Path) -> None:
        """Point `huggingface_hub` at this server, in this process and in subprocesses started from it, with an
        empty cache under `hf_home`; undone with `monkeypatch`. Sets `hf_home`/`cache_dir`."""
        import huggingface_hub
        from huggingface_hub import constants as C
        from huggingface_hub import hf_api
        from huggingface_hub.utils import _http

        hf_home = Path(hf_home)
        (hf_home / "hub").mkdir(parents=True, exist_ok=True)
        self.hf_home, self.cache_dir = hf_home, hf_home / "hub"
        self._monkeypatch = monkeypatch
        for name in ENV_UNSET:
            monkeypatch.delenv(name, raising=False)
        for name, value in self.env(hf_home).items():
            monkeypatch.setenv(name, value)

        # What huggingface_hub.constants computed from the environment at import time.
        home, cache = str(hf_home), str(hf_home / "hub")
        patches = {
            "ENDPOINT": self.endpoint,
            "HUGGINGFACE_CO_URL_TEMPLATE": self.endpoint + "/{repo_id}/resolve/{revision}/{filename}",
            "HF_HOME": home,
            "HF_HUB_CACHE": cache,
            "HUGGINGFACE_HUB_CACHE": cache,
            "default_cache_path": cache,
            "HF_ASSETS_CACHE": os.path.join(home, "assets"),
            "HUGGINGFACE_ASSETS_CACHE": os.path.join(home, "assets"),
            "default_assets_cache_path": os.path.join(home, "assets"),
            "HF_XET_CACHE": os.path.join(home, "xet"),
            "HF_TOKEN_PATH": os.path.join(home, "token"),
            "HF_STORED_TOKENS_PATH": os.path.join(home, "stored_tokens"),
            "CHECK_FOR_UPDATE_DONE_PATH": os.path.join(home, ".check_for_update_done"),
            "CHECK_FOR_SKILL_UPDATE_DONE_PATH": os.path.join(home, ".check_for_skill_update_done"),
            "AGENT_HARNESSES_PATH": os.path.join(home, ".agent_harnesses.json"),
            "HF_HUB_OFFLINE": False,
            "HF_HUB_DISABLE_XET": True,
            "HF_HUB_DISABLE_TELEMETRY": True,
            "HF_HUB_DISABLE_UPDATE_CHECK": True,
            "HF_HUB_DISABLE_IMPLICIT_TOKEN": False,
            "HF_HUB_DISABLE_SYMLINKS_WARNING": True,
            "HF_URL_HOSTS": frozenset(getattr(C, "HF_URL_HOSTS", frozenset())) | {self.host},
        }
        for name, value in patches.items():
            if hasattr(C, name):
                monkeypatch.setattr(C, name, value)
        # Module-level HfApi behind huggingface_hub.model_info / list_repo_tree / ...: endpoint fixed at import.
        monkeypatch.setattr(hf_api.api, "endpoint", self.endpoint)
        try:  # `from ..constants import HF_HUB_CACHE` (scan_cache_dir's default)
            from huggingface_hub.utils import _cache_manager

            monkeypatch.setattr(_cache_manager, "HF_HUB_CACHE", cache)
        except (ImportError, AttributeError):
            pass
        if hasattr(_http, "_HUB_ORIGINS"):  # origins the client follows redirects to, with the auth header
            origins = frozenset(_http._HUB_ORIGINS) | {_http._url_origin(self.endpoint)}
            monkeypatch.setattr(_http, "_HUB_ORIGINS", origins)
        # A fresh shared httpx client: no pooled connection to another server, proxy settings re-read.
        huggingface_hub.close_session()

    def set_offline(self, offline: bool = True) -> None:
        """HF_HUB_OFFLINE=1 (or unset) for this process and its subprocesses. Needs `install` first."""
        if self._monkeypatch is None:
            raise RuntimeError("call install(monkeypatch, hf_home) first")
        from huggingface_hub import constants as C

        if offline:
            self._monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        else:
            self._monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        self._monkeypatch.setattr(C, "HF_HUB_OFFLINE", offline)

    # ---- request handling

    def _handle(self, h: _Handler, method: str) -> None:
        started = time.thread_time()
        split = urlsplit(h.path)
        rec = RequestRecord(
            method=method,
            path=unquote(split.path),
            query=parse_qs(split.query, keep_blank_values=True),
            status=0,
            kind="other",
            authorization=h.headers.get("Authorization"),
            range=h.headers.get("Range"),
        )
        try:
            self._handle_request(h, method, rec)
        finally:
            spent = time.thread_time() - started
            role = "download" if rec.kind in ("resolve", "info", "tree", "paths-info") else "upload"
            with self._lock:
                self.cpu_seconds += spent
                self.cpu_by_role[role] = self.cpu_by_role.get(role, 0.0) + spent

    def _handle_request(self, h: _Handler, method: str, rec: RequestRecord) -> None:
        split = urlsplit(h.path)
        raw_segs = split.path.split("/")
        query = rec.query
        try:
            kind = upload_kind(method, raw_segs)
            if kind is not None and self._upload_fault(h, rec, kind):
                return
            body = b""
            if method == "POST":
                n = int(h.headers.get("Content-Length") or 0)
                body = h.rfile.read(n) if n else b""
            if split.path == "/api/agent-harnesses":
                return self._send_json(h, rec, 200, {"standardEnvVars": [], "harnesses": {}})
            if split.path == STATE_PATH and method == "GET":
                return self._send_json(h, rec, 200, self.state())
            if self._upload_route(h, rec, method, raw_segs, body):
                return
            if len(raw_segs) > 3 and raw_segs[1] == "api" and raw_segs[2] == "models":
                return self._api(h, rec, method, raw_segs[3:], query, body)
            if "resolve" in raw_segs[2:]:
                return self._resolve(h, rec, method, raw_segs)
            raise _HubError(404, None, "Not Found")
        except _HubError as e:
            headers = {"X-Error-Message": e.message, "X-Request-Id": f"fake-{len(self.requests)}"}
            if e.code:
                headers["X-Error-Code"] = e.code
            if e.commit:
                headers["X-Repo-Commit"] = e.commit
            self._send_json(h, rec, e.status, {"error": e.message}, headers | e.headers)
        except Dropped:
            self._record(rec, -1)  # a lost connection: no answer at all
            self._close(h)
        except (BrokenPipeError, ConnectionResetError):
            h.close_connection = True

    def _repo(self, rec: RequestRecord, segs: list[str], h: _Handler) -> tuple[_Repo, list[str]]:
        """Match the longest registered repo id at the start of `segs` (raw URL segments); check auth."""
        names = [unquote(s) for s in segs]
        with self._lock:
            repo = None
            for n in (2, 1):
                if len(names) >= n and "/".join(names[:n]) in self._repos:
                    repo, rest = self._repos["/".join(names[:n])], segs[n:]
                    break
        if repo is None:
            rec.repo_id = "/".join(names[:2])
            raise _HubError(404, "RepoNotFound", "Repository not found")
        rec.repo_id = repo.repo_id
        if repo.private:
            auth = h.headers.get("Authorization")
            if auth is None:
                raise _HubError(401, "RepoNotFound", "Invalid username or password.")
            if auth != f"Bearer {repo.token}":
                raise _HubError(401, None, "Invalid credentials in Authorization header")
        return repo, rest

    def _commit(self, repo: _Repo, rec: RequestRecord, raw_rev: str) -> _Commit:
        rev = unquote(raw_rev)
        rec.revision = rev
        with self._lock:
            sha = repo.refs.get(rev) or (rev if rev in repo.commits else None)
            if sha is None:
                raise _HubError(404, "RevisionNotFound", f"Invalid rev id: {rev}")
            return repo.commits[sha]

    def _check_fail(self, rec: RequestRecord, method: str, path: str | None) -> None:
        with self._lock:
            for key in ((rec.repo_id, path), (rec.repo_id, None)) if path is not None else ((rec.repo_id, None),):
                for m, status, countdown, message in self._fail.get(key, []):
                    if (m is None or m == method) and countdown.take():
                        raise _HubError(status, None, message or f"Injected failure {status}")

    # -- /api/models/...

    def _api(self, h: _Handler, rec: RequestRecord, method: str, segs: list[str], query, body: bytes) -> None:
        rec.kind = next((k for k in ("tree", "paths-info") if k in segs[1:3]), "info")  # until parsed for real
        repo, rest = self._repo(rec, segs, h)
        self._check_fail(rec, method, None)
        if method == "POST" and rest and rest[0] in UPLOAD_ACTIONS:
            return self._upload_api(h, rec, repo, rest, query, body)
        if not rest or rest == [""]:
            if method == "POST":
                raise _HubError(405, None, "Method not allowed")
            rec.kind = "info"
            return self._info(h, rec, repo, self._commit(repo, rec, "main"), query)
        action = rest[0]
        if action == "revision" and len(rest) == 2 and method != "POST":
            rec.kind = "info"
            return self._info(h, rec, repo, self._commit(repo, rec, rest[1]), query)
        if action == "tree" and len(rest) >= 2 and method != "POST":
            rec.kind = "tree"
            commit = self._commit(repo, rec, rest[1])
            sub = unquote("/".join(rest[2:])).strip("/")
            return self._tree(h, rec, repo, commit, sub, query)
        if action == "paths-info" and len(rest) == 2 and method == "POST":
            rec.kind = "paths-info"
            commit = self._commit(repo, rec, rest[1])
            form = parse_qs(body.decode(), keep_blank_values=True)
            if not form and body.strip().startswith(b"{"):
                data = json.loads(body)
                form = {"paths": data.get("paths", []), "expand": [str(data.get("expand", False))]}
            expand = _truthy(form.get("expand"))
            out = []
            for p in form.get("paths", []):
                p = p.strip("/")
                if p in commit.files:
                    out.append(self._file_entry(repo, commit, commit.files[p], expand))
                elif p in commit.dirs:
                    out.append(self._dir_entry(commit, p, expand))
            return self._send_json(h, rec, 200, out)
        raise _HubError(404, None, "Not Found")

    def _advertised_sha256(self, repo: _Repo, f: _File) -> str:
        with self._lock:
            return self._advertised.get((repo.repo_id, f.path), f.sha256)

    def _file_entry(self, repo: _Repo, commit: _Commit, f: _File, expand: bool) -> dict:
        entry: dict = {"type": "file", "oid": f.git_oid, "size": f.size, "path": f.path}
        if f.lfs:
            entry["lfs"] = {"oid": self._advertised_sha256(repo, f), "size": f.size, "pointerSize": f.pointer_size}
        if expand:
            entry["lastCommit"] = {"id": commit.sha, "title": "Upload", "date": _DATE}
            entry["securityFileStatus"] = {"status": "safe", "avScan": None, "pickleImportScan": None}
        return entry

    def _dir_entry(self, commit: _Commit, path: str, expand: bool) -> dict:
        entry: dict = {
            "type": "directory",
            "oid": hashlib.sha1(f"{commit.sha}:{path}".encode()).hexdigest(),
            "size": 0,
            "path": path,
        }
        if expand:
            entry["lastCommit"] = {"id": commit.sha, "title": "Upload", "date": _DATE}
        return entry

    def _info(self, h: _Handler, rec: RequestRecord, repo: _Repo, commit: _Commit, query) -> None:
        blobs = _truthy(query.get("blobs"))
        siblings = []
        for f in commit.files.values():
            s: dict = {"rfilename": f.path}
            if blobs:
                s["size"] = f.size
                s["blobId"] = f.git_oid
                if f.lfs:
                    s["lfs"] = {
                        "sha256": self._advertised_sha256(repo, f),
                        "size": f.size,
                        "pointerSize": f.pointer_size,
                    }
            siblings.append(s)
        ns = repo.repo_id.split("/")[0] if "/" in repo.repo_id else None
        data = {
            "_id": hashlib.sha1(repo.repo_id.encode()).hexdigest()[:24],
            "id": repo.repo_id,
            "modelId": repo.repo_id,
            "author": ns,
            "sha": commit.sha,
            "lastModified": _DATE,
            "createdAt": _DATE,
            "private": repo.private,
            "gated": False,
            "disabled": False,
            "downloads": 0,
            "likes": 0,
            "tags": [],
            "siblings": siblings,
            "usedStorage": sum(f.size for f in commit.files.values()),
        }
        self._send_json(h, rec, 200, data)

    def _tree(self, h: _Handler, rec: RequestRecord, repo: _Repo, commit: _Commit, sub: str, query) -> None:
        recursive, expand = _truthy(query.get("recursive")), _truthy(query.get("expand"))
        if sub and sub not in commit.dirs:
            if sub in commit.files:  # the Hub lists a file path as that single file
                return self._send_json(h, rec, 200, [self._file_entry(repo, commit, commit.files[sub], expand)])
            raise _HubError(404, "EntryNotFound", f"{sub} does not exist on {rec.revision}", commit.sha)
        prefix = sub + "/" if sub else ""

        def wanted(p: str) -> bool:
            return p.startswith(prefix) and (recursive or "/" not in p[len(prefix) :])

        entries = [self._dir_entry(commit, d, expand) for d in sorted(commit.dirs) if wanted(d)]
        entries += [self._file_entry(repo, commit, f, expand) for p, f in commit.files.items() if wanted(p)]
        page = max(1, self.tree_expand_page_size if expand else self.tree_page_size)
        start = int((query.get("cursor") or ["0"])[-1] or 0)
        chunk = entries[start : start + page]
        headers = {}
        if start + page < len(entries):
            q = {k: v[-1] for k, v in query.items() if k != "cursor"}
            q["cursor"] = str(start + page)
            headers["Link"] = f'<{self.endpoint}{urlsplit(h.path).path}?{urlencode(q)}>; rel="next"'
        self._send_json(h, rec, 200, chunk, headers)

    # -- /{repo_id}/resolve/{revision}/{path}

    def _resolve(self, h: _Handler, rec: RequestRecord, method: str, raw_segs: list[str]) -> None:
        rec.kind = "resolve"
        i = raw_segs.index("resolve", 2)
        if method == "POST":
            raise _HubError(405, None, "Method not allowed")
        prefix = raw_segs[1:i]
        if prefix and prefix[0] in ("datasets", "spaces", "kernels"):
            rec.repo_id = "/".join(unquote(s) for s in prefix[1:])
            raise _HubError(404, "RepoNotFound", "Repository not found (FakeHub serves models only)")
        if len(raw_segs) < i + 3:
            raise _HubError(404, None, "Not Found")
        rec.filename = unquote("/".join(raw_segs[i + 2 :]))
        if len(prefix) not in (1, 2):
            rec.repo_id = "/".join(unquote(s) for s in prefix)
            raise _HubError(404, "RepoNotFound", "Repository not found")
        repo, rest = self._repo(rec, prefix, h)
        if rest:
            raise _HubError(404, "RepoNotFound", "Repository not found")
        commit = self._commit(repo, rec, raw_segs[i + 1])
        f = commit.files.get(rec.filename)
        if f is None:
            raise _HubError(404, "EntryNotFound", f"{rec.filename} does not exist on {rec.revision}", commit.sha)
        self._check_fail(rec, method, f.path)
        if f.disk is None and method == "GET":
            raise _HubError(410, None, f"{f.path}: FakeHub's sink kept no bytes of it (only its size and sha256)")

        key = (repo.repo_id, f.path)
        with self._lock:
            corrupt = self._corrupt.get(key)
            use_corrupt = corrupt is not None and (
                corrupt[1].take() if method == "GET" else (corrupt[1].remaining is None or corrupt[1].remaining > 0)
            )
            trunc = self._truncate.get(key)
            trunc_at = trunc[0] if (method == "GET" and trunc is not None and trunc[1].take()) else -1
            stall = self._stall.get(key)
            stalled = method == "GET" and not h.headers.get("Range") and stall is not None and stall.take()
        data: bytes | None = None
        if use_corrupt:
            data = corrupt[0]
            if data is None:
                data = bytearray(f.disk.read_bytes())
                if data:
                    data[-1] ^= 0xFF
                data = bytes(data)
        total = len(data) if data is not None else f.size

        etag = self._advertised_sha256(repo, f) if f.lfs else f.git_oid
        headers = {
            "ETag": f'"{etag}"',
            "X-Repo-Commit": commit.sha,
            "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream",
            "Content-Disposition": f'inline; filename="{f.path.rsplit("/", 1)[-1]}"',
        }
        if f.lfs:
            headers["X-Linked-Etag"] = f'"{etag}"'
            headers["X-Linked-Size"] = str(f.size)

        start, end, status = 0, total - 1, 200
        rng = h.headers.get("Range")
        if rng:
            parsed = _parse_range(rng, total)
            if parsed is None:
                headers["Content-Range"] = f"bytes */{total}"
                return self._send(h, rec, 416, b"", {**headers, "X-Error-Message": "Range Not Satisfiable"}, method)
            start, end = parsed
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end}/{total}"
        length = max(0, end - start + 1)
        headers["Content-Length"] = str(length)
        self._record(rec, status)
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, v)
        h.end_headers()
        if method == "HEAD":
            return
        if stalled:
            h.wfile.flush()
            self._unstall.wait(60)
            h.close_connection = True
            return
        limit = length if trunc_at < 0 else min(length, trunc_at if trunc_at is not None else length // 2)
        # bytes_sent is counted before each write: the client may return as soon as it has the last byte.
        if data is not None:
            rec.bytes_sent = limit
            h.wfile.write(data[start : start + limit])
        else:
            with open(f.disk, "rb") as fh:
                _send_span(h.connection, fh, start, limit, rec)
        h.wfile.flush()
        if rec.bytes_sent < length:  # injected truncation: drop the connection mid-body
            h.close_connection = True
            try:
                h.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    # -- responses

    def _record(self, rec: RequestRecord, status: int) -> None:
        rec.status = status
        with self._lock:
            self.requests.append(rec)

    def _send_json(self, h: _Handler, rec: RequestRecord, status: int, obj, headers: dict | None = None) -> None:
        body = json.dumps(obj).encode()
        self._send(h, rec, status, body, {"Content-Type": "application/json", **(headers or {})}, h.command)

    def _send(self, h: _Handler, rec: RequestRecord, status: int, body: bytes, headers: dict, method: str) -> None:
        self._record(rec, status)
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if method != "HEAD":
            rec.bytes_sent = len(body)
            h.wfile.write(body)


def client_env(endpoint: str, hf_home: str | Path) -> dict[str, str]:
    """Env vars pointing a `huggingface_hub` process at the fake Hub at `endpoint` (another
    process's too: fake_hub_serve.py), its cache under `hf_home` (FakeHub.env)."""
    hf_home = Path(hf_home)
    host = urlsplit(endpoint).hostname or "127.0.0.1"
    no_proxy = ",".join(x for x in dict.fromkeys([host, "localhost", *os.environ.get("NO_PROXY", "").split(",")]) if x)
    return {
        "HF_ENDPOINT": endpoint,
        "HF_HOME": str(hf_home),
        "HF_HUB_CACHE": str(hf_home / "hub"),
        "HF_HUB_DISABLE_XET": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "HF_HUB_DISABLE_UPDATE_CHECK": "1",
        "HF_HUB_DISABLE_SYMLINKS_WARNING": "1",
        "NO_PROXY": no_proxy,
        "no_proxy": no_proxy,
    }


def _parse_range(value: str, total: int) -> tuple[int, int] | None:
    """Single `bytes=a-b`, `bytes=a-` or `bytes=-n` range -> inclusive (start, end), None if unsatisfiable."""
    if not value.startswith("bytes=") or "," in value:
        return None
    a, _, b = value[len("bytes=") :].strip().partition("-")
    try:
        if a == "":
            n = int(b)
            if n <= 0:
                return None
            return max(0, total - n), total - 1
        start = int(a)
        end = int(b) if b else total - 1
    except ValueError:
        return None
    if start >= total or end < start:
        return None
    return start, min(end, total - 1)
