"""mla-convert: convert MLA checkpoints (DeepSeek-V3/R1 and family) for vLLM on Intel Gaudi, with
precomputed W_UK_T / W_UV. The public API (docs/api.md):

    mla_convert.convert(source, out_dir, *, options=None, settings=None, **fields) -> ConversionResult
    mla_convert.verify(out_dir, *, source=None, workers=1) -> VerifyReport
    mla_convert.upload(out_dir, repo_id, *, options=None, progress_factory=None, **fields) -> UploadResult
    mla_convert.card(out_dir, *, base_model=None, repo_id=None) -> CardResult

Importing it imports no torch; the first call does.
"""

from mla_convert.api import card, convert, upload, verify
from mla_convert.errors import ConvertError, OutputError, SourceError, UploadError, VerificationError
from mla_convert.results import (
    CardResult,
    CheckGroup,
    ConversionResult,
    Failure,
    TensorStats,
    UploadResult,
    VerifyReport,
)
from mla_convert.settings import Options, RunSettings, UploadOptions
from mla_convert.version import __version__

__all__ = [
    "CardResult",
    "CheckGroup",
    "ConversionResult",
    "ConvertError",
    "Failure",
    "Options",
    "OutputError",
    "RunSettings",
    "SourceError",
    "TensorStats",
    "UploadError",
    "UploadOptions",
    "UploadResult",
    "VerificationError",
    "VerifyReport",
    "__version__",
    "card",
    "convert",
    "upload",
    "verify",
]
