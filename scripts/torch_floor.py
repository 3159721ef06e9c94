"""How close can a torch.compile program come to JAX's call?  A floor under dynbatch's
time on the CPU cases where JAX leads.

    PYTHONPATH=<jax> taskset -c 0 python scripts/torch_floor.py     # one core, one thread
    PYTHONPATH=<jax> taskset -c 0 python scripts/torch_floor.py sweep,hessian

Per case, in one process:

* JAX's whole call and dynbatch's whole call, timed interleaved as the benchmark
  times them (dynbatch.bench.measure.interleaved_times);
* the stack alone: the same dynbatch call with each compiled region's program swapped
  for one that returns its result, precomputed (Dynamo's frame, its guards, the
  pre-graph bytecode and dynbatch's region: what any torch.compile backend's call
  pays before its program runs);
* the products alone: every matrix product the program ran (recorded by the
  profiler), replayed on fresh operands of its shapes, each by the fastest torch
  kernel for it (ATen's mm with either operand layout, or oneDNN's linear), warm.

floor = stack + products: dynbatch's time if all the rest of its program (its
pointwise kernels, allocations, the Inductor wrapper) took no time.  Where
floor / JAX exceeds 1.1, no change inside dynbatch's graph reaches issue 12's
"no case above 1.1" with torch's kernels and Dynamo's frame.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Callable

import torch

from dynbatch.bench import measure, variants, workloads

# (workload, case label) pairs; every case of a problem runs first, in the benchmark's
# order, so the graph timed is the one the benchmark times (a sweep's B >= 4 share
# one graph with B symbolic).
CASES = [("sweep", "B=1"), ("sweep", "B=4"), ("sweep", "B=16"), ("sweep", "B=64"), ("sweep", "B=256"),
         ("mlp_jacobian", "B=128"), ("hessian", "hvp K=8"), ("attention", "B=16")]
PRODUCTS = {"aten::mm", "aten::bmm", "aten::addmm", "mkldnn::_linear_pointwise"}


def recorded_products(call: Callable[[], object]) -> list[tuple[str, list]]:
    """(op, input shapes) of every matrix product one call runs, outermost only."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        call()
    out = []
    for e in prof.events():
        if e.name in PRODUCTS and not (e.cpu_parent is not None and e.cpu_parent.name in PRODUCTS):
            out.append((e.name, [list(s) for s in e.input_shapes]))
    return out


def _median_us(fn: Callable[[], object], reps: int = 300) -> float:
    for _ in range(20):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def fastest_product_us(op: str, shapes: list) -> float:
    """The fastest torch kernel's time for one product of these shapes, warm."""
    if op == "aten::bmm":
        (b, m, k), (_, _, n) = shapes[0], shapes[1]
        x, y, o = torch.randn(b, m, k), torch.randn(b, k, n), torch.empty(b, m, n)
        return min(_median_us(lambda: torch.bmm(x, y, out=o)),
                   _median_us(lambda: torch.bmm(x, y.mT.contiguous().mT, out=o)))
    if op == "aten::addmm":
        shapes = shapes[1:3]
    if op == "mkldnn::_linear_pointwise":
        (m, k), (n, _) = shapes[0], shapes[1]
    else:
        (m, k), (_, n) = shapes[0], shapes[1]
    x, w, wt, o = torch.randn(m, k), torch.randn(k, n), torch.randn(n, k), torch.empty(m, n)
    kernels = [lambda: torch.mm(x, w, out=o), lambda: torch.mm(x, wt.t(), out=o)]
    if torch.backends.mkldnn.is_available():
        kernels.append(lambda: torch.ops.mkldnn._linear_pointwise(x, wt, None, "none", [], ""))
    return min(_median_us(k) for k in kernels)


class Precomputed:
    """A region's program that returns what the real one returned for this case."""

    def __init__(self, real: Callable) -> None:
        self.real, self.result = real, None

    def __call__(self, *args):
        if self.result is None:
            self.result = self.real(*args)
        return self.result


def regions_compiled_since(globals_before: set[str], namespace: dict) -> list:
    # Dynamo puts each compiled graph among the frame's globals; its disable()
    # wrapper keeps the callable it wraps, dynbatch's Region.
    return [v._torchdynamo_orig_callable for k, v in namespace.items()
            if k.startswith("__compiled_fn") and k not in globals_before]


def main(names: str | None = None) -> None:
    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    wanted = [c for c in CASES if names is None or c[0] in names.split(",")]
    budget = measure.Budget(min_time_s=2.0, min_reps=50, max_reps=20000)
    print(f"{'case':28s} {'jax':>9s} {'dynbatch':>9s} {'stack':>8s} {'products':>9s} {'floor':>8s} "
          f"{'dynbatch/jax':>12s} {'floor/jax':>9s}   (us; products: count)")
    for workload in dict.fromkeys(w for w, _ in wanted):
        for problem in workloads.build(workload, "cpu", None, cpu, None):
            labels = [label for w, label in wanted if w == workload]
            if not any(case.label in labels for case in problem.cases):
                continue
            torch._dynamo.reset()
            program = variants.batched_program(problem)
            before = set(program.__globals__)
            compiled = torch.compile(program, backend="dynbatch")
            jax = variants.build("jax", problem, cpu)
            for case in problem.cases:  # the benchmark's order: the same graphs
                compiled(case.x, case.cotangents)
            regions = regions_compiled_since(before, program.__globals__)
            reals = [r.compiled for r in regions]
            for case in problem.cases:
                if case.label not in labels:
                    continue
                jax_args = jax.prepare(case)
                jax.call(*jax_args)
                memos = [Precomputed(real) for real in reals]

                def set_programs(programs):
                    for region, p in zip(regions, programs):
                        region.compiled = p

                def whole():
                    set_programs(reals)
                    compiled(case.x, case.cotangents)

                def stack():
                    set_programs(memos)
                    compiled(case.x, case.cotangents)

                stack()  # fills each memo from the real program
                timed = measure.interleaved_times(
                    {"jax": lambda: jax.call(*jax_args), "dynbatch": whole, "stack": stack}, lambda: None, budget)
                set_programs(reals)
                med = {k: statistics.median(v["times_s"]) * 1e6 for k, v in timed.items()}
                products = recorded_products(lambda: compiled(case.x, case.cotangents))
                prod_us = sum(fastest_product_us(op, shapes) for op, shapes in products)
                floor = med["stack"] + prod_us
                print(f"{problem.name + ' ' + case.label:28s} {med['jax']:9.1f} {med['dynbatch']:9.1f} "
                      f"{med['stack']:8.1f} {prod_us:9.1f} {floor:8.1f} {med['dynbatch'] / med['jax']:12.2f} "
                      f"{floor / med['jax']:9.2f}   ({len(products)})", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
