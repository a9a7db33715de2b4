"""verify's memory. A tensor larger than data_pass.BY_ROWS_BYTES (an embedding,
lm_head: 1.85 GB each in DeepSeek-R1) is checked as it is read, a run of rows at a time in the
reused read buffers, rather than read whole into memory of its own; the report is the same,
failures included. And what the header pass and the task building hold per tensor stays small
(docs/benchmarks.md, "verify's memory", has the figures at R1's size)."""

import importlib.util
import json
import shutil
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

from mla_convert.constants import MANIFEST_NAME
from mla_convert.verification import data_pass, verify
from mla_convert.verification import readers as readers_mod
from support.edits import fix_hash, tensor_spans

FP8 = "channel-fp8"
NAN = {1: b"\x7f", 2: b"\xc0\x7f", 4: b"\x00\x00\xc0\x7f"}  # e4m3fn, bf16, f32 (little-endian)
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _native_readers():
    """The native pass decides by rows: these tests run it, and leave the choice as they found it."""
    readers_mod.reset()
    yield
    readers_mod.reset()


class _Seen:
    """Which tensors went by rows and passed, and which were checked whole (data_pass._FileChecks.tensor)."""

    def __init__(self, monkeypatch):
        self.by_rows, self.whole = set(), set()
        finish, tensor = data_pass._ByRows.finish, data_pass._FileChecks.tensor

        def spy_finish(by_rows):
            passed = finish(by_rows)
            if passed:
                self.by_rows.add(by_rows.info.name)
            return passed

        def spy_tensor(checks, info, buf):
            self.whole.add(info.name)
            return tensor(checks, info, buf)

        monkeypatch.setattr(data_pass._ByRows, "finish", spy_finish)
        monkeypatch.setattr(data_pass._FileChecks, "tensor", spy_tensor)


def _report(out: Path, source, monkeypatch, by_rows: bool) -> str:
    """verify's JSON report (less its time), every tensor that may go by rows going so (a few
    rows at a time) or none; as text, where NaN equals NaN."""
    with monkeypatch.context() as m:
        m.setattr(data_pass, "BY_ROWS_BYTES", 0 if by_rows else 1 << 62)
        m.setattr(data_pass, "ROWS_BYTES", 3000)
        report = verify(out, source=source).to_json()
    report.pop("seconds")
    report.pop("readers_reason")  # the first verify of a session probes the readers, the next remembers
    return json.dumps(report, indent=1, sort_keys=True)


def test_a_clean_output_checked_by_rows_reports_the_same_and_holds_no_tensor_whole(converted, tiny_src, monkeypatch):
    for source in (None, tiny_src):
        whole = _report(converted[FP8], source, monkeypatch, by_rows=False)
        seen = _Seen(monkeypatch)
        assert _report(converted[FP8], source, monkeypatch, by_rows=True) == whole
        assert json.loads(whole)["ok"]
        assert seen.by_rows and not seen.by_rows & seen.whole
        embed = "model.embed_tokens.weight"
        assert embed in seen.by_rows  # compared with its source by parts, with --source
        # read whole: a scale, a weight compared with its scale (--source), an MLA artifact
        assert any(n.endswith("weight_scale") for n in seen.whole) and any(n.endswith("W_UK_T") for n in seen.whole)
        fp8_weights = {n for n in seen.by_rows | seen.whole if n.endswith("mlp.down_proj.weight")}
        assert fp8_weights <= (seen.whole if source else seen.by_rows)


@pytest.mark.parametrize("source", [False, True])
def test_a_flipped_value_checked_by_rows_fails_as_when_read_whole(converted, tiny_src, tmp_path, monkeypatch, source):
    """One element of one tensor of each dtype and role changed (the hashes made to agree): made
    NaN, or off by orders of magnitude with --source. By rows, the run that holds it fails, the
    tensor is read whole and checked as any other, and the report (failures, their words, the
    counts) is the one of a verify that reads every tensor whole."""
    out = Path(shutil.copytree(converted[FP8], tmp_path / "out"))
    src = tiny_src if source else None
    seen_kinds, cases = set(), []
    for path in sorted(out.rglob("*.safetensors")):
        for name, (begin, end, dtype) in tensor_spans(path).items():
            kind = (dtype, name.rsplit(".", 1)[-1], "mla" in path.parts)
            size = {"F8_E4M3": 1, "BF16": 2, "F32": 4}.get(dtype)
            if kind not in seen_kinds and size:
                seen_kinds.add(kind)
                cases.append((path, name, begin + (end - begin) // size * 3 // 4 * size, size))  # a later run
    assert len(cases) >= 5
    manifest, mla_manifest = (out / MANIFEST_NAME).read_text(), (out / "mla/manifest.json").read_text()
    fell_back = 0
    for path, name, at, size in cases:
        data = path.read_bytes()
        changed = bytearray(data)
        if source:
            changed[at + size - 1] ^= 0x40  # an exponent bit
        else:
            changed[at : at + size] = NAN[size]
        path.write_bytes(changed)
        fix_hash(out, str(path.relative_to(out)))
        try:
            whole = _report(out, src, monkeypatch, by_rows=False)
            seen = _Seen(monkeypatch)
            by_rows = _report(out, src, monkeypatch, by_rows=True)
        finally:
            path.write_bytes(data)
            (out / MANIFEST_NAME).write_text(manifest)
            (out / "mla/manifest.json").write_text(mla_manifest)
        assert by_rows == whole and not json.loads(whole)["ok"], name
        fell_back += name in seen.whole and name not in seen.by_rows
    assert fell_back >= 3  # the flipped tensors that go by rows were read again, whole


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# verify's peak at DeepSeek-R1's size is held to at most 1 GB: what every run holds
# (~55 MB: the interpreter, the native library), what the header pass and the tasks hold per tensor,
# and what tensors are read into, which does not grow with the largest one (READ_BYTES; at R1's dims
# the two read buffers hold its dense layers' 132 MB MLP weights whole, and --source reads 64 MB of
# the source at a time: 328 MB). That leaves (1 GB - 55 MB - 328 MB) / 91,991 = 6.7 KB of resident
# memory per tensor, ~5.7 KB as tracemalloc counts it (resident runs 15-20 % above). The bounds below
# hold today's figures (about 1,270 and 2,490 bytes) with room, well inside that.
BYTES_PER_TENSOR = {"alone": 2_000, "with --source": 4_000}
# What verify reads tensors into, whatever their size: two buffers of whole rows, the source's rows, room.
READ_BYTES = 4 * data_pass.ROWS_BYTES


@pytest.mark.parametrize("with_source", [False, True], ids=["alone", "with --source"])
def test_the_header_pass_and_the_tasks_hold_little_per_tensor(tmp_path_factory, with_source):
    """A sparse R1-shaped output of a few thousand tensors (tiny dims, 128 experts): what the
    structures verify builds before its data pass hold (the source opened and planned, the header
    pass, every file's task), traced, stays under BYTES_PER_TENSOR per tensor."""
    from mla_convert.verification import api
    from mla_convert.verification.report import Tally
    from mla_convert.verification.structure import check_structure
    from mla_convert.verification.tasks import file_tasks

    base = tmp_path_factory.mktemp("sparse")
    r1, gen = _script("r1_sparse_source"), _script("r1_sparse_output")
    r1.build(base / "src", r1.r1_spec(layers=8, experts=128, shards=4, tiny=True), jobs=1)
    gen.build(base / "src", base / "out", jobs=1)
    out = base / "out"
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        manifest = api._read_conversion_manifest(out)
        options = api._recorded_options(out, manifest)
        src = api._open_source(base / "src") if with_source else None
        plan = api.make_plan(src, options) if with_source else None
        tally = Tally()
        layout = check_structure(out, options.format, manifest["source_fingerprint"], plan, tally)
        tasks = file_tasks(out, layout, manifest, options, src)
        held = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(before, "filename"))
    finally:
        tracemalloc.stop()
    tensors = sum(len(h.tensors) for h in layout.headers.values())
    assert not tally.failures and len(tasks) > 10 and tensors > 4_000
    per_tensor = held / tensors
    bound = BYTES_PER_TENSOR["with --source" if with_source else "alone"]
    print(f"PER_TENSOR {per_tensor:.0f}")
    assert per_tensor < bound, f"{per_tensor:.0f} bytes per tensor held before the data pass (bound {bound})"


# ---- a whole verify's peak, in its own process (the kernel's ru_maxrss) ----------------------------


# Run by a small launcher, which reports its child's peak: Linux counts in a child's ru_maxrss the
# memory of the process that forked it (at exec), here a pytest process with torch loaded.
_LAUNCHER = """import json, os, subprocess, sys
p = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
report = p.stdout.read()
_, status, usage = os.wait4(p.pid, 0)
print(json.dumps([os.waitstatus_to_exitcode(status), usage.ru_maxrss * 1024, report.decode()]))"""


def _peak_rss(out: Path, source: Path | None = None) -> int:
    """`python -m mla_convert verify OUT [--source SRC] --json`, as a user runs it: it passes, and
    its peak resident memory (bytes; ru_maxrss is in KB on Linux)."""
    args = [sys.executable, "-m", "mla_convert", "verify", str(out), "--json"]
    args += ["--source", str(source)] if source else []
    launched = subprocess.run([sys.executable, "-c", _LAUNCHER, *args], capture_output=True, text=True, check=True)
    exit_code, peak, report = json.loads(launched.stdout)
    assert exit_code == 0 and json.loads(report)["ok"]
    return peak


@pytest.fixture(scope="module")
def vocabularies(tmp_path_factory) -> dict[int, tuple[Path, Path]]:
    """The same sparse R1-shaped output (tiny dims) at two vocabulary sizes: its four embedding-sized
    tensors 256 KB, or 512 MB each (twice ReadBuffers.REUSE_BYTES): {vocab: (source, output)}."""
    base = tmp_path_factory.mktemp("vocab")
    r1, gen = _script("r1_sparse_source"), _script("r1_sparse_output")
    made = {}
    for vocab in (512, 1 << 20):
        src, out = base / f"src-{vocab}", base / f"out-{vocab}"
        r1.build(src, r1.r1_spec(layers=4, experts=8, shards=4, tiny=True, vocab=vocab), jobs=1)
        gen.build(src, out, jobs=1)
        made[vocab] = (src, out)
    return made


@pytest.mark.slow
@pytest.mark.parametrize("with_source", [False, True], ids=["alone", "with --source"])
def test_verify_s_peak_does_not_grow_with_its_largest_tensor(vocabularies, with_source):
    """The memory verify reads into is bounded, whatever the largest tensor: the peak with 512 MB
    embeddings is within READ_BYTES of the peak with 256 KB ones. Before (24055df): an embedding over
    REUSE_BYTES was read whole into memory of its own, +509 MB alone, +572 MB with --source (R1's
    1.85 GB embed_tokens made its 2.35 GB peak)."""
    # the native readers' pass probed and remembered here (the autouse fixture forgot it), as on a
    # machine that has verified before: else each run probes with torch, whose import hides the rest
    assert readers_mod.reader_backend().name == "native"
    peaks = [_peak_rss(out, src if with_source else None) for src, out in (vocabularies[512], vocabularies[1 << 20])]
    grown = peaks[1] - peaks[0]
    assert grown < READ_BYTES, f"the peak grew {grown / 1e6:.0f} MB with 512 MB tensors (bound {READ_BYTES / 1e6:.0f})"
