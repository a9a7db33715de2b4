"""The real CLI as a running process that a test signals, kills, pipes or meets with another one
(tests/test_signals.py, test_pipes.py, test_lock.py, test_workers.py), and what a test sees of
its process group in /proc."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent.parent
MANIFEST = "mla-convert-manifest.json"


def as_from_a_terminal() -> None:
    """A background job of a script starts with SIGINT ignored, and one under nohup (a test run
    started so) with SIGHUP ignored; the CLI keeps them so. A command typed at a terminal finds
    the defaults: so does the child here, whatever the test run was started with."""
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, signal.SIG_DFL)


def start_cli(
    *args, env=None, group=False, stdout=subprocess.PIPE, stderr=subprocess.PIPE, pause_at=None, preexec_fn=None
) -> subprocess.Popen:
    """`python -m mla_convert ARGS` started, text pipes by default; `group`: in a session (and
    process group) of its own; `pause_at=(POINT, GATE)`: held at that crash point (pause_cli.py)."""
    child_env = {**os.environ, **(env or {})}
    command = [sys.executable, "-m", "mla_convert"]
    if pause_at is not None:
        child_env["PYTHONPATH"] = os.pathsep.join([str(TESTS_DIR), *filter(None, [child_env.get("PYTHONPATH")])])
        command = [sys.executable, "-m", "support.pause_cli", pause_at[0], str(pause_at[1])]

    def before_exec() -> None:
        as_from_a_terminal()
        if preexec_fn is not None:
            preexec_fn()

    return subprocess.Popen(
        [*command, *map(str, args)], stdout=stdout, stderr=stderr, text=True, env=child_env,
        preexec_fn=before_exec, start_new_session=group,
    )  # fmt: skip


def wait_until(condition, timeout: float = 120, what: str = "the condition") -> None:
    t0 = time.monotonic()
    while not condition():
        assert time.monotonic() - t0 < timeout, f"timed out waiting for {what}"
        time.sleep(0.01)


def wait_until_writing(out: Path, p: subprocess.Popen, timeout: float = 120) -> None:
    """Until the conversion has written its first file (its manifest), or ended."""
    wait_until(lambda: (out / MANIFEST).exists() or p.poll() is not None, timeout, "the first output file")


def group_members(pgid: int) -> list[tuple[int, str]]:
    """(pid, command line) of every live process in process group `pgid` (zombies are dead: a
    container's PID 1 may be slow to reap the orphans it inherits)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                found.append((int(stat.parent.name), cmdline))
        except (OSError, IndexError, ValueError):
            continue
    return found


def workers_of(pgid: int) -> list[str]:
    """The worker processes (multiprocessing's spawned children) alive in a process group."""
    return [cmd for _, cmd in group_members(pgid) if "spawn_main" in cmd]


@contextlib.contextmanager
def small_filesystem(path: Path, size: str):
    """A tmpfs of `size` at `path` (root only; skipped where mounts are not allowed)."""
    if os.geteuid() != 0:
        pytest.skip("a small filesystem needs root (tmpfs)")
    path.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]).returncode != 0:
        pytest.skip("this machine does not allow mounts (no CAP_SYS_ADMIN)")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)
