"""Changing a private copy of a checkpoint on disk, for tests that feed the reader or the output
checks something wrong: a JSON file edited, a safetensors header edited with its data kept as it
is, a tensor dropped from its shard (and, if asked, from the index).

Imported (`from support.edits import ...`): the test modules' own module-level helpers use them.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable
from pathlib import Path

from safetensors.torch import load_file, save_file

INDEX = "model.safetensors.index.json"


def edit_json(path: Path, edit: Callable[[dict], object]) -> None:
    """Read the JSON file `path`, let `edit` change the parsed object in place, write it back."""
    data = json.loads(Path(path).read_text())
    edit(data)
    Path(path).write_text(json.dumps(data))


def edit_header(path: Path, edit: Callable[[dict], object]) -> None:
    """Let `edit` change the parsed JSON header of the safetensors file `path` in place; the file
    is written back with the data section byte for byte as it was, the header compact and padded
    as writers write it (an edit that keeps the header's length keeps the file's size)."""
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    new = json.dumps(header, separators=(",", ":")).encode()
    new += b" " * (-(8 + len(new)) % 8)
    Path(path).write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])


def shard_of(root: Path, name: str, index: str = INDEX) -> Path:
    """The shard of the checkpoint in `root` that its index (file `index`) says holds tensor `name`."""
    return Path(root) / json.loads((Path(root) / index).read_text())["weight_map"][name]


def rewrite_shard(path: Path, edit: Callable[[dict], object]) -> None:
    """Load every tensor of the safetensors file `path`, let `edit` change the {name: tensor} dict
    in place, and save the file again (the index is left as it is)."""
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def drop_tensor(root: Path, name: str, *, from_index: bool = True) -> None:
    """Remove tensor `name` from its shard and, unless `from_index` is False, from the index."""
    rewrite_shard(shard_of(root, name), lambda t: t.pop(name))
    if from_index:
        edit_json(Path(root) / INDEX, lambda i: i["weight_map"].pop(name))


def rewrite_output_tensor(out: Path, name: str, edit: Callable[[dict], object], index: str = INDEX) -> None:
    """rewrite_shard on the shard of the converted output `out` holding `name`, with the shard's
    size and sha256 in the conversion manifest kept right: only the value and structure checks can
    object."""
    shard = shard_of(out, name, index)
    rewrite_shard(shard, edit)
    data = shard.read_bytes()
    record = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    edit_json(Path(out) / "mla-convert-manifest.json", lambda m: m["files"].__setitem__(shard.name, record))


def fix_hash(root: Path, rel: str) -> None:
    """Make the manifests agree with a file changed on purpose, so only the other checks can tell."""
    data = (Path(root) / rel).read_bytes()
    entry = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    if rel.startswith("mla/layer-"):
        mla = json.loads((Path(root) / "mla/manifest.json").read_text())
        for e in mla["layers"]:
            if f"mla/{e['file']}" == rel:
                e.update(entry)
        (Path(root) / "mla/manifest.json").write_text(json.dumps(mla, indent=2))
        fix_hash(root, "mla/manifest.json")
    manifest = Path(root) / "mla-convert-manifest.json"
    man = json.loads(manifest.read_text())
    man["files"][rel] = entry
    manifest.write_text(json.dumps(man, indent=2))


def tensor_spans(path: Path) -> dict[str, tuple[int, int, str]]:
    """Each non-empty tensor of a safetensors file: its first and past-last byte in the file, and its dtype."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    return {
        name: (8 + n + t["data_offsets"][0], 8 + n + t["data_offsets"][1], t["dtype"])
        for name, t in header.items()
        if name != "__metadata__" and t["data_offsets"][1] > t["data_offsets"][0]
    }
