"""What a command shows while it works and when it is done: progress on stderr (a status line and a
bar on a terminal, plain lines in a log), the conversion summary and the verify report as tables,
and paths and next commands as whole lines, each printed from its typed result (mla_convert.results).
rich is imported when first needed, not at start-up."""

from __future__ import annotations

import contextlib
import shlex
import sys
import threading
import time

import typer

from mla_convert import envs, formats
from mla_convert.results import CardResult, ConversionResult, DemoResult, UploadResult, VerifyReport
from mla_convert.units import duration, gb


class ProgressLines:
    """Progress for a log (stderr not a terminal: nohup, CI, a job scheduler): one plain line every
    `interval` seconds with the bytes done, the speed and the time left."""

    def __init__(self, description: str, total: int, interval: float):
        self.description, self.total, self.interval = description, total, interval
        self.done = 0
        self.start = self.last = time.monotonic()
        self.lock = threading.Lock()  # verify advances from several threads

    def advance(self, n: int) -> None:
        with self.lock:
            self.done += n
            now = time.monotonic()
            if now - self.last < self.interval:
                return
            self.last = now
            rate = self.done / max(now - self.start, 1e-9)
            left = max(self.total - self.done, 0)
            eta = duration(left / rate) if rate > 0 else "unknown"
            pct = 100 * self.done / self.total if self.total else 100.0
            typer.echo(
                f"{self.description}: {gb(self.done)} of {gb(self.total)} ({pct:.1f} %), "
                f"{rate / 1e9:.2f} GB/s, about {eta} left",
                err=True,
            )


class Reporter:
    """What a long command shows on stderr while it works: on a terminal a status line through
    start-up and then a progress bar that ends at 100 %; in a log, plain progress lines at a steady
    interval (envs.progress_interval: MLA_CONVERT_PROGRESS_INTERVAL seconds, default 30); with
    --quiet, nothing. A notice
    (a line worth keeping, such as the plan) is printed in every mode but quiet."""

    def __init__(self, quiet: bool, description: str):
        self.quiet, self.description = quiet, description
        self.tty = sys.stderr.isatty()
        self.interval = envs.progress_interval()
        self.console = rich_console(stderr=True)
        self.spinner = None
        self.bar = None
        self.tasks: list = []

    def status(self, message: str) -> None:
        if self.quiet or not self.tty or self.bar is not None:
            return
        if self.spinner is None:
            self.spinner = self.console.status(message)
            self.spinner.start()
        else:
            self.spinner.update(message)

    def notice(self, message: str) -> None:
        if not self.quiet:
            self.console.print(message, soft_wrap=True, highlight=False, markup=False)

    def _stop_spinner(self) -> None:
        if self.spinner is not None:
            self.spinner.stop()
            self.spinner = None

    def progress_factory(self, total: int):
        if self.quiet:
            return None
        if not self.tty:
            return ProgressLines(self.description, total, self.interval).advance
        self._stop_spinner()
        if self.bar is None:
            from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

            self.bar = Progress(
                "[progress.description]{task.description}",
                BarColumn(),
                DownloadColumn(),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
                console=self.console,
                transient=False,
            )
            self.bar.start()
        task = self.bar.add_task(self.description, total=total)
        self.tasks.append(task)
        return lambda n: self.bar.advance(task, n)

    def close(self, finished: bool) -> None:
        self._stop_spinner()
        if self.bar is not None:
            if finished:  # what was counted may fall short of the total (headers, a resume's kept files)
                for task in self.tasks:
                    self.bar.update(task, completed=self.bar.tasks[task].total)
            self.bar.stop()
            self.bar = None


@contextlib.contextmanager
def reporter(quiet: bool, description: str):
    reporter = Reporter(quiet, description)
    finished = False
    try:
        yield reporter
        finished = True
    finally:
        reporter.close(finished)


def rich_console(stderr: bool = False):
    from rich.console import Console

    return Console(stderr=stderr)


def print_summary(result: ConversionResult | DemoResult, title: str, source_arg: str | None = None) -> None:
    """The summary table, then the paths and the next commands as whole lines (soft-wrapped: a
    narrow terminal folds them, but they copy and paste whole). A demo's adds its verdict."""
    from rich.table import Table

    r = result.conversion if isinstance(result, DemoResult) else result
    table = Table(title=title, show_header=False)
    table.add_column(no_wrap=True)
    table.add_column()
    fmt = formats.get(r.format)
    rows = [
        ("format / target" if fmt.fp8_range else "format", fmt.label(r.target, r.fp8_max)),
        ("shards", str(r.shards)),
        ("tensors in -> out", f"{r.tensors_in} -> {r.tensors_out}"),
        ("block-FP8 weights converted", str(r.fp8_weights_converted)),
        ("16-bit linears quantized", str(r.bf16_linears_quantized)),
        ("MLA layers (W_UK_T / W_UV)", str(r.mla_layers)),
        ("bytes in", gb(r.bytes_in)),
        ("bytes out (model + mla)", f"{gb(r.bytes_out_model)} + {gb(r.bytes_out_mla)}"),
        ("bytes out, in all", gb(r.bytes_out)),
    ]
    if r.disk_required_stream is not None:
        rows += [
            ("disk needed, download then convert", gb(r.disk_required_download_then_convert)),
            ("disk needed, --stream", gb(r.disk_required_stream)),
        ]
    if r.disk_free is not None:
        rows.append(("free space", _space_row(r)))
    for i, (pattern, n) in enumerate((r.ignored_by_pattern or {}).items()):
        rows.append(("" if i else "left unquantized by --ignore", f"{n} linear{'s' * (n != 1)}: {pattern}"))
    if r.resumed_jobs:
        kept = r.resumed_jobs
        rows.append(("resumed", f"kept {kept} of {r.shards} shard jobs (re-hashed), redid {r.shards - kept}"))
    if r.seconds is not None:
        on = r.compute_device if r.compute_device is not None else r.device
        rows += [
            ("time", f"{r.seconds:.2f} s ({r.gb_per_s:.2f} GB/s of source)"),
            ("kernels", f"{r.kernels} on {on} ({r.kernels_reason})"),
        ]
        if r.device != "cpu" and r.device_reason:
            rows.append(("device", f"{r.device}: {r.device_check} ({r.device_reason})"))
        rows.append(("writes", f"{r.write_io} ({r.write_io_reason})"))
    if isinstance(result, DemoResult):
        v = result.report
        failed = sum(g.failed for g in v.groups.values())
        verdict = "pass" if v.ok else f"FAIL ({failed} failed)"
        rows += [
            ("verify --source", f"{verdict}: {sum(g.checked for g in v.groups.values())} checks in {v.seconds:.2f} s")
        ]
    for k, v in rows:
        table.add_row(k, v)
    console = rich_console()
    console.print(table)
    lines = [("source", r.source), ("output", r.out)]
    if r.base_model_hint:  # in the summary, not on stderr: a note, not a failure
        lines.append(("note", r.base_model_hint.replace("DIR", r.out, 1)))
    print_lines(console, lines)
    if r.seconds is not None and source_arg is not None:
        out = shlex.quote(r.out)
        check = f"mla-convert verify {out}" + (
            f" --source {shlex.quote(source_arg)}" if r.peak_source_bytes_on_disk is None else ""
        )
        print_lines(console, [("to check it", check), ("to serve it", f"vllm serve {out}")])


def _space_row(r: ConversionResult) -> str:
    freed = r.disk_freed_by_overwrite or 0
    row = f"{gb(r.disk_required)} needed of {gb(r.disk_free)} free"
    if freed:
        row += f" (+{gb(freed)} freed by --overwrite)"
    if r.cache_dir is not None:
        row += f"; download {gb(r.cache_required)} of {gb(r.cache_free)} free in the Hub cache"
    short = r.disk_required > r.disk_free + freed or (r.cache_required or 0) > (r.cache_free or 0)
    return row + (": NOT ENOUGH" if short else "")


def print_lines(console, items: list[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in items)
    for k, v in items:
        console.print(f"{k + ':':<{width + 1}} {v}", soft_wrap=True, highlight=False, markup=False)


def print_verify_report(report: VerifyReport, quiet: bool, listed: int = 10) -> None:
    """A table of the check groups; then each failure on one line (all of them also with --quiet)."""
    from rich.table import Table

    groups = report.groups
    if not quiet:
        console = rich_console()
        known = formats.find(report.format)
        table = Table(title=f"verify ({known.label(report.target) if known else report.format})")
        for col in ("group", "checks", "failed", "result"):
            table.add_column(col)
        for name, g in groups.items():
            result = f"skipped: {g.skipped}" if g.skipped else "[red]FAIL" if g.failed else "[green]pass"
            table.add_row(name, str(g.checked), str(g.failed), result)
        console.print(table)
        print_lines(console, [("checked", report.dir)] + ([("against", report.source)] if report.source else []))
        if report.worst_tensors:
            worst = Table(title="worst tensors against the source")
            worst.add_column("tensor", overflow="fold")
            for col in ("op", "max abs err", "rel err", "cosine", "of bound"):
                worst.add_column(col)
            for t in report.worst_tensors:
                worst.add_row(t.tensor, t.op, f"{t.max_abs_err:.3g}", f"{t.rel_err:.3g}",
                              f"{t.cosine:.6f}", f"{t.bound_use:.0%}")  # fmt: skip
            console.print(worst)
    for name, g in groups.items():
        for f in g.failures[: None if quiet else listed]:
            typer.echo(f.line(), err=True)
        more = g.failed - (len(g.failures[:listed]) if not quiet else len(g.failures))
        if more > 0:
            typer.echo(f"[{name}] ... and {more} more failures (--json lists {len(g.failures)})", err=True)
    if not quiet:
        total = sum(g.checked for g in groups.values())
        failed = sum(g.failed for g in groups.values())
        verdict = "[green]PASS" if report.ok else f"[red]FAIL: {failed} of {total} checks failed"
        rich_console().print(f"{verdict}[/] ({total} checks, {report.seconds:.2f} s)")
        # Native or torch: what decoded FP8 and counted NaN/Inf (bf16 outputs too), not a format.
        rich_console().print(f"value readers: {report.readers} ({report.readers_reason})", style="dim")


def print_upload(r: UploadResult) -> None:
    """What an upload sent (a dry run: each file it would send, by commit), as whole lines."""
    out = rich_console()
    if r.dry_run:
        for item in r.plan:
            out.print(f"commit {item['commit']}  {item['size']:>15,}  {item['path']}", highlight=False, markup=False)
        commits = max((item["commit"] for item in r.plan), default=0)
        rows = [("would upload", f"{r.files} files, {gb(r.bytes)}, in {commits} commits, to {r.url}")]
    else:
        sent = f"{r.uploaded_files} files, {gb(r.uploaded_bytes)}, in {len(r.commits)} commits"
        rows = [("uploaded", sent), ("on the Hub already", f"{r.skipped_files} files, {gb(r.skipped_bytes)}")]
        if r.deleted:
            rows.append(("deleted (--overwrite)", f"{len(r.deleted)} files of another model"))
        if r.created:
            rows.append(("created", " and ".join(r.created)))
        rows += [("repo", r.url), ("commits", ", ".join(c[:12] for c in r.commits) or "none: up to date")]
    if r.card:
        rows.append(("model card", r.card))
    rows.append(("checked", r.verified))
    if r.base_model_hint:
        rows.append(("note", r.base_model_hint))
    print_lines(out, rows)


def print_card(r: CardResult) -> None:
    """The card written again: where, whether it changed, what it names."""
    rows = [
        ("model card", f"{r.card} ({'written' if r.changed else 'unchanged: already this card'})"),
        ("base_model", r.base_model or "none"),
        ("for", r.repo_id or "the local directory"),
    ]
    if r.base_model_hint:
        rows.append(("note", r.base_model_hint))
    print_lines(rich_console(), rows)
