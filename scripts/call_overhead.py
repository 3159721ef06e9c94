"""Where a small batched grad's time goes: per call, wall time against the time
the device spends in kernels, and the kernels launched, for each column of the
bench's ``sweep`` workload (the gap is per-call overhead: Python, guards,
dispatch, launches).  Each column is timed back to back in one process.

    python scripts/call_overhead.py --device cuda --batch-sizes 1,4,16
    python scripts/call_overhead.py --device cpu --size quick
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

import dynbatch
from dynbatch.bench import variants, workloads

COLUMNS = ("compiled_func", "dynbatch", "dynbatch_cudagraphs", "jax")


def wall_per_call(call, sync, reps: int) -> float:
    for _ in range(3):
        call()
    sync()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        call()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def kernels_per_call(call, sync, device: torch.device, reps: int = 10) -> tuple[float, int]:
    """(device seconds in kernels, kernels launched) per call, from torch's profiler."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync()
    with profile(activities=activities) as prof:
        for _ in range(reps):
            call()
        sync()
    if device.type != "cuda":
        return float("nan"), 0
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.device_time for e in kernels) / 1e6 / reps, len(kernels) // reps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--size", default=None, help="size tier (default: the device's)")
    parser.add_argument("--batch-sizes", default="1,4,16")
    parser.add_argument("--reps", type=int, default=200)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    dynbatch.register()
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    (problem,) = workloads.build("sweep", args.size or device.type, sizes, device, None)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}")
    print("| column | B | wall us/call | kernel us/call | kernels/call | wall - kernels us |")
    print("|---|---|---|---|---|---|")
    for column in COLUMNS:
        try:
            runner = variants.build(column, problem, device)
        except variants.VariantUnavailable as e:
            print(f"| {column} | - | skipped: {e} | | | |")
            continue
        for case in problem.cases:
            args_ = runner.prepare(case)

            def call():
                return runner.call(*args_)

            wall = wall_per_call(call, sync, args.reps)
            kernel_s, launches = kernels_per_call(call, sync, device) if column != "jax" else (float("nan"), 0)
            print(f"| {column} | {case.batch} | {wall * 1e6:.1f} | {kernel_s * 1e6:.1f} | {launches} "
                  f"| {(wall - kernel_s) * 1e6:.1f} |", flush=True)


if __name__ == "__main__":
    main()
