"""A source shard's bytes from the Hub, read lean (--stream's downloads): the standard library's HTTP
client reads the body straight from the socket into the staging buffers of the file being written
(io.disk_write: hashed there, and written past the page cache where the disk takes it).
huggingface_hub's session (httpx) copies each 64 KiB block through its parser several times,
which costs more CPU than the sha256 of the same bytes.

Only the plain case goes this way: huggingface_hub's own session, not one its user set up
(`set_client_factory`: proxies, certificates), not offline. Where the request does not succeed at
once (an error status, no connection made), the caller makes it again through huggingface_hub,
whose exception says what the Hub said; a connection lost in the middle of the body is a
ConnectionError, tried again from the byte it stopped at. The token goes to the Hub only, never to
the host a redirect names (as huggingface_hub does).
"""

from __future__ import annotations


def plain_get(url: str, headers: dict[str, str], timeout: float | None):
    """The response to GET `url` (http.client.HTTPResponse, 200 or 206), or None: make the request
    through huggingface_hub instead (see the module docstring)."""
    import urllib.error
    import urllib.request

    if not plain_session():
        return None
    auth = {k: v for k, v in headers.items() if k.lower() == "authorization"}
    request = urllib.request.Request(url, headers={k: v for k, v in headers.items() if k not in auth})
    for k, v in auth.items():
        request.add_unredirected_header(k.capitalize(), v)
    try:
        return urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as e:
        e.close()
        return None
    except urllib.error.URLError:
        return None


def receive(response, out) -> None:
    """The body of `response` read straight into the staging buffers of `out` (an io.disk_write
    StagedFile, which hashes and writes them)."""
    import http.client

    try:
        while True:
            space, _ = out.reserve()
            n = response.readinto(space)
            if not n:
                break
            out.commit(n)
    except http.client.HTTPException as e:  # IncompleteRead: the connection closed mid-body
        raise ConnectionError(f"the connection closed in the middle of the body ({type(e).__name__})") from e
    left = getattr(response, "length", None)  # http.client ends a body cut short without an error
    if left:
        raise ConnectionError(f"the connection closed in the middle of the body, {left} bytes short")


def plain_session() -> bool:
    from huggingface_hub import constants
    from huggingface_hub.utils import _http

    default = getattr(_http, "default_client_factory", None)
    return (
        not constants.HF_HUB_OFFLINE
        and default is not None
        and getattr(_http, "_GLOBAL_CLIENT_FACTORY", None) is default
    )
