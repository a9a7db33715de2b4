"""How a checkpoint directory describes its model, in one of three shapes (the members' real files;
which member uses which: source/members/):

- `config.json` of the text model itself (DeepSeek-V3 and most of the family);
- `config.json` of a multimodal wrapper that nests the text model in `text_config` (its text
  tensors behind a prefix: Member.names);
- a member's own layout without config.json (Member.own_layout / read_own_layout).

`read_model_config` gives the text model's config in config.json's names (what source.family
reads), how the checkpoint names its tensors (source.naming), its index file, and where its
quantization_config lives; `ModelConfig.output` writes the output's config in the same shape.
Standard library only.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path

from mla_convert.constants import CONFIG_NAME, INDEX_NAME, SINGLE_FILE_NAME
from mla_convert.errors import SourceError
from mla_convert.source import members
from mla_convert.source.family import DEEPSEEK_V3
from mla_convert.source.naming import DEEPSEEK_NAMES, TensorNames

QUANT_KEY = "quantization_config"
# A directory with neither config.json nor a member's own layout (docs/troubleshooting.md lists it).
NOT_A_CHECKPOINT = (
    f"not a checkpoint directory: no {CONFIG_NAME} (nor a member's own layout, such as params.json "
    "with consolidated shards)"
)
TEXT_CONFIG = "text_config"


@dataclass(frozen=True)
class ModelConfig:
    file: str  # the config file: config.json or params.json
    raw: dict  # that file's object, as it is
    raw_bytes: bytes
    text: dict  # the text model's config in config.json's names (source.family's input)
    names: TensorNames = DEEPSEEK_NAMES
    architecture: str = DEEPSEEK_V3  # as the checkpoint declares it (a wrapper's), or what vLLM builds from it
    text_key: str | None = None  # TEXT_CONFIG when the text model is nested
    quant_at: tuple[str | None, ...] = ()  # where the source's quantization_config is: None (top), TEXT_CONFIG
    index_name: str = INDEX_NAME
    single_file_name: str = SINGLE_FILE_NAME
    field_label: dict = field(default_factory=dict)  # config.json field -> the file's own name, for messages
    vision: bool = False  # the config declares a vision part (its tensors: names.extra_prefixes)

    @property
    def quantization(self) -> dict | None:
        """The source's quantization_config: the top-level one before a nested one, as vLLM reads it."""
        if not self.quant_at:
            return None
        return (self.raw if self.quant_at[0] is None else self.raw[TEXT_CONFIG])[QUANT_KEY]

    def label(self, name: str) -> str:
        return self.field_label.get(name, name)

    def where(self) -> str:
        """Where the text model's config is, for messages: '' or "<wrapper architecture>'s text_config: "."""
        return f"{self.architecture}'s {self.text_key}: " if self.text_key else ""

    def output(self, quantization: dict | None) -> dict:
        """The output's config: this one with its quantization_config replaced where the source had
        it (at the top level if it had none) or, for None, removed; the dtype fields it has set
        to bfloat16 (config.json's torch_dtype always)."""
        out = copy.deepcopy(self.raw)
        places = [out] + ([out[TEXT_CONFIG]] if self.text_key else [])
        wheres = (self.quant_at or (None,)) if quantization is not None else ()
        targets = [out if where is None else out[TEXT_CONFIG] for where in wheres]
        for place in places:
            if not any(place is t for t in targets):
                place.pop(QUANT_KEY, None)
        for place in targets:  # replaced where the key was, so the file keeps its order
            place[QUANT_KEY] = copy.deepcopy(quantization)
        if self.file == CONFIG_NAME:
            out["torch_dtype"] = "bfloat16"
        for place in places:
            for key in ("dtype", "torch_dtype"):
                if key in place:
                    place[key] = "bfloat16"
        return out


def read_json_object(path: Path, what: str) -> tuple[dict, bytes]:
    """The JSON object in `path` and its bytes; SourceError (naming `what`) when the file is missing,
    unreadable, not JSON, or not an object."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError as e:
        raise SourceError(f"{path}: {what} not found") from e
    except OSError as e:
        raise SourceError(f"{path}: cannot read {what} ({e.strerror or e})") from e
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SourceError(f"{path}: {what} is not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise SourceError(f"{path}: {what} must be a JSON object")
    return data, raw


def read_model_config(root: Path) -> ModelConfig:
    """The model description of the checkpoint (or converted) directory `root`; SourceError."""
    own = members.own_layout_of(root)
    if own is not None:
        return own.read_own_layout(root)
    if not (root / CONFIG_NAME).exists():
        raise SourceError(f"{root}: {NOT_A_CHECKPOINT}")
    raw, raw_bytes = read_json_object(root / CONFIG_NAME, CONFIG_NAME)
    member = members.wrapper_of(raw.get("architectures"))
    if member is None:
        return ModelConfig(CONFIG_NAME, raw, raw_bytes, raw, quant_at=(None,) if QUANT_KEY in raw else ())
    wrapper, nested = member.architecture, raw.get(TEXT_CONFIG)
    if not isinstance(nested, dict):
        raise SourceError(
            f"{root / CONFIG_NAME}: {wrapper} keeps its text model in text_config, and this config has "
            f"{'none' if nested is None else 'no object there'}"
        )
    text = nested if nested.get("architectures") else nested | {"architectures": [member.text_architecture]}
    quant_at = tuple(w for w, place in ((None, raw), (TEXT_CONFIG, nested)) if QUANT_KEY in place)
    if len(quant_at) == 2 and raw[QUANT_KEY] != nested[QUANT_KEY]:
        raise SourceError(
            f"{root / CONFIG_NAME}: the quantization_config at the top level and the one in text_config differ; "
            "expected one, or the same in both"
        )
    return ModelConfig(CONFIG_NAME, raw, raw_bytes, text, member.names, wrapper, TEXT_CONFIG, quant_at,
                       vision=raw.get("vision_config") is not None)  # fmt: skip
