"""The library's entry points: `convert`, `verify`, `upload` and `card`, keyword-only past their paths, each
returning a typed result (mla_convert.results); and `demo`, the offline demo the CLI runs. The CLI is a
thin shell over these.

    import mla_convert

    result = mla_convert.convert("/data/DeepSeek-R1", "/data/R1-channel-fp8", target="gaudi2", workers=2)
    report = mla_convert.verify(result.out, source="/data/DeepSeek-R1")
    assert report.ok, [f.line() for f in report.failures()]

torch is imported when a function is first called, not when mla_convert is imported.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from mla_convert.errors import ConvertError
from mla_convert.output.lock import locked
from mla_convert.results import CardResult, ConversionResult, DemoResult, UploadResult, VerifyReport
from mla_convert.settings import MessageFn, Options, ProgressFactory, RunSettings, UploadOptions

_OPTION_FIELDS = frozenset(f.name for f in dataclasses.fields(Options))
_SETTING_FIELDS = frozenset(f.name for f in dataclasses.fields(RunSettings))
_UPLOAD_FIELDS = frozenset(f.name for f in dataclasses.fields(UploadOptions))


def convert(
    source: str | Path,
    out_dir: str | Path,
    *,
    options: Options | None = None,
    settings: RunSettings | None = None,
    upload: str | None = None,
    upload_options: UploadOptions | None = None,
    max_disk: int | str | None = None,
    **fields,
) -> ConversionResult:
    """Convert the checkpoint `source` (a directory or a Hub repo id) into `out_dir`.

    What to produce is `options` (Options: format, target, ignore), how to run is `settings`
    (RunSettings: workers, device, kernels, write_io, revision, stream, dry_run, resume,
    overwrite, ignore_free_space, progress_factory, status, notice); any of those fields may
    instead be given by name, replacing the field of the object given (or of the default):
    `convert(src, out, format="bf16", workers=2)`.

    `upload="OWNER/NAME"` publishes the conversion on the Hub as it goes (publish.hub_to_hub):
    each file checked, sent, and deleted from `out_dir` once committed, within `max_disk` (bytes,
    or a size such as "40GB"; default: publish.disk_plan.default_budget); `upload_options`
    (UploadOptions: revision, the branch; create; private; overwrite) as for `upload`. A Hub source
    is then streamed.

    Raises ConvertError (SourceError, OutputError, UploadError) with a one-line message for anything
    the caller can act on, its cause chained; after KeyboardInterrupt, `resume=True` finishes the
    output (and the upload).
    """
    unknown = sorted(set(fields) - _OPTION_FIELDS - _SETTING_FIELDS)
    if unknown:
        raise TypeError(f"convert() got unexpected keyword arguments {', '.join(unknown)}")
    options = dataclasses.replace(options or Options(), **{k: v for k, v in fields.items() if k in _OPTION_FIELDS})
    settings = dataclasses.replace(
        settings or RunSettings(), **{k: v for k, v in fields.items() if k in _SETTING_FIELDS}
    )
    _workers_can_start(settings.workers)
    if upload is None:
        if upload_options is not None or max_disk is not None:
            raise TypeError("convert(): upload_options and max_disk go with upload=OWNER/NAME")
        from mla_convert.conversion.pipeline import convert as run

        return run(source, out_dir, options, settings)
    from mla_convert.publish.hub_to_hub import convert_and_upload

    return convert_and_upload(source, out_dir, upload, options, settings, upload_options or UploadOptions(), max_disk)


def verify(
    out_dir: str | Path,
    *,
    source: str | Path | None = None,
    workers: int = 1,
    progress_factory: ProgressFactory | None = None,
    notice: MessageFn | None = None,
    revision: str | None = None,
    download: bool = False,
    max_disk: int | None = None,
    status: MessageFn | None = None,
) -> VerifyReport:
    """Verify `out_dir`, a directory mla-convert wrote, optionally against its `source` (every
    tensor compared with the exact value of the source's). `report.ok` when every check passed;
    `report.failures()` names each failure's check, file, tensor, expected and found.

    Holds `out_dir`'s lock while it reads, as `mla-convert verify` does: refused (OutputError,
    naming the PID) while a conversion, a card or an upload holds it; `notice` hears of a stale
    lock taken over. Raises VerificationError (a ConvertError) when verification cannot run: not
    an mla-convert output, an unreadable manifest, a `source` that cannot be opened or is not the
    one `out_dir` was converted from.

    `out_dir` an OWNER/NAME that is not a local path: the conversion published on the Hub
    (verification.remote), at `revision` (default main): its files' sizes and sha256 as the Hub
    records them against the manifest, without downloading them; with `download`, every check of
    a local verify (and `source`), the files downloaded in turn, at most `max_disk` bytes at once;
    `status` hears what runs now, `notice` what was downloaded.
    """
    from mla_convert.settings import is_repo_target

    if is_repo_target(out_dir):
        from mla_convert.verification.remote import verify_repo

        return verify_repo(
            str(out_dir), revision=revision, source=source, download=download, max_disk=max_disk,
            progress_factory=progress_factory, status=status, notice=notice,
        )  # fmt: skip
    if revision is not None or download or max_disk is not None:
        from mla_convert.errors import VerificationError

        raise VerificationError(
            f"{out_dir}: a local directory; --revision, --download and --max-disk are for a Hub repo"
        )
    _workers_can_start(workers)
    from mla_convert.verification.api import verify as run

    with locked(Path(out_dir), "verify", notice):
        return run(out_dir, source, workers=workers, progress_factory=progress_factory)


def _workers_can_start(workers: int) -> None:
    """Worker processes start without the caller's script (process.workers); where they cannot, a
    script that calls from its top level unguarded is refused before any work, saying what to add."""
    if workers > 1:
        from mla_convert.process.workers import unguarded_script

        if (line := unguarded_script()) is not None:
            raise ConvertError(line)


def upload(
    out_dir: str | Path,
    repo_id: str,
    *,
    options: UploadOptions | None = None,
    progress_factory: ProgressFactory | None = None,
    check_progress_factory: ProgressFactory | None = None,
    status: MessageFn | None = None,
    **fields,
) -> UploadResult:
    """Upload `out_dir`, a directory mla-convert wrote, to the Hub model repo `repo_id`, as
    `mla-convert upload` does: its card written for `repo_id` first (recorded in the directory),
    then exactly the files its manifest lists, after verify's structure and integrity checks; the
    same call after an interruption sends only what the branch does not hold yet. Token:
    huggingface_hub's own.

    `options` (UploadOptions: revision (the branch, default main), private, create, overwrite,
    skip_verify, dry_run); any of its fields may instead be given by name:
    `upload(out, "org/name", create=True)`. `progress_factory`: the upload's bytes;
    `check_progress_factory`: verify's reading of every file first; `status`: what runs now.

    Holds `out_dir`'s lock from the first check to the last call (it writes the card there, and
    a conversion must not rewrite the files under it): refused, naming the PID, while another run
    holds it. Raises UploadError (a ConvertError) with a one-line message when the upload is
    refused or fails; after KeyboardInterrupt, `e.upload_state` (publish.upload.UploadJob, when it
    had started) says what is on the Hub.
    """
    unknown = sorted(set(fields) - _UPLOAD_FIELDS)
    if unknown:
        raise TypeError(f"upload() got unexpected keyword arguments {', '.join(unknown)}")
    options = dataclasses.replace(options or UploadOptions(), **fields)
    from mla_convert.publish.upload import prepare, run

    with locked(Path(out_dir), "upload", status):
        job = prepare(out_dir, repo_id, options, check_progress=check_progress_factory, status=status)
        return run(job, progress_factory, status)


def card(
    out_dir: str | Path,
    *,
    base_model: str | None = None,
    repo_id: str | None = None,
    keep: bool = False,
    overwrite: bool = False,
) -> CardResult:
    """Write the model card of `out_dir` (a finished conversion) again, without the source: with
    `base_model` (a Hub model id) and `repo_id` (the repo its download and serve lines name) when
    given, else the recorded ones; the manifest records the new card. verify passes afterwards.

    What its user wrote around mla-convert's sections (and their own metadata keys and tags) is
    kept, and recorded. An edit inside a section mla-convert writes is refused (OutputError naming
    README.md and the section) unless `keep` (kept as edited, and in later cards too) or
    `overwrite` (written again from the facts).

    Holds `out_dir`'s lock while it writes, as `mla-convert card` does. Raises OutputError (a
    ConvertError) with a one-line message when it cannot: no such directory, another run holds the
    directory, not a finished conversion, converted with --no-card, an edit inside a section, or a
    base model or repo that is not a Hub id.
    """
    from mla_convert.errors import OutputError
    from mla_convert.output.card import BASE_MODEL_HINT, render_card

    if not Path(out_dir).is_dir():  # before the lock, which would say that it cannot be taken
        raise OutputError(f"{out_dir}: {'not a directory' if Path(out_dir).exists() else 'no such directory'}")
    with locked(Path(out_dir), "card", None):
        done = render_card(Path(out_dir), base_model=base_model, repo_id=repo_id, keep=keep, overwrite=overwrite)
    hint = None if done.base_model else BASE_MODEL_HINT.replace("DIR", str(out_dir), 1)
    return CardResult(str(out_dir), str(done.path), done.changed, done.base_model, done.repo_id, hint)


def demo(
    out_dir: str | Path | None = None,
    *,
    member: str | None = None,
    overwrite: bool = False,
    options: Options | None = None,
    **fields,
) -> DemoResult:
    """The offline demo, as `mla-convert demo` runs it: the tiny checkpoint of family `member`
    (source.family.demo_members(); default the first) written to `out_dir`/source (default: a new
    temporary directory), converted to `out_dir`/converted-FORMAT and verified against it.
    `options` (or its fields by name: `demo(format="bf16")`) say what to convert to; `overwrite`
    replaces an earlier demo in `out_dir`, and only that. Not part of the public API (docs/api.md)."""
    unknown = sorted(set(fields) - _OPTION_FIELDS)
    if unknown:
        raise TypeError(f"demo() got unexpected keyword arguments {', '.join(unknown)}")
    options = dataclasses.replace(options or Options(), **fields)
    from mla_convert.demo.run import run_demo

    return run_demo(out_dir, options, overwrite, *(() if member is None else (member,)))
