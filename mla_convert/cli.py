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
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer
import typer.core
from typer.core import TyperGroup

from . import __version__
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
PROGRESS_INTERVAL = 30.0  # seconds between progress lines when stderr is not a terminal
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


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class _Lines:
    """Progress for a log (stderr not a terminal: nohup, CI, a job scheduler): one plain line every
    `interval` seconds with the bytes done, the speed and the time left."""

    def __init__(self, description: str, total: int, interval: float):
        self.description, self.total, self.interval = description, total, interval
        self.done = 0
        self.start = self.last = time.monotonic()
        self.lock = threading.Lock()  # verify advances from several threads

    def advance(self, n: int) -> None:
        with self.lock:
            self.done += n
            now = time.monotonic()
            if now - self.last < self.interval:
                return
            self.last = now
            rate = self.done / max(now - self.start, 1e-9)
            left = max(self.total - self.done, 0)
            eta = _duration(left / rate) if rate > 0 else "unknown"
            pct = 100 * self.done / self.total if self.total else 100.0
            typer.echo(
                f"{self.description}: {gb(self.done)} of {gb(self.total)} ({pct:.1f} %), "
                f"{rate / 1e9:.2f} GB/s, about {eta} left",
                err=True,
            )


class _Reporter:
    """What a long command shows on stderr while it works: on a terminal a status line through
    start-up and then a progress bar that ends at 100 %; in a log, plain progress lines at a steady
    interval (MLA_CONVERT_PROGRESS_INTERVAL seconds, default 30); with --quiet, nothing. A notice
    (a line worth keeping, such as the plan) is printed in every mode but quiet."""

    def __init__(self, quiet: bool, description: str):
        self.quiet, self.description = quiet, description
        self.tty = sys.stderr.isatty()
        self.interval = float(os.environ.get("MLA_CONVERT_PROGRESS_INTERVAL") or PROGRESS_INTERVAL)
        self.console = _console(stderr=True)
        self.spinner = None
        self.bar = None
        self.tasks: list = []

    def status(self, message: str) -> None:
        if self.quiet or not self.tty or self.bar is not None:
            return
        if self.spinner is None:
            self.spinner = self.console.status(message)
            self.spinner.start()
        else:
            self.spinner.update(message)

    def notice(self, message: str) -> None:
        if not self.quiet:
            self.console.print(message, soft_wrap=True, highlight=False, markup=False)

    def _stop_spinner(self) -> None:
        if self.spinner is not None:
            self.spinner.stop()
            self.spinner = None

    def progress_factory(self, total: int):
        if self.quiet:
            return None
        if not self.tty:
            return _Lines(self.description, total, self.interval).advance
        self._stop_spinner()
        if self.bar is None:
            from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

            self.bar = Progress(
                "[progress.description]{task.description}",
                BarColumn(),
                DownloadColumn(),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
                console=self.console,
                transient=False,
            )
            self.bar.start()
        task = self.bar.add_task(self.description, total=total)
        self.tasks.append(task)
        return lambda n: self.bar.advance(task, n)

    def close(self, finished: bool) -> None:
        self._stop_spinner()
        if self.bar is not None:
            if finished:  # what was counted may fall short of the total (headers, a resume's kept files)
                for task in self.tasks:
                    self.bar.update(task, completed=self.bar.tasks[task].total)
            self.bar.stop()
            self.bar = None


@contextlib.contextmanager
def _reporter(quiet: bool, description: str):
    reporter = _Reporter(quiet, description)
    finished = False
    try:
        yield reporter
        finished = True
    finally:
        reporter.close(finished)


def _console(stderr: bool = False):
    from rich.console import Console

    return Console(stderr=stderr)


def _print_summary(summary: dict, title: str, source_arg: str | None = None) -> None:
    """The summary table, then the paths and the next commands as whole lines (soft-wrapped: a
    narrow terminal folds them, but they copy and paste whole)."""
    from rich.table import Table

    table = Table(title=title, show_header=False)
    table.add_column(no_wrap=True)
    table.add_column()
    fmt = summary["format"]
    target = f"{fmt} / {summary['target']} (FP8 max {summary['fp8_max']:g})" if fmt != "bf16" else "bf16"
    rows = [
        ("format / target" if fmt != "bf16" else "format", target),
        ("shards", str(summary["shards"])),
        ("tensors in -> out", f"{summary['tensors_in']} -> {summary['tensors_out']}"),
        ("block-FP8 weights converted", str(summary["fp8_weights_converted"])),
        ("16-bit linears quantized", str(summary["bf16_linears_quantized"])),
        ("MLA layers (W_UK_T / W_UV)", str(summary["mla_layers"])),
        ("bytes in", gb(summary["bytes_in"])),
        ("bytes out (model + mla)", f"{gb(summary['bytes_out_model'])} + {gb(summary['bytes_out_mla'])}"),
        ("disk needed", gb(summary["disk_needed"])),
    ]
    if "disk_needed_stream" in summary:
        rows += [
            ("disk needed, download then convert", gb(summary["disk_needed_download_then_convert"])),
            ("disk needed, --stream", gb(summary["disk_needed_stream"])),
        ]
    if "disk_free" in summary:
        rows.append(("free space", _space_row(summary)))
    if summary.get("resumed_jobs"):
        kept = summary["resumed_jobs"]
        rows.append(
            ("resumed", f"kept {kept} of {summary['shards']} shard jobs (re-hashed), redid {summary['shards'] - kept}")
        )
    if "seconds" in summary:
        rows += [
            ("time", f"{summary['seconds']:.2f} s ({summary['gb_per_s']:.2f} GB/s of source)"),
            ("kernels", f"{summary['kernels']} on {summary.get('compute_device', summary['device'])} "
             f"({summary['kernels_reason']})"),
        ]  # fmt: skip
        if summary["device"] != "cpu" and summary.get("device_reason"):
            rows.append(("device", f"{summary['device']}: {summary['device_check']} ({summary['device_reason']})"))
        rows.append(("writes", f"{summary['write_io']} ({summary['write_io_reason']})"))
    if "verify" in summary:
        v = summary["verify"]
        verdict = "pass" if v["ok"] else f"FAIL ({v['failed']} failed)"
        rows += [("verify --source", f"{verdict}: {v['checks']} checks in {v['seconds']:.2f} s")]
    for k, v in rows:
        table.add_row(k, v)
    console = _console()
    console.print(table)
    _print_lines(console, [("source", summary["source"]), ("output", summary["out"])])
    if "seconds" in summary and source_arg is not None:
        out = shlex.quote(summary["out"])
        check = f"mla-convert verify {out}" + (
            f" --source {shlex.quote(source_arg)}" if "peak_source_bytes_on_disk" not in summary else ""
        )
        _print_lines(console, [("to check it", check), ("to serve it", f"vllm serve {out}")])


def _space_row(summary: dict) -> str:
    row = f"{gb(summary['disk_required'])} needed of {gb(summary['disk_free'])} free"
    if summary.get("disk_freed_by_overwrite"):
        row += f" (+{gb(summary['disk_freed_by_overwrite'])} freed by --overwrite)"
    if "cache_dir" in summary:
        row += f"; download {gb(summary['cache_required'])} of {gb(summary['cache_free'])} free in the Hub cache"
    short = summary["disk_required"] > summary["disk_free"] + summary.get("disk_freed_by_overwrite", 0) or (
        summary.get("cache_required", 0) > summary.get("cache_free", 0)
    )
    return row + (": NOT ENOUGH" if short else "")


def _print_lines(console, items: list[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in items)
    for k, v in items:
        console.print(f"{k + ':':<{width + 1}} {v}", soft_wrap=True, highlight=False, markup=False)


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
    with _errors_to_exit(functools.partial(_convert_interrupted, out)), _reporter(quiet, "converting") as report:
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
        _print_summary(summary, title, source_arg)


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
        _print_lines(
            _console(),
            [("demo files", f"{where} ({gb(summary['demo_bytes'])}: the tiny source and its conversion)"),
             ("remove them", f"rm -r {where}")],
        )  # fmt: skip
    if not report["ok"]:
        _print_verify_report(report, quiet=True)  # the failures, one per line
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
    with _errors_to_exit("verify interrupted; nothing was changed"), _reporter(quiet, "verifying") as progress:
        progress.status("starting (loading torch)")
        _start_heavy_process()
        from .verify import verify

        progress.status(f"reading the headers in {dir}")
        report = verify(dir, source, workers=workers, progress_factory=progress.progress_factory)
    if json_out:
        typer.echo(json.dumps(report, indent=2))
    else:
        _print_verify_report(report, quiet)
    raise typer.Exit(report["exit_code"])


def _print_verify_report(report: dict, quiet: bool, listed: int = 10) -> None:
    """A table of the check groups; then each failure on one line (all of them also with --quiet)."""
    from rich.table import Table

    groups = report["groups"]
    if not quiet:
        console = _console()
        table = Table(title=f"verify ({report['format']} / {report['target']})")
        for col in ("group", "checks", "failed", "result"):
            table.add_column(col)
        for name, g in groups.items():
            result = f"skipped: {g['skipped']}" if g["skipped"] else "[red]FAIL" if g["failed"] else "[green]pass"
            table.add_row(name, str(g["checked"]), str(g["failed"]), result)
        console.print(table)
        _print_lines(
            console, [("checked", report["dir"])] + ([("against", report["source"])] if report["source"] else [])
        )
        if report["worst_tensors"]:
            worst = Table(title="worst tensors against the source")
            worst.add_column("tensor", overflow="fold")
            for col in ("op", "max abs err", "rel err", "cosine", "of bound"):
                worst.add_column(col)
            for s in report["worst_tensors"]:
                worst.add_row(s["tensor"], s["op"], f"{s['max_abs_err']:.3g}", f"{s['rel_err']:.3g}",
                              f"{s['cosine']:.6f}", f"{s['bound_use']:.0%}")  # fmt: skip
            console.print(worst)
    for name, g in groups.items():
        for f in g["failures"][: None if quiet else listed]:
            typer.echo(f["message"], err=True)
        more = g["failed"] - (len(g["failures"][:listed]) if not quiet else len(g["failures"]))
        if more > 0:
            typer.echo(f"[{name}] ... and {more} more failures (--json lists {len(g['failures'])})", err=True)
    if not quiet:
        total = sum(g["checked"] for g in groups.values())
        failed = sum(g["failed"] for g in groups.values())
        verdict = "[green]PASS" if report["ok"] else f"[red]FAIL: {failed} of {total} checks failed"
        _console().print(f"{verdict}[/] ({total} checks, {report['seconds']:.2f} s)")
        _console().print(f"fp8 readers: {report['readers']} ({report['readers_reason']})", style="dim")


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
