"""verify, file tasks: what the data pass of one file is asked to check (FileTask, with a TensorTask
for each tensor that has a role in the conversion and an MlaTask for an artifact file), and what it
returns (FileResult). Tasks are plain data, which a worker process gets pickled; `file_tasks`
builds them from what the header pass learned and the source.

A tensor whose header does not match its expectation gets no job (its values are still checked):
the structure checks have reported it. There is a job for each of DeepSeek-R1's 91,991 tensors,
held through the data pass: they take slots, not a dict each, and the Refs of one file share its
path's string.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from mla_convert import formats
from mla_convert.constants import MLA_DIR_NAME
from mla_convert.plan.ops import FP8_SCALE, reads
from mla_convert.settings import Options
from mla_convert.source.checkpoint import SourceCheckpoint
from mla_convert.verification.report import Tally
from mla_convert.verification.rows import Ref
from mla_convert.verification.structure import Structure
from mla_convert.verification.values import selected
from mla_runtime.format import MlaDims, kv_b_name, layer_file_name
from mla_runtime.safetensors_file import ShardHeader


@dataclass(frozen=True, slots=True)
class TensorTask:
    """What to check for one tensor beyond its values (absent: values only)."""

    op: str  # the plan's op: COPY, TO_BF16, TO_FP8, QUANT_FP8, FP8_SCALE, ...
    scale: Ref | None = None  # a quantized weight: where its scale is (read by offset when it is not next in this file)
    scale_name: str | None = None  # a quantized weight: the name of its scale (the format's ScaleLayout)
    source: Ref | None = None  # with --source: the source tensor (an INT4 weight's weight_packed)
    source_scale: Ref | None = None  # with --source, block-FP8 sources: the block scale (INT4: its scales)
    group_size: int | None = None  # with --source, INT4_TO_BF16: columns per scale


@dataclass(frozen=True, slots=True)
class MlaTask:
    layer: int
    kv_b: Ref | None  # the converted model's kv_b_proj weight
    kv_b_scale: Ref | None  # ... and its scale (a format that quantizes it)
    source: Ref | None = None  # with --source: the source kv_b_proj and its block scale (none: 16-bit)
    source_scale: Ref | None = None


@dataclass(frozen=True, slots=True)
class FileTask:
    root: str
    rel: str
    header: ShardHeader | None  # None: hash only (side files, JSON, unparseable shards)
    fp8_max: float
    value_checks: tuple[str, ...] = ()  # the format's and target's (verification.values.selected)
    block: tuple[int, int] | None = None  # the source's block size (with a block-FP8 --source)
    dims: MlaDims | None = None
    rope_dim: int = 0
    tensors: dict[str, TensorTask] = field(default_factory=dict)
    mla: MlaTask | None = None


@dataclass
class FileResult:
    rel: str
    size: int | None  # None: the file is missing
    sha256: str | None
    tally: Tally


def file_tasks(
    root: Path, structure: Structure, manifest: dict, options: Options, src: SourceCheckpoint | None
) -> list[FileTask]:
    """One task for every file the conversion manifest or the index lists, and every artifact file
    whose header was read, sorted by path."""
    fmt = options.output_format
    common = {
        "root": str(root),
        "fp8_max": options.fp8_max,
        "value_checks": selected(fmt.value_checks, formats.target(options.target)),
        "block": src.block if src else None,
        "dims": structure.dims,
        "rope_dim": int((structure.config or {}).get("qk_rope_head_dim") or 0),
    }
    paths = _Paths()
    mla_files = {f"{MLA_DIR_NAME}/{layer_file_name(i)}": i for i in structure.mla_headers}
    rels = set(manifest["files"]) | set(structure.weight_map.values()) | set(mla_files)
    tasks = []
    for rel in sorted(rels):
        if rel in structure.headers:
            header = structure.headers[rel]
            jobs = {
                n: j for n, info in header.tensors.items() if (j := _tensor_task(n, info, structure, src, fmt, paths))
            }
            tasks.append(FileTask(rel=rel, header=header, tensors=jobs, **common))
        elif rel in mla_files:
            layer = mla_files[rel]
            at = common | {
                "dims": structure.mla_manifest.dims_of(layer)
            }  # a layer's own dims (checked against the config)
            mla = _mla_task(layer, structure, src, fmt, paths)
            tasks.append(FileTask(rel=rel, header=structure.mla_headers[layer], mla=mla, **at))
        else:
            tasks.append(FileTask(rel=rel, header=None, **common))
    return tasks


def _matches(structure: Structure, name: str, info) -> bool:
    """The header agrees with the expectation (else the structure check failed already)."""
    exp = structure.expects.get(name)
    return exp is not None and info is not None and exp.admits(info)


class _Paths:
    """Each file's path as one string, shared by the Refs into it."""

    def __init__(self) -> None:
        self._strings: dict[Path, str] = {}

    def __call__(self, path: Path) -> str:
        return self._strings.setdefault(path, str(path))


def _tensor_task(
    name: str, info, structure: Structure, src: SourceCheckpoint | None, fmt: formats.Format, paths: _Paths
) -> TensorTask | None:
    """What to check for a tensor beyond its values; None for one that does not match its
    expectation (only its values are checked)."""
    if not _matches(structure, name, info):
        return None
    exp = structure.expects[name]
    scale = fmt.scale_of(exp.op)
    scale_name = scale.name(name) if scale is not None else None
    source = source_scale = group = None
    if src is not None and exp.source is not None and exp.op != FP8_SCALE:
        source = _src_ref(src, exp.source, paths)
        if "block_scale" in reads(exp.op):
            source_scale = _src_ref(src, src.block_fp8[exp.source].scale.name, paths)
        if "group_scale" in reads(exp.op):
            w = src.int4[exp.source.rsplit(".", 1)[0]]
            source_scale, group = _src_ref(src, w.scale.name, paths), src.quant.int4.columns_per_scale(w.cols)
    scale_ref = _out_ref(structure, scale_name, paths) if scale_name else None
    return TensorTask(exp.op, scale_ref, scale_name, source, source_scale, group)


def _mla_task(
    layer: int, structure: Structure, src: SourceCheckpoint | None, fmt: formats.Format, paths: _Paths
) -> MlaTask:
    kv_b = structure.names.from_deepseek(kv_b_name(layer))  # the same name in the source and the output
    source = source_scale = None
    if src is not None and kv_b in src.block_fp8:
        source, source_scale = _src_ref(src, kv_b, paths), _src_ref(src, src.block_fp8[kv_b].scale.name, paths)
    elif src is not None and kv_b in src.weight_map:  # a 16-bit source kv_b_proj
        source = _src_ref(src, kv_b, paths)
    scale = fmt.scale_name(kv_b)
    kv_b_scale = _out_ref(structure, scale, paths) if scale else None
    return MlaTask(layer, _out_ref(structure, kv_b, paths), kv_b_scale, source, source_scale)


def _out_ref(structure: Structure, name: str, paths: _Paths) -> Ref | None:
    """Where an output tensor lies, if its header matches what it should be."""
    hd = structure.headers.get(structure.weight_map.get(name, ""))
    if hd is None or not _matches(structure, name, hd.tensors.get(name)):
        return None
    return Ref.of(paths(hd.path), hd, name)


def _src_ref(src: SourceCheckpoint, name: str, paths: _Paths) -> Ref:
    rel = src.weight_map[name]
    return Ref.of(paths(src.root / rel), src.headers[rel], name)
