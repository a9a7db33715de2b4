"""Reading checkpoint directories in tests: JSON files, every tensor, a hash of every file; and the
tiny checkpoint's shard names.

Tests get `load_json`, `load_all`, `tree_hashes` and `conversion_hashes` as fixtures (tests/conftest.py); a test module's
own module-level helpers, which fixtures cannot reach, import them from here.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import safe_open

# Two of the four shards of the tiny checkpoint (mla_convert.demo.synthetic.CheckpointSpec's defaults).
SHARD1, SHARD2 = "model-00001-of-00004.safetensors", "model-00002-of-00004.safetensors"


def load_json(path) -> dict:
    return json.loads(Path(path).read_text())


def load_all(root: Path, index_name: str = "model.safetensors.index.json") -> dict[str, torch.Tensor]:
    """Every tensor of the sharded safetensors checkpoint in `root`, by name (through its index:
    `index_name`, e.g. a consolidated one)."""
    index = load_json(root / index_name)["weight_map"]
    out = {}
    for file in sorted(set(index.values())):
        with safe_open(str(root / file), "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open handles are not iterable)
                out[name] = f.get_tensor(name)
    return out


def tree_hashes(root: Path) -> dict[str, str]:
    """{path relative to `root`: sha256} of every file under `root`."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


# What names where a conversion's source came from: the model card (its base_model) and the
# conversion manifest (its `source`, and the card's sha256 among its files).
_PROVENANCE = ("README.md", "mla-convert-manifest.json")


def conversion_hashes(root: Path) -> dict[str, str]:
    """tree_hashes of a conversion but for the card, with the manifest counted without what names the
    source's location: for conversions of the same checkpoint reached two ways (a Hub repo id and a
    local directory), which must agree in everything else (tests/test_card.py checks the cards)."""
    hashes = {rel: h for rel, h in tree_hashes(root).items() if rel not in _PROVENANCE}
    manifest = load_json(root / "mla-convert-manifest.json")
    manifest.pop("source", None)
    manifest["files"].pop("README.md", None)
    hashes["mla-convert-manifest.json, its source left out"] = hashlib.sha256(
        json.dumps(manifest, sort_keys=True).encode()
    ).hexdigest()
    return hashes
