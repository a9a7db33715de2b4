"""The mla-convert command line. Each command parses options, calls one library function and
prints the result; errors become one line on stderr and a non-zero exit code."""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import os
from pathlib import Path
from typing import Annotated

import typer

from .family import MEMBERS, SUPPORTED_ARCHITECTURES, architectures_help
from .settings import RunSettings

app = typer.Typer(
    name="mla-convert",
    help="Convert MLA checkpoints of the DeepSeek-V3 family (DeepSeek-V3/R1/V3.1/V3.2, Kimi-K2, GLM-5, "
    "DeepSeek-V2, Moonlight; block-FP8 or BF16) for vLLM on Intel Gaudi (channel FP8 or bf16), with each MLA "
    "layer's W_UK_T / W_UV precomputed next to the model.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

OutOpt = Annotated[Path, typer.Option("--out", "-o", help="Output directory (created; must be empty).")]
FormatOpt = Annotated[
    str,
    typer.Option("--format", "-f", help="channel-fp8 (compressed-tensors, loads as is in vLLM/vllm-gaudi) or bf16."),
]
TargetOpt = Annotated[
    str, typer.Option("--target", "-t", help="FP8 range of the target: gaudi3 (max 448) or gaudi2 (max 240).")
]
WorkersOpt = Annotated[int, typer.Option("--workers", "-w", min=1, help="Shards converted in parallel (processes).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print a machine-readable JSON summary on stdout.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bars or tables.")]
OverwriteOpt = Annotated[bool, typer.Option("--overwrite", help="Delete the contents of a non-empty --out first.")]

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
DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="Print the plan and disk needed; write nothing.")]
ResumeOpt = Annotated[
    bool,
    typer.Option(
        "--resume",
        help="Finish an interrupted conversion in --out: verified files are kept, the rest redone. "
        "Refused if the source or options differ.",
    ),
]
DeviceOpt = Annotated[
    str, typer.Option("--device", help="Torch device for the arithmetic (cpu, cuda, hpu, ...). Output is identical.")
]
KernelsOpt = Annotated[
    str,
    typer.Option(
        "--kernels",
        help="auto: native C kernels built for this CPU, else torch.compile (large checkpoints), else eager; "
        "or native / compile / eager. Whatever runs is first checked bit-identical to eager.",
    ),
]
WriteIoOpt = Annotated[
    str,
    typer.Option(
        "--write-io",
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
def _errors_to_exit():
    """Library errors -> one line and their exit code; anything unexpected -> exit 70."""
    from .errors import ConvertError

    if os.environ.get("MLA_CONVERT_TRACEBACK"):
        yield
        return
    try:
        yield
    except ConvertError as e:
        _fail(str(e), e.exit_code)
    except KeyboardInterrupt:
        _fail("interrupted; the output directory is incomplete (finish it with --resume)", 130)
    except (typer.Exit, typer.Abort):
        raise
    except Exception as e:  # a bug: keep it to one line, traceback on request
        _fail(f"unexpected {type(e).__name__}: {e}", 70, hint=True)


@contextlib.contextmanager
def _byte_progress(enabled: bool, description: str):
    """Yields a factory(total_bytes) -> advance(nbytes) callback, or None when silenced."""
    if not enabled:
        yield None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=_console(stderr=True),
        transient=False,
    ) as bar:

        def factory(total: int):
            task = bar.add_task(description, total=total)
            return lambda n: bar.advance(task, n)

        yield factory


def _console(stderr: bool = False):
    from rich.console import Console

    return Console(stderr=stderr)


def _gb(n: int) -> str:
    return f"{n / 1e9:.3f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def _print_summary(summary: dict, title: str) -> None:
    from rich.table import Table

    table = Table(title=title, show_header=False)
    table.add_column(no_wrap=True)
    table.add_column(overflow="fold")  # paths must stay readable in a narrow terminal
    rows = [
        ("source", summary["source"]),
        ("output", summary["out"]),
        ("format / target", f"{summary['format']} / {summary['target']} (FP8 max {summary['fp8_max']:g})"),
        ("shards", str(summary["shards"])),
        ("tensors in -> out", f"{summary['tensors_in']} -> {summary['tensors_out']}"),
        ("block-FP8 weights converted", str(summary["fp8_weights_converted"])),
        ("16-bit linears quantized", str(summary["bf16_linears_quantized"])),
        ("MLA layers (W_UK_T / W_UV)", str(summary["mla_layers"])),
        ("bytes in", _gb(summary["bytes_in"])),
        ("bytes out (model + mla)", f"{_gb(summary['bytes_out_model'])} + {_gb(summary['bytes_out_mla'])}"),
        ("disk needed", _gb(summary["disk_needed"])),
    ]
    if "seconds" in summary:
        rows += [
            ("time", f"{summary['seconds']:.2f} s ({summary['gb_per_s']:.2f} GB/s of source)"),
            ("kernels", f"{summary['kernels']} on {summary['device']} ({summary['kernels_reason']})"),
            ("writes", f"{summary['write_io']} ({summary['write_io_reason']})"),
        ]
    if "verify" in summary:
        v = summary["verify"]
        verdict = "pass" if v["ok"] else f"FAIL ({v['failed']} failed)"
        rows += [("verify --source", f"{verdict}: {v['checks']} checks in {v['seconds']:.2f} s")]
    for k, v in rows:
        table.add_row(k, v)
    _console().print(table)


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
    device: DeviceOpt = RunSettings.device,
    kernels: KernelsOpt = RunSettings.kernels,
    write_io: WriteIoOpt = RunSettings.write_io,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Convert a checkpoint of the MLA family (block-FP8 or BF16) and precompute its MLA weights."""
    _start_heavy_process()
    from .convert import convert
    from .plan import Options

    with _errors_to_exit():
        options = Options(format=format, target=target, ignore=tuple(ignore or ()))
        settings = RunSettings(
            workers=workers, device=device, kernels=kernels, write_io=write_io, revision=revision,
            stream=stream, dry_run=dry_run, resume=resume, overwrite=overwrite,
        )  # fmt: skip
        if quiet or json_out:
            from huggingface_hub.utils import disable_progress_bars

            disable_progress_bars()
        with _byte_progress(not (quiet or json_out or dry_run), "converting") as progress:
            summary = convert(source, out, options, settings, progress_factory=progress)
    _report(summary, json_out, quiet, "Plan (dry run: nothing written)" if dry_run else "Converted")


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
    "supported checkpoint may be given instead.",
    epilog=CONVERT_EPILOG,
)(_with_default_source(convert_cmd, "deepseek-ai/DeepSeek-R1"))


def _report(summary: dict, json_out: bool, quiet: bool, title: str) -> None:
    if json_out:
        typer.echo(json.dumps(summary, indent=2))
    elif not quiet:
        _print_summary(summary, title)


@app.command()
def demo(
    out: Annotated[
        Path | None, typer.Option("--out", "-o", help="Where to put the demo (default: a new temporary directory).")
    ] = None,
    format: FormatOpt = "channel-fp8",
    target: TargetOpt = "gaudi3",
    member: Annotated[
        str,
        typer.Option("--family", help=f"Which member's tiny checkpoint: {', '.join(MEMBERS)}."),
    ] = MEMBERS[0],
    overwrite: OverwriteOpt = False,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Write a tiny checkpoint of a family member (DeepSeek-R1's by default), convert, verify, report. Offline."""
    from .demo import run_demo
    from .plan import Options

    with _errors_to_exit():
        summary, report = run_demo(out, Options(format=format, target=target), overwrite, member)
    _report(summary, json_out, quiet, f"Demo: tiny {member} checkpoint converted and verified")
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

    Exit code 0: every check passed; 1: a check failed; 2: verification could not run."""
    from .read_ahead import read_ahead_in_background
    from .verify.order import files_at_once, first_files

    read_ahead_in_background(first_files(dir, workers), files_at_once(workers))  # while torch loads
    _start_heavy_process()
    from .verify import verify

    with _errors_to_exit(), _byte_progress(not (quiet or json_out), "verifying") as progress:
        report = verify(dir, source, workers=workers, progress_factory=progress)
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
        table = Table(title=f"verify {report['dir']} ({report['format']} / {report['target']})")
        for col in ("group", "checks", "failed", "result"):
            table.add_column(col)
        for name, g in groups.items():
            result = f"skipped: {g['skipped']}" if g["skipped"] else "[red]FAIL" if g["failed"] else "[green]pass"
            table.add_row(name, str(g["checked"]), str(g["failed"]), result)
        _console().print(table)
        if report["worst_tensors"]:
            worst = Table(title="worst tensors against the source")
            worst.add_column("tensor", overflow="fold")
            for col in ("op", "max abs err", "rel err", "cosine", "of bound"):
                worst.add_column(col)
            for s in report["worst_tensors"]:
                worst.add_row(s["tensor"], s["op"], f"{s['max_abs_err']:.3g}", f"{s['rel_err']:.3g}",
                              f"{s['cosine']:.6f}", f"{s['bound_use']:.0%}")  # fmt: skip
            _console().print(worst)
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

    gc.disable()
    try:
        import torch  # noqa: F401
    finally:
        gc.enable()
    gc.freeze()
    from .heap import keep_freed_pages

    keep_freed_pages()


def main() -> None:
    import signal

    # Hitting a file size limit (ulimit -f) then fails the write with EFBIG, which becomes a clean
    # error with the partial file removed, instead of the default SIGXFSZ core dump.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    app(prog_name="mla-convert")


if __name__ == "__main__":
    main()
