#!/usr/bin/env python
"""A converted DeepSeek-R1 at its real size on a few MB of disk: what `mla-convert convert` writes
from a sparse source of scripts/r1_sparse_source.py, without converting.

    python scripts/r1_sparse_source.py /tmp/r1-sparse
    python scripts/r1_sparse_output.py /tmp/r1-sparse /tmp/r1-sparse-out     # 163 shards + 62 MLA files, ~691 GB
    python scripts/r1_sparse_output.py /tmp/r1-small OUT --compare REAL_OUT   # every file's sha256 against a conversion's

A sparse source's weights are zero, and the conversion of a zero weight is known exactly: every
FP8 code zero, every channel scale 1.0 (an all-zero row's scale, kernels/numerics.py), zero MLA
artifacts (the split of a zero kv_b_proj); every copied tensor is the source's bytes. So this
plans the conversion with the product's own planner (plan.planner.make_plan on
source.checkpoint.open_source, the block scales checked as convert checks them), writes each output
shard and MLA layer file with the product's own header (safetensors_file.encode_header, as
io.shard_writer.ShardWriter writes it), the zero data left as file holes and only the scales and
the copied data regions written, hashes each file as written (the holes hashed as zeros), and ends
with the conversion's own last stage (conversion.finalize: side files, MLA manifest, card, index,
config, the manifest 'complete'). A weight of the source that is not zero is refused: what the
converter makes of it is not known here.

`--compare REAL_OUT`: the sha256 of every file here against the same file of a real conversion of
the same source (`mla-convert convert SRC --out REAL_OUT`, with the same options): the proof that
this is the converter's output. OUT.json beside OUT records what was built; a run whose OUT.json
records the same source fingerprint and options keeps OUT as it is.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import struct
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mla_convert.constants import INCOMPLETE, MANIFEST_NAME, MLA_DIR_NAME  # noqa: E402
from mla_convert.conversion.finalize import finalize  # noqa: E402
from mla_convert.conversion.scales import check_scale_values  # noqa: E402
from mla_convert.output.card_facts import source_ref  # noqa: E402
from mla_convert.output.manifest import write_manifest  # noqa: E402
from mla_convert.plan.ops import COPY_OPS, FP8_SCALE, QUANT_FP8, TO_BF16, TO_FP8  # noqa: E402
from mla_convert.plan.planner import Plan, make_plan, mla_file_rel  # noqa: E402
from mla_convert.settings import Options  # noqa: E402
from mla_convert.source.checkpoint import open_source  # noqa: E402
from mla_runtime.format import ARTIFACT_ST_DTYPE, w_uk_t_name, w_uv_name  # noqa: E402
from mla_runtime.safetensors_file import encode_header, nbytes_of  # noqa: E402

ZEROS = memoryview(bytes(16 << 20))
ZERO_OPS = (TO_FP8, TO_BF16, QUANT_FP8)  # a zero weight becomes zero codes (and a scale of 1.0 per row)
ONE_F32 = struct.pack("<f", 1.0)  # the channel scale of an all-zero row

# What one output file holds besides zeros, in file order: ("fill", offset, value, count) or
# ("copy", offset, source path, source offset, nbytes).
Piece = tuple


def file_plans(plan: Plan, out: Path) -> list[tuple[str, bytes, int, list[Piece]]]:
    """(path, header bytes, size, pieces) of every shard and MLA layer file the plan writes."""
    files = []
    for job in plan.shards:
        specs = {t.name: (t.dtype, t.shape) for t in job.tensors}
        prefix = encode_header(specs, {"format": "pt"})  # io.shard_writer.ShardWriter's, no metadata given
        pos, pieces = len(prefix), []
        for t in job.tensors:
            n = nbytes_of(t.dtype, t.shape)
            if t.op == FP8_SCALE:
                if t.dtype != "F32":
                    raise SystemExit(f"{t.name}: a {t.dtype} scale; this script knows float32 channel scales only")
                pieces.append(("fill", pos, ONE_F32, n // 4))
            elif t.op in COPY_OPS:
                pieces.append(("copy", pos, *_source_bytes(plan, t.source)))
            elif t.op not in ZERO_OPS:
                raise SystemExit(f"{t.name}: op {t.op!r}; this script knows the conversion of zero block-FP8 weights")
            pos += n
        files.append((str(out / job.file), prefix, pos, pieces))
        for layer in job.mla_layers:  # the split of a zero kv_b_proj: zero artifacts
            dims = plan.dims_of(layer)
            specs = {w_uk_t_name(layer): (ARTIFACT_ST_DTYPE, dims.w_uk_t_shape()),
                     w_uv_name(layer): (ARTIFACT_ST_DTYPE, dims.w_uv_shape())}  # fmt: skip
            prefix = encode_header(specs, {"format": "pt"})
            size = len(prefix) + sum(nbytes_of(*s) for s in specs.values())
            files.append((str(out / mla_file_rel(layer)), prefix, size, []))
    return files


def _source_bytes(plan: Plan, name: str) -> tuple[str, int, int]:
    """Where a source tensor's bytes lie: (path, offset, nbytes)."""
    src, rel = plan.source, plan.source.weight_map[name]
    info = src.info(name)
    return str(src.root / rel), src.headers[rel].data_start + info.begin, info.nbytes


def check_zero_weights(plan: Plan) -> None:
    """Every source weight the plan converts, and every kv_b_proj (its MLA artifacts are written as
    zeros), is zero (its stored ranges hold zero bytes), before anything is written; else SystemExit."""
    for job in plan.shards:
        for t in job.tensors:
            if t.op in ZERO_OPS or t.layer is not None:
                path, offset, nbytes = _source_bytes(plan, t.source)
                for at, data in _stored(path, offset, nbytes):
                    if data.count(0) != len(data):
                        raise SystemExit(f"{path}: {t.source} is not zero (at byte {offset + at}); this script "
                                         "writes the conversion of zero weights only")  # fmt: skip


def data_ranges(fd: int, start: int, end: int):
    """The (begin, end) ranges of [start, end) that the file stores (the rest: holes, read as zeros)."""
    pos = start
    while pos < end:
        try:
            begin = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError:  # ENXIO: no data after pos
            return
        if begin >= end:
            return
        stop = min(end, os.lseek(fd, begin, os.SEEK_HOLE))
        yield begin, stop
        pos = stop


def _stored(path: str, offset: int, nbytes: int):
    """(relative offset, bytes) of each stored range of a source tensor."""
    fd = os.open(path, os.O_RDONLY)
    try:
        for b, e in data_ranges(fd, offset, offset + nbytes):
            yield b - offset, os.pread(fd, e - b, b)
    finally:
        os.close(fd)


def write_file(path: str, prefix: bytes, size: int, pieces: list[Piece]) -> dict:
    """The file: its header, its pieces, holes for the rest; its size and sha256 (of what was
    written, the holes hashed as zeros; never read back)."""
    tmp = Path(path).with_name(f".{Path(path).name}.partial")
    h, pos = hashlib.sha256(), 0

    def put(f, offset: int, data: bytes) -> None:
        nonlocal pos
        while pos < offset:
            n = min(offset - pos, len(ZEROS))
            h.update(ZEROS[:n])
            pos += n
        f.seek(offset)
        f.write(data)
        h.update(data)
        pos += len(data)

    try:
        with open(tmp, "wb") as f:
            put(f, 0, prefix)
            for piece in pieces:
                if piece[0] == "fill":
                    _, offset, value, count = piece
                    put(f, offset, value * count)
                else:
                    _, offset, src, src_offset, nbytes = piece
                    for at, data in _stored(src, src_offset, nbytes):
                        put(f, offset + at, data)
            f.truncate(size)
            while pos < size:
                n = min(size - pos, len(ZEROS))
                h.update(ZEROS[:n])
                pos += n
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return {"size": size, "sha256": h.hexdigest()}


def build(src_dir: Path, out: Path, options: Options = Options(), jobs: int = 2) -> dict:  # noqa: B008 (frozen)
    """Write the converted directory to `out` (kept when OUT.json records this source and these
    options); returns what OUT.json says."""
    summary_path = out.with_name(out.name + ".json")
    src = open_source(src_dir)
    key = {"source": str(src.root.absolute()), "fingerprint": src.fingerprint(), "options": options.as_dict()}
    if summary_path.exists() and (out / MANIFEST_NAME).exists():
        summary = json.loads(summary_path.read_text())
        if summary.get("key") == key:
            return summary | {"reused": True}
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out}: not empty; give a new directory (or delete this one)")
    t0 = time.perf_counter()
    check_scale_values(src)  # as convert does first: a source it refuses is refused here
    plan = make_plan(src, options)
    check_zero_weights(plan)
    (out / MLA_DIR_NAME).mkdir(parents=True, exist_ok=True)
    write_manifest(out, INCOMPLETE, options.as_dict(), src.fingerprint(), {})
    work = file_plans(plan, out)
    if jobs <= 1:
        written = [write_file(*w) for w in work]
    else:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            written = list(pool.map(write_file, *zip(*work, strict=True), chunksize=1))
    files = {os.path.relpath(w[0], out): r for w, r in zip(work, written, strict=True)}
    finalize(plan, out, files, source_ref(src.root, base_model=options.base_model))
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    summary = {
        "key": key, "files": len(manifest["files"]), "shards": len(plan.shards), "mla_layers": len(plan.mla_layers),
        "tensors": sum(len(j.tensors) for j in plan.shards), "bytes": sum(f["size"] for f in manifest["files"].values()),
        "allocated_bytes": sum(p.lstat().st_blocks * 512 for p in out.rglob("*") if p.is_file()),
        "seconds": round(time.perf_counter() - t0, 1), "reused": False,
    }  # fmt: skip
    summary_path.write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def compare(out: Path, real: Path) -> list[str]:
    """The files of `out` and `real` (a real conversion) that differ: missing on one side, or
    another sha256 (both read from disk); empty when every file is the same."""

    def digests(root: Path) -> dict[str, str]:
        out = {}
        for p in sorted(root.rglob("*")):
            if p.is_file():
                h = hashlib.sha256()
                with open(p, "rb") as f:
                    while chunk := f.read(16 << 20):
                        h.update(chunk)
                out[str(p.relative_to(root))] = h.hexdigest()
        return out

    mine, theirs = digests(out), digests(real)
    return [
        f"{rel}: {'missing here' if rel not in mine else 'not in the conversion' if rel not in theirs else 'differs'}"
        for rel in sorted(set(mine) | set(theirs))
        if mine.get(rel) != theirs.get(rel)
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", type=Path, help="a sparse source (scripts/r1_sparse_source.py)")
    ap.add_argument("out", type=Path)
    ap.add_argument("--format", default=Options.format)
    ap.add_argument("--target", default=Options.target)
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="processes writing and hashing")
    ap.add_argument("--compare", type=Path, metavar="REAL_OUT", help="a real conversion of SOURCE to compare with")
    args = ap.parse_args(argv)
    summary = build(args.source, args.out, Options(format=args.format, target=args.target), args.jobs)
    print(
        f"{'reused' if summary['reused'] else 'built'}: {summary['shards']} shards and {summary['mla_layers']} MLA "
        f"layer files, {summary['tensors']:,} tensors, {summary['bytes'] / 1e9:.1f} GB on "
        f"{summary['allocated_bytes'] / 1e6:.1f} MB of disk ({summary['files']} files, {summary['seconds']} s)"
    )
    if args.compare is None:
        return 0
    differ = compare(args.out, args.compare)
    print("\n".join(differ) or f"every file has the sha256 of {args.compare}'s")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
