"""Every choice list, dtype name and file name of mla-convert, in one module without torch (the
output formats and targets, `--format` and `--target`, are mla_convert.formats').

The command line reads its choices from here for `--help` (torch is not imported yet), and every
module that checks or writes one of these values takes it from here. What the runtime reads as
well (the MLA directory, the conversion manifest's name, config.json) is owned by
`mla_runtime.format` and named here too.
"""

from __future__ import annotations

from mla_runtime.format import CONFIG_NAME, CONVERT_MANIFEST_NAME, MLA_DIR_NAME
from mla_runtime.format import MANIFEST_NAME as MLA_MANIFEST_NAME
from mla_runtime.model_configs import PARAMS_CONFIG_NAME as _PARAMS_JSON_NAME

TOOL_NAME = "mla-convert"  # the producer named in both manifests

# --- how a conversion runs (RunSettings) --------------------------------------------------------

KERNELS_AUTO = "auto"
KERNEL_MODES = (KERNELS_AUTO, "native", "compile", "eager")
WRITE_AUTO, WRITE_DIRECT, WRITE_BUFFERED = "auto", "direct", "buffered"
WRITE_MODES = (WRITE_AUTO, WRITE_DIRECT, WRITE_BUFFERED)

# --- safetensors dtype names --------------------------------------------------------------------

FP8_E4M3 = "F8_E4M3"
FLOAT_WEIGHT_DTYPES = ("BF16", "F16", "F32")  # 16- and 32-bit float tensors: copied as they are, or quantized
BLOCK_SCALE_DTYPES = ("F32", "F8_E8M0")  # float32, or float8_e8m0fnu: 2^(v - 127), 0xFF is NaN
FLOAT_DTYPES = (FP8_E4M3, "F8_E5M2", "BF16", "F16", "F32", "F64")  # tensors whose values verify checks
# compressed-tensors FP8_BLOCK: a BF16 (or F32) multiplier per block, as DeepSeek's F32 one
CT_BLOCK_SCALE_DTYPES = ("BF16", "F32")
INT4_PACKED_DTYPE = "I32"  # pack-quantized INT4: eight 4-bit values per int32 (weight_packed, weight_zero_point)
INT4_SHAPE_DTYPES = ("I32", "I64")  # weight_shape: [N, K] (I32 or I64, by writer)

# --- the source checkpoint ----------------------------------------------------------------------

INDEX_NAME = "model.safetensors.index.json"
SINGLE_FILE_NAME = "model.safetensors"
BLOCK_SCALE_SUFFIX = ".weight_scale_inv"
CHANNEL_SCALE_SUFFIX = ".weight_scale"
# A member's own layout (source/members/): params.json instead of config.json, consolidated shards
PARAMS_JSON_NAME = _PARAMS_JSON_NAME
CONSOLIDATED_INDEX_NAME = "consolidated.safetensors.index.json"
CONSOLIDATED_SINGLE_FILE_NAME = "consolidated.safetensors"
CONSOLIDATED_SHARD_PREFIX = "consolidated"
# compressed-tensors pack-quantized INT4: a module's tensor suffixes
INT4_PACKED, INT4_SCALE, INT4_SHAPE, INT4_ZERO_POINT = (
    "weight_packed",
    "weight_scale",
    "weight_shape",
    "weight_zero_point",
)

# --- files under --out --------------------------------------------------------------------------

MANIFEST_NAME = CONVERT_MANIFEST_NAME  # the conversion manifest: options, fingerprint, every file's sha256
JOURNAL_NAME = ".mla-convert-journal.jsonl"  # finished shard jobs of a run in progress (--resume)
PARTIAL_SUFFIX = ".partial"  # an output file is written as .NAME.partial and renamed when complete
STAGING_DIR_NAME = ".mla-convert-source"  # --stream downloads live here, inside --out
PROBE_NAME = ".mla-convert-write-probe"  # --write-io's test file, removed at once
LOCK_NAME = ".mla-convert.lock"  # one command at a time per --out (output.lock); removed by its holder
DEMO_MARKER_NAME = ".mla-convert-demo.json"  # the demo's record of the files it wrote

# The conversion manifest's status: 'incomplete' from before the first output file until the last.
COMPLETE, INCOMPLETE = "complete", "incomplete"

# --- the model card and the upload to the Hub ---------------------------------------------------

CARD_NAME = "README.md"  # the output's model card (with --no-card: the source's README, unchanged)
CARD_METADATA_KEY = "mla_convert"  # the card's own metadata entry: tool version, format, source, fingerprint
GITATTRIBUTES_NAME = ".gitattributes"  # the Hub's own file in a new repo: never uploaded, never deleted
# The name prefix of threads an interrupted command does not wait for (cli.startup.still_working):
# verify's file readers, a --stream download, an upload's transfer. Their memory is their own and
# nothing they do is left to finalize.
LEFT_RUNNING_THREAD_PREFIX = "mla-convert left running: "

__all__ = [
    "BLOCK_SCALE_DTYPES",
    "BLOCK_SCALE_SUFFIX",
    "CARD_METADATA_KEY",
    "CARD_NAME",
    "CHANNEL_SCALE_SUFFIX",
    "COMPLETE",
    "CONFIG_NAME",
    "CONSOLIDATED_INDEX_NAME",
    "CONSOLIDATED_SHARD_PREFIX",
    "CONSOLIDATED_SINGLE_FILE_NAME",
    "CT_BLOCK_SCALE_DTYPES",
    "DEMO_MARKER_NAME",
    "FLOAT_DTYPES",
    "FLOAT_WEIGHT_DTYPES",
    "FP8_E4M3",
    "GITATTRIBUTES_NAME",
    "INCOMPLETE",
    "INDEX_NAME",
    "INT4_PACKED",
    "INT4_PACKED_DTYPE",
    "INT4_SCALE",
    "INT4_SHAPE",
    "INT4_SHAPE_DTYPES",
    "INT4_ZERO_POINT",
    "JOURNAL_NAME",
    "KERNELS_AUTO",
    "KERNEL_MODES",
    "LEFT_RUNNING_THREAD_PREFIX",
    "LOCK_NAME",
    "MANIFEST_NAME",
    "MLA_DIR_NAME",
    "MLA_MANIFEST_NAME",
    "PARAMS_JSON_NAME",
    "PARTIAL_SUFFIX",
    "PROBE_NAME",
    "SINGLE_FILE_NAME",
    "STAGING_DIR_NAME",
    "TOOL_NAME",
    "WRITE_AUTO",
    "WRITE_BUFFERED",
    "WRITE_DIRECT",
    "WRITE_MODES",
]  # fmt: skip
