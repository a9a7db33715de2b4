"""What a synthetic checkpoint of the MLA family holds: its config, and every tensor's name, kind and
shape (`CheckpointSpec`); a tiny one of each member (FAMILY) for the tests and the demo, and
`CheckpointSpec.r1_dims` with a few layers at the true R1 dimensions for the benchmarks.
`mla_convert.demo.synthetic` writes them.

The default is DeepSeek-V3/R1's layout: same tensor names, config, quantization_config, index and
side files as DeepSeek's release; several shards; one weight's scale deliberately in another shard;
a 576-row kv_a_proj_with_mqa (partial 128-blocks); dense first layers, routed and shared experts,
and the MTP layer. The members keep their own structure at tiny sizes (from the project's reference
notes, shared/reference/model-family.md): V3.1's power-of-two scales, V3.2's indexer (a 128-row
`wk` with a one-row scale grid) and F32 norms, Kimi-K2's per-layer `inv_freq` and shard names,
GLM-5's dims, BF16 modules_to_not_convert and MTP layer without its own head, V2-Lite's and
Moonlight's BF16 weights with a plain q_proj; GLM-5.2's IndexShare (indexer_types), Kimi-K2-Thinking's
pack-quantized INT4 experts, Kimi-K2.5/K2.6's nested config, `language_model.` names and vision
tower, Mistral-Large-3's own layout (params.json, consolidated shards, Mistral names, FP8_BLOCK with
BF16 scales, a vision encoder).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

from mla_convert.source import family
from mla_convert.source.checkpoint import module_of

BLOCK = 128
DEEPSEEK, KIMI_K25, MISTRAL = "deepseek", "kimi-k25", "mistral"  # CheckpointSpec.layout
# weights: "fp8" (DeepSeek's block FP8), "bf16", "ct-fp8-block" (compressed-tensors FP8_BLOCK,
# Mistral-Large-3), "int4" (compressed-tensors pack-quantized INT4 routed experts, the rest BF16)
CT_FP8_BLOCK, INT4 = "ct-fp8-block", "int4"
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
    # The late-2026 members (shared/reference/model-family.md, "The members of late 2026").
    layout: str = DEEPSEEK  # DEEPSEEK; KIMI_K25 (config nested in text_config, language_model.); MISTRAL
    int4_group: int = 32  # weights "int4": the routed experts pack-quantized, symmetric, this group size
    vision: bool = False  # a BF16 vision tower (Kimi-K2.5/K2.6) or encoder (Mistral-Large-3), copied
    quant_in_text_config: bool = False  # Kimi-K2.6: quantization_config only inside text_config
    indexer_types: tuple[str, ...] = ()  # GLM-5.2 (IndexShare): per decoder layer, "full" or "shared"
    index_topk_freq: int = 0  # > 0: GLM-5.2's index_topk_freq / index_skip_topk_offset, with indexer_types
    index_skip_topk_offset: int = 0

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
        quantization = self.quantization_config()
        if quantization is not None:
            cfg["quantization_config"] = quantization
        if self.indexer_types:
            cfg["indexer_types"] = list(self.indexer_types)
        if self.index_topk_freq:
            cfg["index_topk_freq"], cfg["index_skip_topk_offset"] = self.index_topk_freq, self.index_skip_topk_offset
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

    def quantization_config(self) -> dict | None:
        """The source's quantization_config as the member's real checkpoint has it; None for BF16."""
        if self.weights == "fp8":
            q = {
                "activation_scheme": "dynamic",
                "fmt": "e4m3",
                "quant_method": "fp8",
                "weight_block_size": list(self.block),
            }
            if self.scale_fmt:
                q["scale_fmt"] = self.scale_fmt
            if self.not_converted:
                q["modules_to_not_convert"] = self.modules_to_not_convert()
            return q
        if self.weights in (INT4, CT_FP8_BLOCK):
            return self.compressed_tensors_config()
        return None

    def modules_to_not_convert(self) -> list[str]:
        """The linears `not_converted` keeps BF16, as quantization_config lists them (by name); with
        IndexShare also each layer's `self_attn.indexers_proj`, which names no tensor (as GLM-5.2's)."""
        names = [module_of(n) for n, kind, _ in self.tensors() if kind == "bf16-linear"]
        if self.indexer_types:
            names += [f"model.layers.{i}.self_attn.indexers_proj" for i in range(self.num_hidden_layers)]
        return sorted(set(names))

    def compressed_tensors_config(self) -> dict:
        """The source's compressed-tensors quantization_config: Mistral-Large-3's FP8_BLOCK, or
        Kimi's pack-quantized INT4 (one group, targets Linear; the ignore list keeps every linear
        but the routed experts)."""
        if self.weights == CT_FP8_BLOCK:
            ignore = ["model.embed_tokens", "re:patch_merger.*", "re:vision_encoder.*", "re:vision_language_adapter.*",
                      "re:.*kv_a_proj_with_mqa$", "re:.*q_a_proj$", "re:.*gate$", "lm_head"]  # fmt: skip
            fp8 = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False}
            group = {
                "format": "float-quantized", "targets": ["Linear"], "output_activations": None,
                "input_activations": fp8 | {"dynamic": True, "group_size": 128, "strategy": "group"},
                "weights": fp8 | {"block_structure": list(self.block), "strategy": "block"},
            }  # fmt: skip
            return {"config_groups": {"FP8_BLOCK": group}, "format": "float-quantized", "ignore": ignore,
                    "quant_method": "compressed-tensors", "quantization_status": "compressed"}  # fmt: skip
        ignore = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]
        if self.vision and self.quant_in_text_config:  # Kimi-K2.6's list
            ignore = ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
                      "re:.*lm_head.*", "re:vision_tower.*", "re:mm_projector.*"]  # fmt: skip
        weights = {
            "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": self.int4_group,
            "dynamic": False, "actorder": None, "observer": "minmax", "observer_kwargs": {}, "block_structure": None,
        }  # fmt: skip
        group = {"targets": ["Linear"], "weights": weights, "input_activations": None, "output_activations": None}
        return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
                "kv_cache_scheme": None, "config_groups": {"group_0": group}, "ignore": ignore}  # fmt: skip

    def _linear(self, name: str) -> str:
        """The kind of a linear the member's FP8 releases quantize, in this checkpoint: "fp8",
        "int4" (an INT4 source's routed experts) or "bf16-linear"."""
        module = module_of(name)
        if self.weights == INT4:
            return "int4" if ".mlp.experts." in module else "bf16-linear"
        if self.weights == "bf16" or any(re.search(p, module) for p in self.not_converted):
            return "bf16-linear"
        if family.linear_kind(module, self.architecture) != family.FP8_LINEAR:  # Mistral's wq_a, wkv_a_with_mqa
            return "bf16-linear"
        return "fp8"

    def scale_name(self, weight: str) -> str:
        """A block-FP8 weight's scale: DeepSeek's `weight_scale_inv`, compressed-tensors' `weight_scale`."""
        return weight[: -len(".weight")] + ".weight_scale" if self.weights == CT_FP8_BLOCK else weight + "_scale_inv"

    def tensors(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """(name, kind, shape) in DeepSeek's order, by DeepSeek's names (demo.layouts gives the
        member's own); kind: fp8 | bf16 | bf16-linear | norm | bias | buffer | f32 | scale |
        int4-packed | int4-scale | int4-shape."""
        h = self.hidden_size
        out: list[tuple[str, str, tuple[int, ...]]] = [("model.embed_tokens.weight", "bf16", (self.vocab_size, h))]
        for i in range(self.num_hidden_layers + self.num_nextn_predict_layers):
            p = f"model.layers.{i}."
            if i >= self.num_hidden_layers:
                out += self._mtp_modules(p)
            out += [(p + "input_layernorm.weight", "norm", (h,)), (p + "post_attention_layernorm.weight", "norm", (h,))]
            out += self._attention(p + "self_attn.", i)
            out += self._ffn(p, i)
        out += [("model.norm.weight", "norm", (h,)), ("lm_head.weight", "bf16", (self.vocab_size, h))]
        # Every FP8 weight carries its block scale right after it, as in DeepSeek's shards; an INT4
        # weight is its packed codes, scales and shape.
        bn, bk = self.block
        full = []
        for name, kind, shape in out:
            if kind == "int4":
                m, (n, k) = module_of(name), shape
                full += [(m + ".weight_packed", "int4-packed", (n, math.ceil(k / 8))),
                         (m + ".weight_scale", "int4-scale", (n, k // self.int4_group)),
                         (m + ".weight_shape", "int4-shape", (2,))]  # fmt: skip
                continue
            full.append((name, kind, shape))
            if kind == "fp8":
                full.append((self.scale_name(name), "scale", (math.ceil(shape[0] / bn), math.ceil(shape[1] / bk))))
        return full

    def _mtp_modules(self, p: str) -> list[tuple[str, str, tuple[int, ...]]]:
        """The MTP layer's own modules (GLM's reuse the main model's embeddings and head)."""
        h, vocab = self.hidden_size, self.vocab_size
        out = [(p + "embed_tokens.weight", "bf16", (vocab, h))] if self.mtp_own_head else []
        out += [
            (p + "enorm.weight", "norm", (h,)),
            (p + "hnorm.weight", "norm", (h,)),
            (p + "eh_proj.weight", "bf16", (h, 2 * h)),
            (p + "shared_head.norm.weight", "norm", (h,)),
        ]
        return out + ([(p + "shared_head.head.weight", "bf16", (vocab, h))] if self.mtp_own_head else [])

    def _attention(self, a: str, layer: int) -> list[tuple[str, str, tuple[int, ...]]]:
        h, n, lin = self.hidden_size, self.num_attention_heads, self._linear
        q_rows = n * (self.qk_nope_head_dim + self.qk_rope_head_dim)
        if self.q_lora_rank:
            out = [
                (a + "q_a_proj.weight", lin(a + "q_a_proj.weight"), (self.q_lora_rank, h)),
                (a + "q_a_layernorm.weight", "norm", (self.q_lora_rank,)),
                (a + "q_b_proj.weight", lin(a + "q_b_proj.weight"), (q_rows, self.q_lora_rank)),
            ]
        else:
            out = [(a + "q_proj.weight", lin(a + "q_proj.weight"), (q_rows, h))]
        out += [
            (a + "kv_a_proj_with_mqa.weight", lin(a + "kv_a_proj_with_mqa.weight"),
             (self.kv_lora_rank + self.qk_rope_head_dim, h)),
            (a + "kv_a_layernorm.weight", "norm", (self.kv_lora_rank,)),
            (a + "kv_b_proj.weight", lin(a + "kv_b_proj.weight"),
             (n * (self.qk_nope_head_dim + self.v_head_dim), self.kv_lora_rank)),
            (a + "o_proj.weight", lin(a + "o_proj.weight"), (h, n * self.v_head_dim)),
        ]  # fmt: skip
        shared = self.indexer_types and layer < len(self.indexer_types) and self.indexer_types[layer] == "shared"
        if self.index_n_heads and not shared:  # IndexShare: a "shared" layer reuses another's top-k
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
        return out

    def _ffn(self, p: str, layer: int) -> list[tuple[str, str, tuple[int, ...]]]:
        """A dense MLP for the first layers, else the router, the routed and the shared experts."""
        h = self.hidden_size
        if layer < self.first_k_dense_replace:
            return self._mlp(p + "mlp.", h, self.intermediate_size)
        out = [(p + "mlp.gate.weight", "bf16", (self.n_routed_experts, h))]
        if self.topk_method == "noaux_tc":
            out.append((p + "mlp.gate.e_score_correction_bias", "f32", (self.n_routed_experts,)))
        for e in range(self.n_routed_experts):
            out += self._mlp(f"{p}mlp.experts.{e}.", h, self.moe_intermediate_size)
        return out + self._mlp(p + "mlp.shared_experts.", h, self.moe_intermediate_size * self.n_shared_experts)

    def _mlp(self, p: str, h: int, inter: int) -> list[tuple[str, str, tuple[int, ...]]]:
        names = (p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight")
        shapes = ((inter, h), (inter, h), (h, inter))
        return [(name, self._linear(name), shape) for name, shape in zip(names, shapes, strict=True)]

    def st_dtype(self, kind: str) -> str:
        """The safetensors dtype of a tensor kind in this checkpoint."""
        if kind in ("norm", "bias"):
            return "F32" if self.norm_dtype == "f32" else "BF16"
        if kind == "scale":
            return {"e8m0": "F8_E8M0", "bf16": "BF16"}.get(self.scale_dtype, "F32")
        return {"fp8": "F8_E4M3", "bf16": "BF16", "bf16-linear": "BF16", "buffer": "BF16", "f32": "F32",
                "int4-packed": "I32", "int4-scale": "BF16", "int4-shape": "I32"}[kind]  # fmt: skip


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
    # GLM-5.2 / 5.3: IndexShare, indexers on layers 0-2 and every 4th from 6 (0-2 at this size), the
    # same placement in index_topk_freq / index_skip_topk_offset; 141 shards at full size.
    "glm-5.2": CheckpointSpec(
        architecture=family.GLM_MOE_DSA, model_type="glm_moe_dsa", auto_map=(), remote_code=(), q_lora_rank=2048,
        qk_nope_head_dim=192, v_head_dim=256, index_n_heads=4, mtp_own_head=False, num_hidden_layers=5,
        not_converted=(r"\.mlp\.shared_experts\.",), indexer_types=("full", "full", "full", "shared", "shared"),
        index_topk_freq=4, index_skip_topk_offset=3,
    ),
    # Mistral-Large-3-675B-Instruct-2512: Mistral's own layout, FP8_BLOCK with BF16 scales, a vision
    # encoder, softmax routing (no e_score_correction_bias), no MTP layer.
    "mistral-large-3": CheckpointSpec(
        architecture=family.MISTRAL_LARGE_3, model_type="deepseek_v3", layout=MISTRAL, weights=CT_FP8_BLOCK,
        scale_dtype="bf16", num_nextn_predict_layers=0, topk_method="softmax", n_group=1, topk_group=1,
        auto_map=(), remote_code=(), vision=True, shard_name="consolidated-{i:05d}-of-{n:05d}.safetensors",
        split_scale_of="model.layers.1.mlp.experts.3.down_proj.weight",
    ),
    # Its BF16 release: the same names and files, no quantization.
    "mistral-large-3-bf16": CheckpointSpec(
        architecture=family.MISTRAL_LARGE_3, model_type="deepseek_v3", layout=MISTRAL, weights="bf16",
        num_nextn_predict_layers=0, topk_method="softmax", n_group=1, topk_group=1, auto_map=(), remote_code=(),
        vision=True, shard_name="consolidated-{i:05d}-of-{n:05d}.safetensors",
    ),
    # Kimi-K2-Thinking: pack-quantized INT4 routed experts (group 32), everything else BF16; 62 shards.
    "kimi-k2-thinking": CheckpointSpec(
        model_type="kimi_k2", weights=INT4, num_attention_heads=2, n_routed_experts=12, num_nextn_predict_layers=0,
        n_group=1, topk_group=1, shard_name="model-{i:05d}-of-{n:06d}.safetensors",
        remote_code=("configuration_deepseek.py", "modeling_deepseek.py", "tokenization_kimi.py"),
    ),
    # Kimi-K2.5: KimiK25ForConditionalGeneration, the text model in text_config, language_model.
    # names, a BF16 vision tower and projector; 64 shards. K2.6: its quantization_config in text_config only.
    "kimi-k2.5": CheckpointSpec(
        model_type="kimi_k2", layout=KIMI_K25, weights=INT4, num_attention_heads=2, n_routed_experts=12,
        num_nextn_predict_layers=0, n_group=1, topk_group=1, vision=True, shard_name="model-{i:05d}-of-{n:06d}.safetensors",
        remote_code=("configuration_kimi_k25.py", "modeling_kimi_k25.py", "tokenization_kimi.py"),
    ),
    "kimi-k2.6": CheckpointSpec(
        model_type="kimi_k2", layout=KIMI_K25, weights=INT4, num_attention_heads=2, n_routed_experts=12,
        num_nextn_predict_layers=0, n_group=1, topk_group=1, vision=True, quant_in_text_config=True,
        shard_name="model-{i:05d}-of-{n:06d}.safetensors",
        remote_code=("configuration_kimi_k25.py", "modeling_kimi_k25.py", "tokenization_kimi.py"),
    ),
}  # fmt: skip
assert tuple(FAMILY) == family.MEMBERS
