"""``python -m dynbatch.bench hessian_rows``: the bench's ``hessian`` rows through one column alone.

    python -m dynbatch.bench hessian_rows B --device cuda                    # dynbatch, the bench's order
    python -m dynbatch.bench hessian_rows A --device cuda --column compiled_func

The rows (B = 2112 on CUDA, 272 on the CPU: the device's size tier), one process per run,
compiled one of four ways (``WAYS``): A at the rows (static); B at the rows, then at K = 8
(dynamic, the bench's order: the rows then run the dynamic graph); C the rows marked
dynamic from the first call; D as B with the K = 8 call's size hint set to the rows' B.
Prints the median of 20 calls of the rows and the costliest kernels of three
(torch.profiler).  docs/benchmarks.md, "`hessian` rows on CUDA", compares this with the
bench's cell.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import dynbatch

from . import variants, workloads

WAYS = {"A": "compiled at the rows (static)",
        "B": "compiled at the rows, then at K = 8 (dynamic: the bench's order)",
        "C": "the rows marked dynamic from the first call",
        "D": "as B, the K = 8 call's size hint set to the rows' B"}
PROBE_K = 8  # the HVP case compiled after the rows (ways B and D)
TIMED_CALLS = 20
PROFILED_CALLS = 3
TOP_KERNELS = 9


def parse_args(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dynbatch-bench hessian_rows",
                                     description="The bench's hessian rows through one column alone, compiled "
                                                 "one of four ways: "
                                                 + "; ".join(f"{k}: {v}" for k, v in WAYS.items()))
    parser.add_argument("way", choices=list(WAYS))
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--column", choices=[v for v in variants.VARIANTS if v not in ("stock_compile", "jax")],
                        default="dynbatch", help="the bench's column (default dynbatch)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False  # full fp32 matmuls, as the bench runs them
    dynbatch.register()
    problem = workloads.hessian(device.type, [PROBE_K], device)[0]
    rows, probes = problem.cases
    runner = variants.build(args.column, problem, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    call = _compiled(args.way, runner, runner.prepare(rows), runner.prepare(probes), rows.batch)
    for _ in range(3):
        call()
    sync()
    times = []
    for _ in range(TIMED_CALLS):
        start = time.perf_counter()
        call()
        sync()
        times.append(time.perf_counter() - start)
    print(f"{args.column} way {args.way}: rows B={rows.batch} median {statistics.median(times) * 1e3:.3f} ms, "
          f"graphs {runner.compiles()}", flush=True)
    for line in _costliest(call, sync, device):
        print(line, flush=True)
    return 0


def _compiled(way: str, runner: variants.Runner, rows: tuple, probes: tuple, batch: int):
    """The rows' call, after the first calls that compile it ``way``."""
    if way == "C":
        torch._dynamo.mark_dynamic(rows[1], 0)
    runner.call(*rows)
    if way == "D":
        torch._dynamo.mark_dynamic(probes[1], 0, hint_override=batch)
    if way != "A":
        runner.call(*probes)
    return lambda: runner.call(*rows)


def _costliest(call, sync, device: torch.device) -> list[str]:
    """The kernels (CUDA: by device time) or ops (CPU: by their own CPU time) the calls spend most in."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(PROFILED_CALLS):
            call()
        sync()

    def spent(event) -> float:
        return event.self_device_time_total if cuda else event.self_cpu_time_total

    events = sorted(prof.key_averages(), key=spent, reverse=True)[:TOP_KERNELS]
    return [f"   {spent(e) / PROFILED_CALLS / 1000:8.3f} ms x{e.count / PROFILED_CALLS:.0f} {e.key[:140]}"
            for e in events]
