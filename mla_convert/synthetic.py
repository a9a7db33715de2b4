"""Synthetic DeepSeek-V3/R1-shaped block-FP8 checkpoints: a tiny one for tests and the demo, and
one with a few layers at the true R1 dimensions for benchmarks.

Same tensor names, config, quantization_config, index and side files as DeepSeek's release;
several shards; one weight's scale deliberately in another shard; a 576-row kv_a_proj_with_mqa
(partial 128-blocks); dense first layers, routed and shared experts, and the MTP layer.
Tensors are generated and written one at a time, so big checkpoints stream.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from mla_runtime.format import CONFIG_NAME
from mla_runtime.safetensors_file import nbytes_of

from .checkpoint import INDEX_NAME
from .safetensors_io import ShardWriter

BLOCK = 128


@dataclass(frozen=True)
class CheckpointSpec:
    hidden_size: int = 256
    num_hidden_layers: int = 3
    first_k_dense_replace: int = 1
    num_nextn_predict_layers: int = 1
    num_attention_heads: int = 4
    q_lora_rank: int = 192
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

    def config(self) -> dict:
        cfg = {
            "architectures": ["DeepseekV3ForCausalLM"],
            "auto_map": {
                "AutoConfig": "configuration_deepseek.DeepseekV3Config",
                "AutoModel": "modeling_deepseek.DeepseekV3Model",
                "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
            },
            "model_type": "deepseek_v3",
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
            "topk_method": "noaux_tc",
            "torch_dtype": "bfloat16",
            "use_cache": True,
            "quantization_config": {
                "activation_scheme": "dynamic",
                "fmt": "e4m3",
                "quant_method": "fp8",
                "weight_block_size": [BLOCK, BLOCK],
            },
        }
        for k in (
            "hidden_size", "num_hidden_layers", "first_k_dense_replace", "num_nextn_predict_layers",
            "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
            "v_head_dim", "intermediate_size", "moe_intermediate_size", "n_routed_experts",
            "n_shared_experts", "num_experts_per_tok", "n_group", "topk_group", "vocab_size",
        ):  # fmt: skip
            cfg[k] = getattr(self, k)
        return dict(sorted(cfg.items()))

    def tensors(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """(name, kind, shape) in DeepSeek's order; kind: fp8 | bf16 | norm | f32."""
        h, n = self.hidden_size, self.num_attention_heads
        out: list[tuple[str, str, tuple[int, ...]]] = [("model.embed_tokens.weight", "bf16", (self.vocab_size, h))]
        for i in range(self.num_hidden_layers + self.num_nextn_predict_layers):
            p = f"model.layers.{i}."
            if i >= self.num_hidden_layers:  # the MTP layer's own modules
                out += [
                    (p + "embed_tokens.weight", "bf16", (self.vocab_size, h)),
                    (p + "enorm.weight", "norm", (h,)),
                    (p + "hnorm.weight", "norm", (h,)),
                    (p + "eh_proj.weight", "bf16", (h, 2 * h)),
                    (p + "shared_head.norm.weight", "norm", (h,)),
                    (p + "shared_head.head.weight", "bf16", (self.vocab_size, h)),
                ]
            out += [(p + "input_layernorm.weight", "norm", (h,)), (p + "post_attention_layernorm.weight", "norm", (h,))]
            a = p + "self_attn."
            out += [
                (a + "q_a_proj.weight", "fp8", (self.q_lora_rank, h)),
                (a + "q_a_layernorm.weight", "norm", (self.q_lora_rank,)),
                (a + "q_b_proj.weight", "fp8", (n * (self.qk_nope_head_dim + self.qk_rope_head_dim), self.q_lora_rank)),
                (a + "kv_a_proj_with_mqa.weight", "fp8", (self.kv_lora_rank + self.qk_rope_head_dim, h)),
                (a + "kv_a_layernorm.weight", "norm", (self.kv_lora_rank,)),
                (a + "kv_b_proj.weight", "fp8", (n * (self.qk_nope_head_dim + self.v_head_dim), self.kv_lora_rank)),
                (a + "o_proj.weight", "fp8", (h, n * self.v_head_dim)),
            ]
            if i < self.first_k_dense_replace:
                out += _mlp(p + "mlp.", h, self.intermediate_size)
            else:
                out += [
                    (p + "mlp.gate.weight", "bf16", (self.n_routed_experts, h)),
                    (p + "mlp.gate.e_score_correction_bias", "f32", (self.n_routed_experts,)),
                ]
                for e in range(self.n_routed_experts):
                    out += _mlp(f"{p}mlp.experts.{e}.", h, self.moe_intermediate_size)
                out += _mlp(p + "mlp.shared_experts.", h, self.moe_intermediate_size * self.n_shared_experts)
        out += [("model.norm.weight", "norm", (h,)), ("lm_head.weight", "bf16", (self.vocab_size, h))]
        # Every FP8 weight carries its block scale right after it, as in DeepSeek's shards.
        full = []
        for name, kind, shape in out:
            full.append((name, kind, shape))
            if kind == "fp8":
                full.append((name + "_scale_inv", "scale", (math.ceil(shape[0] / BLOCK), math.ceil(shape[1] / BLOCK))))
        return full


def _mlp(p: str, h: int, inter: int) -> list[tuple[str, str, tuple[int, ...]]]:
    return [
        (p + "gate_proj.weight", "fp8", (inter, h)),
        (p + "up_proj.weight", "fp8", (inter, h)),
        (p + "down_proj.weight", "fp8", (h, inter)),
    ]


_ST_DTYPE = {"fp8": "F8_E4M3", "bf16": "BF16", "norm": "BF16", "f32": "F32", "scale": "F32"}


def quantize_block_fp8(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [N, K] -> (e4m3 [N, K], fp32 scale grid): DeepSeek's block quantization."""
    n, k = w.shape
    gn, gk = math.ceil(n / block), math.ceil(k / block)
    padded = torch.nn.functional.pad(w, (0, gk * block - k, 0, gn * block - n))
    blocks = padded.view(gn, block, gk, block)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    q = (blocks / scale.view(gn, 1, gk, 1)).clamp(-448, 448).view(gn * block, gk * block)[:n, :k]
    return q.contiguous().to(torch.float8_e4m3fn), scale.float().contiguous()


class _Generator:
    """Deterministic tensor values; an FP8 weight and its scale are generated together and each
    handed out once, whichever shard asks first."""

    def __init__(self, spec: CheckpointSpec, shapes: dict[str, tuple[int, ...]]):
        self.gen = torch.Generator().manual_seed(spec.seed)
        self.shapes = shapes
        self.pairs: dict[str, list] = {}

    def make(self, name: str, kind: str, shape: tuple[int, ...]) -> torch.Tensor:
        if kind == "fp8":
            return self._pair_part(name, 0)
        if kind == "scale":
            return self._pair_part(name[: -len("_scale_inv")], 1)
        if kind == "norm":
            return (1.0 + 0.05 * torch.randn(shape, generator=self.gen)).to(torch.bfloat16)
        if kind == "f32":
            return 0.01 * torch.randn(shape, generator=self.gen)
        return (0.02 * torch.randn(shape, generator=self.gen)).to(torch.bfloat16)

    def _pair_part(self, wname: str, which: int) -> torch.Tensor:
        entry = self.pairs.get(wname)
        if entry is None:
            entry = self.pairs[wname] = list(self._fp8_pair(wname))
        part, entry[which] = entry[which], None
        if all(x is None for x in entry):
            del self.pairs[wname]
        return part

    def _fp8_pair(self, wname: str) -> tuple[torch.Tensor, torch.Tensor]:
        shape = self.shapes[wname]
        w = torch.randn(shape, generator=self.gen) / math.sqrt(shape[1])
        if wname.endswith("experts.0.down_proj.weight"):
            w[0].zero_()  # an all-zero output row: channel scales must stay finite
        return quantize_block_fp8(w)


def write_checkpoint(out_dir: str | Path, spec: CheckpointSpec = CheckpointSpec()) -> Path:
    """Write a block-FP8 DeepSeek-shaped checkpoint to `out_dir` (created; must be empty or absent)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = spec.tensors()
    shard_of = _assign_shards(tensors, spec)
    gen = _Generator(spec, {n: s for n, _, s in tensors})
    names = [f"model-{i + 1:05d}-of-{spec.num_shards:05d}.safetensors" for i in range(spec.num_shards)]
    by_shard: list[list[tuple[str, str, tuple[int, ...]]]] = [[] for _ in names]
    for t in tensors:
        by_shard[shard_of[t[0]]].append(t)
    total = 0
    for fname, items in zip(names, by_shard, strict=True):
        specs = {n: (_ST_DTYPE[k], s) for n, k, s in items}
        with ShardWriter(out_dir / fname, specs) as w:
            for n, k, s in items:
                w.write(n, gen.make(n, k, s))
            w.commit()
        total += sum(nbytes_of(_ST_DTYPE[k], s) for _, k, s in items)
    weight_map = {n: names[shard_of[n]] for n, _, _ in tensors}
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    (out_dir / CONFIG_NAME).write_text(json.dumps(spec.config(), indent=2) + "\n")
    _write_side_files(out_dir, spec)
    return out_dir


def _assign_shards(tensors, spec: CheckpointSpec) -> dict[str, int]:
    """Contiguous runs of roughly equal bytes; then move one scale into the next shard."""
    sizes = [nbytes_of(_ST_DTYPE[k], s) for _, k, s in tensors]
    per = sum(sizes) / spec.num_shards
    shard_of, acc = {}, 0
    for (name, _, _), size in zip(tensors, sizes, strict=True):
        shard_of[name] = min(int(acc // per), spec.num_shards - 1)
        acc += size
    w = spec.split_scale_of
    if w and w in shard_of and spec.num_shards > 1:
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
    for fname in ("configuration_deepseek.py", "modeling_deepseek.py"):
        (out_dir / fname).write_text(
            f'"""{fname}: placeholder for DeepSeek\'s remote-code file in this synthetic checkpoint.\n\n'
            'mla-convert copies such files unchanged and never imports or runs them."""\n'
        )
    (out_dir / "README.md").write_text("Synthetic DeepSeek-V3-shaped block-FP8 checkpoint written by mla-convert.\n")
    (out_dir / "figures").mkdir(exist_ok=True)
    (out_dir / "figures" / "notes.txt").write_text("A side file in a subfolder: copied with its path.\n")
