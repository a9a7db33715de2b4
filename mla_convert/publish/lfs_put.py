"""An LFS file's bytes sent to the Hub lean (convert --upload's preuploads): huggingface_hub makes
the protocol's API calls (the preupload modes, the LFS batch, a multipart transfer's completion,
the verify), and the standard library sends the bodies: over http the kernel copies the file to
the socket (socket.sendfile: no byte passes through Python), over https one large buffer, reused,
is filled from the file and sent whole. The client's session sends a body in 64 KiB pieces
through httpx, which costs more CPU than the converter's own work on the same bytes.

Only the plain case goes this way: huggingface_hub's own session (source.hub_body), not offline,
no proxy, no Xet (with hf_xet installed the client's Xet pipeline sends the bytes), each file a
local path. Anything else, and any failure on the way (an error status, a connection refused or
lost, an answer this module does not understand), `preupload` answers False: the caller makes the
whole preupload again through the client, whose retries and exceptions say what the Hub said. An
object stored before the failure is not sent again (the batch answers it has it); one cut short
is sent again whole, as the client would. Each request carries what the client's carries: the
token only on the Hub's API calls, never on a PUT to a storage URL (a presigned URL takes none).
"""

from __future__ import annotations

import threading

BUFFER_BYTES = 16 << 20  # https: what one read from the file and one send to the socket carry
_local = threading.local()


class _NotLean(Exception):
    """The lean path cannot go on; the client does it all again."""


def preupload(api, repo_id: str, revision: str, ops: list, timeout: float | None) -> bool:
    """What `api.preupload_lfs_files(repo_id, additions=ops, revision=revision)` does, the bodies
    sent lean; True when done. False: the client is to do it (see the module docstring); the ops
    then carry nothing that would keep the client from sending what is not stored yet."""
    try:
        if not _plain(ops):
            return False
        _preupload(api, repo_id, revision, ops, timeout)
    except Exception:  # whatever it was, the client's own attempt says it in its terms
        return False
    return True


def _plain(ops: list) -> bool:
    import urllib.request

    from huggingface_hub._commit_api import is_xet_available  # what the client's upload asks

    from mla_convert.source import hub_body

    return (
        hub_body.plain_session()  # the test the download's lean path makes
        and not is_xet_available()
        and not set(urllib.request.getproxies()) - {"no"}  # httpx reads the same variables
        and all(isinstance(op.path_or_fileobj, str) and op.path_in_repo != ".gitignore" for op in ops)
    )


def _preupload(api, repo_id: str, revision: str, ops: list, timeout: float | None) -> None:
    """preupload_lfs_files's steps, each API call the client's own (same headers, same retries)."""
    from urllib.parse import quote

    from huggingface_hub._commit_api import UPLOAD_BATCH_MAX_NUM_FILES, _fetch_upload_modes
    from huggingface_hub.lfs import post_lfs_batch_info

    rev = quote(revision, safe="")
    headers = api._build_hf_headers()
    new = [op for op in ops if not op._is_uploaded]
    unasked = [op for op in new if op._upload_mode is None]
    if unasked:
        _fetch_upload_modes(
            additions=unasked, repo_type="model", repo_id=repo_id, headers=headers, revision=rev,
            endpoint=api.endpoint, create_pr=False, gitignore_content=None,
        )  # fmt: skip
    lfs = [op for op in new if op._upload_mode == "lfs" and not op._should_ignore]
    for start in range(0, len(lfs), UPLOAD_BATCH_MAX_NUM_FILES):
        chunk = lfs[start : start + UPLOAD_BATCH_MAX_NUM_FILES]
        actions, errors, _ = post_lfs_batch_info(
            upload_infos=[op.upload_info for op in chunk], token=None, repo_type="model", repo_id=repo_id,
            revision=rev, endpoint=api.endpoint, headers=headers, transfers=["basic", "multipart"],
        )  # fmt: skip
        if errors:
            raise _NotLean("the LFS batch refused an object")
        by_oid = {op.upload_info.sha256.hex(): op for op in chunk}
        for action in actions:
            if action.get("actions") is not None:  # none: the Hub has its bytes already
                _upload(by_oid[action["oid"]], action, headers, api.endpoint, timeout)
    for op in lfs:  # as the client marks them: create_commit sends none of them again
        op._is_uploaded = True
        op.path_or_fileobj = b""


def _upload(op, action: dict, headers: dict, endpoint: str, timeout: float | None) -> None:
    """lfs.lfs_upload's steps for one object: its bytes by one PUT (basic) or by parts (multipart:
    `chunk_size` and the numbered part URLs in the upload action's header, then the completion
    with each part's ETag), then the verify action's POST."""
    from huggingface_hub import lfs
    from huggingface_hub.utils import build_hf_headers, fix_hf_endpoint_in_url, hf_raise_for_status, http_backoff

    lfs._validate_batch_actions(action)
    upload, verify = action["actions"]["upload"], action["actions"].get("verify")
    header = upload.get("header") or {}
    url = fix_hf_endpoint_in_url(upload["href"], endpoint=endpoint)
    info = op.upload_info
    with open(op.path_or_fileobj, "rb", buffering=0) as f, _Connections(timeout) as connections:
        if header.get("chunk_size") is None:
            connections.put(url, f, 0, info.size)
        else:
            chunk = int(header["chunk_size"])
            urls = lfs._get_sorted_parts_urls(header=header, upload_info=info, chunk_size=chunk)
            etags = [
                {"etag": connections.put(u, f, n * chunk, min(chunk, info.size - n * chunk))}
                for n, u in enumerate(urls)
            ]
            done = http_backoff(
                "POST", url, json=lfs._get_completion_payload(etags, info.sha256.hex()), headers=lfs.LFS_HEADERS
            )
            hf_raise_for_status(done)
    if verify is not None:
        lfs._validate_lfs_action(verify)
        checked = http_backoff(
            "POST", fix_hf_endpoint_in_url(verify["href"], endpoint), headers=build_hf_headers(headers=headers),
            json={"oid": info.sha256.hex(), "size": info.size},
        )  # fmt: skip
        hf_raise_for_status(checked)


class _Connections:
    """The connections one object's PUTs go by: one per host, kept open from part to part."""

    def __init__(self, timeout: float | None):
        self.timeout, self.open = timeout, {}

    def __enter__(self) -> _Connections:
        return self

    def __exit__(self, *exc) -> None:
        for conn in self.open.values():
            conn.close()

    def put(self, url: str, f, offset: int, count: int) -> str | None:
        """PUT `count` bytes of `f` from `offset` to `url` (no token: a storage URL); the answer's
        ETag. _NotLean unless the answer is a 2xx; OSError (a connection problem) as it comes."""
        import http.client
        import uuid
        from urllib.parse import urlsplit

        import httpx2

        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise _NotLean(f"not an http(s) URL: {url}")
        key = (parts.scheme, parts.hostname, parts.port)
        conn = self.open.pop(key, None)
        if conn is None and parts.scheme == "http":
            conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=self.timeout)
        elif conn is None:
            conn = http.client.HTTPSConnection(parts.hostname, parts.port, timeout=self.timeout, context=_tls())
        try:
            conn.putrequest("PUT", f"{parts.path or '/'}{'?' + parts.query if parts.query else ''}",
                            skip_accept_encoding=True)  # fmt: skip
            for name, value in (
                ("Accept", "*/*"),
                ("User-Agent", f"python-httpx2/{httpx2.__version__}"),  # the client's session's
                ("X-Amzn-Trace-Id", str(uuid.uuid4())),  # as huggingface_hub's request hook adds
                ("Content-Length", str(count)),
            ):
                conn.putheader(name, value)
            conn.endheaders()
            _send_body(conn.sock, f, offset, count, parts.scheme == "https")
            response = conn.getresponse()
            response.read()
        except BaseException:
            conn.close()
            raise
        if not 200 <= response.status < 300:
            conn.close()
            raise _NotLean(f"PUT answered {response.status}")
        if response.will_close:
            conn.close()
        else:
            self.open[key] = conn
        return response.getheader("ETag")


def _send_body(sock, f, offset: int, count: int, tls: bool) -> None:
    """`count` bytes of `f` from `offset` to `sock`: by the kernel over a plain socket, else through
    one reused buffer."""
    if not tls:
        if sock.sendfile(f, offset, count) != count:
            raise _NotLean("the file ended before its recorded size")
        return
    view = _buffer()
    f.seek(offset)
    left = count
    while left:
        n = f.readinto(view[: min(len(view), left)])
        if not n:
            raise _NotLean("the file ended before its recorded size")
        sock.sendall(view[:n])
        left -= n


def _buffer() -> memoryview:
    if getattr(_local, "view", None) is None:
        _local.view = memoryview(bytearray(BUFFER_BYTES))
    return _local.view


_contexts: list = []


def _tls():
    """The TLS context the client's session makes (its trust store, SSL_CERT_FILE honoured), made once."""
    import httpx2

    if not _contexts:
        _contexts.append(httpx2.create_ssl_context())
    return _contexts[0]
