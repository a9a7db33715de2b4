"""verify, the output's quantization_config: its schema, and which scheme it gives each linear, read
the way vLLM's compressed-tensors config reads it.

A channel-FP8 output has one group of static per-channel FP8 weights with dynamic per-token
activations, targeting the class "Linear"; an INT4 source's output also keeps that source's
pack-quantized INT4 group, whose targets name its modules (a name or `re:` target wins over the
class target in vLLM and in compressed-tensors, so each module gets one scheme). `ignore` applies
to every group. Module names are the ones vLLM matches (source.naming's `config_module`).
"""

from __future__ import annotations

import re

FP8, INT4, IGNORED = "channel-fp8", "int4", "unquantized"
_FP8_WEIGHTS = {"type": "float", "num_bits": 8, "strategy": "channel", "dynamic": False, "symmetric": True}
_FP8_INPUTS = {"type": "float", "num_bits": 8, "strategy": "token", "dynamic": True}
COMPRESSION_FORMATS = ("float-quantized", "pack-quantized", "mixed-precision")  # what an output may say


def _is_int4(group: dict) -> bool:
    w = group.get("weights") or {}
    return (w.get("type"), w.get("num_bits")) == ("int", 4)


def groups_of(qc: dict) -> tuple[list[dict], list[dict]]:
    """(the channel-FP8 groups, the INT4 groups) of a config."""
    groups = [g for g in (qc.get("config_groups") or {}).values() if isinstance(g, dict)]
    return [g for g in groups if not _is_int4(g)], [g for g in groups if _is_int4(g)]


def config_problems(qc) -> list[str]:
    """What keeps `qc` from being this tool's channel-FP8 config (with an INT4 source's INT4 group)."""
    if not isinstance(qc, dict):
        return [f"quantization_config is {qc!r}"]
    out = []
    if qc.get("quant_method") != "compressed-tensors":
        out.append(f"quant_method {qc.get('quant_method')!r}")
    fp8, int4 = groups_of(qc)
    want_format = "mixed-precision" if int4 else "float-quantized"
    if qc.get("format") != want_format:
        out.append(f"format {qc.get('format')!r}, expected {want_format!r}")
    if len(fp8) != 1:
        out.append(f"{len(fp8)} channel-FP8 groups, expected one")
    for g in fp8:
        w, a = g.get("weights") or {}, g.get("input_activations") or {}
        out += [f"weights.{k} {w.get(k)!r}" for k, val in _FP8_WEIGHTS.items() if w.get(k) != val]
        out += [f"input_activations.{k} {a.get(k)!r}" for k, val in _FP8_INPUTS.items() if a.get(k) != val]
        if "Linear" not in (g.get("targets") or []):
            out.append(f"targets {g.get('targets')!r} lack 'Linear'")
    for g in int4:
        targets = g.get("targets") or []
        if not targets or "Linear" in targets:
            out.append(f"INT4 targets {targets!r}: they must name its modules (two groups targeting 'Linear' collide)")
        if g.get("format", qc.get("format")) != "pack-quantized":
            out.append(f"INT4 group format {g.get('format')!r}, expected 'pack-quantized'")
    if not isinstance(qc.get("ignore", []), list):
        out.append("ignore is not a list")
    if "fp8_dtype_flavor" in qc:  # the weights are float8_e4m3fn for every target; only the range differs
        out.append(f"fp8_dtype_flavor {qc['fp8_dtype_flavor']!r} claims another encoding than float8_e4m3fn")
    return out


def ct_ignored(module: str, ignore: list[str]) -> bool:
    """compressed-tensors semantics: 're:PATTERN' entries match with re.match, others by exact name."""
    for entry in ignore:
        if entry.startswith("re:"):
            try:
                if re.match(entry[3:], module):
                    return True
            except re.error:
                continue
        elif entry == module:
            return True
    return False


def _matches(module: str, target: str) -> bool:
    if target.startswith("re:"):
        try:
            return re.match(target[3:], module) is not None
        except re.error:
            return False
    return target == module


def claimed(module: str, qc: dict) -> str:
    """The scheme the config gives a linear (by vLLM's module name): IGNORED, INT4 or FP8. Ignore
    first; then a name or regex target of any group; then the class target "Linear"."""
    if ct_ignored(module, [str(x) for x in (qc.get("ignore") or [])]):
        return IGNORED
    fp8, int4 = groups_of(qc)
    for kind, groups in ((INT4, int4), (FP8, fp8)):
        if any(_matches(module, t) for g in groups for t in (g.get("targets") or []) if t != "Linear"):
            return kind
    return FP8 if any("Linear" in (g.get("targets") or []) for g in fp8) else IGNORED


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
