"""Plan a conversion from headers alone: what each output shard holds and which source tensors
(weight and its possibly distant scale) it needs. Nothing is read or written here."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from mla_convert.constants import (
    CARD_NAME,
    CHANNEL_FP8,
    CHANNEL_SCALE_SUFFIX,
    CONFIG_NAME,
    FLOAT_WEIGHT_DTYPES,
    FP8_E4M3,
    INDEX_NAME,
    MLA_DIR_NAME,
    MLA_MANIFEST_NAME,
)
from mla_convert.plan.ops import CONVERTING_OPS, COPY, FP8_SCALE, QUANT_FP8, TO_BF16, TO_FP8
from mla_convert.plan.output_config import output_config
from mla_convert.settings import Options
from mla_convert.source.checkpoint import SourceCheckpoint, module_of
from mla_convert.source.family import FP8_LINEAR, linear_kind
from mla_runtime.format import kv_b_layer_index, layer_file_name
from mla_runtime.safetensors_file import nbytes_of


@dataclass(frozen=True)
class OutTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    op: str
    source: str  # source tensor name (for converted weights: the FP8 weight)


@dataclass
class ShardJob:
    file: str
    tensors: list[OutTensor]
    mla_layers: list[int] = field(default_factory=list)  # kv_b_proj layers converted in this job

    @property
    def out_bytes(self) -> int:
        return sum(nbytes_of(t.dtype, t.shape) for t in self.tensors)


@dataclass
class Plan:
    source: SourceCheckpoint
    options: Options
    shards: list[ShardJob]
    config: dict
    ignored_modules: list[str]  # the config's ignore list: 're:' patterns, then module names

    @property
    def mla_layers(self) -> list[int]:
        return sorted(i for job in self.shards for i in job.mla_layers)

    def inputs_of(self, job: ShardJob) -> dict[str, str]:
        """Source tensor name -> source file for everything `job` reads, partner scales included."""
        src = self.source
        need: dict[str, str] = {}
        for t in job.tensors:
            if t.op == FP8_SCALE:
                continue
            need[t.source] = src.weight_map[t.source]
            if t.source in src.fp8:
                pair = src.fp8[t.source]
                need[pair.scale.name] = pair.scale_file
        return need

    def job_outputs(self) -> dict[str, list[str]]:
        """Each shard job's files: its shard and the MLA layer files of the kv_b_proj it holds."""
        return {job.file: [job.file, *map(mla_file_rel, job.mla_layers)] for job in self.shards}

    def writes(self) -> set[str]:
        """Every file the conversion writes, relative to --out."""
        files = {rel for rels in self.job_outputs().values() for rel in rels}
        card = {CARD_NAME} if self.options.card else set()  # also where the source has no README of its own
        return (
            files
            | set(self.source.side_files)
            | card
            | {CONFIG_NAME, INDEX_NAME, f"{MLA_DIR_NAME}/{MLA_MANIFEST_NAME}"}
        )

    def ops(self) -> tuple[str, ...]:
        """The converting ops the plan uses, in CONVERTING_OPS' order (what the kernels must run)."""
        used = {t.op for job in self.shards for t in job.tensors}
        return tuple(op for op in CONVERTING_OPS if op in used)

    def in_bytes(self, job: ShardJob) -> int:
        return sum(self.source.info(n).nbytes for n in self.inputs_of(job))

    def summary(self) -> dict:
        out_shards = sum(j.out_bytes for j in self.shards)
        d = self.source.dims
        mla = len(self.mla_layers) * 2 * (math.prod(d.w_uk_t_shape()) + math.prod(d.w_uv_shape()))  # bf16
        side = sum((self.source.root / f).stat().st_size for f in self.source.side_files)
        return {
            "source": str(self.source.root),
            "format": self.options.format,
            "target": self.options.target,
            "fp8_max": self.options.fp8_max,
            "shards": len(self.shards),
            "tensors_in": len(self.source.weight_map),
            "tensors_out": sum(len(j.tensors) for j in self.shards),
            "fp8_weights_converted": len(self.source.fp8),
            "bf16_linears_quantized": sum(t.op == QUANT_FP8 for job in self.shards for t in job.tensors),
            "mla_layers": len(self.mla_layers),
            "bytes_in": self.source.total_bytes(),
            "bytes_out_model": out_shards,
            "bytes_out_mla": mla,
            "disk_needed": out_shards + mla + side,
            "ignored_modules": len(self.ignored_modules),
        }


def is_ignored(module: str, patterns: tuple[str, ...]) -> bool:
    return any(re.match(p, module) for p in patterns)


def quantizable(src: SourceCheckpoint, name: str) -> bool:
    """A BF16 source's linear that a channel-FP8 conversion quantizes: one that DeepSeek's FP8
    releases quantize (family.FP8_LINEAR), stored as a 2-D float weight. In an FP8 source, a 16-bit
    linear is the source's own choice (modules_to_not_convert): copied, never quantized."""
    if src.block is not None or not name.endswith(".weight"):
        return False
    info = src.info(name)
    return len(info.shape) == 2 and info.dtype in FLOAT_WEIGHT_DTYPES and linear_kind(module_of(name)) == FP8_LINEAR


def make_plan(src: SourceCheckpoint, options: Options) -> Plan:
    """One output shard per source shard, same file name; every tensor stays in its weight's shard."""
    by_file: dict[str, list[OutTensor]] = {f: [] for f in sorted(src.headers)}
    unquantized: set[str] = set()
    scale_names = {p.scale.name for p in src.fp8.values()}
    for name in sorted(src.weight_map):
        if name in scale_names:
            continue  # consumed with its weight; no *_scale_inv in the output
        info = src.info(name)
        out = by_file[src.weight_map[name]]
        module = module_of(name)
        if options.format == CHANNEL_FP8 and quantizable(src, name) and not is_ignored(module, options.ignore):
            out.append(OutTensor(name, FP8_E4M3, info.shape, QUANT_FP8, name))
            out.append(OutTensor(module + CHANNEL_SCALE_SUFFIX, "F32", (info.shape[0], 1), FP8_SCALE, name))
            continue
        if name not in src.fp8:
            out.append(OutTensor(name, info.dtype, info.shape, COPY, name))
            if len(info.shape) == 2 and name.endswith(".weight") and not name.endswith("embed_tokens.weight"):
                unquantized.add(module)  # a linear left in 16 bits (lm_head, gate, eh_proj, modules_to_not_convert)
            continue
        if options.format != CHANNEL_FP8 or is_ignored(module, options.ignore):
            out.append(OutTensor(name, "BF16", info.shape, TO_BF16, name))
            if not is_ignored(module, options.ignore):
                unquantized.add(module)
        else:
            out.append(OutTensor(name, FP8_E4M3, info.shape, TO_FP8, name))
            out.append(OutTensor(module + CHANNEL_SCALE_SUFFIX, "F32", (info.shape[0], 1), FP8_SCALE, name))
    jobs = []
    for file, tensors in by_file.items():
        layers = sorted(i for t in tensors if (i := kv_b_layer_index(t.source)) is not None and t.op != FP8_SCALE)
        jobs.append(ShardJob(file, tensors, layers))
    # User patterns go in as compressed-tensors 're:' entries (re.match, as vLLM applies them);
    # listing every matched expert by name would make R1's config.json megabytes long.
    ignored = (
        [f"re:{p}" for p in options.ignore] + sorted(m for m in unquantized if not is_ignored(m, options.ignore))
        if options.format == CHANNEL_FP8
        else []
    )
    return Plan(src, options, jobs, output_config(src.config, options.format, ignored), ignored)


def mla_file_rel(layer: int) -> str:
    return f"{MLA_DIR_NAME}/{layer_file_name(layer)}"
