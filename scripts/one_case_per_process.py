"""One bench case's ``dynbatch`` column at two settings of an option, each in a fresh process.

``python scripts/one_case_per_process.py dynbatch.keep_cpu_buffers=large,True
full_hessian/pair_mlp:N=32 lj_forces:N=100 [--calls 200] [--out FILE.md]``

Why: a setting whose effect depends on the process's state (glibc's heap: what it maps
afresh, what it trims between calls; NOTE [Programs that fault] in dynbatch/cpu_buffers.py)
cannot be measured in the bench's or ``bench ab``'s process, where other columns' and
cases' large frees ran first.  A user's process that runs one model is this script's:
each (case, setting) runs alone in a new process that makes only that case's data (the
workload at that N or B alone), the two settings at once on cores 0 and 1 (``taskset``,
one torch thread), then swapped, so both see the same machine and each sits on each core
once.  The programs come from a compile cache that a first, untimed run per setting
filled, as a user's second run finds them.  Prints per run the median of the timed calls
(``--calls``, and at least a second of them) after five untimed ones, the minor page
faults per timed call (getrusage), the programs whose kept buffers start at 128 KiB
(``dynbatch.counters()``), the cores the timed calls kept busy (CPU time over wall time)
and the largest difference from eager's batched grad; per case the ratio of the second
setting over the first (geometric mean of the two placements).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_CELL = """
import json, os, resource, statistics, sys, time
import torch
import dynbatch
from dynbatch.bench import ab, variants
from dynbatch.bench.workloads import WORKLOADS

torch.set_num_threads(1)
key, text, problem_name, label, calls = sys.argv[1:6]
workload = problem_name.split("/")[0]
# Only this case's data is made: other sizes' tensors would shape the heap (NOTE [Programs that fault]).
size = int(label.rpartition("=")[2]) if label.rpartition("=")[2].isdigit() else None
if label.startswith("N="):
    problems = WORKLOADS[workload]("cpu", None, torch.device("cpu"), atoms=[size])
else:
    problems = WORKLOADS[workload]("cpu", [size] if label[0] in "BK" or " K=" in label else None,
                                   torch.device("cpu"))
problem = next(p for p in problems if p.name == problem_name)
case = next(c for c in problem.cases if c.label == label)
program = torch.compile(variants.with_own_code(variants.batched_program(problem)), backend="dynbatch",
                        options={key: ab.value(text)})
x, v = case.x, case.cotangents
for _ in range(5):
    program(x, v)
times = []
faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
cpu = time.process_time()
start = time.perf_counter()
# At least a second of calls: the probed first calls of a program (cpu_buffers._Watch) weigh little.
while int(calls) and (len(times) < int(calls) or time.perf_counter() - start < 1.0):
    t = time.perf_counter()
    out = program(x, v)
    times.append(time.perf_counter() - t)
wall = time.perf_counter() - start
faults = (resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - faults) / max(1, len(times))
cores = (time.process_time() - cpu) / wall if times else None
error = None
if times:  # against eager's batched grad (legacy vmap), once
    error = (out - variants.batched_program(problem)(x, v)).abs().max().item()
print(json.dumps({"median_ms": statistics.median(times) * 1e3 if times else None, "error": error,
                  "faults": faults, "cores": cores, "counters": dynbatch.counters()}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("setting", help="KEY=A,B: a dynbatch option at two settings")
    parser.add_argument("cases", nargs="+", help="PROBLEM:LABEL, as the bench names them (sweep:B=256)")
    parser.add_argument("--calls", type=int, default=200, help="timed calls per run")
    parser.add_argument("--out", type=Path, default=None, help="also write the table, with its provenance, here (.md)")
    args = parser.parse_args()
    key, _, values = args.setting.partition("=")
    first, second = values.split(",")
    lines = [f"{key}: {second} over {first}; each run alone in a fresh process, one torch thread", "",
             "| case | core | setting | median ms | faults per call | programs from 128 KiB | cores | max abs diff vs eager |",
             "|---|---|---|---|---|---|---|---|"]
    for line in lines[2:]:
        print(line)
    ratios = []
    for case in args.cases:
        problem, _, label = case.partition(":")
        medians = {first: [], second: []}
        caches = {text: tempfile.mkdtemp(prefix="one-case-") for text in (first, second)}
        warm_ups = [_start(key, text, problem, label, 0, core, caches[text]) for core, text in enumerate((first, second))]
        for run in warm_ups:  # compiled once, untimed: the timed runs load the programs from the cache
            _, err = run.communicate()
            if run.returncode != 0:
                raise SystemExit(f"{case}: compiling failed:\n{err[-3000:]}")
        for cores in ((first, second), (second, first)):
            runs = [_start(key, text, problem, label, args.calls, core, caches[text]) for core, text in enumerate(cores)]
            for core, (text, run) in enumerate(zip(cores, runs)):
                out, err = run.communicate()
                if run.returncode != 0:
                    raise SystemExit(f"{case} {text} on core {core} failed:\n{err[-3000:]}")
                cell = json.loads(out.strip().splitlines()[-1])
                medians[text].append(cell["median_ms"])
                lowered = cell["counters"].get("cpu_buffers_from_128KiB", 0)
                lines.append(f"| {case} | {core} | {text} | {cell['median_ms']:.4g} | {cell['faults']:.0f} | {lowered} "
                             f"| {cell['cores']:.2f} | {cell['error']:.2g} |")
                print(lines[-1])
        ratio = math.sqrt(medians[second][0] * medians[second][1] / (medians[first][0] * medians[first][1]))
        ratios.append(ratio)
        lines.append(f"| {case} | | {second} / {first} | ×{ratio:.3f} | | | | |")
        print(lines[-1])
    lines += ["", f"{second} / {first}: geometric mean ×{math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f} "
              f"over {len(ratios)} cases"]
    print(lines[-1])
    if args.out:
        args.out.write_text("\n".join([*_provenance(), "", *lines]) + "\n")


def _provenance() -> list[str]:
    """What ran, where, when: the command, the machine, torch, the code's commit."""
    import platform

    import torch

    command = "python scripts/one_case_per_process.py " + " ".join(
        f"'{a}'" if " " in a else a for a in sys.argv[1:])
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                           text=True).stdout.strip()
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return [f"<!-- generated by: {command} -->",
            f"`{command}`, {when}; {cpu}, {os.cpu_count()} cores; torch {torch.__version__}, "
            f"Python {platform.python_version()}; code at {commit}{' with changes not committed' if dirty else ''}."]


def _start(key: str, text: str, problem: str, label: str, calls: int, core: int, cache: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_CACHE_DIR": cache}
    return subprocess.Popen(["taskset", "-c", str(core), sys.executable, "-c", _CELL, key, text, problem, label,
                             str(calls)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


if __name__ == "__main__":
    main()
