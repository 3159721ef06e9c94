"""What a batched grad outside a compiled model costs per call, beside what torch itself costs.

``python scripts/outside_floor.py [--batch 1] [--reps 2000]``, pinned to one core
(``taskset -c 1``).  The ``sweep`` workload's 3-layer tanh MLP (the benchmark's) as an
``nn.Module`` whose weights require grad; every row compiled and warmed up in one process,
then each timed in a run of its own, medians in microseconds (``--interleaved``: in turn,
which on a 2 MiB L2 adds ~55 us to each of these small calls).  A call's time also depends
on the state of glibc's heap: where a program's buffers land above its mmap threshold, each
call faults them in anew (here ``dynbatch inside`` took 132 us instead of 73 until
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
is torch's own (docs/benchmarks.md, "Grads outside a compiled nn.Module").

``--split``: the ``dynbatch outside`` call alone, in four phases, medians over the calls
(timestamps taken around dynbatch's routed backward, ``region_direct.Direct.backward``, and
its program, wrapped by this script for the measurement): the model's forward; torch's
``autograd.grad`` until dynbatch's backward starts (its pytree and legacy-vmap wrapping, the
engine, AOTAutograd's node); dynbatch's backward less its program (the plumbing); the
program (Inductor's, the batched backward from the saved activations); the return to the
caller (the engine's and vmap's unwrapping).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import dynbatch  # noqa: F401 - registers the backend
from dynbatch import region_direct, region_saved_backward
from dynbatch.bench import variants, workloads


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1, help="B, the cotangents per call")
    parser.add_argument("--reps", type=int, default=2000, help="timed calls of each row")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="where the model runs (cuda: the cuda size tier, a sync after each call)")
    parser.add_argument("--interleaved", action="store_true",
                        help="time the rows' calls in turn, not each row in a run of its own")
    parser.add_argument("--split", action="store_true",
                        help="time the phases of the outside call instead (see the module's docstring)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.split:
        split(args.batch, args.reps, torch.device(args.device))
        return

    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    problem = workloads.sweep(device.type, [args.batch], device)[0]
    case = problem.cases[0]
    x = case.x.detach().requires_grad_()
    v = case.cotangents
    inside = torch.compile(variants.with_own_code(variants.batched_program(problem)), backend="dynbatch")
    outside = torch.compile(variants.as_module(problem.f), backend="dynbatch")
    stock = torch.compile(variants.as_module(problem.f))

    rows = {
        "dynbatch inside": lambda: inside(case.x, v),
        "dynbatch outside": lambda: torch.autograd.grad(outside(x), x, v, is_grads_batched=True),
        "dynbatch forward": lambda: outside(x),
        "stock forward": lambda: stock(x),
        "stock forward + one plain grad": lambda: torch.autograd.grad(stock(x), x, v[0]),
        "eager Function, batched grad": lambda: torch.autograd.grad(_Copy.apply(x), x, v, is_grads_batched=True),
    }
    for call in rows.values():  # compile and warm up
        for _ in range(50):
            call()
    times: dict[str, list[float]] = {name: [] for name in rows}
    rounds = [list(rows.items())] * args.reps if args.interleaved else \
        [[(name, call)] * args.reps for name, call in rows.items()]
    for calls in rounds:
        for name, call in calls:
            start = time.perf_counter()
            call()
            sync()
            times[name].append(time.perf_counter() - start)
    how = "interleaved calls" if args.interleaved else "calls in a run of their own"
    print(f"torch {torch.__version__} on {device}, 1 thread, sweep B={args.batch}, medians of {args.reps} {how}")
    for name, ts in times.items():
        print(f"{name:32s} {statistics.median(ts) * 1e6:8.1f} us")


def _timed(cls: type, name: str, stamps: dict[str, float]) -> None:
    """Wrap ``cls.name`` to record when its calls start and end (this process only)."""
    original = getattr(cls, name)

    def timed(*args, **kwargs):
        stamps[name + " in"] = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            stamps[name + " out"] = time.perf_counter()

    setattr(cls, name, timed)


def split(batch: int, reps: int, device: torch.device) -> None:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    problem = workloads.sweep(device.type, [batch], device)[0]
    case = problem.cases[0]
    x = case.x.detach().requires_grad_()
    v = case.cotangents
    outside = torch.compile(variants.as_module(problem.f), backend="dynbatch")
    stamps: dict[str, float] = {}
    _timed(region_direct.Direct, "backward", stamps)
    _timed(region_saved_backward._Program, "run", stamps)
    for _ in range(50):
        torch.autograd.grad(outside(x), x, v, is_grads_batched=True)
    phases: dict[str, list[float]] = {name: [] for name in (
        "forward", "autograd.grad until dynbatch's backward", "dynbatch's backward less its program",
        "its program", "back to the caller", "whole call")}
    for _ in range(reps):
        stamps.clear()
        start = time.perf_counter()
        y = outside(x)
        forward_end = time.perf_counter()
        torch.autograd.grad(y, x, v, is_grads_batched=True)
        end = time.perf_counter()
        sync()
        if "run in" not in stamps:
            raise SystemExit("the call did not take the saved activations' program: nothing to split")
        program = stamps["run out"] - stamps["run in"]
        for name, seconds in zip(phases, (
                forward_end - start, stamps["backward in"] - forward_end,
                stamps["backward out"] - stamps["backward in"] - program, program,
                end - stamps["backward out"], end - start)):
            phases[name].append(seconds)
    print(f"torch {torch.__version__} on {device}, 1 thread, sweep B={batch}: dynbatch outside in phases, medians of {reps} calls")
    for name, ts in phases.items():
        print(f"{name:40s} {statistics.median(ts) * 1e6:8.1f} us")


if __name__ == "__main__":
    main()
