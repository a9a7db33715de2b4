"""Plan a conversion from headers alone: what each output shard holds and which source tensors
(weight and its possibly distant scale) it needs. What each kind of source tensor becomes is the
output format's (formats.Format: its transform, dtype and scale); nothing is read or written here."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace

from mla_convert import formats
from mla_convert.constants import CARD_NAME, FLOAT_WEIGHT_DTYPES, MLA_DIR_NAME, MLA_MANIFEST_NAME
from mla_convert.errors import OptionError, SourceError
from mla_convert.formats import Becomes
from mla_convert.plan.ops import CONVERTING_OPS, COPY, FP8_SCALE, INT4_SHAPE, TO_BF16, reads
from mla_convert.plan.output_config import output_config
from mla_convert.settings import Options
from mla_convert.source.checkpoint import SourceCheckpoint, module_of
from mla_convert.source.family import FP8_LINEAR, linear_kind
from mla_runtime.format import MlaDims, kv_b_layer_index, layer_file_name
from mla_runtime.safetensors_file import nbytes_of


@dataclass(frozen=True)
class OutTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    op: str
    source: str  # source tensor name (for converted weights: the FP8 weight; INT4: its weight_packed)
    layer: int | None = None  # a layer's kv_b_proj weight: that layer (its MLA artifacts are written with it)


@dataclass
class OutShard:
    """One output shard: its file, its tensors in write order, the layers whose MLA artifacts go with it."""

    file: str
    tensors: list[OutTensor]
    mla_layers: list[int] = field(default_factory=list)  # kv_b_proj layers converted with this shard

    @property
    def out_bytes(self) -> int:
        return sum(nbytes_of(t.dtype, t.shape) for t in self.tensors)


@dataclass
class Plan:
    source: SourceCheckpoint
    options: Options
    shards: list[OutShard]
    config: dict
    ignore: list[str]  # the config's ignore list: 're:' patterns, then module names
    # The linears it leaves in 16 bits, which that list names (by pattern or name), in vLLM's names
    # (none where the format quantizes nothing: there is no list)
    ignored_modules: list[str]

    @property
    def mla_layers(self) -> list[int]:
        return sorted(i for shard in self.shards for i in shard.mla_layers)

    def dims_of(self, layer: int) -> MlaDims:
        """The MLA dims of `layer`'s artifacts: the model's, with those the member gives that layer
        of its own (SourceCheckpoint.own_dims: a NoPE layer's qk_nope_head_dim)."""
        own = self.source.own_dims(layer)
        return replace(self.source.dims, **own) if own else self.source.dims

    @property
    def config_name(self) -> str:
        """The output's config file: config.json, or a member's own config file (params.json)."""
        return self.source.model.file

    @property
    def index_name(self) -> str:
        return self.source.model.index_name

    def inputs_of(self, shard: OutShard) -> dict[str, str]:
        """Source tensor name -> source file for everything `shard`'s tensors read, partner scales included."""
        src = self.source
        need: dict[str, str] = {}
        for t in shard.tensors:
            if t.op == FP8_SCALE:
                continue
            need[t.source] = src.weight_map[t.source]
            if t.source in src.block_fp8:
                pair = src.block_fp8[t.source]
                need[pair.scale.name] = pair.scale_file
            if "group_scale" in reads(t.op):  # an INT4 weight converted
                w = src.int4[module_of(t.source)]
                need |= {p.name: src.weight_map[p.name] for p in (w.scale, w.shape)}
        return need

    def job_outputs(self) -> dict[str, list[str]]:
        """Each shard job's files: its shard and the MLA layer files of the kv_b_proj it holds."""
        return {shard.file: [shard.file, *map(mla_file_rel, shard.mla_layers)] for shard in self.shards}

    def writes(self) -> set[str]:
        """Every file the conversion writes, relative to --out."""
        files = {rel for rels in self.job_outputs().values() for rel in rels}
        card = {CARD_NAME} if self.options.card else set()  # also where the source has no README of its own
        return (
            files
            | set(self.source.side_files)
            | card
            | {self.config_name, self.index_name, f"{MLA_DIR_NAME}/{MLA_MANIFEST_NAME}"}
        )

    def ops(self) -> tuple[str, ...]:
        """The converting ops the plan uses, in CONVERTING_OPS' order (what the kernels must run)."""
        used = {t.op for shard in self.shards for t in shard.tensors}
        return tuple(op for op in CONVERTING_OPS if op in used)

    def in_bytes(self, shard: OutShard) -> int:
        return sum(self.source.info(n).nbytes for n in self.inputs_of(shard))

    def summary(self) -> dict:
        linear = self.options.output_format.float_linear
        quantize = linear.op if linear is not None else None
        out_shards = sum(j.out_bytes for j in self.shards)
        mla = sum(
            2 * (math.prod(d.w_uk_t_shape()) + math.prod(d.w_uv_shape())) for d in map(self.dims_of, self.mla_layers)
        )  # bf16, each layer at its own dims
        side = sum((self.source.root / f).stat().st_size for f in self.source.side_files)
        return {
            "source": str(self.source.root),
            "format": self.options.format,
            "target": self.options.target,
            "fp8_max": self.options.fp8_max,
            "shards": len(self.shards),
            "tensors_in": len(self.source.weight_map),
            "tensors_out": sum(len(j.tensors) for j in self.shards),
            "fp8_weights_converted": len(self.source.block_fp8),
            "bf16_linears_quantized": sum(t.op == quantize for shard in self.shards for t in shard.tensors),
            "mla_layers": len(self.mla_layers),
            "bytes_in": self.source.total_bytes(),
            "bytes_out_model": out_shards,
            "bytes_out_mla": mla,
            "bytes_out": out_shards + mla + side,
            "ignored_modules": len(self.ignored_modules),
        }


def is_ignored(module: str, patterns: tuple[str, ...]) -> bool:
    return any(re.match(p, module) for p in patterns)


def quantizable(src: SourceCheckpoint, name: str) -> bool:
    """A BF16 (or INT4) source's 16-bit linear that a channel-FP8 conversion quantizes: one that the
    member's FP8 releases quantize (family.FP8_LINEAR), stored as a 2-D float weight. In a block-FP8
    source, a 16-bit linear is the source's own choice (modules_to_not_convert): copied, never
    quantized."""
    if src.block is not None or not name.endswith(".weight"):
        return False
    deepseek = src.names.to_deepseek(name)
    info = src.info(name)
    return (
        deepseek is not None
        and len(info.shape) == 2
        and info.dtype in FLOAT_WEIGHT_DTYPES
        and linear_kind(module_of(deepseek), src.layout.architecture) == FP8_LINEAR
    )


class _Planner:
    """The output tensors of each shard, and what the config must say about them."""

    def __init__(self, src: SourceCheckpoint, options: Options):
        self.src, self.options = src, options
        self.fmt = options.output_format
        self.by_file: dict[str, list[OutTensor]] = {f: [] for f in sorted(src.headers)}
        self.unquantized: set[str] = set()  # text linears written in 16 bits (config-module names)
        self.extras: set[str] = set()  # prefixes of the other parts (vision) whose linears are copied
        self.left_16bit: set[str] = set()  # every linear written in 16 bits (config-module names)
        self.int4_packed = {w.packed.name: w for w in src.int4.values()}
        self.int4_shape = {w.shape.name: w for w in src.int4.values()}
        self.skip = {p.scale.name for p in src.block_fp8.values()}  # consumed with their weight
        if self.fmt.int4 is not None:  # converted: each INT4 weight's partners are read with its weight_packed
            self.skip |= {p.name for w in src.int4.values() for p in w.tensors() if p is not w.packed}

    def add(self, name: str) -> None:
        src, info = self.src, self.src.info(name)
        out, module = self.by_file[src.weight_map[name]], module_of(name)
        deepseek = src.names.to_deepseek(name)
        layer = kv_b_layer_index(deepseek) if deepseek else None
        ignored = is_ignored(src.names.config_module(module), self.options.ignore)
        if name in self.int4_packed or name in self.int4_shape:
            self._int4(name, out, ignored)
        elif self.fmt.float_linear is not None and quantizable(src, name) and not ignored:
            self._converted(out, name, info.shape, self.fmt.float_linear, layer)
        elif name not in src.block_fp8:
            out.append(OutTensor(name, info.dtype, info.shape, COPY, name, layer))
            if (
                len(info.shape) == 2
                and name.endswith(".weight")
                and not (deepseek or name).endswith("embed_tokens.weight")
            ):
                self._left_16bit(module)  # lm_head, gate, eh_proj, modules_to_not_convert, vision
        elif ignored:
            out.append(OutTensor(name, "BF16", info.shape, TO_BF16, name, layer))
            self.left_16bit.add(src.names.config_module(module))  # the user's pattern names it
        else:
            self._converted(out, name, info.shape, self.fmt.block_fp8, layer)
            if self.fmt.block_fp8.scale is None:
                self._left_16bit(module)

    def _converted(self, out: list[OutTensor], name: str, shape: tuple[int, ...], b: Becomes, layer) -> None:
        """A weight as the format converts it, and its scale right after it."""
        out.append(OutTensor(name, b.dtype, shape, b.op, name, layer))
        if b.scale is not None:
            out.append(OutTensor(b.scale.name(name), b.scale.dtype, b.scale.shape(shape), FP8_SCALE, name))

    def _left_16bit(self, module: str) -> None:
        """A linear written in 16 bits that the ignore list names: by its part's prefix, or by name
        (unless a pattern of the user's matches it: ignore_list)."""
        names = self.src.names
        self.left_16bit.add(names.config_module(module))
        if names.is_extra(module):
            self.extras.add(next(p for p in names.extra_prefixes if module.startswith(p)))
        else:
            self.unquantized.add(names.config_module(module))

    def _int4(self, name: str, out: list[OutTensor], ignored: bool) -> None:
        """A format that keeps INT4: every tensor of an INT4 weight copied (its weight_shape checked
        first); one that converts it (bf16): its weight_packed and scale become its weight."""
        info, w = self.src.info(name), self.int4_packed.get(name) or self.int4_shape[name]
        b = self.fmt.int4
        if b is None and ignored:
            converting = " or ".join(f.name for f in formats.all_formats() if f.int4 is not None)
            what = f"an INT4 weight, which {self.fmt.name} copies as INT4 (it is never requantized)"
            raise OptionError(
                f"ignore matches {w.module!r}, {what}; leave it out of ignore, or convert to format={converting!r}",
                f"--ignore matches {w.module!r}, {what}; leave it out of --ignore, or convert with --format "
                f"{converting}",
            )
        if b is None:
            out.append(OutTensor(name, info.dtype, info.shape, INT4_SHAPE if name in self.int4_shape else COPY, name))
            return
        if not self.src.quant.int4.symmetric:
            keeping = " or ".join(f.name for f in formats.all_formats() if f.int4 is None)
            raise SourceError(
                f"{self.src.root / self.src.weight_map[name]}: {w.module!r} is asymmetric INT4 (it has a "
                f"weight_zero_point; its group {self.src.quant.int4.group_name!r} says symmetric: false): the "
                f"{self.fmt.name} format dequantizes symmetric INT4 only, as (nibble - 8) x scale; convert to "
                f"{keeping}, which copies the INT4 weights as they are"
            )
        out.append(OutTensor(w.module + ".weight", b.dtype, (w.rows, w.cols), b.op, name))

    def ignore_list(self) -> list[str]:
        """The output's ignore list: the user's patterns as compressed-tensors 're:' entries
        (re.match, as vLLM applies them; listing every matched expert by name would make R1's
        config megabytes long), each other part's prefix, then the text linears left 16-bit by name."""
        if not self.fmt.quantizes:
            return []
        extras = [f"re:{re.escape(p)}.*" for p in sorted(self.extras)]
        named = sorted(m for m in self.unquantized if not is_ignored(m, self.options.ignore))
        return [f"re:{p}" for p in self.options.ignore] + extras + named

    def ignored_modules(self) -> list[str]:
        """The linears the ignore list names: every one left in 16 bits (none without a list)."""
        return sorted(self.left_16bit, key=natural) if self.fmt.quantizes else []


def make_plan(src: SourceCheckpoint, options: Options) -> Plan:
    """One output shard per source shard, same file name; every tensor stays in its weight's shard."""
    planner = _Planner(src, options)
    for name in sorted(src.weight_map):
        if name not in planner.skip:
            planner.add(name)
    shards = []
    for file, tensors in planner.by_file.items():
        layers = sorted(t.layer for t in tensors if t.layer is not None and t.op != FP8_SCALE)
        shards.append(OutShard(file, tensors, layers))
    ignore = planner.ignore_list()
    fmt = planner.fmt
    int4_targets = int4_target_list(src, options) if fmt.quantizes and fmt.int4 is None and src.int4 else []
    config = output_config(src.model, fmt, ignore, src.quant.int4, int4_targets)
    return Plan(src, options, shards, config, ignore, planner.ignored_modules())


# The routed experts, as a compressed-tensors target that vLLM matches on expert 0's names.
ROUTED_EXPERTS_TARGET = r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"


def int4_target_list(src: SourceCheckpoint, options: Options) -> list[str]:
    """The targets of the output's INT4 group: exactly the modules the source holds in INT4.
    The routed experts (every INT4 weight of the INT4 releases) as one pattern, any other INT4 linear
    by name; the pattern only if it matches no linear that is not INT4."""
    names = src.names
    int4 = {names.config_module(m) for m in src.int4}
    linears = {names.config_module(module_of(n)) for n in src.weight_map if n.endswith(".weight")}
    pattern = ROUTED_EXPERTS_TARGET[3:]
    experts = {m for m in int4 if re.match(pattern, m)}
    if experts and not any(re.match(pattern, m) for m in linears - int4):
        return [ROUTED_EXPERTS_TARGET, *sorted(int4 - experts)]
    return sorted(int4)


def natural(name: str) -> list:
    """A sort key that puts layer 2 before layer 10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def mla_file_rel(layer: int) -> str:
    return f"{MLA_DIR_NAME}/{layer_file_name(layer)}"
