"""Synthetic checkpoints of the MLA family: a tiny one of each member (FAMILY) for tests and the
demo, and one with a few layers at the true R1 dimensions for benchmarks.

The default is DeepSeek-V3/R1's layout: same tensor names, config, quantization_config, index and
side files as DeepSeek's release; several shards; one weight's scale deliberately in another shard;
a 576-row kv_a_proj_with_mqa (partial 128-blocks); dense first layers, routed and shared experts,
and the MTP layer. The members keep their own structure at tiny sizes (from the project's reference
notes, shared/reference/model-family.md): V3.1's power-of-two scales, V3.2's indexer (a 128-row
`wk` with a one-row scale grid) and F32 norms, Kimi-K2's per-layer `inv_freq` and shard names,
GLM-5's dims, BF16 modules_to_not_convert and MTP layer without its own head, V2-Lite's and
Moonlight's BF16 weights with a plain q_proj. Tensors are generated and written one at a time, so
big checkpoints stream.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from mla_convert.constants import CONFIG_NAME, INDEX_NAME
from mla_convert.io.shard_writer import ShardWriter
from mla_convert.source import family
from mla_convert.source.checkpoint import module_of
from mla_runtime.safetensors_file import nbytes_of

BLOCK = 128
DEEPSEEK_AUTO_MAP = {
    "AutoConfig": "configuration_deepseek.DeepseekV3Config",
    "AutoModel": "modeling_deepseek.DeepseekV3Model",
    "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
}


@dataclass(frozen=True)
class CheckpointSpec:
    hidden_size: int = 256
    num_hidden_layers: int = 3
    first_k_dense_replace: int = 1
    num_nextn_predict_layers: int = 1
    num_attention_heads: int = 4
    q_lora_rank: int | None = 192  # None: no q LoRA, a single q_proj (V2-Lite, Moonlight)
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    intermediate_size: int = 320
    moe_intermediate_size: int = 192
    n_routed_experts: int = 8
    n_shared_experts: int = 1
    num_experts_per_tok: int = 2
    n_group: int = 2
    topk_group: int = 1
    vocab_size: int = 512
    num_shards: int = 4
    seed: int = 0
    # A weight whose scale goes to the next shard (R1 has one such pair around layer 39).
    split_scale_of: str = "model.layers.1.mlp.experts.3.down_proj.weight"
    architecture: str = family.DEEPSEEK_V3
    model_type: str = "deepseek_v3"
    auto_map: tuple[tuple[str, str], ...] = tuple(DEEPSEEK_AUTO_MAP.items())
    weights: str = "fp8"  # "fp8": block FP8 with a quantization_config; "bf16": no quantization_config
    block: tuple[int, int] = (BLOCK, BLOCK)  # weight_block_size
    scale_dtype: str = "f32"  # "f32", or "e8m0": float8_e8m0fnu scale tensors
    scale_fmt: str | None = None  # "ue8m0" (V3.1, V3.2): power-of-two scales, except o_proj's
    norm_dtype: str = "bf16"  # "f32": every norm in float32 (V3.2)
    index_n_heads: int = 0  # > 0: the lightning indexer (V3.2, GLM) on every layer
    index_head_dim: int = 128
    mtp_own_head: bool = True  # False: the MTP layer has no embed_tokens / shared_head.head (GLM)
    inv_freq: int = 0  # > 0: every layer stores self_attn.rotary_emb.inv_freq, BF16 of this length (Kimi)
    not_converted: tuple[str, ...] = ()  # module regexes (re.search) left BF16 in an FP8 source
    topk_method: str = "noaux_tc"
    shard_name: str = "model-{i:05d}-of-{n:05d}.safetensors"  # Kimi: "model-{i}-of-{n}.safetensors"
    remote_code: tuple[str, ...] = ("configuration_deepseek.py", "modeling_deepseek.py")

    @classmethod
    def r1_dims(
        cls, num_hidden_layers: int = 2, n_routed_experts: int = 16, num_shards: int = 4, **kw
    ) -> CheckpointSpec:
        """True DeepSeek-R1 tensor shapes with fewer layers/experts (for benchmarks); `kw` overrides."""
        dims = dict(
            hidden_size=7168,
            num_hidden_layers=num_hidden_layers,
            first_k_dense_replace=1,
            num_nextn_predict_layers=0,
            num_attention_heads=128,
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            intermediate_size=18432,
            moe_intermediate_size=2048,
            n_routed_experts=n_routed_experts,
            n_shared_experts=1,
            num_experts_per_tok=min(8, n_routed_experts),
            n_group=1,
            topk_group=1,
            vocab_size=129280,
            num_shards=num_shards,
            split_scale_of="model.layers.1.mlp.experts.1.down_proj.weight",
        )
        return cls(**(dims | kw))

    @classmethod
    def family(cls, member: str, **kw) -> CheckpointSpec:
        """The tiny checkpoint of a family member (family.MEMBERS); `kw` overrides."""
        if member not in FAMILY:
            raise ValueError(f"unknown family member {member!r}; expected one of {', '.join(family.MEMBERS)}")
        return dataclasses.replace(FAMILY[member], **kw)

    def config(self) -> dict:
        cfg = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": 0,
            "eos_token_id": 1,
            "hidden_act": "silu",
            "initializer_range": 0.02,
            "max_position_embeddings": 2048,
            "moe_layer_freq": 1,
            "norm_topk_prob": True,
            "num_key_value_heads": self.num_attention_heads,
            "pretraining_tp": 1,
            "rms_norm_eps": 1e-6,
            "rope_scaling": None,
            "rope_theta": 10000,
            "routed_scaling_factor": 2.5,
            "scoring_func": "sigmoid",
            "tie_word_embeddings": False,
            "topk_method": self.topk_method,
            "torch_dtype": "bfloat16",
            "use_cache": True,
        }
        if self.auto_map:
            cfg["auto_map"] = dict(self.auto_map)
        if self.topk_method != "noaux_tc":  # DeepSeek-V2's softmax router
            cfg["scoring_func"] = "softmax"
            cfg["routed_scaling_factor"] = 1.0
        if self.weights == "fp8":
            cfg["quantization_config"] = {
                "activation_scheme": "dynamic",
                "fmt": "e4m3",
                "quant_method": "fp8",
                "weight_block_size": list(self.block),
            }
            if self.scale_fmt:
                cfg["quantization_config"]["scale_fmt"] = self.scale_fmt
            if self.not_converted:
                cfg["quantization_config"]["modules_to_not_convert"] = self.modules_to_not_convert()
        keys = [
            "hidden_size", "num_hidden_layers", "first_k_dense_replace", "num_attention_heads", "q_lora_rank",
            "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "intermediate_size",
            "moe_intermediate_size", "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "n_group",
            "topk_group", "vocab_size",
        ]  # fmt: skip
        if self.architecture != family.DEEPSEEK_V2:  # V2 has no MTP, and no such key
            keys.append("num_nextn_predict_layers")
        if self.index_n_heads:
            keys += ["index_n_heads", "index_head_dim"]
            cfg["index_topk"] = 2048
        for k in keys:
            cfg[k] = getattr(self, k)
        return dict(sorted(cfg.items()))

    def modules_to_not_convert(self) -> list[str]:
        """The linears `not_converted` keeps BF16, as quantization_config lists them (by name)."""
        names = [module_of(n) for n, kind, _ in self.tensors() if kind == "bf16-linear"]
        return sorted(set(names))

    def _linear(self, name: str) -> str:
        """The kind of a linear DeepSeek's FP8 releases quantize, in this checkpoint."""
        if self.weights == "bf16" or any(re.search(p, module_of(name)) for p in self.not_converted):
            return "bf16-linear"
        return "fp8"

    def tensors(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """(name, kind, shape) in DeepSeek's order; kind: fp8 | bf16 | bf16-linear | norm | bias |
        buffer | f32 | scale."""
        h, n = self.hidden_size, self.num_attention_heads
        lin = self._linear
        out: list[tuple[str, str, tuple[int, ...]]] = [("model.embed_tokens.weight", "bf16", (self.vocab_size, h))]
        for i in range(self.num_hidden_layers + self.num_nextn_predict_layers):
            p = f"model.layers.{i}."
            if i >= self.num_hidden_layers:  # the MTP layer's own modules
                if self.mtp_own_head:
                    out.append((p + "embed_tokens.weight", "bf16", (self.vocab_size, h)))
                out += [
                    (p + "enorm.weight", "norm", (h,)),
                    (p + "hnorm.weight", "norm", (h,)),
                    (p + "eh_proj.weight", "bf16", (h, 2 * h)),
                    (p + "shared_head.norm.weight", "norm", (h,)),
                ]
                if self.mtp_own_head:
                    out.append((p + "shared_head.head.weight", "bf16", (self.vocab_size, h)))
            out += [(p + "input_layernorm.weight", "norm", (h,)), (p + "post_attention_layernorm.weight", "norm", (h,))]
            a = p + "self_attn."
            q_rows = n * (self.qk_nope_head_dim + self.qk_rope_head_dim)
            if self.q_lora_rank:
                out += [
                    (a + "q_a_proj.weight", lin(a + "q_a_proj.weight"), (self.q_lora_rank, h)),
                    (a + "q_a_layernorm.weight", "norm", (self.q_lora_rank,)),
                    (a + "q_b_proj.weight", lin(a + "q_b_proj.weight"), (q_rows, self.q_lora_rank)),
                ]
            else:
                out.append((a + "q_proj.weight", lin(a + "q_proj.weight"), (q_rows, h)))
            out += [
                (a + "kv_a_proj_with_mqa.weight", lin(a + "kv_a_proj_with_mqa.weight"),
                 (self.kv_lora_rank + self.qk_rope_head_dim, h)),
                (a + "kv_a_layernorm.weight", "norm", (self.kv_lora_rank,)),
                (a + "kv_b_proj.weight", lin(a + "kv_b_proj.weight"),
                 (n * (self.qk_nope_head_dim + self.v_head_dim), self.kv_lora_rank)),
                (a + "o_proj.weight", lin(a + "o_proj.weight"), (h, n * self.v_head_dim)),
            ]  # fmt: skip
            if self.index_n_heads:
                x = a + "indexer."
                out += [
                    (x + "wq_b.weight", lin(x + "wq_b.weight"),
                     (self.index_n_heads * self.index_head_dim, self.q_lora_rank or h)),
                    (x + "wk.weight", lin(x + "wk.weight"), (self.index_head_dim, h)),
                    (x + "weights_proj.weight", "bf16", (self.index_n_heads, h)),
                    (x + "k_norm.weight", "norm", (self.index_head_dim,)),
                    (x + "k_norm.bias", "bias", (self.index_head_dim,)),
                ]  # fmt: skip
            if self.inv_freq:
                out.append((a + "rotary_emb.inv_freq", "buffer", (self.inv_freq,)))
            if i < self.first_k_dense_replace:
                out += self._mlp(p + "mlp.", h, self.intermediate_size)
            else:
                out.append((p + "mlp.gate.weight", "bf16", (self.n_routed_experts, h)))
                if self.topk_method == "noaux_tc":
                    out.append((p + "mlp.gate.e_score_correction_bias", "f32", (self.n_routed_experts,)))
                for e in range(self.n_routed_experts):
                    out += self._mlp(f"{p}mlp.experts.{e}.", h, self.moe_intermediate_size)
                out += self._mlp(p + "mlp.shared_experts.", h, self.moe_intermediate_size * self.n_shared_experts)
        out += [("model.norm.weight", "norm", (h,)), ("lm_head.weight", "bf16", (self.vocab_size, h))]
        # Every FP8 weight carries its block scale right after it, as in DeepSeek's shards.
        bn, bk = self.block
        full = []
        for name, kind, shape in out:
            full.append((name, kind, shape))
            if kind == "fp8":
                full.append((name + "_scale_inv", "scale", (math.ceil(shape[0] / bn), math.ceil(shape[1] / bk))))
        return full

    def _mlp(self, p: str, h: int, inter: int) -> list[tuple[str, str, tuple[int, ...]]]:
        names = (p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight")
        shapes = ((inter, h), (inter, h), (h, inter))
        return [(name, self._linear(name), shape) for name, shape in zip(names, shapes, strict=True)]

    def st_dtype(self, kind: str) -> str:
        """The safetensors dtype of a tensor kind in this checkpoint."""
        if kind in ("norm", "bias"):
            return "F32" if self.norm_dtype == "f32" else "BF16"
        if kind == "scale":
            return "F8_E8M0" if self.scale_dtype == "e8m0" else "F32"
        return {"fp8": "F8_E4M3", "bf16": "BF16", "bf16-linear": "BF16", "buffer": "BF16", "f32": "F32"}[kind]


# The tiny checkpoint of each family member, by family.MEMBERS name: the default layout with each
# member's own structure (shared/reference/model-family.md), dimensions shrunk.
FAMILY: dict[str, CheckpointSpec] = {
    "deepseek-v3": CheckpointSpec(),
    "deepseek-v3.1": CheckpointSpec(scale_fmt="ue8m0"),
    "deepseek-v3.2": CheckpointSpec(
        architecture=family.DEEPSEEK_V32, model_type="deepseek_v32", scale_fmt="ue8m0", norm_dtype="f32",
        index_n_heads=4,
    ),
    "kimi-k2": CheckpointSpec(
        model_type="kimi_k2", num_attention_heads=2, n_routed_experts=12, num_nextn_predict_layers=0, inv_freq=56,
        shard_name="model-{i}-of-{n}.safetensors",
        remote_code=("configuration_deepseek.py", "modeling_deepseek.py", "tokenization_kimi.py"),
    ),
    "glm-5": CheckpointSpec(
        architecture=family.GLM_MOE_DSA, model_type="glm_moe_dsa", auto_map=(), remote_code=(), q_lora_rank=2048,
        qk_nope_head_dim=192, v_head_dim=256, index_n_heads=4, mtp_own_head=False,
        not_converted=(r"\.mlp\.shared_experts\.",),
    ),
    "deepseek-v2-lite": CheckpointSpec(
        architecture=family.DEEPSEEK_V2, model_type="deepseek_v2", weights="bf16", num_attention_heads=16,
        q_lora_rank=None, num_nextn_predict_layers=0, topk_method="greedy", n_group=1, topk_group=1,
        auto_map=(("AutoConfig", "configuration_deepseek.DeepseekV2Config"),
                  ("AutoModelForCausalLM", "modeling_deepseek.DeepseekV2ForCausalLM")),
    ),
    "moonlight": CheckpointSpec(
        weights="bf16", num_attention_heads=16, q_lora_rank=None, num_nextn_predict_layers=0, n_group=1,
        topk_group=1,
    ),
}  # fmt: skip
assert tuple(FAMILY) == family.MEMBERS


def quantize_block_fp8(
    w: torch.Tensor, block: int | tuple[int, int] = BLOCK, pow2: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [N, K] -> (e4m3 [N, K], fp32 scale grid): DeepSeek's block quantization. `pow2`: each
    scale rounded up to a power of two (V3.1's ue8m0 scales)."""
    bn, bk = (block, block) if isinstance(block, int) else block
    n, k = w.shape
    gn, gk = math.ceil(n / bn), math.ceil(k / bk)
    padded = torch.nn.functional.pad(w, (0, gk * bk - k, 0, gn * bn - n))
    blocks = padded.view(gn, bn, gk, bk)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    if pow2:
        scale = torch.pow(2.0, torch.ceil(torch.log2(scale)))
    q = (blocks / scale.view(gn, 1, gk, 1)).clamp(-448, 448).view(gn * bn, gk * bk)[:n, :k]
    return q.contiguous().to(torch.float8_e4m3fn), scale.float().contiguous()


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
            scale = self._pair_part(name[: -len("_scale_inv")], 1)
            return encode_e8m0(scale) if self.spec.scale_dtype == "e8m0" else scale
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
            entry = self.pairs[wname] = list(self._fp8_pair(wname))
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

    def _fp8_pair(self, wname: str) -> tuple[torch.Tensor, torch.Tensor]:
        # ue8m0: power-of-two scales, except o_proj's (as reported of V3.1's release)
        pow2 = self.spec.scale_fmt == "ue8m0" and not wname.endswith("o_proj.weight")
        if self.spec.scale_dtype == "e8m0":
            pow2 = True
        return quantize_block_fp8(self._linear_weight(wname), self.spec.block, pow2)


def write_checkpoint(out_dir: str | Path, spec: CheckpointSpec = CheckpointSpec()) -> Path:
    """Write the checkpoint `spec` describes to `out_dir` (created; must be empty or absent)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = spec.tensors()
    shard_of = _assign_shards(tensors, spec)
    gen = _Generator(spec, {n: s for n, _, s in tensors})
    names = [spec.shard_name.format(i=i + 1, n=spec.num_shards) for i in range(spec.num_shards)]
    by_shard: list[list[tuple[str, str, tuple[int, ...]]]] = [[] for _ in names]
    for t in tensors:
        by_shard[shard_of[t[0]]].append(t)
    total = 0
    for fname, items in zip(names, by_shard, strict=True):
        specs = {n: (spec.st_dtype(k), s) for n, k, s in items}
        with ShardWriter(out_dir / fname, specs) as w:
            for n, k, s in items:
                w.write(n, gen.make(n, k, s))
            w.commit()
        total += sum(nbytes_of(spec.st_dtype(k), s) for _, k, s in items)
    weight_map = {n: names[shard_of[n]] for n, _, _ in tensors}
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    (out_dir / CONFIG_NAME).write_text(json.dumps(spec.config(), indent=2) + "\n")
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
    if w and w + "_scale_inv" in shard_of and spec.num_shards > 1:
        s = shard_of[w]
        shard_of[w + "_scale_inv"] = s + 1 if s + 1 < spec.num_shards else s - 1
    return shard_of


def _write_side_files(out_dir: Path, spec: CheckpointSpec) -> None:
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
    weights = "block-FP8" if spec.weights == "fp8" else "BF16"
    (out_dir / "README.md").write_text(
        f"Synthetic {spec.architecture} ({spec.model_type}) {weights} checkpoint written by mla-convert.\n"
    )
    (out_dir / "figures").mkdir(exist_ok=True)
    (out_dir / "figures" / "notes.txt").write_text("A side file in a subfolder: copied with its path.\n")
