"""DeepSeek-V3, R1 and V3.1 (DeepseekV3ForCausalLM): the member the family's rules are written for."""

from mla_convert.source.members.member import Member, NonMember, SupportedCheckpoint

_NO_KV_B = (
    "it has no kv_b_proj (one 512-wide latent serves as key and value), so there is no latent "
    "up-projection to precompute, and vllm-gaudi's MLA layer (HPUMLAAttention) does not serve it"
)

MEMBER = Member(
    name="deepseek-v3",
    rank=0,
    architecture="DeepseekV3ForCausalLM",
    short="DeepSeek-V3/R1/V3.1",
    help_who="DeepSeek-V3, R1, V3.1 (deepseek_v3), fine-tunes, any model_type",
    help_what="Block-FP8 (F32 or E8M0 scales, any block size) or BF16; MTP layer kept where present",
    supported=(
        SupportedCheckpoint(
            "DeepSeek-V3, R1, V3.1, FP8 fine-tunes",
            "`DeepseekV3ForCausalLM` (`deepseek_v3`, any)",
            "block FP8 (F32 or E8M0 scales, any block size)",
            "FP8 linears to channel FP8 or bf16; the rest copied; the MTP layer kept",
            ("deepseek-v3", "deepseek-v3.1"),
        ),
    ),
    non_members=(
        NonMember("DeepSeek-V4", ("DeepseekV4ForCausalLM",), ("deepseek_v4",), _NO_KV_B),
        NonMember("DeepSeek-V4.1", ("DeepseekV41ForCausalLM",), ("deepseek_v41", "deepseek_v4_1"), _NO_KV_B),
    ),
    # The default CheckpointSpec is DeepSeek-V3/R1's; V3.1 adds power-of-two (ue8m0) scales.
    demos={"deepseek-v3": {}, "deepseek-v3.1": {"scale_fmt": "ue8m0"}},
)
