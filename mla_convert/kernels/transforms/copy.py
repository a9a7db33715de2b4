"""A source tensor that is not converted: its bytes as they are (read straight into the writer).
A 16-bit kv_b_proj copied is what its layer's MLA artifacts are split from."""

from __future__ import annotations

from mla_convert.kernels.transforms.transform import BF16_DTYPE, SOURCE_DTYPE, Params, Transform

OP = "copy"


def eager(p: Params):
    return lambda w: w


TRANSFORM = Transform(
    op=OP,
    reads=("weight",),
    writes=SOURCE_DTYPE,
    eager=eager,
    native_dtypes=(BF16_DTYPE,),  # a bf16 kv_b_proj: split by the C kernels (mla_split)
    split="mla16",
    verify="copy",
    bound="copied",
)
