"""The CPU core's float32 peak, measured: fused multiply-adds on independent registers.

A GEMM kernel's GFLOP/s means little without the core's own limit, and the
limit depends on the clock the core actually runs at (its boost under load) and
on how many FMA units it has, which no table gives for a cloud machine.  So it
is measured: a loop of 12 independent AVX2 (or AVX-512) FMA chains, enough to
cover the FMA latency on two ports, compiled once by the C compiler dynbatch's own
GEMM uses (native_gemm.compiler) into a temporary shared library and called through
ctypes, one thread.
"""

from __future__ import annotations

import ctypes
import functools
import platform
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable

from dynbatch.cpu import native_gemm

# 12 accumulators: FMA latency (4-5 cycles) times two FMA ports, with room to spare.
_SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>
double fma_flops(int64_t iters, float *sink) {
    VEC acc[12]; VEC x = SET1(1.0000001f), y = SET1(0.9999999f);
    for (int i = 0; i < 12; i++) acc[i] = SET1((float)i);
    for (int64_t n = 0; n < iters; n++) {  /* unrolled: the accumulators stay in registers */
#define F(i) acc[i] = FMA(acc[i], x, y);
        F(0) F(1) F(2) F(3) F(4) F(5) F(6) F(7) F(8) F(9) F(10) F(11)
    }
    VEC s = acc[0];
    for (int i = 1; i < 12; i++) s = ADD(s, acc[i]);
    float out[LANES]; STORE(out, s); *sink = out[0];
    return (double)iters * 12 * LANES * 2;
}
"""
_ISAS = {
    "avx512": ("-mavx512f", dict(VEC="__m512", SET1="_mm512_set1_ps", FMA="_mm512_fmadd_ps",
                                 ADD="_mm512_add_ps", STORE="_mm512_storeu_ps", LANES="16")),
    "avx2": ("-mavx2 -mfma", dict(VEC="__m256", SET1="_mm256_set1_ps", FMA="_mm256_fmadd_ps",
                                  ADD="_mm256_add_ps", STORE="_mm256_storeu_ps", LANES="8")),
}
RUN_FLOPS = 5e9  # ~0.03 s a run on a 3 GHz AVX-512 core
RUNS = 5


def _flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_model() -> str:
    """The CPU's model name as /proc/cpuinfo gives it (the platform's processor elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def isa() -> str | None:
    """The widest FMA instruction set this CPU has of those measured: "avx512", "avx2" or None."""
    flags = _flags()
    if "avx512f" in flags:
        return "avx512"
    if {"avx2", "fma"} <= flags:
        return "avx2"
    return None


@functools.cache
def fma_loop() -> Callable[[float], Callable[[], float]] | None:
    """``loop(flops)``: a thunk that runs about ``flops`` float32 FLOPs of the FMA loop on
    this thread and returns the FLOPs it ran; None where there is no x86 FMA or no C compiler."""
    kind, compiler = isa(), native_gemm.compiler()  # the compiler dynbatch's own GEMM is built with
    if kind is None or compiler is None:
        return None
    flags, macros = _ISAS[kind]
    with tempfile.TemporaryDirectory() as tmp:
        lib = Path(tmp) / "fma_peak.so"
        defines = [f"-D{k}={v}" for k, v in macros.items()]
        built = subprocess.run([compiler, "-O2", *flags.split(), *defines, "-shared", "-fPIC", "-x", "c", "-",
                                "-o", str(lib)], input=_SOURCE, text=True, capture_output=True)
        if built.returncode != 0:
            return None
        fma = ctypes.CDLL(str(lib)).fma_flops
    fma.restype, fma.argtypes = ctypes.c_double, [ctypes.c_int64, ctypes.POINTER(ctypes.c_float)]
    sink, per_iteration = ctypes.c_float(), 12 * int(macros["LANES"]) * 2

    def loop(flops: float) -> Callable[[], float]:
        iterations = max(1, round(flops / per_iteration))
        return lambda: fma(iterations, ctypes.byref(sink))

    return loop


@functools.cache
def core_peak_gflops() -> float | None:
    """One core's float32 GFLOP/s in a loop of FMAs (the best of RUNS), or None where
    there is no x86 FMA or no C compiler."""
    loop = fma_loop()
    if loop is None:
        return None
    run, best = loop(RUN_FLOPS), 0.0
    for _ in range(RUNS):
        start = time.perf_counter()
        flops = run()
        best = max(best, flops / (time.perf_counter() - start) / 1e9)
    return best
