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

import pytest

from mla_convert import convert, upload
from mla_convert.constants import JOURNAL_NAME, MANIFEST_NAME
from mla_convert.demo.specs import CheckpointSpec
from mla_convert.demo.synthetic import write_checkpoint
from mla_convert.errors import ConvertError
from mla_convert.settings import UploadOptions

REPO = "org/tiny-h2h"
WRITE = "hf_fake_write_token"


@pytest.fixture
def hub(fake_hub, monkeypatch):
    fake_hub.add_token(WRITE)
    monkeypatch.setenv("HF_TOKEN", WRITE)
    return fake_hub


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
    with DiskWatch(out) as watch:
        result = convert(eight, out, upload=REPO, upload_options=UploadOptions(create=True), max_disk=budget)
    assert_plain_convert_and_upload_give_the_same_tree(hub, eight, tmp_path)
    expected = repo_tree(hub, REPO)
    assert 0 < watch.peak <= budget < result.bytes_out
    assert result.disk_peak <= budget and result.disk_budget == budget
    assert result.uploaded_files == len(expected) and result.checked_files == 8 + 4  # shards and artifact files
    assert len(result.commits) >= 2 and set(result.stage_seconds) == {"download", "convert", "check", "upload"}
    # What the directory keeps: the manifest, the journal, the small files; the data went up.
    left = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert not any(p.endswith(".safetensors") for p in left) and MANIFEST_NAME in left and JOURNAL_NAME in left
    # The last commit is the one that makes it a model; no earlier one holds config.json.
    commits = [c for c in hub.commits if c.repo_id == REPO and c.summary != "initial commit"]
    assert "config.json" in commits[-1].added and all("config.json" not in c.added for c in commits[:-1])
    assert all(len(c.added) < 100 for c in commits)
    assert json.loads((out / MANIFEST_NAME).read_text())["status"] == "complete"


SOURCE = "deepseek-ai/Tiny-R1-eight"


def test_a_hub_source_streamed_within_the_budget(hub, eight, tmp_path):
    hub.add_repo(SOURCE, eight)
    out = tmp_path / "out"
    plan = convert(SOURCE, out, upload=REPO, upload_options=UploadOptions(create=True), dry_run=True)
    assert plan.disk_budget_min > plan.bytes_out / 8  # a job's source shards count now
    budget = plan.disk_budget_min + 500_000
    with DiskWatch(out) as watch:
        result = convert(SOURCE, out, upload=REPO, upload_options=UploadOptions(create=True), max_disk=budget)
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
