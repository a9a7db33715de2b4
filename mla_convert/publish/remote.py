"""The Hub's side of `upload`, through huggingface_hub: the token, the repo and its branch, what the
branch already holds, one file's content sent, one commit; every failure as one UploadError line
that says what to do, its cause chained.

Token, endpoint and offline mode are huggingface_hub's own (HF_TOKEN or `hf auth login`,
HF_ENDPOINT, HF_HUB_OFFLINE). Files go up with the client's own `upload_folder`, given exactly
the files to send: with hf_xet installed (huggingface_hub 2.4 requires it) its streamed Xet
pipeline, committing in batches of its choosing; with HF_HUB_DISABLE_XET=1, one create_commit
over its LFS transfer. `convert --upload` preuploads file by file instead, the bytes sent lean by
publish.lfs_put where the case is plain (the client's session, LFS), else by the client.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mla_convert.errors import UploadError, network_errors
from mla_convert.source import hub as source_hub
from mla_convert.source.hub import http_error_line, retrying, transient

RESUMES = "run the same command again: what is on the Hub already is not sent again"
QUOTA_WORDS = ("storage", "quota", "limit reached", "exceeded")
CREATE, READ, WRITE = "create", "read", "write"  # what a request was doing, for a 403's message
# Where the client asks for a Xet write token (hf_xet's error names the URL); a server without Xet
# answers 404, and the client with hf_xet installed has no other way up (no LFS fallback).
XET_TOKEN_PATH = "/xet-write-token/"
# Seconds a request to the Hub may wait for the next byte either way before it fails (transiently:
# tried again). huggingface_hub's shared session has none, and a stalled upload would wait forever.
HUB_TIMEOUT = 120.0


@dataclass(frozen=True)
class RemoteFile:
    path: str
    size: int
    sha256: str | None  # an LFS file's (the Hub keeps it)
    blob_id: str | None  # the git object id of a file kept in git


class Unreachable(UploadError):
    """The Hub cannot be reached at all (offline mode, no network, a refused connection)."""


def token_problem() -> str | None:
    """Why there is no token to upload with, or None."""
    from huggingface_hub import get_token

    if get_token() is None:
        return (
            "no Hugging Face token: set HF_TOKEN, or log in with `hf auth login`; uploading needs a token with "
            "write access to the repo"
        )
    return None


def endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


class Remote:
    """One repo and branch on the Hub."""

    def __init__(self, repo_id: str, revision: str):
        from huggingface_hub import HfApi

        self.repo_id, self.revision = repo_id, revision
        self.api = HfApi()

    def visibility(self) -> bool | None:
        """Whether the repo is private; None when there is no such repo (or the token cannot see it)."""
        from huggingface_hub import errors

        with hub_errors(self.repo_id, READ):
            try:
                return bool(self.api.repo_info(self.repo_id).private)
            except errors.RepositoryNotFoundError:
                return None

    def files(self) -> dict[str, RemoteFile] | None:
        """What the branch holds; None when there is no such branch."""
        from huggingface_hub import errors
        from huggingface_hub.hf_api import RepoFile

        with hub_errors(self.repo_id, READ):
            try:
                entries = list(self.api.list_repo_tree(self.repo_id, revision=self.revision, recursive=True))
            except errors.RevisionNotFoundError:
                return None
        return {
            e.path: RemoteFile(e.path, e.size, e.lfs.sha256 if e.lfs else None, None if e.lfs else e.blob_id)
            for e in entries
            if isinstance(e, RepoFile)
        }

    def create_repo(self, private: bool) -> None:
        with hub_errors(self.repo_id, CREATE):
            self.api.create_repo(self.repo_id, private=private, exist_ok=True)

    def create_branch(self) -> None:
        with hub_errors(self.repo_id, WRITE):
            self.api.create_branch(self.repo_id, branch=self.revision, exist_ok=True)

    def validate_card(self, path: Path, text: str) -> None:
        """The card's metadata (`text`, to be written at `path`) as the Hub's own validation sees
        it, before any byte goes up."""
        from huggingface_hub import ModelCard, errors

        with hub_errors(self.repo_id, READ):
            try:
                ModelCard(text).validate()
            except ValueError as e:  # the Hub's 400: its answer is the message
                if isinstance(e, errors.HfHubHTTPError):
                    raise
                raise UploadError(f"{path}: the Hub refuses this model card's metadata ({_card_errors(e)})") from e

    def head(self) -> str:
        """The branch's last commit."""
        with hub_errors(self.repo_id, READ):
            return retrying(lambda: self.api.repo_info(self.repo_id, revision=self.revision).sha)

    def preupload(self, ops: list) -> None:
        """The client's preupload of `ops` (CommitOperationAdd, each with its sha256 set: nothing is
        hashed again): an LFS file's bytes into the Hub's storage, not yet in a commit; a small file
        only told apart (its bytes go with the commit). The bytes go lean where they can
        (publish.lfs_put); else, or when that fails in any way, it is all done again by the client,
        tried again while it fails transiently."""
        from mla_convert.publish import lfs_put

        bounded_session()
        if lfs_put.preupload(self.api, self.repo_id, self.revision, ops, HUB_TIMEOUT):
            return
        with hub_errors(self.repo_id, WRITE):
            retrying(lambda: self.api.preupload_lfs_files(self.repo_id, additions=ops, revision=self.revision))

    def commit(self, ops: list, deletions: list[str], message: str, landed: Callable[[], bool]) -> str:
        """One commit of `ops` (preuploaded) and `deletions`; its id. Tried again while it fails
        transiently, unless `landed()` says the branch holds it already (its answer was lost)."""
        from huggingface_hub import CommitOperationDelete

        operations = [*ops, *(CommitOperationDelete(p) for p in deletions)]
        bounded_session()
        with hub_errors(self.repo_id, WRITE):
            for wait in (*source_hub.RETRY_WAITS, None):
                try:
                    info = self.api.create_commit(
                        self.repo_id, operations=operations, commit_message=message, revision=self.revision
                    )
                    return info.oid
                except Exception as e:
                    asked = transient(e)
                    if wait is None or asked is None:
                        raise
                    time.sleep(max(wait, asked))
                    if landed():
                        return self.api.repo_info(self.repo_id, revision=self.revision).sha
        raise AssertionError("unreachable")

    def upload_files(self, root: Path, rels: list[str], deletions: list[str], message: str) -> str:
        """`rels` (paths relative to `root`, as in the repo) sent and committed by the client's
        upload_folder, `deletions` deleted in the same call; returns the (last) commit's id."""
        from mla_convert.publish.contents import exact_pattern

        with hub_errors(self.repo_id, WRITE):
            info = self.api.upload_folder(
                repo_id=self.repo_id, folder_path=root, revision=self.revision, commit_message=message,
                allow_patterns=[exact_pattern(r) for r in rels] or [exact_pattern("\0")],  # none: match nothing
                delete_patterns=[exact_pattern(r) for r in deletions] or None,
            )  # fmt: skip
        return info.oid


_bounded: dict[int, float] = {}  # id of a session this module gave its timeout -> that timeout


def bounded_session() -> None:
    """huggingface_hub's shared session given HUB_TIMEOUT, unless its factory set one of its own."""
    from huggingface_hub.utils import get_session

    session = get_session()
    if session.timeout.read is None or _bounded.get(id(session)) == session.timeout.read:
        session.timeout = HUB_TIMEOUT
        _bounded[id(session)] = HUB_TIMEOUT


@contextlib.contextmanager
def hub_errors(repo_id: str, doing: str):
    """huggingface_hub's exceptions (and the transport's under them) -> one UploadError line."""
    try:
        yield
    except (KeyboardInterrupt, UploadError):
        raise
    except Exception as e:
        line = classify(e, repo_id, doing)
        if line is None:
            raise
        raise (Unreachable if _unreachable(e) else UploadError)(line) from e


def _unreachable(e: BaseException) -> bool:
    """Whether `e` (or a cause) says the Hub is not there: offline mode, the transport's errors."""
    from huggingface_hub import errors

    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, errors.HfHubHTTPError) and e.response is not None:
            return False  # the Hub answered
        if isinstance(e, (errors.OfflineModeIsEnabled, ConnectionError, TimeoutError, *network_errors())):
            return True
        e = e.__cause__ or e.__context__
    return False


def classify(e: BaseException, repo_id: str, doing: str) -> str | None:
    """The line for `e`, or for the first error of its cause chain that is known; None if none is."""
    from huggingface_hub import errors

    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, errors.RepositoryNotFoundError):
            return f"{repo_id}: no such model repo on the Hub, or the token cannot see it; pass --create to make it"
        if isinstance(e, errors.RevisionNotFoundError):
            return f"{repo_id}: no such branch on the Hub; pass --create to make it"
        if isinstance(e, errors.OfflineModeIsEnabled):
            return "HF_HUB_OFFLINE=1 is set: an upload needs the Hub; unset it"
        if XET_TOKEN_PATH in str(e) and "404" in str(e):
            return (
                f"{repo_id}: the Hub at {endpoint()} offers no Xet storage (its Xet token endpoint answered 404), and "
                "huggingface_hub with hf_xet installed uploads through Xet only; set HF_HUB_DISABLE_XET=1 to upload "
                "over LFS"
            )
        if isinstance(e, errors.HfHubHTTPError) and e.response is not None:
            return _http_line(e, repo_id, doing)
        if isinstance(e, (ConnectionError, TimeoutError, *network_errors())):
            return (
                f"cannot reach the Hub at {endpoint()} ({type(e).__name__}: {_one_line(e)}); check the network, or "
                f"HF_ENDPOINT and the proxy settings; {RESUMES}"
            )
        if isinstance(e, ValueError) and "LFS batch API returned errors" in str(e):
            return f"{repo_id}: the Hub's storage refused a file ({_one_line(e)}); {RESUMES}"
        e = e.__cause__ or e.__context__
    return None


def _http_line(e, repo_id: str, doing: str) -> str:
    status = e.response.status_code
    server = " ".join((getattr(e, "server_message", None) or "").split())
    said = f"{status}{': ' + server if server else ''}"
    namespace = repo_id.split("/")[0]
    if status == 401:
        return (
            f"{repo_id}: the Hub refused the token ({said}): it is not valid, or has expired; set HF_TOKEN to a "
            "valid token, or log in again with `hf auth login`"
        )
    if status in (402, 403, 507) and any(w in server.lower() for w in QUOTA_WORDS):
        return f"{repo_id}: the Hub refused the upload for lack of storage ({said}); free some or upgrade the plan, then {RESUMES}"
    if status == 403 and doing == CREATE:
        return (
            f"{repo_id}: the token may not create repositories in {namespace} ({said}); it needs write access "
            f"there: a token with the 'write' role, or a fine-grained one that may create repos in {namespace}"
        )
    if status == 403:
        return (
            f"{repo_id}: the token may not write to this repo ({said}); it needs write access to it: a token "
            f"with the 'write' role, or a fine-grained one with write access to {repo_id}'s contents"
        )
    if status == 429:
        return f"{repo_id}: the Hub is limiting the request rate ({said}); wait a few minutes, then {RESUMES}"
    return f"{repo_id}: Hub request failed: {http_error_line(e)}; {RESUMES}"


def _card_errors(e: ValueError) -> str:
    import json

    try:
        return "; ".join(str(x.get("message")) for x in json.loads(str(e))["errors"])
    except (ValueError, TypeError, KeyError, AttributeError):
        return _one_line(e)


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300] or type(e).__name__
