"""Stand-in for the parts of vllm 0.34.0 that load an MLA layer's weights (tests only; see
../README.md). Follows the PyPI wheel vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl
(sha256 79ca4b3cd74aec08c4bf476bdf0cb15735b605ae5368526a2faae1e30f044ca2; `vllm/_version.py`:
0.34.0, commit g62d4bc3c7), file for file:

- `utils.py`: vllm/model_executor/utils.py: `replace_parameter` (the kept parameter object, a
  tensor of another layout copied into the parameter's own storage where it fits:
  `_in_own_storage`, `storage_view`, `_extent`), `weights_already_processed` /
  `is_weights_pre_processed`;
- `mla_attention.py`: vllm/model_executor/layers/attention/mla_attention.py: `split_kv_b_proj`,
  what `MLAAttention.__init__` adds for loading (`act_dtype` from the default dtype, `W_UV_dcp`,
  the DCP manager of vllm/v1/attention/ops/dcp.py with its A2A `v_up_proj_combine`), and
  `MLAAttention.process_weights_after_loading(self)` (no argument);
- `weight_utils.py`: vllm/model_executor/model_loader/weight_utils.py, `finalize_model_weights`;
- `loader_utils.py`: vllm/model_executor/model_loader/utils.py, `process_weights_after_loading`
  (quant methods first, then `finalize_model_weights`; the checkpoint layout recorded under direct
  reload) and `initialize_model`'s `record_metadata_for_reloading`;
- `reload.py`: vllm/model_executor/model_loader/reload/ (layerwise.py, meta.py, direct.py,
  lifecycle.py, inplace.py): the layerwise reload (the default), the direct reload
  (`VLLM_RELOAD_MODE=direct`) and the kernel-format reload (`is_checkpoint_format=False`);
- `mla.py`: vllm/model_executor/layers/mla.py, what `MultiHeadLatentAttentionWrapper.__init__`
  builds (the MLAAttention at `{prefix}.attn` over the caller's kv_b_proj);
- `mistral_large4.py`: Mistral-Large-4's MLA layers (transformers_utils/configs/mistral.py's
  reading of the `nope` pattern and `kv_sharing`; models/mistral/common/layer_spec.py;
  models/mistral/nvidia/attention.py's `_MistralMLA` and `MistralMLAAttention.__init__`: per-layer
  qk_nope_head_dim, KV-sharing layers with their own kv_b_proj, kv_b_proj unquantized;
  models/mistral/mistral_large4/nvidia/model.py's `MistralLarge4ForCausalLM` and `_load_weights`);
- `kimi_k3.py`: of vllm/models/kimi_k3/nvidia/ (dsa.py, model.py, specialized_decode/), the
  Kimi-K3.1 DSA layer's weight path: `KimiK3DSAAttention` (kv_b_proj under the model's quant
  config, the wrapper), the model's `process_weights_after_loading` and what the specialized
  decode keeps of W_UK_T / W_UV (references to the layer's tensors; under DCP a gathered copy of
  W_UV).

What did not change from 0.32.0 (the attention-layer helpers, `get_and_maybe_dequant_weights`,
the quant and linear classes) comes from ../vllm_upstream.py. Left out: the ROCm aiter branches,
DCP with ranks of different heads (the stand-in's DCP group gathers this rank's tensor once per
rank: it runs one rank), the reload's online quantization, torchao and the tied-parameter cases.
"""
