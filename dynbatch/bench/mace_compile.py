"""``python -m dynbatch.bench mace_compile``: the first and second call of one of MACE's
calls through ``torch.compile(model, backend="dynbatch")``, and the seconds ``gcc`` took.

    OMP_NUM_THREADS=1 TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) taskset -c 1 \\
        python -m dynbatch.bench mace_compile hessian [--without-vec-range-hook]

With mace-torch installed (``pip install -e '.[models]'``).  ``hessian``,
``inference_forces`` or ``training_step``: the ``mace`` workload's calls
(mace_workload.py, its quick batch).  An empty kernel cache makes the first call the
whole compile; ``gcc`` compiles each of Inductor's C++ kernels in it, and the seconds it
took are printed too.

``--without-vec-range-hook`` compiles with Inductor's ``simplify_index_in_vec_range`` as it
is (``dynbatch.lowering.inductor.inductor_vec_range_without_full_simplify`` off), for an
A/B of that hook: run both at once on cores 0 and 1, each with a cache of its own, then
compare the generated modules' names in the two caches (Inductor names each by a hash of
its code).
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch

import dynbatch

from . import mace_workload
from .variants import VariantUnavailable, with_own_forward


def parse_args(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dynbatch-bench mace_compile",
                                     description="The first and second call of one of MACE's calls through "
                                                 "torch.compile(model, backend='dynbatch'), and gcc's seconds.")
    parser.add_argument("call", choices=("hessian", "inference_forces", "training_step"))
    parser.add_argument("--without-vec-range-hook", action="store_true",
                        help="compile with Inductor's simplify_index_in_vec_range as it is")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    if args.without_vec_range_hook:
        from dynbatch.lowering import inductor

        inductor.inductor_vec_range_without_full_simplify = contextlib.nullcontext
    dynbatch.register()
    problem = next(p for p in mace_workload.mace("quick", torch.device("cpu")) if p.call == args.call)
    case = problem.cases[0]
    try:
        model = problem.make_model()
    except VariantUnavailable as e:
        raise SystemExit(f"dynbatch-bench mace_compile: {e}") from None
    program = mace_workload._program(args.call, model, torch.compile(with_own_forward(model), backend="dynbatch"))
    with _gcc_timed() as gcc:
        for name in ("first", "second"):
            start = time.perf_counter()
            program(case.batch, case.e_ref, case.f_ref)
            print(f"{args.call} {name} call: {time.perf_counter() - start:.4g} s")
    print(f"gcc: {gcc['seconds']:.1f} s over {gcc['compiles']} compiles; dynbatch counters {dynbatch.counters()}")
    return 0


@contextlib.contextmanager
def _gcc_timed():
    """The seconds Inductor's C++ compiles take (``cpp_builder.run_compile_cmd``), and their count."""
    from torch._inductor import cpp_builder

    spent = {"seconds": 0.0, "compiles": 0}
    build = cpp_builder.run_compile_cmd

    def timed_build(cmd_line: str, cwd: str) -> None:
        start = time.perf_counter()
        try:
            build(cmd_line, cwd)
        finally:
            spent["seconds"] += time.perf_counter() - start
            spent["compiles"] += 1

    cpp_builder.run_compile_cmd = timed_build
    try:
        yield spent
    finally:
        cpp_builder.run_compile_cmd = build
