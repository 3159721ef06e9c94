"""dynbatch's own float32 GEMM for x86-64 CPUs (AVX2, AVX-512), built once per machine, called through ctypes.

NOTE [dynbatch's own GEMM]
On the AMD EPYC (Zen 3, AVX2 + FMA) dynbatch was first developed on, one core's float32
peak is ~96 GFLOP/s (``bench gemm``'s FMA loop).  MKL, which torch's CPU wheels
call, reaches 0.55-0.85 of it on the batched backward's tall products, numpy's
OpenBLAS 0.6-0.87, and no well-kept library on the package index ships better
kernels for this core (the ``blis`` wheel's generic kernels: 15-22 GFLOP/s).  So
dynbatch carries one GEMM of its own, ``csrc/sgemm.c``: BLIS's packing and blocking
around an MR x NR micro-kernel, built twice: for AVX2 (6 x 16; alone 0.95 of that
core's peak, whole products 0.78-0.94 by their best runs, docs/results/gemm_cpu.md)
and for AVX-512 (12 x 32) where the CPU has it: on an AMD EPYC core with AVX-512, MKL
reached ~110 of the core's ~256 GFLOP/s and XLA 249 (issue 36).
On an Intel Xeon (Sapphire Rapids) MKL runs at 0.83-0.97 of the peak but packs the
whole of a large B for a few rows: [128, 2048] @ [2048, 2048] 0.74 of the peak.  With
one block of rows this GEMM packs B a panel at a time, just before its use, the next
panel prefetched meanwhile (``block_streaming_b``): ~0.8 there.  A last tile of 2/3 MR
rows (M = 128) has a kernel of its own, and a narrow product (N <= 256) reads a
row-major A in place rather than packing it for a few B panels.  Each build is one more
kernel for ``cpu_matmul="auto"`` to measure (cpu/matmul_kernels.py, NOTE [CPU matmul
kernels]), never assumed faster.

NOTE [huge pages for large outputs]
A product's output of megabytes is fresh memory at most calls: glibc maps an
allocation over its mmap threshold anew each time (the threshold stops adapting
at 32 MiB) and torch's CPU allocator hands it on, so the kernel's first writes
fault one 4 KiB page at a time, 8192 faults for 32 MiB.  That halved
[4096, 128] @ [128, 2048] for every kernel, MKL's included.  ``new_output`` asks
for transparent huge pages on the output's 2 MiB-aligned interior before any
kernel writes it (``madvise(MADV_HUGEPAGE)``, what torch's THP_MEM_ALLOC_ENABLE=1
does for every allocation; a no-op where THP is ``never``): 16 faults instead.
One core, one run each: on the AMD EPYC (Zen 3) dynbatch's AVX2 kernel 47.8 ->
72.7 GFLOP/s; on an Intel Xeon (AVX-512) MKL 78 -> 125, and [4096, 512] @
[512, 2048] 125 -> 145.  Every routed kernel that can write into a given output
takes one from here (ATen's ``mm(out=)``, numpy's BLAS, this GEMM), and a product
into Inductor's buffer (``matmul_kernels.mm_out``) has that buffer advised first.

NOTE [Streamed stores]
A product with a small K writes an output far larger than L2 once: [4096, 128] @ [128,
2048] writes 32 MiB while its packed B (1 MiB) waits in L2 to be reused, and the plain
stores read each output line in before writing it and push B out.  Where C is written
in one block of K, is at least STREAM_MIN_BYTES (8 MiB, four times the Xeon's L2),
aligned for them, and its first and last pages are already in memory (``mincore``),
each tile is written with non-temporal stores (``_mm512_stream_ps``), which go around
the caches.  On the Xeon, one core, an interleaved A/B of the two builds into a buffer
in memory: [4096, 128] @ [128, 2048] 127-130 -> 153-155 GFLOP/s (MKL 134), [4096,
128] @ [128, 512] 131-135 -> 149-154, and 107 -> 124 with a sum of the output after
it (the next kernel reads C from memory, not L3, and it still wins).  Fresh pages are
left to plain stores: the kernel zeroes a page as the first write faults it in, and a
streamed store to that just-zeroed line cost more than it saved (113 -> 107); so a new
32 MiB output still costs its faults (~4 ms of a ~17 ms product), which only an
allocator that keeps large buffers avoids: ``new_output`` takes one of dynbatch's kept
buffers (NOTE [Reused CPU buffers] in cpu/kept_buffers.py), so a product whose previous output
was dropped writes into memory already mapped (``bench gemm``, glibc's defaults: 0.67 ->
0.9 of the core's peak at [4096, 128] @ [128, 2048]).

It is plain C with no torch headers, so it builds in a second: with the C compiler
Inductor would use (``$CC``, else ``gcc``/``cc``), ``-O3 -fopenmp`` and the build's
instruction-set flags (``ISAS``), into Inductor's cache directory, named by a hash of
the source and the command, and loaded with ctypes (the call releases the GIL).  Its
OpenMP threads are torch's: the library asks for ``libgomp.so.1``, which torch's Linux
wheels have already loaded under that name, and each product runs on
``torch.get_num_threads()`` of them.  Where the CPU lacks the instruction set (torch's
own capability check), or no compiler builds it, that build is simply not available
(logged once).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from .. import _compat
from . import kept_buffers

log = logging.getLogger("dynbatch")

SOURCE = Path(__file__).with_name("csrc") / "sgemm.c"
# One build of the source per instruction set: its compiler flags, and the capability
# torch's own dispatch must report for the build to run here.
ISAS = {
    "avx2": (("-O3", "-mavx2", "-mfma", "-fopenmp", "-fPIC", "-shared"), ("AVX2", "AVX512")),
    "avx512": (("-O3", "-mavx512f", "-mavx2", "-mfma", "-fopenmp", "-fPIC", "-shared"), ("AVX512",)),
}


HUGE_PAGE = 2 << 20   # bytes: x86-64's transparent huge page
MADV_HUGEPAGE = 14    # <sys/mman.h> on Linux


@functools.cache
def _madvise():
    """libc's madvise, or None off Linux."""
    if platform.system() != "Linux":
        return None
    try:
        madvise = ctypes.CDLL(None).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return madvise


HUGE_OUTPUT = 2 * HUGE_PAGE  # bytes: a buffer this large surely holds a whole aligned huge page


def new_output(rows: int, cols: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An empty row-major [rows, cols] matrix for a product to write: a kept buffer where it
    is large (NOTE [Reused CPU buffers] in cpu/kept_buffers.py), its whole huge pages advised
    (NOTE [huge pages for large outputs])."""
    return advise_huge_pages(kept_buffers.empty_strided((rows, cols), (cols, 1), dtype))


def advise_huge_pages(out: torch.Tensor) -> torch.Tensor:
    """Ask for huge pages on the 2 MiB-aligned interior of ``out`` before a product writes
    it (pages already touched keep theirs: a hint for fresh memory); small buffers as they are."""
    if out.nbytes < HUGE_OUTPUT:
        return out
    start = (out.data_ptr() + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1)
    end = (out.data_ptr() + out.nbytes) & ~(HUGE_PAGE - 1)
    madvise = _madvise()
    if end > start and madvise is not None:
        madvise(start, end - start, MADV_HUGEPAGE)  # a hint: its failure changes nothing
    return out


def cpu_supported(isa: str = "avx2") -> bool:
    """x86-64 Linux with the instruction set, as torch's own dispatch sees the CPU."""
    return (platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64")
            and torch.backends.cpu.get_cpu_capability() in ISAS[isa][1])


def compiler() -> str | None:
    for name in (os.environ.get("CC"), "gcc", "cc"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def build(cc: str, out_dir: Path, isa: str = "avx2") -> Path:
    """The GEMM's shared library for ``isa``, compiled unless this build exists."""
    return build_library(SOURCE, [cc, *ISAS[isa][0]], out_dir, f"sgemm_{isa}")


def build_library(source: Path, command: list[str], out_dir: Path, stem: str) -> Path:
    """``source`` compiled by ``command`` into ``out_dir``, unless a build of this source
    and command exists (named by their digest)."""
    digest = hashlib.sha256(source.read_bytes() + "\0".join(command).encode()).hexdigest()[:16]
    target = out_dir / f"{stem}-{digest}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    # Another process (pytest's workers) may build the same file: each writes its own
    # and renames it into place, which is atomic.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        subprocess.run([*command, str(source), "-o", tmp], check=True, capture_output=True, text=True)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.cache
def library(isa: str = "avx2") -> ctypes.CDLL | None:
    """The loaded kernel built for ``isa``, or None where this machine cannot have it."""
    if not cpu_supported(isa):
        return None
    cc = compiler()
    if cc is None:
        log.info("dynbatch: no C compiler found: its %s GEMM is not available", isa)
        return None
    try:
        lib = ctypes.CDLL(str(build(cc, Path(_compat.inductor_cache_dir()) / "dynbatch", isa)))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or e
        log.info("dynbatch: its %s GEMM did not build or load (%s): not available", isa, str(detail)[-500:])
        return None
    size, ptr = ctypes.c_long, ctypes.c_void_p
    lib.dynbatch_sgemm.argtypes = [size, size, size, ptr, size, size, ptr, size, size, ptr, size, ctypes.c_int]
    lib.dynbatch_sgemm.restype = ctypes.c_int
    return lib


def applies(a: torch.Tensor, b: torch.Tensor, isa: str = "avx2") -> bool:
    return (a.dtype == torch.float32 == b.dtype and a.device.type == "cpu" == b.device.type
            and a.dim() == 2 == b.dim() and library(isa) is not None)


def matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None, isa: str = "avx2") -> torch.Tensor:
    """``a @ b`` (float32 CPU matrices, any strides) as a new row-major matrix, or into
    ``out`` (row-major [M, N]), by the build for ``isa``."""
    m, k = a.shape
    n = b.shape[1]
    out = new_output(m, n) if out is None else out
    if m and n and library(isa).dynbatch_sgemm(m, n, k, a.data_ptr(), a.stride(0), a.stride(1), b.data_ptr(),
                                                b.stride(0), b.stride(1), out.data_ptr(), n,
                                                torch.get_num_threads()):
        raise MemoryError(f"dynbatch's GEMM could not allocate its packing buffers for [{m}, {k}] @ [{k}, {n}]")
    return out


def matmul_avx512(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``matmul`` by the AVX-512 build."""
    return matmul(a, b, out, "avx512")
