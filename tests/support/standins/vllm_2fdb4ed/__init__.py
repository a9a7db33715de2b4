"""Stand-in for the parts of vLLM at commit 2fdb4edea59b0575558313e07149c26885662438 (vllm-project/vllm,
after the MLA processing-policy refactor) that load an MLA layer's weights (tests only; see
../README.md). Read from the public repository at that commit, file for file:

- `mla_attention.py`: vllm/model_executor/layers/attention/mla_attention.py,
  `MLAAttention.process_weights_after_loading` and `MLAAttention.create_reload_state` (there is no
  `split_kv_b_proj` any more);
- `reload_mla.py`: vllm/model_executor/model_loader/reload/mla.py, whole: the processing policies
  (`CommonMLAProcessingPolicy`, `AiterMLAProcessingPolicy`, `AMXMLAProcessingPolicy`),
  `get_mla_processing_policy` and `MLAReloadPolicy` (trace-mode reload);
- `utils.py`: vllm/model_executor/utils.py, `replace_parameter`. The repository holds no copy of
  that file at 2fdb4ed; `reload/mla.py` calls it with `prefer_copy=True`, and the stored version
  that has the keyword (commit not shown by the index) reads as 0.32.0's, so this is 0.32.0's;
- `reload_trace.py`: of vllm/model_executor/model_loader/reload/trace.py, only `ReloadError` and
  what `MLAReloadPolicy` calls (`ReloadState.bind_target` / `targets` / `copy_`, `ReloadTarget`),
  from the stored version at commit 0f6c0f5a2fed5c3bbaa3d3958484e5dd12ef33a1 (none is stored at
  2fdb4ed).

What did not change from 0.32.0 (`MLAAttention.__init__`, `get_and_maybe_dequant_weights`, the
attention-layer helpers, the quant and linear classes) comes from ../vllm_upstream.py. Whether
2fdb4ed is on vLLM's main branch after 0.33.0 could not be confirmed; it is the commit read.
"""
