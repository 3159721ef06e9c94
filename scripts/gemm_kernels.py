"""One float32 product [M, K] @ [K, N] by each CPU kernel, timed interleaved: ATen's mm
(MKL on x86), oneDNN's linear (torch.ops.mkldnn._linear_pointwise) and, when JAX is
importable, XLA's dot at "highest" precision.

    taskset -c 0 python scripts/gemm_kernels.py    # one core (XLA sizes its pool from the affinity)

Prints GFLOP/s per kernel and shape, and oneDNN's time over ATen's.
"""

from __future__ import annotations

import torch

from dynbatch.bench import measure

SHAPES = [(m, k, k) for k in (128, 512) for m in (8, 64, 512, 1024, 2048, 4096, 8192)]


def main() -> None:
    torch.set_num_threads(1)
    kernels = {
        "aten_mm": lambda a, w: torch.mm(a, w.t()),
        "onednn": lambda a, w: torch.ops.mkldnn._linear_pointwise(a, w, None, "none", [], ""),
    }
    try:
        import jax
        import jax.numpy as jnp

        jax.config.update("jax_default_matmul_precision", "highest")
        dot = jax.jit(lambda a, w: a @ w.T)
        jax_arrays = lambda a, w: (jnp.asarray(a.numpy()), jnp.asarray(w.numpy()))  # noqa: E731
    except ImportError:
        dot = None
    budget = measure.Budget(min_time_s=0.5, min_reps=20, max_reps=2000)
    print(f"{'M':>6} {'K=N':>4}  " + "  ".join(f"{k:>10}" for k in list(kernels) + (["xla"] if dot else []))
          + "   onednn/aten")
    for m, k, n in SHAPES:
        a, w = torch.randn(m, k), torch.randn(n, k)
        calls = {name: (lambda f=f: f(a, w)) for name, f in kernels.items()}
        if dot is not None:
            ja, jw = jax_arrays(a, w)
            calls["xla"] = lambda: dot(ja, jw).block_until_ready()
        timed = measure.interleaved_times(calls, lambda: None, budget)
        med = {name: sorted(v["times_s"])[len(v["times_s"]) // 2] for name, v in timed.items()}
        flops = 2 * m * k * n / 1e9
        print(f"{m:6d} {k:4d}  " + "  ".join(f"{flops / t:7.1f} GF" for t in med.values())
              + f"   {med['onednn'] / med['aten_mm']:.2f}", flush=True)


if __name__ == "__main__":
    main()
