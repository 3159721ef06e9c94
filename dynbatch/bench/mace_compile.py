"""``python -m dynbatch.bench mace_compile``: the first and second call of one of MACE's
calls through ``torch.compile(model, backend="dynbatch")``, and the seconds ``gcc`` took.

    OMP_NUM_THREADS=1 TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) taskset -c 1 \\
        python -m dynbatch.bench mace_compile hessian [--without-vec-range-hook]
    python -m dynbatch.bench mace_compile training_step --other-batch [--sizes marked] [--background]
    python -m dynbatch.bench mace_compile inference_forces --stock

With mace-torch installed (``pip install -e '.[models]'``).  ``hessian``,
``inference_forces``, ``calculator_forces`` (the forces as MACE's ASE calculator takes them
from a compiled model) or ``training_step``: the ``mace`` workload's calls (mace_workload.py,
its quick batch).  An empty kernel cache makes the
first call the whole compile; ``gcc`` compiles each of Inductor's C++ kernels in it, and the
seconds it took are printed too.  ``--other-batch`` then calls it on a batch of other
molecules (the ``cpu`` tier's: other atom, edge and graph counts) and compares that first
call with eager's: a second batch as MD over a dataset meets it.  ``--sizes`` sets how the
compile sees the batch's sizes: ``static`` (torch.compile's default: static first, then
Dynamo recompiles with the sizes that changed dynamic), ``marked`` (each tensor's atom, edge
or graph count marked dynamic before the first call, ``mark_batch_dynamic``) or ``dynamic``
(``torch.compile(dynamic=True)``); ``--eager`` makes the same calls on the model uncompiled
(the first call's baseline); ``--background`` compiles with
``options={"dynbatch.compile": "background"}`` and then calls the first batch again until
every program compiled in the background has taken over (``handover``);
``--without-aot-cache`` with ``options={"dynbatch.aot_cache": False}``,
``--aot-cache-with-backward`` with ``"with_backward"``; ``--stock`` compiles with stock
``torch.compile`` (Inductor) under MACE's own preparation instead, the peer to run beside it
on the other core.  Run it twice on one cache directory for a warm start.

``--without-vec-range-hook`` compiles with Inductor's ``simplify_index_in_vec_range`` as it
is (``dynbatch.lowering.inductor.inductor_vec_range_without_full_simplify`` off), for an
A/B of that hook: run both at once on cores 0 and 1, each with a cache of its own, then
compare the generated modules' names in the two caches (Inductor names each by a hash of
its code).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import time
import types

import torch

import dynbatch

from .. import records
from . import first_call, mace_workload
from .variants import VariantUnavailable, with_own_forward


def parse_args(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dynbatch-bench mace_compile",
                                     description="The first and second call of one of MACE's calls through "
                                                 "torch.compile(model, backend='dynbatch'), and gcc's seconds.")
    parser.add_argument("call", choices=tuple(mace_workload._CALLS))
    parser.add_argument("--without-vec-range-hook", action="store_true",
                        help="compile with Inductor's simplify_index_in_vec_range as it is")
    parser.add_argument("--other-batch", action="store_true",
                        help="then the first call on a batch of other molecules, checked against eager")
    parser.add_argument("--sizes", choices=("static", "marked", "dynamic"), default="static",
                        help="the batch's sizes static (default), marked dynamic, or torch.compile(dynamic=True)")
    parser.add_argument("--background", action="store_true",
                        help='options={"dynbatch.compile": "background"}')
    parser.add_argument("--without-aot-cache", action="store_true", help='options={"dynbatch.aot_cache": False}')
    parser.add_argument("--aot-cache-with-backward", action="store_true",
                        help='options={"dynbatch.aot_cache": "with_backward"}')
    parser.add_argument("--stock", action="store_true",
                        help="stock torch.compile (Inductor) with MACE's own preparation, for a side-by-side run")
    parser.add_argument("--eager", action="store_true",
                        help="the same calls on the model uncompiled: the first call's baseline (--background's)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    if args.without_vec_range_hook:
        from dynbatch.lowering import inductor

        inductor.inductor_vec_range_without_full_simplify = contextlib.nullcontext
    dynbatch.register()
    call = args.call
    problem = next(p for p in mace_workload.mace("quick", torch.device("cpu")) if p.call == call)
    case = problem.cases[0]
    try:
        model = problem.make_model()
    except VariantUnavailable as e:
        raise SystemExit(f"dynbatch-bench mace_compile: {e}") from None
    program_of = functools.partial(mace_workload._program, call, model)
    if args.eager and (args.stock or args.background or args.without_aot_cache or args.aot_cache_with_backward):
        raise SystemExit("dynbatch-bench mace_compile: --eager runs the model uncompiled, without other options")
    if args.stock and (args.call == "hessian" or args.background or args.without_aot_cache
                       or args.aot_cache_with_backward):
        raise SystemExit("dynbatch-bench mace_compile: --stock runs training_step, inference_forces or "
                         "calculator_forces, without dynbatch's options")
    options = {**({"dynbatch.compile": "background"} if args.background else {}),
               **({"dynbatch.aot_cache": False} if args.without_aot_cache else {}),
               **({"dynbatch.aot_cache": "with_backward"} if args.aot_cache_with_backward else {})}
    # The first call's seconds include torch.compile's own: stock's imports Inductor there,
    # dynbatch's at the first call.
    start = time.perf_counter()
    compiled = model if args.eager else torch.compile(
        with_own_forward(model), dynamic=True if args.sizes == "dynamic" else None,
        **({} if args.stock else {"backend": "dynbatch", "options": options}))
    compile_seconds = time.perf_counter() - start
    run = (lambda batch, **kwargs: compiled(mark_batch_dynamic(batch), **kwargs)) if args.sizes == "marked" \
        else compiled
    program = program_of(run)
    calls = [("first", case), ("second", case)]
    if args.other_batch:
        (other,) = next(p for p in mace_workload.mace("cpu", torch.device("cpu")) if p.call == call).cases
        calls.append((f"other batch's first ({other.label})", other))
    with _gcc_timed() as gcc, (mace_workload.mace_prep() if args.stock else contextlib.nullcontext()):
        for name, at in calls:
            got = []
            seconds, phases, _ = first_call.timed_by_phase(lambda: got.append(program(at.batch, at.e_ref, at.f_ref)))
            if name == "first":
                seconds, phases = seconds + compile_seconds, {"torch.compile": compile_seconds, **phases}
            error = (got[0] - program_of(model)(at.batch, at.e_ref, at.f_ref)).abs().max()
            split = "" if args.eager else ", ".join(f"{p} {phases[p]:.1f}" for p in ("torch.compile", *records.PHASES)
                                                    if phases.get(p))
            print(f"{args.call} {name} call: {seconds:.4g} s (max difference from eager {error:.2g})"
                  + (f"; {split}" if split else ""))
    if args.background:
        # The first batch again, back to back, until every program compiled in the background ran.
        runner = types.SimpleNamespace(call=program)
        handover = first_call.handover(runner, (case.batch, case.e_ref, case.f_ref), start)
        print(f"handover: {handover['calls']} calls, {handover['seconds']:.1f} s after the first call's start")
    print(f"gcc: {gcc['seconds']:.1f} s over {gcc['compiles']} compiles; dynbatch counters {dynbatch.counters()}")
    return 0


def mark_batch_dynamic(batch: dict) -> dict:
    """The batch with each tensor's count of atoms, edges or graphs (dim 0; ``edge_index``'s
    dim 1) marked dynamic: the first compile takes them symbolic, and a batch of other sizes
    compiles nothing new.  ``maybe_``: a size the model fixes stays static, unasked."""
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dim():
            torch._dynamo.maybe_mark_dynamic(value, 1 if key == "edge_index" else 0)
    return batch


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
