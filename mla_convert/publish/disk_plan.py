"""What `convert --upload` holds on disk, from the plan alone: each output file's exact size, each
job's ticket (its new source shards and its output files, reserved together in job order:
output.budget), the smallest budget that works, and the default one.

The smallest budget is that of the run with one job at a time: at job k the disk holds the source
shards a later job still needs, job k's own shards and its output files; the run's last stage adds
the small files (side files, config, index, card, manifests) once every shard is gone. A budget
below it would wait forever on the job that does not fit; it is refused before the first byte.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from mla_convert.errors import ConvertError
from mla_convert.plan.planner import Plan, mla_file_rel
from mla_runtime.format import ARTIFACT_ST_DTYPE, w_uk_t_name, w_uv_name
from mla_runtime.safetensors_file import encode_header, nbytes_of

DEFAULT_MAX_DISK = 40 * 10**9  # with --upload: room for a few shards in each stage at DeepSeek-R1's size
BOOKKEEPING = 2**20  # the journal, the lock and the manifest 'incomplete', in --out for the whole run


def file_sizes(plan: Plan) -> dict[str, int]:
    """Each output file a shard job writes -> its exact size (header and data), as written."""
    sizes = {}
    for job in plan.shards:
        specs = {t.name: (t.dtype, t.shape) for t in job.tensors}
        sizes[job.file] = _size(specs)
        for layer in job.mla_layers:
            dims = plan.dims_of(layer)
            specs = {
                w_uk_t_name(layer): (ARTIFACT_ST_DTYPE, dims.w_uk_t_shape()),
                w_uv_name(layer): (ARTIFACT_ST_DTYPE, dims.w_uv_shape()),
            }
            sizes[mla_file_rel(layer)] = _size(specs)
    return sizes


def _size(specs: dict) -> int:
    return len(encode_header(specs, {"format": "pt"})) + sum(nbytes_of(d, s) for d, s in specs.values())


@dataclass(frozen=True)
class DiskPlan:
    minimum: int  # the smallest budget that works
    everything: int  # every source shard and output file at once: the most a run could hold
    last_stage: int  # the last stage's files (side files, config, index, card, manifests), at most
    staged: int  # in --out for the whole run: the bookkeeping, a Hub source's small files (staged)


def disk_plan(plan: Plan, shard_sizes: dict[str, int] | None, jobs: list[str] | None = None) -> DiskPlan:
    """The disk the run of `jobs` (default: all, in plan order) holds. `shard_sizes`: the source
    shards it downloads (None: a local source, not on this disk)."""
    sizes = file_sizes(plan)
    by_file = {job.file: job for job in plan.shards}
    outputs = plan.job_outputs()
    jobs = [job.file for job in plan.shards] if jobs is None else jobs
    inputs = {j: sorted(set(plan.inputs_of(by_file[j]).values())) if shard_sizes is not None else [] for j in jobs}
    last_user = {f: k for k, j in enumerate(jobs) for f in inputs[j]}
    side = sum((plan.source.root / f).stat().st_size for f in plan.source.side_files)
    staged = BOOKKEEPING + (side if shard_sizes is not None else 0)
    minimum = 0
    on_disk: set[str] = set()
    for k, j in enumerate(jobs):
        on_disk |= set(inputs[j])
        out = sum(sizes[rel] for rel in outputs[j])
        minimum = max(minimum, out + sum(shard_sizes[f] for f in on_disk) if shard_sizes else out)
        on_disk = {f for f in on_disk if last_user[f] > k}
    last = side + _small_files(plan)
    sources = sum(shard_sizes[f] for f in last_user) if shard_sizes else 0
    everything = sum(sizes[rel] for j in jobs for rel in outputs[j]) + sources + staged + last
    return DiskPlan(staged + max(minimum, last), everything, last, staged)


def resume_minimum(
    plan: Plan,
    shard_sizes: dict[str, int] | None,
    needed: DiskPlan,
    unchecked: dict[str, int],
    todo: list[str],
    leftovers: set[str],
) -> int:
    """The smallest budget a --resume works in, one job at a time: the files the earlier run left
    unchecked (`unchecked`: job -> bytes, in the order they are checked again) hold their room until
    checked and committed, each check needs its job's source shards again, the shards an earlier run
    left in the staging directory (`leftovers`) hold theirs until used, and the jobs still to
    convert (`todo`) follow as in a fresh run (at least `needed.minimum`, the budget that run needs)."""
    by_file = {job.file: job for job in plan.shards}
    sizes = file_sizes(plan)
    outputs = plan.job_outputs()
    jobs = [*unchecked, *todo]
    inputs = {j: set(plan.inputs_of(by_file[j]).values()) if shard_sizes is not None else set() for j in jobs}
    last_user = {f: k for k, j in enumerate(jobs) for f in inputs[j]}
    on_disk = {f for f in leftovers if f in last_user}
    used = needed.staged + sum(unchecked.values()) + sum(shard_sizes[f] for f in on_disk)
    minimum = used
    for k, j in enumerate(jobs):
        out = unchecked[j] if j in unchecked else sum(sizes[rel] for rel in outputs[j])
        new = inputs[j] - on_disk
        used += sum(shard_sizes[f] for f in new) + (0 if j in unchecked else out)
        minimum = max(minimum, used)
        on_disk |= new
        done = {f for f in on_disk if last_user[f] <= k}
        used -= out + sum(shard_sizes[f] for f in done)
        on_disk -= done
    return max(minimum, needed.minimum)


def _small_files(plan: Plan) -> int:
    """A bound on the bytes of the config, the index, the card and the two manifests."""
    names = sum(len(t.name) + len(job.file) + 16 for job in plan.shards for t in job.tensors)
    config = len(json.dumps(plan.config, indent=2))
    files = len(file_sizes(plan)) + len(plan.source.side_files) + 8
    return 2 * (names + config + 256 * files + 300 * len(plan.mla_layers)) + 64 * 1024


def default_budget(needed: DiskPlan, out_dir: Path) -> int:
    """With --upload and no --max-disk: DEFAULT_MAX_DISK, or the most the run could hold if less,
    within nine tenths of what --out's filesystem has free, and never below the smallest that works."""
    from mla_convert.output.out_dir import nearest_existing

    free = shutil.disk_usage(nearest_existing(out_dir)).free
    return max(needed.minimum, min(DEFAULT_MAX_DISK, needed.everything, free * 9 // 10))


UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}


def parse_size(value: int | str | None) -> int | None:
    """--max-disk SIZE: bytes, or a number with K, M, G, T (powers of 1000) or KiB, MiB, GiB, TiB
    (of 1024), B optional: 40G, 40GB, 37.5GiB, 40000000000."""
    if value is None or isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?)?B?\s*", str(value).upper())
    if m is None:
        raise ConvertError(f"--max-disk {value!r}: expected a size such as 40GB, 500MB, 1.5TB or 37GiB")
    return int(float(m.group(1)) * UNITS[m.group(2) or ""])
