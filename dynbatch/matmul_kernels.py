"""The CPU kernel of dynbatch's batched matrix products, chosen by measurement.

NOTE [CPU matmul kernels]
A batched backward through a linear layer multiplies the [B*N, n] cotangent by
the weight, ``aten.mm(g, W.t())``: one tall product whose height grows with B.
Inductor hands every CPU ``mm`` to ATen, which calls the BLAS torch was built
with (MKL on x86).  oneDNN's GEMM (``torch.ops.mkldnn._linear_pointwise``,
which computes ``a @ w.t()`` with ``w`` as stored) blocks tall products
better on some CPUs and is slower on short ones, where its per-call setup
dominates.  On the 2-core AMD EPYC dynbatch is developed on, one thread,
float32, oneDNN over MKL: 0.72-0.93x the time from M = 1024 (K = N = 128 and
512), but up to 5x at M = 8 (docs/design.md, "Stage 4 — lowering").  "auto", the default,
takes the faster per shape.  Which kernel wins depends on the CPU, the
shape and the thread count, so it is measured, not assumed: the first
product of each (power-of-two bucket of M, K, N, dtype, threads) runs both
kernels on its real operands, a few times each, and the faster is remembered
for the rest of the process.  Both compute the same product in float32; they
differ only in rounding (the order of the sums).

Inductor lowers ``_linear_pointwise`` only for a weight it has frozen into a
constant, and M is symbolic here, so the choice is a custom op,
``dynbatch::linear_nt``.  Inductor lowers it (``lowerings()``) to a plain call of
``linear_nt`` from its generated code, as it calls ``mm``: an extern call of the
op itself would go through the dispatcher's Python kernel, 10-20 us a product.
That lowering builds Inductor's IR nodes here (``extern_alloc_lowering``): with
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

from . import _compat, fail_soft

log = logging.getLogger("dynbatch")

# Options.cpu_matmul: "auto" measures; "aten" leaves every product to ATen;
# "onednn" takes oneDNN wherever it applies (for tests and comparisons).
CHOICES = ("auto", "aten", "onednn")
# Timed calls of each kernel in a measurement, after one untimed call that
# builds oneDNN's primitive and warms the caches (the minimum is compared).
TRIALS = 5
# Products shorter than this stay with ATen unmeasured.  Inside the programs,
# on the 2-core AMD EPYC, one thread, oneDNN over MKL (forced, timed interleaved):
# M = 512 1.05-1.09x (three A/Bs), M = 1024 0.93-1.02x (nine), though oneDNN
# alone is 0.96x at 512: a first-call measurement would pick it there and lose.
# On the earlier host M = 1024 was a coin flip (1.08x at K = N = 128, 0.86x at
# 512), which the measurement decides at a cost of a few percent either way.
MIN_ROWS = 1024

_chosen: dict[tuple, str] = {}
_lock = threading.Lock()


def aten_nt(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.mm(a, w.t())


def onednn_nt(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(a, w, None, "none", [], "")


KERNELS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {"aten": aten_nt, "onednn": onednn_nt}


@functools.cache
def onednn_available() -> bool:
    return bool(getattr(torch._C, "_has_mkldnn", False)) and torch.backends.mkldnn.is_available()


def onednn_applies(a: torch.Tensor, w: torch.Tensor) -> bool:
    """oneDNN's linear takes dense float32 CPU matrices, ``a`` [M, K] and ``w`` [N, K]."""
    return (a.device.type == "cpu" and a.dtype == torch.float32 == w.dtype and a.dim() == 2 == w.dim()
            and a.shape[0] > 0 and a.is_contiguous() and w.is_contiguous() and onednn_available())


def shape_key(m: int, k: int, n: int, dtype: torch.dtype) -> tuple:
    # Neighbouring heights share a kernel: M's power-of-two bucket, not M itself,
    # so a sweep over B measures a handful of times, not once per B.
    return (m.bit_length(), k, n, dtype, torch.get_num_threads())


def linear_nt(a: torch.Tensor, w: torch.Tensor, kernel: str = "auto") -> torch.Tensor:
    """``a @ w.t()`` by the kernel ``kernel`` names, or by the measured faster one ("auto")."""
    if kernel == "aten" or (kernel == "auto" and a.shape[0] < MIN_ROWS) or not onednn_applies(a, w):
        return KERNELS["aten"](a, w)
    if kernel == "onednn":
        return KERNELS["onednn"](a, w)
    key = shape_key(a.shape[0], a.shape[1], w.shape[0], a.dtype)
    name = _chosen.get(key)
    if name is not None:
        return KERNELS[name](a, w)
    name, out = measure(a, w)
    with _lock:
        _chosen.setdefault(key, name)
    return out


def measure(a: torch.Tensor, w: torch.Tensor) -> tuple[str, torch.Tensor]:
    """Time both kernels on these operands, alternating (a drifting machine slows
    both alike); return the faster one's name and a product it computed."""
    best = {name: float("inf") for name in KERNELS}
    outs = {name: kernel(a, w) for name, kernel in KERNELS.items()}
    for _ in range(TRIALS):
        for name, kernel in KERNELS.items():
            start = time.perf_counter()
            outs[name] = kernel(a, w)
            best[name] = min(best[name], time.perf_counter() - start)
    name = min(best, key=best.get)
    log.debug("dynbatch: CPU matmul [%d, %d] @ [%d, %d].T %s, %d threads: %s (%s)", a.shape[0], a.shape[1],
              w.shape[0], w.shape[1], a.dtype, torch.get_num_threads(), name,
              ", ".join(f"{k} {v * 1e6:.0f} us" for k, v in best.items()))
    return name, outs[name]


def chosen() -> dict[tuple, str]:
    """The kernel measured for each shape bucket so far (a copy)."""
    return dict(_chosen)


def forget() -> None:
    """Measure again from the next product on (tests; after changing the thread count)."""
    with _lock:
        _chosen.clear()


def choice_for_static_shape(m: int, k: int, n: int, dtype: torch.dtype, kernel: str) -> str:
    """The kernel a product of known sizes gets, measured on random operands of its shape
    when ``kernel`` is "auto" (the compile-time twin of ``linear_nt``'s run-time choice)."""
    if dtype != torch.float32 or m == 0 or not onednn_available():
        return "aten"
    if kernel != "auto":
        return kernel
    if m < MIN_ROWS:
        return "aten"
    key = shape_key(m, k, n, dtype)
    if key not in _chosen:
        with _compat.real_tensors():
            name, _ = measure(torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype))
        with _lock:
            _chosen.setdefault(key, name)
    return _chosen[key]


# --- the custom op Inductor calls -------------------------------------------------

_library: torch.library.Library | None = None


def op() -> torch._ops.OpOverload:
    """``dynbatch::linear_nt(Tensor a, Tensor w, str kernel) -> Tensor``, registered on first use
    (importing dynbatch registers nothing)."""
    global _library
    with _lock:
        if _library is None:
            lib = torch.library.Library("dynbatch", "DEF")
            lib.define("linear_nt(Tensor a, Tensor w, str kernel) -> Tensor")
            lib.impl("linear_nt", linear_nt, "CPU")
            torch.library.register_fake("dynbatch::linear_nt", _linear_nt_fake, lib=lib)
            _library = lib
    return torch.ops.dynbatch.linear_nt.default


EXTERN_NAME = "dynbatch_linear_nt"  # extern_kernels.<this> in Inductor's generated code


def register() -> None:
    """The op and the extern kernel, before any graph that calls them compiles or loads."""
    op()
    _compat.register_extern_kernel(EXTERN_NAME, linear_nt)


def lowerings() -> dict:
    """Inductor's lowering of the op (it has none): ``extern_kernels.dynbatch_linear_nt(a, w, kernel)``,
    in the form ``_compat.inductor_lowerings`` takes."""
    return {op(): lambda op, _none: extern_alloc_lowering(op, EXTERN_NAME, 0, (1, 0))}


def extern_alloc_lowering(op: torch._ops.OpOverload, name: str, out_rows: int,
                          out_cols: tuple[int, int]) -> Callable:
    """A lowering of ``op`` that calls ``extern_kernels.<name>(*tensors, *constants)`` from the
    generated code, a plain Python call (the op would go through the dispatcher, 10-20 us on a
    small product); its output is a new contiguous matrix [size(out_rows, 0), size(out_cols)].
    Where Inductor's IR differs from what this expects, the op's own extern call instead."""
    from torch._inductor import ir

    def lower(*args):
        try:
            return _extern_alloc(*args)
        except Exception as e:  # noqa: BLE001 - an Inductor internal moved: the slower, sure path
            fail_soft.hook_failed(f"the direct extern call of {op}", e)
            return _compat.inductor_fallback(op)(*args)

    def _extern_alloc(*args):
        tensors = [ir.ExternKernel.require_contiguous(ir.ExternKernel.realize_input(a))
                   for a in args if isinstance(a, ir.IRNode)]
        constants = tuple(a for a in args if not isinstance(a, ir.IRNode))
        size = [tensors[out_rows].get_size()[0], tensors[out_cols[0]].get_size()[out_cols[1]]]
        layout = ir.FixedLayout(tensors[0].get_device(), tensors[0].get_dtype(), size)
        return ir.TensorBox.create(ir.ExternKernelAlloc(layout, tensors, constant_args=constants,
                                                        python_kernel_name=f"extern_kernels.{name}"))

    return lower


def _linear_nt_fake(a: torch.Tensor, w: torch.Tensor, kernel: str) -> torch.Tensor:
    return a.new_empty((a.shape[0], w.shape[0]))
