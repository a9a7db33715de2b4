"""mla_convert.output.preflight: before the first byte, what --out holds and what becomes of it
(used as it is, kept by --resume, replaced by --overwrite, or refused), the free-space numbers
of a run, the refusals they lead to, and the line logged before a Hub download."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from mla_convert.constants import MANIFEST_NAME, STAGING_DIR_NAME
from mla_convert.errors import OutputError
from mla_convert.output import out_dir as out_dir_mod
from mla_convert.output import preflight
from mla_convert.output.preflight import Conversion, OutputState, check_room, inspect_output, plan_line, space
from mla_convert.plan.planner import make_plan
from mla_convert.settings import Options, RunSettings
from mla_convert.source.checkpoint import open_source
from support.checkpoints import SHARD2
from support.edits import edit_json


def conversion_of(src_root: Path, options: Options = Options()) -> Conversion:  # noqa: B008 (frozen)
    """What the pipeline hands preflight for a conversion of the checkpoint in `src_root`."""
    plan = make_plan(open_source(src_root), options)
    return Conversion(plan.options.as_dict(), plan.source.fingerprint(), src_root, plan.job_outputs(), plan.writes())


@pytest.fixture(scope="module")
def conversion(tiny_src) -> Conversion:
    """The default (channel-fp8) conversion of the tiny checkpoint."""
    return conversion_of(tiny_src)


@pytest.fixture
def earlier(converted, tmp_path) -> Path:
    """A private copy of a complete channel-fp8 conversion of the tiny checkpoint."""
    return Path(shutil.copytree(converted["channel-fp8"], tmp_path / "out"))


def listing(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ---- inspect_output -----------------------------------------------------------------------------


def test_a_missing_or_empty_out_is_used_as_it_is_and_not_created_yet(conversion, tmp_path):
    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "new" / "deeper", tmp_path / "empty"):
        for settings in (RunSettings(), RunSettings(resume=True), RunSettings(overwrite=True)):
            state = inspect_output(conversion, out, settings)
            assert state == OutputState({}) and state.kept_bytes == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"] and not any((tmp_path / "empty").iterdir())


def test_a_directory_of_other_files_is_refused_and_left_alone(conversion, tmp_path):
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    for name in ("a.txt", "b.txt", "sub/c.txt"):
        (out / name).write_text(name)
    before = listing(out)
    for settings in (RunSettings(), RunSettings(resume=True)):
        with pytest.raises(OutputError, match="directory is not empty") as e:
            inspect_output(conversion, out, settings)
        assert "a.txt and 2 other files" in str(e.value) and "--overwrite" in str(e.value)
    with pytest.raises(OutputError, match="replaces only an earlier mla-convert output"):
        inspect_output(conversion, out, RunSettings(overwrite=True))
    assert listing(out) == before


def test_an_earlier_complete_output_is_replaced_only_with_overwrite(conversion, earlier):
    before = listing(earlier)
    with pytest.raises(OutputError, match="earlier conversion; pass --overwrite"):
        inspect_output(conversion, earlier, RunSettings())
    state = inspect_output(conversion, earlier, RunSettings(overwrite=True))
    assert state.kept == {} and set(state.earlier.files) == set(before)
    assert state.earlier.nbytes == sum(len(data) for data in before.values())
    assert listing(earlier) == before  # inspected, not deleted yet


def test_an_unfinished_output_asks_for_resume_or_overwrite(conversion, earlier):
    edit_json(earlier / MANIFEST_NAME, lambda m: m.update(status="incomplete"))
    with pytest.raises(OutputError, match="unfinished conversion; pass --resume to finish it, or --overwrite"):
        inspect_output(conversion, earlier, RunSettings())
    assert inspect_output(conversion, earlier, RunSettings(overwrite=True)).earlier is not None


def test_only_the_staging_of_a_stream_run_is_resumed_as_a_fresh_start(conversion, tmp_path):
    """A --stream run stopped before its manifest left only its downloads."""
    out = tmp_path / "out"
    (out / STAGING_DIR_NAME).mkdir(parents=True)
    (out / STAGING_DIR_NAME / SHARD2).write_bytes(b"x" * 100)
    assert inspect_output(conversion, out, RunSettings(resume=True)) == OutputState({})
    with pytest.raises(OutputError, match="unfinished conversion"):
        inspect_output(conversion, out, RunSettings())
    state = inspect_output(conversion, out, RunSettings(overwrite=True))
    assert state.earlier.files == ()  # the staging folder goes as a whole (test_out_dir.py: its bytes)


def test_resume_keeps_the_intact_jobs_removes_partials_and_deletes_nothing_else(conversion, earlier):
    damaged = earlier / SHARD2
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 1
    damaged.write_bytes(bytes(data))
    (earlier / f".{SHARD2}.partial").write_bytes(b"half")
    (earlier / "mla" / ".layer-002.safetensors.partial").write_bytes(b"half")
    said = []
    state = inspect_output(conversion, earlier, RunSettings(resume=True, status=said.append))
    assert set(state.kept) == set(conversion.job_outputs) - {SHARD2}
    for job, files in state.kept.items():
        assert [rel for rel, _, _ in files] == conversion.job_outputs[job]
        for rel, size, sha in files:
            assert (size, sha) == (len(b := (earlier / rel).read_bytes()), hashlib.sha256(b).hexdigest())
    assert state.kept_bytes == sum((earlier / rel).stat().st_size for f in state.kept.values() for rel, _, _ in f)
    assert not list(earlier.rglob("*.partial")) and damaged.read_bytes() == bytes(data)
    assert said and str(earlier) in said[0]


def test_resume_of_a_conversion_with_other_options_is_refused(tiny_src, earlier):
    with pytest.raises(OutputError, match="format recorded 'channel-fp8', requested 'bf16'"):
        inspect_output(conversion_of(tiny_src, Options(format="bf16")), earlier, RunSettings(resume=True))


def test_out_overlapping_the_source_is_refused_while_the_source_is_on_disk(conversion, tiny_src):
    for out in (tiny_src, tiny_src / "converted", tiny_src.parent):
        with pytest.raises(OutputError, match="--out"):
            inspect_output(conversion, out, RunSettings())
    hub_source = Conversion(conversion.options, conversion.fingerprint, None, conversion.job_outputs, conversion.writes)
    assert inspect_output(hub_source, tiny_src / "converted", RunSettings()) == OutputState({})


def test_out_that_is_a_file_is_refused(conversion, tmp_path):
    (tmp_path / "out").write_text("x")
    with pytest.raises(OutputError, match="exists and is not a directory"):
        inspect_output(conversion, tmp_path / "out", RunSettings())


# ---- space ----------------------------------------------------------------------------------------

SUMMARY = {"bytes_out": 7_000, "disk_required_stream": 9_000}


@pytest.fixture
def free(monkeypatch):
    """What the filesystems report free, faked per path: set `free[path] = bytes` (others: 10**12)."""
    reported: dict[Path, int] = {}
    monkeypatch.setattr(out_dir_mod, "disk_free", lambda path: reported.get(Path(path), 10**12))
    return reported


def test_space_of_a_local_source(tmp_path, free):
    free[tmp_path / "out"] = 5_000
    numbers = space(SUMMARY, tmp_path / "out", RunSettings(), OutputState({}), None, None)
    assert numbers == {"disk_required": 7_000, "disk_free": 5_000}
    streamed = space(SUMMARY, tmp_path / "out", RunSettings(stream=True), OutputState({}), None, None)
    assert streamed["disk_required"] == 9_000


def test_what_resume_keeps_is_not_needed_again(tmp_path, free):
    kept = {"a": [("a", 2_500, "x"), ("mla/layer-000.safetensors", 500, "y")]}
    numbers = space(SUMMARY, tmp_path, RunSettings(resume=True), OutputState(kept), None, None)
    assert numbers["disk_required"] == 4_000
    everything = {"a": [("a", 8_000, "x")]}  # more than needed (a new plan writes less): never below 0
    assert space(SUMMARY, tmp_path, RunSettings(), OutputState(everything), None, None)["disk_required"] == 0


def test_what_overwrite_frees_is_counted(conversion, earlier, free):
    state = inspect_output(conversion, earlier, RunSettings(overwrite=True))
    numbers = space(SUMMARY, earlier, RunSettings(overwrite=True), state, None, None)
    assert numbers["disk_freed_by_overwrite"] == sum(p.stat().st_size for p in earlier.rglob("*") if p.is_file())


def test_a_download_to_a_cache_on_the_same_filesystem_adds_to_what_out_needs(tmp_path, free):
    cache = tmp_path / "hf" / "hub"  # not there yet: its filesystem is that of tmp_path, as --out's
    numbers = space(SUMMARY, tmp_path / "out", RunSettings(), OutputState({}), 3_000, cache)
    assert numbers["disk_required"] == 10_000 and "cache_dir" not in numbers


def test_a_download_to_a_cache_elsewhere_gets_its_own_numbers(tmp_path, free, monkeypatch):
    cache, out = tmp_path / "cache", tmp_path / "out"
    monkeypatch.setattr(out_dir_mod, "same_filesystem", lambda a, b: False)
    free[cache], free[out] = 2_000, 50_000
    numbers = space(SUMMARY, out, RunSettings(), OutputState({}), 3_000, cache)
    assert numbers == {
        "disk_required": 7_000, "disk_free": 50_000,
        "cache_dir": str(cache), "cache_required": 3_000, "cache_free": 2_000,
    }  # fmt: skip


# ---- check_room ------------------------------------------------------------------------------------


def test_too_little_room_on_out_is_refused_naming_both_sizes(tmp_path):
    numbers = {"disk_required": 300_000_000, "disk_free": 120_000_000}
    with pytest.raises(OutputError) as e:
        check_room(numbers, tmp_path / "out", RunSettings())
    message = str(e.value)
    assert str(tmp_path / "out") in message and "not enough free space" in message
    assert "0.300 GB" in message and "0.120 GB free" in message and "--ignore-free-space" in message
    check_room(numbers, tmp_path / "out", RunSettings(ignore_free_space=True))
    check_room({"disk_required": 120_000_000, "disk_free": 120_000_000}, tmp_path, RunSettings())  # just fits


def test_what_overwrite_frees_makes_room(tmp_path):
    numbers = {"disk_required": 10_000_000, "disk_free": 4_000_000, "disk_freed_by_overwrite": 6_000_000}
    check_room(numbers, tmp_path, RunSettings(overwrite=True))
    with pytest.raises(OutputError, match=r"with the 5\.00 MB that --overwrite frees"):
        check_room(numbers | {"disk_freed_by_overwrite": 5_000_000}, tmp_path, RunSettings(overwrite=True))


def test_too_little_room_in_the_hub_cache_is_refused_naming_the_cache(tmp_path):
    numbers = {"disk_required": 1, "disk_free": 10, "cache_dir": "/cache/hub", "cache_required": 5, "cache_free": 4}
    with pytest.raises(OutputError) as e:
        check_room(numbers, tmp_path, RunSettings())
    message = str(e.value)
    assert message.startswith("/cache/hub: not enough free space to download")
    assert "HF_HUB_CACHE" in message and "--stream" in message
    check_room(numbers, tmp_path, RunSettings(ignore_free_space=True))


def test_inspect_then_space_then_check_room_on_a_real_filesystem(conversion, tmp_path, tiny_src):
    """The real free space of tmp_path: the tiny conversion fits, a petabyte does not."""
    out = tmp_path / "out"
    summary = make_plan(open_source(tiny_src), Options()).summary()
    state = inspect_output(conversion, out, RunSettings())
    numbers = space(summary, out, RunSettings(), state, None, None)
    assert numbers["disk_required"] == summary["bytes_out"] and numbers["disk_free"] > summary["bytes_out"]
    check_room(numbers, out, RunSettings())
    with pytest.raises(OutputError, match="not enough free space"):
        check_room(numbers | {"disk_required": 10**15}, out, RunSettings())


# ---- plan_line ---------------------------------------------------------------------------------------

HUB_SUMMARY = {"source": "org/model@abc", "shards": 4, "download_bytes": 2_500_000_000}


def test_plan_line_of_a_download_to_the_cache_on_outs_filesystem(tmp_path):
    line = plan_line(HUB_SUMMARY | {"disk_required": 5_000_000_000, "disk_free": 60_000_000}, tmp_path, False)
    assert line == (
        f"org/model@abc: 4 shards, 2.500 GB: 5.000 GB needed in {tmp_path} (60.00 MB free), "
        "with the download to the Hub cache"
    )


def test_plan_line_of_a_download_to_a_cache_elsewhere(tmp_path):
    summary = HUB_SUMMARY | {
        "disk_required": 1_000_000_000, "disk_free": 2_000_000_000,
        "cache_dir": "/cache", "cache_required": 2_500_000_000, "cache_free": 3_000_000_000,
    }  # fmt: skip
    line = plan_line(summary, tmp_path, False)
    assert line == (
        f"org/model@abc: 4 shards, 2.500 GB: 2.500 GB to download to /cache (3.000 GB free); "
        f"1.000 GB needed in {tmp_path} (2.000 GB free)"
    )


def test_plan_line_of_a_streamed_source(tmp_path):
    summary = HUB_SUMMARY | {"disk_required": 1_500_000_000, "disk_free": 2_000_000_000, "cache_dir": "/cache"}
    line = plan_line(summary, tmp_path, True)
    assert line == (
        f"org/model@abc: 4 shards, 2.500 GB, streamed: 1.500 GB needed in {tmp_path} (2.000 GB free), "
        "with the shards in flight"
    )


def test_prepare_creates_out_or_deletes_the_earlier_output_first(conversion, earlier, tmp_path):
    new = tmp_path / "a" / "b"
    preflight.prepare(new, OutputState({}))
    assert new.is_dir()
    (earlier / "mla" / "keep.txt").write_text("not the tool's, but prepare deletes only what it was given")
    state = OutputState({}, out_dir_mod.Earlier(earlier, tuple(conversion.writes), 0))
    preflight.prepare(earlier, state)
    assert listing(earlier).keys() == {MANIFEST_NAME, "mla/keep.txt"}
