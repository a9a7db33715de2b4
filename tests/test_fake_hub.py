"""The real `huggingface_hub` client against `FakeHub` (tests/support/fake_hub.py), serving the tiny checkpoint."""

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import pytest
from huggingface_hub import HfApi, errors, hf_hub_download, snapshot_download

from support.fake_hub import FakeHub

REPO = "deepseek-ai/Tiny-R1"
SHARD = "model-00002-of-00004.safetensors"


def sha256_of(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def git_sha1_of(path) -> str:
    data = Path(path).read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def repo_files(root: Path) -> dict[str, Path]:
    return {p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def hub(fake_hub, tiny_src):
    fake_hub.add_repo(REPO, tiny_src)
    return fake_hub


def test_fixture_points_the_client_at_the_server(hub, tmp_path):
    from huggingface_hub import constants

    assert os.environ["HF_ENDPOINT"] == hub.endpoint == constants.ENDPOINT
    assert hub.endpoint.startswith("http://127.0.0.1:") and hub.port > 0
    assert os.environ["HF_HUB_CACHE"] == constants.HF_HUB_CACHE == str(hub.cache_dir)
    assert hub.cache_dir.is_relative_to(tmp_path)
    assert os.environ["HF_HUB_DISABLE_XET"] == "1" and constants.HF_HUB_DISABLE_XET
    assert os.environ["HF_HUB_DISABLE_TELEMETRY"] == "1" and constants.HF_HUB_DISABLE_TELEMETRY
    assert "HF_TOKEN" not in os.environ and not constants.HF_HUB_OFFLINE
    assert huggingface_hub.hf_api.api.endpoint == hub.endpoint  # huggingface_hub.model_info & co


def test_snapshot_download_is_byte_identical_and_fetches_each_file_once(hub, tiny_src):
    path = Path(snapshot_download(REPO))
    src, got = repo_files(tiny_src), repo_files(path)
    assert sorted(got) == sorted(src)
    for name, p in src.items():
        assert got[name].read_bytes() == p.read_bytes(), name
    assert path.is_relative_to(hub.cache_dir) and path.name == hub.commit_sha(REPO)
    assert hub.count(kind="info") == 1 and hub.count(kind="tree") == 1
    assert all(hub.downloads(REPO, name) == 1 for name in src)
    assert not any(r.method == "HEAD" and r.status >= 400 for r in hub.requests)

    # Again: the revision is re-resolved (one info call), nothing is downloaded again.
    before = len(hub.requests)
    assert Path(snapshot_download(REPO)) == path
    assert [r.kind for r in hub.requests[before:]] == ["info"]


def test_listings_give_size_and_sha256(hub, tiny_src):
    api = HfApi()
    src = repo_files(tiny_src)
    sha = hub.commit_sha(REPO)

    # Recommended: one paginated GET of the tree at a commit; lfs.sha256 for LFS files, blob_id (git sha1) else.
    tree = list(api.list_repo_tree(REPO, revision=sha, recursive=True))
    files = {e.path: e for e in tree if isinstance(e, huggingface_hub.hf_api.RepoFile)}
    folders = {e.path for e in tree if isinstance(e, huggingface_hub.hf_api.RepoFolder)}
    assert sorted(files) == sorted(src) and folders == {"figures"}
    for name, p in src.items():
        e = files[name]
        assert e.size == p.stat().st_size
        if name.endswith(".safetensors"):
            assert e.lfs is not None and e.lfs.sha256 == sha256_of(p) and e.lfs.size == e.size
        else:
            assert e.lfs is None and e.blob_id == git_sha1_of(p)

    assert [e.path for e in api.list_repo_tree(REPO, "figures")] == ["figures/notes.txt"]

    # model_info(files_metadata=True): the same from siblings, plus the commit sha.
    info = api.model_info(REPO, files_metadata=True)
    assert info.sha == sha
    sib = {s.rfilename: s for s in info.siblings}
    assert sorted(sib) == sorted(src)
    for name, p in src.items():
        assert sib[name].size == p.stat().st_size
        assert (sib[name].lfs.sha256 if name.endswith(".safetensors") else sib[name].lfs) == (
            sha256_of(p) if name.endswith(".safetensors") else None
        )

    # get_paths_info: chosen paths only (a missing one is skipped, as on the Hub).
    got = api.get_paths_info(REPO, [SHARD, "config.json", "figures", "nope.bin"], revision="main")
    by_path = {e.path: e for e in got}
    assert set(by_path) == {SHARD, "config.json", "figures"}
    assert by_path[SHARD].lfs.sha256 == sha256_of(tiny_src / SHARD)

    # expand=True pages at 50 entries on the Hub; follow the Link header across pages.
    hub.tree_expand_page_size = 4
    hub.reset_requests()
    expanded = list(api.list_repo_tree(REPO, recursive=True, expand=True))
    assert {e.path for e in expanded} == set(src) | folders
    assert hub.count(kind="tree") == -(-len(expanded) // 4) > 1
    assert all(e.last_commit.oid == sha for e in expanded)


def test_hf_hub_download_then_cache(hub, tiny_src):
    p = Path(hf_hub_download(REPO, SHARD))
    assert p.read_bytes() == (tiny_src / SHARD).read_bytes()
    assert hub.downloads(REPO, SHARD) == 1
    # The blob is named after the ETag: the sha256 for an LFS file.
    assert p.resolve().name == sha256_of(tiny_src / SHARD)

    # By branch: one HEAD to check the commit, no second GET.
    before = len(hub.requests)
    assert Path(hf_hub_download(REPO, SHARD)) == p
    assert [(r.method, r.kind) for r in hub.requests[before:]] == [("HEAD", "resolve")]
    # By commit sha: no request at all.
    before = len(hub.requests)
    assert Path(hf_hub_download(REPO, SHARD, revision=hub.commit_sha(REPO))) == p
    assert len(hub.requests) == before
    assert hub.downloads(REPO, SHARD) == 1


def test_download_to_local_dir_and_again_after_deleting_it(hub, tiny_src, tmp_path):
    # The shape of a streaming conversion: fetch one shard into a work dir, use it, delete it.
    p = Path(hf_hub_download(REPO, SHARD, local_dir=tmp_path / "work"))
    assert p == tmp_path / "work" / SHARD and p.read_bytes() == (tiny_src / SHARD).read_bytes()
    p.unlink()
    again = Path(hf_hub_download(REPO, SHARD, local_dir=tmp_path / "work"))
    assert again.read_bytes() == (tiny_src / SHARD).read_bytes()
    assert hub.downloads(REPO, SHARD) == 2
    assert not (hub.cache_dir / "models--deepseek-ai--Tiny-R1" / "blobs").exists()


def test_offline_mode(hub, tiny_src):
    path = Path(snapshot_download(REPO))
    hub.set_offline()
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    hub.reset_requests()
    assert Path(snapshot_download(REPO)) == path
    assert Path(hf_hub_download(REPO, "config.json")) == path / "config.json"
    assert hub.requests == []

    hub.add_repo("deepseek-ai/Never-Downloaded", tiny_src)
    with pytest.raises(errors.LocalEntryNotFoundError, match="HF_HUB_OFFLINE"):
        snapshot_download("deepseek-ai/Never-Downloaded")
    with pytest.raises(errors.LocalEntryNotFoundError):
        hf_hub_download("deepseek-ai/Never-Downloaded", "config.json")
    assert hub.requests == []

    hub.set_offline(False)
    assert Path(snapshot_download("deepseek-ai/Never-Downloaded")).is_dir()


def test_unknown_repo_revision_and_file(hub):
    with pytest.raises(errors.RepositoryNotFoundError):
        snapshot_download("deepseek-ai/Nope")
    with pytest.raises(errors.RepositoryNotFoundError):
        hf_hub_download("deepseek-ai/Nope", "config.json")
    with pytest.raises(errors.RepositoryNotFoundError):
        HfApi().model_info("nope")
    with pytest.raises(errors.RevisionNotFoundError):
        snapshot_download(REPO, revision="v9")
    with pytest.raises(errors.RevisionNotFoundError):
        hf_hub_download(REPO, "config.json", revision="v9")
    with pytest.raises(errors.RemoteEntryNotFoundError):
        hf_hub_download(REPO, "nope.json")
    statuses = {(r.kind, r.status) for r in hub.requests}
    assert statuses <= {("info", 404), ("resolve", 404), ("info", 200)}


def test_corrupted_body_is_not_detected_by_the_client(hub, tiny_src):
    api = HfApi()
    listed = {e.path: e for e in api.list_repo_tree(REPO, recursive=True)}[SHARD]
    hub.corrupt(REPO, SHARD, times=1)  # same length, last byte flipped; next GET only

    p = Path(hf_hub_download(REPO, SHARD))
    # huggingface_hub only checks the size of an HTTP download, not its sha256: the corrupt file is cached as is,
    # even under a blob named after the advertised sha256.
    assert p.stat().st_size == listed.size == listed.lfs.size
    assert sha256_of(p) != listed.lfs.sha256 == sha256_of(tiny_src / SHARD)
    assert p.resolve().name == listed.lfs.sha256
    check = api.verify_repo_checksums(REPO, cache_dir=hub.cache_dir)  # the client's own (opt-in) check sees it
    assert [m["path"] for m in check.mismatches] == [SHARD]

    # A plain retry is served from the (corrupt) cache; force_download fetches it again.
    assert sha256_of(hf_hub_download(REPO, SHARD)) != listed.lfs.sha256
    assert hub.downloads(REPO, SHARD) == 1
    p = Path(hf_hub_download(REPO, SHARD, force_download=True))
    assert sha256_of(p) == listed.lfs.sha256 and hub.downloads(REPO, SHARD) == 2


def test_corrupted_body_of_another_length_fails_the_size_check(hub):
    hub.corrupt(REPO, SHARD, b"garbage")
    with pytest.raises(OSError, match="Consistency check failed"):
        hf_hub_download(REPO, SHARD)


def test_advertised_sha256_override(hub, tiny_src):
    hub.advertise_sha256(REPO, SHARD, "0" * 64)
    listed = {e.path: e for e in HfApi().list_repo_tree(REPO, recursive=True)}[SHARD]
    assert listed.lfs.sha256 == "0" * 64
    p = hf_hub_download(REPO, SHARD)
    assert sha256_of(p) == sha256_of(tiny_src / SHARD) != listed.lfs.sha256


def test_truncated_download_is_retried(hub, tiny_src, monkeypatch):
    data = (tiny_src / SHARD).read_bytes()
    hub.truncate(REPO, SHARD, at=1000)
    p = hf_hub_download(REPO, SHARD)  # the client sleeps 1 s, then retries
    assert Path(p).read_bytes() == data
    gets = [(r.status, r.range, r.bytes_sent) for r in hub.requests if r.method == "GET" and r.filename == SHARD]
    # It keeps only whole DOWNLOAD_CHUNK_SIZE (10 MiB) chunks: under that, it starts over without a Range.
    assert gets == [(200, None, 1000), (200, None, len(data))]


def test_truncated_download_is_resumed_with_a_range_request(hub, tiny_src, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 256)  # so 1000 bytes hold 3 whole chunks
    data = (tiny_src / SHARD).read_bytes()
    hub.truncate(REPO, SHARD, at=1000)
    p = hf_hub_download(REPO, SHARD)
    assert Path(p).read_bytes() == data
    gets = [(r.status, r.range, r.bytes_sent) for r in hub.requests if r.method == "GET" and r.filename == SHARD]
    assert gets == [(200, None, 1000), (206, "bytes=768-", len(data) - 768)]


def test_range_requests(hub, tiny_src):
    import httpx2

    data = (tiny_src / "config.json").read_bytes()
    url = f"{hub.endpoint}/{REPO}/resolve/main/config.json"
    for rng, want in (("bytes=10-19", data[10:20]), ("bytes=100-", data[100:]), ("bytes=-7", data[-7:])):
        r = httpx2.get(url, headers={"Range": rng}, timeout=5)
        assert (r.status_code, r.content) == (206, want), rng
        assert r.headers["Content-Range"].endswith(f"/{len(data)}")
    assert httpx2.get(url, headers={"Range": f"bytes={len(data)}-"}, timeout=5).status_code == 416


def test_a_sparse_file_is_served_whole_holes_as_zeros_and_its_ranges_too(fake_hub, tmp_path):
    """A file of data islands between holes (how scripts/r1_sparse_source.py writes a source): its
    bytes whole and by range, across island and hole edges, and a range that is all hole."""
    import httpx2

    d = tmp_path / "sparse"
    d.mkdir()
    size = 5 * (1 << 20) + 12345
    islands = {0: b"head" * 1000, 3 * (1 << 20) + 7: os.urandom(70_000), size - 9: b"the tail!"}
    with open(d / "w.bin", "wb") as f:
        f.truncate(size)
        for at, data in islands.items():
            f.seek(at)
            f.write(data)
    want = bytearray(size)
    for at, data in islands.items():
        want[at : at + len(data)] = data
    assert os.stat(d / "w.bin").st_blocks * 512 < size // 2  # holes on this filesystem
    fake_hub.add_repo("acme/sparse", d)
    url = f"{fake_hub.endpoint}/acme/sparse/resolve/main/w.bin"
    assert httpx2.get(url, timeout=30).content == want
    edges = [
        (0, 3999),
        (3990, 4010),
        (1 << 20, 2 << 20),
        (3 * (1 << 20), 3 * (1 << 20) + 80_000),
        (size - 20, size - 1),
    ]
    for a, b in edges:
        r = httpx2.get(url, headers={"Range": f"bytes={a}-{b}"}, timeout=30)
        assert (r.status_code, r.content) == (206, bytes(want[a : b + 1])), (a, b)


def test_injected_failure_is_one_shot(hub, tiny_src):
    hub.fail(REPO, "config.json", status=500, method="GET")
    with pytest.raises(errors.HfHubHTTPError) as e:
        hf_hub_download(REPO, "config.json")
    assert e.value.response.status_code == 500
    assert Path(hf_hub_download(REPO, "config.json")).read_bytes() == (tiny_src / "config.json").read_bytes()


def test_private_repo_needs_the_token(fake_hub, tiny_src, monkeypatch):
    fake_hub.add_repo("acme/private", tiny_src, private=True, token="hf_secret")
    with pytest.raises(errors.RepositoryNotFoundError):
        snapshot_download("acme/private")
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    with pytest.raises(errors.HfHubHTTPError) as e:
        hf_hub_download("acme/private", "config.json")
    assert e.value.response.status_code == 401
    monkeypatch.setenv("HF_TOKEN", "hf_secret")  # read at call time, as users expect
    fake_hub.reset_requests()
    assert (Path(snapshot_download("acme/private")) / "config.json").is_file()
    assert fake_hub.requests and {r.authorization for r in fake_hub.requests} == {"Bearer hf_secret"}


def test_revisions(fake_hub, tiny_src, tmp_path):
    main = fake_hub.add_repo(REPO, tiny_src)
    other = tmp_path / "v2"
    (other / "sub").mkdir(parents=True)
    (other / "config.json").write_text("{}")
    (other / "sub" / "x.safetensors").write_bytes(b"\0" * 10)
    v2 = fake_hub.add_repo(REPO, other, "ab" * 20, revision="v2")
    assert v2 == "ab" * 20 and main != v2 and fake_hub.commit_sha(REPO) == main

    p = Path(snapshot_download(REPO, revision="v2"))
    assert p.name == v2 and sorted(repo_files(p)) == ["config.json", "sub/x.safetensors"]
    infos = fake_hub.count(kind="info")
    p = Path(snapshot_download(REPO, revision=main))  # by commit sha: no info call
    assert p.name == main and fake_hub.count(kind="info") == infos
    assert (p / SHARD).read_bytes() == (tiny_src / SHARD).read_bytes()


def test_subprocesses_inherit_the_environment(hub, tiny_src):
    code = f"import huggingface_hub as h; print(h.snapshot_download({REPO!r}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    path = Path(out.stdout.strip().splitlines()[-1])
    assert path.is_relative_to(hub.cache_dir)
    assert (path / SHARD).read_bytes() == (tiny_src / SHARD).read_bytes()
    assert hub.downloads(REPO, SHARD) == 1


def test_standalone_context_manager_shuts_down(tiny_src):
    with FakeHub({REPO: (tiny_src, None)}) as hub:
        port = hub.port
        import httpx2

        r = httpx2.get(f"{hub.endpoint}/api/models/{REPO}", timeout=5)
        assert r.status_code == 200 and r.json()["sha"] == hub.commit_sha(REPO)
    import socket

    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


# --- for Hub to Hub at the real size: sparse files served by sendfile, the sink, byte counters, upload faults ----


TOKEN = "hf_fake_write_token"
SINK_REPO = "org/sink"
LFS_JSON = "application/vnd.git-lfs+json"


def sparse_file(path: Path, size: int, data: dict[int, bytes]) -> Path:
    """A file of `size` bytes, holes but for `data` ({offset: bytes})."""
    with open(path, "wb") as f:
        for offset, chunk in data.items():
            f.seek(offset)
            f.write(chunk)
        f.truncate(size)
    return path


@pytest.fixture
def sink(tmp_path, monkeypatch):
    """A started FakeHub in sink mode, installed, with a write token in HF_TOKEN; parts of 1 MiB."""
    with FakeHub(sink=True) as hub:
        hub.install(monkeypatch, tmp_path / "hf_home")
        hub.add_token(TOKEN)
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        try:
            yield hub
        finally:
            huggingface_hub.close_session()


def upload_files(files: dict[str, Path], repo: str = SINK_REPO, message: str = "upload") -> str:
    from huggingface_hub import CommitOperationAdd

    api = HfApi()
    api.create_repo(repo, exist_ok=True)
    ops = [CommitOperationAdd(path_in_repo=rel, path_or_fileobj=str(p)) for rel, p in files.items()]
    return api.create_commit(repo, ops, commit_message=message).oid


class _CountingFile:
    """A file object that counts the bytes read through it (its descriptor still serves sendfile)."""

    read_bytes = 0

    def __init__(self, f):
        self._f = f

    def read(self, *args):
        data = self._f.read(*args)
        _CountingFile.read_bytes += len(data)
        return data

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


def test_a_sparse_file_is_served_without_reading_it_into_python(fake_hub, tmp_path, monkeypatch):
    import tracemalloc

    import httpx2

    import support.fake_hub

    counting = lambda *a, **k: _CountingFile(open(*a, **k))  # noqa: E731, SIM115 (closed by its __exit__)
    monkeypatch.setattr(support.fake_hub, "open", counting, raising=False)
    monkeypatch.setattr(_CountingFile, "read_bytes", 0)

    size = 96 << 20
    marks = {0: b"head", 50 << 20: b"middle", size - 4: b"tail"}
    repo_dir = tmp_path / "repo"
    repo_dir.mkdir()
    sparse_file(repo_dir / "model.safetensors", size, marks)
    digest = sha256_of(repo_dir / "model.safetensors")
    fake_hub.add_repo("org/sparse", repo_dir, known_sha256={"model.safetensors": digest})
    url = f"{fake_hub.endpoint}/org/sparse/resolve/main/model.safetensors"

    code = (
        "import hashlib, sys, httpx2\n"
        "h = hashlib.sha256()\n"
        "with httpx2.stream('GET', sys.argv[1], timeout=30) as r:\n"
        "    for chunk in r.iter_bytes(1 << 20): h.update(chunk)\n"
        "print(r.status_code, h.hexdigest())\n"
    )
    tracemalloc.start()
    try:  # the client in another process: what this one allocates is the server's
        out = subprocess.run([sys.executable, "-c", code, url], capture_output=True, text=True, timeout=120)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["200", digest]
    assert peak < 4 << 20, peak  # 96 MiB served, never held by Python
    assert _CountingFile.read_bytes == 0  # nor read through it: sendfile
    (get,) = [r for r in fake_hub.requests if r.method == "GET" and r.filename == "model.safetensors"]
    assert get.bytes_sent == size

    r = httpx2.get(url, headers={"Range": f"bytes={50 << 20}-{(50 << 20) + 5}"}, timeout=5)
    assert (r.status_code, r.content) == (206, b"middle")
    r = httpx2.get(url, headers={"Range": "bytes=-4"}, timeout=5)
    assert (r.status_code, r.content) == (206, b"tail")


def test_the_sink_keeps_paths_sizes_and_sha256_not_bytes(sink, tmp_path):
    big = tmp_path / "model-00001-of-00001.safetensors"
    big.write_bytes(os.urandom(3 * 1024 * 1024 + 17))  # above the 2 MiB multipart threshold: 4 parts
    small = tmp_path / "tiny.safetensors"
    small.write_bytes(os.urandom(1000))
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "deepseek_v3"}\n')
    upload_files({big.name: big, "sub/" + small.name: small, config.name: config})

    # The listings answer as for kept bytes.
    files = {e.path: e for e in HfApi().list_repo_tree(SINK_REPO, recursive=True) if hasattr(e, "size")}
    assert sorted(files) == [
        ".gitattributes",
        "config.json",
        "model-00001-of-00001.safetensors",
        "sub/tiny.safetensors",
    ]
    for rel, p in ((big.name, big), ("sub/" + small.name, small)):
        assert files[rel].size == p.stat().st_size and files[rel].lfs.sha256 == sha256_of(p)
    assert files["config.json"].lfs is None and files["config.json"].blob_id == git_sha1_of(config)
    (info,) = HfApi().get_paths_info(SINK_REPO, [big.name])
    assert info.lfs.sha256 == sha256_of(big)
    assert sink.tree_sizes(SINK_REPO)[big.name] == (big.stat().st_size, sha256_of(big))
    assert sink.count(kind="lfs-part") == 4 and sink.count(kind="lfs-upload") == 1

    # No LFS bytes kept anywhere; a regular file is kept and downloads.
    stored = [p for p in Path(sink._storage.name).rglob("*") if p.is_file() and p.stat().st_size >= 1000]
    assert stored == []
    assert Path(hf_hub_download(SINK_REPO, "config.json")).read_bytes() == config.read_bytes()
    with pytest.raises(errors.HfHubHTTPError) as e:
        hf_hub_download(SINK_REPO, big.name)
    assert e.value.response.status_code == 410

    # Bytes received per path: each file once; the same content again is not sent.
    sizes = {rel: (tmp_path / rel.split("/")[-1]).stat().st_size for rel in (big.name, config.name)}
    received = sink.received_by_path(SINK_REPO)
    assert received[big.name] == sizes[big.name] and received[config.name] == sizes[config.name]
    assert received["sub/tiny.safetensors"] == 1000 and received[".gitattributes"] == 0
    before = sink.received_bytes
    upload_files({"copy-of-big.safetensors": big}, message="again")
    assert sink.received_bytes == before  # the batch said "stored": no PUT
    assert sink.received_by_path(SINK_REPO)["copy-of-big.safetensors"] == sizes[big.name]
    assert [c.summary for c in sink.commits] == ["initial commit", "upload", "again"]
    assert [(r.repo_id, sorted(p for p, _, _ in r.files)) for r in sink.preuploads] == [
        (SINK_REPO, ["config.json", big.name, "sub/tiny.safetensors"]),
        (SINK_REPO, ["copy-of-big.safetensors"]),
    ]
    assert {mode for r in sink.preuploads for p, _, mode in r.files if p.endswith(".safetensors")} == {"lfs"}


def test_the_sink_refuses_bytes_that_are_not_the_object(sink, tmp_path):
    import httpx2

    data = os.urandom(1000)
    url = f"{sink.endpoint}/fake-lfs/{hashlib.sha256(b'other').hexdigest()}?size=1000"
    assert httpx2.put(url, content=data, timeout=5).status_code == 400
    assert sink._objects == {}


@pytest.mark.parametrize("sink_mode", [True, False], ids=["sink", "kept"])
def test_a_multipart_transfer_checks_each_parts_etag_and_bytes(sink_mode, tmp_path):
    import httpx2

    def three_parts() -> tuple[list[bytes], str]:
        parts = [os.urandom(1 << 20), os.urandom(1 << 20), os.urandom(5000)]
        return parts, hashlib.sha256(b"".join(parts)).hexdigest()

    with FakeHub(sink=sink_mode) as hub:

        def put(oid: str, n: int, body: bytes) -> str:
            r = httpx2.put(f"{hub.endpoint}/fake-lfs/{oid}/part/{n}", content=body, timeout=5)
            assert r.status_code == 200
            return r.headers["ETag"]

        def complete(oid: str, size: int, etags: list[str]) -> int:
            body = {"oid": oid, "parts": [{"partNumber": n, "etag": e} for n, e in enumerate(etags, start=1)]}
            url, headers = f"{hub.endpoint}/fake-lfs/{oid}/complete?size={size}", {"Content-Type": LFS_JSON}
            return httpx2.post(url, json=body, headers=headers, timeout=5).status_code

        parts, oid = three_parts()
        size = sum(map(len, parts))
        etags = {2: put(oid, 2, parts[1]), 1: put(oid, 1, parts[0]), 3: put(oid, 3, parts[2])}  # part 2 early
        assert put(oid, 1, parts[0]) == etags[1]  # sent again, the same bytes: the same ETag
        assert len(set(etags.values())) == 3 and all(e.startswith('"') and len(e) > 2 for e in etags.values())
        assert complete(oid, size, [etags[1], etags[3], etags[2]]) == 400  # not the ETags answered for those parts
        assert oid not in hub.lfs_uploads
        assert complete(oid, size, [etags[1], etags[2], etags[3]]) == 200
        assert hub.lfs_uploads == [oid] and hub._objects[oid].size == size
        assert hub.received_lfs[oid] == size + len(parts[0])
        if not sink_mode:
            assert hub._objects[oid].path.read_bytes() == b"".join(parts)

        # A part sent again with other bytes of its size after the server had it (part 1, which came
        # in order, or part 2, which came early), its new ETag in the completion: the object is refused.
        for again in (1, 2):
            parts, oid = three_parts()
            etags = {2: put(oid, 2, parts[1]), 1: put(oid, 1, parts[0]), 3: put(oid, 3, parts[2])}
            other = bytearray(parts[again - 1])
            other[-1] ^= 1
            etags[again] = put(oid, again, bytes(other))
            assert complete(oid, sum(map(len, parts)), [etags[1], etags[2], etags[3]]) == 400
            assert oid not in hub.lfs_uploads


def test_the_bytes_of_a_send_cut_short_by_the_client_are_counted_to_the_byte(sink):
    import socket
    import time

    size, sent = 3 << 20, (3 << 19) + 7
    oid = hashlib.sha256(b"never whole").hexdigest()
    with socket.create_connection(("127.0.0.1", sink.port), timeout=5) as conn:
        conn.sendall(f"PUT /fake-lfs/{oid}?size={size} HTTP/1.1\r\nHost: x\r\nContent-Length: {size}\r\n\r\n".encode())
        conn.sendall(os.urandom(sent))
    deadline = time.monotonic() + 10
    while sink.count(kind="lfs-upload") == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert [r.status for r in sink.requests if r.kind == "lfs-upload"] == [-1]
    assert sink.received_lfs[oid] == sent and sink._objects == {}


def test_upload_faults_are_retried_by_the_client_where_transient(sink, tmp_path):
    big = tmp_path / "model.safetensors"
    big.write_bytes(os.urandom(3 * 1024 * 1024))  # 3 parts of 1 MiB
    small = tmp_path / "other.safetensors"
    small.write_bytes(os.urandom(5000))
    sink.fail_upload("lfs-part", status=503, times=2)
    sink.cut_upload("lfs-upload", at=1000)
    sink.fail_upload("preupload", status=429, retry_after=0.2)
    upload_files({big.name: big, small.name: small})

    assert sink.tree(SINK_REPO)[big.name] == sha256_of(big) and sink.tree(SINK_REPO)[small.name] == sha256_of(small)
    parts = [r.status for r in sink.requests if r.kind == "lfs-part"]
    assert parts == [503, 503, 200, 200, 200]
    assert [r.status for r in sink.requests if r.kind == "lfs-upload"] == [-1, 200]
    assert [r.status for r in sink.requests if r.kind == "preupload"][:2] == [429, 200]
    # What was received, the failed sends included: a test of "nothing sent twice" subtracts its faults.
    assert sink.received_lfs[sha256_of(big)] == 3 * 1024 * 1024 + 2 * 1024 * 1024
    assert sink.received_lfs[sha256_of(small)] == 1000 + 5000


def test_a_failed_commit_says_retry_after_and_changes_nothing(sink, tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes(os.urandom(4000))
    upload_files({}, message="empty")  # the repo exists, the next commit is the faulted one
    sink.fail_upload("commit", status=429, retry_after=3)
    with pytest.raises(errors.HfHubHTTPError) as e:
        upload_files({f.name: f})
    assert e.value.response.status_code == 429 and e.value.response.headers["Retry-After"] == "3"
    assert f.name not in sink.tree(SINK_REPO)
    assert sink.received_lfs[sha256_of(f)] == 4000  # the data went up before the commit

    sink.cut_upload("commit")
    with pytest.raises(Exception) as e:  # a lost connection: the client's transport error
        upload_files({f.name: f})
    assert f.name not in sink.tree(SINK_REPO)
    assert sink.count(kind="commit", status=-1) == 1
    upload_files({f.name: f})
    assert sink.tree(SINK_REPO)[f.name] == sha256_of(f)
    assert sink.received_by_path(SINK_REPO)[f.name] == 4000  # stored once, never sent again


def test_a_stall_holds_the_request_until_released_or_its_time(sink, tmp_path):
    import threading
    import time

    f = tmp_path / "model.safetensors"
    f.write_bytes(os.urandom(4000))
    sink.stall_upload("lfs-upload", seconds=0.5)
    t0 = time.monotonic()
    upload_files({f.name: f})
    assert time.monotonic() - t0 >= 0.5
    g = tmp_path / "second.safetensors"
    g.write_bytes(os.urandom(4000))
    sink.stall_upload("commit")  # until released
    timer = threading.Timer(0.5, sink.release_stalls)
    timer.start()
    t0 = time.monotonic()
    upload_files({g.name: g})
    assert time.monotonic() - t0 >= 0.5 and g.name in sink.tree(SINK_REPO)
    timer.join()
    with pytest.raises(ValueError, match="unknown upload request kind"):
        sink.fail_upload("upload")


def test_the_state_endpoint_and_the_servers_cpu_time(sink, tmp_path):
    import httpx2

    f = tmp_path / "model.safetensors"
    f.write_bytes(os.urandom(3 * 1024 * 1024))
    upload_files({f.name: f})
    state = httpx2.get(f"{sink.endpoint}/_fake/state", timeout=5).json()
    assert state["repos"][SINK_REPO][f.name] == [f.stat().st_size, sha256_of(f), f.stat().st_size]
    assert state["received_bytes"] == f.stat().st_size
    assert [c["summary"] for c in state["commits"]] == ["initial commit", "upload"]
    assert 0 < state["cpu_seconds"] == pytest.approx(sink.cpu_seconds, abs=0.5)
    assert state["cpu_by_role"]["upload"] > 0 and sum(state["cpu_by_role"].values()) <= state["cpu_seconds"] + 1e-6


def test_the_server_in_a_process_of_its_own(tiny_src, tmp_path):
    import json
    import signal

    import httpx2

    digests = {SHARD: sha256_of(tiny_src / SHARD)}
    (tmp_path / "digests.json").write_text(json.dumps(digests))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "support.fake_hub_serve", "--repo", f"{REPO}={tiny_src}:{tmp_path / 'digests.json'}",
         "--sink", "--token", TOKEN],
        stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        started = json.loads(proc.stdout.readline())
        assert started["pid"] == proc.pid
        hub_env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HF_HUB_OFFLINE")}
        hub_env |= {"HF_ENDPOINT": started["endpoint"], "HF_HOME": str(tmp_path / "hf"), "HF_HUB_DISABLE_XET": "1"}
        code = f"import huggingface_hub as h; print(h.snapshot_download({REPO!r}))"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=hub_env, timeout=120)
        assert out.returncode == 0, out.stderr
        got = Path(out.stdout.strip().splitlines()[-1])
        assert (got / SHARD).read_bytes() == (tiny_src / SHARD).read_bytes()
        state = httpx2.get(f"{started['endpoint']}/_fake/state", timeout=5).json()
        assert state["repos"][REPO][SHARD][:2] == [(tiny_src / SHARD).stat().st_size, digests[SHARD]]
    finally:
        proc.send_signal(signal.SIGTERM)
        _, status, usage = os.wait4(proc.pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert usage.ru_utime + usage.ru_stime > 0  # its own CPU time, apart from the client's
