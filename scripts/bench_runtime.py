#!/usr/bin/env python3
"""Time to prepare W_UK_T / W_UV for every MLA layer of DeepSeek-R1, side by side:

- artifacts: what mla_runtime does (open + validate the manifest, then per layer read this rank's
  heads of W_UK_T / W_UV from mla/layer-NNN.safetensors, contiguous, bf16), with and without the
  plugin's per-layer spot check against the served kv_b_proj;
- recompute: what vllm-gaudi's HPUMLAAttention does at every start (the documented
  process_weights_after_loading): dequantize the block-FP8 kv_b_proj [32768, 512] in bf16
  (bf16(w) * bf16(scale) per 128x128 block), transpose, split, permute, make contiguous. Also the
  channel-FP8 variant (1-D scale, what VLLM_HPU_FORCE_CHANNEL_FP8 leaves).

True R1 dimensions: 61 layers, N=128 heads, P=V=128, L=512. On the CPU of this machine, not a
Gaudi: the HPU does the recompute faster, but the artifacts path is a file read either way.

    python scripts/bench_runtime.py [--layers 61] [--repeats 3] [--tp 1] [--dir /tmp/mla-bench] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from mla_runtime.artifacts import open_artifacts
from mla_runtime.format import MlaDims
from mla_runtime.plugin import spot_check

R1 = MlaDims(num_heads=128, qk_nope_head_dim=128, v_head_dim=128, kv_lora_rank=512)
BLOCK = 128


def make_block_fp8(gen: torch.Generator, dims: MlaDims) -> nn.Module:
    rows, cols = dims.kv_b_shape()
    kv_b = nn.Module()
    w = torch.randn(rows, cols, generator=gen) / math.sqrt(cols)
    grid = w.view(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK).abs().amax(dim=(1, 3)) / 448.0
    q = (w.view(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK) / grid[:, None, :, None]).view(rows, cols)
    kv_b.weight = nn.Parameter(q.to(torch.float8_e4m3fn), requires_grad=False)
    kv_b.weight_scale_inv = grid.float()
    kv_b.weight_block_size = [BLOCK, BLOCK]
    return kv_b


def exact_dequant(kv_b: nn.Module) -> torch.Tensor:
    grid = kv_b.weight_scale_inv.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    return kv_b.weight.float() * grid


def write_artifacts(mla_dir: Path, weights: list[nn.Module], layers: int, dims: MlaDims) -> None:
    """61 layer files as mla-convert writes them (the weights cycle: content does not matter here)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from support.artifacts import write_artifacts as write

    write(mla_dir, {i: exact_dequant(weights[i % len(weights)]) for i in range(layers)}, dims)


def recompute_block(kv_b: nn.Module, dims: MlaDims, act_dtype=torch.bfloat16):
    """vllm-gaudi's block-FP8 path: bf16 block dequant, .T, view, split, permute, contiguous."""
    w, s = kv_b.weight, kv_b.weight_scale_inv
    gm, gn = s.shape
    deq = w.contiguous().to(act_dtype).view(gm, BLOCK, gn, BLOCK) * s.to(act_dtype).view(gm, 1, gn, 1)
    deq = deq.view(w.shape).T
    deq = deq.view(dims.kv_lora_rank, dims.num_heads, dims.qk_nope_head_dim + dims.v_head_dim)
    w_uk, w_uv = deq.split([dims.qk_nope_head_dim, dims.v_head_dim], dim=-1)
    return w_uk.permute(1, 2, 0).contiguous(), w_uv.transpose(0, 1).contiguous()


def recompute_channel(w: torch.Tensor, scale: torch.Tensor, dims: MlaDims, act_dtype=torch.bfloat16):
    """vllm-gaudi's channel-FP8 path (1-D weight_scale_inv)."""
    deq = (w.to(act_dtype) * scale.view(-1, 1).to(act_dtype)).T.contiguous()
    deq = deq.view(dims.kv_lora_rank, dims.num_heads, dims.qk_nope_head_dim + dims.v_head_dim)
    w_uk, w_uv = deq.split([dims.qk_nope_head_dim, dims.v_head_dim], dim=-1)
    return w_uk.permute(1, 2, 0).contiguous(), w_uv.transpose(0, 1).contiguous()


def timed(fn, repeats: int, before=None) -> list[float]:
    out = []
    for _ in range(repeats):
        if before is not None:
            before()
        t0 = time.perf_counter()
        keep = fn()  # the layers hold their tensors until all are prepared, as in a real start
        out.append(time.perf_counter() - t0)
        del keep
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size: time rank 0's share")
    ap.add_argument("--dir", type=Path, default=None, help="where to write the artifacts (default: a temp dir)")
    ap.add_argument(
        "--cold",
        action="store_true",
        help="drop the artifact files from the page cache (posix_fadvise DONTNEED) before each read",
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    dims = R1
    local = MlaDims(dims.num_heads // args.tp, dims.qk_nope_head_dim, dims.v_head_dim, dims.kv_lora_rank)
    gen = torch.Generator().manual_seed(0)
    n_distinct = min(4, args.layers)
    weights = [make_block_fp8(gen, dims) for _ in range(n_distinct)]
    rows_local = local.num_heads * (local.qk_nope_head_dim + local.v_head_dim)
    local_weights = []
    for kv_b in weights:  # rank 0's rows of kv_b_proj, as vLLM's ColumnParallelLinear holds them
        m = nn.Module()
        m.weight = nn.Parameter(kv_b.weight[:rows_local].contiguous(), requires_grad=False)
        m.weight_scale_inv = kv_b.weight_scale_inv[: rows_local // BLOCK].contiguous()
        m.weight_block_size = [BLOCK, BLOCK]
        local_weights.append(m)
    channel = []
    for kv_b in local_weights:  # what VLLM_HPU_FORCE_CHANNEL_FP8 leaves: per-row scales
        deq = exact_dequant(kv_b)
        scale = deq.abs().amax(dim=1).clamp_min(1e-12) / 448.0
        channel.append(((deq / scale[:, None]).to(torch.float8_e4m3fn), scale))

    own_dir = args.dir is None
    base = Path(tempfile.mkdtemp(prefix="mla-bench-")) if own_dir else args.dir
    mla_dir = base / "mla"
    try:
        t0 = time.perf_counter()
        write_artifacts(mla_dir, weights, args.layers, dims)
        write_s = time.perf_counter() - t0
        size = sum(p.stat().st_size for p in mla_dir.glob("layer-*.safetensors"))

        def drop_cache():
            for path in mla_dir.glob("layer-*.safetensors"):
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)

        def from_artifacts(check: bool):
            def run():
                arts = open_artifacts(mla_dir)
                out = []
                for i in range(args.layers):
                    uk_t, uv = arts.load_layer(i, tp_rank=0, tp_size=args.tp)
                    if check:
                        spot_check(local_weights[i % n_distinct], uk_t, uv, where=f"layer {i}")
                    out.append((uk_t, uv))
                return out

            return run

        def recompute(kind: str):
            def run():
                if kind == "block":
                    return [recompute_block(local_weights[i % n_distinct], local) for i in range(args.layers)]
                return [recompute_channel(*channel[i % n_distinct], local) for i in range(args.layers)]

            return run

        # Same result check before timing: artifacts == exact dequant split; block recompute within bf16.
        a_uk, _ = open_artifacts(mla_dir).load_layer(0, tp_rank=0, tp_size=args.tp)
        r_uk, _ = recompute_block(local_weights[0], local)
        assert a_uk.shape == r_uk.shape == local.w_uk_t_shape()
        torch.testing.assert_close(a_uk.float(), r_uk.float(), rtol=2**-7, atol=1e-6)

        results = {
            "artifacts": timed(from_artifacts(False), args.repeats, drop_cache if args.cold else None),
            "artifacts + spot check": timed(from_artifacts(True), args.repeats, drop_cache if args.cold else None),
            "recompute block-FP8 (vllm-gaudi)": timed(recompute("block"), args.repeats),
            "recompute channel-FP8 (vllm-gaudi)": timed(recompute("channel"), args.repeats),
        }
    finally:
        if own_dir:
            shutil.rmtree(base, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in results.items()}
    base_key = "recompute block-FP8 (vllm-gaudi)"
    report = {
        "layers": args.layers, "tp_size": args.tp, "heads_per_rank": local.num_heads,
        "dims": {"N": dims.num_heads, "P": dims.qk_nope_head_dim, "V": dims.v_head_dim, "L": dims.kv_lora_rank},
        "artifact_bytes_on_disk": size, "cold": args.cold, "artifact_write_s": round(write_s, 3), "torch_threads": torch.get_num_threads(),
        "median_s": {k: round(v, 4) for k, v in med.items()},
        "all_s": {k: [round(x, 4) for x in v] for k, v in results.items()},
        "speedup_vs_block_recompute": {k: round(med[base_key] / v, 2) for k, v in med.items()},
    }  # fmt: skip
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(
        f"W_UK_T/W_UV for {args.layers} layers, R1 dims N={dims.num_heads} P={dims.qk_nope_head_dim} "
        f"V={dims.v_head_dim} L={dims.kv_lora_rank}, TP rank 0 of {args.tp} ({local.num_heads} heads), "
        f"{torch.get_num_threads()} torch threads; artifacts {size / 1e9:.2f} GB, "
        f"page cache {'dropped before each read' if args.cold else 'warm'}"
    )
    print(f"{'method':38} {'median s':>9} {'per layer ms':>13} {'x faster than block recompute':>31}")
    for k, v in med.items():
        print(f"{k:38} {v:9.3f} {1000 * v / args.layers:13.1f} {med[base_key] / v:31.2f}")
    print(f"ratio recompute(block) / artifacts: {med[base_key] / med['artifacts']:.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
