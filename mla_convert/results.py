"""What the library's entry points return: typed results, each with `to_json()` giving the dict the
CLI prints for `--json`. Standard library only.

- `ConversionResult`: what `mla_convert.convert()` planned and did (a dry run: the plan and the
  free-space numbers only).
- `VerifyReport`: what `mla_convert.verify()` checked, with every failure (`Failure`) and the
  tensors furthest from their source (`TensorStats`).
- `DemoResult`: the demo's conversion and its verification, and where it left its files.
- `UploadResult`: what `mla-convert upload` sent to the Hub (a dry run: what it would send).
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass


def _present(obj) -> dict:
    """The fields of `obj` in declaration order, those left None (not part of this run) omitted."""
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if getattr(obj, f.name) is not None}


@dataclass(frozen=True)
class ConversionResult:
    # The plan (plan.planner.Plan.summary).
    source: str  # the source directory, or REPO@COMMIT for a Hub source
    format: str
    target: str
    fp8_max: float
    shards: int
    tensors_in: int
    tensors_out: int
    fp8_weights_converted: int  # block-FP8 weights of the source
    bf16_linears_quantized: int  # 16-bit linears quantized to channel FP8
    mla_layers: int  # layers with W_UK_T / W_UV artifacts
    bytes_in: int
    bytes_out_model: int
    bytes_out_mla: int
    bytes_out: int  # the whole output: shards, artifacts and side files
    ignored_modules: int  # the linears the output config's ignore list leaves in 16 bits (by pattern or name)
    # Each --ignore pattern -> the linears it left unquantized (plan.ignore); None without --ignore.
    # Keyword-only, so that it sits with the plan's fields in to_json and still has a default.
    ignored_by_pattern: dict[str, int] | None = dataclasses.field(default=None, kw_only=True)
    out: str
    dry_run: bool
    workers: int
    device: str
    # A Hub source.
    hub_commit: str | None = None
    download_bytes: int | None = None
    disk_required_download_then_convert: int | None = None  # on --out's filesystem, each way
    disk_required_stream: int | None = None
    # Free space (output.preflight.space): what this run needs on --out's filesystem, and has.
    disk_required: int | None = None
    disk_free: int | None = None
    disk_freed_by_overwrite: int | None = None
    cache_dir: str | None = None
    cache_required: int | None = None
    cache_free: int | None = None
    # How it ran (not in a dry run).
    kernels: str | None = None
    kernels_reason: str | None = None
    compute_device: str | None = None
    device_check: str | None = None  # kernels.fastest: not needed, passed, differed, failed
    device_reason: str | None = None
    write_io: str | None = None
    write_io_reason: str | None = None
    peak_source_bytes_on_disk: int | None = None  # --stream
    status: str | None = None  # "complete"
    resumed_jobs: int | None = None  # shard jobs a --resume kept
    files: int | None = None
    seconds: float | None = None
    gb_per_s: float | None = None
    source_fingerprint: str | None = None
    base_model: str | None = None  # the card's base_model (a Hub model id); None: none, or no card
    base_model_hint: str | None = None  # a card without base_model: how to set it, one line
    # convert --upload (publish.hub_to_hub): where, within which disk budget, and how each stage went.
    upload_repo: str | None = None
    upload_revision: str | None = None  # the branch
    upload_url: str | None = None
    disk_budget: int | None = None  # --max-disk (or its default): source shards and output files at once
    disk_budget_min: int | None = None  # the smallest budget that works (one job at a time)
    disk_peak_planned: int | None = None  # the most the run may hold at once: the budget, or all of it if less
    disk_peak: int | None = None  # the most it held (reserved) at once; never above disk_budget
    checked_files: int | None = None  # files checked as verify --source checks them, before they were sent
    uploaded_files: int | None = None  # committed by this run
    uploaded_bytes: int | None = None
    skipped_files: int | None = None  # on the branch already at their sha256 (a --resume): not sent
    skipped_bytes: int | None = None
    commits: tuple[str, ...] | None = None  # the commit ids this run made, in order; the last holds the config
    created: tuple[str, ...] | None = None  # "repo", "branch": what --create made
    deleted: tuple[str, ...] | None = None  # another model's files the last commit removed (--overwrite)
    stage_seconds: dict[str, float] | None = None  # download, convert, check, upload: each stage's busy seconds

    def to_json(self) -> dict:
        return _present(self)


@dataclass(frozen=True)
class Failure:
    group: str
    check: str  # short id of the check, e.g. "sha256", "nan", "fp8-bound"
    file: str | None = None  # relative to the verified directory (or to --source)
    tensor: str | None = None
    expected: str = ""
    found: str = ""

    def line(self) -> str:
        where = " ".join(x for x in (self.file, repr(self.tensor) if self.tensor else None) if x)
        return f"[{self.group}/{self.check}] {where or '-'}: expected {self.expected}; found {self.found}"


@dataclass(frozen=True)
class TensorStats:
    """How far one converted tensor is from the exact fp32 dequant of its source tensor."""

    file: str
    tensor: str
    op: str  # "fp8" | "bf16"
    max_abs_err: float
    rel_err: float  # ||converted - exact||_2 / ||exact||_2
    cosine: float
    bound_use: float  # max over elements of |err| / allowed error (<= 1 passes)


@dataclass(frozen=True)
class CheckGroup:
    title: str
    checked: int
    failed: int
    skipped: str | None  # why the group did not run (no --source), else None
    failures: tuple[Failure, ...]  # the first MAX_LISTED of them
    failures_not_listed: int

    def to_json(self) -> dict:
        return {
            "title": self.title,
            "checked": self.checked,
            "failed": self.failed,
            "skipped": self.skipped,
            "failures": [asdict(f) | {"message": f.line()} for f in self.failures],
            "failures_not_listed": self.failures_not_listed,
        }


@dataclass(frozen=True)
class VerifyReport:
    dir: str
    source: str | None
    format: str
    target: str
    fp8_max: float
    files: int
    tensors: int
    mla_layers: int
    workers: int
    readers: str  # verification.readers: native or torch
    readers_reason: str
    tolerances: dict[str, str]
    ok: bool
    exit_code: int  # 0: every check passed; 1: a check failed
    groups: dict[str, CheckGroup]
    worst_tensors: tuple[TensorStats, ...]
    bytes_read: int
    seconds: float = 0.0

    def failures(self) -> list[Failure]:
        return [f for g in self.groups.values() for f in g.failures]

    def to_json(self) -> dict:
        return {
            **{k: getattr(self, k) for k in ("dir", "source", "format", "target", "fp8_max", "files", "tensors")},
            **{k: getattr(self, k) for k in ("mla_layers", "workers", "readers", "readers_reason", "tolerances")},
            "ok": self.ok,
            "exit_code": self.exit_code,
            "groups": {name: g.to_json() for name, g in self.groups.items()},
            "worst_tensors": [asdict(s) for s in self.worst_tensors],
            "bytes_read": self.bytes_read,
            "seconds": self.seconds,
        }


@dataclass(frozen=True)
class DemoResult:
    conversion: ConversionResult
    report: VerifyReport  # the conversion verified against its tiny source
    demo_dir: str
    demo_bytes: int  # what the demo left on disk: the source and its conversion

    def to_json(self) -> dict:
        """The conversion's --json, with the verdict and the demo's directory."""
        groups = self.report.groups.values()
        verdict = {
            "ok": self.report.ok,
            "checks": sum(g.checked for g in groups),
            "failed": sum(g.failed for g in groups),
            "seconds": self.report.seconds,
        }
        return self.conversion.to_json() | {"verify": verdict, "demo_dir": self.demo_dir, "demo_bytes": self.demo_bytes}


@dataclass(frozen=True)
class UploadResult:
    dir: str
    repo: str
    revision: str
    url: str  # the branch on the Hub
    dry_run: bool
    files: int  # the manifest's files and the manifest: what the branch holds once done
    bytes: int
    uploaded_files: int  # sent by this run (a dry run: none)
    uploaded_bytes: int
    skipped_files: int  # on the branch already, with the same sha256
    skipped_bytes: int
    commits: tuple[str, ...] = ()  # the commit ids this run made, in order
    deleted: tuple[str, ...] = ()  # files of another model the last commit removed (--overwrite)
    created: tuple[str, ...] = ()  # "repo", "branch": what --create made
    verified: str | None = None  # what was checked before the upload, or why not
    seconds: float | None = None
    plan: tuple[dict, ...] = ()  # each commit's files, {"commit": n, "path", "size"}, in upload order
    card: str | None = None  # "written for REPO_ID", "already written for REPO_ID"; None: no card of its own
    base_model_hint: str | None = None  # the card names no base model: how to set it, one line
    would_upload_files: int | None = None  # a dry run: what it would send, nothing being known of the Hub
    would_upload_bytes: int | None = None

    def to_json(self) -> dict:
        out = _present(self)
        for key in ("commits", "deleted", "created", "plan"):
            out[key] = [*getattr(self, key)]
        return out


@dataclass(frozen=True)
class CardResult:
    """`mla-convert card DIR`: the model card written again."""

    dir: str
    card: str  # its path
    changed: bool  # False: it already was this card (nothing written)
    base_model: str | None  # a Hub model id, or None: the card names none
    repo_id: str | None  # the repo it is written for, or None: the local directory
    base_model_hint: str | None = None  # no base model: how to set it, one line

    def to_json(self) -> dict:
        return dataclasses.asdict(self)
