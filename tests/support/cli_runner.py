"""The real CLI in a child process (so a test can SIGKILL it, resource-limit it, or give it its own
environment): tests get it as the `run_cli` fixture (tests/conftest.py). And `cli_error`: a command
run in this process that must fail with one line."""

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


def cli_error(args: list, out: Path) -> str:
    """Run the CLI in this process (Typer's runner) with `args`, which must fail as bad input does:
    exit 2, one line on stderr starting 'error: ', and nothing at `out`. Returns that line."""
    from typer.testing import CliRunner

    from mla_convert.cli.app import app

    res = CliRunner().invoke(app, [str(a) for a in args])
    assert res.exit_code == 2, (res.stdout, res.stderr)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert not out.exists()
    return lines[0]
