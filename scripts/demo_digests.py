#!/usr/bin/env python
"""The sha256 of every file `mla-convert demo` writes, for every family member in every format
and every target the format takes, so that a change that must not change output bytes can be
checked against the commit before:

    python scripts/demo_digests.py > after.txt
    git stash; python scripts/demo_digests.py > before.txt; git stash pop
    diff <(sort before.txt) <(sort after.txt)

One line a file: member, format, path inside the converted directory, sha256; the format column is
FORMAT for the default target and FORMAT/TARGET for another one (channel-fp8/gaudi2). The source
checkpoint the demo writes is listed too (under `source/`). Runs the CLI of the checkout it stands
in (`python -m mla_convert`, with this checkout first on PYTHONPATH).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mla_convert import formats  # noqa: E402

FORMATS = formats.names()
TARGETS = tuple(formats.TARGETS)


def members() -> list[str]:
    from mla_convert.source.family import demo_members

    return ["deepseek-r1", *demo_members()]  # deepseek-r1: the demo's default, not a member's demo


def targets_of(fmt: str, wanted: list[str] | None) -> list[str]:
    """The targets `fmt` takes (formats.Format.refuses_target), those of `wanted` where given."""
    taken = [t for t in TARGETS if formats.get(fmt).refuses_target(t) is None]
    return [t for t in taken if t in wanted] if wanted else taken


def digests(directory: Path) -> list[tuple[str, str]]:
    out = []
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        out.append((str(path.relative_to(directory)), hashlib.sha256(path.read_bytes()).hexdigest()))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", action="append", help="only these members (repeatable)")
    parser.add_argument("--format", action="append", choices=FORMATS, help="only these formats (repeatable)")
    parser.add_argument("--target", action="append", choices=TARGETS, help="only these targets (repeatable)")
    parser.add_argument(
        "--workdir",
        default=os.path.join(tempfile.gettempdir(), "demo-digests"),
        help="where each demo is written (a fixed path: outputs record their source's path)",
    )
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    for member in args.family or members():
        for fmt in args.format or FORMATS:
            for target in targets_of(fmt, args.target):
                label = fmt if target == formats.DEFAULT_TARGET else f"{fmt}/{target}"
                # One fixed path: the card and the conversion manifest record the source's path.
                with tempfile.TemporaryDirectory(prefix="demo-digests-") as tmp:
                    out = Path(args.workdir) / "demo"
                    shutil.rmtree(out, ignore_errors=True)
                    cmd = [sys.executable, "-m", "mla_convert", "demo", "--quiet", "--family", member,
                           "--format", fmt, "--target", target]  # fmt: skip
                    subprocess.run([*cmd, "--out", str(out)], check=True, env=env, cwd=tmp)
                    for rel, digest in digests(out):
                        if ".mla-convert" in rel:  # the run's own lock and journal, not output
                            continue
                        print(f"{member}\t{label}\t{rel}\t{digest}", flush=True)


if __name__ == "__main__":
    main()
