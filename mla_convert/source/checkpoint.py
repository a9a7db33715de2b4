"""The source checkpoint: config, index and shard headers, validated before anything is written.
No torch here, and no tensor data is read: the scales' values (and INT4 weight shapes) are checked
by conversion.scales.

The family's rules are written in DeepSeek-V3's names; a member that names its tensors otherwise
(source/members/) is checked through its `names` (source.naming), and keeps its own
names in the output."""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mla_convert.constants import (
    BLOCK_SCALE_SUFFIX,
    FLOAT_WEIGHT_DTYPES,
    FP8_E4M3,
    INT4_PACKED,
    INT4_PACKED_DTYPE,
    INT4_SCALE,
    INT4_SHAPE,
    INT4_SHAPE_DTYPES,
    INT4_ZERO_POINT,
    MANIFEST_NAME,
    MLA_DIR_NAME,
)
from mla_convert.errors import SourceError
from mla_convert.io.headers import read_header
from mla_convert.source.family import FamilyError, ModelLayout, implied_tensors, indexer_placement, layer_config
from mla_convert.source.model_config import ModelConfig, read_json_object, read_model_config
from mla_convert.source.naming import TensorNames
from mla_convert.source.quantization import BLOCK_FP8, INT4, QuantizationError, SourceQuantization, read_quantization
from mla_convert.source.shapes import Labels, shape_mismatch, shape_rules
from mla_runtime.format import MlaDims
from mla_runtime.safetensors_file import ShardHeader, TensorInfo

__all__ = ["BlockFp8Weight", "Int4Weight", "SourceCheckpoint", "checked_member", "module_of", "open_source",
           "read_json_object"]  # fmt: skip


def module_of(weight_name: str) -> str:
    """'model.layers.3.self_attn.kv_b_proj.weight' -> 'model.layers.3.self_attn.kv_b_proj'."""
    return weight_name.rsplit(".", 1)[0]


@dataclass(frozen=True)
class BlockFp8Weight:
    """One block-FP8 weight of the source: its tensor, its block scale and the file that holds the scale."""

    weight: TensorInfo
    scale: TensorInfo
    scale_file: str


@dataclass(frozen=True)
class Int4Weight:
    """One pack-quantized INT4 linear: its tensors (by the checkpoint's names) and its [N, K]."""

    module: str
    packed: TensorInfo  # I32 [N, ceil(K / 8)]
    scale: TensorInfo  # [N, K / group_size] (one column for strategy channel)
    shape: TensorInfo  # I32 (or I64) [2]: the values N, K
    zero_point: TensorInfo | None  # I32 [ceil(N / 8), K / group_size], asymmetric schemes only
    rows: int
    cols: int  # K

    def tensors(self) -> tuple[TensorInfo, ...]:
        return (self.packed, self.scale, self.shape) + ((self.zero_point,) if self.zero_point else ())


@dataclass(frozen=True)
class SourceCheckpoint:
    root: Path
    model: ModelConfig  # how the directory describes the model (config.json, nested, params.json)
    index_bytes: bytes  # b"" for a single-file checkpoint without an index
    weight_map: dict[str, str]  # tensor name -> file name (relative to root)
    headers: dict[str, ShardHeader]  # file name -> parsed header
    layout: ModelLayout  # the family member's structure, from the config
    quant: SourceQuantization  # what the source's quantization_config describes
    block_fp8: dict[str, BlockFp8Weight]  # block-FP8 weight tensor name -> its weight and scale
    side_files: tuple[str, ...]  # relative paths of everything else to copy
    int4: dict[str, Int4Weight] = field(default_factory=dict)  # INT4 module name -> its tensors
    deepseek: dict[str, str] = field(default_factory=dict)  # DeepSeek-V3 name -> the checkpoint's, where one maps

    @property
    def config(self) -> dict:
        """The text model's config in config.json's names (what source.family reads)."""
        return self.model.text

    @property
    def config_bytes(self) -> bytes:
        return self.model.raw_bytes

    @property
    def names(self) -> TensorNames:
        return self.model.names

    @property
    def block(self) -> tuple[int, int] | None:
        """The block-FP8 scale block; None for a BF16 or INT4 source."""
        return self.quant.block

    @property
    def dims(self) -> MlaDims:
        return MlaDims.from_model_config(self.config)

    def own_dims(self, layer: int) -> dict | None:
        """The MLA dims layer `layer` has of its own (MlaDims' names), only those that differ from
        the model's; None where none do (the MLA manifest then records none)."""
        dims = MlaDims.from_model_config(layer_config(self.config, self.layout.architecture, layer))
        own = {k: v for k, v in asdict(dims).items() if getattr(self.dims, k) != v}
        return own or None

    @property
    def num_layers_with_mtp(self) -> int:
        return self.layout.all_layers

    def info(self, name: str) -> TensorInfo:
        return self.headers[self.weight_map[name]].tensors[name]

    def total_bytes(self) -> int:
        return sum(h.file_size for h in self.headers.values())

    def fingerprint(self) -> str:
        """sha256 over config, index and every shard's size and header: cheap, and it changes when
        any tensor's name, dtype, shape or position does. Tensor data is covered by verify."""
        h = hashlib.sha256()
        h.update(hashlib.sha256(self.config_bytes).digest())
        h.update(hashlib.sha256(self.index_bytes).digest())
        for name in sorted(self.headers):
            hd = self.headers[name]
            h.update(f"{name}\0{hd.file_size}\0".encode())
            h.update(hashlib.sha256(hd.header_bytes).digest())
        return h.hexdigest()

    def weight_shape(self, deepseek_weight: str) -> tuple[int, ...] | None:
        """The [N, K] of a linear by its DeepSeek-V3 weight name (an INT4 one's from its packed
        tensors), or a tensor's shape; None when the checkpoint has no such tensor."""
        name = self.deepseek.get(deepseek_weight)
        if name is not None:
            return self.info(name).shape
        w = self.int4.get(self.names.module_from_deepseek(module_of(deepseek_weight))) if self.int4 else None
        return (w.rows, w.cols) if w else None


def check_config(model: ModelConfig, path: Path) -> tuple[ModelLayout, SourceQuantization]:
    """Accept a supported MLA architecture with a quantization this tool reads; return its layout
    and the source's quantization (source.quantization)."""
    try:
        layout = ModelLayout.of(model.text, model.label)
    except FamilyError as e:
        raise SourceError(f"{path}: {model.where()}{e}") from e
    try:
        return layout, read_quantization(model.quantization)
    except QuantizationError as e:
        raise SourceError(f"{path}: {e}") from e


def checked_member(root: Path, rel: str, what: str) -> Path:
    """Resolve `rel` inside `root`, refusing absolute paths, '..' and symlinks that leave the source.

    A Hugging Face cache snapshot links its files to '../../blobs/': that blobs folder is allowed.
    """
    if not isinstance(rel, str) or not rel or "\0" in rel or os.path.isabs(rel) or ".." in Path(rel).parts:
        raise SourceError(f"{root}: {what} {rel!r} must be a relative path inside the checkpoint")
    path = root / rel
    real = path.resolve()
    allowed = [root.resolve()]
    if root.parent.name == "snapshots" and (root.parent.parent / "blobs").is_dir():
        allowed.append((root.parent.parent / "blobs").resolve())
    if not any(real == a or a in real.parents for a in allowed):
        raise SourceError(f"{path}: {what} leads outside the checkpoint (to {real})")
    return path


def open_source(root: str | Path, remote_headers: dict[str, ShardHeader] | None = None) -> SourceCheckpoint:
    """Read and validate a source checkpoint from headers only. Raises SourceError.

    `remote_headers` (file -> header) stands in for shards not downloaded yet (--stream)."""
    root = Path(root)
    if not root.is_dir():
        raise SourceError(f"{root}: not a directory")
    model = read_model_config(root)
    config_path = root / model.file
    layout, quant = check_config(model, config_path)
    index_bytes, weight_map, headers = _read_index_and_headers(root, model, remote_headers)
    deepseek = {}
    for name in weight_map:
        if (d := model.names.to_deepseek(name)) is not None:
            deepseek[d] = name
    int4 = _int4_weights(root, weight_map, headers, quant, config_path)
    src = SourceCheckpoint(
        root, model, index_bytes, weight_map, headers, layout, quant,
        _pair_block_fp8(root, weight_map, headers, quant, config_path), _side_files(root, model, headers),
        _int4_shapes(root, weight_map, model.text, model.names, quant, int4), deepseek,
    )  # fmt: skip
    _check_layers(src)
    return src


def _read_index_and_headers(
    root: Path, model: ModelConfig, remote_headers: dict[str, ShardHeader] | None
) -> tuple[bytes, dict[str, str], dict[str, ShardHeader]]:
    """The index's bytes (b"" without one), weight_map and every shard's header, which must agree."""
    index_name, single = model.index_name, model.single_file_name
    index_path = root / index_name
    if index_path.exists():
        index, index_bytes = read_json_object(index_path, "safetensors index")
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise SourceError(f"{index_path}: no weight_map")
        if not all(isinstance(v, str) for v in weight_map.values()):
            raise SourceError(f"{index_path}: weight_map values must be file names")
    elif (root / single).exists():
        index_bytes = b""
        weight_map = None
    else:
        raise SourceError(f"{root}: no {index_name} and no {single}; not a safetensors checkpoint")

    files = sorted(set(weight_map.values())) if weight_map else [single]
    headers: dict[str, ShardHeader] = {}
    for rel in files:
        path = checked_member(root, rel, "shard")
        if remote_headers and rel in remote_headers:
            headers[rel] = remote_headers[rel]
            continue
        if not path.is_file():
            raise SourceError(f"{path}: shard named in {index_name} does not exist")
        headers[rel] = read_header(path)
    if weight_map is None:
        weight_map = {n: single for n in headers[single].tensors}
    for name, rel in weight_map.items():
        if name not in headers[rel].tensors:
            raise SourceError(f"{root / rel}: tensor {name!r} listed in the index is not in this shard")
    for rel, hd in headers.items():
        for name in hd.tensors:
            if weight_map.get(name) != rel:
                raise SourceError(f"{root / rel}: tensor {name!r} is in this shard but not in the index")
    return index_bytes, dict(weight_map), headers


def _pair_block_fp8(root, weight_map, headers, quant: SourceQuantization, config_path) -> dict[str, BlockFp8Weight]:
    """Every F8_E4M3 weight with its block scale (DeepSeek's `weight_scale_inv`, compressed-tensors'
    `weight_scale`), checked against the block size."""

    def info(name):
        return headers[weight_map[name]].tensors[name]

    block, suffix = quant.block, quant.scale_suffix
    pairs: dict[str, BlockFp8Weight] = {}
    for name in weight_map:
        if name.endswith(BLOCK_SCALE_SUFFIX) and quant.kind != BLOCK_FP8:
            raise SourceError(
                f"{root / weight_map[name]}: block scale {name!r}, but {config_path} has no quantization_config "
                "with its weight_block_size"
            )
        if quant.kind != BLOCK_FP8 or not name.endswith(suffix):
            continue
        wname = name[: -len(suffix)] + ".weight"
        where = root / weight_map[name]
        if wname not in weight_map:
            raise SourceError(f"{where}: scale {name!r} has no weight {wname!r}")
        w, s = info(wname), info(name)
        if w.dtype != FP8_E4M3:
            raise SourceError(
                f"{root / weight_map[wname]}: tensor {wname!r} has a block scale but dtype {w.dtype}, expected F8_E4M3"
            )
        if s.dtype not in quant.scale_dtypes:
            raise SourceError(
                f"{where}: scale {name!r} has dtype {s.dtype}; expected {' or '.join(quant.scale_dtypes)}"
                + (" (float8_e8m0fnu)" if "F8_E8M0" in quant.scale_dtypes else "")
            )
        if len(w.shape) != 2:
            raise SourceError(
                f"{root / weight_map[wname]}: FP8 weight {wname!r} has shape {list(w.shape)}, expected 2-D"
            )
        grid = (math.ceil(w.shape[0] / block[0]), math.ceil(w.shape[1] / block[1]))
        if tuple(s.shape) != grid:
            what = "weight_block_size" if suffix == BLOCK_SCALE_SUFFIX else "block_structure"
            raise SourceError(
                f"{where}: scale {name!r} has shape {list(s.shape)} but weight {wname!r} {list(w.shape)} "
                f"with the config's {block[0]}x{block[1]} blocks ({what}) needs {list(grid)}"
            )
        pairs[wname] = BlockFp8Weight(w, s, weight_map[name])
    for name, rel in weight_map.items():
        if headers[rel].tensors[name].dtype == FP8_E4M3 and name not in pairs:
            scale = name[: -len(".weight")] + suffix if name.endswith(".weight") else name + "_scale_inv"
            raise SourceError(f"{root / rel}: FP8 tensor {name!r} has no {scale}; cannot dequantize it")
    return pairs


def _int4_weights(root, weight_map, headers, quant: SourceQuantization, config_path) -> dict[str, Int4Weight]:
    """Every pack-quantized INT4 linear of an INT4 source, with its partner tensors (which may sit
    in other shards), their dtypes checked; their shapes are checked by _check_int4_shapes."""

    def info(name):
        return headers[weight_map[name]].tensors[name]

    out: dict[str, Int4Weight] = {}
    packed_suffix = "." + INT4_PACKED
    for name in weight_map:
        if not name.endswith(packed_suffix):
            continue
        module, where = name[: -len(packed_suffix)], root / weight_map[name]
        if quant.kind != INT4:
            raise SourceError(f"{where}: INT4 tensor {name!r}, but {config_path} has no pack-quantized INT4 group")
        parts = {s: f"{module}.{s}" for s in (INT4_SCALE, INT4_SHAPE, INT4_ZERO_POINT)}
        for s in (INT4_SCALE, INT4_SHAPE):
            if parts[s] not in weight_map:
                raise SourceError(f"{where}: INT4 weight {name!r} has no {parts[s]!r}")
        has_zero = parts[INT4_ZERO_POINT] in weight_map
        if has_zero == quant.int4.symmetric:
            state = "has" if has_zero else "lacks"
            raise SourceError(
                f"{where}: INT4 module {module!r} {state} {INT4_ZERO_POINT}, but its group "
                f"{quant.int4.group_name!r} says symmetric: {str(quant.int4.symmetric).lower()}"
            )
        packed, scale, shape = info(name), info(parts[INT4_SCALE]), info(parts[INT4_SHAPE])
        for t, want in ((packed, (INT4_PACKED_DTYPE,)), (scale, FLOAT_WEIGHT_DTYPES), (shape, INT4_SHAPE_DTYPES)):
            if t.dtype not in want:
                raise SourceError(
                    f"{root / weight_map[t.name]}: {t.name!r} has dtype {t.dtype}; expected {' or '.join(want)}"
                )
        zero = info(parts[INT4_ZERO_POINT]) if has_zero else None
        if zero is not None and zero.dtype != INT4_PACKED_DTYPE:
            raise SourceError(f"{root / weight_map[zero.name]}: {zero.name!r} has dtype {zero.dtype}; expected I32")
        out[module] = Int4Weight(module, packed, scale, shape, zero, 0, 0)
    return out


def _int4_shapes(root: Path, weight_map, text: dict, names: TensorNames, quant: SourceQuantization,
                 int4: dict[str, Int4Weight]) -> dict[str, Int4Weight]:  # fmt: skip
    """Each INT4 linear with its [N, K]: its packed weight, scale and zero points agree with each
    other and with the group size, and the group size divides K. K is the config's where the
    family implies the module (a mismatch with the config is _check_layers' to name), else the
    packed columns x 8."""
    if not int4:
        return int4
    implied = implied_tensors(text)
    out = {}
    for module, w in int4.items():
        where = root / weight_map[w.packed.name]
        if len(w.packed.shape) != 2:
            raise SourceError(f"{where}: {w.packed.name!r} has shape {list(w.packed.shape)}, expected 2-D [N, K / 8]")
        n, p = w.packed.shape
        deepseek = names.module_to_deepseek(module)
        want = implied.get(f"{deepseek}.weight", ((0, 0),))[0] if deepseek else (0, 0)
        k = want[1] if math.ceil(want[1] / 8) == p else p * 8
        g = quant.int4.columns_per_scale(k)
        if k % g:
            raise SourceError(
                f"{where}: group_size {g} does not divide the {k} columns of {module!r} (its [N, K] is [{n}, {k}])"
            )
        checks = [(w.scale, (n, k // g), f"[N, K / group_size] = [{n}, {k} / {g}]"), (w.shape, (2,), "[2]: N, K")]
        if w.zero_point is not None:
            checks.append((w.zero_point, (math.ceil(n / 8), k // g), f"[N / 8, K / group_size] = [{n} / 8, {k} / {g}]"))
        for t, shape, rule in checks:
            if tuple(t.shape) != shape:
                raise SourceError(
                    f"{root / weight_map[t.name]}: {t.name!r} has shape {list(t.shape)}, which does not match its "
                    f"packed weight {w.packed.name!r} {list(w.packed.shape)}: {rule} = {list(shape)}"
                )
        out[module] = Int4Weight(module, w.packed, w.scale, w.shape, w.zero_point, n, k)
    return out


def _check_layers(src: SourceCheckpoint) -> None:
    """Every attention layer (MTP included) is there, and its tensors have the config's dims."""
    lay, names, model = src.layout, src.names, src.model
    q_names = ("q_a_proj.weight", "q_b_proj.weight") if lay.q_lora_rank else ("q_proj.weight",)
    required = ("kv_b_proj.weight", "kv_a_proj_with_mqa.weight", "o_proj.weight", *q_names)
    labels = Labels(field=model.label, tensor=names.from_deepseek)
    try:  # a member's layer may lack one of them (a KV-sharing layer's kv_a_proj_with_mqa)
        implied = implied_tensors(src.config)
    except (KeyError, TypeError):  # a missing MoE or vocabulary size: verify's tensor set names it
        implied = None
    for i in range(lay.all_layers):
        prefix = f"model.layers.{i}.self_attn."
        wanted = [s for s in required if implied is None or prefix + s in implied]
        missing = [prefix + s for s in wanted if src.weight_shape(prefix + s) is None]
        if missing:
            hint = ""
            if lay.q_lora_rank and src.weight_shape(prefix + "q_proj.weight") is not None:
                hint = f"; its q_lora_rank {lay.q_lora_rank} needs q_a_proj / q_b_proj, the checkpoint has q_proj"
            elif not lay.q_lora_rank and src.weight_shape(prefix + "q_a_proj.weight") is not None:
                hint = "; its q_lora_rank null needs q_proj, the checkpoint has q_a_proj / q_b_proj"
            raise SourceError(
                f"{src.root}: layer {i} has no {names.from_deepseek(missing[0])!r}; the checkpoint is incomplete "
                f"or {model.file} describes another model{hint}"
            )
        if names.module_from_deepseek(prefix + "kv_b_proj") in src.int4:
            raise SourceError(f"{src.root}: layer {i}'s kv_b_proj is INT4; only a 16-bit or block-FP8 one is supported")
        suffixes = {rule.suffix for rule in shape_rules(lay, i)}
        shapes = {s: shape for s in suffixes if (shape := src.weight_shape(f"model.layers.{i}.{s}")) is not None}
        problem = shape_mismatch(layer_config(src.config, lay.architecture, i), lay, i, shapes, labels)
        if problem:
            raise SourceError(f"{src.root / model.file}: {model.where()}{problem}")
        _check_indexer(src, i)


def _check_indexer(src: SourceCheckpoint, i: int) -> None:
    """Layer i holds an indexer exactly when the config says it does (IndexShare's indexer_types, or
    the placement derived from index_topk_freq / index_topk_pattern)."""
    lay = src.layout
    if lay.indexer is None:
        return
    has = src.weight_shape(f"model.layers.{i}.self_attn.indexer.wk.weight") is not None
    wants = i in lay.indexer_layers
    if has == wants:
        return
    placement = indexer_placement(src.config)
    said = repr(src.config["indexer_types"][i]) if placement == "indexer_types" and i < lay.layers else None
    said = said or ("an indexer" if wants else "none (it shares another layer's)")
    raise SourceError(
        f"{src.root / src.model.file}: layer {i} {'holds' if has else 'has no'} self_attn.indexer.*, but "
        f"{placement} gives it {said}; the config does not describe these tensors"
    )


def _side_files(root: Path, model: ModelConfig, headers: dict[str, ShardHeader]) -> tuple[str, ...]:
    """Every non-weight file to carry over (tokenizer, generation config, remote code, docs...).

    A source that is itself an mla-convert output (a bf16 conversion, converted again) keeps its
    own MLA artifacts and conversion manifest: the output gets new ones."""
    skip = {model.index_name, model.file, MANIFEST_NAME, *headers}
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        top = os.path.samefile(dirpath, root)
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and not (top and d == MLA_DIR_NAME))
        for fn in sorted(filenames):
            rel = os.path.relpath(os.path.join(dirpath, fn), root)
            if fn.startswith(".") or rel in skip or fn.endswith(".safetensors"):
                continue
            out.append(rel)
    return tuple(out)
