"""What a synthetic checkpoint of the MLA family holds: its config, and every tensor's name, kind and
shape (`CheckpointSpec`); a tiny one of each demo member (FAMILY: the fields each member module of
source/members/ declares, at tiny sizes) for the tests and the demo, and `CheckpointSpec.r1_dims`
with a few layers at the true R1 dimensions for the benchmarks. `mla_convert.demo.synthetic`
writes them.

The default is DeepSeek-V3/R1's layout: same tensor names, config, quantization_config, index and
side files as DeepSeek's release; several shards; one weight's scale deliberately in another shard;
a 576-row kv_a_proj_with_mqa (partial 128-blocks); dense first layers, routed and shared experts,
and the MTP layer. The fields below give the members' own structure (from the project's reference
notes, shared/reference/model-family.md): power-of-two scales, the indexer (a 128-row `wk` with a
one-row scale grid) and F32 norms, per-layer `inv_freq` and shard names, other dims, BF16
modules_to_not_convert and an MTP layer without its own head, BF16 weights with a plain q_proj,
IndexShare (indexer_types), pack-quantized INT4 experts, a nested config, a vision part, and a
member's own layout (Member.demo_layout).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from mla_convert.source import family, members
from mla_convert.source.checkpoint import module_of

BLOCK = 128
DEEPSEEK = "deepseek"  # CheckpointSpec.layout: config.json and DeepSeek-V3's names; others: Member.demo_layout
# weights: "fp8" (DeepSeek's block FP8), "bf16", "ct-fp8-block" (compressed-tensors FP8_BLOCK),
# "int4" (compressed-tensors pack-quantized INT4 routed experts, the rest BF16)
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
    q_lora_rank: int | None = 192  # None: no q LoRA, a single q_proj
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
    mtp_key: bool = True  # False: the config has no num_nextn_predict_layers (a member without MTP)
    model_type: str = "deepseek_v3"
    auto_map: tuple[tuple[str, str], ...] = tuple(DEEPSEEK_AUTO_MAP.items())
    weights: str = "fp8"  # "fp8": block FP8 with a quantization_config; "bf16": no quantization_config
    block: tuple[int, int] = (BLOCK, BLOCK)  # weight_block_size
    scale_dtype: str = "f32"  # "f32", or "e8m0": float8_e8m0fnu scale tensors
    scale_fmt: str | None = None  # "ue8m0": power-of-two scales, except o_proj's
    norm_dtype: str = "bf16"  # "f32": every norm in float32
    index_n_heads: int = 0  # > 0: the lightning indexer on every layer
    index_head_dim: int = 128
    mtp_own_head: bool = True  # False: the MTP layer has no embed_tokens / shared_head.head
    inv_freq: int = 0  # > 0: every layer stores self_attn.rotary_emb.inv_freq, BF16 of this length
    not_converted: tuple[str, ...] = ()  # module regexes (re.search) left BF16 in an FP8 source
    topk_method: str = "noaux_tc"
    shard_name: str = "model-{i:05d}-of-{n:05d}.safetensors"
    remote_code: tuple[str, ...] = ("configuration_deepseek.py", "modeling_deepseek.py")
    tiktoken: bool = False  # a tiktoken.model vocabulary next to the HF tokenizer files
    layout: str = DEEPSEEK  # DEEPSEEK, or a member's Member.demo_layout name
    int4_group: int = 32  # weights "int4": the routed experts pack-quantized, symmetric, this group size
    vision: bool = False  # a BF16 vision part (the layout's vision_tensors), copied
    quant_in_text_config: bool = False  # a nested config: quantization_config only inside text_config
    quant_ignore: tuple[
        str, ...
    ] = ()  # a compressed-tensors config's ignore list; () for INT4: every linear but the experts
    indexer_types: tuple[str, ...] = ()  # IndexShare: per decoder layer, "full" or "shared"
    index_topk_freq: int = 0  # > 0: index_topk_freq / index_skip_topk_offset, with indexer_types
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
        """The tiny checkpoint of a demo member (family.demo_members()); `kw` overrides."""
        if member not in members.demo_members():
            raise ValueError(f"unknown family member {member!r}; expected one of {', '.join(members.demo_members())}")
        return cls(**(members.demo_spec_fields(member) | kw))

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
        if self.topk_method != "noaux_tc":  # a softmax router
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
        if self.mtp_key:
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
        IndexShare also each layer's `self_attn.indexers_proj`, which names no tensor (as the real one)."""
        names = [module_of(n) for n, kind, _ in self.tensors() if kind == "bf16-linear"]
        if self.indexer_types:
            names += [f"model.layers.{i}.self_attn.indexers_proj" for i in range(self.num_hidden_layers)]
        return sorted(set(names))

    def compressed_tensors_config(self) -> dict:
        """The source's compressed-tensors quantization_config: FP8_BLOCK, or pack-quantized INT4
        (one group, targets Linear; the ignore list keeps every linear but the routed experts)."""
        if self.weights == CT_FP8_BLOCK:
            ignore = list(self.quant_ignore)
            fp8 = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False}
            group = {
                "format": "float-quantized", "targets": ["Linear"], "output_activations": None,
                "input_activations": fp8 | {"dynamic": True, "group_size": 128, "strategy": "group"},
                "weights": fp8 | {"block_structure": list(self.block), "strategy": "block"},
            }  # fmt: skip
            return {"config_groups": {"FP8_BLOCK": group}, "format": "float-quantized", "ignore": ignore,
                    "quant_method": "compressed-tensors", "quantization_status": "compressed"}  # fmt: skip
        ignore = list(self.quant_ignore) or [
            "lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
        ]  # fmt: skip
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
        if family.linear_kind(module, self.architecture) != family.FP8_LINEAR:  # a member's kept_16bit
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
        layout = members.demo_layout(self.layout)
        if layout is not None and layout.edit_tensors is not None:
            out = layout.edit_tensors(self, out)
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
        """The MTP layer's own modules (some reuse the main model's embeddings and head)."""
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


# The tiny checkpoint of each demo member, by name: the default layout with the fields its member
# module declares (Member.demos).
FAMILY: dict[str, CheckpointSpec] = {
    name: CheckpointSpec(**members.demo_spec_fields(name)) for name in members.demo_members()
}
