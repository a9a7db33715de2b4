#!/usr/bin/env python
"""The CPU floor of `convert --upload` on this host: what each GB of source must cost at least.

`convert --upload` of a block-FP8 source to channel FP8 does, per byte of source (the output is
the same size): receive it from the Hub, check its sha256, write it to the local disk; read it
back, convert it, hash the output (the manifest's and the Hub's sha256), write it; read the output
and the source again for the per-file check (verify --source's bound, in C); send the output. This
script measures each of those primitives alone, in this process, on --mb MB of data, medians of
--reps, in CPU seconds per GB (user + system, from getrusage), and prints their sum: no pipeline
doing that work spends less on this host. The Hub's side (what serves the download, what receives
the upload) runs in a child process and is not counted, as the Hub's CPU is not the tool's.

    python scripts/cpu_floor.py --mb 1024 --json floor.json

The conversion and the bound check are mla-convert's own C kernels (one thread); the copies are
the kernel's (socket -> buffer, buffer -> page cache, page cache -> buffer); sendfile is the
cheapest way to send a file over plain HTTP (HTTPS adds the encryption, not measured here).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import socket
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

BUF = 8 << 20


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def measured(fn, reps: int, nbytes: int) -> float:
    """Median CPU seconds per GB of fn() over reps runs."""
    runs = []
    for _ in range(reps):
        t = cpu()
        fn()
        runs.append((cpu() - t) / (nbytes / 1e9))
    return round(statistics.median(runs), 3)


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=1024, help="MB of data per measurement")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None, help="where the scratch file goes (default: a temp dir)")
    ap.add_argument("--zeros", action="store_true", help="zero weights, as scripts/hub_to_hub_r1.py's source")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    import torch

    from mla_convert.kernels import native
    from mla_convert.kernels.transforms import block_fp8_to_channel_fp8
    from mla_convert.process import threads

    threads.share_cores(1)  # one thread: CPU per byte, not parallel speed
    torch.set_num_threads(1)
    n = args.mb * (1 << 20)
    rows, k = n // 7168, 7168
    n = rows * k
    torch.manual_seed(0)
    w = (torch.randn(rows, k) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    if args.zeros:
        w.view(torch.uint8).zero_()
    s = torch.rand(-(-rows // 128), k // 128) * 0.01 + 1e-3
    data = memoryview(w.view(torch.uint8).numpy()).cast("B")
    buf = memoryview(bytearray(BUF))
    figures: dict[str, float] = {}

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = Path(tmp) / "scratch"

        def write_file() -> None:
            with open(path, "wb", buffering=0) as f:
                for i in range(0, n, BUF):
                    f.write(data[i : i + BUF])
                os.fsync(f.fileno())

        def read_file() -> None:
            with open(path, "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass

        figures["write to the page cache (and fsync)"] = measured(write_file, args.reps, n)
        figures["read from the page cache"] = measured(read_file, args.reps, n)
        figures["sha256"] = measured(lambda: hashlib.sha256(data).digest(), args.reps, n)

        def receive() -> None:
            server = socket.create_server(("127.0.0.1", 0))
            pid = os.fork()
            if pid == 0:  # the Hub's side: sends the file, not counted
                c = socket.create_connection(server.getsockname())
                with open(path, "rb") as f:
                    c.sendfile(f)
                c.close()
                os._exit(0)
            conn, _ = server.accept()
            got = 0
            while m := conn.recv_into(buf):
                got += m
            conn.close()
            server.close()
            os.waitpid(pid, 0)
            assert got == n, got

        def send() -> None:
            server = socket.create_server(("127.0.0.1", 0))
            pid = os.fork()
            if pid == 0:  # the Hub's side: receives and drops, not counted
                conn, _ = server.accept()
                while conn.recv_into(buf):
                    pass
                os._exit(0)
            c = socket.create_connection(server.getsockname())
            with open(path, "rb") as f:
                c.sendfile(f)
            c.close()
            server.close()
            os.waitpid(pid, 0)

        figures["receive over loopback TCP"] = measured(receive, args.reps, n)
        figures["send a file over loopback TCP (sendfile)"] = measured(send, args.reps, n)
        drop_cache(path)

    block = (128, 128)
    figures["block FP8 -> channel FP8 (C kernel)"] = measured(
        lambda: block_fp8_to_channel_fp8.to_channel_fp8(w, s, block, 448.0), args.reps, n
    )
    q, sc = block_fp8_to_channel_fp8.to_channel_fp8(w, s, block, 448.0)
    figures["verify --source's bound check (C kernel)"] = measured(
        lambda: native.fp8_bound_rows(q, sc, w, s, block, 2.0**-4 + 2.0**-20, 2.0**-10), args.reps, n
    )

    # each primitive as many times as a GB of source needs it
    uses = {
        "receive over loopback TCP": 1,
        "sha256": 2,  # the source's check, the output's hash
        "write to the page cache (and fsync)": 1,  # the downloaded shard (the output is written O_DIRECT)
        "read from the page cache": 3,  # the source by the conversion, then source and output by the check
        "block FP8 -> channel FP8 (C kernel)": 1,
        "verify --source's bound check (C kernel)": 1,
        "send a file over loopback TCP (sendfile)": 1,
    }
    floor = round(sum(figures[name] * times for name, times in uses.items()), 2)
    width = max(map(len, figures))
    weights = "zero" if args.zeros else "random"
    print(f"CPU-s per GB, {args.mb} MB of {weights} weights, medians of {args.reps}, one thread:")
    for name, value in figures.items():
        print(f"  {name:<{width}}  {value:6.3f}  x{uses[name]}")
    print(f"floor of convert --upload per GB of source: {floor} CPU-s")
    if args.json:
        args.json.write_text(
            json.dumps({"weights": weights, "cpu_s_per_gb": figures, "uses": uses, "floor": floor}, indent=1) + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
