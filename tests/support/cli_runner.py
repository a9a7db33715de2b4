"""The real CLI in a child process (so a test can SIGKILL it, resource-limit it, or give it its own
environment). Tests get it as the `run_cli` fixture (tests/conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys


def run_cli(*args, env=None, preexec_fn=None, unset=()) -> subprocess.CompletedProcess:
    """`python -m mla_convert ARGS...` with `env` added to this process's environment and the
    variables named in `unset` removed from it; its output captured as text."""
    child_env = {k: v for k, v in {**os.environ, **(env or {})}.items() if k not in unset}
    return subprocess.run(
        [sys.executable, "-m", "mla_convert", *map(str, args)],
        capture_output=True, text=True, env=child_env, preexec_fn=preexec_fn, timeout=300,
    )  # fmt: skip
