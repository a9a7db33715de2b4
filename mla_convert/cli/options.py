"""The options the commands share, declared once (Typer reads each command's options from its
signature). Their choices and defaults come from mla_convert.constants, mla_convert.formats and
mla_convert.settings, which import no torch: --help stays instant."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from mla_convert import formats
from mla_convert.constants import KERNEL_MODES, WRITE_MODES
from mla_convert.source import members


def choices(values: tuple[str, ...]) -> str:
    return f"[{'|'.join(values)}]"


def _either(words: list[str]) -> str:
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def format_help() -> str:
    """--format's help: each format's own words (formats.Format.help)."""
    return _either([f.help for f in formats.all_formats()]) + "."


def target_help() -> str:
    """--target's help: each target's range, and the formats whose bytes do not depend on it."""
    ranges = _either([f"{t.name} (max {t.fp8_max:g})" for t in formats.TARGETS.values()])
    ranged = [f.name for f in formats.all_formats() if f.fp8_range]
    others = [f.name for f in formats.all_formats() if not f.fp8_range]
    others_words = (
        f" a {_either(others)} output is the same for both, and --target "
        f"{_either([t for t in formats.TARGETS if t != formats.DEFAULT_TARGET])} with it is refused."
        if others
        else ""
    )
    return f"FP8 range of the target: {ranges}. For --format {_either(ranged)} only:{others_words}"


OutOpt = Annotated[
    Path,
    typer.Option(
        "--out",
        "-o",
        metavar="DIR",
        help="Output directory: created, or empty, or (--overwrite) an earlier mla-convert output.",
    ),
]
FormatOpt = Annotated[
    str,
    typer.Option(
        "--format",
        "-f",
        metavar=choices(formats.names()),
        help=format_help(),
    ),
]
TargetOpt = Annotated[
    str,
    typer.Option(
        "--target",
        "-t",
        metavar=choices(tuple(formats.TARGETS)),
        help=target_help(),
    ),
]
NoCardOpt = Annotated[
    bool,
    typer.Option(
        "--no-card",
        help="Keep the source's README.md as it is, instead of the output's own model card (Hub metadata naming the "
        "source as base model, what was converted and how, serving, verification, the source's card below it). "
        "Recorded in the manifest: a --resume must match it.",
    ),
]
WorkersOpt = Annotated[
    int, typer.Option("--workers", "-w", metavar="N", min=1, help="Shards converted in parallel (processes).")
]
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
SourceArg = Annotated[
    str,
    typer.Argument(
        metavar="SOURCE",
        help=f"Checkpoint directory or Hub repo id: {members.source_help()}.",
    ),
]
IgnoreOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--ignore",
        metavar="REGEX",
        help="Linears to leave unquantized (block-FP8 ones dequantized to bf16, 16-bit ones copied): a regular "
        "expression matched at the start of module names, recorded as a 're:' entry in the config's ignore "
        "list; repeatable. A pattern that matches no linear is refused. E.g. the routed experts: "
        "'model\\.layers\\.\\d+\\.mlp\\.experts\\.'",
    ),
]
RevisionOpt = Annotated[
    str | None, typer.Option("--revision", metavar="REV", help="Hub revision (branch, tag or commit).")
]
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
        metavar="DEVICE",
        help="Torch device for the arithmetic (cpu, cuda, hpu, ...). Used only where it gives the CPU's bytes: "
        "every process first checks it bit-identical to the CPU on a probe set, else the CPU converts and the "
        "summary says why.",
    ),
]
KernelsOpt = Annotated[
    str,
    typer.Option(
        "--kernels",
        metavar=choices(KERNEL_MODES),
        help="auto: native C kernels built for this CPU, else torch.compile (large checkpoints), else eager; "
        "or native / compile / eager. Whatever runs is first checked bit-identical to eager.",
    ),
]
WriteIoOpt = Annotated[
    str,
    typer.Option(
        "--write-io",
        metavar=choices(WRITE_MODES),
        help="auto: write shards with O_DIRECT on a local disk filesystem (ext4, xfs, btrfs, ...) that accepts "
        "it (no page-cache copy, far less CPU), else through the page cache (NFS, FUSE, tmpfs); or direct / "
        "buffered. The bytes written are the same.",
    ),
]
# The demo's names: the family members, and deepseek-r1, which has DeepSeek-V3's layout (one
# architecture, the same dims): the README calls the demo R1-shaped.
DEMO_DEFAULT = "deepseek-r1"
DEMO_FAMILIES = {DEMO_DEFAULT: "deepseek-v3"} | {m: m for m in members.demo_members()}
FamilyOpt = Annotated[
    str,
    typer.Option(
        "--family",
        metavar="NAME",  # the names listed in the help: as a [a|b|...] choice they overrun 80 columns
        help=f"Which member's tiny checkpoint: {', '.join(DEMO_FAMILIES)}.",
    ),
]
BaseModelOpt = Annotated[
    str | None,
    typer.Option(
        "--base-model",
        metavar="REPO_ID",
        help="The Hub model this one derives from, for the card's base_model (OWNER/NAME). Default: the source's "
        "Hub id, else the source card's own base_model, else none. `mla-convert card DIR --base-model` sets it later.",
    ),
]
