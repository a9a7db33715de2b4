#!/usr/bin/env python
"""DeepSeek-R1 at its real size on a few hundred MB of disk: every tensor, the weights file holes.

    python scripts/r1_sparse_source.py /data/r1-sparse                  # 163 shards, 91,991 tensors, 688.6 GB
    python scripts/r1_sparse_source.py /tmp/r1-small --layers 4 --experts 32
    python scripts/r1_sparse_source.py /tmp/r1-tiny --tiny               # tiny dims, for tests

The tensor set is DeepSeek-R1's (mla_convert.demo.specs.CheckpointSpec at R1's dims: 61 layers and
the MTP layer 61, the first 3 dense, 256 routed experts and 1 shared; block-FP8 weights with their
F32 `weight_scale_inv` [ceil(N/128), ceil(K/128)], BF16 norms, embeddings, router gates, lm_head and
eh_proj, F32 `e_score_correction_bias`), in DeepSeek's order, cut into shards of equal bytes named as
R1's (`model-000NN-of-000163.safetensors`), one weight's scale in the next shard as in R1 (around
layer 39's expert 92). config.json is R1's published one, with its quantization_config;
generation_config.json R1's; the tokenizer, the remote code and the card stand-ins.

Each shard is its header and its scales (non-trivial values: each scale tensor its own
deterministic uniform draw in [2^-14, 2^-7]); every other byte is zero, left a hole by truncating
the file to its size. Each shard's sha256 is computed as it is written (the holes hashed as zeros),
in `--jobs` processes: DIR.sha256.json ({path: sha256}, for `python -m support.fake_hub_serve
--repo ID=DIR:DIR.sha256.json`) and DIR.json (what was built: counts, bytes, the spec) are written
beside DIR. A DIR whose DIR.json records the same spec is kept as it is.

Where it differs from the real checkpoint: the shard boundaries (equal bytes, not DeepSeek's cuts,
so which tensors share a shard differs), the exact tensor whose scale sits in the next shard, the
weights (zero) and scales (synthetic), the tokenizer (a WordLevel stand-in of the real vocabulary
size) and the absence of figures/.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import struct
import sys
import time
import zlib
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mla_convert.demo.specs import CheckpointSpec  # noqa: E402

REAL_TENSORS, REAL_BYTES, REAL_SHARDS = 91_991, 688.6e9, 163
SHARD_NAME = "model-{i:05d}-of-{n:06d}.safetensors"  # R1's: model-00001-of-000163.safetensors
INDEX_NAME = "model.safetensors.index.json"
ZEROS = memoryview(bytes(16 << 20))
DTYPES = {"F8_E4M3": 1, "BF16": 2, "F32": 4, "I32": 4}

# DeepSeek-R1's config.json as published (deepseek-ai/DeepSeek-R1), but auto_map and the dims a
# smaller build changes (config_of).
R1_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModel": "modeling_deepseek.DeepseekV3Model",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
    },
    "aux_loss_alpha": 0.001,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "pretraining_tp": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.46.3",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 129280,
}
GENERATION_CONFIG = {
    "_from_model_config": True,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "do_sample": True,
    "temperature": 0.6,
    "top_p": 0.95,
    "transformers_version": "4.46.3",
}
DIM_KEYS = (
    "hidden_size", "num_hidden_layers", "first_k_dense_replace", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "intermediate_size", "moe_intermediate_size",
    "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "n_group", "topk_group", "vocab_size",
    "num_nextn_predict_layers",
)  # fmt: skip


def r1_spec(
    layers: int = 61, experts: int = 256, shards: int | None = None, tiny: bool = False, vocab: int | None = None
) -> CheckpointSpec:
    """R1's tensor set with `layers` decoder layers (the first 3 dense, as in R1), `experts` routed
    experts and a `vocab` (default R1's 129,280) for the four embedding-sized tensors; tiny: the
    same layout at tiny dims (hidden 256, 4 heads, vocab 512)."""
    groups = min(8, experts)
    common = dict(
        num_hidden_layers=layers, first_k_dense_replace=min(3, layers), num_nextn_predict_layers=1,
        n_routed_experts=experts, n_group=groups, topk_group=min(4, groups), num_shards=shards or 1,
        shard_name=SHARD_NAME, **({"vocab_size": vocab} if vocab else {}),
    )  # fmt: skip
    if tiny:
        spec = CheckpointSpec(num_experts_per_tok=2, **common)
    else:
        spec = CheckpointSpec.r1_dims(num_experts_per_tok=min(8, experts), **common)
    split = f"model.layers.{min(39, layers - 1)}.mlp.experts.{min(92, experts - 1)}.down_proj.weight"
    if layers <= spec.first_k_dense_replace:
        split = f"model.layers.{layers - 1}.mlp.down_proj.weight"
    spec = dataclasses.replace(spec, split_scale_of=split)
    if shards is None:  # R1's shard size: 163 of them at the real size
        spec = dataclasses.replace(spec, num_shards=max(1, round(tensor_bytes(spec) / (REAL_BYTES / REAL_SHARDS))))
    return spec


def tensor_bytes(spec: CheckpointSpec) -> int:
    return sum(math.prod(shape) * DTYPES[spec.st_dtype(kind)] for _, kind, shape in spec.tensors())


def config_of(spec: CheckpointSpec) -> dict:
    dims = {k: getattr(spec, k) for k in DIM_KEYS} | {"num_key_value_heads": spec.num_attention_heads}
    return dict(sorted((R1_CONFIG | dims).items()))


def assign_shards(spec: CheckpointSpec, tensors: list) -> list[list[tuple[str, str, tuple[int, ...]]]]:
    """Contiguous runs of about equal bytes, in DeepSeek's order; then one scale moved into the
    next shard (as R1 has one)."""
    sizes = [math.prod(s) * DTYPES[spec.st_dtype(k)] for _, k, s in tensors]
    per = sum(sizes) / spec.num_shards
    shard_of, acc = {}, 0
    for (name, _, _), size in zip(tensors, sizes, strict=True):
        shard_of[name] = min(int(acc // per), spec.num_shards - 1)
        acc += size
    partner = spec.scale_name(spec.split_scale_of)
    if partner in shard_of and spec.num_shards > 1:
        s = shard_of[spec.split_scale_of]
        shard_of[partner] = s + 1 if s + 1 < spec.num_shards else s - 1
    out: list[list] = [[] for _ in range(spec.num_shards)]
    for t in tensors:
        out[shard_of[t[0]]].append(t)
    return out


def scale_values(name: str, shape: tuple[int, ...]) -> bytes:
    import numpy as np

    rng = np.random.default_rng(zlib.crc32(name.encode()))
    return rng.uniform(2.0**-14, 2.0**-7, size=shape).astype("<f4").tobytes()


def write_shard(path: str, items: list[tuple[str, str, tuple[int, ...]]], dtypes: dict[str, str]) -> dict:
    """The shard: its header, its scales, holes for the rest; its size and sha256 (computed as
    written, never read back)."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, kind, shape in items:
        n = math.prod(shape) * DTYPES[dtypes[kind]]
        header[name] = {"dtype": dtypes[kind], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    head = struct.pack("<Q", len(raw)) + raw
    h = hashlib.sha256(head)
    with open(path, "wb") as f:
        f.write(head)
        for name, kind, shape in items:
            begin, end = header[name]["data_offsets"]
            if kind == "scale":
                data = scale_values(name, shape)
                f.seek(len(head) + begin)
                f.write(data)
                h.update(data)
                continue
            left = end - begin
            while left:
                n = min(left, len(ZEROS))
                h.update(ZEROS[:n])
                left -= n
        f.truncate(len(head) + offset)
    return {"path": Path(path).name, "size": len(head) + offset, "sha256": h.hexdigest(), "tensors": len(items)}


def build(out: Path, spec: CheckpointSpec, jobs: int = 2) -> dict:
    """Write the source to `out` (kept if DIR.json records this spec); returns what DIR.json says."""
    summary_path, digests_path = out.with_name(out.name + ".json"), out.with_name(out.name + ".sha256.json")
    key = {k: v for k, v in spec.__dict__.items() if not isinstance(v, tuple)}
    if summary_path.exists() and digests_path.exists() and out.is_dir():
        summary = json.loads(summary_path.read_text())
        if summary.get("spec") == key and all((out / s["path"]).is_file() for s in summary["shards"]):
            summary["reused"] = True
            return summary
    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    tensors = spec.tensors()
    names = [spec.shard_name.format(i=i + 1, n=spec.num_shards) for i in range(spec.num_shards)]
    dtypes = {kind: spec.st_dtype(kind) for _, kind, _ in tensors}
    by_shard = assign_shards(spec, tensors)
    work = ([str(out / n) for n in names], by_shard, [dtypes] * len(names))
    if jobs <= 1:
        shards = list(map(write_shard, *work))
    else:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            shards = list(pool.map(write_shard, *work))
    weight_map = {name: names[i] for i, items in enumerate(by_shard) for name, _, _ in items}
    total = tensor_bytes(spec)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(config_of(spec), indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2) + "\n")
    _side_files(out, spec)
    digests = {s["path"]: s["sha256"] for s in shards}
    digests_path.write_text(json.dumps(digests, indent=1) + "\n")
    summary = {
        "spec": key, "tensors": len(tensors), "tensor_bytes": total, "shard_bytes": sum(s["size"] for s in shards),
        "shards": shards, "allocated_bytes": _allocated(out), "seconds": round(time.perf_counter() - t0, 1),
        "reused": False,
    }  # fmt: skip
    summary_path.write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def _side_files(out: Path, spec: CheckpointSpec) -> None:
    specials = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"]
    vocab = {tok: i for i, tok in enumerate(specials)} | {f"t{i}": i for i in range(len(specials), spec.vocab_size)}
    added = [{"id": i, "content": t, "special": True, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False} for i, t in enumerate(specials)]  # fmt: skip
    tokenizer = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
                 "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None, "decoder": None,
                 "model": {"type": "WordLevel", "vocab": vocab, "unk_token": specials[2]}}  # fmt: skip
    (out / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False) + "\n")
    tok_config = {"add_bos_token": True, "add_eos_token": False, "bos_token": specials[0], "eos_token": specials[1],
                  "pad_token": specials[2], "model_max_length": 131072, "tokenizer_class": "LlamaTokenizerFast"}  # fmt: skip
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, ensure_ascii=False, indent=2) + "\n")
    for name in ("configuration_deepseek.py", "modeling_deepseek.py"):
        (out / name).write_text(f'"""{name}: a stand-in for DeepSeek\'s remote code (copied, never run)."""\n')
    (out / "LICENSE").write_text("MIT License (a stand-in for DeepSeek-R1's LICENSE file)\n")
    (out / "README.md").write_text(
        "---\nlicense: mit\nlibrary_name: transformers\n---\n\n# DeepSeek-R1 (sparse stand-in)\n\n"
        "DeepSeek-R1's tensors at their real shapes, every weight zero (file holes), synthetic scales.\n"
    )


def _allocated(root: Path) -> int:
    return sum(p.lstat().st_blocks * 512 for p in root.rglob("*") if p.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", type=Path)
    ap.add_argument("--layers", type=int, help="decoder layers, the MTP layer not counted (R1: 61; --tiny: 4)")
    ap.add_argument("--experts", type=int, help="routed experts per MoE layer (R1: 256; --tiny: 8)")
    ap.add_argument("--vocab", type=int, help="vocabulary rows of the embeddings and heads (R1: 129,280)")
    ap.add_argument("--shards", type=int, help="default: R1's shard size (163 at the real size)")
    ap.add_argument("--tiny", action="store_true", help="tiny dims (hidden 256): for tests")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="processes writing and hashing")
    args = ap.parse_args()
    summary = build(args.dir, spec_from_args(args), args.jobs)
    print(describe(summary))


def spec_from_args(args: argparse.Namespace) -> CheckpointSpec:
    layers = args.layers or (4 if args.tiny else 61)
    experts = args.experts or (8 if args.tiny else 256)
    return r1_spec(layers, experts, args.shards or (4 if args.tiny else None), args.tiny, args.vocab)


def describe(summary: dict) -> str:
    """What was built against DeepSeek-R1's real counts."""
    n, size, shards = summary["tensors"], summary["shard_bytes"], len(summary["shards"])
    return (
        f"{'reused' if summary.get('reused') else 'built'}: {shards} shards, {n:,} tensors, {size / 1e9:.1f} GB "
        f"({summary['tensor_bytes']:,} bytes of tensors) on {summary['allocated_bytes'] / 1e9:.2f} GB of disk; "
        f"DeepSeek-R1: {REAL_SHARDS} shards, {REAL_TENSORS:,} tensors, {REAL_BYTES / 1e9:.1f} GB"
    )


if __name__ == "__main__":
    main()
