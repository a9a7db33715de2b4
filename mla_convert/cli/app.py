"""The mla-convert command line: the Typer app, its commands (one module each: convert_cmd,
verify_cmd, demo_cmd, upload_cmd), and `main`. Each command parses options, calls one library function and
prints the result; errors become one line on stderr and an exit code (cli.errors)."""

from __future__ import annotations

import os
import signal
import sys
from typing import Annotated

import typer
import typer.core
from typer.core import TyperGroup

from mla_convert.cli import convert_cmd, demo_cmd, upload_cmd, verify_cmd
from mla_convert.cli.errors import EXIT_INTERRUPTED
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

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            typer.echo("error: interrupted", err=True)
            raise typer.Exit(EXIT_INTERRUPTED) from None


app = typer.Typer(
    name="mla-convert",
    cls=_OneLineErrors,
    help="Convert MLA checkpoints of the DeepSeek-V3 family (DeepSeek-V3/R1/V3.1/V3.2, Kimi-K2, GLM-5, "
    "DeepSeek-V2, Moonlight; block-FP8 or BF16) for vLLM on Intel Gaudi (channel FP8 or bf16), with each MLA "
    "layer's W_UK_T / W_UV precomputed next to the model.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
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


app.command("convert", epilog=convert_cmd.EPILOG)(convert_cmd.convert)
app.command("deepseek-r1", help=convert_cmd.R1_HELP, epilog=convert_cmd.EPILOG)(convert_cmd.deepseek_r1)
app.command("demo")(demo_cmd.demo)
app.command("verify")(verify_cmd.verify)
app.command("upload")(upload_cmd.upload)


def main() -> None:
    # Hitting a file size limit (ulimit -f) then fails the write with EFBIG, which becomes a clean
    # error with the partial file removed, instead of the default SIGXFSZ core dump.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    interrupts.install()
    try:
        app(prog_name="mla-convert")
    except SystemExit as e:
        if e.code == EXIT_INTERRUPTED and still_working():
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(EXIT_INTERRUPTED)
        raise
    finally:
        # The command is over: a Ctrl-C now could only cut the interpreter's shutdown short, where
        # Python's own handler is already gone and SIGINT would kill the process.
        interrupts.ignore()


if __name__ == "__main__":
    main()
