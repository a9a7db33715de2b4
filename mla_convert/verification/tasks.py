"""verify, file tasks: what the data pass of one file is asked to check (FileTask, with a TensorJob
for each tensor that has a role in the conversion and an MlaJob for an artifact file), and what it
returns (FileResult). Tasks are plain data: a worker process gets them pickled."""

from __future__ import annotations

from dataclasses import dataclass, field

from mla_convert.verification.report import Tally
from mla_convert.verification.rows import Ref
from mla_runtime.format import MlaDims
from mla_runtime.safetensors_file import ShardHeader


@dataclass(frozen=True)
class TensorJob:
    """What to check for one tensor beyond its values (absent: values only)."""

    op: str  # the plan's op: COPY, TO_BF16, TO_FP8, QUANT_FP8, FP8_SCALE
    scale: Ref | None = None  # channel FP8: its channel scale, when it does not follow it in this file
    scale_name: str | None = None  # channel FP8: the name of its channel scale
    source: Ref | None = None  # with --source: the source tensor
    source_scale: Ref | None = None  # with --source, block-FP8 sources: the block scale_inv


@dataclass(frozen=True)
class MlaJob:
    layer: int
    kv_b: Ref | None  # the converted model's kv_b_proj weight
    kv_b_scale: Ref | None  # ... and its channel scale (channel-FP8 output)
    source: Ref | None = None  # with --source: the source kv_b_proj and its block scale (none: 16-bit)
    source_scale: Ref | None = None


@dataclass(frozen=True)
class FileTask:
    root: str
    rel: str
    header: ShardHeader | None  # None: hash only (side files, JSON, unparseable shards)
    fp8_max: float
    signed_zero: bool = True  # the target's FP8 weights may hold -0 (constants.SIGNED_ZERO)
    block: tuple[int, int] | None = None  # the source's block size (with a block-FP8 --source)
    dims: MlaDims | None = None
    rope_dim: int = 0
    tensors: dict[str, TensorJob] = field(default_factory=dict)
    mla: MlaJob | None = None


@dataclass
class FileResult:
    rel: str
    size: int | None  # None: the file is missing
    sha256: str | None
    tally: Tally
