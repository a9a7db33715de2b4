"""mla_convert.output.journal: the journal of finished shard jobs and of each output file's
lifecycle (a torn last line ignored), the removal of an interrupted run's hidden partial files,
the refusals of a --resume, and which journaled or manifested jobs a resume may keep (on disk, or
on the Hub's branch), deleting nothing."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from mla_convert.constants import JOURNAL_NAME, MANIFEST_NAME
from mla_convert.errors import OutputError
from mla_convert.output.journal import (
    CHECKED,
    COMMITTED,
    HASHED,
    SENT,
    FileRecord,
    Journal,
    check_resumable,
    remove_partials,
    resumable_jobs,
)
from mla_convert.plan.planner import make_plan
from mla_convert.settings import Options
from mla_convert.source.checkpoint import open_source
from support.checkpoints import SHARD1, SHARD2
from support.edits import edit_json

OPTIONS = {"format": "channel-fp8", "target": "gaudi3", "ignore": []}


def files_of(root: Path, *rels: str) -> list[tuple[str, int, str]]:
    """(relative path, size, sha256) of files under `root`, as a job records them."""
    out = []
    for rel in rels:
        data = (root / rel).read_bytes()
        out.append((rel, len(data), hashlib.sha256(data).hexdigest()))
    return out


def write_manifest(out: Path, **fields) -> None:
    doc = {"tool": "mla-convert", "status": "incomplete", "options": OPTIONS, "source_fingerprint": "f" * 64}
    (out / MANIFEST_NAME).write_text(json.dumps(doc | fields))


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ---- the journal -----------------------------------------------------------------------------------


def test_recorded_jobs_are_read_back(tmp_path):
    journal = Journal(tmp_path)
    assert journal.entries() == {}
    a = [("model-1.safetensors", 10, "a" * 64), ("mla/layer-000.safetensors", 20, "b" * 64)]
    journal.record("model-1.safetensors", a)
    journal.record("model-2.safetensors", [("model-2.safetensors", 30, "c" * 64)])
    assert Journal(tmp_path).entries() == {
        "model-1.safetensors": a,
        "model-2.safetensors": [("model-2.safetensors", 30, "c" * 64)],
    }
    assert (tmp_path / JOURNAL_NAME).is_file()
    journal.remove()
    journal.remove()  # twice: no error
    assert not (tmp_path / JOURNAL_NAME).exists() and Journal(tmp_path).entries() == {}


def test_a_torn_last_line_and_stray_lines_are_ignored(tmp_path):
    journal = Journal(tmp_path)
    journal.record("one", [("one", 1, "x")])
    with open(tmp_path / JOURNAL_NAME, "a") as f:
        f.write('{"job": "two", "files": [["two", 2, "y"]]}\n')
        f.write('["not", "an", "entry"]\n{"job": "three"}\n{"job": "four", "files": [["four", "many", "z"]]}\n')
        f.write('{"job": "five", "files": [["fi')  # killed mid-append
    assert Journal(tmp_path).entries() == {"one": [("one", 1, "x")], "two": [("two", 2, "y")]}


def test_a_job_recorded_twice_keeps_its_last_files(tmp_path):
    journal = Journal(tmp_path)
    journal.record("j", [("j", 1, "old")])
    journal.record("j", [("j", 2, "new")])
    assert journal.entries() == {"j": [("j", 2, "new")]}


def test_a_journal_that_cannot_be_written_is_an_output_error_naming_it(tmp_path):
    journal = Journal(tmp_path / "gone")
    with pytest.raises(OutputError, match="cannot record progress") as e:
        journal.record("j", [("j", 1, "x")])
    assert str(tmp_path / "gone" / JOURNAL_NAME) in str(e.value)


# ---- remove_partials ---------------------------------------------------------------------------------


def test_remove_partials_removes_only_hidden_partial_files_and_counts_them(tmp_path):
    (tmp_path / "mla" / "deep").mkdir(parents=True)
    partials = [f".{SHARD1}.partial", "mla/.layer-001.safetensors.partial", "mla/deep/.config.json.partial"]
    others = ["visible.partial", ".hidden", ".x.partial.bak", SHARD1, "mla/layer-000.safetensors", "partial"]
    for rel in partials + others:
        (tmp_path / rel).write_bytes(b"x")
    assert remove_partials(tmp_path) == 3
    assert sorted(tree(tmp_path)) == sorted(others)
    assert remove_partials(tmp_path) == 0


# ---- check_resumable -----------------------------------------------------------------------------------


def test_check_resumable_returns_the_manifest_of_the_same_conversion(tmp_path):
    write_manifest(tmp_path)
    manifest = check_resumable(tmp_path, OPTIONS, "f" * 64)
    assert manifest["status"] == "incomplete" and manifest["options"] == OPTIONS


def test_no_manifest_cannot_be_resumed(tmp_path):
    with pytest.raises(OutputError, match=f"no {MANIFEST_NAME}; this is not an mla-convert output"):
        check_resumable(tmp_path, OPTIONS, "f" * 64)


@pytest.mark.parametrize("content", [b"{truncated", b"\xff\xfe not text"])
def test_an_unreadable_manifest_cannot_be_resumed(tmp_path, content):
    (tmp_path / MANIFEST_NAME).write_bytes(content)
    with pytest.raises(OutputError, match=r"unreadable .*; cannot resume, start over with --overwrite") as e:
        check_resumable(tmp_path, OPTIONS, "f" * 64)
    assert str(tmp_path / MANIFEST_NAME) in str(e.value)


def test_a_manifest_that_is_a_directory_cannot_be_resumed(tmp_path):
    (tmp_path / MANIFEST_NAME).mkdir()
    with pytest.raises(OutputError, match="unreadable"):
        check_resumable(tmp_path, OPTIONS, "f" * 64)


def test_a_manifest_that_is_not_a_json_object_cannot_be_resumed(tmp_path):
    (tmp_path / MANIFEST_NAME).write_text("[]")
    with pytest.raises(OutputError, match="not an mla-convert manifest"):
        check_resumable(tmp_path, OPTIONS, "f" * 64)


def test_other_options_cannot_be_resumed_and_each_difference_is_named(tmp_path):
    write_manifest(tmp_path)
    asked = OPTIONS | {"format": "bf16", "ignore": ["lm_head"]}
    with pytest.raises(OutputError, match="cannot resume with different options") as e:
        check_resumable(tmp_path, asked, "f" * 64)
    assert "format recorded 'channel-fp8', requested 'bf16'" in str(e.value)
    assert "ignore recorded [], requested ['lm_head']" in str(e.value)
    assert "target" not in str(e.value)


def test_another_source_cannot_be_resumed(tmp_path):
    write_manifest(tmp_path)
    with pytest.raises(OutputError, match="different source") as e:
        check_resumable(tmp_path, OPTIONS, "0123456789ab" + "0" * 52)
    assert "ffffffffffff..." in str(e.value) and "0123456789ab..." in str(e.value)


# ---- resumable_jobs ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def jobs(tiny_src) -> dict[str, list[str]]:
    """Each shard job of the tiny checkpoint's conversion -> its files (the plan's job_outputs)."""
    return make_plan(open_source(tiny_src), Options()).job_outputs()


def test_a_complete_manifest_keeps_every_intact_job(out, load_json, jobs):
    manifest = load_json(out / MANIFEST_NAME)
    assert manifest["status"] == "complete"
    kept = resumable_jobs(out, manifest, jobs)
    assert kept == {job: files_of(out, *rels) for job, rels in jobs.items()}


def test_a_job_with_a_damaged_or_missing_file_is_redone(out, load_json, jobs):
    manifest = load_json(out / MANIFEST_NAME)
    assert len(jobs[SHARD1]) > 1 and len(jobs[SHARD2]) > 1  # each with a shard and an MLA layer file
    layer = out / jobs[SHARD2][-1]
    data = bytearray(layer.read_bytes())
    data[len(data) // 2] ^= 0x10  # same size, other bytes
    layer.write_bytes(bytes(data))
    assert set(resumable_jobs(out, manifest, jobs)) == set(jobs) - {SHARD2}
    (out / jobs[SHARD1][-1]).unlink()
    assert set(resumable_jobs(out, manifest, jobs)) == set(jobs) - {SHARD1, SHARD2}


def test_a_file_of_another_size_is_redone(out, load_json, jobs):
    manifest = load_json(out / MANIFEST_NAME)
    with open(out / SHARD1, "ab") as f:
        f.write(b"\0")
    assert set(resumable_jobs(out, manifest, jobs)) == set(jobs) - {SHARD1}


def test_an_incomplete_manifest_keeps_only_the_journaled_jobs(out, load_json, jobs):
    edit_json(out / MANIFEST_NAME, lambda m: m.update(status="incomplete"))
    manifest = load_json(out / MANIFEST_NAME)
    assert resumable_jobs(out, manifest, jobs) == {}  # its file list is not trusted: nothing journaled yet
    Journal(out).record(SHARD2, files_of(out, *jobs[SHARD2]))
    assert resumable_jobs(out, manifest, jobs) == {SHARD2: files_of(out, *jobs[SHARD2])}


def test_a_journal_entry_that_no_longer_matches_is_not_kept(out, load_json, jobs):
    edit_json(out / MANIFEST_NAME, lambda m: m.update(status="incomplete"))
    manifest = load_json(out / MANIFEST_NAME)
    recorded = files_of(out, *jobs[SHARD1])
    recorded[1] = (recorded[1][0], recorded[1][1], "0" * 64)  # written, then changed after it was journaled
    Journal(out).record(SHARD1, recorded)
    assert resumable_jobs(out, manifest, jobs) == {}


def test_a_job_must_have_all_its_files_recorded(out, load_json, jobs):
    edit_json(out / MANIFEST_NAME, lambda m: m.update(status="incomplete"))
    manifest = load_json(out / MANIFEST_NAME)
    Journal(out).record(SHARD1, files_of(out, SHARD1))  # its MLA layers not recorded
    assert resumable_jobs(out, manifest, jobs) == {}
    assert resumable_jobs(out, manifest, {"no-files": []}) == {}


def test_resumable_jobs_deletes_and_changes_nothing(out, load_json, jobs):
    manifest = load_json(out / MANIFEST_NAME)
    (out / SHARD2).write_bytes(b"damaged")
    (out / f".{SHARD1}.partial").write_bytes(b"half")
    Journal(out).record(SHARD1, files_of(out, *jobs[SHARD1]))
    before = tree(out)
    resumable_jobs(out, manifest, jobs | {"missing.safetensors": ["missing.safetensors"]})
    assert tree(out) == before


def test_a_record_after_a_torn_last_line_is_a_line_of_its_own(tmp_path):
    """A run killed in the middle of an append leaves half a line; the next run's first record must
    not be glued to it (and lost with it)."""
    journal = Journal(tmp_path)
    journal.record("a.safetensors", [("a.safetensors", 1, "0" * 64)])
    with open(journal.path, "a") as f:
        f.write('{"job": "b.safetensors", "fi')  # killed mid-append
    journal.record("c.safetensors", [("c.safetensors", 3, "2" * 64)])
    assert set(journal.entries()) == {"a.safetensors", "c.safetensors"}


def test_a_journal_that_cannot_be_read_records_nothing(tmp_path):
    (tmp_path / ".mla-convert-journal.jsonl").mkdir()
    assert Journal(tmp_path).entries() == {}


# ---- the output file's lifecycle -------------------------------------------------------------------


def test_each_file_goes_through_its_states_in_order_and_a_commit_is_recorded_with_where(tmp_path):
    journal = Journal(tmp_path)
    a, b = ("model-1.safetensors", 10, "a" * 64), ("mla/layer-000.safetensors", 20, "b" * 64)
    journal.record("model-1.safetensors", [a, b])
    assert {r.state for r in journal.files().values()} == {HASHED}
    journal.advance([a[0], b[0]], CHECKED)
    journal.advance([a[0]], SENT)
    journal.advance([a[0]], COMMITTED, repo="org/x", revision="main", commit="c" * 40)
    files = Journal(tmp_path).files()
    assert files[a[0]] == FileRecord(*a, COMMITTED, "model-1.safetensors", "org/x", "main", "c" * 40)
    assert files[b[0]] == FileRecord(*b, CHECKED, "model-1.safetensors")
    assert files[a[0]].on_hub and not files[b[0]].on_hub
    assert files[b[0]].reached(HASHED) and files[b[0]].reached(CHECKED) and not files[b[0]].reached(SENT)
    # The job view is what it always was: a job and its files.
    assert journal.entries() == {"model-1.safetensors": [a, b]}


def test_a_file_written_again_starts_over_and_a_state_of_a_file_never_written_is_ignored(tmp_path):
    journal = Journal(tmp_path)
    journal.record("j", [("j", 1, "old")])
    journal.advance(["j"], CHECKED)
    journal.advance(["nowhere"], SENT)
    journal.record("j", [("j", 2, "new")])  # the job redone: its file is another one now
    assert journal.files() == {"j": FileRecord("j", 2, "new", HASHED, "j")}
    journal.record(None, [("config.json", 3, "c")])  # the last stage's files belong to no job
    assert journal.files()["config.json"].job is None and "config.json" not in journal.entries()


def test_a_torn_state_line_is_ignored_and_the_next_record_is_a_line_of_its_own(tmp_path):
    journal = Journal(tmp_path)
    journal.record("j", [("j", 1, "x")])
    with open(journal.path, "a") as f:
        f.write('{"state": "committed", "paths": ["j"], "rep')  # killed mid-append
    journal.advance(["j"], CHECKED)
    with open(journal.path, "a") as f:
        f.write('{"state": "bogus", "paths": ["j"]}\n{"state": "sent", "paths": "j"}\n')
    assert journal.files()["j"].state == CHECKED


def test_only_checked_sent_and_committed_are_states_a_file_advances_to(tmp_path):
    with pytest.raises(ValueError, match="hashed"):
        Journal(tmp_path).advance(["j"], HASHED)
    assert not (tmp_path / JOURNAL_NAME).exists()


def test_a_job_whose_files_are_on_the_hub_is_kept_without_them_on_disk(out, load_json, jobs):
    edit_json(out / MANIFEST_NAME, lambda m: m.update(status="incomplete"))
    manifest = load_json(out / MANIFEST_NAME)
    recorded = files_of(out, *jobs[SHARD1])
    Journal(out).record(SHARD1, recorded)
    for rel, _, _ in recorded:
        (out / rel).unlink()  # committed, then deleted here
    held = {rel: (size, sha) for rel, size, sha in recorded}
    assert resumable_jobs(out, manifest, jobs) == {}
    assert resumable_jobs(out, manifest, jobs, held=held) == {SHARD1: recorded}
    # On the Hub at another sha256 (or size): not this run's file, redone.
    other = held | {recorded[0][0]: (recorded[0][1], "0" * 64)}
    assert resumable_jobs(out, manifest, jobs, held=other) == {}
    # Half on the Hub, half on disk, both as recorded: kept.
    Journal(out).record(SHARD2, files_of(out, *jobs[SHARD2]))
    half = files_of(out, *jobs[SHARD2])
    (out / half[0][0]).unlink()
    kept = resumable_jobs(out, manifest, jobs, held=held | {half[0][0]: half[0][1:]})
    assert kept == {SHARD1: recorded, SHARD2: half}
