"""verify, header pass: what a converted directory must contain, checked without reading tensor data.

The config, the index and every shard header, the tensor set against the expected one (expects),
quantization_config against the tensors, and the MLA manifest with the artifact headers
(mla_manifest). What the pass learned (Structure) is what the data pass works from.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from mla_convert import formats
from mla_convert.constants import CONFIG_NAME, INDEX_NAME, INT4_PACKED
from mla_convert.errors import SourceError
from mla_convert.formats import IGNORED, INT4, QUANTIZED, Format
from mla_convert.io.headers import read_header
from mla_convert.plan.planner import Plan
from mla_convert.source import members
from mla_convert.source.checkpoint import module_of
from mla_convert.source.family import (
    FP8_LINEAR,
    LINEAR,
    FamilyError,
    ModelLayout,
    layer_config,
    supported_architectures,
)
from mla_convert.source.model_config import ModelConfig, read_model_config
from mla_convert.source.naming import DEEPSEEK_NAMES, TensorNames
from mla_convert.verification.expects import (
    Expect,
    expects_from_config,
    expects_from_plan,
    extra_buffer_expects,
    other_part_expects,
)
from mla_convert.verification.mla_manifest import check_mla_manifest
from mla_convert.verification.report import STRUCTURE, Tally
from mla_runtime.format import MlaDims, MlaManifest, kv_b_layer_index
from mla_runtime.safetensors_file import ShardHeader


@dataclass
class Structure:
    """What the header pass learned; the data pass works from it."""

    config: dict | None = None  # the text model's config in config.json's names
    model: ModelConfig | None = None  # how the directory describes the model (its config file, names)
    names: TensorNames = DEEPSEEK_NAMES
    index_name: str = INDEX_NAME
    dims: MlaDims | None = None
    weight_map: dict[str, str] = field(default_factory=dict)
    headers: dict[str, ShardHeader] = field(default_factory=dict)  # model shards that parsed
    expects: dict[str, Expect] = field(default_factory=dict)
    mla_layers: list[int] = field(default_factory=list)  # layers that must have artifacts
    mla_manifest: MlaManifest | None = None
    mla_headers: dict[int, ShardHeader] = field(default_factory=dict)

    def after_tasks(self) -> Structure:
        """This, less each tensor's expectation: the file tasks (tasks.file_tasks) took what the
        data pass needs of them, and no check after it reads them."""
        return replace(self, expects={})


def check_structure(root: Path, fmt: str, fingerprint: str, plan: Plan | None, tally: Tally) -> Structure:
    """Run every header-only check of an output in format `fmt` (formats.names()), recording
    results in `tally`; return what the data pass needs."""
    structure = Structure()
    output = formats.get(fmt)
    structure.model = _check_config(root, output, tally)
    if structure.model is not None:
        structure.config, structure.names, structure.index_name = (
            structure.model.text,
            structure.model.names,
            structure.model.index_name,
        )
    elif (own := members.own_layout_of(root)) is not None:
        structure.index_name = own.index_file or INDEX_NAME
    _check_index(root, structure, tally)
    if structure.config is None:
        return structure
    config_file = structure.model.file
    structure.dims = MlaDims.from_model_config(structure.config)
    try:
        if plan is not None:
            structure.expects = expects_from_plan(plan)
        else:
            structure.expects = expects_from_config(
                structure.config, output, structure.model.quantization, structure.names
            )
            structure.expects |= extra_buffer_expects(
                structure.config, structure.headers, structure.expects, structure.names
            )
            structure.expects |= other_part_expects(structure.names, structure.headers, structure.model.vision)
    except (KeyError, TypeError, FamilyError) as e:
        tally.fail(
            STRUCTURE, "config", config_file, expected="every dimension of its architecture", found=f"missing {e}"
        )
        return structure
    _check_tensor_set(structure, tally)
    if output.quantizes:
        _check_quantized_modules(structure, output, tally)
    structure.mla_layers = sorted(
        i for n in structure.expects if (d := structure.names.to_deepseek(n)) and (i := kv_b_layer_index(d)) is not None
    )
    arch = ModelLayout.of(structure.config).architecture  # the expectations above read it already
    own = {i: MlaDims.from_model_config(layer_config(structure.config, arch, i)) for i in structure.mla_layers}
    structure.mla_manifest, structure.mla_headers = check_mla_manifest(
        root, structure.dims, structure.mla_layers, fmt, fingerprint, tally, own
    )
    return structure


_UNREADABLE = object()


def _load_json(root: Path, rel: str, check: str, what: str, tally: Tally) -> object:
    """The JSON document `rel`, or _UNREADABLE with a failure of `check` when it is missing or is
    not JSON (a document that is JSON `null` is returned as None, for the caller to refuse)."""
    try:
        return json.loads((root / rel).read_bytes())
    except FileNotFoundError:
        tally.fail(STRUCTURE, check, rel, expected=what, found="missing")
    except (OSError, ValueError) as e:
        tally.fail(STRUCTURE, check, rel, expected="valid JSON", found=str(e))
    return _UNREADABLE


def _check_config(root: Path, fmt: Format, tally: Tally) -> ModelConfig | None:
    """The directory's model description (config.json, nested, or params.json): a supported
    architecture with its dims, and the quantization_config the format implies."""
    try:
        model = read_model_config(root)
    except SourceError as e:
        own = members.own_layout_of(root)
        name = CONFIG_NAME if own is None else own.config_file
        missing = not (root / name).exists()
        found = "missing" if missing else str(e).replace(f"{root / name}: ", "")
        tally.fail(STRUCTURE, "config", name, expected=name if missing else "valid JSON", found=found)
        return None
    if not tally.expect(
        model.architecture in supported_architectures(),
        STRUCTURE,
        "config",
        model.file,
        expected=f"architectures containing one of {', '.join(supported_architectures())}",
        found=repr(model.raw.get("architectures")),
    ):
        return None
    try:
        ModelLayout.of(model.text)
        problem = None if isinstance(model.text.get("vocab_size"), int) else "config lacks integer vocab_size"
    except FamilyError as e:
        problem = f"{model.where()}{e}"
    if not tally.expect(
        problem is None, STRUCTURE, "config", model.file, expected="integer MLA and model dims", found=problem
    ):
        return None
    problem = fmt.config_problem(model.quantization, bool(model.quant_at))
    tally.expect(
        problem is None,
        STRUCTURE,
        "quantization_config",
        model.file,
        expected=fmt.config_expected(),
        found=problem or "",
    )
    return model


def _check_index(root: Path, structure: Structure, tally: Tally) -> None:
    """The index and the shard headers agree exactly; headers are sane; total_size is right."""
    index = _read_index(root, structure.index_name, tally)
    if index is None:
        return
    structure.weight_map = index["weight_map"]
    _read_shard_headers(root, structure, tally)
    _check_index_vs_headers(root, structure, tally)
    metadata = index.get("metadata")
    total = metadata.get("total_size") if isinstance(metadata, dict) else None
    actual = sum(t.nbytes for hd in structure.headers.values() for t in hd.tensors.values())
    if len(structure.headers) == len(set(structure.weight_map.values())):
        tally.expect(total == actual, STRUCTURE, "total_size", structure.index_name, expected=actual, found=total)


def _read_index(root: Path, index_name: str, tally: Tally) -> dict | None:
    """The safetensors index, if it parses and has a weight_map of tensor -> file name."""
    index = _load_json(root, index_name, "index", "the safetensors index", tally)
    if index is _UNREADABLE:
        return None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        tally.fail(
            STRUCTURE, "index", index_name, expected="a weight_map of tensor -> file name", found=repr(weight_map)[:200]
        )
        return None
    return index


def _read_shard_headers(root: Path, structure: Structure, tally: Tally) -> None:
    """The header of every shard the index names, into structure.headers (those that parse)."""
    for rel in sorted(set(structure.weight_map.values())):
        if os.path.isabs(rel) or ".." in Path(rel).parts or "/" in rel:
            tally.fail(
                STRUCTURE,
                "index",
                structure.index_name,
                expected="shard file names inside the directory",
                found=repr(rel),
            )
            continue
        try:
            structure.headers[rel] = read_header(root / rel)
            tally.ok(STRUCTURE)
        except SourceError as e:
            found = "missing" if not (root / rel).exists() else str(e).replace(str(root / rel) + ": ", "")
            tally.fail(STRUCTURE, "header", rel, expected="a sane safetensors header", found=found)


def _check_index_vs_headers(root: Path, structure: Structure, tally: Tally) -> None:
    """Every tensor the index lists is in its shard, every tensor of a shard is listed there, and
    every shard in the directory is listed."""
    weight_map = structure.weight_map
    for name, rel in sorted(weight_map.items()):
        if rel in structure.headers:
            tally.expect(
                name in structure.headers[rel].tensors,
                STRUCTURE,
                "index-vs-header",
                rel,
                name,
                expected="listed in the index and present in this shard",
                found="not in the shard",
            )
    for rel, hd in sorted(structure.headers.items()):
        for name in hd.tensors:
            tally.expect(
                weight_map.get(name) == rel,
                STRUCTURE,
                "index-vs-header",
                rel,
                name,
                expected="every tensor of the shard listed in the index",
                found="not in the index" if name not in weight_map else f"index says {weight_map[name]}",
            )
    listed = set(weight_map.values())
    for path in sorted(root.glob("*.safetensors")):
        tally.expect(
            path.name in listed,
            STRUCTURE,
            "index-vs-header",
            path.name,
            expected="every shard listed in the index",
            found="shard not in the index",
        )


def _check_tensor_set(structure: Structure, tally: Tally) -> None:
    """Every implied tensor present with its dtype and shape; nothing else (no *_scale_inv)."""
    for name, exp in structure.expects.items():
        rel = structure.weight_map.get(name)
        if rel is None:
            tally.fail(STRUCTURE, "missing-tensor", None, name, expected=exp.describe(), found="not in the index")
            continue
        if exp.file is not None:
            tally.expect(
                rel == exp.file, STRUCTURE, "tensor-file", rel, name, expected=f"in {exp.file}", found=f"in {rel}"
            )
        info = structure.headers[rel].tensors.get(name) if rel in structure.headers else None
        if info is None:
            continue  # reported by the index/header checks
        tally.expect(
            exp.admits(info),
            STRUCTURE,
            "dtype-shape",
            rel,
            name,
            expected=exp.describe(),
            found=f"{info.dtype}{list(info.shape)}",
        )
    for name in sorted(set(structure.weight_map) | {n for hd in structure.headers.values() for n in hd.tensors}):
        if name not in structure.expects:
            why = (
                "a leftover block-FP8 scale"
                if name.endswith("_scale_inv")
                else f"not implied by {structure.model.file}"
            )
            tally.fail(
                STRUCTURE,
                "unexpected-tensor",
                structure.weight_map.get(name),
                name,
                expected="no such tensor",
                found=why,
            )


def _check_quantized_modules(structure: Structure, fmt: Format, tally: Tally) -> None:
    """quantization_config agrees with the tensors: a linear it quantizes holds a weight as the
    format quantizes one, with its scale, one it gives the INT4 group holds packed INT4 tensors, one
    it ignores holds a 16-bit weight; an ignore entry by name names a linear."""
    qc = structure.model.quantization or {}
    ignore = [str(x) for x in (qc.get("ignore") or [])]
    modules = {
        module_of(n)
        for n, e in structure.expects.items()
        if e.kind in (FP8_LINEAR, LINEAR) and n.endswith((".weight", f".{INT4_PACKED}"))
    }
    served = {structure.names.config_module(m) for m in modules}
    for module in sorted(modules):
        actual = _stored_scheme(structure, module, fmt)
        if actual is None:
            continue  # missing: reported by the tensor set check
        said = fmt.claimed(structure.names.config_module(module), qc)
        tally.expect(
            said == actual,
            STRUCTURE,
            "quantization_config",
            structure.model.file,
            module,
            expected=f"{fmt.scheme_label(actual)} as stored",
            found=f"{fmt.scheme_label(said)} per quantization_config",
        )
    for entry in ignore:
        if not entry.startswith("re:"):
            tally.expect(
                entry in served,
                STRUCTURE,
                "quantization_config",
                structure.model.file,
                entry,
                expected="ignore entries that name linear modules",
                found="no such module",
            )


def _stored_scheme(structure: Structure, module: str, fmt: Format) -> str | None:
    """QUANTIZED (a weight as the format quantizes one, and its scale), INT4 or IGNORED (16-bit) as
    the headers hold `module`; None when it is missing."""
    if _info(structure, f"{module}.{INT4_PACKED}") is not None:
        return INT4
    weight = f"{module}.weight"
    w = _info(structure, weight)
    if w is None:
        return None
    scale = fmt.scale_name(weight)
    quantized = w.dtype == fmt.block_fp8.dtype and scale is not None and _info(structure, scale) is not None
    return QUANTIZED if quantized else IGNORED


def _info(structure: Structure, name: str):
    rel = structure.weight_map.get(name)
    return structure.headers[rel].tensors.get(name) if rel in structure.headers else None
