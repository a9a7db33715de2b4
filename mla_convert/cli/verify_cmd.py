"""`mla-convert verify DIR [--source SOURCE]`; `mla-convert verify OWNER/NAME [--download]`."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from mla_convert.cli import console
from mla_convert.cli.errors import errors_to_exit, fail
from mla_convert.cli.options import QuietOpt, RevisionOpt
from mla_convert.cli.startup import start_heavy_process
from mla_convert.io.read_ahead import read_ahead_in_background
from mla_convert.settings import is_repo_target
from mla_convert.units import parse_size
from mla_convert.verification.order import default_workers, files_at_once, first_files


def verify(
    dir: Annotated[
        str,
        typer.Argument(
            metavar="DIR",
            help="A directory written by mla-convert convert; or OWNER/NAME, a conversion published on the Hub "
            "(a local path of that name is taken first).",
        ),
    ],
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
    revision: RevisionOpt = None,
    download: Annotated[
        bool,
        typer.Option(
            "--download",
            help="Hub repo: download each file in turn and run every check of a local verify on it (and "
            "--source), deleting it after; without, the Hub's sizes and sha256 against the manifest.",
        ),
    ] = False,
    max_disk: Annotated[
        str | None,
        typer.Option(
            "--max-disk",
            metavar="SIZE",
            help="With --download: the most its files may take on disk at once (40G, 1.5TB). Default: what "
            "the largest check needs, plus one file downloading ahead.",
        ),
    ] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the full report as JSON on stdout.")] = False,
    quiet: QuietOpt = False,
) -> None:
    """Check a converted directory: structure, file hashes, values, MLA artifacts, and against --source.
    Or a conversion published on the Hub (OWNER/NAME): every file the manifest lists there at its size
    and sha256, nothing else on the branch, without downloading the data (--download: every check).

    Exit code 0: every check passed; 1: a check failed; 2: verification could not run (or DIR is in use
    by a conversion; no network, no such repo); 130 (Ctrl-C), 143 (SIGTERM), 129 (SIGHUP): interrupted
    (verify only reads: nothing was changed)."""
    try:
        budget = None if max_disk is None else parse_size(max_disk)
    except ValueError as e:
        fail(f"--max-disk {e}", 2)
    on_hub = is_repo_target(dir)
    workers = default_workers() if workers is None else workers
    if not on_hub:
        read_ahead_in_background(first_files(dir, workers), files_at_once(workers))  # while Python starts
    with errors_to_exit("verify interrupted; nothing was changed"), console.reporter(quiet, "verifying") as progress:
        progress.status("starting")
        start_heavy_process(torch=False)  # torch only where a check needs it (verification.data_pass)
        from mla_convert import api

        progress.status(f"reading the headers in {dir}" if not on_hub else f"asking the Hub about {dir}")
        report = api.verify(
            dir, source=source, workers=workers, progress_factory=progress.progress_factory, notice=progress.notice,
            revision=revision, download=download, max_disk=budget, status=progress.status,
        )  # fmt: skip
    if json_out:
        typer.echo(json.dumps(report.to_json(), indent=2))
    else:
        console.print_verify_report(report, quiet)
    raise typer.Exit(report.exit_code)
