"""DeepSeek-V3.2 and V3.2-Exp (DeepseekV32ForCausalLM): V3 plus the lightning indexer on every layer."""

from mla_convert.source.members.member import Member, SupportedCheckpoint

MEMBER = Member(
    name="deepseek-v3.2",
    rank=3,
    architecture="DeepseekV32ForCausalLM",
    short="DeepSeek-V3.2",
    help_who="DeepSeek-V3.2, V3.2-Exp (deepseek_v32)",
    help_what="As DeepseekV3, plus the lightning indexer: wq_b / wk converted, weights_proj and k_norm copied; "
    "F32 norms stay F32",
    indexer=True,
    supported=(
        SupportedCheckpoint(
            "DeepSeek-V3.2(-Exp)",
            "`DeepseekV32ForCausalLM`",
            "block FP8",
            "as V3, plus the indexer: `wq_b` / `wk` converted, `weights_proj` and `k_norm` copied; F32 norms stay F32",
            ("deepseek-v3.2",),
        ),
    ),
    demos={
        "deepseek-v3.2": dict(
            architecture="DeepseekV32ForCausalLM",
            model_type="deepseek_v32",
            scale_fmt="ue8m0",
            norm_dtype="f32",
            index_n_heads=4,
        ),
    },
)
