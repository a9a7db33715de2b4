"""What one member of the MLA family declares (`Member`), in data where data is enough and in a
few hooks where it is not. Each module of this package defines one `MEMBER`; the package's
registry finds them. Generic code asks the registry, never names a member. Standard library only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mla_convert.source.naming import DEEPSEEK_NAMES, TensorNames


@dataclass(frozen=True)
class SupportedCheckpoint:
    """One record of the supported-checkpoints page (docs/checkpoints.md)."""

    checkpoints: str  # as a user knows them
    declares: str  # the `architectures` (`model_type`) the files declare, or the member's own layout
    source: str  # what the source's weights are
    conversion: str  # what happens to them
    demos: tuple[str, ...]  # the demo members built like it


@dataclass(frozen=True)
class NonMember:
    """A checkpoint that looks like the family but is refused, in one line saying why."""

    what: str  # the checkpoint, as a user knows it
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    why: str


@dataclass(frozen=True)
class DemoLayout:
    """How a member's tiny synthetic checkpoint lays its files out when that is not DeepSeek-V3's
    (config.json, DeepSeek names). Each hook takes the demo's CheckpointSpec (duck-typed: this
    layer sits below the demo)."""

    name: str  # CheckpointSpec.layout
    native_name: Callable[[Any, str], str]  # (spec, DeepSeek-V3 tensor name) -> the checkpoint's name
    config_file: Callable[[Any, dict], tuple[str, dict]]  # (spec, config.json object) -> (file, object)
    vision_tensors: Callable[[Any], list] = lambda spec: []  # (name, kind, shape) of the copied part
    index_name: str | None = None  # None: model.safetensors.index.json
    side_files: Callable[[Any], dict[str, str]] | None = None  # file -> text, instead of HF's tokenizer files
    # (spec, [(DeepSeek-V3 name, kind, shape)]) -> that list with the member's own per-layer tensors
    # (other widths, tensors dropped or added); before the block scales are appended
    edit_tensors: Callable[[Any, list], list] | None = None


# The MLA dims (config.json's names: qk_nope_head_dim, ...) a member gives layer i of its own; None:
# the model's. The inventory and the MLA manifest (LayerEntry.dims, only where they differ) follow.
LayerDims = Callable[[dict, int], dict | None]
# Layer i's tensors added to, changed in or taken from the generic inventory (name -> (shape, kind)):
# (config, i, inventory) -> None; run after the generic inventory of every layer.
LayerInventory = Callable[[dict, int, dict], None]


@dataclass(frozen=True)
class Member:
    """One member: how its config is read, what its checkpoint holds, how it is documented and demoed."""

    name: str  # the member, e.g. "deepseek-v3"
    rank: int  # where it sits in every list (help, docs, demo members): the order members were added
    architecture: str  # what its config declares (a wrapper's own), or what vLLM builds from its own layout
    help_who: str  # the checkpoints, for the architecture's --help paragraph
    short: str = ""  # the checkpoints in a few characters, for the app's one-line summary
    help_what: str = ""  # what the conversion does with them (joined after the other members')
    text_architecture: str | None = None  # a wrapper's text model (in text_config); None: `architecture`
    names: TensorNames = DEEPSEEK_NAMES  # how a wrapper names the text model's tensors
    indexer: bool = False  # the lightning indexer (index_n_heads / index_head_dim)
    mtp_own_head: bool = True  # False: the MTP layer reuses the main model's embed_tokens and head
    kept_16bit: str | None = None  # regex (after `model.layers.N.`) of FP8 linears its releases keep 16-bit
    # Its own layout, where it has one: whether a directory is in it, and reading it (a ModelConfig).
    own_layout: Callable[[Path], bool] | None = None
    read_own_layout: Callable[[Path], Any] | None = None
    config_file: str | None = None  # its own layout's config file
    index_file: str | None = None  # its own layout's shard index
    layout_help: str = ""  # its own layout, for SOURCE's --help
    refuse: Callable[[dict], str | None] | None = None  # a refusal of its text config, with the reason
    layer_dims: LayerDims | None = None  # a layer's own MLA dims
    layer_inventory: LayerInventory | None = None  # a layer's tensors beyond (or instead of) the generic ones
    supported: tuple[SupportedCheckpoint, ...] = ()
    non_members: tuple[NonMember, ...] = ()  # look-alikes of this member that are refused
    nvfp4_release: str = ""  # its NVFP4 release, named in the refusal of an NVFP4 source
    demos: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # demo name -> CheckpointSpec fields
    demo_layout: DemoLayout | None = None

    @property
    def served_as(self) -> str:
        return self.text_architecture or self.architecture
