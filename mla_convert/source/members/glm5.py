"""GLM-5, 5.1, 5.2, 5.3 (GlmMoeDsaForCausalLM): V3.2's indexer at GLM's own dims, BF16
modules_to_not_convert, an MTP layer without its own head; 5.2's IndexShare (indexer_types)."""

from mla_convert.source.members.member import Member, NonMember, SupportedCheckpoint

_ARCH = "GlmMoeDsaForCausalLM"
_DEMO = dict(
    architecture=_ARCH, model_type="glm_moe_dsa", auto_map=(), remote_code=(), q_lora_rank=2048,
    qk_nope_head_dim=192, v_head_dim=256, index_n_heads=4, mtp_own_head=False,
    not_converted=(r"\.mlp\.shared_experts\.",),
)  # fmt: skip

MEMBER = Member(
    name="glm-5",
    rank=4,
    architecture=_ARCH,
    short="GLM-5",
    help_who="GLM-5, GLM-5.1, GLM-5.2, GLM-5.3 FP8 (glm_moe_dsa)",
    help_what="As DeepseekV32 with its own dims (qk_nope 192, v_head 256); modules_to_not_convert copied as BF16 "
    "and ignored; MTP layer without embed_tokens / shared_head.head; indexer_types (IndexShare) read",
    indexer=True,
    mtp_own_head=False,
    supported=(
        SupportedCheckpoint(
            "GLM-5, GLM-5.1 FP8",
            "`GlmMoeDsaForCausalLM`",
            "block FP8 + BF16 `modules_to_not_convert`",
            "as V3.2 at GLM's dims (nope 192, v 256); BF16 modules copied and ignored; MTP layer without its own head",
            ("glm-5",),
        ),
        SupportedCheckpoint(
            "GLM-5.2, GLM-5.3 (IndexShare)",
            "`GlmMoeDsaForCausalLM`",
            "as GLM-5",
            "as GLM-5; which layers hold an indexer is read from `indexer_types`, derived from `index_topk_freq` / "
            "`index_skip_topk_offset` only where that is absent, and a disagreement with the tensors is refused "
            "naming the layer",
            ("glm-5.2",),
        ),
    ),
    non_members=(
        NonMember(
            "GLM-5.3-Flash",
            ("Glm5NextForConditionalGeneration", "Glm5NextForCausalLM"),
            ("glm5_next",),
            "vllm-gaudi's MLA layer (HPUMLAAttention) does not serve it, and its layers are not DeepSeek-V3's",
        ),
    ),
    demos={
        "glm-5": _DEMO,
        # IndexShare: indexers on layers 0-2 and every 4th from 6 (0-2 at this size), the same
        # placement in index_topk_freq / index_skip_topk_offset; 141 shards at full size.
        "glm-5.2": _DEMO
        | dict(
            num_hidden_layers=5,
            indexer_types=("full", "full", "full", "shared", "shared"),
            index_topk_freq=4,
            index_skip_topk_offset=3,
        ),
    },
)
