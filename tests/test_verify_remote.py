"""`mla-convert verify OWNER/NAME`: a conversion published on the (fake) Hub with `mla-convert upload`,
checked there with the real huggingface_hub client: without --download from the Hub's sizes and
sha256 (no model data downloaded); with --download through every check of a local verify, within a
disk budget; a changed, missing or extra file fails naming it; errors are one line, exit 2."""

import json
import os
import shutil
from pathlib import Path

import pytest
from huggingface_hub import HfApi
from typer.testing import CliRunner

import mla_convert
from mla_convert.cli.app import app
from mla_convert.constants import MANIFEST_NAME
from mla_convert.errors import VerificationError

REPO = "org/tiny-r1-channel-fp8"
SHARD = "model-00002-of-00004.safetensors"
runner = CliRunner()


@pytest.fixture
def published(hub, out) -> Path:
    """The tiny channel-FP8 conversion, uploaded to REPO by `mla-convert upload`; the local copy."""
    mla_convert.upload(out, REPO, create=True)
    hub.reset_requests()
    return out


def verify(*args) -> tuple[int, dict | None, str]:
    res = runner.invoke(app, ["verify", *map(str, args), "--json"])
    report = json.loads(res.stdout) if res.exit_code in (0, 1) else None
    return res.exit_code, report, res.stderr


def failure_lines(report: dict) -> list[str]:
    return [f["message"] for g in report["groups"].values() for f in g["failures"]]


def one_error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


def shard_gets(hub) -> list[str]:
    return [r.filename for r in hub.requests if r.method == "GET" and r.kind == "resolve" and r.range is None
            and r.filename.endswith(".safetensors")]  # fmt: skip


# --- a published conversion passes ----------------------------------------------------------------


def test_a_published_conversion_passes_without_downloading_its_data(published):
    code, report, stderr = verify(REPO)
    assert code == 0, stderr
    groups = report["groups"]
    manifest = json.loads((published / MANIFEST_NAME).read_text())
    # Each listed file: present, its size, its sha256; the status; the card's fields.
    assert groups["integrity"]["checked"] >= 1 + 3 * len(manifest["files"]) and groups["integrity"]["failed"] == 0
    assert {g: v["skipped"] is not None for g, v in groups.items()} == {
        "structure": True, "integrity": False, "values": True, "source": True, "mla": True,
    }  # fmt: skip
    assert report["dir"].startswith(f"{REPO} (main, commit ") and report["format"] == "channel-fp8"


def test_no_model_data_is_downloaded(published, hub):
    code, _, stderr = verify(REPO)
    assert code == 0, stderr
    got = {r.filename for r in hub.requests if r.method == "GET" and r.kind == "resolve"}
    assert got and not any(name.endswith(".safetensors") for name in got)
    assert MANIFEST_NAME in got and "README.md" in got and "config.json" in got


def test_the_library_call_and_a_revision(published, hub):
    report = mla_convert.verify(REPO)
    assert report.ok and report.exit_code == 0
    HfApi().create_branch(REPO, branch="v1")
    assert mla_convert.verify(REPO, revision="v1").ok
    with pytest.raises(VerificationError, match="revision 'v9' not found"):
        mla_convert.verify(REPO, revision="v9")


# --- a changed, missing or extra file fails, naming it -------------------------------------------


def test_a_changed_shard_fails_naming_it(published, tmp_path):
    data = bytearray((published / SHARD).read_bytes())
    data[-1] ^= 0xFF  # same size, other bytes
    HfApi().upload_file(path_or_fileobj=bytes(data), path_in_repo=SHARD, repo_id=REPO)
    code, report, _ = verify(REPO)
    assert code == 1
    (line,) = failure_lines(report)
    assert line.startswith(f"[integrity/sha256] {SHARD}: expected ") and "(the Hub's record)" in line


def test_a_changed_small_file_fails_naming_it(published):
    config = json.loads((published / "config.json").read_text())
    config["rope_theta"] = 1
    HfApi().upload_file(path_or_fileobj=json.dumps(config).encode(), path_in_repo="config.json", repo_id=REPO)
    code, report, _ = verify(REPO)
    assert code == 1
    assert any(ln.startswith("[integrity/size] config.json") for ln in failure_lines(report))
    assert any(
        ln.startswith("[integrity/sha256] config.json") and "(of its bytes)" in ln for ln in failure_lines(report)
    )


def test_a_missing_file_fails_naming_it(published):
    HfApi().delete_file("mla/layer-001.safetensors", repo_id=REPO)
    code, report, _ = verify(REPO)
    assert code == 1
    (line,) = failure_lines(report)
    assert line.startswith("[integrity/missing-file] mla/layer-001.safetensors: ") and "not on the branch" in line


def test_an_extra_file_fails_naming_it(published):
    HfApi().upload_file(path_or_fileobj=b"notes\n", path_in_repo="notes/extra.txt", repo_id=REPO)
    code, report, _ = verify(REPO)
    assert code == 1
    (line,) = failure_lines(report)
    assert line.startswith("[integrity/unlisted-file] notes/extra.txt: ")


def test_a_card_that_says_another_format_fails(published):
    card = (published / "README.md").read_text().replace("  format: channel-fp8\n", "  format: bf16\n", 1)
    assert card != (published / "README.md").read_text()
    HfApi().upload_file(path_or_fileobj=card.encode(), path_in_repo="README.md", repo_id=REPO)
    code, report, _ = verify(REPO)
    assert code == 1
    lines = failure_lines(report)
    assert any(ln.startswith("[integrity/sha256] README.md") for ln in lines)
    assert any(ln.startswith("[integrity/card] README.md") and "format" in ln for ln in lines)  # its metadata read


# --- --download: every check of a local verify, within a disk budget ------------------------------


def test_download_runs_every_check_of_a_local_verify(published, tiny_src, hub):
    local = mla_convert.verify(published, source=tiny_src)
    notices = []
    report = mla_convert.verify(REPO, download=True, source=tiny_src, notice=notices.append)
    assert report.ok, [f.line() for f in report.failures()]
    assert {g: v.checked for g, v in report.groups.items()} == {g: v.checked for g, v in local.groups.items()}
    assert report.tensors == local.tensors and report.mla_layers == local.mla_layers
    assert all(v.skipped is None for v in report.groups.values())
    shards = sorted(
        p for p in json.loads((published / MANIFEST_NAME).read_text())["files"] if p.endswith(".safetensors")
    )
    assert sorted(shard_gets(hub)) == shards  # each data file downloaded once
    (line,) = notices
    assert line.startswith("downloaded ") and "on disk at once" in line


def test_download_stays_within_the_budget_or_refuses_before_the_first_byte(published, hub, monkeypatch):
    from mla_convert.verification import remote

    sizes = {p.relative_to(published).as_posix(): p.stat().st_size for p in published.rglob("*") if p.is_file()}
    small = sum(s for rel, s in sizes.items() if not rel.endswith(".safetensors"))
    largest = max(s for rel, s in sizes.items() if rel.endswith(".safetensors"))
    code, _, stderr = verify(REPO, "--download", "--max-disk", "1000")
    line = one_error_line(stderr)
    assert code == 2 and "--max-disk 0.00 MB: checking" in line and "needs at least" in line
    assert shard_gets(hub) == []  # refused before any data

    on_disk = []  # what the work directory holds (allocated blocks) as each file is checked

    def measured(task, progress=None):
        root = Path(task.root)
        on_disk.append(sum(p.stat().st_blocks * 512 for p in root.rglob("*") if p.is_file()))
        return run_file_task(task, progress)

    run_file_task = remote.run_file_task
    monkeypatch.setattr(remote, "run_file_task", measured)
    budget = small + 2 * largest + 64 * 1024  # a shard and an MLA layer file at once, not the whole repo
    assert budget < sum(sizes.values()) / 2
    report = mla_convert.verify(REPO, download=True, max_disk=budget)
    assert report.ok, [f.line() for f in report.failures()]
    assert len(on_disk) == report.files and 0 < max(on_disk) <= budget


def test_download_fails_naming_a_changed_shard(published):
    data = bytearray((published / SHARD).read_bytes())
    data[-1] ^= 0xFF
    HfApi().upload_file(path_or_fileobj=bytes(data), path_in_repo=SHARD, repo_id=REPO)
    report = mla_convert.verify(REPO, download=True)
    assert not report.ok and report.exit_code == 1
    assert {(f.check, f.file) for f in report.failures() if f.group == "integrity"} == {("sha256", SHARD)}


def test_download_reads_each_header_as_the_file_holds_it(published):
    data = bytearray((published / SHARD).read_bytes())
    data[8:16] = b"{garbage"  # the header's first bytes: not JSON
    HfApi().upload_file(path_or_fileobj=bytes(data), path_in_repo=SHARD, repo_id=REPO)
    report = mla_convert.verify(REPO, download=True)
    assert report.exit_code == 1
    headers = [f for f in report.failures() if (f.group, f.check) == ("structure", "header")]
    assert [(f.file, "not JSON" in f.found) for f in headers] == [(SHARD, True)]


def test_download_with_another_source_is_one_line(published, family_checkpoints):
    code, _, stderr = verify(REPO, "--download", "--source", family_checkpoints.source("kimi-k2"))
    assert code == 2 and "this is not the source this directory was converted from" in one_error_line(stderr)


# --- what cannot run: one line, exit 2 ------------------------------------------------------------


def test_no_such_repo_no_network_no_manifest(hub, tmp_path, monkeypatch):
    code, _, stderr = verify("org/nothing-here")
    line = one_error_line(stderr)
    assert code == 2 and "org/nothing-here: no such directory here, and no such model repo on the Hub" in line

    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text("{}")
    hub.add_repo("org/plain", plain)
    code, _, stderr = verify("org/plain")
    assert code == 2 and f"not an mla-convert output: no {MANIFEST_NAME} on the branch" in one_error_line(stderr)

    code, _, stderr = verify("org/plain", "--source", tmp_path)
    assert code == 2 and "--source compares every tensor" in one_error_line(stderr)
    code, _, stderr = verify("org/plain", "--download", "--max-disk", "lots")
    assert code == 2 and "--max-disk 'lots': expected a size" in one_error_line(stderr)

    hub.stop()  # the network gone
    code, _, stderr = verify("org/plain")
    assert code == 2 and "cannot reach the Hub" in one_error_line(stderr)


def test_a_local_path_always_wins(published, converted, tmp_path, monkeypatch, hub):
    """A relative path that exists is the directory, even where the Hub has a repo of that name."""
    here = tmp_path / "cwd"
    shutil.copytree(converted["bf16"], here / REPO)
    monkeypatch.chdir(here)
    code, report, stderr = verify(REPO)
    assert code == 0, stderr
    assert report["dir"] == REPO and report["format"] == "bf16"
    assert hub.requests == []
    code, _, stderr = verify(REPO, "--download")
    assert code == 2 and "a local directory; --revision, --download and --max-disk are for a Hub repo" in stderr
    os.chdir(tmp_path)
