"""Write the synthetic checkpoints `mla_convert.demo.specs` describes: tensors generated and
written one at a time (big checkpoints stream), DeepSeek's block quantization of them (with BF16
scales for compressed-tensors FP8_BLOCK), pack-quantized INT4 routed experts, the index,
config and side files in the member's layout (demo.layouts)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from mla_convert.demo import layouts
from mla_convert.demo.specs import BLOCK, CT_FP8_BLOCK, CheckpointSpec
from mla_convert.io.shard_writer import ShardWriter
from mla_runtime.safetensors_file import nbytes_of


def quantize_block_fp8(
    w: torch.Tensor, block: int | tuple[int, int] = BLOCK, pow2: bool = False, bf16_scale: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [N, K] -> (e4m3 [N, K], fp32 scale grid): DeepSeek's block quantization. `pow2`: each
    scale rounded up to a power of two (V3.1's ue8m0 scales); `bf16_scale`: each scale rounded to
    bf16 (compressed-tensors FP8_BLOCK stores them so), its values still returned in float32."""
    bn, bk = (block, block) if isinstance(block, int) else block
    n, k = w.shape
    gn, gk = math.ceil(n / bn), math.ceil(k / bk)
    padded = torch.nn.functional.pad(w, (0, gk * bk - k, 0, gn * bn - n))
    blocks = padded.view(gn, bn, gk, bk)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    if pow2:
        scale = torch.pow(2.0, torch.ceil(torch.log2(scale)))
    if bf16_scale:
        scale = scale.to(torch.bfloat16).float()
    q = (blocks / scale.view(gn, 1, gk, 1)).clamp(-448, 448).view(gn * bn, gk * bk)[:n, :k]
    return q.contiguous().to(torch.float8_e4m3fn), scale.float().contiguous()


def quantize_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 [N, K] -> (weight_packed I32 [N, K / 8], weight_scale BF16 [N, K / group], weight_shape
    I32 [2]): symmetric round-to-nearest INT4 per group of columns, scale max|group| / 7, the codes
    stored as value + 8, eight to an int32 with the lowest column in the lowest nibble."""
    n, k = w.shape
    groups = w.view(n, k // group, group)
    scale = (groups.abs().amax(dim=-1) / 7.0).clamp(min=2.0**-20).to(torch.bfloat16)
    q = torch.round(groups / scale.float().unsqueeze(-1)).clamp(-8, 7).to(torch.int32).view(n, k)
    codes = (q + 8).view(n, k // 8, 8)
    packed = torch.zeros(n, k // 8, dtype=torch.int32)
    for b in range(8):
        packed |= codes[:, :, b] << (4 * b)  # nibble 7 sets the sign bit: the int32 may be negative
    return packed, scale, torch.tensor([n, k], dtype=torch.int32)


def encode_e8m0(scale: torch.Tensor) -> torch.Tensor:
    """Power-of-two fp32 scales -> float8_e8m0fnu (the exponent byte, 2^(v - 127))."""
    exponent = torch.log2(scale)
    if not torch.equal(exponent, exponent.round()):
        raise ValueError("e8m0 scales must be powers of two")
    return (exponent.to(torch.int32) + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


class _Generator:
    """Deterministic tensor values; an FP8 weight and its scale are generated together and each
    handed out once, whichever shard asks first."""

    def __init__(self, spec: CheckpointSpec, shapes: dict[str, tuple[int, ...]]):
        self.spec = spec
        self.gen = torch.Generator().manual_seed(spec.seed)
        self.shapes = shapes
        self.pairs: dict[str, list] = {}

    def make(self, name: str, kind: str, shape: tuple[int, ...]) -> torch.Tensor:
        if kind == "fp8":
            return self._pair_part(name, 0)
        if kind == "scale":
            weight = name[: -len(".weight_scale")] + ".weight" if name.endswith(".weight_scale") else name[:-10]
            scale = self._pair_part(weight, 1)
            if self.spec.scale_dtype == "bf16":
                return scale.to(torch.bfloat16)
            return encode_e8m0(scale) if self.spec.scale_dtype == "e8m0" else scale
        if kind.startswith("int4-"):
            which = ("int4-packed", "int4-scale", "int4-shape").index(kind)
            return self._pair_part(name.rsplit(".", 1)[0] + ".weight", which)
        norm_dtype = torch.float32 if self.spec.norm_dtype == "f32" else torch.bfloat16
        if kind == "norm":
            return (1.0 + 0.05 * torch.randn(shape, generator=self.gen)).to(norm_dtype)
        if kind == "bias":
            return (0.01 * torch.randn(shape, generator=self.gen)).to(norm_dtype)
        if kind == "f32":
            return 0.01 * torch.randn(shape, generator=self.gen)
        if kind == "buffer":  # rotary inv_freq: 1 / 10000^(2i / (2 * length))
            return (1.0 / 10000 ** (torch.arange(0, 2 * shape[0], 2).float() / (2 * shape[0]))).to(torch.bfloat16)
        if kind == "bf16-linear":
            return self._linear_weight(name).to(torch.bfloat16)
        return (0.02 * torch.randn(shape, generator=self.gen)).to(torch.bfloat16)

    def _pair_part(self, wname: str, which: int) -> torch.Tensor:
        entry = self.pairs.get(wname)
        if entry is None:
            entry = self.pairs[wname] = list(self._int4(wname) if wname not in self.shapes else self._fp8_pair(wname))
        part, entry[which] = entry[which], None
        if all(x is None for x in entry):
            del self.pairs[wname]
        return part

    def _linear_weight(self, wname: str) -> torch.Tensor:
        shape = self.shapes[wname]
        w = torch.randn(shape, generator=self.gen) / math.sqrt(shape[1])
        if wname.endswith("experts.0.down_proj.weight"):
            w[0].zero_()  # an all-zero output row: channel scales must stay finite
        return w

    def _int4(self, wname: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        module = wname[: -len(".weight")]
        n, k8 = self.shapes[module + ".weight_packed"]
        w = torch.randn((n, k8 * 8), generator=self.gen) / math.sqrt(k8 * 8)
        return quantize_int4(w, self.spec.int4_group)

    def _fp8_pair(self, wname: str) -> tuple[torch.Tensor, torch.Tensor]:
        # ue8m0: power-of-two scales, except o_proj's (as reported of V3.1's release)
        pow2 = self.spec.scale_fmt == "ue8m0" and not wname.endswith("o_proj.weight")
        if self.spec.scale_dtype == "e8m0":
            pow2 = True
        bf16 = self.spec.weights == CT_FP8_BLOCK
        return quantize_block_fp8(self._linear_weight(wname), self.spec.block, pow2, bf16_scale=bf16)


def write_checkpoint(out_dir: str | Path, spec: CheckpointSpec = CheckpointSpec()) -> Path:  # noqa: B008 (frozen)
    """Write the checkpoint `spec` describes to `out_dir` (created; must be empty or absent)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = spec.tensors() + layouts.vision_tensors(spec)
    shard_of = _assign_shards(tensors, spec)
    gen = _Generator(spec, {n: s for n, _, s in tensors})
    vision = {n for n, _, _ in layouts.vision_tensors(spec)}  # named as the member names them already
    native = {n: n if n in vision else layouts.native_name(spec, n) for n, _, _ in tensors}
    names = [spec.shard_name.format(i=i + 1, n=spec.num_shards) for i in range(spec.num_shards)]
    by_shard: list[list[tuple[str, str, tuple[int, ...]]]] = [[] for _ in names]
    for t in tensors:
        by_shard[shard_of[t[0]]].append(t)
    total = 0
    for fname, items in zip(names, by_shard, strict=True):
        specs = {native[n]: (spec.st_dtype(k), s) for n, k, s in items}
        with ShardWriter(out_dir / fname, specs) as w:
            for n, k, s in items:
                w.write(native[n], gen.make(n, k, s))
            w.commit()
        total += sum(nbytes_of(spec.st_dtype(k), s) for _, k, s in items)
    weight_map = {native[n]: names[shard_of[n]] for n, _, _ in tensors}
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / layouts.index_name(spec)).write_text(json.dumps(index, indent=2) + "\n")
    config_name, config = layouts.config_file(spec)
    (out_dir / config_name).write_text(json.dumps(config, indent=2) + "\n")
    _write_side_files(out_dir, spec)
    return out_dir


def _assign_shards(tensors, spec: CheckpointSpec) -> dict[str, int]:
    """Contiguous runs of roughly equal bytes; then move one scale into the next shard."""
    sizes = [nbytes_of(spec.st_dtype(k), s) for _, k, s in tensors]
    per = sum(sizes) / spec.num_shards
    shard_of, acc = {}, 0
    for (name, _, _), size in zip(tensors, sizes, strict=True):
        shard_of[name] = min(int(acc // per), spec.num_shards - 1)
        acc += size
    w = spec.split_scale_of
    partner = spec.scale_name(w) if w else None
    if w and w not in shard_of and w[: -len(".weight")] + ".weight_packed" in shard_of:  # INT4: its scale
        w, partner = w[: -len(".weight")] + ".weight_packed", w[: -len(".weight")] + ".weight_scale"
    if w and partner in shard_of and spec.num_shards > 1:
        s = shard_of[w]
        shard_of[partner] = s + 1 if s + 1 < spec.num_shards else s - 1
    return shard_of


def _write_side_files(out_dir: Path, spec: CheckpointSpec) -> None:
    own = layouts.side_files(spec)
    if own is None:
        _write_hf_side_files(out_dir, spec)
    for fname, text in (own or {}).items():
        (out_dir / fname).write_text(text)
    weights = {"fp8": "block-FP8", "bf16": "BF16", CT_FP8_BLOCK: "FP8_BLOCK", "int4": "INT4 experts"}[spec.weights]
    # Front matter as a published checkpoint's card has it (DeepSeek-R1's: license, library), which
    # the converted model's card takes over.
    (out_dir / "README.md").write_text(
        "---\nlicense: mit\nlibrary_name: transformers\npipeline_tag: text-generation\n---\n\n"
        f"# Synthetic {spec.architecture}\n\n"
        f"A synthetic {spec.architecture} ({spec.model_type}, {spec.layout} layout) {weights} checkpoint "
        "written by mla-convert.\n"
    )
    (out_dir / "figures").mkdir(exist_ok=True)
    (out_dir / "figures" / "notes.txt").write_text("A side file in a subfolder: copied with its path.\n")


def _write_hf_side_files(out_dir: Path, spec: CheckpointSpec) -> None:
    specials = ["<|begin▁of▁sentence|>", "<|end▁of▁sentence|>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    vocab.update({f"w{i}": i for i in range(len(specials), spec.vocab_size)})
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": i,
                "content": t,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for i, t in enumerate(specials)
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None,
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": True},
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    }
    (out_dir / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False) + "\n")
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": specials[0],
        "eos_token": specials[1],
        "unk_token": specials[2],
        "model_max_length": 2048,
        "add_bos_token": True,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_cfg, ensure_ascii=False, indent=2) + "\n")
    gen_cfg = {"bos_token_id": 0, "eos_token_id": 1, "do_sample": True, "temperature": 0.6, "top_p": 0.95}
    (out_dir / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")
    for fname in spec.remote_code:
        (out_dir / fname).write_text(
            f'"""{fname}: placeholder for a remote-code file in this synthetic checkpoint.\n\n'
            'mla-convert copies such files unchanged and never imports or runs them."""\n'
        )
    if spec.tiktoken:
        (out_dir / "tiktoken.model").write_text("".join(f"dw{i}= {i}\n" for i in range(8)))
