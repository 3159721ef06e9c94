"""``python -m dynbatch.bench sparse_hessian``: a Lennard-Jones Hessian by each column.

Columns: ``eager`` (``functional.hessian(vectorize=True)``), ``dynbatch_dense``
(``dynbatch.hessian(sparse=False)``: a batched grad of B = 3N rows), ``dynbatch_sparse``
(compressed, the dense result), ``dynbatch_csr`` (compressed, a CSR result), ``jax``
(``jit(hessian)``) and ``asdex`` (JAX's sparse Hessian), where installed.  Each column and
size runs in a fresh process with an empty Inductor cache (its first call is a cold
compile), one thread pinned to one core; it reports the first call, the median of the
steady calls, the colours, the largest difference from the dense dynbatch result of
the same size, and the peak memory growth of one steady call (the process's RSS high-water mark).

    python -m dynbatch.bench sparse_hessian --sizes 500,2000 --columns dynbatch_dense,dynbatch_sparse,asdex
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

from . import sparse_problems
from .cli import pin_to_cores

COLUMNS = ("eager", "dynbatch_dense", "dynbatch_sparse", "dynbatch_csr", "jax", "asdex")
# Dense columns past this size would hold a 3N x 3N Hessian per row batch: skipped.
DENSE_LIMIT = {"eager": 500, "jax": 500}


def _maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _torch_column(column: str, pos, i, j):
    import dynbatch

    if column == "eager":
        return lambda: torch.autograd.functional.hessian(lambda t: sparse_problems.lennard_jones(t, i, j), pos,
                                                         vectorize=True).reshape(pos.numel(), -1)
    layout = torch.sparse_csr if column == "dynbatch_csr" else torch.strided
    sparse = column != "dynbatch_dense"

    def call():
        h = dynbatch.hessian(sparse_problems.lennard_jones, pos, i, j, sparse=sparse, layout=layout)
        return h if layout == torch.sparse_csr else h.reshape(pos.numel(), -1)

    return call


def _jax_column(column: str, pos, i, j):
    import jax
    import jax.numpy as jnp

    jax.config.update("jax_enable_x64", True)
    jpos, ji, jj = (jnp.asarray(t.numpy()) for t in (pos, i, j))

    def energy(x):
        d = x[ji] - x[jj]
        inv6 = 1 / jnp.sum(d * d, -1) ** 3
        return jnp.sum(4 * (inv6 * inv6 - inv6))

    if column == "jax":
        fn = jax.jit(jax.hessian(energy))
        return lambda: fn(jpos).block_until_ready()
    import asdex

    fn = jax.jit(asdex.hessian(energy, jpos))  # as asdex's docs ask: unjitted, each call re-traces
    return lambda: jax.block_until_ready(fn(jpos))


def _child(column: str, atoms: int, repeats: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    pos, (i, j) = sparse_problems.lennard_jones_problem(atoms)
    make = _jax_column if column in ("jax", "asdex") else _torch_column
    start = time.perf_counter()
    call = make(column, pos, i, j)
    result = call()
    first = time.perf_counter() - start
    steady = []
    rss_before = _maxrss_mib()
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        steady.append(time.perf_counter() - start)
    row = {"column": column, "atoms": atoms, "pairs": int(i.numel()), "first_s": first,
           "steady_s": sorted(steady)[len(steady) // 2], "peak_growth_mib": _maxrss_mib() - rss_before}
    if column.startswith("dynbatch"):
        import dynbatch

        c = dynbatch.counters()
        row["colours"] = c.get("colours", 0) // max(1, c.get("grads_compressed", 0)) or None
    if column in ("dynbatch_sparse", "dynbatch_csr", "eager"):
        import dynbatch

        dense = dynbatch.hessian(sparse_problems.lennard_jones, pos, i, j, sparse=False).reshape(pos.numel(), -1)
        got = result.to_dense() if column == "dynbatch_csr" else result
        row["max_diff_from_dense"] = float((got - dense).abs().max())
    return row


def _run(column: str, atoms: int, repeats: int, threads: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="dynbatch-sparse-") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "OMP_NUM_THREADS": str(threads)}
        out = subprocess.run([sys.executable, "-m", "dynbatch.bench.sparse_hessian", "--child", column, str(atoms),
                              str(repeats)], env=env, capture_output=True, text=True, check=False)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode or not lines:
        return {"column": column, "atoms": atoms, "error": (out.stderr.strip().splitlines() or ["no output"])[-1]}
    return json.loads(lines[-1])


def table(rows: list[dict[str, Any]]) -> str:
    head = ["N atoms (pairs)", "column", "first call s", "steady s", "/ dynbatch_dense", "colours",
            "peak growth MiB", "max diff from dense"]
    dense = {r["atoms"]: r.get("steady_s") for r in rows if r["column"] == "dynbatch_dense"}
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        size = f"{r['atoms']} ({r.get('pairs', '?')})"
        if "error" in r:
            lines.append(f"| {size} | {r['column']} | failed: {r['error'][:120]} |")
            continue
        ratio = r["steady_s"] / dense[r["atoms"]] if dense.get(r["atoms"]) else None
        diff = r.get("max_diff_from_dense")
        lines.append("| " + " | ".join([size, r["column"], f"{r['first_s']:.2f}", f"{r['steady_s']:.3f}",
                                        f"{ratio:.2f}" if ratio else "-", str(r.get("colours") or "-"),
                                        f"{r['peak_growth_mib']:.0f}", f"{diff:.1e}" if diff is not None else "-"])
                     + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="dynbatch-bench sparse_hessian", description=__doc__.splitlines()[0])
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--sizes", default="500,2000", help="comma list of atom counts, default %(default)s")
    parser.add_argument("--columns", default=",".join(COLUMNS), help="comma list, default %(default)s")
    parser.add_argument("--repeats", type=int, default=5, help="steady calls per column")
    parser.add_argument("--threads", type=int, default=1, help="threads and cores per process")
    parser.add_argument("--out", help="write the table (markdown) here too")
    args = parser.parse_args(argv)
    if args.child:
        column, atoms, repeats = args.child
        print(json.dumps(_child(column, int(atoms), int(repeats))))
        return 0
    pin_to_cores(args.threads)
    rows = []
    for atoms in (int(s) for s in args.sizes.split(",")):
        for column in args.columns.split(","):
            if atoms > DENSE_LIMIT.get(column, atoms):
                continue
            rows.append(_run(column, atoms, args.repeats, args.threads))
            print(json.dumps(rows[-1]), flush=True)
    print(table(rows))
    if args.out:
        with open(args.out, "w") as f:
            f.write(table(rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
