"""The mla-convert command line. Each command parses options, calls one library function and
prints the result; errors become one line on stderr and a non-zero exit code."""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import os
import shlex
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer
import typer.core
from typer.core import TyperGroup

from . import __version__, console
from .family import MEMBERS, SUPPORTED_ARCHITECTURES, architectures_help
from .out_dir import gb
from .settings import RunSettings

# The choices of the options whose values the library checks (plan.FORMATS and TARGETS,
# kernels.MODES, disk_write.MODES; tests/test_cli.py holds them equal). Spelled out here because
# those modules import torch, which --help must not wait for.
FORMATS = ("channel-fp8", "bf16")
TARGETS = ("gaudi3", "gaudi2")
KERNEL_MODES = ("auto", "native", "compile", "eager")
WRITE_MODES = ("auto", "direct", "buffered")
INTERRUPTED = "interrupted; the output directory is incomplete (finish it with --resume)"


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
            code = 130  # click's Abort stands for the user's interrupt
        if standalone_mode:
            sys.exit(code)
        return code

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            typer.echo("error: interrupted", err=True)
            raise typer.Exit(130) from None


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


def _choices(values: tuple[str, ...]) -> str:
    return f"[{'|'.join(values)}]"


OutOpt = Annotated[
    Path,
    typer.Option(
        "--out", "-o", help="Output directory: created, or empty, or (--overwrite) an earlier mla-convert output."
    ),
]
FormatOpt = Annotated[
    str,
    typer.Option(
        "--format",
        "-f",
        metavar=_choices(FORMATS),
        help="channel-fp8 (compressed-tensors, loads as is in vLLM/vllm-gaudi) or bf16.",
    ),
]
TargetOpt = Annotated[
    str,
    typer.Option(
        "--target",
        "-t",
        metavar=_choices(TARGETS),
        help="FP8 range of the target: gaudi3 (max 448) or gaudi2 (max 240).",
    ),
]
WorkersOpt = Annotated[int, typer.Option("--workers", "-w", min=1, help="Shards converted in parallel (processes).")]
JsonOpt = Annotated[
    bool, typer.Option("--json", help="Print a machine-readable JSON summary on stdout (progress stays on stderr).")
]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress, status lines or tables; errors only.")]
OverwriteOpt = Annotated[
    bool,
    typer.Option(
        "--overwrite",
        help="Replace an earlier mla-convert output in --out (recognised by its manifest, journal or --stream "
        "staging). Refused if --out holds any file mla-convert did not write.",
    ),
]

# convert's flags. Their defaults are read from RunSettings' class attributes (where a dataclass
# keeps each field's default), not from an instance: building one imports torch, too slow for --help.
SourceArg = Annotated[
    str,
    typer.Argument(
        help=f"Checkpoint directory or Hub repo id; its config.json names one of {', '.join(SUPPORTED_ARCHITECTURES)}."
    ),
]
IgnoreOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--ignore",
        help="Regex (matched at the start of module names) of linears to leave unquantized (block-FP8 ones "
        "dequantized to bf16, 16-bit ones copied), recorded as 're:' entries in the config's ignore list; "
        "repeatable. E.g. 'model\\.layers\\.\\d+\\.mlp\\.experts'.",
    ),
]
RevisionOpt = Annotated[str | None, typer.Option("--revision", help="Hub revision (branch, tag or commit).")]
StreamOpt = Annotated[
    bool,
    typer.Option(
        "--stream",
        help="Hub source: download each shard just before it is converted and delete it after, so the disk "
        "holds the output plus a few source shards (not the whole source).",
    ),
]
DryRunOpt = Annotated[
    bool,
    typer.Option("--dry-run", help="Print the plan, and the disk space needed against what is free; write nothing."),
]
ResumeOpt = Annotated[
    bool,
    typer.Option(
        "--resume",
        help="Finish an interrupted conversion in --out: verified files are kept, the rest redone. "
        "Refused if the source or options differ.",
    ),
]
IgnoreFreeSpaceOpt = Annotated[
    bool,
    typer.Option(
        "--ignore-free-space",
        help="Convert even when a filesystem reports less free space than the plan needs. For filesystems that "
        "misreport it (some network and FUSE filesystems, quotas the report does not show); where the space "
        "really runs out, the run stops with an error and can be finished with --resume.",
    ),
]
DeviceOpt = Annotated[
    str,
    typer.Option(
        "--device",
        help="Torch device for the arithmetic (cpu, cuda, hpu, ...). Used only where it gives the CPU's bytes: "
        "every process first checks it bit-identical to the CPU on a probe set, else the CPU converts and the "
        "summary says why.",
    ),
]
KernelsOpt = Annotated[
    str,
    typer.Option(
        "--kernels",
        metavar=_choices(KERNEL_MODES),
        help="auto: native C kernels built for this CPU, else torch.compile (large checkpoints), else eager; "
        "or native / compile / eager. Whatever runs is first checked bit-identical to eager.",
    ),
]
WriteIoOpt = Annotated[
    str,
    typer.Option(
        "--write-io",
        metavar=_choices(WRITE_MODES),
        help="auto: write shards with O_DIRECT on a local disk filesystem (ext4, xfs, btrfs, ...) that accepts "
        "it (no page-cache copy, far less CPU), else through the page cache (NFS, FUSE, tmpfs); or direct / "
        "buffered. The bytes written are the same.",
    ),
]


def _fail(message: str, code: int, hint: bool = False) -> None:
    typer.echo(f"error: {message}", err=True)
    if hint:
        typer.echo("(set MLA_CONVERT_TRACEBACK=1 to see the traceback)", err=True)
    raise typer.Exit(code)


@contextlib.contextmanager
def _errors_to_exit(interrupted: str | Callable[[], str] = INTERRUPTED):
    """Library errors and failures of the environment -> one line and exit code 2 (130 for Ctrl-C,
    saying `interrupted`, or what it returns); anything else is a bug -> exit 70.

    The line is printed once the error is handled, not inside the handler: the exception's
    traceback, and with it every frame and tensor of the failed command, is let go first."""
    from .errors import ConvertError, network_errors

    if os.environ.get("MLA_CONVERT_TRACEBACK"):
        yield
        return
    hint = False
    try:
        yield
        return
    except ConvertError as e:
        message, code = str(e), e.exit_code
    except KeyboardInterrupt:
        message, code = (interrupted if isinstance(interrupted, str) else interrupted()), 130
    except (typer.Exit, typer.Abort):
        raise
    except OSError as e:  # a disk, a mount, a permission, the network: the environment, not a bug
        message, code = (f"{e.filename}: " if e.filename else "") + f"{e.strerror or e}", 2
    except network_errors() as e:
        message, code = f"network error: {type(e).__name__}: {e}", 2
    except MemoryError:
        message, code = "out of memory; close other programs, or use fewer --workers", 2
    except Exception as e:  # a bug: keep it to one line, traceback on request
        message, code, hint = f"unexpected {type(e).__name__}: {e}", 70, True
    _fail(message, code, hint)


CONVERT_EPILOG = "Supported architectures (detected from config.json):\n\n" + architectures_help()


@app.command("convert", epilog=CONVERT_EPILOG)
def convert_cmd(
    source: SourceArg,
    out: OutOpt = ...,
    format: FormatOpt = "channel-fp8",
    target: TargetOpt = "gaudi3",
    ignore: IgnoreOpt = None,
    revision: RevisionOpt = RunSettings.revision,
    stream: StreamOpt = RunSettings.stream,
    workers: WorkersOpt = RunSettings.workers,
    dry_run: DryRunOpt = RunSettings.dry_run,
    overwrite: OverwriteOpt = RunSettings.overwrite,
    resume: ResumeOpt = RunSettings.resume,
    ignore_free_space: IgnoreFreeSpaceOpt = RunSettings.ignore_free_space,
    device: DeviceOpt = RunSettings.device,
    kernels: KernelsOpt = RunSettings.kernels,
    write_io: WriteIoOpt = RunSettings.write_io,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Convert a checkpoint of the MLA family (block-FP8 or BF16) and precompute its MLA weights."""
    with _errors_to_exit(functools.partial(_convert_interrupted, out)), console.reporter(quiet, "converting") as report:
        report.status("starting (loading torch)")
        _start_heavy_process()
        from .convert import convert
        from .plan import Options

        options = Options(format=format, target=target, ignore=tuple(ignore or ()))
        settings = RunSettings(
            workers=workers, device=device, kernels=kernels, write_io=write_io, revision=revision,
            stream=stream, dry_run=dry_run, resume=resume, overwrite=overwrite,
            ignore_free_space=ignore_free_space, progress_factory=None if dry_run else report.progress_factory,
            status=report.status, notice=report.notice,
        )  # fmt: skip
        if quiet or json_out:
            from huggingface_hub.utils import disable_progress_bars, logging

            disable_progress_bars()
            if quiet:  # its retry warnings too: errors only
                logging.set_verbosity_error()
        summary = convert(source, out, options, settings)
    _report(summary, json_out, quiet, "Plan (dry run: nothing written)" if dry_run else "Converted", source)


def _convert_interrupted(out: Path) -> str:
    """What an interrupted conversion left in --out, for the one line that says so."""
    from .manifest import COMPLETE, MANIFEST_NAME, readable_manifest

    if not (out / MANIFEST_NAME).is_file():
        return f"interrupted before the conversion wrote to {out}"
    if (readable_manifest(out) or {}).get("status") == COMPLETE:
        return f"interrupted; {out} holds a finished conversion"
    return INTERRUPTED


def _with_default_source(command, default: str):
    """`command` with SOURCE optional, defaulting to `default`: a preset of the same options,
    declared once (Typer reads the options from the signature)."""

    @functools.wraps(command)
    def preset(**kwargs):
        return command(**kwargs)

    sig = inspect.signature(command, eval_str=True)
    preset.__signature__ = sig.replace(
        parameters=[p.replace(default=default) if p.name == "source" else p for p in sig.parameters.values()]
    )
    return preset


app.command(
    "deepseek-r1",
    help="The convert command with DeepSeek-R1 (deepseek-ai/DeepSeek-R1) as the default SOURCE; any "
    "supported checkpoint may be given instead. A Hub source is planned from its file list and shard "
    "headers first: the sizes and the disk space needed against what is free are printed, and a disk too "
    "small is refused, before anything is downloaded.",
    epilog=CONVERT_EPILOG,
)(_with_default_source(convert_cmd, "deepseek-ai/DeepSeek-R1"))


def _report(summary: dict, json_out: bool, quiet: bool, title: str, source_arg: str | None = None) -> None:
    if summary.get("device_check") in ("differed", "failed") and not quiet:  # the user asked for that device
        typer.echo(f"warning: --device {summary['device']}: {summary['device_reason']}", err=True)
    if json_out:
        typer.echo(json.dumps(summary, indent=2))
    elif not quiet:
        console.print_summary(summary, title, source_arg)


@app.command()
def demo(
    out: Annotated[
        Path | None, typer.Option("--out", "-o", help="Where to put the demo (default: a new temporary directory).")
    ] = None,
    format: FormatOpt = "channel-fp8",
    target: TargetOpt = "gaudi3",
    member: Annotated[
        str,
        typer.Option("--family", metavar=_choices(MEMBERS), help="Which member's tiny checkpoint."),
    ] = MEMBERS[0],
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Replace an earlier demo in --out (and nothing else).")
    ] = False,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Write a tiny checkpoint of a family member (DeepSeek-R1's by default), convert, verify, report. Offline."""
    with _errors_to_exit("demo interrupted; run it again with --overwrite, or remove its directory"):
        from .demo import run_demo
        from .plan import Options

        summary, report = run_demo(out, Options(format=format, target=target), overwrite, member)
    _report(summary, json_out, quiet, f"Demo: tiny {member} checkpoint converted and verified")
    if not (json_out or quiet):
        where = shlex.quote(summary["demo_dir"])
        console.print_lines(
            console.rich_console(),
            [("demo files", f"{where} ({gb(summary['demo_bytes'])}: the tiny source and its conversion)"),
             ("remove them", f"rm -r {where}")],
        )  # fmt: skip
    if not report["ok"]:
        console.print_verify_report(report, quiet=True)  # the failures, one per line
        raise typer.Exit(1)


@app.command("verify")
def verify_cmd(
    dir: Annotated[Path, typer.Argument(metavar="DIR", help="A directory written by mla-convert convert.")],
    source: Annotated[
        str | None,
        typer.Option("--source", "-s", help="Its source checkpoint: compare every tensor with the exact dequant."),
    ] = None,
    workers: Annotated[int, typer.Option("--workers", "-w", min=1, help="Files checked in parallel (processes).")] = 1,
    json_out: Annotated[bool, typer.Option("--json", help="Print the full report as JSON on stdout.")] = False,
    quiet: QuietOpt = False,
) -> None:
    """Check a converted directory: structure, file hashes, values, MLA artifacts, and against --source.

    Exit code 0: every check passed; 1: a check failed; 2: verification could not run; 130: interrupted
    (verify only reads: nothing was changed)."""
    from .read_ahead import read_ahead_in_background
    from .verify.order import files_at_once, first_files

    read_ahead_in_background(first_files(dir, workers), files_at_once(workers))  # while torch loads
    with _errors_to_exit("verify interrupted; nothing was changed"), console.reporter(quiet, "verifying") as progress:
        progress.status("starting (loading torch)")
        _start_heavy_process()
        from .verify import verify

        progress.status(f"reading the headers in {dir}")
        report = verify(dir, source, workers=workers, progress_factory=progress.progress_factory)
    if json_out:
        typer.echo(json.dumps(report, indent=2))
    else:
        console.print_verify_report(report, quiet)
    raise typer.Exit(report["exit_code"])


def _start_heavy_process() -> None:
    """What a converting or verifying command does first (its workers: workers.worker_init).

    Import torch with the cyclic GC paused, then keep its objects out of later collections: its
    import creates a great many long-lived objects, and the GC would walk them again and again on
    the way, a large part of every command's start-up. Then keep freed heap pages (heap.py).
    """
    import gc

    from . import interrupts

    # A Ctrl-C raised inside torch's import can be swallowed by its C code (torch._C imports numpy
    # and goes on without it when that fails), leaving a command that runs on: it is held back
    # until the import is done, and raised then.
    gc.disable()
    try:
        with interrupts.deferred():
            import torch  # noqa: F401
    finally:
        gc.enable()
    gc.freeze()
    from .heap import keep_freed_pages

    keep_freed_pages()


def _still_working() -> bool:
    """Whether threads that an interrupted command leaves to finish on their own are still at it:
    verify's file readers (each on its tensor: seconds, on R1's largest) or a --stream download
    (minutes). Their memory is their own and nothing they do is left to finalize, so the process
    ends as soon as it has said why, without waiting for them (os._exit in main)."""
    names = []
    if "mla_convert.verify.api" in sys.modules:
        names.append(sys.modules["mla_convert.verify.api"].FILE_THREADS_NAME)
    if "mla_convert.hub" in sys.modules:
        names.append(sys.modules["mla_convert.hub"].DOWNLOAD_THREAD_NAME)
    return any(t.is_alive() and t.name.startswith(tuple(names)) for t in threading.enumerate()) if names else False


def main() -> None:
    import signal

    from . import interrupts

    # Hitting a file size limit (ulimit -f) then fails the write with EFBIG, which becomes a clean
    # error with the partial file removed, instead of the default SIGXFSZ core dump.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    interrupts.install()
    try:
        app(prog_name="mla-convert")
    except SystemExit as e:
        if e.code == 130 and _still_working():
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(130)
        raise
    finally:
        # The command is over: a Ctrl-C now could only cut the interpreter's shutdown short, where
        # Python's own handler is already gone and SIGINT would kill the process.
        interrupts.ignore()


if __name__ == "__main__":
    main()
