"""`mla-convert card DIR [--base-model ID] [--repo-id ID] [--keep | --overwrite]`: a converted
directory's model card written again, without the source, the user's edits kept (mla_convert.card)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from mla_convert.cli import console
from mla_convert.cli.errors import errors_to_exit
from mla_convert.cli.options import JsonOpt, QuietOpt

DirArg = Annotated[Path, typer.Argument(metavar="DIR", help="A directory written by mla-convert convert.")]
CardBaseOpt = Annotated[
    str | None,
    typer.Option(
        "--base-model",
        metavar="REPO_ID",
        help="The Hub model it derives from, for the card's base_model (OWNER/NAME). Default: the recorded one.",
    ),
]
RepoIdOpt = Annotated[
    str | None,
    typer.Option(
        "--repo-id",
        metavar="REPO_ID",
        help="The Hub repo the card is for: its download and serve lines name it (upload sets it). Default: "
        "the recorded one.",
    ),
]
KeepOpt = Annotated[
    bool,
    typer.Option(
        "--keep",
        help="Keep your edits inside the sections mla-convert writes, as you wrote them (later cards keep them too).",
    ),
]
CardOverwriteOpt = Annotated[
    bool,
    typer.Option(
        "--overwrite",
        help="Write the sections mla-convert writes again, over your edits inside them (your text around them "
        "is kept).",
    ),
]


def card(
    dir: DirArg,
    base_model: CardBaseOpt = None,
    repo_id: RepoIdOpt = None,
    keep: KeepOpt = False,
    overwrite: CardOverwriteOpt = False,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Write a converted directory's model card (README.md) again, and its record in the manifest, from
    what the manifest records: no source needed, and verify passes afterwards. Your text around
    its sections is kept and recorded; an edit inside them is refused unless --keep or --overwrite.

    Exit code 0: written (or already this card); 2: refused (one line says why)."""
    with errors_to_exit("interrupted; run the same command again to write the card"):
        from mla_convert import api

        result = api.card(dir, base_model=base_model, repo_id=repo_id, keep=keep, overwrite=overwrite)  # locked there
    if json_out:
        typer.echo(json.dumps(result.to_json(), indent=2))
    elif not quiet:
        console.print_card(result)
