"""Errors as a command shows them: one `error:` line on stderr and an exit code (README, "Exit
codes"); with MLA_CONVERT_TRACEBACK=1 the Python traceback instead, with the chain of causes."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import typer

from mla_convert import envs
from mla_convert.errors import ConvertError, network_errors

INTERRUPTED = "interrupted; the output directory is incomplete (finish it with --resume)"
EXIT_INTERRUPTED = 130  # the shell's code for SIGINT
EXIT_BUG = 70  # EX_SOFTWARE: an internal error


def fail(message: str, code: int, hint: bool = False) -> None:
    typer.echo(f"error: {message}", err=True)
    if hint:
        typer.echo(f"(set {envs.TRACEBACK}=1 to see the traceback)", err=True)
    raise typer.Exit(code)


@contextlib.contextmanager
def errors_to_exit(interrupted: str | Callable[[], str] = INTERRUPTED):
    """Library errors and failures of the environment -> one line and exit code 2 (130 for Ctrl-C,
    saying `interrupted`, or what it returns); anything else is a bug -> exit 70.

    The line is printed once the error is handled, not inside the handler: the exception's
    traceback, and with it every frame and tensor of the failed command, is let go first."""
    try:
        show_traceback = envs.traceback()
    except ConvertError as e:
        fail(str(e), e.exit_code)
    if show_traceback:
        yield
        return
    hint = False
    try:
        yield
        return
    except ConvertError as e:
        message, code = str(e), e.exit_code
    except KeyboardInterrupt:
        message, code = (interrupted if isinstance(interrupted, str) else interrupted()), EXIT_INTERRUPTED
    except (typer.Exit, typer.Abort):
        raise
    except OSError as e:  # a disk, a mount, a permission, the network: the environment, not a bug
        message, code = (f"{e.filename}: " if e.filename else "") + f"{e.strerror or e}", 2
    except network_errors() as e:
        message, code = f"network error: {type(e).__name__}: {e}", 2
    except MemoryError:
        message, code = "out of memory; close other programs, or use fewer --workers", 2
    except Exception as e:  # a bug: keep it to one line, traceback on request
        message, code, hint = f"unexpected {type(e).__name__}: {e}", EXIT_BUG, True
    fail(message, code, hint)
