"""What a transform declares: the record every transform module fills in (no torch here).

A transform is one thing the converter does to a source tensor (block FP8 -> channel FP8, ...). Its
module says, in one place: the source tensors it reads (its partners included), its eager
definition in torch (the reference every other implementation is held to, bit for bit), its
optional native entry (C in fp8_kernels.c, called through kernels.native), the probe inputs on
which an implementation must equal the definition before it is used, and the check verify applies
to what it wrote. kernels.fastest chooses among the implementations; the shard job calls the one
chosen.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

# Safetensors dtype strings of what a transform writes (BF16_DTYPE: the dtype, not the output format).
FP8_DTYPE, BF16_DTYPE, F32_DTYPE = "F8_E4M3", "BF16", "F32"
SOURCE_DTYPE = "source"  # written with the source tensor's own dtype and bytes


class Params(NamedTuple):
    """What an implementation is made for besides its inputs: the source's scale block, the
    target's FP8 range and whether a zero code keeps its sign."""

    block: tuple[int, int]
    fp8_max: float
    signed_zero: bool


# A row kernel on raw addresses: (weight rows, float32 block scales or 0, columns, output rows,
# float32 channel scales or 0, r0, r1): rows [r0, r1) of the source at `w` into `out`.
RowKernel = Callable[[int, int, int, int, int, int, int], None]


@dataclass(frozen=True)
class Transform:
    op: str  # its name in a plan (plan.ops) and in the kernel sets
    reads: tuple[str, ...]  # the roles of the source tensors it reads, the weight first
    writes: str  # the dtype it writes (FP8_DTYPE: and a channel scale, written next)
    eager: Callable[[Params], Callable]  # the definition, on CPU torch tensors
    outputs: tuple[str, ...] = ("values",)  # what each returned tensor is, to count differences by
    probes: Callable[[Params], list[tuple]] | None = None  # the inputs implementations are checked on
    native: Callable[[Params], Callable] | None = None  # the C entry on CPU torch tensors
    rows: Callable[[Params], RowKernel] | None = None  # the same C entry on raw rows (the hot path)
    native_dtypes: tuple[str, ...] = ()  # the source dtypes the C entry takes (others: torch)
    compiles: bool = False  # torch.compile of the definition is a candidate
    split: str | None = None  # the MLA split of a kv_b_proj it reads ("mla": block FP8; "mla16": bf16)
    exact_op: str | None = None  # the kernel op giving the exact value the split takes (None: the input)
    # Where the output is made from the exact value (computed once, the split taking it too):
    exact: Callable[[Params], Callable] | None = None
    from_exact: Callable | None = None
    # What verify applies to its output: the comparison with the source (the one registered under
    # this name in verification.against_source, which a transform registered from outside
    # registers too) and the bound it holds it to (its words: verification.bounds.TOLERANCES, or
    # the comparison's own).
    verify: str = "copy"
    bound: str = "copied"

    def takes_natively(self, dtype: str, rank: int) -> bool:
        """Whether the C entry takes a 2-D source of this dtype (the rows kernel exists)."""
        return self.rows is not None and dtype in self.native_dtypes and rank == 2
