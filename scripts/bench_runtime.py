#!/usr/bin/env python3
"""Time to prepare W_UK_T / W_UV for every MLA layer of DeepSeek-R1, side by side, at TP 1 and TP 8:

- artifacts: what mla_runtime does (open + validate the manifest, then per layer this rank's heads
  of W_UK_T / W_UV from mla/layer-NNN.safetensors, bf16 on the CPU): the file's pages mapped
  copy-on-write, read ahead and with their page tables filled, so the tensors are usable at once;
- artifacts, previous reader: the reader before the mapped one (commit c702bec), kept here as the
  baseline: one positioned read per tensor into a new tensor;
- artifacts + spot check: the reader plus the plugin's per-layer check against kv_b_proj
  (mla_runtime/spot_check.py: 256 x 64 values of one head), and the check alone;
- recompute: what vllm-gaudi's HPUMLAAttention does at every start: dequantize the block-FP8
  kv_b_proj [32768, 512] in bf16 (bf16(w) * bf16(scale) per 128x128 block), transpose, split,
  permute, make contiguous; and the channel-FP8 variant (1-D scale, what VLLM_HPU_FORCE_CHANNEL_FP8
  leaves);
- the plugin on vllm-gaudi's default path: the channel-FP8 recompute (vllm-gaudi's method runs
  first), then the artifacts read, spot-checked and copied into the tensors it stored.

True R1 dimensions: 61 layers, N=128 heads, P=V=128, L=512. On the CPU of this machine, not a
Gaudi: the HPU does the recompute faster, but the artifacts path is a file read either way.
Methods alternate within each repeat; the table shows medians, GB/s of this rank's W_UK_T + W_UV
bytes, and each method's speed relative to the block-FP8 recompute.

    python scripts/bench_runtime.py [--layers 61] [--repeats 5] [--tp 1 8] [--cold] [--dir DIR] [--json]
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

from mla_runtime import artifacts as artifacts_mod
from mla_runtime.artifacts import head_range, open_artifacts
from mla_runtime.format import MlaDims, w_uk_t_name, w_uv_name
from mla_runtime.spot_check import spot_check

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


def previous_load_layer(arts, layer: int, tp_rank: int, tp_size: int):
    """The reader as of commit c702bec: header checks, then one positioned read per tensor into a
    new tensor (the same header checks and read function the current reader still falls back to)."""
    header = arts.check_layer(layer)
    path = arts.layer_path(layer)
    start, end = head_range(arts.dims.num_heads, tp_rank, tp_size)
    return tuple(
        artifacts_mod._read_rows(path, header.tensors[name], header.data_start, start, end).contiguous()
        for name in (w_uk_t_name(layer), w_uv_name(layer))
    )


def local_share(weights: list[nn.Module], dims: MlaDims, tp: int):
    """Rank 0's rows of each kv_b_proj (as vLLM's ColumnParallelLinear holds them), and the per-row
    channel-FP8 requantization VLLM_HPU_FORCE_CHANNEL_FP8 makes of them."""
    local = MlaDims(dims.num_heads // tp, dims.qk_nope_head_dim, dims.v_head_dim, dims.kv_lora_rank)
    rows = local.num_heads * (local.qk_nope_head_dim + local.v_head_dim)
    block, channel = [], []
    for kv_b in weights:
        m = nn.Module()
        m.weight = nn.Parameter(kv_b.weight[:rows].contiguous(), requires_grad=False)
        m.weight_scale_inv = kv_b.weight_scale_inv[: rows // BLOCK].contiguous()
        m.weight_block_size = [BLOCK, BLOCK]
        block.append(m)
        deq = exact_dequant(m)
        scale = deq.abs().amax(dim=1).clamp_min(1e-12) / 448.0
        channel.append(((deq / scale[:, None]).to(torch.float8_e4m3fn), scale))
    return local, block, channel


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 8], help="tensor-parallel sizes: time rank 0's share")
    ap.add_argument("--dir", type=Path, default=None, help="where to write the artifacts (default: a temp dir)")
    ap.add_argument(
        "--cold",
        action="store_true",
        help="drop the artifact files from the page cache (posix_fadvise DONTNEED) before each read",
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    dims = R1
    gen = torch.Generator().manual_seed(0)
    n_distinct = min(4, args.layers)
    weights = [make_block_fp8(gen, dims) for _ in range(n_distinct)]

    own_dir = args.dir is None
    base = Path(tempfile.mkdtemp(prefix="mla-bench-")) if own_dir else args.dir
    mla_dir = base / "mla"
    reports = []
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

        for tp in args.tp:
            local, block, channel = local_share(weights, dims, tp)

            def reader(load, check=False, tp=tp, block=block):
                def run():
                    arts = open_artifacts(mla_dir)
                    out = []
                    for i in range(args.layers):
                        uk_t, uv = load(arts, i, tp)
                        if check:
                            spot_check(block[i % n_distinct], uk_t, uv, where=f"layer {i}")
                        out.append((uk_t, uv))
                    return out  # the layers hold their tensors until all are prepared, as in a real start

                return run

            def current(arts, i, tp):
                return arts.load_layer(i, tp_rank=0, tp_size=tp)

            def check_only(tp=tp, block=block):
                arts = open_artifacts(mla_dir)
                loaded = [arts.load_layer(i, tp_rank=0, tp_size=tp) for i in range(n_distinct)]
                t0 = time.perf_counter()
                for i in range(args.layers):
                    spot_check(block[i % n_distinct], *loaded[i % n_distinct], where=f"layer {i}")
                return time.perf_counter() - t0

            def plugin_on_recompute(local=local, channel=channel, block=block, tp=tp):
                stored = [recompute_channel(*channel[i % n_distinct], local) for i in range(args.layers)]
                arts = open_artifacts(mla_dir)
                for i, (uk_t, uv) in enumerate(stored):
                    a_uk_t, a_uv = arts.load_layer(i, tp_rank=0, tp_size=tp)
                    spot_check(block[i % n_distinct], a_uk_t, a_uv, where=f"layer {i}")
                    uk_t.copy_(a_uk_t)
                    uv.copy_(a_uv)
                return stored

            def previous(arts, i, tp):
                return previous_load_layer(arts, i, 0, tp)

            methods = {
                "artifacts (mapped)": reader(current),
                "artifacts, previous reader (pread)": reader(previous),
                "artifacts (mapped) + spot check": reader(current, check=True),
                "recompute block-FP8 (vllm-gaudi)": lambda local=local, block=block: [
                    recompute_block(block[i % n_distinct], local) for i in range(args.layers)
                ],
                "recompute channel-FP8 (vllm-gaudi)": lambda local=local, channel=channel: [
                    recompute_channel(*channel[i % n_distinct], local) for i in range(args.layers)
                ],
                "plugin: channel recompute, then artifacts copied in": plugin_on_recompute,
            }
            # Same results before timing: both readers give the same tensors; block recompute within bf16.
            a_uk, a_uv = open_artifacts(mla_dir).load_layer(0, tp_rank=0, tp_size=tp)
            p_uk, p_uv = previous_load_layer(open_artifacts(mla_dir), 0, 0, tp)
            assert torch.equal(a_uk, p_uk) and torch.equal(a_uv, p_uv)
            r_uk, _ = recompute_block(block[0], local)
            assert a_uk.shape == r_uk.shape == local.w_uk_t_shape()
            torch.testing.assert_close(a_uk.float(), r_uk.float(), rtol=2**-7, atol=1e-6)
            del a_uk, a_uv, p_uk, p_uv, r_uk

            times: dict[str, list[float]] = {k: [] for k in methods}
            for _ in range(args.repeats):  # methods alternate, so machine load affects them alike
                for name, fn in methods.items():
                    if args.cold and name.startswith("artifacts"):
                        drop_cache()
                    t0 = time.perf_counter()
                    keep = fn()
                    times[name].append(time.perf_counter() - t0)
                    del keep
            check_s = [check_only() for _ in range(args.repeats)]
            med = {k: statistics.median(v) for k, v in times.items()}
            nbytes = args.layers * 2 * local.num_heads * dims.kv_lora_rank * 128 * 2  # this rank's W_UK_T + W_UV
            reports.append({
                "tp_size": tp, "heads_per_rank": local.num_heads, "rank_bytes": nbytes,
                "median_s": {k: round(v, 4) for k, v in med.items()},
                "all_s": {k: [round(x, 4) for x in v] for k, v in times.items()},
                "gb_per_s": {k: round(nbytes / v / 1e9, 2) for k, v in med.items()},
                "speed_vs_block_recompute": {k: round(med["recompute block-FP8 (vllm-gaudi)"] / v, 2) for k, v in med.items()},
                "spot_check_s": round(statistics.median(check_s), 5),
                "spot_check_ms_per_layer": round(1000 * statistics.median(check_s) / args.layers, 4),
            })  # fmt: skip
    finally:
        if own_dir:
            shutil.rmtree(base, ignore_errors=True)

    if args.json:
        print(json.dumps({
            "layers": args.layers, "repeats": args.repeats, "cold": args.cold, "torch_threads": torch.get_num_threads(),
            "artifact_bytes_on_disk": size, "artifact_write_s": round(write_s, 3), "tp": reports,
        }, indent=2))  # fmt: skip
        return 0
    print(
        f"W_UK_T/W_UV for {args.layers} layers, R1 dims N={dims.num_heads} P={dims.qk_nope_head_dim} "
        f"V={dims.v_head_dim} L={dims.kv_lora_rank}, rank 0's share; {torch.get_num_threads()} torch threads; "
        f"artifacts {size / 1e9:.2f} GB on disk, page cache {'dropped before each read' if args.cold else 'warm'}; "
        f"medians of {args.repeats}, methods alternating"
    )
    for r in reports:
        print(
            f"\nTP rank 0 of {r['tp_size']} ({r['heads_per_rank']} heads, {r['rank_bytes'] / 1e9:.2f} GB of W_UK_T + W_UV)"
        )
        print(f"{'method':38} {'median s':>9} {'GB/s':>8} {'x block recompute':>18}")
        for k, v in r["median_s"].items():
            print(f"{k:38} {v:9.3f} {r['gb_per_s'][k]:8.2f} {r['speed_vs_block_recompute'][k]:17.2f}x")
        m = r["median_s"]
        print(
            f"spot check alone: {r['spot_check_s']:.4f} s for {args.layers} layers "
            f"({r['spot_check_ms_per_layer']:.3f} ms a layer: 256 x 64 values of kv_b_proj and of the artifacts)"
        )
        print(
            f"mapped reader vs previous reader: {m['artifacts, previous reader (pread)'] / m['artifacts (mapped)']:.1f}x "
            f"faster; block recompute / mapped reader: {m['recompute block-FP8 (vllm-gaudi)'] / m['artifacts (mapped)']:.1f}x"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
