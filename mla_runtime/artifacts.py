"""Open the MLA artifacts of a converted model and fetch one layer's W_UK_T / W_UV for a TP rank.

    arts = open_artifacts("/data/R1-channel-fp8/mla", model_dir="/data/R1-channel-fp8")
    w_uk_t, w_uv = arts.load_layer(3, tp_rank=1, tp_size=8, device="hpu")

Validation happens in two steps, both before any tensor reaches the caller:

- `open_artifacts` reads the manifest (format, version, dtype, layer list), compares its dims with
  the served model's config.json and its source fingerprint with the served directory's
  `mla-convert-manifest.json` (when there is one), and stats every layer file (its size must be the
  manifest's).
- `load_layer` checks the layer file's safetensors header (names, dtype, full shapes), optionally its
  sha256, and maps only rank r's heads [r*N/T, (r+1)*N/T) of each tensor (heads are the leading
  dimension, so a rank's heads are one byte range). On the CPU in bf16 the returned tensors are
  those pages of the page cache themselves, mapped copy-on-write: nothing is copied. For another
  device or dtype, the one copy is from the page cache into the final tensor.

Every error is an `ArtifactError` naming the layer and the file. Depends on torch and the standard
library only (safetensors files are read by `mla_runtime.safetensors_file`).
"""

from __future__ import annotations

import ctypes
import json
import math
import mmap
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from . import envs
from .format import (
    ARTIFACT_ST_DTYPE,
    CONFIG_NAME,
    CONVERT_MANIFEST_NAME,
    MANIFEST_NAME,
    MLA_DIR_NAME,
    ArtifactError,
    LayerEntry,
    MlaDims,
    MlaManifest,
    decode_text,
    layer_file_name,
    read_manifest,
    w_uk_t_name,
    w_uv_name,
)
from .model_configs import PARAMS_CONFIG_NAME, kv_sources, layer_count, layer_fields
from .safetensors_file import DTYPE_SIZES, HeaderError, ShardHeader, TensorInfo, file_digest, pread_exact, read_header


def head_range(num_heads: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """Heads [start, end) held by TP rank `tp_rank` of `tp_size`, as vLLM splits kv_b_proj."""
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ArtifactError(f"invalid tensor-parallel rank {tp_rank} of size {tp_size}")
    if num_heads % tp_size:
        raise ArtifactError(
            f"tensor-parallel size {tp_size} does not divide the {num_heads} attention heads; "
            f"use a TP size that divides {num_heads}"
        )
    per = num_heads // tp_size
    return tp_rank * per, (tp_rank + 1) * per


def _open_no_readahead(path: Path) -> int:
    fd = os.open(path, os.O_RDONLY)
    if hasattr(os, "posix_fadvise"):  # read what is asked for, not the rest of the file
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    return fd


def _read_header(path: Path) -> ShardHeader:
    """The layer file's header, checked by the strict parser, read without reading ahead."""
    fd = _open_no_readahead(path)
    try:
        return read_header(path, fd=fd)
    finally:
        os.close(fd)


def _row_range(info: TensorInfo, data_start: int, start: int, end: int) -> tuple[int, int, tuple[int, ...]]:
    """(file offset, byte count, shape) of rows [start, end) of a tensor (first dimension)."""
    row_bytes = DTYPE_SIZES[info.dtype] * math.prod(info.shape[1:])
    return data_start + info.begin + start * row_bytes, row_bytes * (end - start), (end - start, *info.shape[1:])


# Linux >= 5.14: fill the page tables of a mapping from the page cache without touching the memory
# (Python 3.11's mmap module does not name it yet).
_MADV_POPULATE_READ = 22 if sys.platform.startswith("linux") else None


def _map_rows(path: Path, info: TensorInfo, data_start: int, start: int, end: int, *, populate: bool) -> torch.Tensor:
    """Rows [start, end) of a bf16 tensor, backed by the file's own pages.

    A private (copy-on-write) mapping of exactly those bytes, rounded down to a page: a write to the
    tensor copies the page it touches and never reaches the file. The range is read ahead at once
    (one request for the whole range, not a fault per page); with `populate` its page tables are
    filled too, so that the tensor's first use does not fault page by page.
    """
    offset, nbytes, shape = _row_range(info, data_start, start, end)
    if nbytes == 0:
        return torch.empty(shape, dtype=torch.bfloat16)
    base = offset - offset % mmap.ALLOCATIONGRANULARITY
    fd = os.open(path, os.O_RDONLY)
    try:
        mapping = mmap.mmap(fd, offset - base + nbytes, access=mmap.ACCESS_COPY, offset=base)
    finally:
        os.close(fd)  # the mapping keeps the file
    if hasattr(mapping, "madvise"):
        mapping.madvise(mmap.MADV_WILLNEED)
        if populate and _MADV_POPULATE_READ is not None:
            try:
                mapping.madvise(_MADV_POPULATE_READ)
            except OSError:  # an older kernel: pages are mapped on first use instead
                pass
    # The tensor holds a reference to the mapping, which is unmapped when the last view is freed.
    return torch.frombuffer(mapping, dtype=torch.bfloat16, count=nbytes // 2, offset=offset - base).view(shape)


def _read_rows(path: Path, info: TensorInfo, data_start: int, start: int, end: int) -> torch.Tensor:
    """Rows [start, end) of a bf16 tensor, read into a new tensor with one positioned read of exactly
    those bytes (for files that cannot be mapped)."""
    offset, nbytes, shape = _row_range(info, data_start, start, end)
    out = torch.empty(nbytes, dtype=torch.uint8)  # read straight into the tensor: no zero-fill, no copy
    if nbytes:
        view = memoryview((ctypes.c_ubyte * nbytes).from_address(out.data_ptr())).cast("B")
        fd = _open_no_readahead(path)
        try:
            pread_exact(fd, view, offset)
        finally:
            os.close(fd)
    return out.view(torch.bfloat16).view(shape)


@dataclass(frozen=True)
class MlaArtifacts:
    """Validated MLA artifacts of one converted model (see `open_artifacts`)."""

    artifacts_dir: Path
    manifest: MlaManifest
    verify: str = "size"

    @property
    def dims(self) -> MlaDims:
        """The model's dims; a layer's own are `dims_of(layer)`."""
        return self.manifest.dims

    def dims_of(self, layer: int) -> MlaDims:
        self._entry(layer)  # the message that names the file and the layers there are
        return self.manifest.dims_of(layer)

    @property
    def layers(self) -> list[int]:
        return self.manifest.layer_ids()

    def layer_path(self, layer: int) -> Path:
        return self.artifacts_dir / self._entry(layer).file

    def _entry(self, layer: int) -> LayerEntry:
        try:
            return self.manifest.entry(layer)
        except ArtifactError as e:
            raise ArtifactError(
                f"layer {layer}: no MLA artifacts for this layer in {self.artifacts_dir / MANIFEST_NAME} "
                f"(expected file {self.artifacts_dir / layer_file_name(layer)}; the manifest lists layers "
                f"{_ranges(self.layers)}); re-run mla-convert on the served checkpoint"
            ) from e

    def check_size(self, layer: int) -> Path:
        """The layer's file exists with the size the manifest records; returns its path."""
        entry = self._entry(layer)
        path = self.artifacts_dir / entry.file
        try:
            size = path.stat().st_size
        except FileNotFoundError as e:
            raise ArtifactError(f"layer {layer} ({path}): file is missing; re-run mla-convert") from e
        if size != entry.size:
            raise ArtifactError(
                f"layer {layer} ({path}): file has {size} bytes, the manifest says {entry.size}; the "
                "artifact is truncated or was replaced: re-run mla-convert"
            )
        return path

    def check_layer(self, layer: int, *, sha256: bool | None = None) -> ShardHeader:
        """Size, header (names, dtype, shapes) and, if asked (or verify='sha256'), sha256 of one layer.

        Returns the file's safetensors header."""
        entry = self._entry(layer)
        path = self.check_size(layer)
        where = f"layer {layer} ({path})"
        try:
            header = _read_header(path)
        except HeaderError as e:
            raise ArtifactError(f"{where}: not a readable safetensors file ({str(e).removeprefix(f'{path}: ')})") from e
        except OSError as e:
            raise ArtifactError(f"{where}: not a readable safetensors file ({e.strerror or e})") from e
        dims = self.manifest.dims_of(layer)
        want = {w_uk_t_name(layer): dims.w_uk_t_shape(), w_uv_name(layer): dims.w_uv_shape()}
        for name, shape in want.items():
            info = header.tensors.get(name)
            if info is None:
                raise ArtifactError(f"{where}: tensor {name!r} is missing (the file holds another layer?)")
            if info.dtype != ARTIFACT_ST_DTYPE:
                raise ArtifactError(f"{where}: tensor {name!r} has dtype {info.dtype}, expected {ARTIFACT_ST_DTYPE}")
            if info.shape != shape:
                raise ArtifactError(
                    f"{where}: tensor {name!r} has shape {info.shape}, expected {shape} from the manifest's dims of this layer"
                )
        if sha256 if sha256 is not None else self.verify == "sha256":
            digest = file_digest(path).sha256
            if digest != entry.sha256:
                raise ArtifactError(
                    f"{where}: sha256 {digest} differs from the manifest's {entry.sha256}; the artifact is "
                    "corrupted: re-run mla-convert"
                )
        return header

    def load_layer(
        self,
        layer: int,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.bfloat16,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK_T [N/T, P, L], W_UV [N/T, L, V]) of `layer` for TP rank `tp_rank` of `tp_size`.

        Only that rank's heads are read from disk; both tensors are contiguous, on `device`, in
        `dtype` (the artifacts are bf16: another dtype is a cast of them). On the CPU in bf16 they
        share the file's pages (copy-on-write), so the layer file must not be changed in place
        while they are in use; mla-convert replaces files, it never rewrites them.
        """
        header = self.check_layer(layer)
        path = self.layer_path(layer)
        try:
            start, end = head_range(self.manifest.dims_of(layer).num_heads, tp_rank, tp_size)
        except ArtifactError as e:
            raise ArtifactError(f"layer {layer} ({path}): {e}") from e
        # On the CPU in bf16 the mapped rows are the result; otherwise .to() copies them once, from
        # the page cache into the final tensor.
        final = torch.device(device).type == "cpu" and dtype == torch.bfloat16
        out = []
        for name in (w_uk_t_name(layer), w_uv_name(layer)):
            info = header.tensors[name]
            try:
                try:
                    part = _map_rows(path, info, header.data_start, start, end, populate=final)
                except (OSError, ValueError):  # a file system that cannot map files
                    part = _read_rows(path, info, header.data_start, start, end)
            except (OSError, EOFError) as e:
                raise ArtifactError(f"layer {layer} ({path}): cannot read {name!r} ({e})") from e
            out.append(part.to(device=device, dtype=dtype).contiguous())
        return out[0], out[1]

    def check_served_dims(self, *, layer: int, num_heads: int, tp_size: int, qk_nope_head_dim: int,
                          v_head_dim: int, kv_lora_rank: int) -> None:  # fmt: skip
        """Check what one served attention layer expects (heads on this rank) against the artifacts'
        dims of that layer."""
        path = self.artifacts_dir / layer_file_name(layer)
        where = f"layer {layer} ({path})"
        d = self.dims_of(layer)
        for what, served, ours in (
            ("qk_nope_head_dim", qk_nope_head_dim, d.qk_nope_head_dim),
            ("v_head_dim", v_head_dim, d.v_head_dim),
            ("kv_lora_rank", kv_lora_rank, d.kv_lora_rank),
        ):
            if served != ours:
                raise ArtifactError(f"{where}: the served model has {what}={served}, the artifacts {ours}")
        try:
            start, end = head_range(d.num_heads, 0, tp_size)
        except ArtifactError as e:
            raise ArtifactError(f"{where}: {e}") from e
        if end - start != num_heads:
            raise ArtifactError(
                f"{where}: the artifacts have {d.num_heads} heads, i.e. {end - start} per rank at "
                f"tensor-parallel size {tp_size}, but the served layer has {num_heads} heads per rank"
            )


def _ranges(ids: list[int]) -> str:
    if not ids:
        return "none"
    parts, start, prev = [], ids[0], ids[0]
    for i in [*ids[1:], None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ", ".join(parts)


def _model_config(model_dir: Path) -> tuple[Path, dict] | None:
    """The served directory's config.json, or where it has none its params.json, and its path."""
    path = model_dir / CONFIG_NAME
    if not path.exists():
        path = model_dir / PARAMS_CONFIG_NAME
    if not path.exists():
        return None
    return path, _json_object(path, "the served model's config")


def _json_object(path: Path, what: str) -> dict:
    """A JSON object read from `path`; ArtifactError naming the file where it is not one."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ArtifactError(f"{path}: cannot read {what} ({e.strerror or e})") from e
    try:
        doc = json.loads(decode_text(data, path))
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{path}: cannot read {what} (not valid JSON: {e})") from e
    if not isinstance(doc, dict):
        raise ArtifactError(f"{path}: {what} must be a JSON object, got {type(doc).__name__}")
    return doc


def expected_layers(model_config: dict) -> list[int]:
    """Decoder layers the config serves (the MTP layers are loaded only as a drafter); any config
    shape model_configs.py reads."""
    try:
        return list(range(layer_count(model_config)))
    except KeyError as e:
        raise ArtifactError("model config lacks num_hidden_layers") from e
    except (TypeError, ValueError) as e:
        raise ArtifactError(f"model config: {e}") from e


def served_layer_dims(model_config: dict) -> dict[int, MlaDims]:
    """{decoder layer: the MLA dims the served config gives it} (a NoPE layer's are its own)."""
    model = MlaDims.from_model_config(model_config)
    try:
        kv_sources(model_config)  # a KV-sharing pattern vLLM refuses to serve
        own = layer_fields(model_config)
    except (KeyError, TypeError, ValueError) as e:
        raise ArtifactError(f"the served model's per-layer attention config: {e}") from e
    return {i: replace(model, **own[i]) if i in own else model for i in expected_layers(model_config)}


def open_artifacts(
    artifacts_dir: str | Path,
    *,
    model_dir: str | Path | None = None,
    model_config: dict | None = None,
    expected_fingerprint: str | None = None,
    verify: str | None = None,
) -> MlaArtifacts:
    """Open and validate the artifacts in `artifacts_dir` (a converted model's `mla/` directory).

    `model_dir`: the served model directory; its config.json (unless `model_config` is given) must
    have the artifacts' dims and every decoder layer must have artifacts, and when it holds
    `mla-convert-manifest.json` its source fingerprint must be the artifacts'.
    `expected_fingerprint`: checked too when given. `verify`: "size" (default: file sizes and headers)
    or "sha256" (also hash each layer file when it is loaded); default from $MLA_RUNTIME_VERIFY.
    """
    artifacts_dir = Path(artifacts_dir)
    verify = verify or envs.verify_mode()
    if verify not in envs.VERIFY_MODES:
        raise ArtifactError(f"verify mode {verify!r}: expected one of {', '.join(envs.VERIFY_MODES)}")
    if not artifacts_dir.is_dir():
        raise ArtifactError(f"{artifacts_dir}: no such directory of MLA artifacts")
    manifest = read_manifest(artifacts_dir)
    arts = MlaArtifacts(artifacts_dir, manifest, verify)
    config_path = None
    if model_dir is not None and model_config is None:
        config_path, model_config = _model_config(Path(model_dir)) or (None, None)
    if model_config is not None:
        try:
            served, model = served_layer_dims(model_config), MlaDims.from_model_config(model_config)
        except ArtifactError as e:
            if config_path is None:
                raise
            raise ArtifactError(f"{config_path}: {e}") from e
        _check_served_model(manifest, artifacts_dir, served, model)
    _check_fingerprints(manifest, artifacts_dir, model_dir, expected_fingerprint)
    for layer in manifest.layer_ids():
        arts.check_size(layer)
    return arts


def _check_served_model(manifest, artifacts_dir: Path, served: dict[int, MlaDims], model: MlaDims) -> None:
    """Each decoder layer of the served model has artifacts, at the MLA dims the served config gives
    that layer (`served`; the artifacts' layers beyond them, a drafter's, at the model's dims)."""
    manifest_path = artifacts_dir / MANIFEST_NAME
    ids = manifest.layer_ids()
    wanted = {i: served.get(i, model) for i in ids}
    differ: dict[str, list[int]] = {}
    for i, dims in wanted.items():
        ours = manifest.dims_of(i)
        if dims != ours:
            diffs = ", ".join(
                f"{k}: served {getattr(dims, k)} vs artifacts {getattr(ours, k)}"
                for k in MlaDims.__dataclass_fields__
                if getattr(dims, k) != getattr(ours, k)
            )
            differ.setdefault(diffs, []).append(i)
    if differ:
        diffs, layers = next(iter(differ.items()))
        where = "" if len(layers) == len(ids) else f" on layers {_ranges(layers)}"
        raise ArtifactError(f"{manifest_path}: MLA dims differ from the served model's config ({diffs}){where}")
    missing = [i for i in served if i not in set(ids)]
    if missing:
        first = missing[0]
        raise ArtifactError(
            f"layer {first}: no MLA artifacts (expected {artifacts_dir / layer_file_name(first)}); "
            f"layers {_ranges(missing)} of the served model are missing from {manifest_path}"
        )


def _check_fingerprints(manifest, artifacts_dir: Path, model_dir, expected_fingerprint: str | None) -> None:
    """The artifacts' source fingerprint is the one expected, and the one the served directory's
    conversion manifest records (where it has one)."""
    manifest_path = artifacts_dir / MANIFEST_NAME
    fingerprints = []
    if expected_fingerprint is not None:
        fingerprints.append((expected_fingerprint, "the expected source fingerprint"))
    if model_dir is not None:
        conv = Path(model_dir) / CONVERT_MANIFEST_NAME
        if conv.exists():
            record = _json_object(conv, "the conversion manifest")
            fp, status = record.get("source_fingerprint"), record.get("status")
            if not isinstance(status, str) or not isinstance(fp, str | None):
                raise ArtifactError(f"{conv}: status and source_fingerprint must be strings; the file is damaged")
            if status != "complete":  # a conversion cut short: its files may be half there
                raise ArtifactError(
                    f"{model_dir}: an unfinished mla-convert conversion ({CONVERT_MANIFEST_NAME} says {status!r}); "
                    "finish it with the same mla-convert command and --resume, then start again"
                )
            if fp is not None:
                fingerprints.append((str(fp), str(conv)))
    for fp, origin in fingerprints:
        if fp != manifest.source_fingerprint:
            raise ArtifactError(
                f"{manifest_path}: the artifacts were computed from another checkpoint (source fingerprint "
                f"{manifest.source_fingerprint[:16]}... vs {fp[:16]}... in {origin}); use the {MLA_DIR_NAME}/ "
                "directory written with this model"
            )
