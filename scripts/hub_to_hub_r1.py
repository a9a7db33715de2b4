#!/usr/bin/env python
"""Hub to Hub at DeepSeek-R1's real size: mla-convert streams an R1-shaped source from a
local fake Hub to a repo of the same fake Hub whose sink keeps only each file's path, size and
sha256, and this script measures it.

    python scripts/hub_to_hub_r1.py --workdir /data/h2h                     # the real size: 688.6 GB through
    python scripts/hub_to_hub_r1.py --workdir /tmp/h2h --layers 4 --experts 32 --vocab 16384 --shards 6
    python scripts/hub_to_hub_r1.py --workdir /tmp/h2h --layers 4 --experts 32 --vocab 16384 --shards 6 --stages
    python scripts/hub_to_hub_r1.py --workdir /tmp/h2h --tiny --json out.json  # seconds: what the test runs

The source (scripts/r1_sparse_source.py, kept under --workdir for the next run): DeepSeek-R1's
163 shards, 91,991 tensors, 688.6 GB, its weights file holes; --layers / --experts / --vocab /
--shards scale it down. The fake Hub (`python -m support.fake_hub_serve`, tests/support) runs in
its own process: it serves the source by sendfile, and its sink hashes, checks and drops what is
uploaded. The tool runs as `python -m mla_convert` of this checkout (tool_commands, the one place
its command line is written): `deepseek-r1 SOURCE --stream --out DIR --upload OWNER/NAME --max-disk
SIZE --json` where the tool has --upload; before that, `deepseek-r1 SOURCE --stream --out DIR` then
`upload DIR OWNER/NAME` (the whole output on disk between them).

Measured, for the tool (its process and every process under it): wall time; CPU seconds (wait4,
user + system, of everything it waited for) per GB of source; peak RSS (the sum over its process
tree, sampled, and the largest single process, from wait4); peak local disk (the allocated blocks
of a directory holding the output and the Hub cache, sampled every --sample seconds); each stage's
busy seconds, as its --json reports them (`stage_seconds`), and the wall time over the busiest. For the fake Hub: its own CPU seconds (wait4 of
its process; its download and upload roles from GET /_fake/state). Checked: the sink's final tree
(path, size, sha256) equals the conversion manifest's files and the manifest, each file was
received once (bytes received = its size), and config.json came in the last commit.

--stages also runs each stage alone on the same source, first, against a fake Hub of their own
(the pipeline's then holds none of the objects they uploaded, which it would not ask to receive
again): the download (every shard fetched and its sha256 checked, then deleted, as --stream does),
the conversion from the local (sparse) source, the upload of that output; then the ratio of the
pipeline's wall time to the slowest stage's (the target: at most 1.3). Those need the whole output
on disk: a scaled source.

Prints a summary and, from this run's rates, the projected time of the full-size run; --json
writes every figure.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT / "tests")]

import r1_sparse_source as r1  # noqa: E402

from support.fake_hub import ENV_UNSET, client_env  # noqa: E402

SOURCE_REPO = "deepseek-ai/DeepSeek-R1"
TARGET_REPO = "mla-convert-bench/DeepSeek-R1-channel-fp8"
STAGE_REPO = "mla-convert-bench/stage-upload"
TOKEN = "hf_fake_bench_token"
MANIFEST = "mla-convert-manifest.json"
FULL_SOURCE_BYTES = r1.REAL_BYTES


def tool_commands(has_upload: bool, out: Path, max_disk: str, extra: list[str]) -> list[tuple[str, list[str]]]:
    """The tool's command line(s) for the whole path, by stage name: the one place to change."""
    tool = [sys.executable, "-m", "mla_convert"]
    if has_upload:
        return [("pipeline", [*tool, "deepseek-r1", SOURCE_REPO, "--stream", "--out", str(out), "--upload",
                              TARGET_REPO, "--max-disk", max_disk, "--json", *extra])]  # fmt: skip
    return [
        ("convert", [*tool, "deepseek-r1", SOURCE_REPO, "--stream", "--out", str(out), "--json", *extra]),
        ("upload", [*tool, "upload", str(out), TARGET_REPO, "--json"]),
    ]


def tool_has_upload() -> bool:
    """Whether this checkout's `convert` has --upload and --max-disk."""
    out = subprocess.run([sys.executable, "-m", "mla_convert", "convert", "--help"], capture_output=True,
                         text=True, env=_env({}), timeout=120)  # fmt: skip
    return "--upload" in out.stdout and "--max-disk" in out.stdout


# ---- processes and what they use


class Sampler(threading.Thread):
    """Every `every` seconds: the allocated bytes under `disk_root`, and the RSS summed over the
    process tree of `pid`; their peaks."""

    def __init__(self, pid: int, disk_root: Path, every: float):
        super().__init__(daemon=True)
        self.pid, self.disk_root, self.every = pid, disk_root, every
        self.peak_disk = self.peak_rss = 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.peak_disk = max(self.peak_disk, allocated(self.disk_root))
            self.peak_rss = max(self.peak_rss, sum(_rss(p) for p in process_tree(self.pid)))
            self.done.wait(self.every)

    def stop(self) -> None:
        self.done.set()
        self.join()
        self.peak_disk = max(self.peak_disk, allocated(self.disk_root))


def allocated(root: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:  # deleted meanwhile
                pass
    return total


def process_tree(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(f"/proc/{entry.name}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def measure(name: str, cmd: list[str], env: dict, disk_root: Path, log: Path, every: float) -> dict:
    """Run `cmd` to its end; its wall time, CPU seconds, peak RSS, peak disk, exit code and --json."""
    t0 = time.perf_counter()
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
        sampler = Sampler(proc.pid, disk_root, every)
        sampler.start()
        stdout = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    sampler.stop()
    try:
        result = json.loads(stdout) if stdout.strip() else None
    except ValueError:
        result = None
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        tail = log.read_text()[-2000:]
        raise SystemExit(f"{name} failed (exit {code}): {' '.join(cmd)}\n{tail}")
    return {
        "stage": name, "wall_s": round(wall, 2), "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
        "user_s": round(usage.ru_utime, 2), "sys_s": round(usage.ru_stime, 2),
        "peak_rss_tree": sampler.peak_rss, "peak_rss_largest": usage.ru_maxrss * 1024, "peak_disk": sampler.peak_disk,
        "result": result,
    }  # fmt: skip


class Hub:
    """The fake Hub in its own process: the source repo, and the sink for uploads."""

    def __init__(self, source: Path, digests: Path, log: Path, chunk: int):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])}
        cmd = [sys.executable, "-m", "support.fake_hub_serve", "--repo", f"{SOURCE_REPO}={source}:{digests}",
               "--sink", "--token", TOKEN, "--chunk-size", str(chunk), "--multipart-threshold", str(chunk)]  # fmt: skip
        self.log = open(log, "w")  # noqa: SIM115 (closed by stop)
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=self.log, text=True)
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"the fake Hub did not start: {log.read_text()[-2000:]}")
        self.endpoint = json.loads(line)["endpoint"]

    def state(self) -> dict:
        with urllib.request.urlopen(f"{self.endpoint}/_fake/state", timeout=60) as r:
            return json.loads(r.read())

    def get(self, repo: str, path: str) -> bytes:
        with urllib.request.urlopen(f"{self.endpoint}/{repo}/resolve/main/{path}", timeout=60) as r:
            return r.read()

    def stop(self) -> dict:
        self.proc.send_signal(signal.SIGTERM)
        _, _, usage = os.wait4(self.proc.pid, 0)
        self.log.close()
        return {"cpu_s": round(usage.ru_utime + usage.ru_stime, 2), "peak_rss": usage.ru_maxrss * 1024}


def _env(extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ENV_UNSET}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return env | extra


def create_repo(endpoint: str, repo: str) -> None:
    code = f"from huggingface_hub import HfApi; HfApi().create_repo({repo!r}, exist_ok=True)"
    env = _env(client_env(endpoint, "/nonexistent-hf-home") | {"HF_TOKEN": TOKEN})
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)


# ---- the runs


DOWNLOAD_ALONE = """
import sys
from pathlib import Path
from mla_convert.source import hub
repo = hub.list_repo(sys.argv[1], None)
for name in sorted(f for f in repo.files if f.endswith(".safetensors")):
    hub.fetch_checked(repo, name, local_dir=Path(sys.argv[2])).unlink()
"""


def run_stages(args, hub: Hub, source: Path, run: Path) -> list[dict]:
    """Each stage alone on the same source: download, convert (from the local source), upload."""
    out = run / "out"
    env = _env(client_env(hub.endpoint, run / "hf_home") | {"HF_TOKEN": TOKEN})
    tool = [sys.executable, "-m", "mla_convert"]
    stages = [
        ("download alone", [sys.executable, "-c", DOWNLOAD_ALONE, SOURCE_REPO, str(run / "download")]),
        ("convert alone", [*tool, "deepseek-r1", str(source), "--out", str(out), "--json", *args.tool_arg]),
        ("upload alone", [*tool, "upload", str(out), STAGE_REPO, "--json"]),
    ]
    create_repo(hub.endpoint, STAGE_REPO)
    results = []
    for name, cmd in stages:
        results.append(measure(name, cmd, env, run, args.workdir / f"{name.split()[0]}-alone.log", args.sample))
        print(_line(results[-1], args.source_bytes), flush=True)
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir()
    return results


def run_pipeline(args, hub: Hub, run: Path) -> tuple[list[dict], float]:
    out = run / "out"
    env = _env(client_env(hub.endpoint, run / "hf_home") | {"HF_TOKEN": TOKEN})
    create_repo(hub.endpoint, TARGET_REPO)
    results, t0 = [], time.perf_counter()
    for name, cmd in tool_commands(args.has_upload, out, args.max_disk, args.tool_arg):
        results.append(measure(name, cmd, env, run, args.workdir / f"{name}.log", args.sample))
        print(_line(results[-1], args.source_bytes), flush=True)
    return results, time.perf_counter() - t0


def compare_tree(hub: Hub, state: dict, out: Path) -> dict:
    """The sink's tree against the conversion manifest (fetched from the sink: a git file, kept)."""
    manifest_bytes = hub.get(TARGET_REPO, MANIFEST)
    manifest = json.loads(manifest_bytes)
    expected = {rel: [m["size"], m["sha256"]] for rel, m in manifest["files"].items()}
    expected[MANIFEST] = [len(manifest_bytes), hashlib.sha256(manifest_bytes).hexdigest()]
    tree = {p: v for p, v in state["repos"][TARGET_REPO].items() if p != ".gitattributes"}
    got = {p: v[:2] for p, v in tree.items()}
    local = out / MANIFEST
    commits = [c for c in state["commits"] if c["repo_id"] == TARGET_REPO and c["summary"] != "initial commit"]
    with_config = [i for i, c in enumerate(commits) if "config.json" in c["added"]]
    return {
        "files": len(tree), "bytes": sum(v[0] for v in tree.values()),
        "equal_to_manifest": got == expected,
        "missing": sorted(set(expected) - set(got)), "extra": sorted(set(got) - set(expected)),
        "differ": sorted(p for p in set(got) & set(expected) if got[p] != expected[p]),
        "received_more_than_once": {p: v[2] for p, v in tree.items() if v[2] > v[0]},
        "local_manifest_equal": local.exists() and local.read_bytes() == manifest_bytes,
        "commits": len(commits), "config_only_in_last_commit": with_config == [len(commits) - 1],
    }  # fmt: skip


def _line(r: dict, source_bytes: int) -> str:
    gb = source_bytes / 1e9
    return (
        f"{r['stage']:>16}: {r['wall_s']:8.1f} s wall, {r['cpu_s']:8.1f} CPU-s ({r['cpu_s'] / gb:.2f} CPU-s/GB of "
        f"source), peak RSS {r['peak_rss_tree'] / 1e6:,.0f} MB (largest process {r['peak_rss_largest'] / 1e6:,.0f} MB),"
        f" peak disk {r['peak_disk'] / 1e9:.2f} GB"
    )


def main() -> None:
    args = parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    source = args.workdir / ("source-tiny" if args.tiny else "source")
    built = r1.build(source, r1.spec_from_args(args), args.jobs)
    print(r1.describe(built), f"({built['seconds']} s)" if not built.get("reused") else "", flush=True)
    args.source_bytes = built["shard_bytes"]
    args.has_upload = tool_has_upload() if args.command == "auto" else args.command == "pipeline"
    free = shutil.disk_usage(args.workdir).free
    if (args.stages or not args.has_upload) and args.source_bytes > 0.9 * free:
        raise SystemExit(
            f"the output of {args.source_bytes / 1e9:.1f} GB would be on disk whole ("
            f"{'--stages' if args.stages else 'this tool has no convert --upload yet'}), {free / 1e9:.1f} GB are "
            "free: scale the source down (--layers, --experts, --vocab)"
        )
    run = args.workdir / "run"
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir()
    digests = source.with_name(source.name + ".sha256.json")
    report: dict = {"source": {k: v for k, v in built.items() if k != "shards"}, "machine": _machine()}
    if args.stages:  # a Hub of their own: the pipeline's holds none of the objects they sent
        stages_hub = Hub(source, digests, args.workdir / "fake-hub-stages.log", args.chunk)
        try:
            report["stages_alone"] = run_stages(args, stages_hub, source, run)
        finally:
            report["stages_hub"] = stages_hub.stop()
    hub = Hub(source, digests, args.workdir / "fake-hub.log", args.chunk)
    try:
        report["runs"], wall = run_pipeline(args, hub, run)
        state = hub.state()
        report["tree"] = compare_tree(hub, state, run / "out")
        report["hub_state_cpu"] = {"all": state["cpu_seconds"], **state["cpu_by_role"]}
    finally:
        report["hub"] = hub.stop()
    if not args.keep:
        shutil.rmtree(run, ignore_errors=True)
    report |= summarize(report, wall, args)
    print(summary_text(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    if not report["tree"]["equal_to_manifest"] or report["tree"]["received_more_than_once"]:
        raise SystemExit(1)


def summarize(report: dict, wall: float, args) -> dict:
    runs = report["runs"]
    gb = args.source_bytes / 1e9
    cpu = sum(r["cpu_s"] for r in runs)
    stages = {}
    for r in runs:
        if isinstance(r["result"], dict) and isinstance(r["result"].get("stage_seconds"), dict):
            stages = r["result"]["stage_seconds"]
    out = {
        "command": "pipeline (convert --upload)" if args.has_upload else "two steps (convert --stream, then upload)",
        "wall_s": round(wall, 1), "tool_cpu_s": round(cpu, 1), "tool_cpu_s_per_gb": round(cpu / gb, 3),
        "peak_disk": max(r["peak_disk"] for r in runs), "peak_rss_tree": max(r["peak_rss_tree"] for r in runs),
        "peak_rss_largest": max(r["peak_rss_largest"] for r in runs), "stage_seconds": stages,
        "wall_over_busiest_stage": round(wall / max(stages.values()), 2) if stages and max(stages.values()) else None,
        "hub_cpu_s": report["hub"]["cpu_s"], "hub_cpu_s_per_gb": round(report["hub"]["cpu_s"] / gb, 3),
        "projected_full_wall_s": round(wall * FULL_SOURCE_BYTES / args.source_bytes),
        "projected_full_tool_cpu_s": round(cpu * FULL_SOURCE_BYTES / args.source_bytes),
    }  # fmt: skip
    alone = report.get("stages_alone")
    if alone:
        slowest = max(alone, key=lambda r: r["wall_s"])
        out["slowest_stage_alone"] = slowest["stage"]
        out["wall_over_slowest_stage"] = round(wall / slowest["wall_s"], 2)
        out["sum_of_stages_alone_s"] = round(sum(r["wall_s"] for r in alone), 1)
    return out


def summary_text(r: dict) -> str:
    t = r["tree"]
    lines = [
        f"command: {r['command']}",
        f"wall {r['wall_s']:.1f} s; tool {r['tool_cpu_s']:.1f} CPU-s = {r['tool_cpu_s_per_gb']:.2f} CPU-s per GB of "
        f"source; fake Hub (source and sink) {r['hub_cpu_s']:.1f} CPU-s = {r['hub_cpu_s_per_gb']:.2f} per GB "
        f"(download {r['hub_state_cpu'].get('download', 0):.1f}, upload {r['hub_state_cpu'].get('upload', 0):.1f})",
        f"peak disk {r['peak_disk'] / 1e9:.2f} GB; peak RSS {r['peak_rss_tree'] / 1e6:,.0f} MB (process tree), "
        f"{r['peak_rss_largest'] / 1e6:,.0f} MB (largest process)",
        f"stages busy (s): {json.dumps(r['stage_seconds']) if r['stage_seconds'] else 'not reported by the tool'}"
        + (f"; wall / busiest stage {r['wall_over_busiest_stage']}" if r["wall_over_busiest_stage"] else ""),
        f"sink tree: {t['files']} files, {t['bytes'] / 1e9:.2f} GB; equal to the manifest: {t['equal_to_manifest']}; "
        f"received more than once: {t['received_more_than_once'] or 'none'}; commits {t['commits']}, config.json only "
        f"in the last: {t['config_only_in_last_commit']}",
        f"projected at the real size (688.6 GB, linear in bytes): wall {r['projected_full_wall_s'] / 3600:.2f} h, tool "
        f"CPU {r['projected_full_tool_cpu_s'] / 3600:.2f} h",
    ]
    if "wall_over_slowest_stage" in r:
        lines.append(
            f"stages alone: slowest {r['slowest_stage_alone']}; the pipeline's wall is {r['wall_over_slowest_stage']}x "
            f"it (target <= 1.3); the stages' sum {r['sum_of_stages_alone_s']} s"
        )
    return "\n".join(lines)


def _machine() -> dict:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "?")  # fmt: skip
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return {"cpu": cpu, "cores": os.cpu_count(), "load": os.getloadavg(), "commit": commit.stdout.strip(),
            "date": time.strftime("%Y-%m-%d %H:%M")}  # fmt: skip


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, required=True, help="the source, the run's directory and the logs")
    ap.add_argument("--layers", type=int, help="decoder layers (R1: 61)")
    ap.add_argument("--experts", type=int, help="routed experts (R1: 256)")
    ap.add_argument("--vocab", type=int, help="vocabulary rows (R1: 129,280)")
    ap.add_argument("--shards", type=int, help="source shards (default: R1's shard size)")
    ap.add_argument("--tiny", action="store_true", help="tiny dims, 4 layers, 8 experts, 4 shards: for tests")
    ap.add_argument("--jobs", type=int, default=2, help="processes writing the source")
    ap.add_argument("--max-disk", default="40G", help="the tool's --max-disk (pipeline command)")
    ap.add_argument("--command", choices=("auto", "pipeline", "two-step"), default="auto",
                    help="auto: the pipeline where convert has --upload, else convert then upload")  # fmt: skip
    ap.add_argument("--tool-arg", action="append", default=[], help="an extra argument for the conversion command")
    ap.add_argument("--stages", action="store_true", help="each stage alone first (a scaled source)")
    ap.add_argument("--chunk", type=int, default=64 << 20, help="the fake Hub's multipart part size")
    ap.add_argument("--sample", type=float, default=0.5, help="seconds between disk and RSS samples")
    ap.add_argument("--keep", action="store_true", help="keep the run's directory (the output, the Hub cache)")
    ap.add_argument("--json", type=Path, help="write every figure here")
    return ap.parse_args()


if __name__ == "__main__":
    main()
