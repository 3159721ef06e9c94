"""Command line: ``python -m dynbatch.bench [--quick] [--device cuda] ...``, or
``python -m dynbatch.bench <command> ...``, one of COMMANDS (overhead, ab, gemm, report, ...)."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import torch

from . import cli, mace_workload, measure, plots, report, runner, training
from .cli import pin_to_cores
from .variants import CUDA_ONLY, TRUTH, VARIANTS
from .workloads import WORKLOADS

# The batched-grad workloads, then the training step and the real model (columns of their
# own: training.py, mace_workload.py).  The real model runs when named: minutes of compiles.
DEFAULT_WORKLOADS = [*WORKLOADS, *training.WORKLOADS]
ALL_WORKLOADS = [*DEFAULT_WORKLOADS, *mace_workload.WORKLOADS]
# --quick runs these columns on every workload: the eager ones compile nothing, and dynbatch
# is what the bench is for.
QUICK_EVERY_WORKLOAD = ("eager_loop", "eager_batched", "eager_vmap", "eager_vmap_chunked", "dynbatch")
# python -m dynbatch.bench <command> ...: each in a module of its own, imported when named.
COMMANDS = {"overhead": "per-call overhead of the columns: where a small call's time goes",
            "ab": "A/B of dynbatch or Inductor options on the same cells, side by side",
            "gemm": "one CPU matrix product by each kernel (ATen, oneDNN, OpenBLAS, dynbatch's AVX2 GEMM, XLA)",
            "report": "the tables and plots docs/benchmarks.md shows, rewritten from results JSON files",
            "ab_per_process": "A/B of a dynbatch option on one case at a time, each setting alone in a fresh process",
            "outside_floor": "a batched grad outside a compiled model per call, beside what torch itself costs",
            "hessian_rows": "the hessian rows through one column alone, compiled static, dynamic or hinted",
            "mace_compile": "first and second call of one of MACE's calls through dynbatch, and gcc's seconds",
            "first_call": "a force-training step's first call per column, cold and on a warm cache, by phase",
            "sparse_hessian": "a Lennard-Jones Hessian dense, compressed by colours (dense or CSR), and by JAX/asdex"}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="dynbatch-bench",
        description="Benchmark batched gradients: eager loop, eager is_grads_batched, torch.func, "
                    "stock torch.compile, compiled torch.func, dynbatch and JAX, in one run.",
        epilog="Other commands, each with its own --help: "
               + "; ".join(f"dynbatch-bench {name}: {what}" for name, what in COMMANDS.items()),
    )
    cli.add_problem_flags(parser, ALL_WORKLOADS, default_workloads=DEFAULT_WORKLOADS,
                          quick_help="the CI smoke test, about 2 minutes on one core: one tiny case per "
                                     "workload (the sweep's three B), every column but dynbatch and the eager "
                                     "ones on the sweep only, short timing budgets")
    parser.add_argument("--variants", type=lambda t: cli.names(t, list(VARIANTS), "variant(s)"),
                        default=None, help=f"comma list of columns, default all ({','.join(VARIANTS)}), "
                                           f"less {','.join(CUDA_ONLY)} on the CPU")
    parser.add_argument("--out", type=Path, default=Path("bench-out"), help="output folder (default bench-out/)")
    parser.add_argument("--stock-timeout", type=float, default=None,
                        help="seconds the stock torch.compile column may take per case "
                             "(default 60; stock compile time grows with B, so large B time out)")
    parser.add_argument("--stock-workloads", type=lambda t: cli.names(t, list(WORKLOADS), "workload(s)"),
                        default=None,
                        help="time stock_compile on these workloads only (default: every one; --quick: the sweep)")
    parser.add_argument("--warm-cache", action="store_true",
                        help="keep Inductor's and Triton's on-disk caches (default: an empty folder, "
                             "so first calls include the whole compile; --quick implies it)")
    parser.add_argument("--sequential", action="store_true",
                        help="time each column alone as it runs, not a case's columns interleaved after all ran once")
    parser.add_argument("--single-call", action="store_true",
                        help="for sizes where a call takes minutes: per cell the first call and one steady "
                             "call, no warm-up, timing loop or interleaving (--min-time is ignored); errors "
                             "against eager_loop where it runs, else against the first column")
    parser.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    return parser.parse_args(argv)


def _budget(args: argparse.Namespace) -> measure.Budget:
    return measure.Budget.single_call() if args.single_call else cli.budget(args)


def quick_column_workloads(workloads, columns, reference: str) -> dict[str, tuple[str, ...]]:
    """--quick: each column but the reference and QUICK_EVERY_WORKLOAD on one workload, the
    sweep (else the first batched-grad one): compiles dominate the smoke test, and the
    sweep's batch sizes show each column's recompiles (stock_compile crashes on a new B there)."""
    batched = [w for w in workloads if w in WORKLOADS]
    if not batched:
        return {}
    one = "sweep" if "sweep" in batched else batched[0]
    return {column: (one,) for column in columns if column not in (*QUICK_EVERY_WORKLOAD, reference)}


def settings_from(args: argparse.Namespace) -> runner.Settings:
    device = cli.device(args)
    columns = tuple(args.variants) if args.variants else tuple(
        v for v in VARIANTS if device.type == "cuda" or v not in CUDA_ONLY)
    # Errors are read against eager_loop where it runs, else (a run that leaves the loop
    # out, as --single-call sizes or a short device run do) the first in-process column
    # to run (VARIANTS order; eager_loop comes first).
    reference = next((v for v in VARIANTS if v in columns and v != "stock_compile"), TRUTH)
    column_workloads = quick_column_workloads(args.workloads, columns, reference) if args.quick else {}
    if args.stock_workloads:
        column_workloads["stock_compile"] = tuple(args.stock_workloads)
    return runner.Settings(
        device=device,
        tier=cli.tier(args),
        workloads=tuple(args.workloads),
        variants=columns,
        batch_sizes=args.batch_sizes,
        atoms=args.atoms,
        budget=_budget(args),
        stock_timeout_s=args.stock_timeout or 60.0,
        # Cold caches make first calls honest; the smoke test needs speed, not that figure.
        cold_compile_cache=not (args.warm_cache or args.quick),
        progress=not args.no_progress,
        threads=args.threads,
        column_workloads=column_workloads,
        overlap_stock_start=args.quick,
        interleave=not (args.sequential or args.single_call),
        reference=reference,
    )


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in COMMANDS:
        command = importlib.import_module(f".{argv[0]}", __package__)
        return command.main(argv[1:])
    args = parse_args(argv)
    if args.threads and torch.device(args.device).type == "cpu":
        pin_to_cores(args.threads)
    # Save after every problem: a long run that is stopped still leaves its tables.
    results = runner.run(settings_from(args), on_problem=lambda partial: report.write(partial, args.out))
    paths = report.write(results, args.out)
    paths.update(plots.write(results, args.out))
    notes = report.Footnotes()
    if results["problems"]:
        print(report.time_table(results, notes))
    if results.get("training"):
        print(report.training_table(results, notes))
    if results.get("mace"):
        print(report.mace_table(results, notes))
    if notes.notes:
        print(notes.markdown())
    for name, path in paths.items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
