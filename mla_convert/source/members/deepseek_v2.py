"""DeepSeek-V2, V2.5 and V2-Lite (DeepseekV2ForCausalLM): BF16, softmax routing, no MTP layer."""

from mla_convert.source.members.member import Member, SupportedCheckpoint

MEMBER = Member(
    name="deepseek-v2",
    rank=5,
    architecture="DeepseekV2ForCausalLM",
    short="DeepSeek-V2",
    help_who="DeepSeek-V2, V2.5, V2-Lite (deepseek_v2)",
    help_what="BF16 source: channel FP8 quantizes the linears per row, bf16 copies them; without q_lora, q_proj",
    supported=(
        SupportedCheckpoint(
            "DeepSeek-V2-Lite, V2, V2.5",
            "`DeepseekV2ForCausalLM`",
            "BF16",
            "channel FP8 quantizes the linears per row; bf16 copies; without `q_lora_rank`, `q_proj`",
            ("deepseek-v2-lite",),
        ),
    ),
    demos={
        "deepseek-v2-lite": dict(
            architecture="DeepseekV2ForCausalLM",
            model_type="deepseek_v2",
            weights="bf16",
            num_attention_heads=16,
            q_lora_rank=None,
            num_nextn_predict_layers=0,
            topk_method="greedy",
            n_group=1,
            topk_group=1,
            auto_map=(
                ("AutoConfig", "configuration_deepseek.DeepseekV2Config"),
                ("AutoModelForCausalLM", "modeling_deepseek.DeepseekV2ForCausalLM"),
            ),
            mtp_key=False,
        ),
    },
)
