"""``python -m dynbatch.bench sparse_hessian``: a structured Hessian or Jacobian by each column.

Problems (``--problem``): ``lennard_jones`` (the Hessian over a neighbour list, N atoms),
``message_passing`` (the Hessian of two index_add interactions in a periodic box, N
atoms) and ``poisson`` (the Jacobian of a nonlinear 2-D Poisson residual, a side x side
grid; ``--sizes`` are then grid sides).

Columns: ``eager`` (``functional.hessian(vectorize=True)``), ``dynbatch_dense``
(``dynbatch.hessian(sparse=False)``: a batched grad of B = 3N rows), ``dynbatch_sparse``
(compressed, the dense result), ``dynbatch_csr`` (compressed, a CSR result),
``dynbatch_csr_2ranks`` (the CSR one with its products shared by two gloo ranks,
``process_group=True``, each rank on cores of its own: ``--threads`` cores per rank), ``jax``
(``jit(hessian)``) and ``asdex`` (JAX's sparse Hessian), where installed.  Each column and
size runs in a fresh process with an empty Inductor cache (its first call is a cold
compile), one thread pinned to one core; it reports the first call, the median of the
steady calls, the colours, the largest difference from the dense dynbatch result of
the same size, and the peak memory growth over the steady calls (the RSS high-water mark,
reset first), the result they return included, and the cores the steady calls used (CPU
time over wall time, summed over the ranks: 1.0 on one core).

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

COLUMNS = ("eager", "dynbatch_dense", "dynbatch_sparse", "dynbatch_csr", "dynbatch_csr_2ranks", "jax", "asdex")
RANKED = "_2ranks"
# Dense columns past these sizes take minutes or a dense result that does not fit: skipped.
DENSE_LIMIT = {"lennard_jones": {"eager": 500, "jax": 500, "dynbatch_dense": 5000, "dynbatch_sparse": 5000},
               "message_passing": {"eager": 500},
               "poisson": {"eager": 100, "dynbatch_dense": 100, "dynbatch_sparse": 100}}


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _status_mib(field: str) -> float | None:
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) / 1024 for line in f if line.startswith(field))
    except (OSError, StopIteration):
        return None


def _peak_reset() -> float:
    """Reset the RSS high-water mark (Linux: clear_refs 5) and return the RSS now, MiB;
    elsewhere the process's peak so far, which only an earlier call can have set higher."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status_mib("VmRSS")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _peak_mib() -> float:
    return _status_mib("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


PROBLEMS = ("lennard_jones", "message_passing", "poisson")


def _problem(name: str, size: int):
    """(kind, function, x, args) of one problem at one size."""
    if name == "lennard_jones":
        pos, (i, j) = sparse_problems.lennard_jones_problem(size)
        return "hessian", sparse_problems.lennard_jones, pos, (i, j)
    if name == "message_passing":
        model, pos, pairs = sparse_problems.message_passing_problem(size)
        return "hessian", model, pos, pairs
    u, source = sparse_problems.poisson_problem(size)
    return "jacobian", sparse_problems.poisson_residual, u, (source,)


def _ranks(column: str) -> int:
    return 2 if column.endswith(RANKED) else 1


def _torch_column(column: str, kind, f, x, args):
    import dynbatch

    group = column.endswith(RANKED) or None
    column = column.removesuffix(RANKED)

    if column == "eager":
        derivative = getattr(torch.autograd.functional, kind)
        return lambda: derivative(lambda t: f(t, *args), x, vectorize=True).reshape(-1, x.numel())
    layout = torch.sparse_csr if column == "dynbatch_csr" else torch.strided
    sparse = column != "dynbatch_dense"

    def call():
        out = getattr(dynbatch, kind)(f, x, *args, sparse=sparse, layout=layout, process_group=group)
        return out if layout == torch.sparse_csr else out.reshape(-1, x.numel())

    return call


def _jax_column(column: str, kind, f, pos, args):
    import jax
    import jax.numpy as jnp

    i, j = args
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


def _child(problem: str, column: str, atoms: int, repeats: int, threads: int = 1) -> dict[str, Any]:
    if _ranks(column) > 1:
        return _ranked_child(problem, column, atoms, repeats, threads)
    pin_to_cores(threads)  # the parent holds cores for the ranked columns: one column, its cores
    return _measure(problem, column, atoms, repeats, threads)


def _measure(problem: str, column: str, atoms: int, repeats: int, threads: int) -> dict[str, Any]:
    """One process's row: the first call, then the steady calls (on a rank, started together)."""
    torch.set_num_threads(threads)
    kind, f, x, args = _problem(problem, atoms)
    if column in ("jax", "asdex") and problem != "lennard_jones":
        raise SystemExit(f"the {column} column has the Lennard-Jones problem only")
    make = _jax_column if column in ("jax", "asdex") else _torch_column
    start = time.perf_counter()
    call = make(column, kind, f, x, args)
    result = call()
    first = time.perf_counter() - start
    steady = []
    del result
    rss_before = _peak_reset()
    sync = _barrier if _ranks(column) > 1 else (lambda: None)
    cpu_before, wall_before = _cpu_seconds(), time.perf_counter()
    for _ in range(repeats):
        sync()  # the ranks start each call together: the slower one sets its time
        start = time.perf_counter()
        result = call()
        steady.append(time.perf_counter() - start)
        if _ != repeats - 1:
            del result
    cores_used = (_cpu_seconds() - cpu_before) / (time.perf_counter() - wall_before)
    row = {"problem": problem, "cores_used": cores_used, "column": column, "atoms": atoms,
           "pairs": int(args[0].numel()) if kind == "hessian" else x.numel(), "first_s": first,
           "steady_s": sorted(steady)[len(steady) // 2], "peak_growth_mib": _peak_mib() - rss_before}
    if column.startswith("dynbatch"):
        import dynbatch

        c = dynbatch.counters()
        row["colours"] = c.get("colours", 0) // max(1, c.get("grads_compressed", 0)) or None
    if column in ("dynbatch_sparse", "dynbatch_csr", "dynbatch_csr_2ranks", "eager") and atoms <= DENSE_LIMIT[
            problem].get("dynbatch_dense", atoms):
        import dynbatch

        dense = getattr(dynbatch, kind)(f, x, *args, sparse=False).reshape(-1, x.numel())
        got = result.to_dense() if result.layout == torch.sparse_csr else result
        row["max_diff_from_dense"] = float((got - dense).abs().max())
    return row


def _barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


def _ranked_child(problem: str, column: str, atoms: int, repeats: int, threads: int) -> dict[str, Any]:
    """The column on two gloo ranks, each pinned to ``threads`` cores of its own; rank 0's
    row, its cores used summed over the ranks."""
    import torch.multiprocessing as mp

    ranks = _ranks(column)
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cores) < ranks * threads:
        raise SystemExit(f"{column} needs {ranks * threads} cores, this process may use {len(cores)}")
    with tempfile.TemporaryDirectory(prefix="dynbatch-ranks-") as d:
        mp.spawn(_rank, args=(ranks, d, problem, column, atoms, repeats, threads, cores), nprocs=ranks)
        rows = []
        for r in range(ranks):
            with open(os.path.join(d, f"rank{r}.json")) as f:
                rows.append(json.load(f))
    rows[0]["cores_used"] = sum(r["cores_used"] for r in rows)
    rows[0]["steady_s"] = max(r["steady_s"] for r in rows)
    return rows[0]


def _rank(rank: int, ranks: int, d: str, problem: str, column: str, atoms: int, repeats: int, threads: int,
          cores: list[int]) -> None:
    import torch.distributed as dist

    os.sched_setaffinity(0, cores[rank * threads:(rank + 1) * threads])
    dist.init_process_group("gloo", init_method="file://" + os.path.join(d, "store"), rank=rank, world_size=ranks)
    row = _measure(problem, column, atoms, repeats, threads)
    with open(os.path.join(d, f"rank{rank}.json"), "w") as f:
        json.dump(row, f)
    dist.barrier()
    dist.destroy_process_group()


def _run(problem: str, column: str, atoms: int, repeats: int, threads: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="dynbatch-sparse-") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "OMP_NUM_THREADS": str(threads)}
        out = subprocess.run([sys.executable, "-m", "dynbatch.bench.sparse_hessian", "--child", problem, column,
                              str(atoms), str(repeats), str(threads)], env=env, capture_output=True, text=True,
                             check=False)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode or not lines:
        return {"column": column, "atoms": atoms, "error": (out.stderr.strip().splitlines() or ["no output"])[-1]}
    return json.loads(lines[-1])


def table(rows: list[dict[str, Any]]) -> str:
    head = ["size (pairs or unknowns)", "column", "first call s", "steady s", "/ dynbatch_dense", "colours",
            "peak growth MiB", "max diff from dense", "cores used"]
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
                                        f"{r['peak_growth_mib']:.0f}", f"{diff:.1e}" if diff is not None else "-",
                                        f"{r['cores_used']:.2f}" if "cores_used" in r else "-"])
                     + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="dynbatch-bench sparse_hessian", description=__doc__.splitlines()[0])
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    parser.add_argument("--problem", choices=PROBLEMS, default="lennard_jones")
    parser.add_argument("--sizes", default="500,2000", help="comma list of atom counts (grid sides for poisson), "
                                                             "default %(default)s")
    parser.add_argument("--columns", default=",".join(COLUMNS), help="comma list, default %(default)s")
    parser.add_argument("--repeats", type=int, default=5, help="steady calls per column")
    parser.add_argument("--threads", type=int, default=1, help="threads and cores per process")
    parser.add_argument("--out", help="write the table (markdown) here too")
    parser.add_argument("--plot", help="draw steady time and peak memory growth against size into this PNG")
    args = parser.parse_args(argv)
    if args.child:
        problem, column, atoms, repeats, threads = args.child
        print(json.dumps(_child(problem, column, int(atoms), int(repeats), int(threads))))
        return 0
    pin_to_cores(args.threads * max(_ranks(c) for c in args.columns.split(",")))
    rows = []
    for atoms in (int(s) for s in args.sizes.split(",")):
        for column in args.columns.split(","):
            if atoms > DENSE_LIMIT[args.problem].get(column, atoms):
                continue
            rows.append(_run(args.problem, column, atoms, args.repeats, args.threads))
            print(json.dumps(rows[-1]), flush=True)
    print(table(rows))
    if args.out:
        with open(args.out, "w") as f:
            f.write(table(rows) + "\n")
    if args.plot:
        plot(rows, args.plot, args.problem)
    return 0


def plot(rows: list[dict[str, Any]], path: str, problem: str) -> None:
    """Steady seconds and peak memory growth against size, one line per column (log-log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(10, 4))
    for column in dict.fromkeys(r["column"] for r in rows):
        cells = sorted((r["atoms"], r["steady_s"], r["peak_growth_mib"]) for r in rows
                       if r["column"] == column and "error" not in r)
        if cells:
            sizes, seconds, mib = zip(*cells)
            ax_t.plot(sizes, seconds, "o-", label=column)
            ax_m.plot(sizes, [max(m, 0.1) for m in mib], "o-", label=column)
    for ax, label in ((ax_t, "steady call, s"), (ax_m, "peak growth of one call, MiB")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("grid side" if problem == "poisson" else "atoms")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    ax_t.legend(fontsize=8)
    fig.suptitle(f"bench sparse_hessian --problem {problem}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
