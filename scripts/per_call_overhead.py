"""Where a small-B call of the sweep workload spends its time, and what cpp_wrapper changes.

    taskset -c 0 python scripts/per_call_overhead.py        # one core, one thread

1. Breakdown of one dynbatch call (B = 1, 4, 16): the whole call; the part inside
   dynbatch's region (what the Dynamo frame calls); inside Inductor's compiled
   call; and the matrix products in it (extern mm calls, timed by wrapping them).
2. Default options vs options={"cpp_wrapper": True}, timed interleaved.
3. The stack without the program (B = 1): the region's compiled program swapped
   for one that returns its precomputed result, so the call is only Dynamo's
   frame, guards and dynbatch's region; and the same program timed from inside
   the frame and called directly, which differ by more than the stack costs.
"""

from __future__ import annotations

import time

import torch

from dynbatch.bench import measure, variants, workloads


def main() -> None:
    torch.set_num_threads(1)
    from torch._inductor import output_code
    from torch._inductor.select_algorithm import extern_kernels

    from dynbatch import region

    (problem,) = workloads.build("sweep", "cpu", [1, 4, 16], torch.device("cpu"), None)
    plain = torch.compile(variants.batched_program(problem), backend="dynbatch")
    wrapped = torch.compile(variants.batched_program(problem), backend="dynbatch", options={"cpp_wrapper": True})
    for case in problem.cases:
        plain(case.x, case.cotangents)
        wrapped(case.x, case.cotangents)

    spent = {"region": 0.0, "inductor": 0.0, "mm": 0.0}

    def timing(key, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - start
        return timed

    patches = [(region.Region, "__call__", timing("region", region.Region.__call__)),
               (output_code.CompiledFxGraph, "__call__", timing("inductor", output_code.CompiledFxGraph.__call__)),
               (extern_kernels, "mm", timing("mm", extern_kernels.mm))]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    print("breakdown of one call, microseconds (the timers add about 1 us each):")
    try:
        for obj, name, fn in patches:
            setattr(obj, name, fn)
        for case in problem.cases:
            for key in spent:
                spent[key] = 0.0
            n, start = 2000, time.perf_counter()
            for _ in range(n):
                plain(case.x, case.cotangents)
            total = (time.perf_counter() - start) / n * 1e6
            print(f"  {case.label:6s} total {total:6.1f}; Dynamo frame and guards {total - spent['region'] / n * 1e6:6.1f}; "
                  f"region {spent['region'] / n * 1e6:6.1f}, of which Inductor's call {spent['inductor'] / n * 1e6:6.1f}, "
                  f"of which mm {spent['mm'] / n * 1e6:6.1f}")
    finally:
        for obj, name, fn in saved:
            setattr(obj, name, fn)

    print("default vs cpp_wrapper, interleaved, median microseconds:")
    for case in problem.cases:
        timed = measure.interleaved_times(
            {"default": lambda c=case: plain(c.x, c.cotangents), "cpp_wrapper": lambda c=case: wrapped(c.x, c.cotangents)},
            lambda: None, measure.Budget(min_time_s=2, min_reps=100, max_reps=5000))
        med = {k: sorted(v["times_s"])[len(v["times_s"]) // 2] * 1e6 for k, v in timed.items()}
        print(f"  {case.label:6s} default {med['default']:6.1f}  cpp_wrapper {med['cpp_wrapper']:6.1f}  "
              f"ratio {med['cpp_wrapper'] / med['default']:.2f}")

    stack_without_the_program()


def stack_without_the_program() -> None:
    torch._dynamo.reset()  # a fresh cache entry for the program's code, so its compiled graph is new
    (problem,) = workloads.build("sweep", "cpu", [1], torch.device("cpu"), None)
    program = variants.batched_program(problem)
    compiled = torch.compile(program, backend="dynbatch")
    case = problem.cases[0]
    before = set(program.__globals__)  # Dynamo puts the compiled graph among the frame's globals
    compiled(case.x, case.cotangents)
    (wrapper,) = [v for k, v in program.__globals__.items() if k.startswith("__compiled_fn") and k not in before]
    region = wrapper._torchdynamo_orig_callable  # Dynamo's disable() wrapper keeps the callable it wraps
    real = region.compiled
    inputs = (case.x, *problem.f.__closure__[0].cell_contents, case.cotangents)  # the graph's inputs, in order
    result = real(*inputs)
    inside: list[float] = []

    def real_timed(*args):
        start = time.perf_counter()
        try:
            return real(*args)
        finally:
            inside.append(time.perf_counter() - start)

    def with_program(program_fn):
        def call():
            region.compiled = program_fn
            compiled(case.x, case.cotangents)
        return call

    calls = {
        "whole call": with_program(real_timed),
        "whole call, program returns its result": with_program(lambda *args: result),
        "program called directly": lambda: real(*inputs),
    }
    timed = measure.interleaved_times(calls, lambda: None, measure.Budget(min_time_s=3, min_reps=200, max_reps=20000))
    region.compiled = real
    print("the stack without the program, B = 1, interleaved, median microseconds:")
    for name, cell in timed.items():
        print(f"  {name:40s} {sorted(cell['times_s'])[len(cell['times_s']) // 2] * 1e6:6.1f}")
    print(f"  {'program timed inside the whole call':40s} {sorted(inside)[len(inside) // 2] * 1e6:6.1f}")


if __name__ == "__main__":
    main()
