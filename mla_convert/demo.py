"""The offline demo: a tiny checkpoint of a family member, written, converted and verified."""

from __future__ import annotations

import tempfile
from pathlib import Path

from .convert import convert, ensure_empty_dir
from .errors import ConvertError
from .family import MEMBERS
from .plan import Options
from .synthetic import CheckpointSpec, write_checkpoint
from .verify import verify


def run_demo(
    out_dir: str | Path | None, options: Options, overwrite: bool = False, member: str = MEMBERS[0]
) -> tuple[dict, dict]:
    """Write the tiny checkpoint of `member` (family.MEMBERS) to `out_dir`/source (default: a new
    temporary directory), convert it to `out_dir`/converted-FORMAT and verify that against its source.

    Returns (the conversion summary with a 'verify' entry, the verify report).
    """
    if member not in MEMBERS:
        raise ConvertError(f"--family {member!r}: expected one of {', '.join(MEMBERS)}")
    root = Path(out_dir) if out_dir else Path(tempfile.mkdtemp(prefix="mla-convert-demo-"))
    ensure_empty_dir(root, overwrite)
    src = write_checkpoint(root / "source", CheckpointSpec.family(member))
    summary = convert(src, root / f"converted-{options.format}", options)
    report = verify(summary["out"], src)
    summary["verify"] = {
        "ok": report["ok"],
        "checks": sum(g["checked"] for g in report["groups"].values()),
        "failed": sum(g["failed"] for g in report["groups"].values()),
        "seconds": report["seconds"],
    }
    return summary, report
