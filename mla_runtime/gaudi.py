"""The hook on vllm-gaudi: `HPUMLAAttention.process_weights_after_loading` in
vllm_gaudi/attention/oot_mla.py (absorbed.py says what the wrapper does).

vllm-gaudi registers its own MLA layer class, and the out-of-tree registry takes one class per
name, so the plugin wraps that class's method. The method dequantizes an FP8 kv_b_proj with
`weight_scale_inv` itself (plain, contiguous W_UK_T / W_UV attributes) and hands every other
kv_b_proj (bf16, compressed-tensors) to upstream MLAAttention's method, then re-registers
contiguous copies; the wrapper here acts once that is all done (upstream's wrapper, called inside,
leaves the layer to it). A vllm-gaudi without the class or the method gets one warning naming its
version and vLLM's, and computes the weights itself.
"""

from __future__ import annotations

import logging

from . import absorbed, versions
from .vllm_names import GAUDI_CLASS as CLASS
from .vllm_names import HOOKED_METHOD


def hook(module) -> bool:
    """Wrap `module.HPUMLAAttention.process_weights_after_loading`; False (with one warning) when the
    hook point is missing, or when it is wrapped already."""
    cls = getattr(module, CLASS, None)
    gaudi = versions.vllm_gaudi_version()
    if not isinstance(cls, type) or not callable(getattr(cls, HOOKED_METHOD, None)):
        absorbed.say_once(
            f"hook:{module.__name__}", logging.WARNING,
            "mla_runtime: %s has no %s.process_weights_after_loading in vllm-gaudi %s with %s (tested: %s); "
            "vllm-gaudi computes W_UK_T/W_UV itself and the artifacts are not used",
            module.__name__, CLASS, gaudi, versions.describe_vllm(), versions.TESTED_TEXT,
        )  # fmt: skip
        return False
    if not versions.vllm_gaudi_is_tested(gaudi):
        absorbed.say_once(
            "version:vllm-gaudi", logging.INFO,
            "mla_runtime: vllm-gaudi %s is not one this plugin was tested with (%s); it takes W_UK_T/W_UV "
            "from the artifacts after %s.process_weights_after_loading, as there",
            gaudi, versions.TESTED_TEXT, CLASS,
        )  # fmt: skip
    return absorbed.wrap(cls)
