"""dynbatch's own float32 GEMM for AVX2 CPUs, built once per machine, called through ctypes.

NOTE [dynbatch's own GEMM]
On the AMD EPYC (Zen 3, AVX2 + FMA) dynbatch is developed on, one core's float32
peak is ~96 GFLOP/s (``bench gemm``'s FMA loop).  MKL, which torch's CPU wheels
call, reaches 0.55-0.85 of it on the batched backward's tall products, numpy's
OpenBLAS 0.6-0.87, and no well-kept library on the package index ships better
kernels for this core (the ``blis`` wheel's generic kernels: 15-22 GFLOP/s).  So
dynbatch carries one GEMM of its own, ``csrc/sgemm_avx2.c``: BLIS's packing and
blocking around a 6 x 16 AVX2 micro-kernel (which alone runs at 0.95 of the peak;
whole products 0.78-0.94 by their best runs, docs/results/gemm_cpu.md).
It is one more kernel for ``cpu_matmul="auto"`` to measure (matmul_kernels.py,
NOTE [CPU matmul kernels]), never assumed faster.  An output of megabytes asks the
kernel for transparent huge pages before the first write (``madvise``, where the
system allows it): fresh memory otherwise faults 4 KiB at a time, which halved
[4096, 128] @ [128, 2048] for every kernel (47 against 73 GFLOP/s with the hint).

It is plain C with no torch headers, so it builds in a second: with the C compiler
Inductor would use (``$CC``, else ``gcc``/``cc``), ``-O3 -mavx2 -mfma -fopenmp``,
into Inductor's cache directory, named by a hash of the source and the command, and
loaded with ctypes (the call releases the GIL).  Its OpenMP threads are torch's:
the library asks for ``libgomp.so.1``, which torch's Linux wheels have already
loaded under that name, and each product runs on ``torch.get_num_threads()`` of
them.  Where the CPU lacks AVX2 or FMA (torch's own capability check), or no
compiler builds it, the kernel is simply not available (logged once).
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

from . import _compat

log = logging.getLogger("dynbatch")

SOURCE = Path(__file__).with_name("csrc") / "sgemm_avx2.c"
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-fPIC", "-shared")


def cpu_supported() -> bool:
    """x86-64 Linux with AVX2 and FMA, as torch's own dispatch sees the CPU."""
    return (platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64")
            and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"))


def compiler() -> str | None:
    for name in (os.environ.get("CC"), "gcc", "cc"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def build(cc: str, out_dir: Path) -> Path:
    """The shared library, compiled unless a build of this source and command exists."""
    command = [cc, *FLAGS]
    digest = hashlib.sha256(SOURCE.read_bytes() + "\0".join(command).encode()).hexdigest()[:16]
    target = out_dir / f"sgemm_avx2-{digest}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    # Another process (pytest's workers) may build the same file: each writes its own
    # and renames it into place, which is atomic.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        subprocess.run([*command, str(SOURCE), "-o", tmp], check=True, capture_output=True, text=True)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernel, or None where this machine cannot have it."""
    if not cpu_supported():
        return None
    cc = compiler()
    if cc is None:
        log.info("dynbatch: no C compiler found: its AVX2 GEMM is not available")
        return None
    try:
        lib = ctypes.CDLL(str(build(cc, Path(_compat.inductor_cache_dir()) / "dynbatch")))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or e
        log.info("dynbatch: its AVX2 GEMM did not build or load (%s): not available", str(detail)[-500:])
        return None
    size, ptr = ctypes.c_long, ctypes.c_void_p
    lib.dynbatch_sgemm.argtypes = [size, size, size, ptr, size, size, ptr, size, size, ptr, size, ctypes.c_int]
    lib.dynbatch_sgemm.restype = ctypes.c_int
    return lib


def applies(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == torch.float32 == b.dtype and a.device.type == "cpu" == b.device.type
            and a.dim() == 2 == b.dim() and library() is not None)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` (float32 CPU matrices, any strides) as a new row-major matrix."""
    m, k = a.shape
    n = b.shape[1]
    out = torch.empty((m, n), dtype=torch.float32)
    if m and n and library().dynbatch_sgemm(m, n, k, a.data_ptr(), a.stride(0), a.stride(1), b.data_ptr(),
                                             b.stride(0), b.stride(1), out.data_ptr(), n,
                                             torch.get_num_threads()):
        raise MemoryError(f"dynbatch's GEMM could not allocate its packing buffers for [{m}, {k}] @ [{k}, {n}]")
    return out
