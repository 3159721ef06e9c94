"""What the benchmark's commands share: argument types, the flags that choose the
problems and the timing budget, and pinning the process to its cores."""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Sequence

import torch

from . import measure, workloads
from .problem import Problem


def names(text: str, known, what: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in known]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown {what} {unknown}; choose from {', '.join(known)}")
    return names


def sizes(text: str, flag: str = "--batch-sizes", least: int = 1) -> tuple[int, ...]:
    try:
        sizes = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{flag} takes integers, got {text!r}") from None
    if not sizes or min(sizes) < least:
        raise argparse.ArgumentTypeError(f"{flag} takes integers of at least {least}")
    return sizes


QUICK_HELP = "tiny sizes and short timing budgets"


def add_problem_flags(parser: argparse.ArgumentParser, known_workloads: Sequence[str],
                      default_workloads: Sequence[str] | None = None, quick_help: str = QUICK_HELP) -> None:
    """--device, --workloads, --batch-sizes, --atoms, --quick, --size, --threads and --min-time."""
    default_workloads = tuple(default_workloads or known_workloads)
    default = ("all" if default_workloads == tuple(known_workloads)
               else f"{','.join(default_workloads)}, from")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--workloads", type=lambda t: names(t, known_workloads, "workload(s)"),
                        default=default_workloads, help=f"comma list, default {default}: {','.join(known_workloads)}")
    parser.add_argument("--batch-sizes", type=sizes, default=None,
                        help="comma list of B for the sweep workload and the free-B workloads "
                             "(gelu_vjp, attention, hessian HVP probes); Jacobian workloads keep B = output size")
    parser.add_argument("--atoms", type=lambda t: sizes(t, "--atoms", 2), default=None,
                        help=f"comma list of atom counts N for {', '.join(workloads.ATOM_WORKLOADS)} (B = 3N) "
                             "and force_training, "
                             "replacing the size tier's")
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--size", choices=workloads.TIERS, default=None,
                        help="size tier; default: quick with --quick, else the device's (cpu or cuda)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's choice); on the CPU the whole process "
                             "is also pinned to that many cores first, so every column (JAX's thread pool "
                             "and the stock worker included) runs on the same cores")
    parser.add_argument("--min-time", type=float, default=None,
                        help="seconds of steady-state timing per cell, at least 9 calls "
                             "(default 1.0; --quick: 0.02 and 3 calls)")


def budget(args: argparse.Namespace) -> measure.Budget:
    budget = measure.Budget.quick() if args.quick else measure.Budget()
    if args.min_time is not None:
        budget = dataclasses.replace(budget, min_time_s=args.min_time)
    return budget


def device(args: argparse.Namespace) -> torch.device:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("dynbatch-bench: --device cuda, but torch.cuda.is_available() is False")
    return device


def tier(args: argparse.Namespace) -> str:
    return args.size or ("quick" if args.quick else args.device)


def problems(args: argparse.Namespace) -> list[Problem]:
    """The problems of every workload ``args`` names, at its sizes, on its device."""
    return [problem for name in args.workloads
            for problem in workloads.build(name, tier(args), args.batch_sizes, device(args), args.atoms)]


def pin_to_cores(n: int) -> list[int] | None:
    """Hold this process to its first ``n`` allowed cores.  Done before any column
    runs: threads started later (torch's OpenMP pool, XLA's pool) and the stock
    worker process inherit it, so a one-core run is one core for every column."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))[:n]
    os.sched_setaffinity(0, cores)
    return cores


def use_threads(args: argparse.Namespace) -> None:
    """``--threads``: pin the process to that many cores (on the CPU) and give torch that many threads."""
    if args.threads:
        if args.device == "cpu":
            pin_to_cores(args.threads)
        torch.set_num_threads(args.threads)

