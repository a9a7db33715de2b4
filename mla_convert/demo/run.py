"""The offline demo: a tiny checkpoint of a family member, written, converted and verified."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from mla_convert.constants import DEMO_MARKER_NAME as MARKER
from mla_convert.conversion.pipeline import convert
from mla_convert.demo.specs import CheckpointSpec
from mla_convert.demo.synthetic import write_checkpoint
from mla_convert.errors import ConvertError, OutputError
from mla_convert.io.files import files_under
from mla_convert.output import out_dir as out
from mla_convert.output.card import record_verification
from mla_convert.results import DemoResult
from mla_convert.settings import Options
from mla_convert.source.family import demo_members
from mla_convert.verification.api import verify

# MARKER is written once the demo's source checkpoint is complete: the files it holds, which a later
# `demo --overwrite` may delete (the converted-* directories are recognised by their manifests).
SOURCE_DIR = "source"


def run_demo(
    out_dir: str | Path | None, options: Options, overwrite: bool = False, member: str | None = None
) -> DemoResult:
    """Write the tiny checkpoint of `member` (family.demo_members(); default: the first) to `out_dir`/source (default: a new
    temporary directory), convert it to `out_dir`/converted-FORMAT and verify that against its source;
    the result goes into the converted model's card."""
    member = member or demo_members()[0]
    if member not in demo_members():
        raise ConvertError(f"--family {member!r}: expected one of {', '.join(demo_members())}")
    options.check_new_conversion()  # refused before the demo writes its source
    if out_dir:
        return _run(Path(out_dir), options, overwrite, member)
    root = Path(tempfile.mkdtemp(prefix="mla-convert-demo-"))
    try:
        return _run(root, options, overwrite, member)
    except BaseException:  # a refused or interrupted demo in a directory of its own leaves nothing
        shutil.rmtree(root, ignore_errors=True)
        raise


def _run(root: Path, options: Options, overwrite: bool, member: str) -> DemoResult:
    _prepare(root, overwrite)
    src = write_checkpoint(root / SOURCE_DIR, CheckpointSpec.family(member))
    written = [f"{SOURCE_DIR}/{rel}" for rel in files_under(src)]
    (root / MARKER).write_text(json.dumps({"source_files": written}, indent=1) + "\n")
    conversion = convert(src, root / f"converted-{options.format}", options)
    report = verify(conversion.out, src)
    record_verification(conversion.out, report)  # the card says what verify found
    demo_bytes = sum(os.lstat(root / rel).st_size for rel in files_under(root))
    return DemoResult(conversion, report, str(root), demo_bytes)


def _prepare(root: Path, overwrite: bool) -> None:
    """`root` created or empty; with `overwrite`, an earlier demo in it is deleted, and only that.
    A refusal says what will work: --overwrite only where --overwrite would then go ahead."""
    out.check_writable(root)
    if not out.is_empty(root):
        delete = _earlier_demo(root, overwrite)
        if not overwrite:
            raise OutputError(
                f"{root}: directory holds an earlier demo; pass --overwrite to replace it, or pick another --out"
            )
        delete()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"{root}: cannot create the demo directory ({e.strerror or e})") from e


def _earlier_demo(root: Path, overwrite: bool):
    """A function that deletes the earlier demo in `root`; refuses if `root` holds anything else
    (`overwrite`: whether the user asked for that, for the refusal's words)."""
    try:
        listed = set(json.loads((root / MARKER).read_text())["source_files"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        why = (
            f"--overwrite replaces only an earlier demo (one with {MARKER}), and this directory is not one"
            if overwrite
            else f"directory is not empty, and not an earlier demo (it has no {MARKER})"
        )
        raise OutputError(f"{root}: {why}; pick another --out (a new or empty directory), or empty it yourself") from e
    outputs = [p for p in root.glob("converted-*") if p.is_dir() and not p.is_symlink()]
    earlier = [out.earlier_output(p, ()) for p in outputs]
    claimed = {MARKER} | listed | {f"{p.name}/{rel}" for p in outputs for rel in files_under(p)}
    foreign = [rel for rel in files_under(root) if rel not in claimed]
    if foreign:
        then = "" if overwrite else ", then pass --overwrite to replace the demo"
        raise OutputError(
            f"{root}: {'--overwrite would delete ' if overwrite else 'directory holds an earlier demo and '}"
            f"{out.first_and_others(foreign)}, which the demo did not write; move it out of --out first{then}, "
            "or pick another --out"
        )

    def delete() -> None:
        for e in earlier:
            e.delete()
        out.Earlier(root, tuple(sorted(listed | {MARKER})), 0).delete()
        for p in outputs:
            try:
                p.rmdir()
            except OSError:
                pass

    return delete
