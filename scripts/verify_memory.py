#!/usr/bin/env python
"""verify's memory: the peak and the course of the resident memory of a run of
`mla-convert verify`, and what the header pass and the task building hold.

    python scripts/verify_memory.py run OUT [--source SRC] [--workers N] [--timeline t.json]
    python scripts/verify_memory.py phases OUT [--source SRC] [--top 15]
    python scripts/verify_memory.py trace OUT [--source SRC] [--workers N]

`run` starts `mla-convert verify OUT --json` (PYTHONPATH as given) and samples the resident memory of
the verify process and each of its workers every --every seconds (psutil); it prints the peak of
each, the peak of their sum, the largest single peak from wait4 (ru_maxrss of the process and of
its workers, the kernel's own count, which no sampling misses) and CPU seconds; --timeline writes
the samples. `phases` runs verify's stages that read no tensor data in this process, as verify
runs them (the source and its plan, the header pass, the task building), and gives the resident
memory after each and, with --top, tracemalloc's largest allocation sites of each. `trace` runs a
whole verify in this process and gives the peak of each stage (the data pass: at which file).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

MB = 1e6


def run(out: Path, source: Path | None, workers: int | None, every: float, extra: list[str]) -> dict:
    """One `mla-convert verify` run, sampled: the figures (MB, seconds) and the samples."""
    cmd = [sys.executable, "-m", "mla_convert", "verify", str(out), "--json", *extra]
    if source is not None:
        cmd += ["--source", str(source)]
    if workers is not None:
        cmd += ["--workers", str(workers)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    samples: list[tuple[float, int, list[int]]] = []  # (seconds, parent rss, each worker's rss)
    stop = threading.Event()

    def sample() -> None:
        p = psutil.Process(proc.pid)
        while not stop.is_set():
            try:
                parent = p.memory_info().rss
                kids = []
                for c in p.children(recursive=True):
                    try:
                        kids.append(c.memory_info().rss)
                    except psutil.Error:
                        pass
                samples.append((round(time.perf_counter() - t0, 2), parent, kids))
            except psutil.Error:
                return
            stop.wait(every)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    stdout, stderr = proc.communicate()
    stop.set()
    sampler.join()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    seconds = time.perf_counter() - t0
    try:
        report = json.loads(stdout)
    except ValueError:
        report = {}
    peak_parent = max((s[1] for s in samples), default=0)
    peak_worker = max((max(s[2], default=0) for s in samples), default=0)
    peak_sum = max((s[1] + sum(s[2]) for s in samples), default=0)
    return {
        "command": " ".join(cmd[1:]),
        "exit": proc.returncode,
        "stderr_tail": stderr.decode(errors="replace")[-2000:] if proc.returncode not in (0, 1) else "",
        "ok": report.get("ok"),
        "files": report.get("files"),
        "tensors": report.get("tensors"),
        "checks": sum(g["checked"] for g in report.get("groups", {}).values()) if report else None,
        "seconds": round(seconds, 1),
        "cpu_s": round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 1),
        # ru_maxrss of RUSAGE_CHILDREN: the largest peak of any process waited for (the verify
        # process or one of its workers), in KB
        "peak_rss_largest_mb": round(after.ru_maxrss * 1024 / MB),
        "peak_parent_mb": round(peak_parent / MB),
        "peak_worker_mb": round(peak_worker / MB),
        "peak_sum_mb": round(peak_sum / MB),
        "samples": samples,
    }


def rss() -> int:
    return psutil.Process().memory_info().rss


def phases(out: Path, source: Path | None, top: int) -> list[dict]:
    """verify's stages before the data pass, in this process: the resident memory after each (and
    tracemalloc's largest sites of each, with `top`)."""
    import gc
    import tracemalloc

    from mla_convert.process import resources
    from mla_convert.process.heap import keep_freed_pages
    from mla_convert.verification import api
    from mla_convert.verification.report import Tally
    from mla_convert.verification.structure import check_structure
    from mla_convert.verification.tasks import file_tasks

    rows: list[dict] = []
    last = [None]

    def mark(name: str, t0: float) -> None:
        gc.collect()
        row = {"phase": name, "seconds": round(time.perf_counter() - t0, 2), "rss_mb": round(rss() / MB)}
        if top:
            snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
            row["traced_mb"] = round(sum(s.size for s in snap.statistics("filename")) / MB, 1)
            stats = snap.compare_to(last[0], "lineno") if last[0] is not None else snap.statistics("lineno")
            row["top"] = [
                f"{getattr(s, 'size_diff', s.size) / MB:+8.1f} MB {getattr(s, 'count_diff', s.count):+9d} "
                f"{s.traceback[0].filename.split('/work/')[-1]}:{s.traceback[0].lineno}"
                for s in stats[:top]
            ]
            last[0] = snap
        rows.append(row)

    keep_freed_pages()  # as the command line does (cli.startup.start_heavy_process)
    if top:
        tracemalloc.start()
    with resources.run_scope():
        t0 = time.perf_counter()
        mark("start", t0)
        manifest = api._read_conversion_manifest(out)
        options = api._recorded_options(out, manifest)
        src = plan = None
        if source is not None:
            t0 = time.perf_counter()
            src = api._open_source(source)
            mark("source opened", t0)
            t0 = time.perf_counter()
            plan = api.make_plan(src, options)
            mark("source planned", t0)
        tally = Tally()
        t0 = time.perf_counter()
        layout = check_structure(out, options.format, str(manifest.get("source_fingerprint")), plan, tally)
        mark("header pass", t0)
        t0 = time.perf_counter()
        tasks = file_tasks(out, layout, manifest, options, src)
        mark("tasks built", t0)
        rows[-1]["tasks"] = len(tasks)
        rows[-1]["failures"] = len(tally.failures)
        if hasattr(layout, "after_tasks"):  # as verification.api lets them go before the data pass
            t0 = time.perf_counter()
            del src, plan
            layout = layout.after_tasks()
            mark("what the tasks were built from let go", t0)
    return rows


def trace(out: Path, source: Path | None, workers: int, every: float) -> dict:
    """A whole verify in this process (verification.api.verify_with), its resident memory sampled
    every `every` seconds and each sample put to the stage running then (header pass, task
    building, the data pass file by file, integrity, report): the peak of each stage, the files at
    whose reading it peaked, and whether torch was imported."""
    from mla_convert.process.heap import keep_freed_pages
    from mla_convert.verification import api, runners

    keep_freed_pages()  # as the command line does (cli.startup.start_heavy_process)

    now = {"phase": "start", "file": None}
    samples: list[tuple[float, int, str, str | None, bool]] = []
    stop = threading.Event()
    t0 = time.perf_counter()

    def sample() -> None:
        me = psutil.Process()
        while not stop.is_set():
            samples.append((time.perf_counter() - t0, me.memory_info().rss, now["phase"], now["file"],
                            "torch" in sys.modules))  # fmt: skip
            stop.wait(every)

    def staged(name: str, fn):
        def run(*args, **kw):
            now["phase"], now["file"] = name, None
            try:
                return fn(*args, **kw)
            finally:
                now["phase"] = f"after {name}"

        return run

    file_task = runners.run_file_task

    def run_file_task(task, progress=None):
        now["file"] = task.rel
        return file_task(task, progress)

    patches = {
        (api, "check_structure"): staged("header pass", api.check_structure),
        (api, "file_tasks"): staged("task building", api.file_tasks),
        (api, "check_integrity"): staged("integrity", api.check_integrity),
        (api, "as_report"): staged("report", api.as_report),
        (runners, "run_file_task"): run_file_task,
    }
    saved = {k: getattr(*k) for k in patches}
    for (module, name), fn in patches.items():
        setattr(module, name, fn)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        report = api.verify_with(out, source, staged("data pass", runners.run_files), label=str(out), workers=workers)
    finally:
        stop.set()
        sampler.join()
        for (module, name), fn in saved.items():
            setattr(module, name, fn)
    peaks: dict[str, dict] = {}
    for t, r, phase, file, torch in samples:
        p = peaks.setdefault(phase, {"from_s": round(t, 1), "peak_mb": 0})
        p["to_s"] = round(t, 1)
        if r / MB > p["peak_mb"]:
            p.update(peak_mb=round(r / MB), at_file=file, torch_imported=torch)
    by_file: dict[str, int] = {}
    for _, r, phase, file, _ in samples:
        if phase == "data pass" and file:
            by_file[file] = max(by_file.get(file, 0), round(r / MB))
    return {
        "ok": report.ok, "tensors": report.tensors, "files": report.files,
        "peak_mb": round(max(s[1] for s in samples) / MB),
        "ru_maxrss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / MB),
        "phases": peaks, "files_highest": sorted(by_file.items(), key=lambda kv: -kv[1])[:8],
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    r = sub.add_parser("run")
    r.add_argument("out", type=Path)
    r.add_argument("--source", type=Path)
    r.add_argument("--workers", type=int)
    r.add_argument("--every", type=float, default=1.0, help="seconds between samples")
    r.add_argument("--timeline", type=Path, help="write every sample here (JSON)")
    p = sub.add_parser("phases")
    p.add_argument("out", type=Path)
    p.add_argument("--source", type=Path)
    p.add_argument("--top", type=int, default=0, help="tracemalloc's largest sites per phase (slow)")
    t = sub.add_parser("trace")
    t.add_argument("out", type=Path)
    t.add_argument("--source", type=Path)
    t.add_argument("--workers", type=int, default=1)
    t.add_argument("--every", type=float, default=0.2, help="seconds between samples")
    args = ap.parse_args()
    if args.what == "trace":
        print(json.dumps(trace(args.out, args.source, args.workers, args.every), indent=1))
        return
    if args.what == "run":
        result = run(args.out, args.source, args.workers, args.every, [])
        samples = result.pop("samples")
        if args.timeline:
            args.timeline.write_text(json.dumps(result | {"samples": samples}) + "\n")
        print(json.dumps(result, indent=1))
        return
    for row in phases(args.out, args.source, args.top):
        top = row.pop("top", [])
        print(json.dumps(row))
        for line in top:
            print("   ", line)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
