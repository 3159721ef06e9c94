"""dynbatch.cpu_matmul="aten" vs "auto" on the named workloads (default sweep, mlp_jacobian, gelu_vjp), timed interleaved.

    taskset -c 0 python scripts/compare_cpu_matmul.py 1     # one core, one thread
    taskset -c 0 python scripts/compare_cpu_matmul.py 1 sweep,attention,pinn   # other workloads
    taskset -c 0 python scripts/compare_cpu_matmul.py 1 sweep,mlp_jacobian aten,onednn   # other columns

Both columns are timed with the benchmark's interleaved rounds of warm blocks
(dynbatch.bench.measure.interleaved_times), at least 2 s each per case; prints
medians, the second column's time over the first's, and the kernel "auto" measured
for each bucket of M.
"""

from __future__ import annotations

import sys

import torch

from dynbatch import matmul_kernels
from dynbatch.bench import measure, variants, workloads


DEFAULT_WORKLOADS = "sweep,mlp_jacobian,gelu_vjp"


def main(threads: int, names: str = DEFAULT_WORKLOADS, columns: str = "aten,auto") -> None:
    first, second = columns.split(",")
    torch.set_num_threads(threads)
    cpu = torch.device("cpu")
    problems = [problem for name in names.split(",")
                for problem in workloads.build(name, "cpu", [1, 16, 64, 128, 256, 1024] if name == "sweep" else None, cpu, None)]
    budget = measure.Budget(min_time_s=2.0, min_reps=20, max_reps=5000)
    for problem in problems:
        # Every problem's program shares one code object: a fresh Dynamo cache per problem
        # keeps it under the recompile limit, past which Dynamo would run it eagerly.
        torch._dynamo.reset()
        compiled = {k: torch.compile(variants.batched_program(problem), backend="dynbatch",
                                     options={"dynbatch.cpu_matmul": k}) for k in (first, second)}
        for case in problem.cases:
            calls = {k: (lambda f=f, c=case: f(c.x, c.cotangents)) for k, f in compiled.items()}
            for call in calls.values():
                call()
            timed = measure.interleaved_times(calls, lambda: None, budget)
            med = {k: sorted(v["times_s"])[len(v["times_s"]) // 2] for k, v in timed.items()}
            print(f"{problem.name:18s} {case.label:8s} {first} {med[first] * 1e3:8.3f} ms  "
                  f"{second} {med[second] * 1e3:8.3f} ms  {second}/{first} {med[second] / med[first]:.2f}", flush=True)
    print("measured choices (M bucket = M.bit_length(), K, N, dtype, threads):",
          {k[:3]: v for k, v in matmul_kernels.chosen().items()})


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 1, *sys.argv[2:4])
