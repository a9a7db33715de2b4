"""What a command shows while it works and when it is done: progress on stderr (a status line and a
bar on a terminal, plain lines in a log), the conversion summary and the verify report as tables,
and paths and next commands as whole lines. rich is imported when first needed, not at start-up."""

from __future__ import annotations

import contextlib
import shlex
import sys
import threading
import time

import typer

from mla_convert import envs
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


def print_summary(summary: dict, title: str, source_arg: str | None = None) -> None:
    """The summary table, then the paths and the next commands as whole lines (soft-wrapped: a
    narrow terminal folds them, but they copy and paste whole)."""
    from rich.table import Table

    table = Table(title=title, show_header=False)
    table.add_column(no_wrap=True)
    table.add_column()
    fmt = summary["format"]
    target = f"{fmt} / {summary['target']} (FP8 max {summary['fp8_max']:g})" if fmt != "bf16" else "bf16"
    rows = [
        ("format / target" if fmt != "bf16" else "format", target),
        ("shards", str(summary["shards"])),
        ("tensors in -> out", f"{summary['tensors_in']} -> {summary['tensors_out']}"),
        ("block-FP8 weights converted", str(summary["fp8_weights_converted"])),
        ("16-bit linears quantized", str(summary["bf16_linears_quantized"])),
        ("MLA layers (W_UK_T / W_UV)", str(summary["mla_layers"])),
        ("bytes in", gb(summary["bytes_in"])),
        ("bytes out (model + mla)", f"{gb(summary['bytes_out_model'])} + {gb(summary['bytes_out_mla'])}"),
        ("disk needed", gb(summary["disk_needed"])),
    ]
    if "disk_needed_stream" in summary:
        rows += [
            ("disk needed, download then convert", gb(summary["disk_needed_download_then_convert"])),
            ("disk needed, --stream", gb(summary["disk_needed_stream"])),
        ]
    if "disk_free" in summary:
        rows.append(("free space", _space_row(summary)))
    for i, (pattern, n) in enumerate((summary.get("ignored_by_pattern") or {}).items()):
        rows.append(("" if i else "left unquantized by --ignore", f"{n} linear{'s' * (n != 1)}: {pattern}"))
    if summary.get("resumed_jobs"):
        kept = summary["resumed_jobs"]
        rows.append(
            ("resumed", f"kept {kept} of {summary['shards']} shard jobs (re-hashed), redid {summary['shards'] - kept}")
        )
    if "seconds" in summary:
        rows += [
            ("time", f"{summary['seconds']:.2f} s ({summary['gb_per_s']:.2f} GB/s of source)"),
            ("kernels", f"{summary['kernels']} on {summary.get('compute_device', summary['device'])} "
             f"({summary['kernels_reason']})"),
        ]  # fmt: skip
        if summary["device"] != "cpu" and summary.get("device_reason"):
            rows.append(("device", f"{summary['device']}: {summary['device_check']} ({summary['device_reason']})"))
        rows.append(("writes", f"{summary['write_io']} ({summary['write_io_reason']})"))
    if "verify" in summary:
        v = summary["verify"]
        verdict = "pass" if v["ok"] else f"FAIL ({v['failed']} failed)"
        rows += [("verify --source", f"{verdict}: {v['checks']} checks in {v['seconds']:.2f} s")]
    for k, v in rows:
        table.add_row(k, v)
    console = rich_console()
    console.print(table)
    lines = [("source", summary["source"]), ("output", summary["out"])]
    if summary.get("base_model_hint"):  # in the summary, not on stderr: a note, not a failure
        lines.append(("note", summary["base_model_hint"].replace("DIR", summary["out"], 1)))
    print_lines(console, lines)
    if "seconds" in summary and source_arg is not None:
        out = shlex.quote(summary["out"])
        check = f"mla-convert verify {out}" + (
            f" --source {shlex.quote(source_arg)}" if "peak_source_bytes_on_disk" not in summary else ""
        )
        print_lines(console, [("to check it", check), ("to serve it", f"vllm serve {out}")])


def _space_row(summary: dict) -> str:
    row = f"{gb(summary['disk_required'])} needed of {gb(summary['disk_free'])} free"
    if summary.get("disk_freed_by_overwrite"):
        row += f" (+{gb(summary['disk_freed_by_overwrite'])} freed by --overwrite)"
    if "cache_dir" in summary:
        row += f"; download {gb(summary['cache_required'])} of {gb(summary['cache_free'])} free in the Hub cache"
    short = summary["disk_required"] > summary["disk_free"] + summary.get("disk_freed_by_overwrite", 0) or (
        summary.get("cache_required", 0) > summary.get("cache_free", 0)
    )
    return row + (": NOT ENOUGH" if short else "")


def print_lines(console, items: list[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in items)
    for k, v in items:
        console.print(f"{k + ':':<{width + 1}} {v}", soft_wrap=True, highlight=False, markup=False)


def print_verify_report(report: dict, quiet: bool, listed: int = 10) -> None:
    """A table of the check groups; then each failure on one line (all of them also with --quiet)."""
    from rich.table import Table

    groups = report["groups"]
    if not quiet:
        console = rich_console()
        table = Table(title=f"verify ({report['format']} / {report['target']})")
        for col in ("group", "checks", "failed", "result"):
            table.add_column(col)
        for name, g in groups.items():
            result = f"skipped: {g['skipped']}" if g["skipped"] else "[red]FAIL" if g["failed"] else "[green]pass"
            table.add_row(name, str(g["checked"]), str(g["failed"]), result)
        console.print(table)
        print_lines(
            console, [("checked", report["dir"])] + ([("against", report["source"])] if report["source"] else [])
        )
        if report["worst_tensors"]:
            worst = Table(title="worst tensors against the source")
            worst.add_column("tensor", overflow="fold")
            for col in ("op", "max abs err", "rel err", "cosine", "of bound"):
                worst.add_column(col)
            for s in report["worst_tensors"]:
                worst.add_row(s["tensor"], s["op"], f"{s['max_abs_err']:.3g}", f"{s['rel_err']:.3g}",
                              f"{s['cosine']:.6f}", f"{s['bound_use']:.0%}")  # fmt: skip
            console.print(worst)
    for name, g in groups.items():
        for f in g["failures"][: None if quiet else listed]:
            typer.echo(f["message"], err=True)
        more = g["failed"] - (len(g["failures"][:listed]) if not quiet else len(g["failures"]))
        if more > 0:
            typer.echo(f"[{name}] ... and {more} more failures (--json lists {len(g['failures'])})", err=True)
    if not quiet:
        total = sum(g["checked"] for g in groups.values())
        failed = sum(g["failed"] for g in groups.values())
        verdict = "[green]PASS" if report["ok"] else f"[red]FAIL: {failed} of {total} checks failed"
        rich_console().print(f"{verdict}[/] ({total} checks, {report['seconds']:.2f} s)")
        # Native or torch: what decoded FP8 and counted NaN/Inf (bf16 outputs too), not a format.
        rich_console().print(f"value readers: {report['readers']} ({report['readers_reason']})", style="dim")
