"""Hub sources through the real huggingface_hub client against a local fake Hub (tests/support/fake_hub.py)."""

import json
import re
import threading
import time
from pathlib import Path

import pytest

from mla_convert.conversion.pipeline import convert
from mla_convert.demo.specs import CheckpointSpec
from mla_convert.demo.synthetic import write_checkpoint
from mla_convert.errors import SourceError
from mla_convert.settings import Options
from support.checkpoints import SHARD1, SHARD2

REPO = "deepseek-ai/Tiny-R1"


@pytest.fixture
def hub(fake_hub, tiny_src):
    fake_hub.add_repo(REPO, tiny_src)
    return fake_hub


def shards(src: Path) -> list[str]:
    return sorted(p.name for p in src.glob("*.safetensors"))


def fetches(hub, filename: str) -> int:
    """How many whole copies of a file the server sent (header range reads are a few KB)."""
    sent = sum(
        r.bytes_sent for r in hub.requests if r.method == "GET" and r.filename == filename and r.kind == "resolve"
    )
    return sent // hub.file_info(REPO, filename)["size"]


def test_convert_from_repo_id_matches_local_conversion(hub, converted, tmp_path, conversion_hashes):
    summary = convert(REPO, tmp_path / "out", Options())
    assert summary.status == "complete"
    assert conversion_hashes(tmp_path / "out") == conversion_hashes(converted["channel-fp8"])
    assert all(fetches(hub, s) == 1 for s in shards(converted["channel-fp8"]))


@pytest.fixture(scope="module")
def eight_shards(tmp_path_factory):
    """A tiny checkpoint in 8 shards (so a bound of a few shards is well below the source) and
    its local conversion."""
    base = tmp_path_factory.mktemp("eight")
    src = write_checkpoint(base / "src", CheckpointSpec(num_shards=8))
    convert(src, base / "local", Options())
    return src, base / "local"


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_stream_converts_with_bounded_disk_and_deletes_shards(
    fake_hub, eight_shards, tmp_path, workers, conversion_hashes
):
    hub, (tiny_src, local) = fake_hub, eight_shards
    hub.add_repo(REPO, tiny_src)
    out = tmp_path / "out"
    peak = {"bytes": 0}
    done = threading.Event()

    def watch():  # measured from outside the converter, not reported by it
        while not done.is_set():
            staging = out / ".mla-convert-source"
            if staging.exists():
                peak["bytes"] = max(
                    peak["bytes"], sum(p.stat().st_size for p in staging.glob("*.safetensors") if p.exists())
                )
            time.sleep(0.002)

    t = threading.Thread(target=watch)
    t.start()
    try:
        summary = convert(REPO, out, Options(), stream=True, workers=workers)
    finally:
        done.set()
        t.join()
    assert conversion_hashes(out) == conversion_hashes(local)
    assert not (out / ".mla-convert-source").exists()
    sizes = sorted(((tiny_src / s).stat().st_size for s in shards(tiny_src)), reverse=True)
    bound = sum(sizes[: workers + 2])  # the jobs in flight, one prefetched, and a partner scale's shard
    assert 0 < summary.peak_source_bytes_on_disk <= bound < sum(sizes)
    assert peak["bytes"] <= bound
    assert all(fetches(hub, s) == 1 for s in shards(tiny_src))


def test_dry_run_prices_both_modes_without_downloading_shards(hub, tiny_src, tmp_path):
    summary = convert(REPO, tmp_path / "out", Options(), dry_run=True)
    assert not (tmp_path / "out").exists()
    assert all(fetches(hub, s) == 0 for s in shards(tiny_src))
    source_bytes = sum((tiny_src / s).stat().st_size for s in shards(tiny_src))
    assert summary.disk_required_download_then_convert >= summary.bytes_out + source_bytes
    assert summary.bytes_out < summary.disk_required_stream < summary.disk_required_download_then_convert
    assert summary.fp8_weights_converted == 104 and summary.source.startswith(REPO + "@")


@pytest.mark.parametrize("stream", [False, True])
def test_corrupted_shard_is_refetched_once(hub, converted, tmp_path, stream, conversion_hashes):
    # The first whole download is bad, the second good (the plan first reads the header by two
    # range requests, which the fault also counts).
    hub.corrupt(REPO, SHARD2, times=3)
    convert(REPO, tmp_path / "out", Options(), stream=stream)
    assert conversion_hashes(tmp_path / "out") == conversion_hashes(converted["channel-fp8"])
    assert fetches(hub, SHARD2) == 2


@pytest.mark.parametrize("stream", [False, True])
def test_persistently_corrupted_shard_is_refused_not_converted(hub, tmp_path, stream, load_json):
    hub.corrupt(REPO, SHARD2)
    out = tmp_path / "out"
    with pytest.raises(SourceError, match=rf"{SHARD2}.*sha256.*not converted"):
        convert(REPO, out, Options(), stream=stream)
    manifest = out / "mla-convert-manifest.json"
    assert not manifest.exists() or load_json(manifest)["status"] != "complete"
    assert not (out / SHARD2).exists()


@pytest.mark.slow
def test_interrupted_stream_resumes_without_downloading_converted_shards(
    hub, converted, tmp_path, run_cli, conversion_hashes
):
    out = tmp_path / "out"
    r = run_cli("deepseek-r1", REPO, "--out", out, "--stream", "--quiet", crash_at=f"after-job:{SHARD2}")
    assert r.returncode == -9, r.stderr
    assert fetches(hub, SHARD1) == 1
    r = run_cli("deepseek-r1", REPO, "--out", out, "--stream", "--resume", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["resumed_jobs"] == 2
    assert fetches(hub, SHARD1) == 1  # converted before the crash: not fetched again
    assert conversion_hashes(out) == conversion_hashes(converted["channel-fp8"])


def test_offline_uses_the_cached_snapshot(hub, converted, tmp_path, tree_hashes, conversion_hashes):
    convert(REPO, tmp_path / "first", Options())  # populates the cache
    hub.set_offline()
    hub.reset_requests()
    convert(REPO, tmp_path / "offline", Options())
    assert hub.count() == 0
    assert conversion_hashes(tmp_path / "offline") == conversion_hashes(converted["channel-fp8"])
    assert tree_hashes(tmp_path / "offline") == tree_hashes(tmp_path / "first")  # the same repo and commit


@pytest.mark.slow
def test_offline_with_nothing_cached_is_a_clear_error(hub, tmp_path, run_cli):
    hub.set_offline()
    r = run_cli("deepseek-r1", REPO, "--out", tmp_path / "out", "--quiet")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"error: {REPO}: not in the local Hugging Face cache and the Hub cannot be reached "
        "(offline or HF_HUB_OFFLINE=1); download it first or pass a local directory"
    ]
    r = run_cli("deepseek-r1", REPO, "--out", tmp_path / "out", "--stream", "--quiet")
    assert r.returncode == 2 and "HF_HUB_OFFLINE" in r.stderr


def test_unknown_repo_and_private_repo_token(hub, tiny_src, tmp_path, monkeypatch):
    with pytest.raises(SourceError, match="repository not found"):
        convert("nobody/missing", tmp_path / "a", Options())
    hub.add_repo("org/private", tiny_src, private=True, token="hf_secret")
    with pytest.raises(SourceError, match="repository not found"):
        convert("org/private", tmp_path / "b", Options(), dry_run=True)
    monkeypatch.setenv("HF_TOKEN", "hf_secret")  # the usual huggingface_hub token lookup
    assert convert("org/private", tmp_path / "c", Options(), dry_run=True).fp8_weights_converted == 104


def test_stream_needs_a_hub_source(tiny_src, tmp_path, run_cli):
    r = run_cli("deepseek-r1", tiny_src, "--out", tmp_path / "out", "--stream", "--quiet")
    assert r.returncode == 2 and "--stream needs a Hub repo id" in r.stderr


def test_streamer_window_holds_when_jobs_finish_out_of_order(tmp_path, monkeypatch):
    """Deterministic: job k reads shards k and k+1 (a scale in the next shard); a later job
    finishing first must not move the download window or delete shards still needed."""
    from mla_convert.source import hub as hub_mod

    fetched = []

    def fake_fetch(repo, filename, local_dir=None, write_mode=None):
        (local_dir / filename).write_bytes(b"x" * 100)
        fetched.append(filename)
        return local_dir / filename

    monkeypatch.setattr(hub_mod, "fetch_checked", fake_fetch)
    jobs = [(f"j{k}", [f"s{k}", f"s{k + 1}"]) for k in range(1, 6)]
    on_disk = lambda: sorted(p.name for p in tmp_path.iterdir())  # noqa: E731
    with hub_mod.ShardStreamer(None, tmp_path, jobs, ahead=1) as st:
        assert st.wait_for("j1", 5) and st.wait_for("j2", 5)
        assert not st.wait_for("j3", 0.2)  # window: j1, j2
        st.release("j2", ["s2", "s3"])  # out of order: j1 still runs
        assert not st.wait_for("j3", 0.2) and on_disk() == ["s1", "s2", "s3"]
        st.release("j1", ["s1", "s2"])
        assert st.wait_for("j3", 5) and st.wait_for("j4", 5) and not st.wait_for("j5", 0.2)
        assert on_disk() == ["s3", "s4", "s5"]
        for j, files in jobs[2:4]:
            st.release(j, files)
        assert st.wait_for("j5", 5)
        st.release("j5", ["s5", "s6"])
    assert on_disk() == [] and fetched == [f"s{k}" for k in range(1, 7)]
    assert st.peak_on_disk == 300  # never more than the window's three shards


def test_a_branch_that_moves_between_plan_and_download_is_refused(hub, tiny_src, tmp_path, monkeypatch):
    """The plan (and its free-space and --resume checks) is made for the commit the branch named then;
    if `main` moves before the download resolves it again, the run stops instead of converting
    another commit than it checked."""
    from mla_convert.source import hub as hub_mod

    other = write_checkpoint(tmp_path / "other", CheckpointSpec(seed=1))
    real = hub_mod.prepare_staging

    def staging_then_push(repo, staging):
        headers = real(repo, staging)
        hub.add_repo(REPO, other)  # a new commit on main, after the plan read main's headers
        return headers

    monkeypatch.setattr(hub_mod, "prepare_staging", staging_then_push)
    with pytest.raises(SourceError, match=r"moved on the Hub while it was planned"):
        convert(REPO, tmp_path / "out", Options())
    assert not (tmp_path / "out" / "model.safetensors.index.json").exists()


def test_a_hub_http_error_is_one_line_with_the_server_message_and_request_id(hub, tmp_path):
    """A Hub error that is no known case (a 500 on the file list) names the status, what the
    server said and the request id its support asks for, in one line; the HTTP error is kept as
    the cause."""
    from huggingface_hub.errors import HfHubHTTPError

    hub.fail(REPO, status=500, times=1, method="GET")
    with pytest.raises(SourceError) as err:
        convert(REPO, tmp_path / "out", Options(), dry_run=True)
    message = str(err.value)
    assert "\n" not in message and "500" in message and "Injected failure 500" in message
    assert re.search(r"[Rr]equest [Ii][Dd]:? fake-\d+", message), message
    assert isinstance(err.value.__cause__, HfHubHTTPError)


def test_a_streamed_shard_is_read_lean_unless_the_user_set_up_the_session(
    hub, tiny_src, converted, tmp_path, monkeypatch, conversion_hashes
):
    """--stream reads each shard's body through source.hub_body (straight into the staging buffers
    of the file it writes); a session the user set up for huggingface_hub (proxies, certificates)
    is used instead."""
    import httpx2
    from huggingface_hub.utils import _http, set_client_factory

    from mla_convert.source import hub_body

    lean = []
    receive = hub_body.receive
    monkeypatch.setattr(hub_body, "receive", lambda r, out: (lean.append(r.url), receive(r, out)))
    convert(REPO, tmp_path / "lean", Options(), stream=True)
    assert conversion_hashes(tmp_path / "lean") == conversion_hashes(converted["channel-fp8"])
    assert len(lean) == len(shards(tiny_src))
    lean.clear()
    set_client_factory(lambda: httpx2.Client(follow_redirects=True, timeout=None))  # the user's own
    try:
        convert(REPO, tmp_path / "theirs", Options(), stream=True)
    finally:
        set_client_factory(_http.default_client_factory)
    assert conversion_hashes(tmp_path / "theirs") == conversion_hashes(converted["channel-fp8"]) and lean == []


@pytest.mark.parametrize("write_io", ["buffered", "direct"])
def test_stream_writes_its_downloads_as_the_run_s_write_io_says(
    hub, tiny_src, converted, tmp_path, monkeypatch, write_io, conversion_hashes
):
    """--write-io is the run's choice for everything it writes under --out, the shards --stream
    downloads into its staging directory too (they were written O_DIRECT wherever a probe passed)."""
    from mla_convert.io import disk_write
    from mla_convert.source import hub as source_hub

    opened, open_for_write = [], disk_write.open_for_write
    monkeypatch.setattr(
        disk_write,
        "open_for_write",
        lambda path, mode, **o: (opened.append((path, mode)), open_for_write(path, mode, **o))[1],
    )
    convert(REPO, tmp_path / "out", Options(), stream=True, write_io=write_io)
    downloads = [mode for path, mode in opened if path.name.endswith(source_hub.DOWNLOAD_SUFFIX)]
    assert downloads == [write_io] * len(shards(tiny_src))
    assert conversion_hashes(tmp_path / "out") == conversion_hashes(converted["channel-fp8"])


def test_a_partial_download_an_earlier_run_left_is_continued_from_its_whole_blocks(hub, tiny_src, tmp_path):
    """A shard's download cut short by a killed run: the next fetch keeps its whole 4 KiB blocks
    (hashed, not fetched again), asks for the rest by a range request, and checks the whole."""
    from mla_convert.io.disk_write import ALIGN
    from mla_convert.source import hub as source_hub

    repo = source_hub.list_repo(REPO, None)
    data = (tiny_src / SHARD2).read_bytes()
    staging = tmp_path / "staging"
    staging.mkdir()
    partial = source_hub.download_name(staging / SHARD2)
    partial.write_bytes(data[: 3 * ALIGN + 100])
    hub.reset_requests()
    path = source_hub.fetch_checked(repo, SHARD2, local_dir=staging)
    assert path.read_bytes() == data and not partial.exists()
    gets = [r.range for r in hub.requests if r.method == "GET" and r.filename == SHARD2]
    assert gets == [f"bytes={3 * ALIGN}-"]
