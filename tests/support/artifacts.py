"""Helpers for the MLA artifact tests: write artifacts for given kv_b_proj weights, read a layer's back."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from safetensors import safe_open
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


def read_artifacts(mla_dir: Path, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(W_UK_T, W_UV) of `layer`, whole, as its file in `mla_dir` holds them."""
    with safe_open(str(Path(mla_dir) / layer_file_name(layer)), "pt") as f:
        return f.get_tensor(w_uk_t_name(layer)), f.get_tensor(w_uv_name(layer))
