"""`convert --upload`'s preuploads send each LFS body lean (publish.lfs_put: sendfile over http, one
large reused buffer over https) while huggingface_hub makes the protocol's API calls; a failure
on the way, or a session the user set up, goes through the client. Against the local fake Hub,
through the real client: the final tree is the manifest's, each object stored once."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import huggingface_hub.lfs
import pytest

from mla_convert import convert
from mla_convert.constants import MANIFEST_NAME
from mla_convert.demo.specs import CheckpointSpec
from mla_convert.demo.synthetic import write_checkpoint
from mla_convert.publish import lfs_put
from mla_convert.settings import UploadOptions
from support.fake_hub import WRITE_TOKEN

REPO = "org/tiny-lean"


@pytest.fixture(scope="module")
def four(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("four") / "src", CheckpointSpec(num_shards=4))


class Bodies:
    """Who sent each LFS body: this tool's lean path (files and byte counts) or the client's."""

    def __init__(self, monkeypatch):
        self.lean: list[int] = []
        self.client: list[str] = []
        send, single = lfs_put._send_body, huggingface_hub.lfs._upload_single_part
        parts = huggingface_hub.lfs._upload_parts_iteratively

        def lean(sock, f, offset, count, tls):
            self.lean.append(count)
            return send(sock, f, offset, count, tls)

        def client_single(operation, **kw):
            self.client.append(operation.path_in_repo)
            return single(operation=operation, **kw)

        def client_parts(operation, **kw):
            self.client.append(operation.path_in_repo)
            return parts(operation=operation, **kw)

        monkeypatch.setattr(lfs_put, "_send_body", lean)
        monkeypatch.setattr(huggingface_hub.lfs, "_upload_single_part", client_single)
        monkeypatch.setattr(huggingface_hub.lfs, "_upload_parts_iteratively", client_parts)


def upload(src: Path, out: Path):
    return convert(src, out, upload=REPO, upload_options=UploadOptions(create=True))


def lfs_sizes(hub) -> dict[str, int]:
    """Each LFS file of the branch: its size."""
    stored = set(hub.lfs_uploads)
    return {p: size for p, (size, sha) in hub.tree_sizes(REPO).items() if sha in stored}


def assert_the_tree_is_the_manifest(hub, out: Path) -> None:
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    expected = {rel: meta["sha256"] for rel, meta in manifest["files"].items()}
    expected[MANIFEST_NAME] = hashlib.sha256((out / MANIFEST_NAME).read_bytes()).hexdigest()
    assert {p: h for p, h in hub.tree(REPO).items() if p != ".gitattributes"} == expected
    assert len(hub.lfs_uploads) == len(set(hub.lfs_uploads))  # each object stored once


def puts(hub) -> list:
    return [r for r in hub.requests if r.method == "PUT"]


def test_single_part_and_multipart_bodies_go_lean_each_byte_once(hub, four, tmp_path, monkeypatch):
    bodies = Bodies(monkeypatch)
    hub.multipart_threshold, hub.chunk_size = 1_100_000, 300_000  # the shards in parts, the MLA files whole
    out = tmp_path / "out"
    result = upload(four, out)
    assert result.status == "complete"
    assert_the_tree_is_the_manifest(hub, out)
    sizes = lfs_sizes(hub)
    kinds = {r.kind for r in puts(hub)}
    assert kinds == {"lfs-upload", "lfs-part"}, kinds  # both transfers were made
    assert min(sizes.values()) <= hub.multipart_threshold < max(sizes.values())
    assert bodies.client == [] and sum(bodies.lean) == sum(sizes.values())
    received = hub.received_by_path(REPO)
    assert all(received[p] == n for p, n in sizes.items())  # nothing sent twice
    assert all(r.status == 200 and r.authorization is None for r in puts(hub))  # no token to a storage URL
    assert all(r.authorization is None for r in hub.requests if r.kind == "lfs-complete")  # nor the client's
    parts = [r for r in puts(hub) if r.kind == "lfs-part"]
    assert len(parts) == sum(-(-n // hub.chunk_size) for n in sizes.values() if n > hub.multipart_threshold)
    verifies = [r for r in hub.requests if r.kind == "lfs-verify"]
    assert len(verifies) == len(sizes) and all(r.authorization == f"Bearer {WRITE_TOKEN}" for r in verifies)


def test_the_https_way_sends_through_one_buffer_in_several_fills(hub, four, tmp_path, monkeypatch):
    """The copying sender (https's), here over the fake Hub's plain socket; a buffer smaller than a
    part, so that a body takes several fills and the last one is short."""
    send = lfs_put._send_body
    monkeypatch.setattr(lfs_put, "_send_body", lambda sock, f, offset, count, tls: send(sock, f, offset, count, True))
    monkeypatch.setattr(lfs_put, "BUFFER_BYTES", 70_001)
    monkeypatch.setattr(lfs_put, "_local", type(lfs_put._local)())
    bodies = Bodies(monkeypatch)
    hub.multipart_threshold, hub.chunk_size = 1_100_000, 300_000
    out = tmp_path / "out"
    upload(four, out)
    assert_the_tree_is_the_manifest(hub, out)
    assert bodies.client == [] and {r.kind for r in puts(hub)} == {"lfs-upload", "lfs-part"}
    received = hub.received_by_path(REPO)
    assert all(received[p] == n for p, n in lfs_sizes(hub).items())


@pytest.mark.parametrize(
    "fault", ["a whole body refused (500)", "a whole body cut", "a part refused (503)", "a part cut"]
)
def test_a_lean_put_that_fails_is_made_again_by_the_client(hub, four, tmp_path, monkeypatch, fault):
    bodies = Bodies(monkeypatch)
    if "part" in fault:
        hub.multipart_threshold, hub.chunk_size = 1_100_000, 300_000
    kind = "lfs-part" if "part" in fault else "lfs-upload"
    if "cut" in fault:
        hub.cut_upload(kind, at=100_000)
    else:
        hub.fail_upload(kind, status=500 if "500" in fault else 503)
    out = tmp_path / "out"
    result = upload(four, out)
    assert result.status == "complete"
    assert_the_tree_is_the_manifest(hub, out)
    failed = [r for r in puts(hub) if r.status != 200]
    assert len(failed) == 1 and failed[0].status in (-1, 500, 503)  # the fault happened, to the lean PUT
    assert len(bodies.client) == 1  # that object, again, through the client; every other one lean
    sizes = lfs_sizes(hub)
    received = hub.received_by_path(REPO)
    again = bodies.client[0]
    assert received[again] > sizes[again] and all(received[p] == n for p, n in sizes.items() if p != again)


def test_a_session_the_user_set_up_sends_through_the_client(hub, four, tmp_path, monkeypatch):
    import httpx2
    from huggingface_hub.utils import _http, set_client_factory

    bodies = Bodies(monkeypatch)
    set_client_factory(lambda: httpx2.Client(follow_redirects=True, timeout=None))  # the user's own
    try:
        out = tmp_path / "out"
        upload(four, out)
    finally:
        set_client_factory(_http.default_client_factory)
    assert_the_tree_is_the_manifest(hub, out)
    assert bodies.lean == [] and sorted(bodies.client) == sorted(lfs_sizes(hub))
