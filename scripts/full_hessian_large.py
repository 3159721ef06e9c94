"""One steady call per column of the benchmark's full Hessian at sizes too large for its
timing loop (e.g. N = 1000 Lennard-Jones atoms, B = 3000, where one call takes minutes).

Columns are built by dynbatch.bench (same programs, same memory guard); each cell reports
its first call (compile included), one steady call, CPU time over wall time of that call,
and the peak growth of torch's CPU allocator during it; errors are against the first
column's result.  Usage:

    .venv/bin/python scripts/full_hessian_large.py --atoms 1000 --problem lj \
        --variants eager_vmap_chunked,compiled_func,dynbatch,dynbatch_budget
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import dynbatch
from dynbatch.bench import measure, runner, variants, workloads


def one_call(fn):
    start, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - start, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--atoms", type=lambda s: [int(a) for a in s.split(",")], required=True)
    parser.add_argument("--problem", default="lj", choices=("lj", "pair_mlp"))
    parser.add_argument("--variants", default="eager_vmap_chunked,compiled_func,dynbatch,dynbatch_budget")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    (problem,) = [p for p in workloads.build("full_hessian", "cpu", None, device, args.atoms)
                  if p.name.endswith("/" + args.problem)]
    rows = []
    for case in problem.cases:
        reference = None
        for variant in args.variants.split(","):
            skip = runner.memory_guard(variant, case, device, [])
            if skip:
                rows.append({"case": case.label, "variant": variant, "status": f"skipped: {skip}"})
                print(rows[-1], flush=True)
                continue
            run = variants.build(variant, problem, device)
            call = lambda: run.call(*run.prepare(case))  # noqa: E731
            before = dynbatch.counters()
            _, first, _ = one_call(call)
            result, wall, cpu = one_call(call)
            peak = measure._profiled_peak(call)
            result = run.to_torch(result)
            error = None if reference is None else measure.max_abs_error(result, reference)
            reference = result if reference is None else reference
            delta = {k: v - before.get(k, 0) for k, v in dynbatch.counters().items() if v != before.get(k, 0)}
            rows.append({"case": case.label, "variant": variant, "status": "ok", "first_call_s": first,
                         "call_s": wall, "cores_used": cpu / wall, "peak_mib": peak / 2**20,
                         "output_mib": result.numel() * result.element_size() / 2**20,
                         "max_abs_err_vs_first": error, "max_abs": result.abs().max().item(),
                         "dynbatch": delta})
            print(rows[-1], flush=True)
            del run, result
    meta = {"torch": torch.__version__, "cpu": runner._cpu_name(), "threads": args.threads,
            "budget_auto_bytes": dynbatch.memory.resolve_budget("auto", [torch.zeros(1)])}
    print(json.dumps(meta))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
