"""dynbatch's own GEMM, its AVX2 and AVX-512 builds (cpu/native_gemm.py, csrc/sgemm.c), against float64 products."""

from __future__ import annotations

import os

import pytest
import torch

from dynbatch.cpu import matmul_kernels, native_gemm

# The C source's blocking per build: row panels of MR, column panels of NR, K in blocks
# of KC, N in blocks of NC, rows in blocks of MC per thread (one block of rows: B is
# packed a panel at a time, just before its use).
BLOCKING = {"avx2": dict(MR=6, NR=16, KC=512, NC=1024, MC=72),
            "avx512": dict(MR=12, NR=32, KC=256, NC=2048, MC=240)}


@pytest.fixture(params=list(native_gemm.ISAS))
def isa(request):
    if native_gemm.library(request.param) is None:
        pytest.skip(reason=f"no {request.param} on this CPU, not x86-64 Linux, or no C compiler")
    return request.param




def _layout(t: torch.Tensor, kind: str) -> torch.Tensor:
    """The same matrix row-major ("r"), as a transposed view ("c"), or strided in both dims ("s")."""
    if kind == "r":
        return t.contiguous()
    if kind == "c":
        return t.t().contiguous().t()
    wide = torch.zeros(t.shape[0] * 2, t.shape[1] * 3)
    wide[::2, ::3] = t
    return wide[::2, ::3]


def _check(a: torch.Tensor, b: torch.Tensor, isa: str) -> None:
    out = native_gemm.matmul(a, b, isa=isa)
    exact = (a.double() @ b.double()).float()
    torch.testing.assert_close(out, exact, rtol=1e-5, atol=1e-6 * max(a.shape[1], 1))
    assert out.is_contiguous() and out.dtype == torch.float32


@pytest.mark.parametrize("shape", [
    lambda MR, NR, KC, NC, MC: (1, 1, 1),
    lambda MR, NR, KC, NC, MC: (MR, 8, NR),
    lambda MR, NR, KC, NC, MC: (MR + 1, 9, NR + 1),  # edge tiles, k not a multiple of 8
    lambda MR, NR, KC, NC, MC: (MR * 3 - 1, 23, NR * 2 - 3),
    lambda MR, NR, KC, NC, MC: (MC + 5, 40, 33),  # two row blocks
    lambda MR, NR, KC, NC, MC: (13, KC + 7, 20),  # K in two blocks: the second accumulates
    lambda MR, NR, KC, NC, MC: (7, 5, NC + 9),  # N in two blocks
    lambda MR, NR, KC, NC, MC: (MC, KC + 1, NR * 3 + 1),  # one block of rows, whole and edge panels
    lambda MR, NR, KC, NC, MC: (MC * 2 + MR + 3, KC + 5, NR * 2 + 7),  # narrow: a row-major A in place
    lambda MR, NR, KC, NC, MC: (MR * 2 + MR * 2 // 3, 19, NR * 2),  # a last tile of 2/3 MR: its own kernel
], ids=["1x1x1", "tile", "edges", "edges-k23", "two-row-blocks", "two-k-blocks", "two-n-blocks", "streamed-b",
        "a-in-place", "edge-rows-kernel"])
@pytest.mark.parametrize("layouts", ["rr", "rc", "cr", "cc", "ss"])
def test_equals_the_product_in_every_layout(isa, shape, layouts):
    m, k, n = shape(**BLOCKING[isa])
    gen = torch.Generator().manual_seed(m * 1000 + k + n)
    a, b = torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen)
    _check(_layout(a, layouts[0]), _layout(b, layouts[1]), isa)


# An output at least this large, written in one block of K into pages already in memory,
# is written with streamed stores (csrc/sgemm.c, STREAM_MIN_BYTES).
STREAM_MIN_BYTES = 8 << 20


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("resident", [True, False], ids=["out-in-memory", "new-out"])
def test_a_large_output_written_around_the_caches(isa, threads, resident):
    """Every element written (the buffer starts as NaN), edge tiles and rows included,
    into a buffer in memory (streamed stores) or a new one (streamed where its pages are in memory)."""
    m, k, n = 2048 + 5, 40, 1024 + 16  # n % 16 == 0 (aligned rows), n % NR != 0 (an edge panel)
    assert m * n * 4 >= STREAM_MIN_BYTES
    gen = torch.Generator().manual_seed(threads)
    a, b = torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen)
    out = torch.full((m, n), float("nan")) if resident else None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        result = native_gemm.matmul(a, b, out, isa=isa)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(result, (a.double() @ b.double()).float(), rtol=1e-5, atol=1e-4)


def test_empty_operands(isa):
    assert native_gemm.matmul(torch.randn(0, 5), torch.randn(5, 3), isa=isa).shape == (0, 3)
    assert native_gemm.matmul(torch.randn(4, 5), torch.randn(5, 0), isa=isa).shape == (4, 0)
    torch.testing.assert_close(native_gemm.matmul(torch.randn(4, 0), torch.randn(0, 3), isa=isa), torch.zeros(4, 3))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_torchs_thread_count_gives_the_same_product(isa, threads):
    """Row blocks are split between OpenMP threads (more threads than blocks included)."""
    gen = torch.Generator().manual_seed(threads)
    a, b = torch.randn(BLOCKING[isa]["MC"] * 3 + 1, 70, generator=gen), torch.randn(70, 50, generator=gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = native_gemm.matmul(a, b, isa=isa)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out, (a.double() @ b.double()).float(), rtol=1e-5, atol=1e-4)


def test_float32_cpu_matrices_only(isa):
    a, b = torch.randn(8, 4), torch.randn(4, 3)
    assert native_gemm.applies(a, b, isa) and matmul_kernels.applies(isa, a, b)
    assert not native_gemm.applies(a.double(), b.double(), isa)
    assert not native_gemm.applies(a.half(), b.half(), isa)
    assert not native_gemm.applies(a[None], b, isa)


def test_shares_torchs_openmp_runtime():
    """One OpenMP runtime in the process: the library's threads are torch's."""
    with open("/proc/self/maps") as maps:
        runtimes = {line.split()[-1] for line in maps if "libgomp" in line and "r-xp" in line}
    assert len(runtimes) <= 1, runtimes


def test_built_once_into_the_cache_then_reused(isa, tmp_path):
    cc = native_gemm.compiler()
    path = native_gemm.build(cc, tmp_path, isa)
    stamp = os.stat(path).st_mtime_ns
    assert native_gemm.build(cc, tmp_path, isa) == path and os.stat(path).st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary left behind
