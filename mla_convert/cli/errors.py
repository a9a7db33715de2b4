"""Errors as a command shows them: one `error:` line on stderr and an exit code (README, "Exit
codes"); with MLA_CONVERT_TRACEBACK=1 the Python traceback instead, with the chain of causes."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import typer

from mla_convert import envs
from mla_convert.errors import ConvertError, network_errors
from mla_convert.process import interrupts

INTERRUPTED = "interrupted; the output directory is incomplete (finish it with --resume)"
EXIT_INTERRUPTED = 130  # the shell's code for SIGINT
# 128 + the signal, as a shell reports a process it ended: SIGHUP, SIGINT, SIGTERM (README, "Exit codes").
INTERRUPTED_CODES = frozenset(128 + s for s in interrupts.STOP_SIGNALS)
EXIT_BUG = 70  # EX_SOFTWARE: an internal error
NextStep = Callable[[BaseException], "str | None"]  # a failure -> what the user does next, or None


def fail(message: str, code: int, hint: bool = False) -> None:
    typer.echo(f"error: {message}", err=True)
    if hint:
        typer.echo(f"(set {envs.TRACEBACK}=1 to see the traceback)", err=True)
    raise typer.Exit(code)


@contextlib.contextmanager
def errors_to_exit(interrupted: str | Callable[[], str] = INTERRUPTED, next_step: NextStep | None = None):
    """Library errors and failures of the environment -> one line and exit code 2, ending with what
    `next_step` says to do about it, if anything; Ctrl-C, SIGTERM or SIGHUP -> `interrupted` (or
    what it returns), naming a signal other than SIGINT, and exit code 128 + the signal; anything
    else is a bug -> exit 70.

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
    except ConvertError as e:  # an option refused: named as the command line names it (OptionError.flags)
        message, code = _with_next_step(getattr(e, "flags", None) or str(e), e, next_step), e.exit_code
    except KeyboardInterrupt as e:  # SIGINT, SIGTERM, SIGHUP (process.interrupts.Interrupted)
        said = interrupted if isinstance(interrupted, str) else interrupted()
        message, code = said.replace("interrupted", interrupts.stopped_by(e), 1), interrupts.exit_code(e)
    except (typer.Exit, typer.Abort):
        raise
    except OSError as e:  # a disk, a mount, a permission, the network: the environment, not a bug
        message = (f"{e.filename}: " if e.filename else "") + f"{e.strerror or e}"
        message, code = _with_next_step(message, e, next_step), 2
    except network_errors() as e:
        message, code = _with_next_step(f"network error: {type(e).__name__}: {e}", e, next_step), 2
    except MemoryError:
        message, code = "out of memory; close other programs, or use fewer --workers", 2
    except Exception as e:  # a bug: keep it to one line, traceback on request
        message, code, hint = f"unexpected {type(e).__name__}: {e}", EXIT_BUG, True
    fail(message, code, hint)


def _with_next_step(message: str, e: BaseException, next_step: NextStep | None) -> str:
    """The message, and what to do next where the command knows and the message does not say."""
    step = next_step(e) if next_step else None
    return f"{message}; {step}" if step and step not in message else message
