"""Helpers for the mla_runtime tests: write MLA artifacts for given kv_b_proj weights, and make
block/channel FP8 kv_b_proj weights with chosen scales."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from mla_runtime.format import MANIFEST_NAME, LayerEntry, MlaDims, MlaManifest, layer_file_name, w_uk_t_name, w_uv_name
from mla_runtime.layout import split_kv_b_proj


def write_artifacts(mla_dir: Path, kv_b: dict[int, torch.Tensor], dims: MlaDims, fingerprint: str = "f" * 64) -> Path:
    """Artifacts as mla-convert writes them, from fp32 kv_b_proj weights [N*(P+V), L] per layer."""
    mla_dir = Path(mla_dir)
    mla_dir.mkdir(parents=True, exist_ok=True)
    entries = []
    for layer in sorted(kv_b):
        w_uk_t, w_uv = split_kv_b_proj(kv_b[layer], dims)
        path = mla_dir / layer_file_name(layer)
        save_file({w_uk_t_name(layer): w_uk_t, w_uv_name(layer): w_uv}, str(path))
        data = path.read_bytes()
        entries.append(LayerEntry(layer, path.name, len(data), hashlib.sha256(data).hexdigest()))
    manifest = MlaManifest(dims=dims, layers=tuple(entries), source_fingerprint=fingerprint)
    (mla_dir / MANIFEST_NAME).write_text(manifest.to_json())
    return mla_dir


def fp8_weight(shape, gen: torch.Generator) -> torch.Tensor:
    """Random e4m3 values (finite, both signs)."""
    return (torch.randn(shape, generator=gen) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)


def pow2_scales(shape, gen: torch.Generator) -> torch.Tensor:
    """Scales that are powers of two: exact in bf16, so bf16 dequant equals the fp32 one."""
    return torch.pow(2.0, torch.randint(-12, -6, shape, generator=gen).float())


def any_scales(shape, gen: torch.Generator) -> torch.Tensor:
    """Scales with full fp32 mantissas (as DeepSeek's amax/448 are)."""
    return torch.rand(shape, generator=gen) * 1e-3 + 1e-4


def block_dequant_fp32(w: torch.Tensor, scale: torch.Tensor, block=(128, 128)) -> torch.Tensor:
    """Exact fp32 dequant of a block-FP8 weight (the converter's arithmetic)."""
    bm, bn = block
    m, n = w.shape
    grid = scale.repeat_interleave(bm, 0)[:m].repeat_interleave(bn, 1)[:, :n]
    assert grid.shape == (m, n) and scale.shape == (math.ceil(m / bm), math.ceil(n / bn))
    return w.float() * grid
