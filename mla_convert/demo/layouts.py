"""How a synthetic checkpoint lays its files out, by CheckpointSpec.layout: DEEPSEEK (config.json
and DeepSeek-V3's names) here, any other one by the member that declares it (Member.demo_layout in
source/members/: its config file, tensor names, index and side files, vision part). A member writes
its names out from the reference notes, apart from its converter-side tables, so that the mapping
is tested against a second reading of them.
"""

from __future__ import annotations

from mla_convert.constants import CONFIG_NAME, INDEX_NAME
from mla_convert.demo.specs import DEEPSEEK, CheckpointSpec
from mla_convert.source import members
from mla_convert.source.members import DemoLayout


def _layout(spec: CheckpointSpec) -> DemoLayout | None:
    if spec.layout == DEEPSEEK:
        return None
    layout = members.demo_layout(spec.layout)
    if layout is None:
        raise ValueError(f"no member declares the demo layout {spec.layout!r}")
    return layout


def native_name(spec: CheckpointSpec, name: str) -> str:
    """The checkpoint's own name of a tensor spec.tensors() names in DeepSeek-V3's names."""
    layout = _layout(spec)
    return name if layout is None else layout.native_name(spec, name)


def vision_tensors(spec: CheckpointSpec) -> list[tuple[str, str, tuple[int, ...]]]:
    """A small BF16 vision part, by the member's names (copied bit for bit by a conversion)."""
    layout = _layout(spec)
    return layout.vision_tensors(spec) if spec.vision and layout is not None else []


def index_name(spec: CheckpointSpec) -> str:
    layout = _layout(spec)
    return (layout.index_name if layout is not None else None) or INDEX_NAME


def config_file(spec: CheckpointSpec) -> tuple[str, dict]:
    """(file name, object) of the model's config, in the member's shape."""
    layout = _layout(spec)
    cfg = spec.config()
    return (CONFIG_NAME, cfg) if layout is None else layout.config_file(spec, cfg)


def side_files(spec: CheckpointSpec) -> dict[str, str] | None:
    """The member's own side files (file -> text) instead of the HF tokenizer and code files; None: those."""
    layout = _layout(spec)
    return layout.side_files(spec) if layout is not None and layout.side_files is not None else None
