"""The C conversion kernels (fp8_kernels.c): built with the host's C compiler on first use, cached.

torch's CPU fp8 casts are scalar on hosts without AVX-512, and inductor's generated code inherits
that. The C kernels decode and encode e4m3fn with integer arithmetic, find each row's absmax from
the fp8 bytes, and on CPUs with AVX-512 VBMI turn each (row, block) into a table of 128 codes and a
byte lookup. The library is compiled for this CPU (-march=native) into a cache keyed by source,
compiler, flags and CPU, so a shared home directory never serves one CPU's build to another.
Anything that fails here raises NativeUnavailable; kernels.fastest then falls back with the reason.

No torch at import: the conversion's hot path calls the kernels on raw addresses (each transform's
C entry, an `Entry` declared in its module in kernels.transforms), so a run whose kernel verdict is
cached (kernels.verdict) never imports it. The functions that take and return torch tensors (the
transforms' tensor entries, `decode`, ...: the probes, verify) import it when called, and run the
same C entry points. The entries verify's own checks call are declared here.

The built library and the thread pool the kernels run on belong to the run (process.resources:
closed when it ends): `release_threads()` ends the pool, `reset()` forgets both.
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import itertools
import threading
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from mla_convert.kernels.bits import NONFINITE
from mla_convert.kernels.native_build import NativeUnavailable, build
from mla_convert.process import interrupts, resources, threads

if TYPE_CHECKING:
    import torch

_LIBRARY, _THREADS = "kernels.native.library", "kernels.native.threads"  # the run's slots (process.resources)
I64, U32, F32, PTR = ctypes.c_int64, ctypes.c_uint32, ctypes.c_float, ctypes.c_void_p


class _Loaded(NamedTuple):
    lib: ctypes.CDLL
    path: Path


def _load() -> _Loaded:
    path = build()
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise NativeUnavailable(f"cannot load the built kernels ({e})") from e
    i64, f32, ptr = I64, F32, PTR
    lib.mla_dequant_rows.argtypes = [ptr, ptr, i64, i64, i64, ptr, i64, i64]
    lib.mla_decode_e4m3fn.argtypes = [ptr, ptr, i64, i64]
    lib.mla_row_max_code.argtypes = [ptr, i64, ptr, i64, i64]
    lib.mla_fp8_bound_rows.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, f32, f32, *[ptr] * 8, i64, i64]
    lib.mla_first_difference.argtypes, lib.mla_first_difference.restype = [ptr, ptr, i64], i64
    lib.mla_bound_totals.argtypes, lib.mla_bound_totals.restype = [*[ptr] * 6, i64, ptr], None
    lib.mla_scale_over_limit.argtypes = [ptr, ptr, i64, f32, f32, f32, ptr]
    lib.mla_scale_over_limit.restype = i64
    lib.mla_artifact_bound.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, f32, f32, i64, i64]
    lib.mla_artifact_bound.restype = i64
    lib.mla_normal_fill.argtypes, lib.mla_normal_fill.restype = [ptr, ptr, i64], None
    lib.mla_functional_error.argtypes = [ptr, ptr, ptr, *[i64] * 7, ptr, ptr, ptr, ptr]
    lib.mla_functional_error.restype = ctypes.c_double
    for bits, c_type in ((8, ctypes.c_uint8), (16, ctypes.c_uint16), (32, ctypes.c_uint32)):
        f = getattr(lib, f"mla_count_matching{bits}")
        f.argtypes, f.restype = [ptr, i64, c_type, c_type], i64
    for f in (lib.mla_dequant_rows, lib.mla_decode_e4m3fn, lib.mla_row_max_code, lib.mla_fp8_bound_rows):
        f.restype = None
    return _Loaded(lib, path)


def library() -> ctypes.CDLL:
    """The built library, loaded once per run (process.resources)."""
    return resources.current().slot(_LIBRARY, _load).lib


def is_loaded() -> bool:
    """Whether this run has loaded the library (without building or loading it)."""
    return resources.current().get(_LIBRARY) is not None


def library_path() -> Path:
    """The file of the loaded library (loading it first)."""
    return resources.current().slot(_LIBRARY, _load).path


# ---- threads -------------------------------------------------------------------------------------

MIN_ROWS_PER_THREAD = 64


class _Threads:
    """The kernels' thread pool, grown to the most threads a call has asked for. A pool replaced
    by a larger one is not shut down here: another thread may still be submitting to it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.pool: cf.ThreadPoolExecutor | None = None

    def at_least(self, count: int) -> cf.ThreadPoolExecutor:
        with self._lock:
            if self.pool is None or self.pool._max_workers < count:
                self.pool = cf.ThreadPoolExecutor(count, thread_name_prefix="mla-kernel")
            return self.pool

    def close(self) -> None:
        with self._lock:
            pool, self.pool = self.pool, None
        if pool is not None:
            pool.shutdown(wait=True)


def _rows_parallel(fn, n: int, min_per_thread: int = MIN_ROWS_PER_THREAD) -> None:
    """Run fn(r0, r1) over row ranges on this process's threads (process.threads; each call
    releases the GIL).

    Returns or raises only once every range is done: the callers' fn hold raw pointers into
    buffers that the caller frees or reuses as soon as this returns or unwinds. A range that fails
    does not stop the wait for the others, and a Ctrl-C is held back until they are all done
    (interrupts.deferred), then raised.
    """
    count = max(1, min(threads.count(), n // min_per_thread))
    if count == 1:
        fn(0, n)
        return
    pool = resources.current().slot(_THREADS, _Threads, _Threads.close).at_least(count)
    bounds = [n * i // count for i in range(count + 1)]
    with interrupts.deferred():
        futures = [pool.submit(fn, a, b) for a, b in itertools.pairwise(bounds)]
        cf.wait(futures)
    for f in futures:
        f.result()


def release_threads() -> None:
    """Shut the kernels' thread pool down (the next kernel call starts another)."""
    resources.current().release(_THREADS)


def reset() -> None:
    """release_threads(), and forget the loaded library (the next call loads it again from the
    build cache)."""
    release_threads()
    resources.current().release(_LIBRARY)


class Entry:
    """One C entry point of the library, its ctypes signature declared by the transform module
    that calls it (kernels.transforms); the entries verify's checks share are declared in _load."""

    def __init__(self, name: str, argtypes: list, restype=None) -> None:
        self.name, self.argtypes, self.restype = name, argtypes, restype

    def __call__(self, *args):
        f = getattr(library(), self.name)  # ctypes keeps one function object per name and library
        if f.argtypes is None:
            f.argtypes, f.restype = self.argtypes, self.restype
        return f(*args)


def zero_sign(signed_zero: bool) -> int:
    """The kernels' zero_sign: the sign bit a zero code may keep (numerics.SIGNED_ZERO)."""
    return 0x80 if signed_zero else 0


# ---- on torch tensors (the probes, verify) --------------------------------------------------------


def check_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> tuple[int, int]:
    """(rows, cols) of a 2-D e4m3fn CPU weight whose float32 scale grid fits `block`; ValueError otherwise."""
    import torch

    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2 or weight.device.type != "cpu":
        raise ValueError(
            f"native kernels take a 2-D float8_e4m3fn CPU weight, got {weight.dtype} {tuple(weight.shape)}"
        )
    n, k = weight.shape
    grid = (-(-n // block[0]), -(-k // block[1]))
    if tuple(scale_inv.shape) != grid or scale_inv.dtype != torch.float32:
        raise ValueError(f"scale grid {tuple(scale_inv.shape)} does not fit weight {(n, k)} with block {block}")
    return n, k


def decode(t: torch.Tensor) -> torch.Tensor:
    """t.float() for a float8_e4m3fn CPU tensor of any shape."""
    import torch

    lib = library()
    if t.dtype != torch.float8_e4m3fn or t.device.type != "cpu":
        raise ValueError(f"decode takes a float8_e4m3fn CPU tensor, got {t.dtype} on {t.device}")
    src = t.contiguous()
    out = torch.empty(src.shape, dtype=torch.float32)
    sp, op, n = src.data_ptr(), out.data_ptr(), src.numel()
    if n:
        _rows_parallel(lambda a, b: lib.mla_decode_e4m3fn(sp, op, a, b), n, 1 << 16)
    return out


def row_max_codes(t: torch.Tensor) -> torch.Tensor:
    """(t.view(uint8) & 0x7F).amax(dim=1) for a 2-D float8_e4m3fn CPU tensor: uint8 [N]."""
    import torch

    lib = library()
    if t.dtype != torch.float8_e4m3fn or t.dim() != 2 or t.device.type != "cpu" or not t.shape[1]:
        raise ValueError(
            f"row_max_codes takes a non-empty 2-D float8_e4m3fn CPU tensor, got {t.dtype} {tuple(t.shape)}"
        )
    src = t.contiguous()
    out = torch.empty(t.shape[0], dtype=torch.uint8)
    sp, op, k = src.data_ptr(), out.data_ptr(), t.shape[1]
    _rows_parallel(lambda a, b: lib.mla_row_max_code(sp, k, op, a, b), t.shape[0])
    return out


def __getattr__(name: str):
    # NONFINITE_MASKS: kernels.bits.NONFINITE's masks keyed by torch dtype (verification.values), built when asked for.
    if name == "NONFINITE_MASKS":
        from mla_convert.io.tensors import TORCH_DTYPES

        return {TORCH_DTYPES[dtype]: mask for dtype, (_, mask) in NONFINITE.items()}
    raise AttributeError(name)


def count_nonfinite(t: torch.Tensor) -> int:
    """int((~torch.isfinite(t)).sum()) for a bf16, f16 or f32 CPU tensor, from the bit patterns."""
    from mla_convert.io.tensors import TORCH_TO_ST

    dtype = TORCH_TO_ST.get(t.dtype)
    if dtype not in NONFINITE or t.device.type != "cpu":
        raise ValueError(f"count_nonfinite takes a bf16/f16/f32 CPU tensor, got {t.dtype} on {t.device}")
    mask = NONFINITE[dtype][1]
    return _count_matching(t, mask, mask)


def count_code(t: torch.Tensor, code: int) -> int:
    """int((t.view(torch.uint8) == code).sum()) for a float8_e4m3fn CPU tensor of any shape."""
    import torch

    if t.dtype != torch.float8_e4m3fn or t.device.type != "cpu":
        raise ValueError(f"count_code takes a float8_e4m3fn CPU tensor, got {t.dtype} on {t.device}")
    return _count_matching(t, 0xFF, code)


def _count_matching(t: torch.Tensor, mask: int, value: int) -> int:
    """How many elements of `t` (1, 2 or 4 bytes each) have (bits & mask) == value, over the threads."""
    src = t.contiguous()
    return count_matching(src.data_ptr(), src.numel(), src.element_size(), mask, value)


def count_matching(address: int, n: int, size: int, mask: int, value: int) -> int:
    """How many of the n elements of `size` bytes at `address` have (bits & mask) == value."""
    fn = getattr(library(), f"mla_count_matching{8 * size}")
    counts: list[int] = []
    if n:
        _rows_parallel(lambda a, b: counts.append(fn(address + a * size, b - a, mask, value)), n, 1 << 16)
    return sum(counts)


def fp8_bound_rows(q, scale, weight, scale_inv, block: tuple[int, int], rel: float, half_step: float) -> dict:
    """verify's channel-FP8 check in one pass (see mla_fp8_bound_rows): per-row tensors dd, xx, yy
    (float64), max_abs, max_ratio, amax_x (float32), n_bad, first_bad (int64)."""
    import torch

    lib = library()
    n, k = check_block_fp8(weight, scale_inv, block)
    if q.dtype != torch.float8_e4m3fn or tuple(q.shape) != (n, k) or scale.numel() != n:
        raise ValueError(f"fp8_bound_rows: q {tuple(q.shape)} / scale {tuple(scale.shape)} do not match {(n, k)}")
    q, sc = q.contiguous(), scale.reshape(n).to(torch.float32).contiguous()
    w, s = weight.contiguous(), scale_inv.contiguous()
    out = {name: torch.empty(n, dtype=torch.float64) for name in ("dd", "xx", "yy")}
    out |= {name: torch.empty(n, dtype=torch.float32) for name in ("max_abs", "max_ratio", "amax_x")}
    out |= {name: torch.empty(n, dtype=torch.int64) for name in ("n_bad", "first_bad")}
    order = ("dd", "xx", "yy", "max_abs", "max_ratio", "n_bad", "first_bad", "amax_x")
    ptrs = [out[name].data_ptr() for name in order]
    args = (q.data_ptr(), sc.data_ptr(), w.data_ptr(), s.data_ptr(), k, block[0], block[1], rel, half_step)
    if n and k:
        _rows_parallel(lambda a, b: lib.mla_fp8_bound_rows(*args, *ptrs, a, b), n)
    return out


# ---- verify on raw addresses (no torch): the checks of a tensor read into a buffer ----------------


def row_max_codes_at(address: int, n: int, k: int, out: int) -> None:
    """mla_row_max_code for the n rows of k e4m3fn codes at `address`, into n bytes at `out`."""
    fn = library().mla_row_max_code
    _rows_parallel(lambda a, b: fn(address, k, out, a, b), n)


def fp8_bound_rows_at(
    q: int, sc: int, w: int, s: int, k: int, block, rel: float, half_step: float, outs: list[int], n: int
) -> None:
    """mla_fp8_bound_rows on raw addresses for rows [0, n); `outs`: the 8 per-row arrays in the
    order dd, xx, yy, max_abs, max_ratio, n_bad, first_bad, amax_x."""
    fn = library().mla_fp8_bound_rows
    args = (q, sc, w, s, k, block[0], block[1], rel, half_step)
    _rows_parallel(lambda a, b: fn(*args, *outs, a, b), n)  # fmt: skip


def dequant_rows_at(w: int, s: int, k: int, block, out: int, n: int) -> None:
    """mla_dequant_rows for rows [0, n) on raw addresses (block (1, k): a per-row scale)."""
    fn = library().mla_dequant_rows
    _rows_parallel(lambda a, b: fn(w, s, k, block[0], block[1], out, a, b), n)


def bound_totals(outs: list[int], n: int) -> tuple[float, float, float, float, float, int]:
    """(sum dd, sum xx, sum yy, max max_abs, max max_ratio, sum n_bad) of fp8_bound_rows_at's n rows."""
    dd, xx, yy, max_abs, max_ratio, n_bad = outs[:6]
    out = (ctypes.c_double * 6)()
    library().mla_bound_totals(dd, xx, yy, max_abs, max_ratio, n_bad, n, out)
    return out[0], out[1], out[2], out[3], out[4], int(out[5])


def first_difference(a: int, b: int, n: int) -> int:
    """The first byte offset where the n bytes at a and b differ; -1 where they are equal."""
    return library().mla_first_difference(a, b, n)


def scale_over_limit(sc: int, amax: int, n: int, eps: float, fp8_max: float, rel: float) -> tuple[int, int]:
    """(rows over the scale limit, rows too close to it to decide in C) of n fp32 scales and row maxima."""
    near = ctypes.c_int64(0)
    over = library().mla_scale_over_limit(sc, amax, n, eps, fp8_max, rel, ctypes.byref(near))
    return over, near.value


def artifact_bound(q: int, sc: int, uk: int, uv: int, dims, rel: float, half_step: float) -> int:
    """Elements of W_UK_T and W_UV (bf16 at uk, uv) out of the artifact bound of the channel-FP8
    kv_b_proj at q (row scales at sc), over this process's threads by heads."""
    fn, counts = library().mla_artifact_bound, []
    args = (q, sc, uk, uv, dims.kv_lora_rank, dims.qk_nope_head_dim, dims.v_head_dim, rel, half_step)
    _rows_parallel(lambda a, b: counts.append(fn(*args, a, b)), dims.num_heads, 1)
    return sum(counts)


def normal_fill(seed: int, out: int, n: int) -> None:
    """n standard normal floats at `out` from the stream seeded by `seed` (mla_normal_fill)."""
    state = ctypes.c_uint64(seed)
    library().mla_normal_fill(ctypes.byref(state), out, n)


def functional_error(
    kvb: int, uk: int, uv: int, dims, rope_dim: int, queries: int, cache: int, inputs: tuple[int, int, int, int]
) -> float:
    """mla_functional_error: the relative error of the absorbed decode against the naive one, for
    the inputs (q_nope, q_pe, latent, k_pe) at the given addresses."""
    d = dims
    err = library().mla_functional_error(kvb, uk, uv, d.num_heads, d.qk_nope_head_dim, d.v_head_dim,
                                         d.kv_lora_rank, rope_dim, queries, cache, *inputs)  # fmt: skip
    if err < 0:
        raise MemoryError("functional MLA check: out of memory")
    return err
