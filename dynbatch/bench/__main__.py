"""Command line: ``python -m dynbatch.bench [--quick] [--device cuda] ...``."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

import torch

from . import measure, plots, report, runner, training
from .variants import CUDA_ONLY, VARIANTS
from .workloads import ATOM_WORKLOADS, TIERS, WORKLOADS

# The batched-grad workloads, then the training step (columns of its own: training.py).
ALL_WORKLOADS = [*WORKLOADS, *training.WORKLOADS]


def _names(text: str, known, what: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in known]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown {what} {unknown}; choose from {', '.join(known)}")
    return names


def _sizes(text: str, flag: str = "--batch-sizes", least: int = 1) -> tuple[int, ...]:
    try:
        sizes = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{flag} takes integers, got {text!r}") from None
    if not sizes or min(sizes) < least:
        raise argparse.ArgumentTypeError(f"{flag} takes integers of at least {least}")
    return sizes


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="dynbatch-bench",
        description="Benchmark batched gradients: eager loop, eager is_grads_batched, torch.func, "
                    "stock torch.compile, compiled torch.func, dynbatch and JAX, in one run.",
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--workloads", type=lambda t: _names(t, ALL_WORKLOADS, "workload(s)"),
                        default=tuple(ALL_WORKLOADS), help=f"comma list, default all: {','.join(ALL_WORKLOADS)}")
    parser.add_argument("--variants", type=lambda t: _names(t, list(VARIANTS), "variant(s)"),
                        default=None, help=f"comma list of columns, default all ({','.join(VARIANTS)}), "
                                           f"less {','.join(CUDA_ONLY)} on the CPU")
    parser.add_argument("--batch-sizes", type=_sizes, default=None,
                        help="comma list of B for the sweep workload and the free-B workloads "
                             "(gelu_vjp, attention, hessian HVP probes); Jacobian workloads keep B = output size")
    parser.add_argument("--atoms", type=lambda t: _sizes(t, "--atoms", 2), default=None,
                        help=f"comma list of atom counts N for {', '.join(ATOM_WORKLOADS)} (B = 3N) "
                             "and force_training, "
                             "replacing the size tier's")
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes and short timing budgets (the CI smoke test, about 2 minutes on 2 cores)")
    parser.add_argument("--size", choices=TIERS, default=None,
                        help="size tier; default: quick with --quick, else the device's (cpu or cuda)")
    parser.add_argument("--out", type=Path, default=Path("bench-out"), help="output folder (default bench-out/)")
    parser.add_argument("--stock-timeout", type=float, default=None,
                        help="seconds the stock torch.compile column may take per case "
                             "(default 60; stock compile time grows with B, so large B time out)")
    parser.add_argument("--stock-workloads", type=lambda t: _names(t, list(WORKLOADS), "workload(s)"),
                        default=None,
                        help="time stock_compile on these workloads only (default: every one; --quick: the sweep)")
    parser.add_argument("--warm-cache", action="store_true",
                        help="keep Inductor's and Triton's on-disk caches (default: an empty folder, "
                             "so first calls include the whole compile; --quick implies it)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's choice); on the CPU the whole process "
                             "is also pinned to that many cores first, so every column (JAX's thread pool "
                             "and the stock worker included) runs on the same cores")
    parser.add_argument("--min-time", type=float, default=None,
                        help="seconds of steady-state timing per cell, at least 9 calls "
                             "(default 1.0; --quick: 0.02 and 3 calls)")
    parser.add_argument("--sequential", action="store_true",
                        help="time each column alone as it runs, not a case's columns interleaved after all ran once")
    parser.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    return parser.parse_args(argv)


def _budget(args: argparse.Namespace) -> measure.Budget:
    budget = measure.Budget.quick() if args.quick else measure.Budget()
    if args.min_time is not None:
        budget = dataclasses.replace(budget, min_time_s=args.min_time)
    return budget


def settings_from(args: argparse.Namespace) -> runner.Settings:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("dynbatch-bench: --device cuda, but torch.cuda.is_available() is False")
    tier = args.size or ("quick" if args.quick else device.type)
    # The smoke test runs the slow-to-compile stock column on the sweep only: that is
    # where it crashes on a new batch size, the behaviour the column exists to show.
    stock_workloads = tuple(args.stock_workloads) if args.stock_workloads else None
    if args.quick and stock_workloads is None:
        stock_workloads = ("sweep",) if "sweep" in args.workloads else tuple(args.workloads[:1])
    return runner.Settings(
        device=device,
        tier=tier,
        workloads=tuple(args.workloads),
        variants=tuple(args.variants) if args.variants else tuple(
            v for v in VARIANTS if device.type == "cuda" or v not in CUDA_ONLY),
        batch_sizes=args.batch_sizes,
        atoms=args.atoms,
        budget=_budget(args),
        stock_timeout_s=args.stock_timeout or 60.0,
        # Cold caches make first calls honest; the smoke test needs speed, not that figure.
        cold_compile_cache=not (args.warm_cache or args.quick),
        progress=not args.no_progress,
        threads=args.threads,
        stock_workloads=stock_workloads,
        overlap_stock_start=args.quick,
        interleave=not args.sequential,
    )


def pin_to_cores(n: int) -> list[int] | None:
    """Hold this process to its first ``n`` allowed cores.  Done before any column
    runs: threads started later (torch's OpenMP pool, XLA's pool) and the stock
    worker process inherit it, so a one-core run is one core for every column."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))[:n]
    os.sched_setaffinity(0, cores)
    return cores


def main(argv=None) -> int:
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
    if notes.notes:
        print(notes.markdown())
    for name, path in paths.items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
