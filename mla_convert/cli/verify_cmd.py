"""`mla-convert verify DIR [--source SOURCE]`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from mla_convert.cli import console
from mla_convert.cli.errors import errors_to_exit
from mla_convert.cli.options import QuietOpt
from mla_convert.cli.startup import start_heavy_process
from mla_convert.io.read_ahead import read_ahead_in_background
from mla_convert.verification.order import default_workers, files_at_once, first_files


def verify(
    dir: Annotated[Path, typer.Argument(metavar="DIR", help="A directory written by mla-convert convert.")],
    source: Annotated[
        str | None,
        typer.Option(
            "--source",
            "-s",
            metavar="SOURCE",
            help="Its source checkpoint: compare every tensor with the exact dequant.",
        ),
    ] = None,
    workers: Annotated[
        int | None,
        typer.Option(
            "--workers",
            "-w",
            metavar="N",
            min=1,
            help="Files checked in parallel (processes). Default: one per two cores, at most 8 (1 on 2 cores).",
        ),
    ] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the full report as JSON on stdout.")] = False,
    quiet: QuietOpt = False,
) -> None:
    """Check a converted directory: structure, file hashes, values, MLA artifacts, and against --source.

    Exit code 0: every check passed; 1: a check failed; 2: verification could not run (or DIR is in use
    by a conversion); 130 (Ctrl-C), 143 (SIGTERM), 129 (SIGHUP): interrupted (verify only reads: nothing
    was changed)."""
    workers = default_workers() if workers is None else workers
    read_ahead_in_background(first_files(dir, workers), files_at_once(workers))  # while Python starts
    with errors_to_exit("verify interrupted; nothing was changed"), console.reporter(quiet, "verifying") as progress:
        progress.status("starting")
        start_heavy_process(torch=False)  # torch only where a check needs it (verification.stream)
        from mla_convert import api

        progress.status(f"reading the headers in {dir}")
        report = api.verify(
            dir, source=source, workers=workers, progress_factory=progress.progress_factory, notice=progress.notice
        )
    if json_out:
        typer.echo(json.dumps(report.to_json(), indent=2))
    else:
        console.print_verify_report(report, quiet)
    raise typer.Exit(report.exit_code)
