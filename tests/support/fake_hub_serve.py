"""`FakeHub` (fake_hub.py) in a process of its own, so that its CPU time is measured apart from the
client's (wait4 of this process) and a large transfer does not share the client's interpreter:

    PYTHONPATH=tests python -m support.fake_hub_serve --repo deepseek-ai/DeepSeek-R1=/data/r1:/data/r1.sha256.json \
        --token hf_source_token
    PYTHONPATH=tests python -m support.fake_hub_serve --sink --token hf_write_token --chunk-size 67108864

It prints one JSON line on stdout once it listens, `{"endpoint": "http://127.0.0.1:PORT", "port": PORT,
"pid": PID}`, and serves until SIGTERM or SIGINT (exit 0). Point a client at it with the variables of
`FakeHub.env(HF_HOME)`; ask it `GET /_fake/state` (FakeHub.state: its CPU seconds, commits, bytes
received, each repo's tree) while it runs.

`--repo OWNER/NAME=DIR[:SHA256_JSON]`: serve DIR as that repo's main branch; SHA256_JSON, a JSON
object {path: sha256}, gives the sha256 of those files instead of hashing them at start (a large
sparse source whose writer computed them). Repeatable. `--token`: a write token (every namespace).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from pathlib import Path

from support.fake_hub import FakeHub


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m support.fake_hub_serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", action="append", default=[], metavar="OWNER/NAME=DIR[:SHA256_JSON]")
    ap.add_argument("--token", action="append", default=[], help="a write token it accepts (repeatable)")
    ap.add_argument("--sink", action="store_true", help="hash uploaded LFS bytes, check them, keep none")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--chunk-size", type=int, default=64 << 20, help="bytes per part of a multipart upload")
    ap.add_argument("--multipart-threshold", type=int, default=64 << 20, help="objects above it go in parts")
    args = ap.parse_args(argv)

    hub = FakeHub(
        host=args.host, sink=args.sink, chunk_size=args.chunk_size, multipart_threshold=args.multipart_threshold
    )
    for token in args.token:
        hub.add_token(token)
    for spec in args.repo:
        repo_id, sep, where = spec.partition("=")
        if not sep:
            ap.error(f"--repo {spec!r}: expected OWNER/NAME=DIR[:SHA256_JSON]")
        directory, _, digests = where.partition(":")
        known = json.loads(Path(digests).read_text()) if digests else None
        hub.add_repo(repo_id, directory, known_sha256=known)

    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    with hub:
        print(json.dumps({"endpoint": hub.endpoint, "port": hub.port, "pid": os.getpid()}), flush=True)
        while not done.wait(0.5):
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
