"""``python -m dynbatch.bench gemm``: one float32 CPU product by each kernel, alone.

    python -m dynbatch.bench gemm --threads 1
    python -m dynbatch.bench gemm --m 512,1024,2048 --kn 128 --threads 1
    python -m dynbatch.bench gemm --m 128,1024,4096 --k 128,1024,4096 --n 128,1024,4096 --layout rr

``[M, K] @ [N, K].T``, the batched backward's tall product (NOTE [CPU matmul
kernels] in dynbatch/cpu/matmul_kernels.py), or ``[M, K] @ [K, N]`` with ``--layout rr``,
for K = N (``--kn``) or every K and N given (``--k``, ``--n``), by a plain
``torch.mm`` and each kernel of ``matmul_kernels.KERNELS`` (ATen's ``mm``, which calls MKL on x86, the same on
the transposed problem, oneDNN's linear, numpy's OpenBLAS and dynbatch's own GEMM's AVX2
and AVX-512 builds, where this process has them) and, when JAX is importable, XLA's dot at "highest"
precision (its figure includes ``jax.jit``'s dispatch), timed interleaved
(measure.interleaved_times).  GFLOP/s per kernel and shape, and oneDNN's time
over ATen's: what ``cpu_matmul="auto"`` and ``matmul_kernels.MIN_ROWS`` decide
from.  With ``--threads N`` the process is pinned to N cores before XLA sizes its
thread pool.  The core's float32 peak is measured by an FMA loop (peak.py): once above
the table, and for each shape as one more column timed interleaved with the kernels, as
many FLOPs as the product (a core's clock moves during a run: on a Xeon VM a kernel
once ran at 1.05 of a peak measured at the run's start).  In the table, the fastest of
dynbatch's kernels as a fraction of that shape's FMA loop (x threads): median over
median, and fastest run over the loop's fastest run.  Every kernel returns a new matrix, as a program's product does: an
output above glibc's mmap threshold is fresh pages each call, and their faults are in
the figure (dynbatch's kernels advise huge pages for them, the ``torch`` column does
not: NOTE [huge pages for large outputs]).  ``--out`` writes the table to a file.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import statistics
import sys
from typing import Any, Callable

import torch

from dynbatch.cpu import matmul_kernels

from . import cli, measure, peak

ROWS = (8, 64, 512, 1024, 2048, 4096, 8192)
PEAK = "FMA loop"  # the interleaved column of the core's peak
WIDTHS = (128, 512)
QUICK = ((8, 64), (32,))


def parse_args(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="dynbatch-bench gemm",
        description="One float32 product [M, K] @ [N, K].T by each CPU kernel (ATen's mm, oneDNN's linear, "
                    "XLA's dot when JAX is installed), timed interleaved.")
    parser.add_argument("--m", type=lambda t: cli.sizes(t, "--m"), default=None,
                        help=f"comma list of rows M (default {','.join(map(str, ROWS))})")
    parser.add_argument("--kn", type=lambda t: cli.sizes(t, "--kn"), default=None,
                        help=f"comma list of K = N (default {','.join(map(str, WIDTHS))})")
    parser.add_argument("--k", type=lambda t: cli.sizes(t, "--k"), default=None,
                        help="comma list of K, each with every N of --n (instead of --kn)")
    parser.add_argument("--n", type=lambda t: cli.sizes(t, "--n"), default=None,
                        help="comma list of N (with --k)")
    parser.add_argument("--layout", choices=("rc", "rr"), default="rc",
                        help="the second operand's layout: rc, [M, K] @ [N, K].T (the backward's, default); "
                             "rr, [M, K] @ [K, N] row-major")
    parser.add_argument("--quick", action="store_true", help="tiny shapes and a short timing budget")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's choice); the process is pinned to "
                             "that many cores first, XLA's thread pool included")
    parser.add_argument("--min-time", type=float, default=None,
                        help="seconds of timing per kernel and shape (default 0.5; --quick: 0.02)")
    parser.add_argument("--out", default=None,
                        help="also write the table to this Markdown file, under the command and the UTC time")
    args = parser.parse_args(argv)
    if (args.k is None) != (args.n is None) or (args.k is not None and args.kn is not None):
        parser.error("give --k with --n, or --kn")
    args.device = "cpu"  # for cli.use_threads
    return args


# What decides whether a large output is fresh pages at each call (NOTE [huge pages for
# large outputs], NOTE [Streamed stores] in cpu/native_gemm.py): named in every table.
ALLOCATOR_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES", "LD_PRELOAD")


def allocator() -> str:
    """The process's allocator settings from the environment, as the table names them."""
    set_ = [f"{name}={os.environ[name]}" for name in ALLOCATOR_ENV if os.environ.get(name)]
    if not set_:
        return "glibc's defaults (an output above its mmap threshold is fresh pages at every call)"
    return "set by the environment: " + ", ".join(set_)


def main(argv=None) -> int:
    args = parse_args(argv)
    cli.use_threads(args)
    lines: list[str] = []

    def emit(line: str) -> None:
        lines.append(line)
        print(line, flush=True)

    kernels = kernel_calls()
    rows, widths = QUICK if args.quick else (ROWS, WIDTHS)
    budget = measure.Budget.quick() if args.quick else measure.Budget(min_time_s=0.5, min_reps=20, max_reps=2000)
    if args.min_time is not None:
        budget = dataclasses.replace(budget, min_time_s=args.min_time)
    ratio = "aten" in kernels and "onednn" in kernels
    emit(f"torch {torch.__version__}, {torch.get_num_threads()} threads; GFLOP/s, medians; "
          f"CPU: {peak.cpu_model()}")
    emit(f"allocator: {allocator()}")
    core = peak.core_peak_gflops()
    emit(f"core peak (float32 FMA loop, {peak.isa() or 'no AVX2'}): "
          + (f"{core:.3g} GFLOP/s a core" if core else "not measured (no C compiler or no AVX2)"))
    loop = peak.fma_loop() if core else None
    emit("| M | K | N | " + " | ".join(f"{k} GF/s" for k in kernels) + (" | onednn / aten time" if ratio else "")
          + (" | FMA loop GF/s | dynbatch's best / peak | its fastest run / peak |" if loop else " |"))
    emit("|---|---|---|" + "---|" * (len(kernels) + ratio + 3 * bool(loop)))
    sizes = [(k, n) for k in args.k for n in args.n] if args.k else [(k, k) for k in args.kn or widths]
    for k, n in sizes:
        for m in args.m or rows:
            a = torch.randn(m, k)
            b = torch.randn(n, k).t() if args.layout == "rc" else torch.randn(k, n)
            flops = 2 * m * k * n / 1e9
            calls = {name: make(a, b) for name, make in kernels.items()}
            if loop:  # the core's peak at this shape's clock: as many FLOPs, in the same rounds
                calls[PEAK] = loop(flops * 1e9)
            timed = measure.interleaved_times(calls, lambda: None, budget)
            med = {name: statistics.median(t["times_s"]) for name, t in timed.items()}
            cells = [f"{flops / med[name]:.3g}" for name in kernels]
            if ratio:
                cells.append(f"×{med['onednn'] / med['aten']:.2f}")
            if loop:  # the fastest of the kernels "auto" chooses from (XLA's is not one)
                threads = torch.get_num_threads()
                fastest = min((name for name in med if name in matmul_kernels.KERNELS), key=med.get)
                cells.append(f"{flops / med[PEAK]:.3g}")
                cells.append(f"{med[PEAK] / med[fastest] / threads:.2g} ({fastest})")
                cells.append(f"{min(timed[PEAK]['times_s']) / min(timed[fastest]['times_s']) / threads:.2g}")
            emit(f"| {m} | {k} | {n} | " + " | ".join(cells) + " |")
    if args.out:
        command = "python -m dynbatch.bench gemm " + " ".join(argv if argv is not None else sys.argv[1:])
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        with open(args.out, "w") as f:
            f.write(f"<!-- generated by: {command} -->\n`{command}`, {stamp}.\n\n" + "\n".join(lines) + "\n")
    return 0


def kernel_calls() -> dict[str, Callable[[torch.Tensor, torch.Tensor], Callable[[], Any]]]:
    """name -> (a, b) -> a thunk computing ``a @ b`` by that kernel."""
    # "torch": a plain torch.mm, what a program gets without dynbatch's routing (its
    # "aten" kernel is the same call with a huge-page output where that applies).
    calls = {"torch": lambda a, b: lambda: torch.mm(a, b)}
    calls.update({name: (lambda a, b, kernel=kernel: lambda: kernel(a, b))
                  for name, kernel in matmul_kernels.KERNELS.items()
                  if matmul_kernels.available(name)})
    try:
        import jax
        import jax.numpy as jnp
    except ImportError:
        return calls
    jax.config.update("jax_default_matmul_precision", "highest")
    dot_t, dot = jax.jit(lambda a, w: a @ w.T), jax.jit(lambda a, b: a @ b)

    def xla(a: torch.Tensor, b: torch.Tensor) -> Callable[[], Any]:
        # the same layouts as the torch kernels get: w [N, K] row-major for b = w.T
        if b.stride(0) == 1 and b.dim() == 2 and b.shape[1] > 1:
            ja, jw = jnp.asarray(a.numpy()), jnp.asarray(b.t().numpy())
            return lambda: dot_t(ja, jw).block_until_ready()
        ja, jb = jnp.asarray(a.numpy()), jnp.asarray(b.numpy())
        return lambda: dot(ja, jb).block_until_ready()

    calls["xla"] = xla
    return calls
