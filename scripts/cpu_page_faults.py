"""Page faults and time of large CPU batched backwards, unchunked and in chunks.

    taskset -c 0 python scripts/cpu_page_faults.py        # one core, one thread
    taskset -c 0 python scripts/cpu_page_faults.py unchunked,auto,64MiB,256MiB   # other budgets

The full_hessian workload (Lennard-Jones N = 100, 200; learned pair potential
N = 64, 128) compiled by dynbatch with memory_budget None (one unchunked call),
"32MiB" and "auto" (on the CPU at most memory.CPU_AUTO_BUDGET, 16 MiB).  Per
column: the plan, minor page faults and system time of one call (getrusage),
and the median time over calls interleaved with the other columns
(dynbatch.bench.measure).  NOTE [CPU chunks for speed] in dynbatch/memory.py.
"""

from __future__ import annotations

import resource
import sys

import torch

import dynbatch
from dynbatch.bench import measure, variants, workloads

DEFAULT_COLUMNS = "unchunked,32MiB,auto"
CASES = (("lj", 300), ("lj", 600), ("pair_mlp", 192), ("pair_mlp", 384))


def main(columns: str = DEFAULT_COLUMNS) -> None:
    """``columns``: memory budgets, comma-separated ("unchunked" is None)."""
    budgets = {c: None if c == "unchunked" else c for c in columns.split(",")}
    torch.set_num_threads(1)
    problems = workloads.build("full_hessian", "cpu", None, torch.device("cpu"), None)
    for name, batch in CASES:
        problem = next(p for p in problems if name in p.name)
        case = next(c for c in problem.cases if c.batch == batch)
        fns, lines = {}, {}
        torch._dynamo.reset()  # each case's columns start from empty caches (and recompile limits)
        for column, budget in budgets.items():
            fn = torch.compile(variants.batched_program(problem), backend="dynbatch",
                               options={"dynbatch.memory_budget": budget})
            dynbatch.reset()
            out = fn(case.x, case.cotangents)
            plans = [p for r in dynbatch.compile_records() if not r.chunk_program for p in r.memory_plan]
            chunks = ", ".join(f"chunks of {p.chunk_size} x {p.chunks}" for p in plans if p.applied) or "unchunked"
            before = resource.getrusage(resource.RUSAGE_SELF)
            fn(case.x, case.cotangents)
            after = resource.getrusage(resource.RUSAGE_SELF)
            lines[column] = (f"{chunks:22s} faults {after.ru_minflt - before.ru_minflt:7d}  "
                             f"system {after.ru_stime - before.ru_stime:5.2f} s")
            fns[column] = lambda fn=fn: fn(case.x, case.cotangents)
            del out
        timed = measure.interleaved_times(fns, lambda: None, measure.Budget(min_time_s=4, min_reps=5, max_reps=200))
        for column in budgets:
            times = sorted(timed[column]["times_s"])
            print(f"{problem.name} {case.label:6s} {column:9s} {times[len(times) // 2] * 1e3:8.1f} ms  {lines[column]}",
                  flush=True)


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:2]))
