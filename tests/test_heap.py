"""heap.keep_freed_pages: tensor-sized buffers are reused instead of page-faulted in again."""

import subprocess
import sys

import pytest

CHILD = """
import resource, sys, torch
from mla_convert.process.heap import keep_freed_pages
if sys.argv[1] == "on":
    assert keep_freed_pages() and keep_freed_pages()  # idempotent
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
big = torch.empty(100 << 20, dtype=torch.uint8); big.fill_(1); del big  # a dense-layer-sized one
before = faults()
for i in range(20):  # expert-sized fp8 inputs and bf16 outputs, shapes varying a little
    a = torch.empty((14 << 20) + i * 4096, dtype=torch.uint8); a.fill_(1)
    b = torch.empty((29 << 20) + i * 4096, dtype=torch.uint8); b.fill_(1)
    del a, b
print(faults() - before)
"""


def _page_faults(mode: str) -> int:
    r = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, check=True)
    return int(r.stdout)


@pytest.mark.slow
def test_freed_buffers_are_reused_without_page_faults():
    on, off = _page_faults("on"), _page_faults("off")
    # glibc's default: each round maps fresh pages (~20 x 43 MB / 4 KiB = 220k faults at most);
    # kept heap pages: the first round's pages and the few that growing sizes add (measured 44k
    # against 174k).
    assert on * 3 < off, (on, off)
