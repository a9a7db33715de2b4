"""The real CLI in a child process (so a test can SIGKILL it, resource-limit it, or give it its own
environment). Tests get it as the `run_cli` fixture (tests/conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent.parent


def run_cli(*args, env=None, preexec_fn=None, unset=(), crash_at: str | None = None) -> subprocess.CompletedProcess:
    """`python -m mla_convert ARGS...` with `env` added to this process's environment and the
    variables named in `unset` removed from it; its output captured as text. With `crash_at`, the
    child kills itself with SIGKILL at that crash point (support/crash_cli.py)."""
    child_env = {k: v for k, v in {**os.environ, **(env or {})}.items() if k not in unset}
    command = [sys.executable, "-m", "mla_convert"]
    if crash_at is not None:
        path = child_env.get("PYTHONPATH")
        child_env["PYTHONPATH"] = os.pathsep.join([str(TESTS_DIR), *([path] if path else [])])
        command = [sys.executable, "-m", "support.crash_cli", crash_at]
    return subprocess.run(
        [*command, *map(str, args)],
        capture_output=True, text=True, env=child_env, preexec_fn=preexec_fn, timeout=300,
    )  # fmt: skip
