"""verify, header pass of mla/: the MLA manifest agrees with the model (dims, layers, the source
fingerprint, the format), and each layer's artifact file holds W_UK_T and W_UV in bf16 in their
shapes, and nothing else."""

from __future__ import annotations

from pathlib import Path

from mla_convert.constants import MLA_DIR_NAME, MLA_MANIFEST_NAME
from mla_convert.errors import SourceError
from mla_convert.io.headers import read_header
from mla_convert.verification.report import MLA, STRUCTURE, Tally
from mla_runtime.format import (
    ARTIFACT_ST_DTYPE,
    ArtifactError,
    MlaDims,
    MlaManifest,
    layer_file_name,
    w_uk_t_name,
    w_uv_name,
)
from mla_runtime.format import read_manifest as read_mla_manifest
from mla_runtime.safetensors_file import ShardHeader


def check_mla_manifest(
    root: Path,
    dims: MlaDims,
    mla_layers: list[int],
    fmt: str,
    fingerprint: str,
    tally: Tally,
    layer_dims: dict[int, MlaDims] | None = None,
) -> tuple[MlaManifest | None, dict[int, ShardHeader]]:
    """mla/manifest.json against the model's `dims`, each layer's own (`layer_dims`, the config's:
    a layer absent there has the model's) and the layers that must have artifacts, and each
    artifact file it lists. Returns the manifest (None: unreadable) and the artifact headers that
    were read, by layer."""
    try:
        man = read_mla_manifest(root / MLA_DIR_NAME)
    except ArtifactError as e:
        tally.fail(
            STRUCTURE,
            "mla-manifest",
            f"{MLA_DIR_NAME}/{MLA_MANIFEST_NAME}",
            expected="a valid MLA manifest",
            found=str(e),
        )
        return None, {}
    rel_manifest = f"{MLA_DIR_NAME}/{MLA_MANIFEST_NAME}"
    tally.expect(man.dims == dims, STRUCTURE, "mla-manifest", rel_manifest, expected=dims, found=man.dims)
    tally.expect(
        man.layer_ids() == mla_layers,
        STRUCTURE,
        "mla-manifest",
        rel_manifest,
        expected=f"layers {mla_layers}",
        found=f"layers {man.layer_ids()}",
    )
    tally.expect(
        man.source_fingerprint == fingerprint,
        MLA,
        "fingerprint",
        rel_manifest,
        expected=f"source fingerprint {fingerprint} (the conversion manifest's)",
        found=man.source_fingerprint,
    )
    producer_fmt = man.producer.get("format")
    if producer_fmt is not None:
        tally.expect(
            producer_fmt == fmt, STRUCTURE, "mla-manifest", rel_manifest, expected=f"format {fmt}", found=producer_fmt
        )
    headers: dict[int, ShardHeader] = {}
    for entry in man.layers:
        want = (layer_dims or {}).get(entry.layer, dims)
        # a layer at the model's dims on both sides is what the model-wide check above counted
        if want != dims or entry.dims:
            tally.expect(
                man.dims_of(entry.layer) == want,
                STRUCTURE,
                "mla-manifest",
                rel_manifest,
                expected=f"layer {entry.layer}: {want}",
                found=f"layer {entry.layer}: {man.dims_of(entry.layer)}",
            )
        if tally.expect(
            entry.file == layer_file_name(entry.layer),
            STRUCTURE,
            "mla-manifest",
            rel_manifest,
            expected=layer_file_name(entry.layer),
            found=entry.file,
        ):
            hd = _check_layer_file(root, entry.layer, man.dims_of(entry.layer), tally)
            if hd is not None:
                headers[entry.layer] = hd
    return man, headers


def _check_layer_file(root: Path, layer: int, dims: MlaDims, tally: Tally) -> ShardHeader | None:
    """One layer's artifact file holds W_UK_T and W_UV, bf16 in their shapes, and nothing else.
    Returns its header (None: unreadable)."""
    rel = f"{MLA_DIR_NAME}/{layer_file_name(layer)}"
    try:
        hd = read_header(root / rel)
    except SourceError as e:
        tally.fail(STRUCTURE, "header", rel, expected="a sane safetensors header", found=str(e).split(": ", 1)[-1])
        return None
    want = {
        w_uk_t_name(layer): (ARTIFACT_ST_DTYPE, dims.w_uk_t_shape()),
        w_uv_name(layer): (ARTIFACT_ST_DTYPE, dims.w_uv_shape()),
    }
    for name, (dtype, shape) in want.items():
        t = hd.tensors.get(name)
        tally.expect(
            t is not None and (t.dtype, t.shape) == (dtype, shape),
            STRUCTURE,
            "mla-artifact",
            rel,
            name,
            expected=f"{dtype}{list(shape)}",
            found="missing" if t is None else f"{t.dtype}{list(t.shape)}",
        )
    for name in sorted(set(hd.tensors) - set(want)):
        tally.fail(STRUCTURE, "mla-artifact", rel, name, expected="only W_UK_T and W_UV", found="extra tensor")
    return hd
