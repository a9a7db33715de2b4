"""The hook on upstream vLLM: `MLAAttention.process_weights_after_loading` in
vllm/model_executor/layers/attention/mla_attention.py (absorbed.py says what the wrapper does).

That method is the hook point in every vLLM the plugin was tested with (versions.py): it calls the
module-level `split_kv_b_proj` in 0.32, 0.33 and 0.34, and a processing policy
(model_loader/reload/mla.py) after the 2fdb4ed refactor; either way it ends with W_UK_T / W_UV
stored on the layer, which is all the wrapper relies on. From 0.34 it takes no argument (it reads
`self.act_dtype`) and `finalize_model_weights` calls it, children first, so a parent module's hook
(a model's own hook, a specialized decode built later) derives from what the wrapper placed; the
wrapper passes whatever arguments it gets. Subclasses that do not override it (a model's own
MLAAttention subclass, the MLAAttention that `MultiHeadLatentAttentionWrapper` builds) run the
wrapped method; a model's MLA module that is no MLAAttention is not hooked (absorbed.py names it
once). A vLLM whose module lacks the class or the method gets one warning naming its version, and
computes the weights itself.
"""

from __future__ import annotations

import logging

from . import absorbed, versions
from .vllm_names import HOOKED_METHOD
from .vllm_names import UPSTREAM_CLASS as CLASS


def hook(module) -> bool:
    """Wrap `module.MLAAttention.process_weights_after_loading`; False (with one warning) when the
    hook point is missing, or when it is wrapped already."""
    cls = getattr(module, CLASS, None)
    if not isinstance(cls, type) or not callable(getattr(cls, HOOKED_METHOD, None)):
        absorbed.say_once(
            f"hook:{module.__name__}", logging.WARNING,
            "mla_runtime: %s has no %s.process_weights_after_loading in %s (tested: %s); vLLM computes "
            "W_UK_T/W_UV itself and the artifacts are not used",
            module.__name__, CLASS, versions.describe_vllm(), versions.TESTED_TEXT,
        )  # fmt: skip
        return False
    version, commit = versions.vllm_version()
    if not versions.vllm_is_tested(version, commit):
        absorbed.say_once(
            "version:vllm", logging.INFO,
            "mla_runtime: %s is not one this plugin was tested with (%s); it takes W_UK_T/W_UV from the "
            "artifacts after %s.process_weights_after_loading, as there",
            versions.describe_vllm(), versions.TESTED_TEXT, CLASS,
        )  # fmt: skip
    return absorbed.wrap(cls)
