"""mla_runtime: read precomputed MLA weights (W_UK_T / W_UV) written by mla-convert.

Depends on torch and safetensors only; the vLLM plugin lives in mla_runtime.plugin.
"""

from .artifacts import MlaArtifacts, head_range, open_artifacts  # noqa: F401
from .format import ArtifactError, MlaDims, MlaManifest, read_manifest  # noqa: F401
from .layout import split_kv_b_proj  # noqa: F401
