"""dynbatch's own AVX2 GEMM (native_gemm.py, csrc/sgemm_avx2.c) against float64 products."""

from __future__ import annotations

import os

import pytest
import torch

from dynbatch import matmul_kernels, native_gemm

pytestmark = pytest.mark.skipif(native_gemm.library() is None,
                                reason="no AVX2 + FMA on this CPU, not x86-64 Linux, or no C compiler")

# The C source's blocking: row panels of 6, column panels of 16, K in blocks of 512,
# N in blocks of 1024, rows in blocks of 72 per thread.
MR, NR, KC, NC, MC = 6, 16, 512, 1024, 72


def _layout(t: torch.Tensor, kind: str) -> torch.Tensor:
    """The same matrix row-major ("r"), as a transposed view ("c"), or strided in both dims ("s")."""
    if kind == "r":
        return t.contiguous()
    if kind == "c":
        return t.t().contiguous().t()
    wide = torch.zeros(t.shape[0] * 2, t.shape[1] * 3)
    wide[::2, ::3] = t
    return wide[::2, ::3]


def _check(a: torch.Tensor, b: torch.Tensor) -> None:
    out = native_gemm.matmul(a, b)
    exact = (a.double() @ b.double()).float()
    torch.testing.assert_close(out, exact, rtol=1e-5, atol=1e-6 * max(a.shape[1], 1))
    assert out.is_contiguous() and out.dtype == torch.float32


@pytest.mark.parametrize("m, k, n", [
    (1, 1, 1), (MR, 8, NR), (MR + 1, 9, NR + 1), (MR * 3 - 1, 23, NR * 2 - 3),  # edge tiles, k not a multiple of 8
    (MC + 5, 40, 33),            # two row blocks
    (13, KC + 7, 20),            # K in two blocks: the second accumulates
    (7, 5, NC + 9),              # N in two blocks
])
@pytest.mark.parametrize("layouts", ["rr", "rc", "cr", "cc", "ss"])
def test_equals_the_product_in_every_layout(m, k, n, layouts):
    gen = torch.Generator().manual_seed(m * 1000 + k + n)
    a, b = torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen)
    _check(_layout(a, layouts[0]), _layout(b, layouts[1]))


def test_empty_operands():
    assert native_gemm.matmul(torch.randn(0, 5), torch.randn(5, 3)).shape == (0, 3)
    assert native_gemm.matmul(torch.randn(4, 5), torch.randn(5, 0)).shape == (4, 0)
    torch.testing.assert_close(native_gemm.matmul(torch.randn(4, 0), torch.randn(0, 3)), torch.zeros(4, 3))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_torchs_thread_count_gives_the_same_product(threads):
    """Row blocks are split between OpenMP threads (more threads than blocks included)."""
    gen = torch.Generator().manual_seed(threads)
    a, b = torch.randn(MC * 3 + 1, 70, generator=gen), torch.randn(70, 50, generator=gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = native_gemm.matmul(a, b)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out, (a.double() @ b.double()).float(), rtol=1e-5, atol=1e-4)


def test_float32_cpu_matrices_only():
    a, b = torch.randn(8, 4), torch.randn(4, 3)
    assert native_gemm.applies(a, b) and matmul_kernels.applies("avx2", a, b)
    assert not native_gemm.applies(a.double(), b.double())
    assert not native_gemm.applies(a.half(), b.half())
    assert not native_gemm.applies(a[None], b)


def test_shares_torchs_openmp_runtime():
    """One OpenMP runtime in the process: the library's threads are torch's."""
    with open("/proc/self/maps") as maps:
        runtimes = {line.split()[-1] for line in maps if "libgomp" in line and "r-xp" in line}
    assert len(runtimes) <= 1, runtimes


def test_built_once_into_the_cache_then_reused(tmp_path):
    cc = native_gemm.compiler()
    path = native_gemm.build(cc, tmp_path)
    stamp = os.stat(path).st_mtime_ns
    assert native_gemm.build(cc, tmp_path) == path and os.stat(path).st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary left behind
