"""Moonlight-16B-A3B: a BF16 DeepseekV3ForCausalLM without q LoRA (a single q_proj)."""

from mla_convert.source.members.member import Member, SupportedCheckpoint

MEMBER = Member(
    name="moonlight",
    rank=2,
    architecture="DeepseekV3ForCausalLM",
    short="Moonlight",
    help_who="Moonlight",
    supported=(
        SupportedCheckpoint(
            "Moonlight-16B-A3B, BF16 fine-tunes",
            "`DeepseekV3ForCausalLM`",
            "BF16",
            "channel FP8 quantizes the linears below per row; bf16 copies",
            ("moonlight",),
        ),
    ),
    demos={
        "moonlight": dict(
            weights="bf16",
            num_attention_heads=16,
            q_lora_rank=None,
            num_nextn_predict_layers=0,
            n_group=1,
            topk_group=1,
        ),
    },
)
