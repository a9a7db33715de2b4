"""Kimi-K2 and Kimi-K2-Thinking: DeepseekV3ForCausalLM checkpoints (model_type kimi_k2) with every
layer's rotary inv_freq stored, and K2-Thinking's compressed-tensors pack-quantized INT4 experts."""

from mla_convert.source.members.member import Member, NonMember, SupportedCheckpoint

_NOT_SERVED = "vllm-gaudi's MLA layer (HPUMLAAttention) does not serve it, and its layers are not DeepSeek-V3's"
_KDA = "a hybrid of linear attention (KDA) and MLA layers; " + _NOT_SERVED
_REMOTE_CODE = ("configuration_deepseek.py", "modeling_deepseek.py", "tokenization_kimi.py")

MEMBER = Member(
    name="kimi-k2",
    rank=1,
    architecture="DeepseekV3ForCausalLM",
    short="Kimi-K2",
    help_who="Kimi-K2, Kimi-K2-Thinking (kimi_k2)",
    help_what="compressed-tensors pack-quantized INT4 experts (Kimi-K2-Thinking: copied for channel-fp8, "
    "dequantized for bf16); Kimi's rotary inv_freq copied",
    supported=(
        SupportedCheckpoint(
            "Kimi-K2-Instruct",
            "`DeepseekV3ForCausalLM` (`kimi_k2`)",
            "block FP8",
            "as V3; each layer's `rotary_emb.inv_freq` copied",
            ("kimi-k2",),
        ),
        SupportedCheckpoint(
            "Kimi-K2-Thinking",
            "`DeepseekV3ForCausalLM` (`kimi_k2`)",
            "compressed-tensors pack-quantized INT4 routed experts, the rest BF16",
            "channel FP8: the INT4 experts copied bit for bit, the BF16 linears DeepSeek's FP8 releases quantize "
            "become channel FP8, one config with both groups; bf16: the experts dequantized, `(nibble - 8) * scale` "
            "rounded once",
            ("kimi-k2-thinking",),
        ),
    ),
    non_members=(
        NonMember("Kimi-K3", ("KimiK3ForConditionalGeneration", "KimiK3ForCausalLM"), ("kimi_k3",), _KDA),
        NonMember("Kimi-Linear", ("KimiLinearForCausalLM",), ("kimi_linear",), _KDA),
    ),
    demos={
        "kimi-k2": dict(
            model_type="kimi_k2",
            num_attention_heads=2,
            n_routed_experts=12,
            num_nextn_predict_layers=0,
            inv_freq=56,
            shard_name="model-{i}-of-{n}.safetensors",
            remote_code=_REMOTE_CODE,
            tiktoken=True,
        ),
        # Pack-quantized INT4 routed experts (group 32), everything else BF16; 62 shards.
        "kimi-k2-thinking": dict(
            model_type="kimi_k2",
            weights="int4",
            num_attention_heads=2,
            n_routed_experts=12,
            num_nextn_predict_layers=0,
            n_group=1,
            topk_group=1,
            shard_name="model-{i:05d}-of-{n:06d}.safetensors",
            remote_code=_REMOTE_CODE,
            tiktoken=True,
        ),
    },
)
