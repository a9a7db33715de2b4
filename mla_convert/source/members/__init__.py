"""The family's members, one module each (docs/adding-a-member.md): this registry imports every
module of the package that defines `MEMBER` and answers for all of them, so that adding a member
is one new module and generic code never names one. Standard library only.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
import re
from pathlib import Path

from mla_convert.source.members.member import DemoLayout, Member, NonMember, SupportedCheckpoint

__all__ = [
    "DemoLayout",
    "Member",
    "NonMember",
    "SupportedCheckpoint",
    "all_members",
    "architectures",
    "architectures_help",
    "demo_layout",
    "demo_members",
    "demo_spec_fields",
    "kept_16bit",
    "member_of",
    "non_members",
    "nvfp4_releases",
    "own_config_files",
    "own_layout_of",
    "source_help",
    "supported",
    "text_architectures",
    "wrapper_of",
]  # fmt: skip


@functools.cache
def all_members() -> tuple[Member, ...]:
    """Every member, by rank."""
    found = []
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        if isinstance(getattr(module, "MEMBER", None), Member):
            found.append(module.MEMBER)
    return tuple(sorted(found, key=lambda m: m.rank))


def architectures() -> tuple[str, ...]:
    """The architectures a config may declare (wrappers included), in the order of their first member."""
    return tuple(dict.fromkeys(m.architecture for m in all_members()))


def text_architectures() -> tuple[str, ...]:
    """The architectures of a text model itself (a wrapper's text model is one of them)."""
    return tuple(dict.fromkeys(m.served_as for m in all_members()))


def member_of(architecture: str) -> Member:
    """The first member (by rank) that declares `architecture` or is served as it: the one whose
    structural facts (indexer, MTP head, kept linears) hold for that architecture."""
    for m in all_members():
        if m.architecture == architecture:
            return m
    raise KeyError(architecture)


def wrapper_of(archs: object) -> Member | None:
    """The wrapper member (text model in text_config) one of `archs` names, if any."""
    if not isinstance(archs, list):
        return None
    return next((m for m in all_members() if m.text_architecture and m.architecture in archs), None)


def own_layout_of(root: Path) -> Member | None:
    """The member whose own layout (no config.json) `root` is in, if any: the latest by rank that
    takes it, so that a later member in an earlier one's layout (which it tells apart in its own
    `own_layout`) needs no change to the earlier module."""
    return next((m for m in reversed(all_members()) if m.own_layout is not None and m.own_layout(root)), None)


def own_config_files() -> tuple[str, ...]:
    """The config files of the members' own layouts (besides config.json)."""
    return tuple(dict.fromkeys(m.config_file for m in all_members() if m.config_file))


@functools.cache
def kept_16bit(architecture: str) -> re.Pattern | None:
    pattern = next((m.kept_16bit for m in all_members() if m.served_as == architecture and m.kept_16bit), None)
    return None if pattern is None else re.compile(r"model\.layers\.\d+\." + pattern)


def architectures_help() -> str:
    """The supported architectures, one paragraph each (its members' checkpoints, then what the
    conversion does), for --help."""
    paragraphs = []
    for arch in architectures():
        of = [m for m in all_members() if m.architecture == arch]
        who = "; ".join(m.help_who for m in of)
        what = "; ".join(m.help_what for m in of if m.help_what)
        paragraphs.append(f"{arch}: {who}. {what}.")
    return "\n\n".join(paragraphs)


def source_help() -> str:
    """SOURCE's --help: the architectures config.json may name, and the members' own layouts."""
    own = [m for m in all_members() if m.own_layout is not None]
    in_config = [a for a in architectures() if all(m.architecture != a for m in own)]
    return f"one whose config.json names {', '.join(in_config)}" + "".join(f"; or {m.layout_help}" for m in own)


def supported() -> tuple[SupportedCheckpoint, ...]:
    """The records of docs/checkpoints.md, by member."""
    return tuple(s for m in all_members() for s in m.supported)


def non_members() -> tuple[NonMember, ...]:
    return tuple(n for m in all_members() for n in m.non_members)


def nvfp4_releases() -> tuple[str, ...]:
    return tuple(m.nvfp4_release for m in all_members() if m.nvfp4_release)


def demo_members() -> tuple[str, ...]:
    """The tiny synthetic checkpoints (`demo --family`), by name."""
    return tuple(name for m in all_members() for name in m.demos)


def demo_spec_fields(name: str) -> dict:
    """The CheckpointSpec fields of demo member `name`; KeyError for an unknown one."""
    for m in all_members():
        if name in m.demos:
            return dict(m.demos[name])
    raise KeyError(name)


def demo_layout(name: str) -> DemoLayout | None:
    """The demo layout a member declares under `name` (CheckpointSpec.layout); None for DeepSeek-V3's."""
    return next((m.demo_layout for m in all_members() if m.demo_layout and m.demo_layout.name == name), None)
