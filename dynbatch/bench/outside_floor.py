"""``python -m dynbatch.bench outside_floor``: a batched grad outside a compiled model per
call, beside what torch itself costs.

    python -m dynbatch.bench outside_floor --threads 1               # sweep B = 1, 2000 calls a row
    python -m dynbatch.bench outside_floor --device cuda --batch 4 --interleaved

The ``sweep`` workload's 3-layer tanh MLP (the benchmark's) as an ``nn.Module`` whose
weights require grad; every row compiled and warmed up in one process, then each timed in
a run of its own, medians in microseconds (``--interleaved``: in turn, which on a 2 MiB L2
adds ~55 us to each of these small calls).  A call's time also depends on the state of
glibc's heap: where a program's buffers land above its mmap threshold, each call faults
them in anew (here ``dynbatch inside`` took 132 us instead of 73 until
``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` were raised):

- ``dynbatch inside``: the batched grad compiled with the model (the bench's ``dynbatch``);
- ``dynbatch outside``: ``torch.compile(model, backend="dynbatch")``, the ``is_grads_batched``
  grad in eager code around it (the bench's ``dynbatch_outside``);
- ``dynbatch forward``: the same compiled model's forward alone, with grad;
- ``stock forward``: ``torch.compile(model)`` (Inductor), the forward alone, with grad;
- ``stock forward + one plain grad``: the same, then ``torch.autograd.grad`` of one
  cotangent (not batched): what stock torch.compile takes for a single sample;
- ``eager Function, batched grad``: a one-op ``autograd.Function`` and its
  ``is_grads_batched`` grad: the legacy vmap's wrapping and the engine, with no model.

The gap between the first two is a per-call cost; the last three show how much of it
is torch's own (docs/benchmarks.md, "Grads outside a compiled nn.Module").  The
``dynbatch outside`` call by phase (the forward, torch's grad, dynbatch's backward and
its programs), on this workload or any other: ``python -m dynbatch.bench overhead
--variants dynbatch,dynbatch_outside`` (outside_phases.py).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

import dynbatch

from . import cli, variants, workloads

WARM_UP_CALLS = 50


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g


def parse_args(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dynbatch-bench outside_floor",
                                     description="A batched grad outside a compiled model per call, beside what "
                                                 "torch itself costs (the sweep's MLP; medians in us).")
    parser.add_argument("--batch", type=int, default=1, help="B, the cotangents per call")
    parser.add_argument("--reps", type=int, default=2000, help="timed calls of each row")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="where the model runs (cuda: the cuda size tier, a sync after each call)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1); on the CPU the process is pinned to that many cores")
    parser.add_argument("--interleaved", action="store_true",
                        help="time the rows' calls in turn, not each row in a run of its own")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    cli.use_threads(args)
    device = torch.device(args.device)
    dynbatch.register()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = _timed(_rows(device, args.batch), sync, args.reps, args.interleaved)
    how = "interleaved calls" if args.interleaved else "calls in a run of their own"
    print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} thread(s), sweep B={args.batch}, "
          f"medians of {args.reps} {how}")
    for name, ts in times.items():
        print(f"{name:32s} {statistics.median(ts) * 1e6:8.1f} us")
    return 0


def _rows(device: torch.device, batch: int) -> dict[str, Callable[[], object]]:
    """Each row's call on the sweep's MLP at ``batch`` cotangents."""
    problem = workloads.sweep(device.type, [batch], device)[0]
    case = problem.cases[0]
    x = case.x.detach().requires_grad_()
    v = case.cotangents
    inside = torch.compile(variants.with_own_code(variants.batched_program(problem)), backend="dynbatch")
    outside = torch.compile(variants.as_module(problem.f), backend="dynbatch")
    stock = torch.compile(variants.as_module(problem.f))
    return {
        "dynbatch inside": lambda: inside(case.x, v),
        "dynbatch outside": lambda: torch.autograd.grad(outside(x), x, v, is_grads_batched=True),
        "dynbatch forward": lambda: outside(x),
        "stock forward": lambda: stock(x),
        "stock forward + one plain grad": lambda: torch.autograd.grad(stock(x), x, v[0]),
        "eager Function, batched grad": lambda: torch.autograd.grad(_Copy.apply(x), x, v, is_grads_batched=True),
    }


def _timed(rows: dict[str, Callable[[], object]], sync: Callable[[], None], reps: int,
           interleaved: bool) -> dict[str, list[float]]:
    """Each row's call times in seconds, after every row compiled and warmed up."""
    for call in rows.values():
        for _ in range(WARM_UP_CALLS):
            call()
    times: dict[str, list[float]] = {name: [] for name in rows}
    rounds = [list(rows.items())] * reps if interleaved else [[(name, call)] * reps for name, call in rows.items()]
    for calls in rounds:
        for name, call in calls:
            start = time.perf_counter()
            call()
            sync()
            times[name].append(time.perf_counter() - start)
    return times
