#!/usr/bin/env python
"""Benchmark: mla-convert vs `cp -r` (the I/O floor) vs a naive eager-torch converter.

Builds a synthetic checkpoint at the true DeepSeek-R1 tensor shapes once (a dense layer and an MoE
layer with --experts experts; attention; embeddings with --vocab rows), then runs each method in
its own process, alternating, --reps times, and prints medians, GB/s of source bytes, the ratios
and each process's peak RSS. Figures are only comparable within one run (shared, noisy machine).

Each run's CPU time (user + sys of the process and the workers it waited for, from wait4) is
printed beside its wall time, per GB of source and per GB written. On a shared disk the wall time
follows the neighbours' write traffic (the same `cp -r` + `sync` can take 6 s one hour and 16 s
the next), while the CPU a conversion spends per byte does not: it is the stable figure, and on a
host whose disk keeps up it is the wall time. --baseline runs another commit's mla-convert
alternating with this one, so the two are compared under the same load.

    python scripts/bench_convert.py --experts 32 --reps 3 --markdown bench.md
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()


def naive_convert(src: Path, out: Path, fmt: str) -> None:
    """The public reference converters' algorithm on CPU: per shard load_file, dequantize every FP8
    weight with its scale in eager torch, requantize per channel (or cast to bf16), save_file."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    out.mkdir(parents=True)
    new_map = {}
    for shard in sorted(set(index.values())):
        tensors = load_file(src / shard)
        result = {}
        for name, t in tensors.items():
            if name.endswith("_scale_inv"):
                continue
            if t.dtype != torch.float8_e4m3fn:
                result[name] = t
                continue
            scale_name = name + "_scale_inv"
            if scale_name in tensors:
                s = tensors[scale_name]
            else:  # scale in another shard
                with safe_open(src / index[scale_name], "pt") as f:
                    s = f.get_tensor(scale_name)
            n, k = t.shape
            s_full = s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
            x = t.to(torch.float32) * s_full
            if fmt == "bf16":
                result[name] = x.to(torch.bfloat16)
            else:
                scale = (x.abs().amax(dim=1, keepdim=True) / 448.0).clamp(min=1e-12)
                result[name] = (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
                result[name[: -len(".weight")] + ".weight_scale"] = scale
        save_file(result, out / shard, metadata={"format": "pt"})
        new_map.update({k: shard for k in result})
        del tensors, result
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": new_map}))


def build(src: Path, args: argparse.Namespace) -> None:
    from mla_convert.demo.specs import CheckpointSpec
    from mla_convert.demo.synthetic import write_checkpoint

    marker = src / ".bench-spec.json"
    spec_key = {"experts": args.experts, "vocab": args.vocab, "shards": args.shards}
    if (args.layers, args.dense_layers, args.mtp_layers) != (2, 1, 0):  # the earlier tables' layout keeps its key
        spec_key |= {"layers": args.layers, "dense_layers": args.dense_layers, "mtp_layers": args.mtp_layers}
    if not (marker.exists() and json.loads(marker.read_text()) == spec_key):
        shutil.rmtree(src, ignore_errors=True)
        t = time.perf_counter()
        spec = CheckpointSpec.r1_dims(
            num_hidden_layers=args.layers, n_routed_experts=args.experts, num_shards=args.shards,
            vocab_size=args.vocab, first_k_dense_replace=args.dense_layers,
            num_nextn_predict_layers=args.mtp_layers,
            split_scale_of=f"model.layers.{args.dense_layers}.mlp.experts.1.down_proj.weight",
        )  # fmt: skip
        write_checkpoint(src, spec)
        marker.write_text(json.dumps(spec_key))
        print(f"built {src} in {time.perf_counter() - t:.1f} s", file=sys.stderr)


def run_measured(cmd: list[str], env=None, ok_codes=(0,)) -> tuple[float, float, int]:
    """Wall seconds, CPU seconds (user + sys, with the children it waited for) and peak RSS
    (bytes) of one child process."""
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t
    if os.waitstatus_to_exitcode(status) not in ok_codes:
        raise SystemExit(f"failed ({status}): {' '.join(cmd)}")
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024


def main() -> None:
    args = _parse_args()
    if args._naive:
        return naive_convert(Path(args._naive[0]), Path(args._naive[1]), args._naive[2])
    src = args.workdir / "src"
    if args._build:
        return build(src, args)
    # Built in a child: ru_maxrss survives fork+exec, so a big parent would inflate every figure.
    subprocess.run([sys.executable, str(HERE), *sys.argv[1:], "--_build"], check=True)
    size = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    out = args.workdir / "out"
    methods = _convert_methods(args, src, out)
    runs = _Runs(methods)
    for rep in range(args.reps):
        for name in methods if rep % 2 == 0 else reversed(list(methods)):
            shutil.rmtree(out, ignore_errors=True)
            subprocess.run(["sync"])
            runs.measure(name, methods[name], rep)
            runs.written[name] = _tree_bytes(out)
    shutil.rmtree(out, ignore_errors=True)
    if args.verify:
        methods |= _time_verify(args, src, out, methods, runs)
    result = _result(args, src, size, methods, runs)
    md = _markdown(result)
    print(md)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if args.markdown:
        args.markdown.write_text(md)


def _parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path("bench-out"))
    ap.add_argument("--experts", type=int, default=24, help="routed experts in the MoE layer (size knob)")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers, dense ones first (R1: 61)")
    ap.add_argument("--dense-layers", type=int, default=1, help="of them dense (R1's first_k_dense_replace: 3)")
    ap.add_argument("--mtp-layers", type=int, default=0, help="MTP layers after them (R1: 1)")
    ap.add_argument("--vocab", type=int, default=16384, help="embedding rows (R1: 129280)")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--workers", type=int, nargs="*", default=[1], help="mla-convert --workers values to measure")
    ap.add_argument("--formats", nargs="*", default=["channel-fp8", "bf16"])
    ap.add_argument("--write-io", nargs="*", default=["auto"], help="mla-convert --write-io values to measure")
    ap.add_argument("--no-naive", action="store_true", help="skip the (slow) naive baseline")
    ap.add_argument("--verify", action="store_true", help="also time verify (with and without --source)")
    ap.add_argument(
        "--verify-workers", type=int, nargs="*", default=[None],
        help="with --verify: verify --workers values to measure (default: verify's own default)",
    )  # fmt: skip
    ap.add_argument(
        "--cold", action="store_true",
        help="with --verify: drop the page cache before each verify-phase run (root only), so reading the "
        "files once means reading them from disk",
    )  # fmt: skip
    ap.add_argument(
        "--baseline",
        type=Path,
        help="a checkout of another commit (e.g. `git worktree add /tmp/base REV`): its mla-convert runs too, "
        "alternating with this one, as 'baseline ...' rows",
    )
    ap.add_argument("--json", type=Path, help="write the results as JSON")
    ap.add_argument("--markdown", type=Path, help="write the results as a markdown table")
    ap.add_argument("--_build", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--_naive", nargs=3, metavar=("SRC", "OUT", "FMT"), help=argparse.SUPPRESS)
    return ap.parse_args()


def _convert_methods(args: argparse.Namespace, src: Path, out: Path) -> dict[str, list[str]]:
    """Label -> command of every conversion to time, the `cp -r` floor first."""
    methods: dict[str, list[str]] = {"cp -r + sync": ["sh", "-c", f"cp -r '{src}' '{out}' && sync"]}
    for fmt in args.formats:
        if not args.no_naive:
            methods[f"naive eager {fmt}"] = [sys.executable, str(HERE), "--_naive", str(src), str(out), fmt]
        for w in args.workers:
            for io in args.write_io:
                label = f"mla-convert {fmt} w{w}" + (f" {io}" if io != "auto" else "")
                opts = ["--format", fmt, "--workers", str(w), "--write-io", io, "--quiet"]
                methods[label] = _mla_convert(None, src, out, opts)
                if args.baseline:
                    methods[f"baseline {label}"] = _mla_convert(args.baseline, src, out, opts)
    # The fixed start-up (imports, source validation, plan) that every conversion pays once.
    methods["mla-convert --dry-run (start-up)"] = _mla_convert(None, src, out, ["--dry-run", "--quiet"])
    return methods


def _mla_convert(tree: Path | None, src: Path, out: Path, opts: list[str]) -> list[str]:
    """The command converting src into out: this checkout's mla_convert, or the one in `tree`
    (run from that directory, so its package is the one imported)."""
    cmd = [sys.executable, "-m", "mla_convert", "deepseek-r1", str(src.resolve()), "--out", str(out.resolve()), *opts]
    if tree is None:
        return cmd
    return ["sh", "-c", 'cd "$0" && exec "$@"', str(tree.resolve()), *cmd]


class _Runs:
    """Wall and CPU seconds of every run, and the peak RSS and bytes written of each method."""

    def __init__(self, methods: dict[str, list[str]]):
        self.times: dict[str, list[float]] = {m: [] for m in methods}
        self.cpu: dict[str, list[float]] = {m: [] for m in methods}
        self.rss: dict[str, int] = {m: 0 for m in methods}
        self.written: dict[str, int] = {}  # bytes each method leaves in --out (bf16 writes ~1.9x the source)

    def measure(self, name: str, cmd: list[str], rep: int) -> None:
        wall, cpu, peak = run_measured(cmd)
        self.times.setdefault(name, []).append(wall)
        self.cpu.setdefault(name, []).append(cpu)
        self.rss[name] = max(self.rss.get(name, 0), peak)
        print(f"rep {rep} {name}: {wall:.2f} s, {cpu:.2f} CPU-s", file=sys.stderr)


def _time_verify(
    args: argparse.Namespace, src: Path, out: Path, methods: dict[str, list[str]], runs: _Runs
) -> dict[str, list[str]]:
    """Convert once, then time reading the output against verifying it; returns the verify methods."""
    subprocess.run(
        methods[next(m for m in methods if m.startswith("mla-convert"))], check=True, stdout=subprocess.DEVNULL
    )
    vmethods = {"read output once (cat)": ["sh", "-c", f"find '{out}' -type f -exec cat {{}} + > /dev/null"]}
    for tree, prefix in ((None, ""), *(((args.baseline, "baseline "),) if args.baseline else ())):
        for w in args.verify_workers:
            opts = [] if w is None else ["--workers", str(w)]
            label = "" if w is None else f" w{w}"
            vmethods[f"{prefix}verify{label}"] = _mla_verify(tree, out, opts)
            vmethods[f"{prefix}verify --source{label}"] = _mla_verify(
                tree, out, [*opts, "--source", str(src.resolve())]
            )
    if args.cold:
        vmethods = {f"{name} (cold cache)": cmd for name, cmd in vmethods.items()}
    for rep in range(args.reps):
        for name in vmethods if rep % 2 == 0 else reversed(list(vmethods)):
            if args.cold:
                _drop_page_cache()
            runs.measure(name, vmethods[name], rep)
    output = _tree_bytes(out)
    runs.written |= dict.fromkeys(vmethods, output)  # verify's figures are per GB of output
    shutil.rmtree(out, ignore_errors=True)
    return vmethods


def _mla_verify(tree: Path | None, out: Path, opts: list[str]) -> list[str]:
    """`mla-convert verify` of out: this checkout's, or the one in `tree` (as _mla_convert)."""
    cmd = [sys.executable, "-m", "mla_convert", "verify", str(out.resolve()), "--quiet", *opts]
    if tree is None:
        return cmd
    return ["sh", "-c", 'cd "$0" && exec "$@"', str(tree.resolve()), *cmd]


def _result(args: argparse.Namespace, src: Path, size: int, methods: dict[str, list[str]], runs: _Runs) -> dict:
    med = {m: statistics.median(v) for m, v in runs.times.items()}
    cpu = {m: statistics.median(v) for m, v in runs.cpu.items()}
    cp = med["cp -r + sync"]
    first_convert = med[next(m for m in med if m.startswith("mla-convert"))]
    rows = []
    for m in methods:
        fmt = next((f for f in args.formats if f in m), None)
        naive = med.get(f"naive eager {fmt}")
        written = runs.written.get(m)
        rows.append({
            "method": m, "median_s": round(med[m], 3), "gb_per_s": round(size / med[m] / 1e9, 3),
            "x_cp": round(med[m] / cp, 2),
            "cpu_s": round(cpu[m], 2), "cpu_s_per_gb": round(cpu[m] / (size / 1e9), 3),
            "cpu_s_per_gb_written": round(cpu[m] / (written / 1e9), 3) if written else None,
            "cpu_runs_s": [round(x, 2) for x in runs.cpu[m]],
            # against cp of as many bytes as this method wrote: where the disk is the limit, the floor
            "written_bytes": written,
            "x_cp_same_bytes": round(med[m] / (cp * written / size), 2) if written else None,
            "naive_over_this": round(naive / med[m], 2) if naive and m.startswith("mla-convert") else None,
            "x_first_convert": round(med[m] / first_convert, 2),
            "peak_rss_gib": round(runs.rss[m] / 2**30, 3), "runs_s": [round(x, 2) for x in runs.times[m]],
        })  # fmt: skip
    largest = _largest_tensor_bytes(src)
    return {
        "source_bytes": size, "experts": args.experts, "vocab": args.vocab, "shards": args.shards,
        "reps": args.reps, "cpus": os.cpu_count(), "cpu": _cpu_model(), "largest_tensor_bytes": largest,
        "rss_target_gib": round((2**30 + 2 * largest) / 2**30, 3), "rows": rows,
    }  # fmt: skip


def _drop_page_cache() -> None:
    """Data files leave the page cache; Python, torch and mla_convert are read back in, so only
    the files being verified are cold."""
    subprocess.run(["sync"], check=True)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as e:
        sys.exit(f"--cold: cannot drop the page cache ({e.strerror or e}); it needs root")
    subprocess.run([sys.executable, "-c", "import torch, mla_convert.cli, mla_convert.verification.api"], check=True)


def _tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) if root.exists() else 0


def _cpu_model() -> str:
    """Model name and whether it has AVX-512 (torch's fp8 casts are vectorized only with it)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "?")
    return f"{model}, {'AVX-512' if ' avx512f' in info else 'no AVX-512'}"


def _largest_tensor_bytes(src: Path) -> int:
    from mla_convert.io.headers import read_header

    return max(t.nbytes for p in src.glob("*.safetensors") for t in read_header(p).tensors.values())


def _markdown(r: dict) -> str:
    lines = [
        f"source: {r['source_bytes'] / 1e9:.2f} GB in {r['shards']} shards (R1 shapes, {r['experts']} experts, "
        f"vocab {r['vocab']}); {r['reps']} reps, medians; {r['cpus']} CPUs ({r['cpu']}); "
        "RSS target 1 GiB + 2x largest tensor "
        f"= {r['rss_target_gib']:.2f} GiB",
        "",
        "| method | median s | CPU-s | CPU-s / GB of source | CPU-s / GB written | GB/s of source | time / cp "
        "| GB written | time / cp of as many bytes | naive / this | time / first mla-convert | peak RSS GiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        nv = f"{row['naive_over_this']:.1f}x" if row["naive_over_this"] else ""
        gb = f"{row['written_bytes'] / 1e9:.2f}" if row["written_bytes"] else ""
        same = f"{row['x_cp_same_bytes']:.2f}" if row["x_cp_same_bytes"] else ""
        per_written = f"{row['cpu_s_per_gb_written']:.2f}" if row["cpu_s_per_gb_written"] else ""
        lines.append(
            f"| {row['method']} | {row['median_s']:.2f} | {row['cpu_s']:.2f} | {row['cpu_s_per_gb']:.2f} | {per_written} | "
            f"{row['gb_per_s']:.2f} | {row['x_cp']:.2f} | {gb} | {same} | {nv} | "
            f"{row['x_first_convert']:.2f} | {row['peak_rss_gib']:.2f} |"
        )
    lines += ["", *_per_gb_summary(r)]
    return "\n".join(lines) + "\n"


def _per_gb_summary(r: dict) -> list[str]:
    """The conversion's CPU per GB of source next to verify's per GB of output: median (min-max)."""
    out = []
    for row in r["rows"]:
        m = row["method"]
        if "verify" in m and "dry-run" not in m:
            per, of = row["cpu_s_per_gb_written"], "output"
            runs = [x / (row["written_bytes"] / 1e9) for x in row["cpu_runs_s"]]
        elif m.startswith(("mla-convert", "baseline mla-convert")) and "dry-run" not in m:
            per, of = row["cpu_s_per_gb"], "source"
            runs = [x / (r["source_bytes"] / 1e9) for x in row["cpu_runs_s"]]
        else:
            continue
        out.append(f"- {m}: {per:.2f} CPU-s per GB of {of} ({min(runs):.2f}-{max(runs):.2f})")
    return out


if __name__ == "__main__":
    main()
