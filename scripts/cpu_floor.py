#!/usr/bin/env python
"""The CPU floor of `convert --upload` on this host: what each GB of source must cost at least.

`convert --upload` of a block-FP8 source to channel FP8 does, per byte of source (the output is
the same size): receive it from the Hub, check its sha256, write it to the local disk (past the
page cache); read it back, convert it, hash the output (the manifest's and the Hub's sha256),
write it (past the page cache); read the output back and the source again for the per-file check
(verify --source's bound, in C); send the output. This
script measures each of those primitives alone, in this process, on --mb MB of data, medians of
--reps, in CPU seconds per GB (user + system, from getrusage), and prints their sum: no pipeline
doing that work spends less on this host. The Hub's side (what serves the download, what receives
the upload) runs in a child process and is not counted, as the Hub's CPU is not the tool's.

    python scripts/cpu_floor.py --mb 1024 --json floor.json

The conversion and the bound check are mla-convert's own C kernels (one thread); the copies are
the kernel's (socket -> buffer, disk -> page cache -> buffer); sendfile is the cheapest way to
send a file over plain HTTP (HTTPS adds the encryption, not measured here). Writing into fresh
page-cache pages costs more than all of these on some VMs (0.8-1.2 CPU-s per GB here): the tool
writes past it where the filesystem allows, and so does this script.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import mmap
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


def measured(fn, reps: int, nbytes: int, setup=None) -> float:
    """Median CPU seconds per GB of fn() over reps runs, each after an unmeasured setup()."""
    runs = []
    for _ in range(reps):
        if setup is not None:
            setup()
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
    from mla_convert.kernels.transforms.transform import Params
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

        direct = [hasattr(os, "O_DIRECT")]
        block = mmap.mmap(-1, BUF)  # page-aligned, as O_DIRECT needs
        block.write(os.urandom(BUF))

        def write_file() -> None:  # as the tool writes a download and an output: past the page cache
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
            fd = os.open(path, flags | (os.O_DIRECT if direct[0] else 0))
            try:
                for _ in range(n // BUF):
                    os.write(fd, block)
            except OSError:  # this filesystem refuses O_DIRECT: through the page cache
                if not direct[0]:
                    raise
                direct[0] = False
            finally:
                os.fsync(fd)
                os.close(fd)

        def cold_read() -> None:  # a file just written past the cache, read back: the cache filled
            drop_cache(path)
            read_file()

        def read_file() -> None:
            with open(path, "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass

        def direct_read() -> None:  # the cheapest way to read a file back from the disk
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            try:
                while os.readv(fd, [block]):
                    pass
            finally:
                os.close(fd)

        write_file()
        if not direct[0]:
            write_file()  # the measured runs: through the page cache
        m = n // BUF * BUF  # the file's size
        figures["write past the page cache (O_DIRECT)"] = measured(write_file, args.reps, m)
        figures["read a file not in the page cache"] = measured(cold_read, args.reps, m, setup=write_file)
        figures["read from the page cache"] = measured(read_file, args.reps, m)
        if direct[0]:
            figures["read past the page cache (O_DIRECT)"] = measured(direct_read, args.reps, m)
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
            assert got == path.stat().st_size, got

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

        figures["receive over loopback TCP"] = measured(receive, args.reps, m)
        figures["send a file over loopback TCP (sendfile)"] = measured(send, args.reps, m)
        drop_cache(path)

    block = (128, 128)
    # into buffers touched before, as the tool converts into its reused staging buffers (a fresh
    # allocation's first touch costs this VM more than the kernel)
    q_out, sc_out = torch.zeros(rows, k, dtype=torch.uint8), torch.zeros(rows, 1, dtype=torch.float32)
    kernel = block_fp8_to_channel_fp8.rows(Params(block, 448.0, True))
    figures["block FP8 -> channel FP8 (C kernel)"] = measured(
        lambda: kernel(w.data_ptr(), s.data_ptr(), k, q_out.data_ptr(), sc_out.data_ptr(), 0, rows), args.reps, n
    )
    q, sc = block_fp8_to_channel_fp8.to_channel_fp8(w, s, block, 448.0)
    figures["verify --source's bound check (C kernel)"] = measured(
        lambda: native.fp8_bound_rows(q, sc, w, s, block, 2.0**-4 + 2.0**-20, 2.0**-10), args.reps, n
    )

    # each primitive as many times as a GB of source needs it
    uses = {
        "receive over loopback TCP": 1,
        "sha256": 2,  # the source's check, the output's hash
        "write past the page cache (O_DIRECT)": 2,  # the downloaded shard, the output file
        "read a file not in the page cache": 2,  # the shard by the conversion, the output by the check
        "read from the page cache": 1,  # the shard again, by the check
        "block FP8 -> channel FP8 (C kernel)": 1,
        "verify --source's bound check (C kernel)": 1,
        "send a file over loopback TCP (sendfile)": 1,  # the output, cached by the check's read
    }
    floor = round(sum(figures[name] * times for name, times in uses.items()), 2)
    # What no design can leave out, whatever it does with the disk and the page cache: the bytes
    # received, the source's sha256 check, the output's sha256, the conversion, the bound check.
    required = {"receive over loopback TCP": 1, "sha256": 2, "block FP8 -> channel FP8 (C kernel)": 1,
                "verify --source's bound check (C kernel)": 1}  # fmt: skip
    required_floor = round(sum(figures[name] * times for name, times in required.items()), 2)
    # ... and with the cheapest copies this host has: each file written and read back once past
    # the page cache (the shard by the conversion, the output by the check or the upload).
    cheapest = {**required, "write past the page cache (O_DIRECT)": 2, "send a file over loopback TCP (sendfile)": 1}
    if "read past the page cache (O_DIRECT)" in figures:
        cheapest["read past the page cache (O_DIRECT)"] = 2
    cheapest_floor = round(sum(figures[name] * times for name, times in cheapest.items()), 2)
    width = max(map(len, figures))
    weights = "zero" if args.zeros else "random"
    io = "" if direct[0] else " (O_DIRECT refused here: written through the page cache)"
    print(f"CPU-s per GB, {args.mb} MB of {weights} weights, medians of {args.reps}, one thread{io}:")
    for name, value in figures.items():
        print(f"  {name:<{width}}  {value:6.3f}  x{uses.get(name, 0)}")
    print(f"floor of convert --upload per GB of source: {floor} CPU-s")
    print(f"  the required work alone (receive, two sha256, the two kernels): {required_floor} CPU-s")
    print(f"  with the cheapest copies (each file written and read once past the page cache): {cheapest_floor} CPU-s")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "weights": weights,
                    "direct": direct[0],
                    "cpu_s_per_gb": figures,
                    "uses": uses,
                    "floor": floor,
                    "required": required,
                    "required_floor": required_floor,
                    "cheapest": cheapest,
                    "cheapest_floor": cheapest_floor,
                },
                indent=1,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
