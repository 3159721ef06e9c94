"""The first and second call of one of MACE's calls through ``torch.compile(model, backend="dynbatch")``.

``OMP_NUM_THREADS=1 TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) taskset -c 1 python
scripts/mace_compile_time.py hessian [--without-vec-range-hook]``, with mace-torch installed
(``pip install -e '.[models]'``).  ``hessian``, ``inference_forces`` or ``training_step``: the
``mace`` workload's calls (dynbatch/bench/mace_workload.py, its quick batch).  An empty
kernel cache makes the first call the whole compile; ``gcc`` compiles each of Inductor's C++
kernels in it, and the seconds it took are printed too.

``--without-vec-range-hook`` compiles with Inductor's ``simplify_index_in_vec_range`` as it
is (``lowering.inductor_vec_range_without_full_simplify`` off), for an A/B of that hook: run
both at once on cores 0 and 1, each with a cache of its own, then compare the generated
modules' names in the two caches (Inductor names each by a hash of its code).
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("call", choices=("hessian", "inference_forces", "training_step"))
    parser.add_argument("--without-vec-range-hook", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)

    from torch._inductor import cpp_builder

    import dynbatch
    from dynbatch import lowering
    from dynbatch.bench import mace_workload
    from dynbatch.bench.variants import with_own_forward

    if args.without_vec_range_hook:
        lowering.inductor_vec_range_without_full_simplify = contextlib.nullcontext
    compiling = [0.0, 0]
    build = cpp_builder.run_compile_cmd

    def timed_build(cmd_line: str, cwd: str) -> None:
        start = time.perf_counter()
        try:
            build(cmd_line, cwd)
        finally:
            compiling[0] += time.perf_counter() - start
            compiling[1] += 1

    cpp_builder.run_compile_cmd = timed_build
    problem = next(p for p in mace_workload.mace("quick", torch.device("cpu")) if p.call == args.call)
    case = problem.cases[0]
    model = problem.make_model()
    program = mace_workload._program(args.call, model, torch.compile(with_own_forward(model), backend="dynbatch"))
    for name in ("first", "second"):
        start = time.perf_counter()
        program(case.batch, case.e_ref, case.f_ref)
        print(f"{args.call} {name} call: {time.perf_counter() - start:.4g} s")
    print(f"gcc: {compiling[0]:.1f} s over {compiling[1]} compiles; dynbatch counters {dynbatch.counters()}")


if __name__ == "__main__":
    main()
