"""`mla-convert demo`: a tiny checkpoint written, converted and verified, offline."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Annotated

import typer

from mla_convert.cli import console
from mla_convert.cli.convert_cmd import report_summary
from mla_convert.cli.errors import errors_to_exit, fail
from mla_convert.cli.options import DEMO_DEFAULT, DEMO_FAMILIES, FamilyOpt, FormatOpt, JsonOpt, QuietOpt, TargetOpt
from mla_convert.constants import DEMO_MARKER_NAME
from mla_convert.settings import Options
from mla_convert.units import gb


def demo(
    out: Annotated[
        Path | None,
        typer.Option("--out", "-o", metavar="DIR", help="Where to put the demo (default: a new temporary directory)."),
    ] = None,
    format: FormatOpt = Options.format,
    target: TargetOpt = Options.target,
    member: FamilyOpt = DEMO_DEFAULT,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Replace an earlier demo in --out (and nothing else).")
    ] = False,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Write a tiny checkpoint of a family member (DeepSeek-R1's by default), convert, verify, report. Offline."""
    if member not in DEMO_FAMILIES:
        fail(f"--family {member!r}: expected one of {', '.join(DEMO_FAMILIES)}", 2)
    with errors_to_exit(lambda: _interrupted(out)):
        from mla_convert import api

        result = api.demo(out, member=DEMO_FAMILIES[member], overwrite=overwrite, format=format, target=target)
    report_summary(result, json_out, quiet, f"Demo: tiny {member} checkpoint converted and verified")
    if not (json_out or quiet):
        where = shlex.quote(result.demo_dir)
        console.print_lines(
            console.rich_console(),
            [("demo files", f"{where} ({gb(result.demo_bytes)}: the tiny source and its conversion)"),
             ("remove them", f"rm -r {where}")],
        )  # fmt: skip
    if not result.report.ok:
        console.print_verify_report(result.report, quiet=True)  # the failures, one per line
        raise typer.Exit(1)


def _interrupted(out: Path | None) -> str:
    """What to do after an interrupted demo: --overwrite works once its source is complete (the
    marker written); before that, the directory holds only what the demo began to write."""
    if out is None:
        return "demo interrupted (its temporary directory removed); run it again"
    if (out / DEMO_MARKER_NAME).is_file():
        return "demo interrupted; run it again with --overwrite, or remove its directory"
    return f"demo interrupted before its source checkpoint was complete; remove {out} (only the demo wrote there), then run it again"
