"""The CPU kernel of dynbatch's matrix products, chosen by measurement.

NOTE [CPU matmul kernels]
Inductor hands every CPU ``mm`` to ATen, which calls the BLAS torch was built
with (MKL on x86), in the operands' layout.  Which kernel and which layout is
fastest depends on the shape, and the shapes of backward graphs are extreme:

- a batched backward through a linear layer multiplies the [B*N, n] cotangent by
  the weight, ``mm(g, W.t())``: oneDNN's GEMM (``torch.ops.mkldnn._linear_pointwise``,
  which computes ``a @ w.t()`` with ``w`` [N, K] as stored) blocks such tall
  products better on some CPUs and is slower on short ones, where its per-call
  setup dominates.  On the 2-core AMD EPYC dynbatch is developed on, one thread,
  float32, oneDNN over MKL: 0.72-0.93x the time from M = 1024 (K = N = 128 and
  512), but up to 5x at M = 8 (docs/design.md, "Stage 4 — lowering");
- a weight grad ``mm(g.t(), x)`` reduces over the long dim: [32, 65536] @
  [65536, 8] takes MKL 4 ms in that orientation and 0.6 ms computed as
  ``mm(x.t(), g).t()`` (the same sums, the transposed product); a tall product
  with a short output, [65536, 32] @ [32, 8], 2.4 ms against 0.7 ms the same way
  (force training's pair potential has both, twice per step).

- MKL's kernels for this project's AMD EPYC (Zen 3, AVX2) run at 0.55-0.85 of the
  core's float32 peak (96 GFLOP/s, measured by ``bench gemm``'s FMA loop); the
  OpenBLAS that numpy ships leads on some wide products (N = 2048), and dynbatch's
  own AVX2 GEMM on most tall ones (77-91 GFLOP/s from M = 1024, one core);
- on an Intel Xeon (AVX-512) MKL runs at 0.83-0.97 of the peak but packs a large B
  for few rows at a memory pass's cost: [128, 2048] @ [2048, 2048] 0.74, where
  dynbatch's AVX-512 build, which packs B a panel at a time, runs at ~0.8.

So a product has up to six kernels (``KERNELS``): ATen's as given, ATen's on
the transposed problem (``flipped``, its result copied back to row-major),
oneDNN's where it applies (float32, ``a`` contiguous, ``b.t()`` contiguous or
small enough to copy), numpy's BLAS (``openblas``, where numpy and
threadpoolctl are installed; NOTE [numpy's BLAS]) and dynbatch's own float32
GEMM, built for AVX2 (``avx2``) and for AVX-512 (``avx512``) where the CPU has them
(x86-64 Linux, a C compiler; NOTE [dynbatch's own GEMM] in cpu/native_gemm.py).  "auto", the default, takes the fastest per shape.  It
is measured, not assumed: the first product of each (power-of-two buckets of
M, K and N, operand layouts, dtype, threads) runs every applicable kernel on its
real operands, a few times each, and the fastest is remembered for the rest of
the process; another kernel displaces ATen's only where it is clearly faster
(``MARGIN``).  They compute the same product and differ only in rounding (the
order of the sums).

Inductor lowers ``_linear_pointwise`` only for a weight it has frozen into a
constant, and sizes are symbolic here, so the choice is a custom op,
``dynbatch::mm``.  Inductor lowers it (``lowerings()``) to a plain call of
``mm_out`` from its generated code, as it calls ``aten.mm``: an extern call of the
op itself would go through the dispatcher's Python kernel, 10-20 us a product.
That lowering builds Inductor's IR nodes here (``extern_lowering``), writing into a
buffer Inductor plans (NOTE [Products into Inductor's buffers]): with
oneDNN's ``_linear_pointwise``, the private torch APIs this module uses itself,
not through ``_compat``.  Where the IR moved, products fall back to the op's own
extern call (fail_soft.py).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Callable

import torch

from .. import _compat, fail_soft
from ..options import CPU_MATMUL
from . import native_gemm

log = logging.getLogger("dynbatch")

# Options.cpu_matmul's values (options.py owns the list).
CHOICES = CPU_MATMUL
# Timed calls of each kernel in a measurement, after one untimed call that
# builds oneDNN's primitive and warms the caches (the minimum is compared).
TRIALS = 5
# Another kernel displaces ATen's only below this share of ATen's time.  Measured
# alone, warm, a near tie is noise, and inside a program the routed call pays more
# (a Python extern call, its own output): on `attention` (products [4096, 64] @
# [64, 64], the AVX2 kernel 2 % faster alone) taking the faster of a tie cost the
# whole program 3-4 % (bench ab dynbatch.cpu_matmul=aten,auto, two runs).
MARGIN = 0.95
# Products with M and K both shorter than this stay with ATen unmeasured.  Inside
# the programs, on the 2-core AMD EPYC, one thread, oneDNN over MKL (forced, timed
# interleaved): M = 512 1.05-1.09x (three A/Bs), M = 1024 0.93-1.02x (nine),
# though oneDNN alone is 0.96x at 512: a first-call measurement would pick it
# there and lose.  On the earlier host M = 1024 was a coin flip (1.08x at
# K = N = 128, 0.86x at 512), which the measurement decides at a cost of a few
# percent either way.  The flipped orientation gains from K or M of several
# thousand on ([32, 8192] @ [8192, 8]: 0.08 ms against 0.30).
MIN_ROWS = 1024
# oneDNN takes the second operand as w = b.t() [N, K] contiguous: copied first
# when it is not, if it has at most this many elements (a weight, not an activation).
COPY_LIMIT = 1 << 16

_chosen: dict[tuple, str] = {}
_lock = threading.Lock()


# Each kernel computes ``a @ b`` as a new row-major matrix, or into ``out`` (row-major
# [M, N], Inductor's buffer: NOTE [Products into Inductor's buffers]).

def aten(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    if out is not None:
        return torch.mm(a, b, out=out)
    m, n = a.shape[0], b.shape[1]
    if m * n * a.itemsize < native_gemm.HUGE_OUTPUT:  # the op is CPU-only
        return torch.mm(a, b)
    return torch.mm(a, b, out=native_gemm.new_output(m, n, a.dtype))  # NOTE [huge pages for large outputs]


def flipped(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    product = torch.mm(b.t(), a.t()).t()
    return product.contiguous() if out is None else out.copy_(product)


def onednn(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    w = b.t()
    product = torch.ops.mkldnn._linear_pointwise(a, w if w.is_contiguous() else w.contiguous(), None, "none",
                                                 [], "")
    return product if out is None else out.copy_(product)


# NOTE [numpy's BLAS]
# numpy's wheels ship their own OpenBLAS, which runs float32 GEMMs nearer this
# CPU's peak than the MKL torch's CPU wheels call (NOTE [CPU matmul kernels]).
# Its products write into the torch output in place (``out=``, zero-copy views).
# OpenBLAS has a thread pool of its own, sized by default to every core, which
# would run beside torch's intra-op threads; each product runs it at torch's
# thread count and sets the process-wide count back after, through threadpoolctl
# (a well-kept library that finds the BLAS numpy loaded and its thread setter,
# whose symbol names differ between builds).  numpy code running in another Python
# thread during such a product sees torch's count, not its own.


class NumpyBlas:
    """numpy's BLAS with a thread count per product (NOTE [numpy's BLAS])."""

    def __init__(self, np, blas) -> None:
        self.np, self.blas = np, blas

    def matmul(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        out = native_gemm.new_output(a.shape[0], b.shape[1], a.dtype) if out is None else out
        threads, theirs = torch.get_num_threads(), self.blas.get_num_threads()
        if threads != theirs:
            self.blas.set_num_threads(threads)
        try:
            self.np.matmul(a.numpy(), b.numpy(), out=out.numpy())
        finally:
            if threads != theirs:
                self.blas.set_num_threads(theirs)
        return out


@functools.cache
def numpy_blas() -> NumpyBlas | None:
    """numpy's OpenBLAS, where numpy uses one and threadpoolctl can set its threads."""
    try:
        import numpy as np
        import threadpoolctl
    except ImportError:
        return None
    np.ones(1) @ np.ones(1)  # numpy loads its BLAS lazily on some builds
    for lib in threadpoolctl.ThreadpoolController().select(internal_api="openblas").lib_controllers:
        # numpy's own copy: its wheel keeps it in numpy.libs (or scipy_openblas*), beside numpy
        if "numpy" in lib.filepath or "scipy_openblas" in lib.filepath:
            return NumpyBlas(np, lib)
    return None


def openblas(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    return numpy_blas().matmul(a, b, out)


# name -> kernel(a, b, out=None) computing a @ b, as a new contiguous matrix or into out.
KERNELS: dict[str, Callable[..., torch.Tensor]] = {
    "aten": aten, "flipped": flipped, "onednn": onednn, "openblas": openblas, "avx2": native_gemm.matmul,
    "avx512": native_gemm.matmul_avx512}


@functools.cache
def onednn_available() -> bool:
    return bool(getattr(torch._C, "_has_mkldnn", False)) and torch.backends.mkldnn.is_available()


def available(name: str) -> bool:
    """Whether this process has kernel ``name`` at all (oneDNN, numpy's BLAS and dynbatch's
    own GEMM may be missing)."""
    if name == "onednn":
        return onednn_available()
    if name == "openblas":
        return numpy_blas() is not None
    if name in native_gemm.ISAS:
        return native_gemm.library(name) is not None
    return True


def applies(name: str, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether kernel ``name`` computes ``a @ b`` (ATen's always does)."""
    if name == "aten":
        return True
    if a.device.type != "cpu" or a.dim() != 2 or b.dim() != 2 or a.numel() == 0 or b.numel() == 0:
        return False
    if name == "flipped":
        return a.dtype in (torch.float32, torch.float64)
    if name in native_gemm.ISAS:
        return native_gemm.applies(a, b, name)
    if name == "openblas":
        # .numpy() refuses tensors with a lazy conjugate or negation bit
        return (a.dtype == b.dtype and a.dtype in (torch.float32, torch.float64)
                and not any(t.is_conj() or t.is_neg() for t in (a, b)) and numpy_blas() is not None)
    return (a.dtype == torch.float32 == b.dtype and a.is_contiguous() and onednn_available()
            and (b.t().is_contiguous() or b.numel() <= COPY_LIMIT))


def layout(t: torch.Tensor) -> str:
    """"r" row-major, "c" column-major (a transposed view), "x" neither."""
    return _layout(t.stride())


def _layout(stride: tuple[int, int]) -> str:
    return "r" if stride[1] == 1 else "c" if stride[0] == 1 else "x"


def shape_key(a: torch.Tensor, b: torch.Tensor) -> tuple:
    # Neighbouring sizes share a kernel: power-of-two buckets, not the sizes, so a
    # sweep over B (in M or in K) measures a handful of times, not once per B.
    # Every routed product computes this key: plain tuple work, no helper calls.
    m, k = a.shape
    return (m.bit_length(), k.bit_length(), b.shape[1].bit_length(), _layout(a.stride()),
            _layout(b.stride()), a.dtype, torch.get_num_threads())


def tall(m: int, k: int) -> bool:
    """Worth measuring: short products stay with ATen (the routed call costs more than it could win)."""
    return max(m, k) >= MIN_ROWS


def mm(a: torch.Tensor, b: torch.Tensor, kernel: str = "auto", out: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b`` by the kernel ``kernel`` names (ATen's where that does not apply), or by
    the measured fastest ("auto"); as a new matrix, or into ``out`` (row-major [M, N])."""
    if kernel != "auto":
        return KERNELS[kernel if applies(kernel, a, b) else "aten"](a, b, out)
    m, k = a.shape
    if m < MIN_ROWS and k < MIN_ROWS:  # not tall(m, k), inline: every routed product asks
        return KERNELS["aten"](a, b, out)
    key = shape_key(a, b)
    name = _chosen.get(key)
    if name is not None:
        return KERNELS[name](a, b, out)
    name, product = measure(a, b)
    with _lock:
        _chosen.setdefault(key, name)
    return product if out is None else out.copy_(product)


def mm_out(a: torch.Tensor, b: torch.Tensor, kernel: str = "auto", *, out: torch.Tensor) -> torch.Tensor:
    """``mm`` into ``out``, a row-major [M, N] buffer Inductor's wrapper planned (fresh, or
    one an earlier kernel freed: NOTE [Products into Inductor's buffers]); returns ``out``."""
    native_gemm.advise_huge_pages(out)  # NOTE [huge pages for large outputs]
    return mm(a, b, kernel, out)


def measure(a: torch.Tensor, b: torch.Tensor) -> tuple[str, torch.Tensor]:
    """Time the kernels that apply on these operands, alternating (a drifting machine
    slows all alike); return the fastest one's name and a product it computed."""
    kernels = {name: kernel for name, kernel in KERNELS.items() if applies(name, a, b)}
    outs = {name: kernel(a, b) for name, kernel in kernels.items()}
    best = _fastest_runs(kernels, a, b, outs)
    name = _winner(best)
    if name != "aten":
        # Confirmed head to head: among six kernels one round's noise can crown a near tie
        # ([4096, 64] @ [64, 256] went to `avx512`, 3 % slower than ATen's alone, and cost
        # `attention` 2-5 %).
        name = _winner(_fastest_runs({n: kernels[n] for n in ("aten", name)}, a, b, outs))
    log.debug("dynbatch: CPU matmul [%d, %d] @ [%d, %d] (%s%s) %s, %d threads: %s (%s)", *a.shape, *b.shape,
              layout(a), layout(b), a.dtype, torch.get_num_threads(), name,
              ", ".join(f"{k} {v * 1e6:.0f} us" for k, v in best.items()))
    return name, outs[name]


def _fastest_runs(kernels: dict[str, Callable[..., torch.Tensor]], a: torch.Tensor, b: torch.Tensor,
                  outs: dict[str, torch.Tensor]) -> dict[str, float]:
    """Each kernel's fastest of TRIALS runs, in turn; its last product into ``outs``."""
    best = dict.fromkeys(kernels, float("inf"))
    for _ in range(TRIALS):
        for name, kernel in kernels.items():
            start = time.perf_counter()
            outs[name] = kernel(a, b)
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def _winner(best: dict[str, float]) -> str:
    """The fastest, where it takes under MARGIN of ATen's time (always timed: it applies to
    every product); else ATen's."""
    name = min(best, key=best.get)
    return "aten" if best[name] > MARGIN * best["aten"] else name


def chosen() -> dict[tuple, str]:
    """The kernel measured for each shape bucket so far (a copy)."""
    return dict(_chosen)


def forget() -> None:
    """Measure again from the next product on (tests; after changing the thread count)."""
    with _lock:
        _chosen.clear()


def operands(m: int, k: int, n: int, dtype: torch.dtype, layouts: str = "rr") -> tuple[torch.Tensor, torch.Tensor]:
    """Random operands [m, k] and [k, n] in the given layouts ("r" row-major, "c" a transposed view),
    drawn from a generator of their own: measuring never moves the user's random stream."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, dtype=dtype, generator=gen) if layouts[0] != "c" else \
        torch.randn(k, m, dtype=dtype, generator=gen).t()
    b = torch.randn(k, n, dtype=dtype, generator=gen) if layouts[1] != "c" else \
        torch.randn(n, k, dtype=dtype, generator=gen).t()
    return a, b


def choice_for_static_shape(m: int, k: int, n: int, dtype: torch.dtype, kernel: str,
                            layouts: str = "rr") -> str:
    """The kernel a product of known sizes and layouts gets, measured on random operands
    when ``kernel`` is "auto" (the compile-time twin of ``mm``'s run-time choice)."""
    if m == 0 or k == 0 or n == 0:
        return "aten"
    with _compat.real_tensors():
        a, b = operands(m, k, n, dtype, layouts)
        if kernel != "auto":
            return kernel if applies(kernel, a, b) else "aten"
        if not tall(m, k):
            return "aten"
        key = shape_key(a, b)
        if key not in _chosen:
            name, _ = measure(a, b)
            with _lock:
                _chosen.setdefault(key, name)
    return _chosen[key]


# --- the custom op Inductor calls -------------------------------------------------

_library: torch.library.Library | None = None


def op() -> torch._ops.OpOverload:
    """``dynbatch::mm(Tensor a, Tensor b, str kernel) -> Tensor``, registered on first use
    (importing dynbatch registers nothing)."""
    global _library
    with _lock:
        if _library is None:
            lib = torch.library.Library("dynbatch", "DEF")
            lib.define("mm(Tensor a, Tensor b, str kernel) -> Tensor")
            lib.impl("mm", mm, "CPU")
            torch.library.register_fake("dynbatch::mm", _mm_fake, lib=lib)
            _library = lib
    return torch.ops.dynbatch.mm.default


# NOTE [Products into Inductor's buffers]
# Inductor calls ATen's products as ``mm(a, b, out=buf)``, where ``buf`` is a buffer its
# wrapper plans: one freed by an earlier kernel of the same program where the sizes
# allow, so a program's intermediates stay few and warm in the cache.  A routed product
# that allocated its own output (``ExternKernelAlloc``) took a new buffer at every call,
# and where the measurement then chose ATen's kernel anyway -- every shape of the
# benchmark on the Xeon -- the routing cost the whole program 1-7 % (bench ``ab
# dynbatch.cpu_matmul=aten,auto``, one core: ``attention`` ×1.07 at B = 16, ``sweep`` ×1.07
# at B = 4; into Inductor's buffer ×1.04 and ×1.03, the routed call's Python left).
# So the op lowers to ``extern_kernels.dynbatch_mm_out(a, b, kernel, out=buf)``
# (``ExternKernelOut``): ATen's kernel, numpy's BLAS and dynbatch's own GEMM write into
# the buffer; the flipped orientation and oneDNN, whose results are laid out their own
# way, copy theirs in (a pass over the output, where they won by 5 % or more).

EXTERN_NAME = "dynbatch_mm_out"  # extern_kernels.<this>(a, b, kernel, out=buf) in Inductor's generated code
ALLOC_NAME = "dynbatch_mm"  # extern_kernels.<this>(a, b, kernel): where Inductor's out= node does not build


def register() -> None:
    """The op and the extern kernels, before any graph that calls them compiles or loads."""
    op()
    _compat.register_extern_kernel(EXTERN_NAME, mm_out)
    _compat.register_extern_kernel(ALLOC_NAME, mm)


def lowerings() -> dict:
    """Inductor's lowering of the op (it has none): ``extern_kernels.dynbatch_mm_out(a, b,
    kernel, out=buf)``, in the form ``_compat.inductor_lowerings`` takes."""
    return {op(): lambda op, _none: extern_lowering(op, EXTERN_NAME, ALLOC_NAME, 0, (1, 1))}


def extern_lowering(op: torch._ops.OpOverload, out_name: str, alloc_name: str, out_rows: int,
                    out_cols: tuple[int, int]) -> Callable:
    """A lowering of ``op`` that calls ``extern_kernels.<out_name>(*tensors, *constants,
    out=buf)`` from the generated code, a plain Python call (the op would go through the
    dispatcher, 10-20 us on a small product), into a row-major buffer [size(out_rows, 0),
    size(out_cols)] that Inductor plans (NOTE [Products into Inductor's buffers]).  Where
    Inductor's IR differs from what this expects, ``extern_kernels.<alloc_name>(*tensors,
    *constants)`` with an output of its own; failing that, the op's own extern call."""
    from torch._inductor import ir

    def lower(*args):
        try:
            return _extern(ir.ExternKernelOut, out_name, args)
        except Exception as e:  # noqa: BLE001 - an Inductor internal moved: the slower, sure paths
            fail_soft.hook_failed(f"the extern call of {op} into Inductor's buffer", e)
        try:
            return _extern(ir.ExternKernelAlloc, alloc_name, args)
        except Exception as e:  # noqa: BLE001
            fail_soft.hook_failed(f"the direct extern call of {op}", e)
            return _compat.inductor_fallback(op)(*args)

    def _extern(node_type: type, name: str, args: tuple):
        # Any layout with a unit stride: a transposed view stays a view (the kernels
        # read it as BLAS does), not a copy.
        tensors = [ir.ExternKernel.require_stride1(ir.ExternKernel.realize_input(a))
                   for a in args if isinstance(a, ir.IRNode)]
        constants = tuple(a for a in args if not isinstance(a, ir.IRNode))
        size = [tensors[out_rows].get_size()[0], tensors[out_cols[0]].get_size()[out_cols[1]]]
        layout = ir.FixedLayout(tensors[0].get_device(), tensors[0].get_dtype(), size)
        return ir.TensorBox.create(node_type(layout, tensors, constant_args=constants,
                                             python_kernel_name=f"extern_kernels.{name}"))

    return lower


def _mm_fake(a: torch.Tensor, b: torch.Tensor, kernel: str) -> torch.Tensor:
    return a.new_empty((a.shape[0], b.shape[1]))
