"""compressed-tensors FP8 formats: the one writer of the `quantization_config` such a format
stores, and verify's reading of it, from the same declaration (the format's `weights` and
`input_activations`). Standard library only.

A config has one FP8 group targeting the class "Linear", with the format's weights and dynamic
per-token FP8 activations; an INT4 source's output also keeps that source's pack-quantized INT4
group, whose targets name its modules (a name or `re:` target wins over the class target in vLLM
and in compressed-tensors, so each module gets one scheme; two groups that both targeted "Linear"
would collide: the later one silently replaces the earlier in both). `ignore` applies to every
group. Module names are the ones vLLM matches (source.naming's `config_module`).
"""

from __future__ import annotations

import copy
import re
from typing import ClassVar

from mla_convert.formats.format import IGNORED, INT4, QUANTIZED, Format

FLOAT_QUANTIZED, PACK_QUANTIZED, MIXED_PRECISION = "float-quantized", "pack-quantized", "mixed-precision"
COMPRESSION_FORMATS = (FLOAT_QUANTIZED, PACK_QUANTIZED, MIXED_PRECISION)  # what an output may say
# What verify holds a group's weights and input activations to (in this order in its messages).
_CHECKED_WEIGHTS = ("type", "num_bits", "strategy", "dynamic", "symmetric")
_CHECKED_INPUTS = ("type", "num_bits", "strategy", "dynamic")
DYNAMIC_TOKEN_FP8 = {
    "type": "float", "num_bits": 8, "strategy": "token",
    "symmetric": True, "dynamic": True, "group_size": None, "observer": None,
}  # fmt: skip


def static_fp8_weights(strategy: str) -> dict:
    """Static symmetric e4m3 weights scaled per `strategy` ("channel": per output row; "tensor")."""
    return {
        "type": "float", "num_bits": 8, "strategy": strategy,
        "symmetric": True, "dynamic": False, "group_size": None, "observer": "minmax",
    }  # fmt: skip


class CompressedTensorsFp8(Format):
    """A format whose quantized linears are compressed-tensors float-quantized FP8 (`weights`),
    with dynamic per-token FP8 activations. The same for every target: the bytes are
    float8_e4m3fn, only their range differs, so no `fp8_dtype_flavor` ('float8_e4m3fnuz' would
    claim another encoding)."""

    weights: ClassVar[dict]  # the group's weights, as written
    input_activations: ClassVar[dict] = DYNAMIC_TOKEN_FP8
    tags: ClassVar[tuple[str, ...]] = ("fp8", "compressed-tensors")
    base_model_relation: ClassVar[str | None] = "quantized"

    # ---- the writer ------------------------------------------------------------------------------

    def fp8_group(self) -> dict:
        return {
            "targets": ["Linear"],
            "weights": dict(self.weights),
            "input_activations": dict(self.input_activations),
            "output_activations": None,
            "format": FLOAT_QUANTIZED,
        }

    def quantization_config(self, ignore: list[str], int4=None, int4_targets: list[str] | None = None) -> dict:
        """The compressed-tensors config vLLM and vllm-gaudi load without conversion. With `int4`
        (an INT4 source's group): that group as the source states it, its targets naming exactly
        its modules (`int4_targets`), next to the FP8 group (mixed-precision)."""
        groups = {"group_0": self.fp8_group()}
        fmt = FLOAT_QUANTIZED
        if int4 is not None:
            kept = copy.deepcopy(int4.group) | {"targets": list(int4_targets or [])}
            kept.setdefault("format", PACK_QUANTIZED)
            fp8_name = next(f"group_{i}" for i in range(1, 100) if f"group_{i}" != int4.group_name)
            groups, fmt = {int4.group_name: kept, fp8_name: groups["group_0"]}, MIXED_PRECISION
        return {
            "quant_method": "compressed-tensors",
            "format": fmt,
            "quantization_status": "compressed",
            "config_groups": groups,
            "ignore": list(ignore),
            "kv_cache_scheme": None,
            "global_compression_ratio": None,
        }

    # ---- the reader (verify) ---------------------------------------------------------------------

    def config_expected(self) -> str:
        w = self.weights
        kind = "static" if not w.get("dynamic") else "dynamic"
        return (
            f"compressed-tensors {kind} per-{w.get('strategy')} FP8 weights, dynamic per-token activations"
            " (and an INT4 source's pack-quantized group)"
        )

    def config_problem(self, qc, present: bool) -> str | None:
        return "; ".join(config_problems(qc, self.weights, self.input_activations)) or None

    def claimed(self, module: str, qc: dict) -> str:
        return claimed(module, qc)


def _is_int4(group: dict) -> bool:
    w = group.get("weights") or {}
    return (w.get("type"), w.get("num_bits")) == ("int", 4)


def groups_of(qc: dict) -> tuple[list[dict], list[dict]]:
    """(the FP8 groups, the INT4 groups) of a config."""
    groups = [g for g in (qc.get("config_groups") or {}).values() if isinstance(g, dict)]
    return [g for g in groups if not _is_int4(g)], [g for g in groups if _is_int4(g)]


def config_problems(qc, weights: dict, inputs: dict) -> list[str]:
    """What keeps `qc` from being the config of FP8 `weights` with `inputs` (and an INT4 source's
    INT4 group)."""
    if not isinstance(qc, dict):
        return [f"quantization_config is {qc!r}"]
    out = []
    if qc.get("quant_method") != "compressed-tensors":
        out.append(f"quant_method {qc.get('quant_method')!r}")
    fp8, int4 = groups_of(qc)
    want_format = MIXED_PRECISION if int4 else FLOAT_QUANTIZED
    if qc.get("format") != want_format:
        out.append(f"format {qc.get('format')!r}, expected {want_format!r}")
    if len(fp8) != 1:
        out.append(f"{len(fp8)} {weights.get('strategy')}-FP8 groups, expected one")
    for g in fp8:
        w, a = g.get("weights") or {}, g.get("input_activations") or {}
        out += [f"weights.{k} {w.get(k)!r}" for k in _CHECKED_WEIGHTS if w.get(k) != weights.get(k)]
        out += [f"input_activations.{k} {a.get(k)!r}" for k in _CHECKED_INPUTS if a.get(k) != inputs.get(k)]
        if "Linear" not in (g.get("targets") or []):
            out.append(f"targets {g.get('targets')!r} lack 'Linear'")
    for g in int4:
        targets = g.get("targets") or []
        if not targets or "Linear" in targets:
            out.append(f"INT4 targets {targets!r}: they must name its modules (two groups targeting 'Linear' collide)")
        if g.get("format", qc.get("format")) != PACK_QUANTIZED:
            out.append(f"INT4 group format {g.get('format')!r}, expected {PACK_QUANTIZED!r}")
    if not isinstance(qc.get("ignore", []), list):
        out.append("ignore is not a list")
    if "fp8_dtype_flavor" in qc:  # the weights are float8_e4m3fn for every target; only the range differs
        out.append(f"fp8_dtype_flavor {qc['fp8_dtype_flavor']!r} claims another encoding than float8_e4m3fn")
    return out


def ct_ignored(module: str, ignore: list[str]) -> bool:
    """compressed-tensors semantics: 're:PATTERN' entries match with re.match, others by exact name."""
    return any(_matches(module, entry) for entry in ignore)


def _matches(module: str, target: str) -> bool:
    if target.startswith("re:"):
        try:
            return re.match(target[3:], module) is not None
        except re.error:
            return False
    return target == module


def claimed(module: str, qc: dict) -> str:
    """The scheme the config gives a linear (by vLLM's module name): IGNORED, INT4 or QUANTIZED.
    Ignore first; then a name or regex target of any group; then the class target "Linear"."""
    if ct_ignored(module, [str(x) for x in (qc.get("ignore") or [])]):
        return IGNORED
    fp8, int4 = groups_of(qc)
    for kind, groups in ((INT4, int4), (QUANTIZED, fp8)):
        if any(_matches(module, t) for g in groups for t in (g.get("targets") or []) if t != "Linear"):
            return kind
    return QUANTIZED if any("Linear" in (g.get("targets") or []) for g in fp8) else IGNORED


def int4_group_size(qc: dict | None) -> tuple[int | None, bool] | None:
    """(group_size, symmetric) of the config's INT4 group; None without one."""
    if not isinstance(qc, dict):
        return None
    _, int4 = groups_of(qc)
    if not int4:
        return None
    w = int4[0].get("weights") or {}
    size = w.get("group_size") if w.get("strategy") == "group" else None
    return size, w.get("symmetric", True) is not False
