"""The offline demo: a tiny DeepSeek-R1-shaped checkpoint, written, converted and verified."""

from __future__ import annotations

import tempfile
from pathlib import Path

from .convert import convert, ensure_empty_dir
from .plan import Options
from .synthetic import write_checkpoint
from .verify import verify


def run_demo(out_dir: str | Path | None, options: Options, overwrite: bool = False) -> tuple[dict, dict]:
    """Write the tiny checkpoint to `out_dir`/source (default: a new temporary directory), convert it
    to `out_dir`/converted-FORMAT and verify that against its source.

    Returns (the conversion summary with a 'verify' entry, the verify report).
    """
    root = Path(out_dir) if out_dir else Path(tempfile.mkdtemp(prefix="mla-convert-demo-"))
    ensure_empty_dir(root, overwrite)
    src = write_checkpoint(root / "source")
    summary = convert(src, root / f"converted-{options.format}", options)
    report = verify(summary["out"], src)
    summary["verify"] = {
        "ok": report["ok"],
        "checks": sum(g["checked"] for g in report["groups"].values()),
        "failed": sum(g["failed"] for g in report["groups"].values()),
        "seconds": report["seconds"],
    }
    return summary, report
