"""mla_convert.output.out_dir: where --out may be, whether this process can write there, how an
earlier mla-convert output is recognised, what --overwrite may delete of it (only the tool's own
files: any other file makes it refuse), and that the deletion removes exactly that."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import types
from pathlib import Path

import pytest

from mla_convert.constants import JOURNAL_NAME, MANIFEST_NAME, STAGING_DIR_NAME
from mla_convert.errors import OutputError
from mla_convert.output import out_dir as out_dir_mod
from mla_convert.output.journal import Journal
from mla_convert.output.out_dir import (
    Earlier,
    check_location,
    check_writable,
    disk_free,
    earlier_output,
    is_earlier_output,
    same_filesystem,
)
from support.checkpoints import SHARD1, SHARD2


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def write(root: Path, *rels: str, data: bytes = b"x") -> None:
    for rel in rels:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)


def recorded(out: Path, *rels: str) -> list[tuple[str, int, str]]:
    return [(r, (out / r).stat().st_size, hashlib.sha256((out / r).read_bytes()).hexdigest()) for r in rels]


@pytest.fixture
def earlier(converted, tmp_path) -> Path:
    """A private copy of a complete bf16 conversion of the tiny checkpoint."""
    return Path(shutil.copytree(converted["bf16"], tmp_path / "out"))


# ---- check_location -------------------------------------------------------------------------------


def test_out_may_not_be_the_source_or_inside_it(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for out in (src, src / "out", src / "a" / "b"):  # those below src need not exist yet
        with pytest.raises(OutputError, match="--out is the source or inside it") as e:
            check_location(out, src)
        assert str(out) in str(e.value) and str(src) in str(e.value)


def test_out_may_not_contain_the_source(tmp_path):
    with pytest.raises(OutputError, match="contains the source"):
        check_location(tmp_path, tmp_path / "models" / "src")


def test_out_beside_the_source_is_fine_even_with_a_name_that_starts_the_same(tmp_path):
    (tmp_path / "src").mkdir()
    for out in (tmp_path / "src-converted", tmp_path / "sr", tmp_path / "other" / "src"):
        check_location(out, tmp_path / "src")


def test_the_source_reached_through_a_symlink_is_still_the_source(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "alias").symlink_to(tmp_path / "src", target_is_directory=True)
    with pytest.raises(OutputError, match="inside it"):
        check_location(tmp_path / "alias" / "out", tmp_path / "src")
    with pytest.raises(OutputError, match="inside it"):
        check_location(tmp_path / "src" / "out", tmp_path / "alias")


# ---- check_writable -------------------------------------------------------------------------------


def test_out_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(OutputError, match="exists and is not a directory"):
        check_writable(tmp_path / "f")


def test_a_new_out_is_checked_in_its_nearest_existing_folder_and_not_created(tmp_path, monkeypatch):
    asked = []
    real = os.access
    monkeypatch.setattr(out_dir_mod.os, "access", lambda p, mode: asked.append((Path(p), mode)) or real(p, mode))
    check_writable(tmp_path / "a" / "b" / "c")
    assert asked == [(tmp_path, os.W_OK | os.X_OK)]
    assert not (tmp_path / "a").exists()


def test_the_check_refuses_exactly_where_a_file_cannot_be_created(tmp_path):
    """A folder of mode 0o555: a user cannot create a file in it, root can; the check agrees with
    what actually happens either way."""
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        try:
            (locked / "probe").write_text("x")
            (locked / "probe").unlink()
            can_write = True
        except PermissionError:
            can_write = False
        for out in (locked, locked / "new"):
            if can_write:
                check_writable(out)
            else:
                with pytest.raises(OutputError, match=f"no permission to write in {locked}"):
                    check_writable(out)
    finally:
        locked.chmod(0o755)


def test_no_permission_is_named_with_the_folder_that_refuses(tmp_path, monkeypatch):
    monkeypatch.setattr(out_dir_mod.os, "access", lambda p, mode: False)
    with pytest.raises(OutputError) as e:
        check_writable(tmp_path / "new")
    why = f"cannot write the output: no permission to write in {tmp_path}; pick another --out"
    assert str(e.value) == f"{tmp_path / 'new'}: {why}"


def test_a_read_only_filesystem_is_named_as_such(tmp_path, monkeypatch):
    monkeypatch.setattr(out_dir_mod.os, "access", lambda p, mode: False)
    monkeypatch.setattr(out_dir_mod.os, "statvfs", lambda p: types.SimpleNamespace(f_flag=os.ST_RDONLY))
    with pytest.raises(OutputError, match=f"{tmp_path} is on a read-only filesystem; pick another --out"):
        check_writable(tmp_path / "new")


def test_a_filesystem_that_cannot_be_asked_is_taken_for_a_permission_problem(tmp_path, monkeypatch):
    def statvfs_fails(path):
        raise OSError("not supported")

    monkeypatch.setattr(out_dir_mod.os, "access", lambda p, mode: False)
    monkeypatch.setattr(out_dir_mod.os, "statvfs", statvfs_fails)
    with pytest.raises(OutputError, match="no permission to write in"):
        check_writable(tmp_path / "new")


# ---- recognising an earlier output ----------------------------------------------------------------


def test_what_marks_an_earlier_output(tmp_path):
    marks = {
        "manifest": lambda d: (d / MANIFEST_NAME).write_text(json.dumps({"tool": "mla-convert"})),
        "journal": lambda d: (d / JOURNAL_NAME).write_text(""),
        "staging": lambda d: (d / STAGING_DIR_NAME).mkdir(),
    }
    not_marks = {
        "another tool's manifest": lambda d: (d / MANIFEST_NAME).write_text(json.dumps({"tool": "other"})),
        "a damaged manifest": lambda d: (d / MANIFEST_NAME).write_text("{"),
        "a manifest that is a list": lambda d: (d / MANIFEST_NAME).write_text('["mla-convert"]'),
        "a file named like the staging folder": lambda d: (d / STAGING_DIR_NAME).write_text(""),
        "shards alone": lambda d: write(d, SHARD1, "config.json"),
    }
    for expected, cases in ((True, marks), (False, not_marks)):
        for what, make in cases.items():
            d = tmp_path / what.replace(" ", "-").replace("'", "")
            d.mkdir()
            make(d)
            assert is_earlier_output(d) is expected, what


def test_a_complete_earlier_output_is_deleted_whole(earlier):
    files = tree(earlier)
    found = earlier_output(earlier, writes=())
    assert set(found.files) == set(files) and found.nbytes == sum(map(len, files.values()))
    assert tree(earlier) == files  # found, not deleted
    found.delete()
    assert list(earlier.iterdir()) == []


def test_a_directory_that_is_not_an_earlier_output_is_refused(tmp_path):
    write(tmp_path, "notes.txt", "b.txt", SHARD1)
    with pytest.raises(OutputError, match="is not one") as e:
        earlier_output(tmp_path, writes=(SHARD1, "notes.txt"))
    assert "it holds b.txt and 2 other files" in str(e.value)


def test_a_file_of_the_users_is_named_and_nothing_is_deleted(earlier):
    write(earlier, "keep/thesis.txt", "mla/my-notes.txt", "mla/layer-001.safetensors.bak")
    before = tree(earlier)
    with pytest.raises(OutputError, match="which mla-convert did not write") as e:
        earlier_output(earlier, writes=())
    assert "keep/thesis.txt and 2 other files" in str(e.value)
    assert tree(earlier) == before


def test_an_interrupted_run_is_recognised_from_its_journal_and_what_it_writes(tmp_path):
    """Killed mid-run: a journaled shard, a shard and an MLA layer written but not journaled yet,
    and hidden partial files. All of it is the tool's."""
    out = tmp_path / "out"
    write(out, SHARD1, SHARD2, "mla/layer-000.safetensors", "mla/layer-007.safetensors")
    write(out, f".{SHARD1}.partial", "mla/.layer-002.safetensors.partial", "mla/.manifest.json.partial")
    Journal(out).record(SHARD1, recorded(out, SHARD1, "mla/layer-000.safetensors"))
    found = earlier_output(out, writes=(SHARD2,))
    assert set(found.files) == set(tree(out))
    assert found.nbytes == sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    with pytest.raises(OutputError, match=SHARD2):
        earlier_output(out, writes=())  # not journaled and not among the writes: not provably the tool's


def test_a_stream_runs_staging_is_deleted_as_a_whole(tmp_path):
    out = tmp_path / "out"
    write(out, f"{STAGING_DIR_NAME}/{SHARD1}", f"{STAGING_DIR_NAME}/sub/tokenizer.json")
    found = earlier_output(out, writes=())
    assert found.files == ()
    found.delete()
    assert list(out.iterdir()) == []


def test_a_stream_runs_staging_bytes_are_counted_once(tmp_path):
    out = tmp_path / "out"
    write(out, f"{STAGING_DIR_NAME}/{SHARD1}", data=b"x" * 1000)
    write(out, SHARD2, data=b"y" * 10)
    Journal(out).record(SHARD2, recorded(out, SHARD2))
    on_disk = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    assert earlier_output(out, writes=()).nbytes == on_disk


def test_a_symlink_is_deleted_as_itself_never_its_target(earlier, tmp_path):
    precious = tmp_path / "precious.txt"
    precious.write_text("the user's")
    (earlier / "README.md").unlink()
    (earlier / "README.md").symlink_to(precious)
    found = earlier_output(earlier, writes=("README.md",))
    assert "README.md" in found.files
    found.delete()
    assert not os.path.lexists(earlier / "README.md") and precious.read_text() == "the user's"


# ---- Earlier.delete ----------------------------------------------------------------------------------


def test_delete_removes_only_the_listed_files_and_the_folders_they_leave_empty(tmp_path):
    write(tmp_path, "a/b/c/one", "a/b/two", "a/keep", "x/y/three", "top", "other")
    Earlier(tmp_path, ("a/b/c/one", "a/b/two", "x/y/three", "top", "gone-already"), 0).delete()
    assert sorted(tree(tmp_path)) == ["a/keep", "other"]
    assert not (tmp_path / "a" / "b").exists() and not (tmp_path / "x").exists()
    assert tmp_path.is_dir()


def test_delete_keeps_a_folder_that_holds_an_empty_folder_of_the_users(tmp_path):
    write(tmp_path, "mla/layer-000.safetensors")
    (tmp_path / "mla" / "empty-but-mine").mkdir()
    Earlier(tmp_path, ("mla/layer-000.safetensors",), 0).delete()
    assert (tmp_path / "mla" / "empty-but-mine").is_dir()


# ---- free space and filesystems ------------------------------------------------------------------------


def test_free_space_is_asked_of_the_nearest_existing_folder(tmp_path, monkeypatch):
    asked = []
    monkeypatch.setattr(
        out_dir_mod.shutil, "disk_usage", lambda p: asked.append(Path(p)) or types.SimpleNamespace(free=123)
    )
    assert disk_free(tmp_path / "not" / "yet") == 123 and asked == [tmp_path]


def test_same_filesystem_for_paths_that_do_not_exist_yet(tmp_path):
    assert same_filesystem(tmp_path / "a", tmp_path / "b" / "c")
    assert not same_filesystem(tmp_path / "a", Path("/proc/no-such-entry"))  # procfs: always its own
