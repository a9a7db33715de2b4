"""`mla-convert upload DIR REPO_ID`: a converted directory published on the Hugging Face Hub."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from mla_convert.cli import console
from mla_convert.cli.errors import errors_to_exit
from mla_convert.cli.options import JsonOpt, QuietOpt
from mla_convert.cli.startup import start_heavy_process
from mla_convert.settings import UploadOptions
from mla_convert.units import gb

DirArg = Annotated[Path, typer.Argument(metavar="DIR", help="A directory written by mla-convert convert.")]
RepoArg = Annotated[str, typer.Argument(metavar="REPO_ID", help="The Hub model repo: OWNER/NAME.")]
BranchOpt = Annotated[
    str | None, typer.Option("--revision", metavar="BRANCH", help="The branch to commit to (default: main).")
]
PrivateOpt = Annotated[
    bool,
    typer.Option(
        "--private",
        help="Make the repo private when --create makes it; an existing public repo is refused (the Hub's "
        "settings change it).",
    ),
]
CreateOpt = Annotated[bool, typer.Option("--create", help="Make the repo, and the --revision branch, if missing.")]
ReplaceOpt = Annotated[
    bool,
    typer.Option(
        "--overwrite",
        help="The repo holds another model: replace its files with these, and delete those the manifest does not list.",
    ),
]
SkipVerifyOpt = Annotated[
    bool,
    typer.Option(
        "--skip-verify",
        help="Upload without verify's structure and integrity checks first (they read every file: minutes for "
        "DeepSeek-R1).",
    ),
]
PlanOnlyOpt = Annotated[
    bool,
    typer.Option(
        "--dry-run",
        help="List the files and bytes of each commit, in upload order; ask the Hub nothing, upload nothing.",
    ),
]


# The defaults are UploadOptions' fields: their one home.
def upload(
    dir: DirArg,
    repo_id: RepoArg,
    revision: BranchOpt = UploadOptions.revision,
    private: PrivateOpt = UploadOptions.private,
    create: CreateOpt = UploadOptions.create,
    overwrite: ReplaceOpt = UploadOptions.overwrite,
    skip_verify: SkipVerifyOpt = UploadOptions.skip_verify,
    dry_run: PlanOnlyOpt = UploadOptions.dry_run,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Upload a converted directory to a Hub model repo: exactly the files its manifest lists, after verify's
    structure and integrity checks. Interrupted, the same command resumes.

    Token: huggingface_hub's own (HF_TOKEN, or `hf auth login`). Exit code 0: uploaded; 2: refused or failed
    (one line says why); 130, 143, 129: interrupted by
    Ctrl-C, SIGTERM or SIGHUP."""
    with errors_to_exit(_interrupted):
        from mla_convert import api

        _client_quiet(quiet)
        if not (dry_run or skip_verify):
            start_heavy_process()  # verify's checks import torch
        options = UploadOptions(
            revision=revision, private=private, create=create, overwrite=overwrite, skip_verify=skip_verify,
            dry_run=dry_run,
        )  # fmt: skip
        with console.reporter(quiet, "checking") as report:
            result = api.upload(
                dir, repo_id, options=options, progress_factory=_phase(report, "uploading"),
                check_progress_factory=_phase(report, "checking"), status=report.status,
            )  # fmt: skip
    if json_out:
        typer.echo(json.dumps(result.to_json(), indent=2))
    elif not quiet:
        console.print_upload(result)


def _phase(report: console.Reporter, description: str):
    """A progress factory whose bar, or log lines, say which phase counts: checking, uploading."""

    def factory(total: int):
        report.description = description
        return report.progress_factory(total)

    return factory


def _client_quiet(quiet: bool) -> None:
    """huggingface_hub's own bars would draw over ours; with --quiet, its retry warnings go too."""
    from huggingface_hub.utils import disable_progress_bars, logging

    disable_progress_bars()
    if quiet:
        logging.set_verbosity_error()


def _interrupted() -> str:
    job = getattr(sys.exc_info()[1], "upload_state", None)  # publish.upload.run's, on the interrupt
    if job is None or not (job.done or job.sent_files):
        return "upload interrupted before any file was committed; run the same command to upload"
    return (
        f"upload interrupted: {len(job.done)} commits with {job.sent_files} files ({gb(job.sent_bytes)}) are on "
        f"the Hub; run the same command to resume"
    )
