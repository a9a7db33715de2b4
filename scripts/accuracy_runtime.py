#!/usr/bin/env python3
"""How far the absorbed MLA weights (W_UK_T / W_UV) a vllm-gaudi server ends up with are from the
exact fp32 dequant of the source checkpoint, per loading path: computed by vllm-gaudi itself, or
taken from mla-convert's artifacts by the mla_runtime plugin.

Both columns run the same code: the vllm-gaudi stand-in in tests/support/standins/ (vllm-gaudi's
loading path at a pinned commit, with only the Gaudi ops in plain torch), loaded as an engine
loads (quantization config, model runner, weight loaders, quant methods, attention layers), with
the plugin disabled (MLA_RUNTIME_DISABLE=1) or enabled. Not run on Gaudi hardware.

The weights are synthetic, at R1's kv_b_proj shape (128 heads, [32768, 512]) unless --heads says
otherwise: rows of Gaussian values whose spread varies from row to row, quantized to block FP8 as
DeepSeek's checkpoints are (per 128x128 block, scale = max|block| / 448). The converter's own
functions make its outputs from them (mla_convert.kernels.numerics, mla_convert.formats).

    python scripts/accuracy_runtime.py [--layers 2] [--heads 128] [--seed 0] [--json]

Relative error: ||W - W_exact|| / ||W_exact|| over W_UK_T and W_UV of every layer together.
Gain: the least-squares factor g minimising ||W - g * W_exact|| (1 when there is no bias).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
sys.path.insert(0, str(ROOT / "tests"))
STANDINS = ROOT / "tests" / "support" / "standins"

from mla_convert.formats import TARGETS  # noqa: E402
from mla_convert.formats.channel_fp8 import FORMAT as CHANNEL_FP8  # noqa: E402
from mla_convert.kernels.numerics import quantize_channel_fp8  # noqa: E402
from mla_runtime import plugin  # noqa: E402
from mla_runtime.format import MlaDims  # noqa: E402
from mla_runtime.layout import split_kv_b_proj  # noqa: E402
from support.reference import dequant_block  # noqa: E402  (the tests' slow, obviously correct dequant)

BLOCK = 128
FP8_BLOCK_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}  # fmt: skip

# (device, path name, which checkpoint is served, VLLM_HPU_FORCE_CHANNEL_FP8)
PATHS = [
    ("gaudi3", "block-FP8 source, force-channel on (vllm-gaudi's default)", "source", "true"),
    ("gaudi3", "block-FP8 source, VLLM_HPU_FORCE_CHANNEL_FP8=false", "source", "false"),
    ("gaudi3", "mla-convert channel-FP8 (default output)", "channel-gaudi3", None),
    ("gaudi3", "mla-convert bf16", "bf16", None),
    ("gaudi2", "block-FP8 source, force-channel on (default)", "source", "true"),
    ("gaudi2", "mla-convert channel-FP8 --target gaudi2", "channel-gaudi2", None),
    ("gaudi2", "mla-convert channel-FP8 (gaudi3 output)", "channel-gaudi3", None),
]


def block_fp8_kv_b(gen: torch.Generator, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes [rows, cols], fp32 scale grid) as DeepSeek quantizes a weight."""
    spread = torch.exp(torch.randn(rows, 1, generator=gen) * 0.5) / math.sqrt(cols)
    w = torch.randn(rows, cols, generator=gen) * spread
    tiles = w.view(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK)
    scale = tiles.abs().amax(dim=(1, 3)) / 448.0
    codes = (tiles / scale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return codes.view(rows, cols), scale


def checkpoints(
    source: dict[int, tuple[torch.Tensor, torch.Tensor]], exact: dict[int, torch.Tensor]
) -> dict[str, tuple[dict | None, dict]]:
    """{served checkpoint: (quantization_config, {layer: {tensor suffix: tensor}})}, from the block-FP8
    source and its exact fp32 dequant."""
    out = {"source": (FP8_BLOCK_CONFIG, {i: {"weight": q, "weight_scale_inv": s} for i, (q, s) in source.items()})}
    out["bf16"] = (None, {i: {"weight": e.to(torch.bfloat16)} for i, e in exact.items()})
    for target in ("gaudi3", "gaudi2"):
        qc = CHANNEL_FP8.quantization_config(["lm_head"])  # the same config for both targets
        tensors = {}
        for i, e in exact.items():
            q, s = quantize_channel_fp8(e, TARGETS[target].fp8_max)
            tensors[i] = {"weight": q, "weight_scale": s}
        out[f"channel-{target}"] = (qc, tensors)
    return out


def use_standin(device: str):
    """Import the stand-in afresh for `device` (its device query is read at import), point vLLM's
    module names at it, and register the plugin so that it wraps both attention classes."""
    for name in [n for n, m in sys.modules.items() if n.startswith("vllm_gaudi") or n in ("vllm_upstream", "hpu_engine")]:  # fmt: skip
        del sys.modules[name]
    os.environ["VLLM_GAUDI_STANDIN_DEVICE"] = device
    if str(STANDINS) not in sys.path:
        sys.path.insert(0, str(STANDINS))
    import hpu_engine

    hpu_engine.install()
    plugin.register()
    import vllm_gaudi.attention.oot_mla  # noqa: F401  (wrapped by the plugin's post-import hook)

    return hpu_engine


def relative_error(got: list[torch.Tensor], exact: list[torch.Tensor]) -> tuple[float, float]:
    num = sum(float((g.double() - e.double()).pow(2).sum()) for g, e in zip(got, exact, strict=True))
    den = sum(float(e.double().pow(2).sum()) for e in exact)
    dot = sum(float((g.double() * e.double()).sum()) for g, e in zip(got, exact, strict=True))
    return math.sqrt(num / den), dot / den


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    dims = MlaDims(num_heads=args.heads, qk_nope_head_dim=128, v_head_dim=128, kv_lora_rank=512)
    rows, cols = dims.kv_b_shape()
    gen = torch.Generator().manual_seed(args.seed)
    source = {i: block_fp8_kv_b(gen, rows, cols) for i in range(args.layers)}
    exact_kv_b = {i: dequant_block(q, s) for i, (q, s) in source.items()}
    exact = {i: split_kv_b_proj(x, dims, torch.float32) for i, x in exact_kv_b.items()}
    served = checkpoints(source, exact_kv_b)

    from support.artifacts import write_artifacts

    results = []
    for var in (
        "MLA_RUNTIME_DIR",
        "MLA_RUNTIME_FALLBACK",
        "MLA_RUNTIME_CHECK",
        "VLLM_SCALE_ADJUSTMENT",
        "QUANT_CONFIG",
    ):
        os.environ.pop(var, None)
    with tempfile.TemporaryDirectory(prefix="mla-accuracy-") as tmp:
        model_dir = Path(tmp) / "model"
        write_artifacts(model_dir / "mla", exact_kv_b, dims)
        config = {"num_hidden_layers": args.layers, "num_attention_heads": args.heads, "qk_nope_head_dim": 128,
                  "v_head_dim": 128, "kv_lora_rank": 512}  # fmt: skip
        (model_dir / "config.json").write_text(json.dumps(config))
        for device, name, key, force in PATHS:
            engine = use_standin(device)
            if force is None:
                os.environ.pop("VLLM_HPU_FORCE_CHANNEL_FP8", None)
            else:
                os.environ["VLLM_HPU_FORCE_CHANNEL_FP8"] = force
            row = {"device": device, "path": name}
            for column, disable in (("vllm-gaudi", "1"), ("artifacts", "0")):
                os.environ["MLA_RUNTIME_DISABLE"] = disable
                plugin.reset()
                qc, tensors = served[key]
                loaded = engine.build_and_load(model_dir, qc, tensors, engine.MlaShape(num_heads=args.heads))
                got = [t for i in range(args.layers) for t in (loaded.layers[i].W_UK_T, loaded.layers[i].W_UV)]
                want = [t for i in range(args.layers) for t in exact[i]]
                err, gain = relative_error(got, want)
                row[column] = {"relative_error": err, "gain": gain}
                if column == "artifacts":
                    row["artifacts"]["layers_from_artifacts"] = plugin.summary()[0]["loaded"]
            results.append(row)
    os.environ.pop("MLA_RUNTIME_DISABLE", None)

    if args.json:
        print(json.dumps({"layers": args.layers, "heads": args.heads, "seed": args.seed, "paths": results}, indent=2))
        return 0
    print(
        f"Absorbed weights W_UK_T/W_UV against the exact fp32 dequant of the source: {args.layers} layers, "
        f"{args.heads} heads, kv_b_proj [{rows}, {cols}], synthetic block-FP8 weights (seed {args.seed}); "
        "vllm-gaudi stand-in, not Gaudi hardware"
    )
    print(f"{'device':7} {'path':58} {'vllm-gaudi computes':>26} {'from the artifacts':>19} {'error ratio':>12}")
    for r in results:
        ours, theirs = r["artifacts"], r["vllm-gaudi"]
        print(
            f"{r['device']:7} {r['path']:58} {100 * theirs['relative_error']:9.3f} % (gain {theirs['gain']:.5f})"
            f" {100 * ours['relative_error']:17.3f} % {theirs['relative_error'] / ours['relative_error']:11.1f}x"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
