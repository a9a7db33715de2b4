"""The output file's lifecycle (output.journal: hashed, checked, sent, committed) as its readers see
it: a file `convert --upload` committed to the Hub and deleted locally is not missing for verify's
integrity group, for publish.contents or for `upload`, which compares it with the branch instead
of reading it; one deleted without such a record still is."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from huggingface_hub import HfApi

from mla_convert import upload
from mla_convert.constants import JOURNAL_NAME, MANIFEST_NAME
from mla_convert.errors import UploadError
from mla_convert.output.journal import CHECKED, COMMITTED, SENT, Journal
from mla_convert.publish.contents import read_contents
from mla_convert.verification import verify

REPO = "org/tiny-lifecycle"
SHARD = "model-00002-of-00004.safetensors"
LAYER = "mla/layer-001.safetensors"


def listed(out: Path, rel: str) -> tuple[int, str]:
    meta = json.loads((out / MANIFEST_NAME).read_text())["files"][rel]
    return meta["size"], meta["sha256"]


def sent_and_deleted(out: Path, *rels: str, repo: str = REPO) -> None:
    """As `convert --upload` leaves them: journaled, checked, sent, committed, then deleted."""
    journal = Journal(out)
    journal.record(SHARD, [(rel, *listed(out, rel)) for rel in rels])
    for state in (CHECKED, SENT):
        journal.advance(rels, state)
    journal.advance(rels, COMMITTED, repo=repo, revision="main", commit="c" * 40)
    for rel in rels:
        (out / rel).unlink()


def integrity_failures(out: Path) -> list[str]:
    return [f.line() for f in verify(out).groups["integrity"].failures]


def test_verify_counts_a_committed_file_as_on_the_hub_and_a_deleted_one_as_missing(out, converted, tmp_path):
    committed = Path(shutil.copytree(out, tmp_path / "committed"))
    for rel in (SHARD, LAYER):
        (out / rel).unlink()
    assert any(f.startswith(f"[integrity/missing-file] {SHARD}:") for f in integrity_failures(out))
    assert any(f.check == "artifact" and f.file == LAYER for f in verify(out).failures())

    sent_and_deleted(committed, SHARD, LAYER)
    assert integrity_failures(committed) == []
    assert not any(f.check == "artifact" for f in verify(committed).failures())
    # Committed at another sha256 than the manifest lists: not this conversion's file, missing.
    Journal(committed).record(SHARD, [(SHARD, listed(committed, SHARD)[0], "0" * 64)])
    Journal(committed).advance([SHARD], COMMITTED, repo=REPO, revision="main", commit="d" * 40)
    assert any(f.startswith(f"[integrity/missing-file] {SHARD}:") for f in integrity_failures(committed))


def test_contents_read_the_lifecycle(out, converted):
    gone = Path(shutil.copytree(out, out.parent / "gone"))
    (gone / SHARD).unlink()
    with pytest.raises(UploadError, match=f"lacks {SHARD} that its manifest lists"):
        read_contents(gone)
    sent_and_deleted(out, SHARD, LAYER)
    contents = read_contents(out)  # the journal is this directory's own now: not an unlisted file
    assert {f.rel for f in contents.sent} == {SHARD, LAYER}
    assert all(f.sent_to.repo == REPO and f.sent_to.commit == "c" * 40 for f in contents.sent)
    assert contents.by_rel()[SHARD].sha256 == listed(converted["channel-fp8"], SHARD)[1]
    # Without the lifecycle the journal is a stray file (a run in progress), as before.
    other = out.parent / "plain"
    shutil.copytree(converted["channel-fp8"], other)
    (other / JOURNAL_NAME).write_text("")
    with pytest.raises(UploadError, match=f"holds {JOURNAL_NAME} that its manifest does not list"):
        read_contents(other)


def test_upload_of_a_directory_sent_by_convert_upload_compares_with_the_branch_and_reads_nothing_gone(
    hub, out, converted, tmp_path
):
    # The repo holds the whole conversion (as convert --upload leaves it), the directory its journal and the rest.
    upload(Path(shutil.copytree(converted["channel-fp8"], tmp_path / "whole")), REPO, create=True)
    sent_and_deleted(out, SHARD, LAYER, "config.json")  # a small file kept in git too: the journal says where
    hub.reset_requests()
    result = upload(out, REPO)
    assert result.uploaded_files == 0 and result.commits == () and result.skipped_files == result.files
    assert "before it was sent" in result.verified
    # Another repo does not hold them: refused in one line naming where they went, before any byte.
    HfApi().create_repo("org/other")
    with pytest.raises(UploadError, match=rf"{SHARD}: committed to {REPO} \(branch main\) by `convert --upload`"):
        upload(out, "org/other")
    assert hub.count(method="PUT") == 0
    assert [c.added for c in hub.commits if c.repo_id == "org/other"] == [[".gitattributes"]]
