#!/usr/bin/env python
"""The sha256 of every file `mla-convert demo` writes, for every family member in both formats, so
that a change that must not change output bytes can be checked against the commit before:

    python scripts/demo_digests.py > after.txt
    git stash; python scripts/demo_digests.py > before.txt; git stash pop
    diff <(sort before.txt) <(sort after.txt)

One line a file: member, format, path inside the converted directory, sha256. The source
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
FORMATS = ("channel-fp8", "bf16")


def members() -> list[str]:
    sys.path.insert(0, str(ROOT))
    from mla_convert.source.family import demo_members

    return ["deepseek-r1", *demo_members()]  # deepseek-r1: the demo's default, not a member's demo


def digests(directory: Path) -> list[tuple[str, str]]:
    out = []
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        out.append((str(path.relative_to(directory)), hashlib.sha256(path.read_bytes()).hexdigest()))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", action="append", help="only these members (repeatable)")
    parser.add_argument("--format", action="append", choices=FORMATS, help="only these formats (repeatable)")
    parser.add_argument(
        "--workdir",
        default=os.path.join(tempfile.gettempdir(), "demo-digests"),
        help="where each demo is written (a fixed path: outputs record their source's path)",
    )
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    for member in args.family or members():
        for fmt in args.format or FORMATS:
            # One fixed path: the card and the conversion manifest record the source's path.
            with tempfile.TemporaryDirectory(prefix="demo-digests-") as tmp:
                out = Path(args.workdir) / "demo"
                shutil.rmtree(out, ignore_errors=True)
                cmd = [sys.executable, "-m", "mla_convert", "demo", "--quiet", "--family", member, "--format", fmt]
                subprocess.run([*cmd, "--out", str(out)], check=True, env=env, cwd=tmp)
                for rel, digest in digests(out):
                    if ".mla-convert" in rel:  # the run's own lock and journal, not output
                        continue
                    print(f"{member}\t{fmt}\t{rel}\t{digest}", flush=True)


if __name__ == "__main__":
    main()
