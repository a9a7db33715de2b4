"""verify, mla group: one layer's artifacts (W_UK_T, W_UV) against its kv_b_proj.

The reference is the exact value of the source's kv_b_proj (with --source), else the stored bf16
kv_b_proj, else the stored FP8 one with its scale (one per row, or one for the tensor: each row's
is taken). The artifacts must be its split bit for bit (within the artifact bound of an FP8
reference), and random decode inputs through the absorbed path and
the naive path must agree (reference_mla.functional_error). The split is compared a few heads at a time."""

from __future__ import annotations

import dataclasses

import torch

from mla_convert.constants import FP8_E4M3
from mla_convert.kernels.bits import same_bits
from mla_convert.kernels.numerics import block_scale_f32, dequantize_block_fp8
from mla_convert.verification.bounds import FUNCTIONAL_TOL_EXACT, FUNCTIONAL_TOL_FP8, artifact_allowed_error
from mla_convert.verification.error_stats import Mismatches
from mla_convert.verification.readers import reader_backend
from mla_convert.verification.reference_mla import functional_error
from mla_convert.verification.report import MLA, FileTally
from mla_convert.verification.rows import RowReader
from mla_convert.verification.tasks import MlaTask
from mla_runtime.format import MlaDims, w_uk_t_name, w_uv_name
from mla_runtime.layout import split_kv_b_proj

HEADS_PER_CHUNK = 8  # attention heads per chunk in the MLA artifact comparisons


class MlaChecks:
    """The checks of one artifact file; `reader` reads the kv_b_proj they are compared with."""

    def __init__(self, reader: RowReader, out: FileTally, *, dims: MlaDims, rope_dim: int, block):
        self.reader, self.out = reader, out
        self.dims, self.rope_dim = dims, rope_dim
        self.block = block  # the source's block size (a block-FP8 source)

    def layer(self, job: MlaTask, artifacts: dict[str, torch.Tensor]) -> None:
        """The layer's W_UK_T and W_UV (in `artifacts`, by name) against its kv_b_proj: split, and
        absorbed vs naive attention."""
        dims, layer = self.dims, job.layer
        uk, uv = artifacts.get(w_uk_t_name(layer)), artifacts.get(w_uv_name(layer))
        for name, a, shape in (
            (w_uk_t_name(layer), uk, dims.w_uk_t_shape()),
            (w_uv_name(layer), uv, dims.w_uv_shape()),
        ):
            if a is None or a.dtype != torch.bfloat16 or tuple(a.shape) != shape:
                found = "missing" if a is None else f"{a.dtype}{list(a.shape)}"
                self.out.fail(MLA, "artifact", name, expected=f"bfloat16{list(shape)}", found=found)
                return
        reference = self._reference(job)
        if reference is None:
            self.out.fail(
                MLA,
                "reference",
                f"layer {layer}",
                expected="a kv_b_proj to compare with",
                found="none usable (see the structure failures)",
            )
            return
        x, s, what = reference
        if tuple(x.shape) != dims.kv_b_shape():
            self.out.fail(
                MLA, "reference", f"layer {layer}", expected=f"kv_b_proj {list(dims.kv_b_shape())}", found=list(x.shape)
            )
            return
        self._compare_split(layer, (uk, uv), x, s, what)
        tol = FUNCTIONAL_TOL_EXACT if s is None else FUNCTIONAL_TOL_FP8
        err = functional_error(uk, uv, x, dims, self.rope_dim, seed=layer)
        self.out.expect(
            err <= tol,
            MLA,
            "functional",
            f"layer {layer}",
            expected=f"absorbed decode == naive attention within relative error {tol:g}",
            found=f"relative error {err:.3g}",
        )

    def _reference(self, job: MlaTask) -> tuple[torch.Tensor, torch.Tensor | None, str] | None:
        """The kv_b_proj the artifacts are compared with, fp32: (x, its channel scale when x is the
        stored channel-FP8 kv_b_proj (the artifacts are then within a bound of it, else bit-exact
        splits of it), what it is); None when there is none to use."""
        if job.source is not None and job.source_scale is None:
            return self.reader.rows(job.source).float(), None, "split_kv_b_proj(the source's 16-bit kv_b_proj)"
        if job.source is not None:
            scale = block_scale_f32(self.reader.rows(job.source_scale))
            x = dequantize_block_fp8(self.reader.rows(job.source), scale, self.block)
            return x, None, "split_kv_b_proj(exact fp32 dequant of the source kv_b_proj)"
        if job.kv_b is not None and job.kv_b.dtype == "BF16":
            return self.reader.rows(job.kv_b), None, "split_kv_b_proj(the stored bf16 kv_b_proj)"
        if job.kv_b is not None and job.kv_b.dtype == FP8_E4M3 and job.kv_b_scale is not None:
            q = self.reader.rows(job.kv_b)
            s = self.reader.rows(job.kv_b_scale).reshape(-1, 1)
            if s.shape[0] not in (1, q.shape[0]):
                return None  # not a scale per row or per tensor (the structure checks said so)
            s = s.expand(q.shape[0], 1).contiguous()
            x = reader_backend().decode(q).mul_(s)
            return x, s, "within the artifact bound of the stored FP8 kv_b_proj"
        return None

    def _compare_split(self, layer: int, artifacts, x: torch.Tensor, scale: torch.Tensor | None, what: str) -> None:
        """W_UK_T / W_UV against split_kv_b_proj(x): bit-exact, or within the artifact bound of a
        channel-FP8 x with its `scale`. A few heads at a time: whole-layer fp32 temporaries cost
        more in page faults than in arithmetic."""
        dims, per_head = self.dims, self.dims.qk_nope_head_dim + self.dims.v_head_dim
        names, bad = (w_uk_t_name(layer), w_uv_name(layer)), (Mismatches(), Mismatches())
        for h0 in range(0, dims.num_heads, HEADS_PER_CHUNK):
            h1 = min(dims.num_heads, h0 + HEADS_PER_CHUNK)
            part, rows = dataclasses.replace(dims, num_heads=h1 - h0), slice(h0 * per_head, h1 * per_head)
            if scale is None:
                for m, a, want in zip(bad, artifacts, split_kv_b_proj(x[rows], part, torch.bfloat16), strict=True):
                    m.add(a[h0:h1], want, ~same_bits(a[h0:h1], want), h0)
                continue
            ref = split_kv_b_proj(x[rows], part, torch.float32)
            # a row's scale laid out as a one-column kv_b_proj: [h, P, 1] and [h, 1, V], which broadcast
            scale_layout = split_kv_b_proj(scale[rows], dataclasses.replace(part, kv_lora_rank=1), torch.float32)
            for m, a, want, sc in zip(bad, artifacts, ref, scale_layout, strict=True):
                af = a[h0:h1].float()
                m.add(af, want, ~((af - want).abs() <= artifact_allowed_error(af, sc)), h0)
        for name, a, m in zip(names, artifacts, bad, strict=True):
            if scale is None:
                self.out.verdict(m, MLA, "split-exact", name, f"bit-exact {what}", a.numel(), "differs: ")
            else:
                self.out.verdict(m, MLA, "split-bound", name, what, a.numel(), "out of bound: ")
