"""The mla-convert command line: the Typer app, its commands (one module each: convert_cmd,
verify_cmd, demo_cmd, upload_cmd), and `main`. Each command parses options, calls one library function and
prints the result; errors become one line on stderr and an exit code (cli.errors)."""

from __future__ import annotations

import difflib
import os
import signal
import sys
from typing import Annotated

import typer
import typer.core
from typer.core import TyperGroup

from mla_convert.cli import card_cmd, convert_cmd, demo_cmd, stdio_guard, upload_cmd, verify_cmd
from mla_convert.cli.errors import EXIT_INTERRUPTED, INTERRUPTED_CODES
from mla_convert.cli.help import Command, app_summary, whole_words
from mla_convert.cli.startup import still_working
from mla_convert.process import interrupts
from mla_convert.version import __version__

# The click that Typer runs on: its own copy from Typer 0.2x, the click package before.
_click = getattr(typer.core, "_click", None) or __import__("click")
_NoArgsIsHelp = getattr(_click.exceptions, "NoArgsIsHelpError", ())


class _OneLineErrors(TyperGroup):
    """Typer's own refusals (a bad option value, a missing argument, an unknown option) as one
    `error:` line with exit code 2, like the library's, instead of a framed usage panel; and a
    Ctrl-C outside a command's own handling (while the options parse, while the summary prints) as one
    line with exit code 130."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
            code = rv if isinstance(rv, int) else 0
        except _NoArgsIsHelp as e:
            typer.echo(e.ctx.get_help())
            code = 0
        except _click.exceptions.ClickException as e:
            if isinstance(e, _click.exceptions.NoSuchOption):
                e.possibilities = _closest(e.option_name, e.possibilities or ())
            message = " ".join(e.format_message().split())
            hint = f" (see {e.ctx.command_path} --help)" if getattr(e, "ctx", None) is not None else ""
            typer.echo(f"error: {message}{hint}", err=True)
            code = e.exit_code
        except typer.Abort:  # the same class in every Typer (its own, or click's re-exported)
            typer.echo("error: aborted", err=True)
            code = EXIT_INTERRUPTED  # click's Abort stands for the user's interrupt
        if standalone_mode:
            sys.exit(code)
        return code

    def format_help(self, ctx, formatter) -> None:
        with whole_words(formatter):
            super().format_help(ctx, formatter)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt as e:
            typer.echo(f"error: {interrupts.stopped_by(e)}", err=True)
            raise typer.Exit(interrupts.exit_code(e)) from None


def _closest(typed: str, options) -> list[str]:
    """Of click's suggestions for a mistyped option (difflib's close matches), the closest only:
    `--fromat` is `--format`, not also `--out`."""
    ratio = {o: difflib.SequenceMatcher(None, typed, o).ratio() for o in options}
    return [o for o in options if ratio[o] == max(ratio.values())]


app = typer.Typer(
    name="mla-convert",
    cls=_OneLineErrors,
    help=app_summary(),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain help, wrapped at the terminal's width (cli.help)
)


def _show_version(value: bool) -> None:
    if value:
        typer.echo(f"mla-convert {__version__}")
        raise typer.Exit()


@app.callback()
def _main_options(
    version: Annotated[
        bool, typer.Option("--version", is_eager=True, callback=_show_version, help="Print the version and exit.")
    ] = False,
) -> None:
    pass


# short_help: the commands' list shows each whole in 80 columns (click cuts a longer one with '...').
app.command(
    "convert", cls=Command, short_help="Convert a checkpoint; precompute its MLA weights.", epilog=convert_cmd.EPILOG
)(convert_cmd.convert)
app.command(
    "deepseek-r1", cls=Command, short_help="convert, with DeepSeek-R1 as the default SOURCE.", help=convert_cmd.R1_HELP,
    epilog=convert_cmd.EPILOG,
)(convert_cmd.deepseek_r1)  # fmt: skip
app.command("demo", cls=Command, short_help="A tiny checkpoint converted and verified, offline.")(demo_cmd.demo)
app.command("verify", cls=Command, short_help="Check a converted directory, and against its source.")(verify_cmd.verify)
app.command("upload", cls=Command, short_help="Publish a converted directory on the Hugging Face Hub.")(
    upload_cmd.upload
)
app.command("card", cls=Command, short_help="Write a converted directory's model card again.")(card_cmd.card)


def main() -> None:
    stdio_guard.reopen_closed()  # first: no output file may take fd 0, 1 or 2 (cli.stdio_guard)
    # Hitting a file size limit (ulimit -f) then fails the write with EFBIG, which becomes a clean
    # error with the partial file removed, instead of the default SIGXFSZ core dump.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    stdio_guard.guard()  # a lost reader of stdout or stderr is not the command's failure (cli.stdio_guard)
    interrupts.install()
    try:
        code = _run()
    finally:
        # The command is over: a signal now could only cut the interpreter's shutdown short, where
        # Python's own handlers are already gone and SIGINT or SIGTERM would kill the process.
        interrupts.ignore()
    code = stdio_guard.outcome(code)
    if code in INTERRUPTED_CODES and still_working():
        os._exit(code)
    sys.exit(code)


def _run() -> int:
    try:
        app(prog_name="mla-convert")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


if __name__ == "__main__":
    main()
