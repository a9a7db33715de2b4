"""verify's per-file pass on one shard job's files as soon as they are written (`convert --upload`):
each file checked as `verify --source` checks it (values, its tensors against the source bytes they
were made from while those are still on disk, an artifact file's MLA check), read back from the
bytes just written (the page cache), and not hashed again: the converter hashed them as it wrote
them, and that sha256 is the one the manifest records and the upload sends.

The tasks are verify's own (tasks.file_tasks, run by data_pass.run_file_task), built from the plan
instead of the output's config, index and MLA manifest, which are written last.
"""

from __future__ import annotations

from pathlib import Path

from mla_convert.errors import VerificationError
from mla_convert.io.headers import read_header
from mla_convert.output.journal import Journal
from mla_convert.plan.planner import Plan, mla_file_rel
from mla_convert.results import Failure
from mla_convert.verification.data_pass import run_file_task
from mla_convert.verification.expects import expects_from_plan
from mla_convert.verification.structure import Structure
from mla_convert.verification.tasks import FileTask, file_tasks
from mla_runtime.format import LayerEntry, MlaManifest

JobFiles = list[tuple[str, int, str]]  # (relative path, size, sha256), as the journal records them


def job_tasks(plan: Plan, out_dir: Path, files: JobFiles) -> list[FileTask]:
    """A task for each of `files` (one shard job's, written in `out_dir`), as verify with
    --source builds it for that file."""
    src = plan.source
    rels = {rel for rel, _, _ in files}
    layers = {mla_file_rel(i): i for job in plan.shards for i in job.mla_layers if mla_file_rel(i) in rels}
    shards = sorted(rels - set(layers))
    structure = Structure(
        config=src.config, model=src.model, names=src.names, index_name=plan.index_name, dims=src.dims
    )
    structure.expects = expects_from_plan(plan)
    structure.weight_map = {t.name: job.file for job in plan.shards if job.file in rels for t in job.tensors}
    structure.headers = {rel: read_header(out_dir / rel) for rel in shards}
    structure.mla_layers = sorted(layers.values())
    structure.mla_headers = {i: read_header(out_dir / rel) for rel, i in layers.items()}
    recorded = {rel: (size, sha) for rel, size, sha in files}
    entries = tuple(LayerEntry(i, Path(rel).name, *recorded[rel], src.own_dims(i)) for rel, i in sorted(layers.items()))
    structure.mla_manifest = MlaManifest(dims=src.dims, layers=entries, source_fingerprint=src.fingerprint())
    manifest = {"files": {rel: {"size": size, "sha256": sha} for rel, (size, sha) in recorded.items()}}
    return file_tasks(out_dir, structure, manifest, plan.options, src)


def check_job_files(plan: Plan, out_dir: Path, files: JobFiles) -> list[Failure]:
    """Every check of verify --source on `files`; the failures (none: each file may go up)."""
    failures = []
    for task in job_tasks(plan, out_dir, files):
        result = run_file_task(task, hashed=False)
        failures += result.tally.failures
        if result.size is None:
            failures.append(Failure("integrity", "missing-file", task.rel, expected="the file just written"))
    return failures


def check_not_sent_away(root: Path, manifest: dict) -> None:
    """`verify DIR` of a --out whose files `convert --upload` sent to the Hub and deleted here, every
    one (the journal records where; the manifest and the journal remain): one VerificationError line
    naming the command that checks them there, rather than every check of a file that is not here
    failing. Where some are still here, verify checks those (integrity counts the rest as sent)."""
    records = Journal(root).files()
    listed = list(manifest.get("files") or {})
    gone = [rel for rel in listed if not (root / rel).exists()]
    sent = [records[rel] for rel in gone if rel in records and records[rel].on_hub]
    if not listed or len(sent) < len(listed):
        return
    repo, revision = sent[0].repo, sent[0].revision
    command = f"mla-convert verify {repo}" + (f" --revision {revision}" if revision and revision != "main" else "")
    raise VerificationError(
        f"{root}: `convert --upload` sent {len(sent)} of its {len(manifest['files'])} files to {repo} and deleted "
        f"them here (the manifest and the journal remain); check them where they are: {command} (with --download "
        "for every check of a local verify)"
    )
