"""Stand-in for the parts of vllm 0.33.0 that load an MLA layer's weights and changed since 0.32.0
(tests only; see ../README.md). Follows the PyPI wheel vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl
(sha256 4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa, built from commit
4ba787ec9), file for file:

- `utils.py`: vllm/model_executor/utils.py, `replace_parameter` (no `prefer_copy`: it keeps the
  existing parameter object, copying in place when shape, stride, dtype and device match and
  rebinding `.data` otherwise);
- `mla_attention.py`: vllm/model_executor/layers/attention/mla_attention.py, `split_kv_b_proj`
  and `MLAAttention.process_weights_after_loading` (lines 1242-1366).

What did not change from 0.32.0 (the attention-layer helpers, `get_and_maybe_dequant_weights`,
the quant and linear classes, `MLAAttention.__init__`) comes from ../vllm_upstream.py.
"""
