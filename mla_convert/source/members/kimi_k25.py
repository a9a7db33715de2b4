"""Kimi-K2.5 and K2.6 (KimiK25ForConditionalGeneration): a wrapper whose text model, a Kimi-K2-Thinking
DeepseekV3, sits in config.json's text_config and names its tensors behind `language_model.`, next
to a BF16 vision tower and projector (copied). K2.6 keeps its quantization_config in text_config only."""

from mla_convert.constants import CONFIG_NAME
from mla_convert.source.members.member import DemoLayout, Member, SupportedCheckpoint
from mla_convert.source.naming import PrefixedNames

_ARCH = "KimiK25ForConditionalGeneration"
_LAYOUT = "kimi-k25"  # the demo's CheckpointSpec.layout


def _demo_config_file(spec, cfg: dict) -> tuple[str, dict]:
    """The wrapper's config.json around the text model's (K2.6: quantization_config only there)."""
    quant = cfg.pop("quantization_config", None)
    text = {k: v for k, v in cfg.items() if k != "auto_map"}
    wrapper = {
        "architectures": [_ARCH], "model_type": "kimi_k25",
        "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config",
                     "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration"},
        "text_config": text, "torch_dtype": "bfloat16", "media_placeholder_token_id": 3,
        "vision_config": {"patch_size": 14, "init_pos_emb_height": 16, "init_pos_emb_width": 16,
                          "hidden_size": 64, "mm_hidden_size": 64, "text_hidden_size": spec.hidden_size},
    }  # fmt: skip
    if quant is not None:
        (text if spec.quant_in_text_config else wrapper)["quantization_config"] = quant
    return CONFIG_NAME, dict(sorted(wrapper.items()))


def _demo_vision_tensors(spec) -> list[tuple[str, str, tuple[int, ...]]]:
    """A small BF16 vision tower and projector: 2-D linears, a conv patch embedding, norms."""
    d, h, v = 64, spec.hidden_size, "vision_tower.encoder.blocks.0."
    return [
        ("vision_tower.patch_embed.proj.weight", "bf16", (d, 3, 14, 14)),
        ("vision_tower.patch_embed.pos_emb.weight", "bf16", (16, 16, d)),
        (v + "norm0.weight", "norm", (d,)), (v + "wqkv.weight", "bf16", (3 * d, d)),
        (v + "wo.weight", "bf16", (d, d)), (v + "mlp.fc0.weight", "bf16", (2 * d, d)),
        ("mm_projector.pre_norm.weight", "norm", (d,)), ("mm_projector.proj.0.weight", "bf16", (h, 4 * d)),
        ("mm_projector.proj.2.weight", "bf16", (h, h)),
    ]  # fmt: skip


_DEMO = dict(
    model_type="kimi_k2", layout=_LAYOUT, weights="int4", num_attention_heads=2, n_routed_experts=12,
    num_nextn_predict_layers=0, n_group=1, topk_group=1, vision=True, shard_name="model-{i:05d}-of-{n:06d}.safetensors",
    remote_code=("configuration_kimi_k25.py", "modeling_kimi_k25.py", "tokenization_kimi.py"), tiktoken=True,
)  # fmt: skip

MEMBER = Member(
    name="kimi-k2.5",
    rank=6,
    architecture=_ARCH,
    text_architecture="DeepseekV3ForCausalLM",
    names=PrefixedNames(),
    short="Kimi-K2.5/K2.6",
    help_who="Kimi-K2.5, Kimi-K2.6 (kimi_k25, the text model in text_config)",
    help_what="As Kimi-K2-Thinking behind language_model.; vision_tower and mm_projector copied; the config keeps "
    "its nesting and the quantization_config where the source had it",
    supported=(
        SupportedCheckpoint(
            "Kimi-K2.5, K2.6",
            "`KimiK25ForConditionalGeneration` (`kimi_k25`, nested `text_config`)",
            "as K2-Thinking, text tensors under `language_model.`",
            "as K2-Thinking; `vision_tower.*` and `mm_projector.*` copied; the config keeps its nesting",
            ("kimi-k2.5", "kimi-k2.6"),
        ),
    ),
    # 64 shards at full size.
    demos={
        "kimi-k2.5": _DEMO,
        "kimi-k2.6": _DEMO
        | dict(
            quant_in_text_config=True,
            quant_ignore=(
                "re:.*self_attn.*",
                "re:.*shared_experts.*",
                "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
                "re:.*lm_head.*",
                "re:vision_tower.*",
                "re:mm_projector.*",
            ),
        ),
    },
    demo_layout=DemoLayout(
        _LAYOUT,
        native_name=lambda spec, name: "language_model." + name,
        config_file=_demo_config_file,
        vision_tensors=_demo_vision_tensors,
    ),
)
