"""`convert --upload OWNER/NAME` (publish.hub_to_hub) against the local fake Hub, through the real
huggingface_hub client (the LFS path: the fake Hub has no Xet storage): the Hub's final tree is the
one a plain convert + upload gives, within a disk budget the measured peak never passes."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
import time
from pathlib import Path

import huggingface_hub.lfs
import pytest

from mla_convert import convert, upload
from mla_convert.constants import JOURNAL_NAME, MANIFEST_NAME
from mla_convert.demo.specs import CheckpointSpec
from mla_convert.demo.synthetic import write_checkpoint
from mla_convert.errors import ConvertError
from mla_convert.settings import UploadOptions

REPO = "org/tiny-h2h"


@pytest.fixture(scope="module")
def eight(tmp_path_factory) -> Path:
    """A tiny checkpoint in 8 shards: a budget of a few jobs is well below the output."""
    return write_checkpoint(tmp_path_factory.mktemp("eight") / "src", CheckpointSpec(num_shards=8))


def repo_tree(hub, repo: str) -> dict[str, str]:
    return {p: h for p, h in hub.tree(repo).items() if p != ".gitattributes"}


def assert_plain_convert_and_upload_give_the_same_tree(hub, src: Path, tmp_path: Path) -> None:
    """A plain convert of `src`, then `upload` to REPO: up to date, nothing sent, the tree as it was
    (a file of another sha256 would be refused as another model's)."""
    tree = repo_tree(hub, REPO)
    plain = tmp_path / "plain"
    convert(src, plain)
    result = upload(plain, REPO)
    assert repo_tree(hub, REPO) == tree, sorted(set(repo_tree(hub, REPO).items()) ^ set(tree.items()))
    assert result.uploaded_files == 0 and result.commits == () and result.skipped_files == result.files
    manifest = json.loads((plain / MANIFEST_NAME).read_text())
    expected = {rel: meta["sha256"] for rel, meta in manifest["files"].items()}
    assert (
        tree
        == repo_tree(hub, REPO)
        == expected | {MANIFEST_NAME: hashlib.sha256((plain / MANIFEST_NAME).read_bytes()).hexdigest()}
    )


def hashed_again(fileobj) -> bytes:
    raise AssertionError("huggingface_hub hashed a file the converter had hashed")


def fetches(hub, repo: str, filename: str) -> int:
    """How many whole copies of a file the server sent (header range reads are a few KB)."""
    sent = sum(
        r.bytes_sent for r in hub.requests if r.method == "GET" and r.filename == filename and r.kind == "resolve"
    )
    return sent // hub.file_info(repo, filename)["size"]


class DiskWatch:
    """The bytes under a directory, sampled from outside the converter while it runs."""

    def __init__(self, root: Path):
        self.root, self.peak, self._stop = root, 0, threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._stop.is_set():
            total = 0
            for dirpath, _, names in os.walk(self.root):  # a directory gone meanwhile is skipped
                for name in names:
                    with contextlib.suppress(OSError):
                        total += os.lstat(os.path.join(dirpath, name)).st_size
            self.peak = max(self.peak, total)
            time.sleep(0.001)

    def __enter__(self) -> DiskWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def test_a_budget_below_the_output_keeps_the_peak_under_it_and_gives_the_plain_tree(hub, eight, tmp_path):
    out = tmp_path / "out"
    plan = convert(eight, out, upload=REPO, upload_options=UploadOptions(create=True), dry_run=True)
    budget = plan.disk_budget_min + 1_000_000  # one job at a time, about
    assert plan.disk_budget_min < plan.bytes_out and not out.exists()
    with DiskWatch(out) as watch, pytest.MonkeyPatch.context() as mp:
        mp.setattr(huggingface_hub.lfs, "sha_fileobj", hashed_again)  # one hash per byte: the converter's
        result = convert(eight, out, upload=REPO, upload_options=UploadOptions(create=True), max_disk=budget)
    assert_plain_convert_and_upload_give_the_same_tree(hub, eight, tmp_path)
    expected = repo_tree(hub, REPO)
    assert 0 < watch.peak <= budget < result.bytes_out
    assert result.disk_peak <= budget and result.disk_budget == budget
    assert result.uploaded_files == len(expected) and result.checked_files == 8 + 4  # shards and artifact files
    assert len(result.commits) >= 2 and set(result.stage_seconds) == {"download", "convert", "check", "upload"}
    # What the directory keeps: the manifest, the journal, the small files; the data went up.
    assert sorted(p.name for p in out.iterdir()) == [JOURNAL_NAME, MANIFEST_NAME]
    # The last commit is the one that makes it a model; no earlier one holds config.json.
    commits = [c for c in hub.commits if c.repo_id == REPO and c.summary != "initial commit"]
    assert "config.json" in commits[-1].added and all("config.json" not in c.added for c in commits[:-1])
    assert all(len(c.added) < 100 for c in commits)
    assert json.loads((out / MANIFEST_NAME).read_text())["status"] == "complete"


SOURCE = "deepseek-ai/Tiny-R1-eight"


@pytest.mark.parametrize("workers", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_a_hub_source_streamed_within_the_budget(hub, eight, tmp_path, workers):
    hub.add_repo(SOURCE, eight)
    out = tmp_path / "out"
    plan = convert(SOURCE, out, upload=REPO, upload_options=UploadOptions(create=True), dry_run=True)
    assert plan.disk_budget_min > plan.bytes_out / 8  # a job's source shards count now
    budget = plan.disk_budget_min + 500_000 * workers
    with DiskWatch(out) as watch:
        result = convert(
            SOURCE, out, upload=REPO, upload_options=UploadOptions(create=True), max_disk=budget, workers=workers
        )
    assert 0 < watch.peak <= result.disk_peak <= budget
    assert result.source.startswith(SOURCE + "@")
    shards = sorted(p.name for p in eight.glob("*.safetensors"))
    assert all(fetches(hub, SOURCE, s) == 1 for s in shards)  # each shard fetched once
    assert_plain_convert_and_upload_give_the_same_tree(hub, SOURCE, tmp_path)


def test_a_budget_below_one_job_is_refused_before_the_first_byte_naming_the_smallest(hub, eight, tmp_path):
    out = tmp_path / "out"
    plan = convert(eight, out, upload=REPO, upload_options=UploadOptions(create=True), dry_run=True)
    with pytest.raises(ConvertError, match=r"--max-disk .* too small .* at least .*give --max-disk \d+MB") as e:
        convert(eight, out, upload=REPO, upload_options=UploadOptions(create=True), max_disk=plan.disk_budget_min - 1)
    assert f"{-(-plan.disk_budget_min // 10**6)}MB" in str(e.value)
    assert not out.exists() and hub.count(kind="create") == 0


def test_a_budget_above_the_free_space_counts_only_what_the_run_can_hold(hub, eight, tmp_path, monkeypatch):
    """--max-disk is a ceiling: a run that can never hold as much (everything it converts is
    smaller) is not refused on a disk with less free than the ceiling, only where the most it may
    hold does not fit."""
    from mla_convert.output import out_dir as out_dir_mod

    out = tmp_path / "out"
    plan = convert(eight, out, upload=REPO, upload_options=UploadOptions(create=True), dry_run=True)
    peak = plan.disk_peak_planned
    monkeypatch.setattr(out_dir_mod, "disk_free", lambda path: peak + 1)
    budget = 40 * 10**9
    result = convert(eight, out, upload=REPO, upload_options=UploadOptions(create=True), max_disk=budget)
    assert result.status == "complete" and result.disk_budget == budget and result.disk_peak <= peak
    monkeypatch.setattr(out_dir_mod, "disk_free", lambda path: peak - 1)
    with pytest.raises(ConvertError, match=r"--max-disk .* is more than its filesystem has free"):
        convert(
            eight, tmp_path / "out2", upload=REPO + "-2", upload_options=UploadOptions(create=True), max_disk=budget
        )


SHARD3 = "model-00003-of-00008.safetensors"


def puts(hub) -> list[str]:
    """Every LFS body the fake Hub took whole (a basic transfer, or one part of a multipart one)."""
    return [r.path for r in hub.requests if r.method == "PUT" and r.status == 200]


@pytest.mark.slow
@pytest.mark.parametrize(
    "point",
    [f"download:{SHARD3}", f"shard-write:{SHARD3}", f"check:{SHARD3}", f"preupload:{SHARD3}", "commit:1",
     "last-commit", "commit:3"],
)  # fmt: skip
def test_killed_anywhere_then_resume_gives_the_same_tree_sending_nothing_twice(hub, eight, tmp_path, run_cli, point):
    hub.add_repo(SOURCE, eight)
    out = tmp_path / "out"
    plan = convert(SOURCE, out, upload=REPO, upload_options=UploadOptions(create=True), dry_run=True)
    budget = plan.disk_budget_min + 3_000_000  # about two jobs at once: a commit holds a few files
    args = ("convert", SOURCE, "--out", out, "--upload", REPO, "--create", "--max-disk", budget, "--quiet")
    r = run_cli(*args, crash_at=point)
    assert r.returncode == -9, r.stderr
    with contextlib.suppress(KeyError):  # no repo yet: killed before --create made it
        assert "config.json" not in hub.tree(REPO)  # killed anywhere: the branch never loads as a model
    r = run_cli(*args[:-1], "--resume", "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["disk_peak"] <= budget and summary["status"] == "complete"
    sent = puts(hub)
    assert len(sent) == len(set(sent)) and len(hub.lfs_uploads) == len(set(hub.lfs_uploads))  # nothing twice
    shards = sorted(p.name for p in eight.glob("*.safetensors"))
    assert all(fetches(hub, SOURCE, s) == 1 for s in shards)  # nor downloaded twice
    commits = [c for c in hub.commits if c.repo_id == REPO and c.summary != "initial commit"]
    assert "config.json" in commits[-1].added and all("config.json" not in c.added for c in commits[:-1])
    assert_plain_convert_and_upload_give_the_same_tree(hub, SOURCE, tmp_path)


# --- faults of the Hub and the network: tried again where transient, else one line and resumable ----


@pytest.fixture
def quick_retries(monkeypatch):
    """The waits between tries, in tenths of seconds rather than seconds."""
    from mla_convert.source import hub as source_hub

    monkeypatch.setattr(source_hub, "RETRY_WAITS", (0.1, 0.2, 0.4, 0.8))


def upload_to(src, out, **kw):
    return convert(src, out, upload=REPO, upload_options=UploadOptions(create=True), **kw)


def one_line_exit_2(args: list) -> str:
    from typer.testing import CliRunner

    from mla_convert.cli.app import app

    r = CliRunner().invoke(app, [str(a) for a in args])
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    return lines[0]


@pytest.mark.parametrize("fault", ["503 twice", "cut mid-body", "stall"])
def test_a_download_fault_that_passes_is_tried_again(hub, eight, tmp_path, quick_retries, monkeypatch, fault):
    import huggingface_hub.constants

    hub.add_repo(SOURCE, eight)
    if fault == "503 twice":
        hub.fail(SOURCE, SHARD3, status=503, times=2)
    elif fault == "cut mid-body":
        hub.truncate(SOURCE, SHARD3, at=300_000, times=3)  # its two header reads are shorter: whole
    else:
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DOWNLOAD_TIMEOUT", 1)
        hub.stall(SOURCE, SHARD3)
    result = upload_to(SOURCE, tmp_path / "out")
    assert result.status == "complete"
    if fault == "cut mid-body":  # continued from the byte it stopped at, not fetched again whole
        assert [r.range for r in hub.requests if r.filename == SHARD3 and r.range and r.range.endswith("-")] == [
            "bytes=300000-"
        ]
        assert fetches(hub, SOURCE, SHARD3) == 1
    assert_plain_convert_and_upload_give_the_same_tree(hub, SOURCE, tmp_path)


def test_a_download_refused_is_one_line_and_resumable(hub, eight, tmp_path, quick_retries, monkeypatch):
    from mla_convert.source import hub as source_hub

    hub.add_repo(SOURCE, eight)
    out = tmp_path / "out"
    planned = source_hub.prepare_staging

    def refused_once_planned(*args, **kwargs):  # the shard's header was read; its download is refused
        headers = planned(*args, **kwargs)
        hub.fail(SOURCE, SHARD3, status=403, times=100, message="Access to this file is restricted")
        return headers

    budget = upload_to(SOURCE, out, dry_run=True).disk_budget_min  # one job at a time: a commit each
    monkeypatch.setattr(source_hub, "prepare_staging", refused_once_planned)
    args = ["convert", SOURCE, "--out", out, "--upload", REPO, "--create", "--max-disk", budget, "--quiet"]
    line = one_line_exit_2(args)
    assert SHARD3 in line and "403" in line and "Access to this file is restricted" in line
    assert "config.json" not in hub.tree(REPO)
    monkeypatch.setattr(source_hub, "prepare_staging", planned)
    hub.clear_faults()
    hub.reset_requests()
    result = upload_to(SOURCE, out, resume=True, max_disk=budget)
    assert result.skipped_files > 0  # the branch held some already: not sent again
    assert len(puts(hub)) == len(set(puts(hub)))
    assert_plain_convert_and_upload_give_the_same_tree(hub, SOURCE, tmp_path)


@pytest.mark.parametrize("fault", ["500 on three posts", "commit answer lost", "lfs batch answer lost"])
def test_an_upload_fault_that_passes_is_tried_again_and_nothing_is_committed_twice(
    hub, eight, tmp_path, quick_retries, fault
):
    from huggingface_hub import HfApi

    HfApi().create_repo(REPO)
    if fault == "500 on three posts":
        hub.fail(REPO, status=500, method="POST", times=3)
    elif fault == "commit answer lost":
        hub.drop("commit")
    else:
        hub.drop("lfs-batch")
    result = upload_to(eight, tmp_path / "out")
    commits = [c for c in hub.commits if c.repo_id == REPO and c.summary != "initial commit"]
    assert len(commits) == len(result.commits) == len(set(result.commits))
    added = [p for c in commits for p in c.added]
    assert len(added) == len(set(added))  # each file in one commit
    assert len(puts(hub)) == len(set(puts(hub)))
    assert_plain_convert_and_upload_give_the_same_tree(hub, eight, tmp_path)


def test_an_upload_refused_is_one_line_and_resumable(hub, eight, tmp_path, quick_retries):
    from huggingface_hub import HfApi

    HfApi().create_repo(REPO)
    out = tmp_path / "out"
    plan = upload_to(eight, out, dry_run=True)
    hub.fail(REPO, status=403, method="POST", times=100, message="Your token lacks the repo.write permission")
    line = one_line_exit_2(
        ["convert", eight, "--out", out, "--upload", REPO, "--max-disk", plan.disk_budget_min, "--quiet"]
    )
    assert "may not write to this repo (403: Your token lacks" in line
    hub.clear_faults()
    result = upload_to(eight, out, resume=True, max_disk=plan.disk_budget_min)
    assert result.status == "complete" and result.disk_peak <= plan.disk_budget_min
    assert_plain_convert_and_upload_give_the_same_tree(hub, eight, tmp_path)


@pytest.fixture
def quick_timeout(monkeypatch):
    """A request to the Hub that gets no byte for 1 s fails (transiently) rather than after minutes:
    the client has no setting of its own for an upload's timeout; the tool's is a module constant."""
    from mla_convert.publish import remote

    monkeypatch.setattr(remote, "HUB_TIMEOUT", 1.0)


@pytest.mark.parametrize("fault", ["cut mid-body", "preupload stalls", "commit stalls", "commit cut"])
def test_an_upload_cut_or_stalled_once_is_tried_again(hub, eight, tmp_path, quick_retries, quick_timeout, fault):
    from huggingface_hub import HfApi

    HfApi().create_repo(REPO)
    if fault == "cut mid-body":
        hub.cut_upload("lfs-upload", times=2)  # half a shard's body, then the connection closed
    elif fault == "preupload stalls":
        hub.stall_upload("preupload")  # no answer until the server stops
    elif fault == "commit stalls":
        hub.stall_upload("commit")
    else:
        hub.cut_upload("commit")
    result = upload_to(eight, tmp_path / "out")
    assert result.status == "complete"
    assert any(r.status == -1 for r in hub.requests) or "stalls" in fault  # the fault happened
    commits = [c for c in hub.commits if c.repo_id == REPO and c.summary != "initial commit"]
    added = [p for c in commits for p in c.added]
    assert len(commits) == len(result.commits) and len(added) == len(set(added))  # each file committed once
    assert_plain_convert_and_upload_give_the_same_tree(hub, eight, tmp_path)


@pytest.mark.parametrize("kind", ["commit cut", "commit stalls"])
def test_an_upload_cut_or_stalled_past_the_retries_is_one_line_and_resumable(
    hub, eight, tmp_path, quick_retries, quick_timeout, kind
):
    from huggingface_hub import HfApi

    HfApi().create_repo(REPO)
    out = tmp_path / "out"
    budget = upload_to(eight, out, dry_run=True).disk_budget_min  # a commit after each job
    if kind == "commit cut":
        hub.cut_upload("commit", times=100)
    else:
        hub.stall_upload("commit", times=100)
    line = one_line_exit_2(["convert", eight, "--out", out, "--upload", REPO, "--max-disk", budget, "--quiet"])
    assert "cannot reach the Hub" in line and "--resume" in line, line
    assert "config.json" not in hub.tree(REPO)
    hub.clear_faults()
    hub.release_stalls()
    result = upload_to(eight, out, resume=True, max_disk=budget)
    assert result.status == "complete" and result.disk_peak <= budget
    assert len(puts(hub)) == len(set(puts(hub)))  # the preuploaded bytes not sent again
    assert_plain_convert_and_upload_give_the_same_tree(hub, eight, tmp_path)


def test_resume_with_a_budget_too_small_for_what_is_left_is_refused_naming_the_minimum(
    hub, eight, tmp_path, monkeypatch
):
    """Files left on disk unchecked hold their room until checked, and each check needs its job's
    source shards again: a --resume whose --max-disk cannot hold both is refused before any byte,
    naming the smallest that works (it waited forever)."""
    from mla_convert.errors import ConvertError as Stopped
    from mla_convert.publish import hub_to_hub

    hub.add_repo(SOURCE, eight)
    out = tmp_path / "out"
    checked = hub_to_hub._check

    def stopped(*args):  # the converter goes on meanwhile: jobs converted, not checked
        time.sleep(1.5)
        raise Stopped("stopped for the test")

    monkeypatch.setattr(hub_to_hub, "_check", stopped)
    with pytest.raises(Stopped, match="stopped for the test"):
        upload_to(SOURCE, out)
    monkeypatch.setattr(hub_to_hub, "_check", checked)
    plan = upload_to(SOURCE, out, dry_run=True, resume=True)
    assert plan.disk_budget_min > upload_to(SOURCE, tmp_path / "fresh", dry_run=True).disk_budget_min
    hub.reset_requests()
    with pytest.raises(ConvertError, match=r"--max-disk .* too small to resume .* give --max-disk \d+MB") as e:
        upload_to(SOURCE, out, resume=True, max_disk=plan.disk_budget_min - 1)
    assert f"{-(-plan.disk_budget_min // 10**6)}MB" in str(e.value)
    shards = [r for r in hub.requests if r.kind == "resolve" and r.filename.endswith(".safetensors") and not r.range]
    assert hub.count(method="PUT") == 0 and not shards  # no byte up or down
    result = upload_to(SOURCE, out, resume=True, max_disk=plan.disk_budget_min)
    assert result.status == "complete" and result.disk_peak <= plan.disk_budget_min
    assert_plain_convert_and_upload_give_the_same_tree(hub, SOURCE, tmp_path)


def test_verify_of_the_out_dir_left_by_an_upload_points_to_the_repo(hub, eight, tmp_path):
    """--out keeps the manifest and the journal only: `verify DIR` says where the files went and the
    command that checks them there (exit 2), rather than a failure for every file not here."""
    from typer.testing import CliRunner

    from mla_convert.cli.app import app

    out = tmp_path / "out"
    convert(eight, out, upload=REPO, upload_options=UploadOptions(create=True, revision="v1"))
    r = CliRunner().invoke(app, ["verify", str(out)])
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.exit_code == 2 and len(lines) == 1 and not r.stdout.strip(), r.stderr + r.stdout
    assert f"to {REPO} and deleted them here" in lines[0] and f"mla-convert verify {REPO} --revision v1" in lines[0]
    published = CliRunner().invoke(app, ["verify", REPO, "--revision", "v1"])
    assert published.exit_code == 0, published.stdout + published.stderr


def test_the_command_line_prints_the_budget_and_what_went_up(hub, eight, tmp_path):
    from typer.testing import CliRunner

    from mla_convert.cli.app import app

    out = tmp_path / "out"
    plan = CliRunner().invoke(
        app, ["deepseek-r1", str(eight), "--out", str(out), "--upload", REPO, "--create", "--dry-run"]
    )
    assert plan.exit_code == 0, plan.stderr
    assert "--max-disk" in plan.stdout and "peak on disk, at most" in plan.stdout and not out.exists()
    r = CliRunner().invoke(app, ["deepseek-r1", str(eight), "--out", str(out), "--upload", REPO, "--create"])
    assert r.exit_code == 0, r.stderr
    assert "uploaded" in r.stdout and "stages busy" in r.stdout and f"{REPO}" in r.stdout
    alone = CliRunner().invoke(app, ["convert", str(eight), "--out", str(tmp_path / "x"), "--max-disk", "1GB"])
    assert alone.exit_code == 2 and "go with --upload" in alone.stderr


def test_a_slow_check_still_has_its_source_shards_when_the_conversion_is_done(hub, eight, tmp_path, monkeypatch):
    """The checker may lag the converter: the last jobs' source shards stay until their check is done
    (they were deleted with the staging directory as the conversion finished, under load)."""
    from mla_convert.publish import hub_to_hub

    hub.add_repo(SOURCE, eight)
    checked = hub_to_hub._check

    def slow(*args):
        time.sleep(0.5)
        return checked(*args)

    monkeypatch.setattr(hub_to_hub, "_check", slow)
    result = upload_to(SOURCE, tmp_path / "out")
    assert result.checked_files == 12 and result.stage_seconds["check"] >= 8 * 0.5
    assert_plain_convert_and_upload_give_the_same_tree(hub, SOURCE, tmp_path)


def test_a_failed_library_run_sends_and_commits_nothing_after_it_returns(hub, eight, tmp_path, monkeypatch):
    """convert(upload=...) raising in a process that goes on (a library caller): its checker and
    uploader stop with the file at hand, not send the rest of their queue behind the caller's back."""
    from mla_convert.process.interrupts import CRASH_POINTS
    from mla_convert.publish.hub_to_hub import CHECK_THREAD_NAME, UPLOAD_THREAD_NAME

    hub.add_repo(SOURCE, eight)
    first_sent = threading.Event()

    def planted(point: str) -> None:
        if point.startswith("preupload:") and not first_sent.is_set():
            first_sent.set()
            time.sleep(1.5)  # the uploader busy with its first file while the run fails
        if point == f"check:{SHARD3}":
            first_sent.wait(10)
            raise ConvertError("planted failure")

    monkeypatch.setattr(CRASH_POINTS, "hook", planted)
    with pytest.raises(ConvertError, match="planted failure"):
        upload_to(SOURCE, tmp_path / "out", workers=1)
    returned = len(hub.requests)
    time.sleep(2.5)  # past the uploader's file at hand
    assert [r.path for r in hub.requests[returned:]] == []
    threads = {t.name for t in threading.enumerate()}
    assert CHECK_THREAD_NAME not in threads and UPLOAD_THREAD_NAME not in threads


def test_a_source_shard_that_cannot_be_read_for_the_check_says_so(hub, tmp_path, monkeypatch):
    """The per-file check reads the source again: a shard cut short meanwhile is a read failure of
    the source (one line, exit 2), not a file the conversion wrote wrong."""
    from mla_convert.publish import hub_to_hub

    src = write_checkpoint(tmp_path / "src", CheckpointSpec(num_shards=8))
    checked = hub_to_hub._check

    def shard_cut_short(plan, out_dir, files):
        if any(rel == SHARD3 for rel, _, _ in files):
            os.truncate(src / SHARD3, 100_000)  # its header whole, its tensors not
        return checked(plan, out_dir, files)

    monkeypatch.setattr(hub_to_hub, "_check", shard_cut_short)
    line = one_line_exit_2(["convert", src, "--out", tmp_path / "out", "--upload", REPO, "--create", "--quiet"])
    assert f"{src / SHARD3}: tensor" in line and "a source shard it was made from could not be read" in line, line
    assert "verify rejects" not in line and "--resume" in line
    assert "config.json" not in hub.tree(REPO)


# --- what upload refuses before the first byte, refused here too ------------------------------------


def nothing_started(hub, out: Path) -> None:
    assert not out.exists() and hub.count(method="PUT") == 0 and hub.count(kind="commit") == 0


def test_another_model_in_the_repo_is_refused_unless_overwrite(hub, eight, tiny_src, tmp_path):
    hub.add_repo(REPO, tiny_src)  # the source itself: another model's files
    out = tmp_path / "out"
    with pytest.raises(ConvertError, match=r"holds another model .*--overwrite"):
        upload_to(eight, out)
    nothing_started(hub, out)
    before = set(hub.tree(REPO))
    result = upload_to(eight, out, overwrite=True)
    assert result.deleted and set(result.deleted) == before - set(hub.tree(REPO))  # what this model lacks
    assert_plain_convert_and_upload_give_the_same_tree(hub, eight, tmp_path)


def test_no_token_and_no_hub_are_refused_before_the_first_byte(hub, eight, tmp_path, monkeypatch):
    out = tmp_path / "out"
    monkeypatch.delenv("HF_TOKEN")
    hub.set_offline()
    with pytest.raises(ConvertError, match=r"no Hugging Face token.*; also, HF_HUB_OFFLINE=1 is set"):
        upload_to(eight, out)
    nothing_started(hub, out)


def test_a_card_the_hub_refuses_is_refused_before_the_first_byte(hub, src_copy, tmp_path):
    card = (src_copy / "README.md").read_text().replace("license: mit", "license: MIT License")
    (src_copy / "README.md").write_text(card)  # a source card's license the Hub does not take
    out = tmp_path / "out"
    with pytest.raises(ConvertError, match=r"the Hub refuses this model card.s metadata .*license"):
        upload_to(src_copy, out)
    nothing_started(hub, out)


def test_commits_keep_under_the_hubs_rate(hub, eight, tmp_path, monkeypatch):
    """At most COMMITS_PER_HOUR commits in any RATE_WINDOW (here 4 in 3 s): a tight budget, which
    asks for a commit after each job, waits for the window and commits more at once."""
    from mla_convert.publish import hub_to_hub
    from mla_convert.publish.remote import Remote

    monkeypatch.setattr(hub_to_hub, "COMMITS_PER_HOUR", 4)
    monkeypatch.setattr(hub_to_hub, "RATE_WINDOW", 3.0)
    times = []
    commit = Remote.commit

    def timed(self, *args):
        oid = commit(self, *args)
        times.append(time.monotonic())
        return oid

    monkeypatch.setattr(Remote, "commit", timed)
    out = tmp_path / "out"
    budget = upload_to(eight, out, dry_run=True).disk_budget_min
    result = upload_to(eight, out, max_disk=budget)
    assert len(result.commits) == len(times) >= 5
    assert all(later - first >= 3.0 for first, later in zip(times, times[4:], strict=False))
    assert_plain_convert_and_upload_give_the_same_tree(hub, eight, tmp_path)
