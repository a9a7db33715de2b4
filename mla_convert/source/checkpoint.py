"""The source checkpoint: config, index and shard headers, validated before anything is written.
No torch here, and no tensor data is read: the scales' values are checked by conversion.scales."""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from mla_convert.constants import (
    BLOCK_SCALE_DTYPES,
    BLOCK_SCALE_SUFFIX,
    CONFIG_NAME,
    FP8_E4M3,
    INDEX_NAME,
    MANIFEST_NAME,
    MLA_DIR_NAME,
    SINGLE_FILE_NAME,
)
from mla_convert.errors import SourceError
from mla_convert.io.headers import read_header
from mla_convert.source.family import FamilyError, ModelLayout, shape_mismatch, shape_rules
from mla_runtime.format import MlaDims
from mla_runtime.safetensors_file import ShardHeader, TensorInfo


def module_of(weight_name: str) -> str:
    """'model.layers.3.self_attn.kv_b_proj.weight' -> 'model.layers.3.self_attn.kv_b_proj'."""
    return weight_name.rsplit(".", 1)[0]


@dataclass(frozen=True)
class Fp8Pair:
    weight: TensorInfo
    scale: TensorInfo
    scale_file: str


@dataclass(frozen=True)
class SourceCheckpoint:
    root: Path
    config: dict
    config_bytes: bytes
    index_bytes: bytes  # b"" for a single-file checkpoint without an index
    weight_map: dict[str, str]  # tensor name -> file name (relative to root)
    headers: dict[str, ShardHeader]  # file name -> parsed header
    layout: ModelLayout  # the family member's structure, from the config
    block: tuple[int, int] | None  # the FP8 scale block; None: a BF16 source (no quantization_config)
    fp8: dict[str, Fp8Pair]  # weight tensor name -> its weight and scale
    side_files: tuple[str, ...]  # relative paths of everything else to copy

    @property
    def dims(self) -> MlaDims:
        return MlaDims.from_model_config(self.config)

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


def check_config(config: dict, path: Path) -> tuple[ModelLayout, tuple[int, int] | None]:
    """Accept a supported MLA architecture, BF16 or with block-FP8 quantization; return its layout
    and the scale block (None: a BF16 source, no quantization_config)."""
    try:
        layout = ModelLayout.of(config)
    except FamilyError as e:
        raise SourceError(f"{path}: {e}") from e
    q = config.get("quantization_config")
    if q is None:
        return layout, None
    if not isinstance(q, dict):
        raise SourceError(f"{path}: quantization_config {q!r} is not an object")
    method, fmt, block = q.get("quant_method"), q.get("fmt", "e4m3"), q.get("weight_block_size")
    if method != "fp8":
        raise SourceError(
            f"{path}: quant_method {method!r} is not supported; expected block FP8 ('fp8') or no "
            "quantization_config (BF16)"
            + (" (this looks like a converted checkpoint)" if method == "compressed-tensors" else "")
        )
    if fmt != "e4m3":
        raise SourceError(f"{path}: FP8 format {fmt!r} is not supported; expected 'e4m3'")
    if (
        not isinstance(block, list)
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise SourceError(
            f"{path}: weight_block_size {block!r} is not supported; expected two positive ints like [128, 128]"
        )
    return layout, (block[0], block[1])


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
    config_path = root / CONFIG_NAME
    config, config_bytes = read_json_object(config_path, CONFIG_NAME)
    layout, block = check_config(config, config_path)

    index_path = root / INDEX_NAME
    if index_path.exists():
        index, index_bytes = read_json_object(index_path, "safetensors index")
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise SourceError(f"{index_path}: no weight_map")
        if not all(isinstance(v, str) for v in weight_map.values()):
            raise SourceError(f"{index_path}: weight_map values must be file names")
    elif (root / SINGLE_FILE_NAME).exists():
        index_bytes = b""
        weight_map = None
    else:
        raise SourceError(f"{root}: no {INDEX_NAME} and no {SINGLE_FILE_NAME}; not a safetensors checkpoint")

    files = sorted(set(weight_map.values())) if weight_map else [SINGLE_FILE_NAME]
    headers: dict[str, ShardHeader] = {}
    for rel in files:
        path = checked_member(root, rel, "shard")
        if remote_headers and rel in remote_headers:
            headers[rel] = remote_headers[rel]
            continue
        if not path.is_file():
            raise SourceError(f"{path}: shard named in {INDEX_NAME} does not exist")
        headers[rel] = read_header(path)
    if weight_map is None:
        weight_map = {n: SINGLE_FILE_NAME for n in headers[SINGLE_FILE_NAME].tensors}
    for name, rel in weight_map.items():
        if name not in headers[rel].tensors:
            raise SourceError(f"{root / rel}: tensor {name!r} listed in the index is not in this shard")
    for rel, hd in headers.items():
        for name in hd.tensors:
            if weight_map.get(name) != rel:
                raise SourceError(f"{root / rel}: tensor {name!r} is in this shard but not in the index")

    fp8 = _pair_fp8(root, weight_map, headers, block, config_path)
    src = SourceCheckpoint(
        root, config, config_bytes, index_bytes, dict(weight_map), headers, layout, block, fp8,
        _side_files(root, headers),
    )  # fmt: skip
    _check_layers(src)
    return src


def _pair_fp8(root, weight_map, headers, block, config_path) -> dict[str, Fp8Pair]:
    def info(name):
        return headers[weight_map[name]].tensors[name]

    pairs: dict[str, Fp8Pair] = {}
    for name in weight_map:
        if not name.endswith(BLOCK_SCALE_SUFFIX):
            continue
        wname = name[: -len("_scale_inv")]
        where = root / weight_map[name]
        if block is None:
            raise SourceError(
                f"{where}: block scale {name!r}, but {config_path} has no quantization_config with its weight_block_size"
            )
        if wname not in weight_map:
            raise SourceError(f"{where}: scale {name!r} has no weight {wname!r}")
        w, s = info(wname), info(name)
        if w.dtype != FP8_E4M3:
            raise SourceError(
                f"{root / weight_map[wname]}: tensor {wname!r} has a block scale but dtype {w.dtype}, expected F8_E4M3"
            )
        if s.dtype not in BLOCK_SCALE_DTYPES:
            raise SourceError(f"{where}: scale {name!r} has dtype {s.dtype}; expected F32 or F8_E8M0 (float8_e8m0fnu)")
        if len(w.shape) != 2:
            raise SourceError(
                f"{root / weight_map[wname]}: FP8 weight {wname!r} has shape {list(w.shape)}, expected 2-D"
            )
        grid = (math.ceil(w.shape[0] / block[0]), math.ceil(w.shape[1] / block[1]))
        if tuple(s.shape) != grid:
            raise SourceError(
                f"{where}: scale {name!r} has shape {list(s.shape)} but weight {wname!r} {list(w.shape)} "
                f"with the config's {block[0]}x{block[1]} blocks (weight_block_size) needs {list(grid)}"
            )
        pairs[wname] = Fp8Pair(w, s, weight_map[name])
    for name, rel in weight_map.items():
        if headers[rel].tensors[name].dtype == FP8_E4M3 and name not in pairs:
            raise SourceError(f"{root / rel}: FP8 tensor {name!r} has no {name}_scale_inv; cannot dequantize it")
    return pairs


def _check_layers(src: SourceCheckpoint) -> None:
    """Every attention layer (MTP included) is there, and its tensors have the config's MLA dims."""
    lay = src.layout
    q_names = ("q_a_proj.weight", "q_b_proj.weight") if lay.q_lora_rank else ("q_proj.weight",)
    required = ("kv_b_proj.weight", "kv_a_proj_with_mqa.weight", "o_proj.weight", *q_names)
    for i in range(lay.all_layers):
        prefix = f"model.layers.{i}.self_attn."
        missing = [prefix + s for s in required if prefix + s not in src.weight_map]
        if missing:
            hint = ""
            if lay.q_lora_rank and prefix + "q_proj.weight" in src.weight_map:
                hint = f"; its q_lora_rank {lay.q_lora_rank} needs q_a_proj / q_b_proj, the checkpoint has q_proj"
            elif not lay.q_lora_rank and prefix + "q_a_proj.weight" in src.weight_map:
                hint = "; its q_lora_rank null needs q_proj, the checkpoint has q_a_proj / q_b_proj"
            raise SourceError(
                f"{src.root}: layer {i} has no {missing[0]!r}; the checkpoint is incomplete or config.json "
                f"describes another model{hint}"
            )
        suffixes = {rule.suffix for rule in shape_rules(lay, i)}
        shapes = {s: src.info(prefix + s).shape for s in suffixes if prefix + s in src.weight_map}
        problem = shape_mismatch(src.config, lay, i, shapes)
        if problem:
            raise SourceError(f"{src.root / CONFIG_NAME}: {problem}")


def _side_files(root: Path, headers: dict[str, ShardHeader]) -> tuple[str, ...]:
    """Every non-weight file to carry over (tokenizer, generation config, remote code, docs...).

    A source that is itself an mla-convert output (a bf16 conversion, converted again) keeps its
    own MLA artifacts and conversion manifest: the output gets new ones."""
    skip = {INDEX_NAME, CONFIG_NAME, MANIFEST_NAME, *headers}
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
