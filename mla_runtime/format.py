"""The on-disk format of precomputed MLA weights: names, manifest schema, validation.

Owned here so the converter (writer) and the vLLM plugin (reader) share one definition.
Depends on the standard library only.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from .model_configs import mla_fields

FORMAT_NAME = "mla-precomputed"
FORMAT_VERSION = 1
MLA_DIR_NAME = "mla"  # the artifacts' directory inside the converted model directory
MANIFEST_NAME = "manifest.json"  # the MLA manifest, inside MLA_DIR_NAME
ARTIFACT_DTYPE = "bfloat16"  # as the manifest records it
ARTIFACT_ST_DTYPE = "BF16"  # the same, as the layer files' safetensors headers name it

# Files of the converted model directory that the runtime reads too.
CONFIG_NAME = "config.json"
CONVERT_MANIFEST_NAME = "mla-convert-manifest.json"  # mla-convert's record of the whole conversion

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.kv_b_proj\.weight$")


class ArtifactError(ValueError):
    """The MLA artifacts are missing, malformed or do not match what is being served."""


def kv_b_name(layer: int) -> str:
    """The checkpoint's kv_b_proj weight of a layer, which the artifacts are computed from."""
    return f"model.layers.{layer}.self_attn.kv_b_proj.weight"


def w_uk_t_name(layer: int) -> str:
    return f"model.layers.{layer}.self_attn.W_UK_T"


def w_uv_name(layer: int) -> str:
    return f"model.layers.{layer}.self_attn.W_UV"


def layer_file_name(layer: int) -> str:
    """File (relative to the mla/ directory) holding one layer's W_UK_T and W_UV."""
    return f"layer-{layer:03d}.safetensors"


def kv_b_layer_index(tensor_name: str) -> int | None:
    """Layer index if `tensor_name` is a layer's kv_b_proj weight, else None."""
    m = _LAYER_RE.match(tensor_name)
    return int(m.group(1)) if m else None


def layer_index_of_attention(prefix: str) -> int | None:
    """Layer index from a vLLM module prefix like 'model.layers.3.self_attn.attn'."""
    m = re.search(r"(?:^|\.)layers\.(\d+)\.", prefix + ".")
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class MlaDims:
    num_heads: int  # N
    qk_nope_head_dim: int  # P
    v_head_dim: int  # V
    kv_lora_rank: int  # L

    def w_uk_t_shape(self, heads: int | None = None) -> tuple[int, int, int]:
        return (self.num_heads if heads is None else heads, self.qk_nope_head_dim, self.kv_lora_rank)

    def w_uv_shape(self, heads: int | None = None) -> tuple[int, int, int]:
        return (self.num_heads if heads is None else heads, self.kv_lora_rank, self.v_head_dim)

    def kv_b_shape(self) -> tuple[int, int]:
        return (self.num_heads * (self.qk_nope_head_dim + self.v_head_dim), self.kv_lora_rank)

    @classmethod
    def from_model_config(cls, config: dict) -> MlaDims:
        """The model's dims from its config (any shape model_configs.py reads); a layer of its own
        dims is model_configs.layer_fields'."""
        try:
            return cls(**mla_fields(config))
        except KeyError as e:
            raise ArtifactError(f"model config lacks MLA dimension {e}") from e
        except (TypeError, ValueError) as e:
            raise ArtifactError(f"model config: {e}") from e


@dataclass(frozen=True)
class LayerEntry:
    layer: int
    file: str  # relative to the mla/ directory
    size: int
    sha256: str
    # The dims of this layer that differ from the manifest's (a NoPE layer's qk_nope_head_dim of
    # nope + rope); None, and absent from the file, where none differ.
    dims: dict | None = None


@dataclass(frozen=True)
class MlaManifest:
    dims: MlaDims
    layers: tuple[LayerEntry, ...]
    source_fingerprint: str
    dtype: str = ARTIFACT_DTYPE
    format: str = FORMAT_NAME
    format_version: int = FORMAT_VERSION
    producer: dict = field(default_factory=dict)

    def layer_ids(self) -> list[int]:
        return [e.layer for e in self.layers]

    def entry(self, layer: int) -> LayerEntry:
        for e in self.layers:
            if e.layer == layer:
                return e
        raise ArtifactError(f"no MLA artifacts for layer {layer} in the manifest")

    def dims_of(self, layer: int) -> MlaDims:
        """Layer `layer`'s dims: the manifest's, with that layer's own where it records any."""
        own = self.entry(layer).dims
        return replace(self.dims, **own) if own else self.dims

    def to_json(self) -> str:
        d = asdict(self)
        d["layers"] = [{k: v for k, v in asdict(e).items() if k != "dims" or v} for e in self.layers]
        return json.dumps(d, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str, origin: str = "manifest") -> MlaManifest:
        """The manifest in `text`; every field of the type the writer gives it, or an ArtifactError
        naming `origin` and the field (the plugin and verify read any bytes a disk holds)."""
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ArtifactError(f"{origin}: not valid JSON ({e})") from e
        if not isinstance(d, dict):
            raise ArtifactError(f"{origin}: expected a JSON object")
        if d.get("format") != FORMAT_NAME:
            raise ArtifactError(f"{origin}: format is {d.get('format')!r}, expected {FORMAT_NAME!r}")
        version = d.get("format_version")
        if version != FORMAT_VERSION or isinstance(version, bool):
            raise ArtifactError(
                f"{origin}: format_version {version!r} is not supported "
                f"(this mla_runtime reads version {FORMAT_VERSION}); re-run mla-convert"
            )
        if d.get("dtype") != ARTIFACT_DTYPE:
            raise ArtifactError(f"{origin}: dtype {d.get('dtype')!r}, expected {ARTIFACT_DTYPE!r}")
        try:
            dims = MlaDims(**_dims(d.get("dims"), "dims", partial=False))
            layers = tuple(
                _layer_entry(e, f"layers[{i}]") for i, e in enumerate(_typed(d.get("layers"), list, "layers"))
            )
            fp = _typed(d.get("source_fingerprint"), str, "source_fingerprint")
            producer = _typed(d.get("producer") or {}, dict, "producer")
        except _FieldError as e:
            raise ArtifactError(f"{origin}: malformed manifest ({e})") from e
        ids = [e.layer for e in layers]
        if ids != sorted(set(ids)):
            raise ArtifactError(f"{origin}: layer list must be sorted and unique, got {ids}")
        for e in layers:
            if Path(e.file).name != e.file or e.file in ("", ".", ".."):
                raise ArtifactError(f"{origin}: layer {e.layer} file {e.file!r} must be a plain file name")
        return cls(dims=dims, layers=layers, source_fingerprint=fp, producer=dict(producer))


class _FieldError(ValueError):
    """A manifest field missing or of another type than the writer gives it; says which."""


_JSON_TYPES = {dict: "an object", list: "a list", str: "a string", int: "an integer"}


def _typed(value, kind: type, what: str):
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        got = "missing" if value is None else f"{value!r}"
        raise _FieldError(f"{what} must be {_JSON_TYPES[kind]}, got {got}")
    return value


def _count(value, what: str, least: int) -> int:
    if _typed(value, int, what) < least:
        raise _FieldError(f"{what} must be an integer of at least {least}, got {value!r}")
    return value


def _dims(d, what: str, partial: bool) -> dict[str, int]:
    """MlaDims' fields from `d` (all of them, or with `partial` any of them), positive integers."""
    d = _typed(d, dict, what)
    unknown = sorted(set(d) - set(MlaDims.__dataclass_fields__))
    if unknown:
        raise _FieldError(f"{what}.{unknown[0]} is not an MLA dimension ({', '.join(MlaDims.__dataclass_fields__)})")
    names = d if partial else MlaDims.__dataclass_fields__
    return {k: _count(d.get(k), f"{what}.{k}", 1) for k in names}


def _layer_entry(e, what: str) -> LayerEntry:
    e = _typed(e, dict, what)
    own = e.get("dims")
    return LayerEntry(
        _count(e.get("layer"), f"{what}.layer", 0),
        _typed(e.get("file"), str, f"{what}.file"),
        _count(e.get("size"), f"{what}.size", 0),
        _typed(e.get("sha256"), str, f"{what}.sha256"),
        None if own is None else _dims(own, f"{what}.dims", partial=True) or None,
    )


def read_manifest(artifacts_dir: str | Path) -> MlaManifest:
    path = Path(artifacts_dir) / MANIFEST_NAME
    try:
        data = path.read_bytes()
    except FileNotFoundError as e:
        raise ArtifactError(f"{path}: no MLA manifest (was this directory written by mla-convert?)") from e
    except OSError as e:
        raise ArtifactError(f"{path}: cannot read the MLA manifest ({e.strerror or e})") from e
    return MlaManifest.from_json(decode_text(data, path), origin=str(path))


def decode_text(data: bytes, path: Path | str) -> str:
    """A JSON file's bytes as text; ArtifactError naming the file where they are not UTF-8."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ArtifactError(
            f"{path}: not UTF-8 text (byte {e.start} is {data[e.start]:#04x}); the file is damaged"
        ) from e
