"""`mla-convert convert SOURCE --out DIR`, and its preset `deepseek-r1` (DeepSeek-R1 as the default
SOURCE)."""

from __future__ import annotations

import errno
import functools
import inspect
import json
from pathlib import Path
from typing import Annotated

import typer

from mla_convert.cli import console
from mla_convert.cli.errors import INTERRUPTED, errors_to_exit
from mla_convert.cli.options import (
    BaseModelOpt,
    DeviceOpt,
    DryRunOpt,
    FormatOpt,
    IgnoreFreeSpaceOpt,
    IgnoreOpt,
    JsonOpt,
    KernelsOpt,
    NoCardOpt,
    OutOpt,
    OverwriteOpt,
    QuietOpt,
    ResumeOpt,
    RevisionOpt,
    SourceArg,
    StreamOpt,
    TargetOpt,
    WorkersOpt,
    WriteIoOpt,
)
from mla_convert.cli.startup import start_heavy_process
from mla_convert.cli.upload_cmd import CreateOpt, PrivateOpt
from mla_convert.constants import COMPLETE, INCOMPLETE, MANIFEST_NAME
from mla_convert.errors import network_errors
from mla_convert.output.manifest import readable_manifest
from mla_convert.results import ConversionResult, DemoResult
from mla_convert.settings import Options, RunSettings, UploadOptions
from mla_convert.source.family import architectures_help
from mla_convert.units import gb

DEFAULT_R1 = "deepseek-ai/DeepSeek-R1"
UploadToOpt = Annotated[
    str | None,
    typer.Option(
        "--upload",
        metavar="OWNER/NAME",
        help="Publish to this Hub model repo as it converts: each file checked as verify --source checks it, sent, "
        "and deleted from --out once committed; what makes the repo a model goes in the last commit. A Hub "
        "source is streamed. Token: huggingface_hub's (HF_TOKEN). --overwrite also replaces another model's "
        "files in the branch; --resume finishes an interrupted run, sending nothing the branch holds.",
    ),
]
UploadBranchOpt = Annotated[
    str | None,
    typer.Option("--upload-branch", metavar="BRANCH", help="With --upload: the branch to commit to (default: main)."),
]
MaxDiskOpt = Annotated[
    str | None,
    typer.Option(
        "--max-disk",
        metavar="SIZE",
        help="With --upload: the most --out may hold at once, source shards and output files (e.g. 40GB, 37GiB; "
        "default: 40 GB, or less where the run needs less or the disk has less free). --dry-run prints the "
        "smallest that works; a smaller one is refused before anything starts.",
    ),
]
EPILOG = (
    "Supported architectures (detected from config.json, or from a member's own config file):\n\n"
    + architectures_help()
)
R1_HELP = (
    "The convert command with DeepSeek-R1 (deepseek-ai/DeepSeek-R1) as the default SOURCE; any supported "
    "checkpoint may be given instead. A Hub source is planned from its file list and shard headers first: the "
    "sizes and the disk space needed against what is free are printed, and a disk too small is refused, before "
    "anything is downloaded."
)


# The defaults are read from RunSettings' class attributes (where a dataclass keeps each field's
# default), not from an instance; and Options' from its fields: the one home of each default.
def convert(
    source: SourceArg,
    out: OutOpt = ...,
    format: FormatOpt = Options.format,
    target: TargetOpt = Options.target,
    ignore: IgnoreOpt = None,
    no_card: NoCardOpt = not Options.card,
    base_model: BaseModelOpt = Options.base_model,
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
    upload: UploadToOpt = None,
    upload_branch: UploadBranchOpt = None,
    create: CreateOpt = UploadOptions.create,
    private: PrivateOpt = UploadOptions.private,
    max_disk: MaxDiskOpt = None,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Convert a checkpoint of the MLA family (block-FP8, BF16, or INT4 experts) and precompute its MLA weights."""
    with (
        errors_to_exit(functools.partial(_interrupted, out), functools.partial(next_step, out)),
        console.reporter(quiet, "converting") as report,
    ):
        report.status("starting")
        start_heavy_process(torch=False)  # a conversion imports torch only if its kernels need it
        from mla_convert import api

        options = Options(
            format=format, target=target, ignore=tuple(ignore or ()), card=not no_card, base_model=base_model
        )
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
        hub = {}
        if upload is not None:
            hub = {"upload": upload, "max_disk": max_disk,
                   "upload_options": UploadOptions(revision=upload_branch, create=create, private=private)}  # fmt: skip
        elif upload_branch is not None or create or private or max_disk is not None:
            from mla_convert.errors import ConvertError

            raise ConvertError("--upload-branch, --create, --private and --max-disk go with --upload OWNER/NAME")
        result = api.convert(source, out, options=options, settings=settings, **hub)
    report_summary(result, json_out, quiet, "Plan (dry run: nothing written)" if dry_run else "Converted", source)
    if upload is not None and not (json_out or quiet):
        print_published(result)


def print_published(r: ConversionResult) -> None:
    """`convert --upload`: the disk it held and where the files went, after the conversion's summary."""
    budget = f"{gb(r.disk_budget)} (at least {gb(r.disk_budget_min)})"
    if r.dry_run:
        rows = [("--max-disk", budget), ("peak on disk, at most", gb(r.disk_peak_planned)), ("to", r.upload_repo)]
    else:
        stages = ", ".join(f"{k} {v:.1f} s" for k, v in (r.stage_seconds or {}).items())
        rows = [
            ("--max-disk", f"{budget}; peak {gb(r.disk_peak)}"),
            ("uploaded", f"{r.uploaded_files} files, {gb(r.uploaded_bytes)}, in {len(r.commits or ())} commits"),
            ("on the Hub already", f"{r.skipped_files} files, {gb(r.skipped_bytes)}"),
            ("checked first", f"{r.checked_files} files, as verify --source checks them"),
            ("stages busy", f"{stages} (wall {r.seconds:.1f} s)"),
            ("repo", r.upload_url),
        ]
    console.print_lines(console.rich_console(), rows)


def _interrupted(out: Path) -> str:
    """What an interrupted conversion left in --out, for the one line that says so."""
    if not (out / MANIFEST_NAME).is_file():
        return f"interrupted before the conversion wrote to {out}"
    if (readable_manifest(out) or {}).get("status") == COMPLETE:
        return f"interrupted; {out} holds a finished conversion"
    return INTERRUPTED


# What to do about a failure of the environment, by errno, once --out holds an unfinished conversion.
_FIX = {
    errno.ENOSPC: "free some space on that filesystem",
    errno.EDQUOT: "raise the disk quota or free some space",
    errno.EFBIG: "raise the file size limit (ulimit -f)",
    errno.EROFS: "make the filesystem writable again",
    errno.EIO: "check the disk (an I/O error)",
    errno.EACCES: "fix the permissions",
    errno.EPERM: "fix the permissions",
    **dict.fromkeys(
        (errno.ECONNREFUSED, errno.ECONNRESET, errno.ETIMEDOUT, errno.ENETUNREACH, errno.EHOSTUNREACH),
        "check the network",
    ),
}


def next_step(out: Path, e: BaseException) -> str | None:
    """What the one line of a failure of the environment (a disk, a mount, the network) in the
    middle of a conversion ends with: how to go on. None before the run wrote anything (those
    errors say their own fix) and for anything that is not the environment's."""
    if (readable_manifest(out) or {}).get("status") != INCOMPLETE:
        return None
    cause, network = e, False
    while cause is not None and not isinstance(cause, OSError):
        network = network or isinstance(cause, network_errors())
        cause = cause.__cause__
    if cause is None and not network:
        return None
    fix = "check the network" if cause is None else _FIX.get(cause.errno, "fix that")
    return f"{fix}, then finish it with the same command and --resume (or start over with another --out)"


def with_default_source(command, default: str):
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


deepseek_r1 = with_default_source(convert, DEFAULT_R1)


def report_summary(
    result: ConversionResult | DemoResult, json_out: bool, quiet: bool, title: str, source_arg: str | None = None
) -> None:
    r = result.conversion if isinstance(result, DemoResult) else result
    if r.device_check in ("differed", "failed") and not quiet:  # the user asked for that device
        typer.echo(f"warning: --device {r.device}: {r.device_reason}", err=True)
    if json_out:
        typer.echo(json.dumps(result.to_json(), indent=2))
    elif not quiet:
        console.print_summary(result, title, source_arg)
