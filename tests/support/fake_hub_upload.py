"""The upload side of `FakeHub` (fake_hub.py): the endpoints huggingface_hub 2.4 calls to create a
repo or a branch, validate a model card, and commit files with LFS, as that client calls them
(read from its source: hf_api.create_repo / create_branch / create_commit / preupload_lfs_files,
_commit_api, lfs, repocard.ModelCard.validate).

    POST /api/repos/create                                 {name, organization, visibility}; 409 + url if it exists
    POST /api/models/{repo_id}/branch/{branch}             {} or {startingPoint}; 409 if it exists
    POST /api/validate-yaml                                {content, repoType}: the card's front matter
    POST /api/models/{repo_id}/preupload/{rev}             {files: [{path, sample, size}]} -> uploadMode, oid
    POST /{repo_id}.git/info/lfs/objects/batch             LFS batch: no `actions` for an object already stored
    PUT  /fake-lfs/{oid}                                   a basic transfer (no auth, as a presigned URL)
    PUT  /fake-lfs/{oid}/part/{n}, POST .../complete       a multipart transfer (ETag per part, then completion)
    POST /{repo_id}.git/info/lfs/objects/verify            {oid, size}: 404 unless stored
    POST /api/models/{repo_id}/commit/{rev}                NDJSON: header, file (base64), lfsFile, deletedFile, deletedFolder

The bodies are checked as the real Hub would: an LFS object is stored only when its bytes hash to
its oid and have its size (a multipart one once its parts, their ETags and the whole check out);
a commit's `lfsFile` must name a stored object of that size. A commit becomes a new commit of the
repo, so model_info, the tree, paths-info and resolve (the download side) show it. A new repo
starts, as on the Hub, with a commit holding `.gitattributes`.

Writes need `Authorization: Bearer TOKEN` with a token registered by `add_token` (401 without
one or for an unknown one; 403 for a read token, or a write token outside its namespaces, with
the Hub's kind of message). What a test looks at: `commits` (CommitRecord, in order),
`preuploads` (PreuploadRecord, in order), `lfs_uploads` (the oid of every object stored, once per
completed transfer), `tree(repo)` / `tree_sizes(repo)`, `is_private(repo)`, and the bytes
received: `received_lfs` (oid -> body bytes of every LFS PUT of it, cut ones included),
`received_inline` ((repo, path) -> bytes of that path in every commit body that carried it) and
`received_by_path(repo)` (each file of the branch: what was received for it; equal to its size
when nothing was sent twice).

The sink (`FakeHub(sink=True)`): the bytes of an LFS object are hashed as they arrive (by part,
in order, for a multipart transfer), checked against its oid and size, and dropped; the repo
keeps the path, size and sha256, so listings, paths-info, model_info and the batch's "already
stored" answer are as before, and a GET of such a file answers 410. Regular (inline) files keep
their bytes.

Faults: `hold_uploads` (PUTs of other objects than the ones allowed wait, before reading their
body, until `release_uploads` or the server stops), `drop(kind)` (close the connection without
an answer), `quota(bytes)` (a 403 storage-limit answer from the LFS batch once the objects would
pass it), `fail(..., message=)` of the download side, which upload requests about a repo honour
too; and, by request kind (UPLOAD_KINDS: preupload, lfs-batch, lfs-upload, lfs-part,
lfs-complete, lfs-verify, commit, ...), before the request is handled: `fail_upload(kind,
status, times, retry_after=)` (an error answer, 429 with Retry-After), `cut_upload(kind, at=,
times)` (read `at` bytes of the body, default half, then close the connection: cut mid-body) and
`stall_upload(kind, times, seconds=)` (read nothing and answer nothing for `seconds`, or until
`release_stalls()` or the server stops).
"""

from __future__ import annotations

import base64
import binascii
import fnmatch
import hashlib
import json
import os
import re
import socket
import tempfile
import threading
import time
import uuid
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

import yaml

LFS_JSON = "application/vnd.git-lfs+json"
LFS_SIZE = 10 * 1024 * 1024  # the Hub's own threshold: a file this large is always LFS
RELATIONS = ("adapter", "merge", "quantized", "finetune")  # the Hub's base_model_relation values
# The Hub's license identifiers: the table of hub-docs docs/hub/repositories-licenses.md (the
# "region licenses" block, read at commit 008d54d), `other` asking for license_name.
LICENSES = (
    "apache-2.0", "mit", "openrail", "bigscience-openrail-m", "creativeml-openrail-m", "bigscience-bloom-rail-1.0",
    "bigcode-openrail-m", "afl-3.0", "artistic-2.0", "bsl-1.0", "bsd", "bsd-2-clause", "bsd-3-clause",
    "bsd-3-clause-clear", "c-uda", "cc", "cc0-1.0", "cc-by-2.0", "cc-by-2.5", "cc-by-3.0", "cc-by-4.0",
    "cc-by-sa-3.0", "cc-by-sa-4.0", "cc-by-nc-2.0", "cc-by-nc-3.0", "cc-by-nc-4.0", "cc-by-nd-4.0",
    "cc-by-nc-nd-3.0", "cc-by-nc-nd-4.0", "cc-by-nc-sa-2.0", "cc-by-nc-sa-3.0", "cc-by-nc-sa-4.0",
    "cdla-sharing-1.0", "cdla-permissive-1.0", "cdla-permissive-2.0", "wtfpl", "ecl-2.0", "epl-1.0", "epl-2.0",
    "etalab-2.0", "eupl-1.1", "agpl-3.0", "gfdl", "gpl", "gpl-2.0", "gpl-3.0", "lgpl", "lgpl-2.1", "lgpl-3.0", "isc",
    "lppl-1.3c", "ms-pl", "mpl-2.0", "odc-by", "odbl", "openrail++", "osl-3.0", "postgresql", "ofl-1.1", "ncsa",
    "unlicense", "zlib", "pddl", "lgpl-lr", "deepfloyd-if-license", "llama2", "gemma", "unknown", "other",
)  # fmt: skip
# The Hub's tasks (pipeline_tag): the keys of PIPELINE_DATA in huggingface.js
# packages/tasks/src/pipelines.ts (read at commit 2c3c6c2).
TASKS = (
    "text-classification", "token-classification", "table-question-answering", "question-answering",
    "zero-shot-classification", "translation", "summarization", "feature-extraction", "text-generation",
    "text2text-generation", "fill-mask", "sentence-similarity", "text-to-speech", "text-to-audio",
    "automatic-speech-recognition", "audio-to-audio", "audio-classification", "voice-activity-detection",
    "depth-estimation", "image-classification", "object-detection", "image-segmentation", "text-to-image",
    "image-to-text", "image-to-image", "image-to-video", "unconditional-image-generation", "video-classification",
    "reinforcement-learning", "robotics", "tabular-classification", "tabular-regression", "tabular-to-text",
    "table-to-text", "multiple-choice", "text-retrieval", "time-series-forecasting", "text-to-video",
    "image-text-to-text", "visual-question-answering", "document-question-answering", "zero-shot-image-classification",
    "graph-ml", "mask-generation", "zero-shot-object-detection", "text-to-3d", "image-to-3d",
    "image-feature-extraction", "video-text-to-text", "keypoint-detection", "other",
)  # fmt: skip
# A model id as the Hub names one: NAME or OWNER/NAME (huggingface_hub's validate_repo_id).
MODEL_ID = re.compile(r"^(?:[\w.-]+/)?[\w.-]+$")
GITATTRIBUTES = (
    "*.bin filter=lfs diff=lfs merge=lfs -text\n"
    "*.safetensors filter=lfs diff=lfs merge=lfs -text\n"
    "*.pt filter=lfs diff=lfs merge=lfs -text\n"
    "*tfevents* filter=lfs diff=lfs merge=lfs -text\n"
)
_YAML_BLOCK = re.compile(r"^\s*---\r?\n([\S\s]*?)\r?\n---[ \t]*(\r?\n|$)")
UPLOAD_ACTIONS = ("preupload", "commit", "branch")
# What `fail_upload`, `cut_upload` and `stall_upload` take: the kinds of upload requests.
UPLOAD_KINDS = (
    "create", "branch", "validate-yaml", "preupload", "lfs-batch", "lfs-upload", "lfs-part", "lfs-complete",
    "lfs-verify", "commit",
)  # fmt: skip
# A connection's buffer for the bodies it sends, reused (no allocation per chunk); small enough to
# stay in the CPU cache between the receive and the hashes that read it.
_BODY_BUFFER = 1 << 20


@dataclass
class CommitRecord:
    repo_id: str
    revision: str
    sha: str
    summary: str
    added: list[str] = field(default_factory=list)  # regular and LFS files, in the order sent
    lfs: list[str] = field(default_factory=list)  # those of `added` committed as LFS pointers
    deleted: list[str] = field(default_factory=list)


@dataclass
class PreuploadRecord:
    repo_id: str
    revision: str
    files: list[tuple[str, int, str]]  # (path, size, "lfs" | "regular") as answered


class Dropped(Exception):
    """Raised to close the connection without an answer (a lost connection)."""


@dataclass
class _Object:
    """A stored LFS object: its bytes at `path`, or (the sink) only its size."""

    size: int
    path: Path | None


@dataclass
class _Parts:
    """A multipart transfer under way. The sink hashes the parts in order as they come (a part
    that comes early waits in `data`), and a part sent again after it was hashed on top of the
    parts before it, to compare; otherwise the parts' bytes are kept until completion."""

    hasher: object  # sha256 of parts 1 .. next - 1
    next: int = 1
    etags: dict[int, str] = field(default_factory=dict)  # part -> its ETag (_part_etag)
    sizes: dict[int, int] = field(default_factory=dict)
    data: dict[int, bytes] = field(default_factory=dict)  # kept parts (not the sink), early parts (the sink)
    before: dict[int, object] = field(default_factory=dict)  # the sink, n < next: sha256 of parts 1 .. n - 1
    through: dict[int, str] = field(default_factory=dict)  # the sink, n < next: sha256 hex of parts 1 .. n
    mismatch: bool = False  # a part sent again with other bytes after it was hashed


@dataclass
class _Fault:
    kind: str  # "fail" | "cut" | "stall"
    times: int
    status: int = 500
    retry_after: float | None = None
    message: str | None = None
    at: int | None = None  # cut: body bytes read first (None: half)
    seconds: float | None = None  # stall: None until released or stopped


@dataclass
class _Token:
    write: bool
    namespaces: frozenset[str] | None  # None: every namespace


class UploadEndpoints:
    """Mixed into FakeHub; needs its `_lock`, `_repos`, `endpoint`, `_record`, `_send_json`, `_send`,
    `_repo`, `_commit`, `_check_fail`, `_describe`, `_unstall` and the `_HubError`, `_Repo`, `_Commit`,
    `_File` classes handed to `_init_upload`."""

    def _init_upload(self, classes: dict, multipart_threshold: int, chunk_size: int, sink: bool) -> None:
        self._cls = classes
        self.multipart_threshold, self.chunk_size, self.sink = multipart_threshold, chunk_size, sink
        self._storage = tempfile.TemporaryDirectory(prefix="fake-hub-", ignore_cleanup_errors=True)
        self._tokens: dict[str, _Token] = {}
        self._objects: dict[str, _Object] = {}  # LFS oid -> the object stored
        self._parts: dict[str, _Parts] = {}  # oid -> its multipart transfer under way
        self.commits: list[CommitRecord] = []
        self.preuploads: list[PreuploadRecord] = []
        self.lfs_uploads: list[str] = []
        self.received_lfs: dict[str, int] = {}
        self.received_inline: dict[tuple[str, str], int] = {}
        self._faults: dict[str, list[_Fault]] = {}
        self._release = threading.Event()
        self._held = threading.Event()
        self._held.set()  # set: PUTs go through
        self._allowed: frozenset[str] = frozenset()  # ... and so do those of these objects (oids) while held
        self.puts_waiting = 0
        self._drops: dict[str, int] = {}
        self._quota: int | None = None

    # ---- what tests set and read

    def add_token(self, token: str, *, write: bool = True, namespaces: tuple[str, ...] | None = None) -> None:
        """Accept `token` (Bearer): a write token (in every namespace, or only `namespaces`), or a read one."""
        with self._lock:
            self._tokens[token] = _Token(write, None if namespaces is None else frozenset(namespaces))

    def hold_uploads(self, allow: frozenset[str] = frozenset()) -> None:
        """Every LFS PUT but those of the objects (sha256 oids) in `allow` waits, before reading its
        body, until `release_uploads()` (or the server stops). By object, not by arrival: the client
        sends several files at once, in no fixed order."""
        with self._lock:
            self._allowed = frozenset(allow)
        self._held.clear()

    def release_uploads(self) -> None:
        self._held.set()

    def drop(self, kind: str, *, times: int = 1) -> None:
        """Close the connection of the next `times` requests of `kind` (e.g. 'commit', 'lfs-batch')
        without sending an answer."""
        with self._lock:
            self._drops[kind] = self._drops.get(kind, 0) + times

    def quota(self, limit: int | None) -> None:
        """Refuse (403, the Hub's storage-limit message) an LFS batch whose new objects would take the
        stored bytes past `limit`; None lifts it."""
        self._quota = limit

    def fail_upload(
        self,
        kind: str,
        *,
        status: int = 500,
        times: int = 1,
        retry_after: float | None = None,
        message: str | None = None,
    ) -> None:
        """Answer the next `times` requests of `kind` (UPLOAD_KINDS) with `status` (and a
        `Retry-After: retry_after` header), their body read and ignored."""
        self._add_fault(kind, _Fault("fail", times, status, retry_after, message))

    def cut_upload(self, kind: str, *, at: int | None = None, times: int = 1) -> None:
        """Read `at` bytes of the body (default half) of the next `times` requests of `kind`, then
        close the connection without an answer: the connection lost in the middle of a send."""
        self._add_fault(kind, _Fault("cut", times, at=at))

    def stall_upload(self, kind: str, *, times: int = 1, seconds: float | None = None) -> None:
        """The next `times` requests of `kind` get nothing (their body not read, no answer) for
        `seconds`, then are handled as usual; None: until `release_stalls()` (then handled) or the
        server stops (then the connection closes)."""
        self._add_fault(kind, _Fault("stall", times, seconds=seconds))

    def release_stalls(self) -> None:
        self._release.set()

    def _add_fault(self, kind: str, fault: _Fault) -> None:
        if kind not in UPLOAD_KINDS:
            raise ValueError(f"unknown upload request kind {kind!r}; one of {', '.join(UPLOAD_KINDS)}")
        with self._lock:
            self._faults.setdefault(kind, []).append(fault)
        if fault.kind == "stall":
            self._release.clear()

    def tree(self, repo_id: str, revision: str = "main") -> dict[str, str]:
        """{path: sha256 of its bytes} of every file at `revision`."""
        with self._lock:
            repo = self._repos[repo_id]
            return {p: f.sha256 for p, f in repo.commits[repo.refs[revision]].files.items()}

    def tree_sizes(self, repo_id: str, revision: str = "main") -> dict[str, tuple[int, str]]:
        """{path: (size, sha256)} of every file at `revision`."""
        with self._lock:
            repo = self._repos[repo_id]
            return {p: (f.size, f.sha256) for p, f in repo.commits[repo.refs[revision]].files.items()}

    def received_by_path(self, repo_id: str, revision: str = "main") -> dict[str, int]:
        """Each file of the branch: the bytes received for it (an LFS file: every PUT of its
        object, whichever path or repo it came for; a regular one: every commit body that
        carried it). A file of the repo no upload brought (add_repo, .gitattributes): 0."""
        with self._lock:
            repo = self._repos[repo_id]
            files = repo.commits[repo.refs[revision]].files
            return {
                p: self.received_lfs.get(f.sha256, 0) if f.lfs else self.received_inline.get((repo_id, p), 0)
                for p, f in files.items()
            }

    @property
    def received_bytes(self) -> int:
        """Every byte of upload content received: LFS PUT bodies and inline commit files."""
        with self._lock:
            return sum(self.received_lfs.values()) + sum(self.received_inline.values())

    def is_private(self, repo_id: str) -> bool:
        with self._lock:
            return self._repos[repo_id].private

    # ---- routing (called from FakeHub._handle and FakeHub._api)

    def _upload_route(self, h, rec, method: str, raw_segs: list[str], body: bytes) -> bool:
        """Requests outside /api/models/...; True when one was handled here."""
        path = "/".join(raw_segs)
        if method == "POST" and path == "/api/repos/create":
            self._create_repo(h, rec, body)
        elif method == "POST" and path == "/api/validate-yaml":
            self._validate_yaml(h, rec, body)
        elif raw_segs[1:2] == ["fake-lfs"]:
            self._lfs_transfer(h, rec, method, raw_segs[2:], body)
        elif method == "POST" and len(raw_segs) >= 4 and raw_segs[-4:-1] == ["info", "lfs", "objects"]:
            prefix = raw_segs[1:-4]  # OWNER, NAME.git
            if not prefix or not prefix[-1].endswith(".git"):
                return False
            prefix[-1] = prefix[-1][: -len(".git")]
            repo, _ = self._repo(rec, prefix, h)
            self._write_auth(h, rec, repo.repo_id)
            self._check_fail(rec, method, None)
            if raw_segs[-1] == "batch":
                self._lfs_batch(h, rec, repo, body)
            elif raw_segs[-1] == "verify":
                self._lfs_verify(h, rec, body)
            else:
                return False
        else:
            return False
        return True

    def _upload_api(self, h, rec, repo, rest: list[str], query, body: bytes) -> None:
        """POST /api/models/{repo_id}/{preupload|commit|branch}/{rev}."""
        if len(rest) != 2:
            raise self._cls["HubError"](404, None, "Not Found")
        action, rev = rest[0], unquote(rest[1])
        rec.kind = action
        self._write_auth(h, rec, repo.repo_id)
        self._take_drop(action)
        if action == "branch":
            return self._create_branch(h, rec, repo, rev, body)
        commit = self._commit(repo, rec, rest[1])
        if action == "preupload":
            return self._preupload(h, rec, repo, commit, body)
        if query.get("create_pr"):
            raise self._cls["HubError"](400, None, "FakeHub does not open pull requests")
        self._commit_files(h, rec, repo, commit, rev, h.headers.get("Content-Type", ""), body)

    # ---- auth and faults

    def _write_auth(self, h, rec, repo_id: str, creating: bool = False) -> None:
        error = self._cls["HubError"]
        auth = h.headers.get("Authorization") or ""
        if not auth.startswith("Bearer "):
            raise error(401, None, "Invalid username or password.")
        with self._lock:
            token = self._tokens.get(auth[len("Bearer ") :])
        if token is None:
            raise error(401, None, "Invalid credentials in Authorization header")
        namespace = repo_id.split("/")[0]
        if not token.write or (token.namespaces is not None and namespace not in token.namespaces):
            if creating:
                raise error(
                    403, None, f'You don\'t have the rights to create a model under the namespace "{namespace}"'
                )
            raise error(403, None, f"You don't have the rights to write to {repo_id}: this token is read-only here")

    def _take_drop(self, kind: str) -> None:
        with self._lock:
            if self._drops.get(kind, 0) > 0:
                self._drops[kind] -= 1
                raise Dropped(kind)

    @staticmethod
    def _close(h) -> None:
        h.close_connection = True
        try:
            h.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    # ---- repos and branches

    def _create_repo(self, h, rec, body: bytes) -> None:
        rec.kind = "create"
        data = _json_object(body, self._cls["HubError"])
        name, org = data.get("name"), data.get("organization")
        if not isinstance(name, str) or not name or (data.get("type") not in (None, "model")):
            raise self._cls["HubError"](400, None, "FakeHub creates model repos from a name")
        repo_id = f"{org}/{name}" if org else name
        rec.repo_id = repo_id
        self._write_auth(h, rec, repo_id, creating=True)
        self._take_drop("create")
        url = f"{self.endpoint}/{repo_id}"
        with self._lock:
            if repo_id in self._repos:
                return self._send_json(h, rec, 409, {"error": "You already created this model repo", "url": url})
            private = data.get("visibility") == "private"
            token = h.headers["Authorization"][len("Bearer ") :] if private else None
            repo = self._cls["Repo"](repo_id, private=private, token=token)
            self._repos[repo_id] = repo
            attributes = self._store_blob(GITATTRIBUTES.encode())
            files = {".gitattributes": self._file(".gitattributes", attributes)}
            sha = self._new_commit(repo, "main", None, files, "initial commit", ([".gitattributes"], [], []))
        self._send_json(h, rec, 200, {"url": url, "name": repo_id, "id": sha[:24]})

    def _create_branch(self, h, rec, repo, branch: str, body: bytes) -> None:
        data = _json_object(body or b"{}", self._cls["HubError"])
        with self._lock:
            if branch in repo.refs:
                return self._send_json(h, rec, 409, {"error": "Reference already exists"})
            start = data.get("startingPoint") or "main"
            sha = repo.refs.get(start) or (start if start in repo.commits else None)
            if sha is None:
                raise self._cls["HubError"](404, "RevisionNotFound", f"Invalid rev id: {start}")
            repo.refs[branch] = sha
        self._send_json(h, rec, 200, {})

    # ---- the model card

    def _validate_yaml(self, h, rec, body: bytes) -> None:
        rec.kind = "validate-yaml"
        data = _json_object(body, self._cls["HubError"])
        content = data.get("content") if isinstance(data.get("content"), str) else ""
        match = _YAML_BLOCK.search(content)
        if match is None:
            warning = {"message": "empty or missing yaml metadata in repo card"}
            return self._send_json(h, rec, 200, {"errors": [], "warnings": [warning]})
        try:
            meta = yaml.safe_load(match.group(1))
        except yaml.YAMLError as e:
            return self._send_json(h, rec, 400, {"errors": [{"message": f"Invalid YAML: {e}"}], "warnings": []})
        if meta is not None and not isinstance(meta, dict):
            errors = ["the metadata must be a mapping"]
        else:
            errors = front_matter_errors(meta or {})
        status = 400 if errors else 200
        self._send_json(h, rec, status, {"errors": [{"message": m} for m in errors], "warnings": []})

    # ---- preupload and the LFS protocol

    def _is_lfs(self, path: str, size: int) -> bool:
        name = path.rsplit("/", 1)[-1]
        matches = any(fnmatch.fnmatch(path, p) or fnmatch.fnmatch(name, p) for p in self.lfs_patterns)
        return size > 0 and (matches or size >= LFS_SIZE)

    def _preupload(self, h, rec, repo, commit, body: bytes) -> None:
        error = self._cls["HubError"]
        files = _json_object(body, error).get("files")
        if not isinstance(files, list):
            raise error(400, None, "files: expected a list")
        out = []
        for f in files:
            path, size, sample = f.get("path"), f.get("size"), f.get("sample")
            if not (isinstance(path, str) and isinstance(size, int) and size >= 0 and isinstance(sample, str)):
                raise error(400, None, f"bad preupload entry {f!r}")
            try:
                if len(base64.b64decode(sample, validate=True)) > 512:
                    raise error(400, None, f"{path}: sample longer than 512 bytes")
            except binascii.Error as e:
                raise error(400, None, f"{path}: sample is not base64") from e
            lfs = self._is_lfs(path, size)
            there = commit.files.get(path)
            oid = None if there is None else there.sha256 if there.lfs else there.git_oid
            out.append({"path": path, "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False, "oid": oid})
        with self._lock:
            modes = [(f["path"], f["size"], o["uploadMode"]) for f, o in zip(files, out, strict=True)]
            self.preuploads.append(PreuploadRecord(repo.repo_id, rec.revision, modes))
        self._send_json(h, rec, 200, {"files": out, "commitOid": commit.sha})

    def _lfs_batch(self, h, rec, repo, body: bytes) -> None:
        rec.kind = "lfs-batch"
        error = self._cls["HubError"]
        if LFS_JSON not in (h.headers.get("Content-Type") or "") or LFS_JSON not in (h.headers.get("Accept") or ""):
            raise error(406, None, f"LFS batch requests are {LFS_JSON}")
        self._take_drop("lfs-batch")
        data = _json_object(body, error)
        objects = data.get("objects")
        if (
            data.get("operation") != "upload"
            or data.get("hash_algo", "sha256") != "sha256"
            or not isinstance(objects, list)
        ):
            raise error(400, None, "expected an upload of sha256 objects")
        new = 0
        answers = []
        for o in objects:
            oid, size = o.get("oid"), o.get("size")
            if not (isinstance(oid, str) and re.fullmatch("[0-9a-f]{64}", oid) and isinstance(size, int)):
                raise error(400, None, f"bad LFS object {o!r}")
            with self._lock:
                stored = self._objects.get(oid)
            if stored is not None and stored.size == size:
                answers.append({"oid": oid, "size": size})  # already there: no actions
                continue
            new += size
            answers.append({"oid": oid, "size": size, "authenticated": True, "actions": self._actions(repo, oid, size)})
        with self._lock:
            used = sum(o.size for o in self._objects.values())
        if self._quota is not None and used + new > self._quota:
            raise error(
                403, None, "Private repository storage limit reached, please upgrade your plan to increase your "
                "private storage limit."
            )  # fmt: skip
        multipart = any("chunk_size" in a.get("actions", {}).get("upload", {}).get("header", {}) for a in answers)
        transfer = "multipart" if multipart else "basic"
        self._send_json(h, rec, 200, {"transfer": transfer, "objects": answers, "hash_algo": "sha256"})

    def _actions(self, repo, oid: str, size: int) -> dict:
        verify = {"href": f"{self.endpoint}/{repo.repo_id}.git/info/lfs/objects/verify", "header": {}}
        if size <= self.multipart_threshold:
            return {"upload": {"href": f"{self.endpoint}/fake-lfs/{oid}?size={size}", "header": {}}, "verify": verify}
        parts = -(-size // self.chunk_size)
        header = {"chunk_size": str(self.chunk_size)}
        header |= {f"{n:05d}": f"{self.endpoint}/fake-lfs/{oid}/part/{n}" for n in range(1, parts + 1)}
        return {"upload": {"href": f"{self.endpoint}/fake-lfs/{oid}/complete?size={size}", "header": header},
                "verify": verify}  # fmt: skip

    def _lfs_transfer(self, h, rec, method: str, segs: list[str], body: bytes) -> None:
        """PUT /fake-lfs/{oid} (basic), PUT /fake-lfs/{oid}/part/{n}, POST /fake-lfs/{oid}/complete."""
        error = self._cls["HubError"]
        oid = segs[0] if segs else ""
        size = int((parse_qs(urlsplit(h.path).query).get("size") or ["-1"])[-1])
        if method == "PUT" and len(segs) == 1:
            rec.kind = "lfs-upload"
            self._receive_object(h, oid, size)
            return self._send(h, rec, 200, b"", {}, method)
        if method == "PUT" and len(segs) == 3 and segs[1] == "part" and segs[2].isdigit():
            rec.kind = "lfs-part"
            etag = self._receive_part(h, oid, int(segs[2]))
            return self._send(h, rec, 200, b"", {"ETag": f'"{etag}"'}, method)
        if method == "POST" and segs[1:] == ["complete"]:
            rec.kind = "lfs-complete"
            if LFS_JSON not in (h.headers.get("Content-Type") or ""):
                raise error(406, None, f"the completion is {LFS_JSON}")
            self._complete_parts(oid, size, _json_object(body, error).get("parts") or [])
            return self._send_json(h, rec, 200, {})
        raise error(404, None, "Not Found")

    def _put_body(self, h, oid: str):
        """The body of an LFS PUT, in chunks (views of the connection's buffer: each is valid until
        the next is asked for), each counted in `received_lfs` as it comes; Dropped when the client
        goes away before its end (nothing is stored then)."""
        with self._lock:
            self.puts_waiting += 1
        try:
            while not self._held.wait(0.05) and oid not in self._allowed:
                if self._unstall.is_set():  # the server is stopping
                    raise Dropped("put")
        finally:
            with self._lock:
                self.puts_waiting -= 1
        left = int(h.headers.get("Content-Length") or -1)
        if left < 0:
            raise self._cls["HubError"](411, None, "Content-Length required")
        yield from self._read_body(h, left, oid)

    def _read_body(self, h, left: int, oid: str | None):
        """`left` bytes of `h`'s body as views of its connection's buffer, each valid until the next
        is asked for; the bytes of an LFS object (`oid`) counted in `received_lfs` as they come, to
        the byte (one socket read at a time, counted even when the next one fails). Dropped when
        the client goes away before the end."""
        buf = getattr(h, "fake_hub_buffer", None)
        if buf is None:
            buf = h.fake_hub_buffer = memoryview(bytearray(_BODY_BUFFER))
        while left:
            want, got = min(left, len(buf)), 0
            try:
                while got < want:
                    n = h.rfile.readinto1(buf[got:want])
                    if not n:
                        raise Dropped("body")
                    got += n
            finally:
                if oid is not None and got:
                    with self._lock:
                        self.received_lfs[oid] = self.received_lfs.get(oid, 0) + got
            left -= got
            yield buf[:got]

    def _receive_object(self, h, oid: str, size: int) -> None:
        """A basic transfer: hashed as it comes; kept in a file (dropped by the sink)."""
        hasher, got = hashlib.sha256(), 0
        tmp = None if self.sink else self._lfs_dir() / f"{oid}.{uuid.uuid4().hex}.partial"
        try:
            with open(tmp, "wb") if tmp is not None else _Discard() as out:
                for chunk in self._put_body(h, oid):
                    hasher.update(chunk)
                    got += len(chunk)
                    out.write(chunk)
            self._store_object(oid, size, hasher.hexdigest(), got, tmp)
        finally:
            if tmp is not None:
                tmp.unlink(missing_ok=True)

    def _receive_part(self, h, oid: str, n: int) -> str:
        """One part of a multipart transfer; returns its ETag (_part_etag): in the sink, for a part
        whose predecessors came, the sha256 of the object through it, which the sink computes
        anyway; else its crc32."""
        with self._lock:
            state = self._parts.setdefault(oid, _Parts(hashlib.sha256()))
            base = None if not self.sink or n > state.next else state.hasher if n == state.next else state.before[n]
            hasher = None if base is None else base.copy()
        crc, kept, size = 0, [], 0
        for chunk in self._put_body(h, oid):
            size += len(chunk)
            if hasher is not None:
                hasher.update(chunk)
            else:
                crc = zlib.crc32(chunk, crc)
                kept.append(bytes(chunk))
        digest = None if hasher is None else hasher.hexdigest()
        etag = _part_etag("crc32", f"{crc:08x}", size) if digest is None else _part_etag("sha256", digest, size)
        with self._lock:
            if digest is None and self.sink and n < state.next:  # it came early; its predecessors too, meanwhile
                hasher = state.before[n].copy()
                hasher.update(b"".join(kept))
                digest = hasher.hexdigest()
            if hasher is not None and state.next == n:
                state.before[n], state.through[n] = base, digest
                state.hasher, state.next = hasher, n + 1
            elif hasher is not None:  # sent again after it was hashed: it must be the same
                state.mismatch |= state.through[n] != digest
            else:
                state.data[n] = b"".join(kept)
            while self.sink and state.next in state.data:  # early parts, now in order
                k = state.next
                state.before[k] = state.hasher.copy()
                state.hasher.update(state.data.pop(k))
                state.through[k], state.next = state.hasher.hexdigest(), k + 1
            state.etags[n], state.sizes[n] = etag, size
        return etag

    def _complete_parts(self, oid: str, size: int, parts: list) -> None:
        error = self._cls["HubError"]
        with self._lock:
            state = self._parts.get(oid)
            for n, part in enumerate(parts, start=1):
                if (
                    not isinstance(part, dict)
                    or part.get("partNumber") != n
                    or state is None
                    or n not in state.etags
                    or part.get("etag") != f'"{state.etags[n]}"'
                ):
                    raise error(400, None, f"part {n} of {oid}: missing, or not its ETag")
            if state is None or not parts:
                raise error(400, None, f"{oid}: no parts uploaded")
            count = len(parts)
            got = sum(state.sizes[n] for n in range(1, count + 1))
            if self.sink and (state.mismatch or state.next != count + 1):
                raise error(400, None, f"{oid}: a part was sent again with other bytes, or parts are missing")
            data = None if self.sink else b"".join(state.data[n] for n in range(1, count + 1))
        if data is None:
            digest, tmp = state.hasher.hexdigest(), None
        else:
            digest, tmp = hashlib.sha256(data).hexdigest(), self._lfs_dir() / f"{oid}.{uuid.uuid4().hex}.partial"
            tmp.write_bytes(data)
        try:
            self._store_object(oid, size, digest, got, tmp)
        finally:
            if tmp is not None:
                tmp.unlink(missing_ok=True)
        with self._lock:
            self._parts.pop(oid, None)

    def _lfs_dir(self) -> Path:
        path = Path(self._storage.name) / "lfs"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def _store_object(self, oid: str, size: int, digest: str, got: int, tmp: Path | None) -> None:
        """An object whose bytes hashed to `digest` (`got` of them, in `tmp` unless the sink
        dropped them): stored under its oid when that is its sha256 and `size` its size."""
        if digest != oid or (size >= 0 and got != size):
            raise self._cls["HubError"](400, None, f"the uploaded bytes do not hash to {oid} / are not {size} bytes")
        path = None
        if tmp is not None:
            path = self._lfs_dir() / oid
            os.replace(tmp, path)
        with self._lock:
            self._objects[oid] = _Object(got, path)
            self.lfs_uploads.append(oid)

    def _lfs_verify(self, h, rec, body: bytes) -> None:
        rec.kind = "lfs-verify"
        data = _json_object(body, self._cls["HubError"])
        with self._lock:
            stored = self._objects.get(data.get("oid"))
        if stored is None or stored.size != data.get("size"):
            raise self._cls["HubError"](404, None, f"object {data.get('oid')} not uploaded")
        self._send_json(h, rec, 200, {})

    # ---- upload faults (FakeHub._handle asks before reading a request's body)

    def _upload_fault(self, h, rec, kind: str) -> bool:
        """Apply the next fault set for `kind`, if any: True when the request was answered here
        (an injected error); Dropped for a cut (or a stall the server's stop ends)."""
        with self._lock:
            fault = next((f for f in self._faults.get(kind, []) if f.times > 0), None)
            if fault is None:
                return False
            fault.times -= 1
        rec.kind = kind
        n = int(h.headers.get("Content-Length") or 0)
        oid = rec.path.split("/")[2] if kind in ("lfs-upload", "lfs-part") else None
        if fault.kind == "stall":
            deadline = None if fault.seconds is None else time.monotonic() + fault.seconds
            while not self._release.wait(0.05):
                if self._unstall.is_set():
                    raise Dropped(kind)
                if deadline is not None and time.monotonic() >= deadline:
                    break
            return False
        self._discard_body(h, n if fault.kind == "fail" else (n // 2 if fault.at is None else min(fault.at, n)), oid)
        if fault.kind == "cut":
            raise Dropped(kind)
        headers = {} if fault.retry_after is None else {"Retry-After": f"{fault.retry_after:g}"}
        raise self._cls["HubError"](
            fault.status, None, fault.message or f"Injected failure {fault.status}", headers=headers
        )

    def _discard_body(self, h, n: int, oid: str | None) -> None:
        for _ in self._read_body(h, n, oid):
            pass

    # ---- commits

    def _commit_files(self, h, rec, repo, parent, rev: str, content_type: str, body: bytes) -> None:
        error = self._cls["HubError"]
        if "application/x-ndjson" not in content_type:
            raise error(415, None, "a commit is application/x-ndjson")
        try:
            lines = [json.loads(ln) for ln in body.decode().splitlines() if ln.strip()]
        except ValueError as e:
            raise error(400, None, f"commit body is not NDJSON: {e}") from e
        if not lines or lines[0].get("key") != "header" or not isinstance(lines[0]["value"].get("summary"), str):
            raise error(400, None, "a commit starts with its header")
        header = lines[0]["value"]
        if header.get("parentCommit") not in (None, parent.sha):
            raise error(412, None, "A commit has happened since. Please refresh and try again.")
        files = dict(parent.files)
        added, lfs, deleted = [], [], []
        for line in lines[1:]:
            key, value = line.get("key"), line.get("value") or {}
            path = value.get("path")
            if not isinstance(path, str) or path.startswith("/") or ".." in path.split("/") or not path:
                raise error(400, None, f"bad path {path!r}")
            if key == "file":
                if value.get("encoding") != "base64":
                    raise error(400, None, f"{path}: expected base64 content")
                content = base64.b64decode(value["content"])
                with self._lock:
                    key = (repo.repo_id, path)
                    self.received_inline[key] = self.received_inline.get(key, 0) + len(content)
                files[path] = self._file(path, self._store_blob(content))
                added.append(path)
            elif key == "lfsFile":
                oid, size = value.get("oid"), value.get("size")
                with self._lock:
                    stored = self._objects.get(oid)
                if value.get("algo") != "sha256" or stored is None or stored.size != size:
                    raise error(400, None, f"{path}: LFS object {oid} ({size} bytes) was not uploaded")
                files[path] = self._lfs_file(path, oid, stored)
                added.append(path)
                lfs.append(path)
            elif key in ("deletedFile", "deletedFolder"):
                gone = [
                    p for p in files if p == path or (key == "deletedFolder" and p.startswith(path.rstrip("/") + "/"))
                ]
                if not gone:
                    raise error(404, "EntryNotFound", f"{path}: A file with this name doesn't exist")
                for p in gone:
                    del files[p]
                deleted.append(path)
            else:
                raise error(400, None, f"unknown commit operation {key!r}")
        with self._lock:
            sha = self._new_commit(repo, rev, parent.sha, files, header["summary"], (added, lfs, deleted))
        self._send_json(h, rec, 200, {"success": True, "commitOid": sha, "commitUrl": f"{self.endpoint}/{repo.repo_id}/commit/{sha}",
                                      "hookOutput": ""})  # fmt: skip

    def _new_commit(self, repo, rev: str, parent: str | None, files: dict, summary: str, changes: tuple) -> str:
        """A commit of `files` on branch `rev` (under self._lock); `changes`: (added, lfs, deleted) paths."""
        added, lfs, deleted = changes
        h = hashlib.sha1(f"{repo.repo_id}\0{rev}\0{parent}\0{summary}\0{len(self.commits)}".encode())
        for p in sorted(files):
            h.update(f"{p}\0{files[p].git_oid}\n".encode())
        sha = h.hexdigest()
        dirs = {"/".join(p.split("/")[:i]) for p in files for i in range(1, p.count("/") + 1)}
        repo.commits[sha] = self._cls["Commit"](sha, Path(self._storage.name), files, dirs)
        repo.refs[rev] = sha
        self.commits.append(CommitRecord(repo.repo_id, rev, sha, summary, list(added), list(lfs), list(deleted)))
        return sha

    def _store_blob(self, data: bytes) -> Path:
        path = Path(self._storage.name) / "blobs" / hashlib.sha256(data).hexdigest()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return path

    def _file(self, rel: str, disk: Path):
        """A regular (git) file over stored bytes, whatever its name."""
        size = disk.stat().st_size
        sha256 = hashlib.sha256(disk.read_bytes()).hexdigest()
        return self._cls["File"](rel, disk, size, sha256, _git_sha1(disk.read_bytes()), False, None)

    def _lfs_file(self, rel: str, oid: str, obj: _Object):
        """An LFS file: its pointer in git, its bytes those of the object (none in the sink)."""
        pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\nsize {obj.size}\n".encode()
        return self._cls["File"](rel, obj.path, obj.size, oid, _git_sha1(pointer), True, len(pointer))


class _Discard:
    """A file opened for writing that keeps nothing (the sink)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def write(self, data) -> None:
        pass


def upload_kind(method: str, raw_segs: list[str]) -> str | None:
    """The kind (UPLOAD_KINDS) of an upload request, from its method and raw URL path segments
    (raw_segs[0] is the empty segment before the first slash); None for any other request."""
    segs = raw_segs[1:]
    if method == "POST" and segs == ["api", "repos", "create"]:
        return "create"
    if method == "POST" and segs == ["api", "validate-yaml"]:
        return "validate-yaml"
    if segs[:1] == ["fake-lfs"] and len(segs) >= 2:
        if method == "PUT":
            return "lfs-upload" if len(segs) == 2 else "lfs-part"
        return "lfs-complete" if method == "POST" and segs[2:] == ["complete"] else None
    if method != "POST":
        return None
    if len(segs) >= 5 and segs[-4:-1] == ["info", "lfs", "objects"] and segs[-1] in ("batch", "verify"):
        return f"lfs-{segs[-1]}"
    if segs[:2] == ["api", "models"] and len(segs) in (5, 6) and segs[-2] in UPLOAD_ACTIONS:
        return segs[-2]
    return None


def front_matter_errors(meta: dict) -> list[str]:
    """What the Hub's validate-yaml refuses in the fields a converted model's card carries, with the
    Hub's kind of message (`"datasets" with value "..." is not valid. If possible, use a dataset id
    from https://hf.co/datasets`, as publicly reported, in its model form). Existence on the Hub is
    not checked: the fake knows only its own repos."""
    errors = []
    bases = meta.get("base_model")
    for base in bases if isinstance(bases, list) else [] if bases is None else [bases]:
        if not (isinstance(base, str) and MODEL_ID.match(base) and "--" not in base and ".." not in base):
            errors.append(f'"base_model" with value "{base}" is not valid. Use a model id from https://hf.co/models')
    if meta.get("base_model_relation") not in (None, *RELATIONS):
        errors.append(f'"base_model_relation" must be one of {", ".join(RELATIONS)}')
    license = meta.get("license")
    if license is not None and license not in LICENSES:
        errors.append(
            f'"license" with value "{license}" is not valid. Use a license identifier from '
            "https://hf.co/docs/hub/repositories-licenses, or other with license_name"
        )
    if license == "other" and not (isinstance(meta.get("license_name"), str) and meta["license_name"]):
        errors.append('"license_name" is required when "license" is other')
    for key in ("license_name", "license_link"):
        if key in meta and not isinstance(meta[key], str):
            errors.append(f'"{key}" must be a string')
    tags = meta.get("tags")
    if tags is not None and not (isinstance(tags, list) and all(isinstance(t, str) for t in tags)):
        errors.append('"tags" must be an array of strings')
    if meta.get("pipeline_tag") is not None and meta["pipeline_tag"] not in TASKS:
        errors.append(f'"pipeline_tag" with value "{meta["pipeline_tag"]}" is not a valid task')
    return errors


def _part_etag(algo: str, digest: str, size: int) -> str:
    """The ETag of a multipart part, from a digest that covers its bytes and its size. S3 answers
    the part's md5, but ETags are opaque to the client (huggingface_hub 2.4's
    lfs._get_completion_payload only checks that each is non-empty and sends it back as it came):
    a digest the server has at hand or computes cheaply (a crc32) tells the completion a part's
    ETag from another's as well, with no pass of md5 over every byte."""
    return f"{algo}-{digest}-{size}"


def _git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _json_object(body: bytes, error) -> dict:
    try:
        data = json.loads(body or b"{}")
    except ValueError as e:
        raise error(400, None, f"not JSON: {e}") from e
    if not isinstance(data, dict):
        raise error(400, None, "expected a JSON object")
    return data
