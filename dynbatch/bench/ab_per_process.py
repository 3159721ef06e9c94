"""``python -m dynbatch.bench ab_per_process``: one bench case's ``dynbatch`` column at two
settings of an option, each in a fresh process.

    python -m dynbatch.bench ab_per_process dynbatch.keep_cpu_buffers=large,True \\
        full_hessian/pair_mlp:N=32 lj_forces:N=100 [--calls 200] [--out FILE.md]

Why: a setting whose effect depends on the process's state (glibc's heap: what it maps
afresh, what it trims between calls; NOTE [Programs that fault] in dynbatch/cpu/kept_buffers.py)
cannot be measured in the bench's or ``bench ab``'s process, where other columns' and
cases' large frees ran first.  A user's process that runs one model is this command's:
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

Each run is this module run as a script (``python -m dynbatch.bench.ab_per_process KEY
VALUE PROBLEM LABEL CALLS``, ``_run_case``), printing its figures as one JSON line.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dynbatch.cpu.kept_buffers import FLOOR_LOWERED

from . import ab

UNTIMED_CALLS = 5
MIN_TIMED_S = 1.0  # at least a second of calls: the probed first calls of a program (kept_buffers._Watch) weigh little


def parse_args(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dynbatch-bench ab_per_process",
                                     description="One bench case's dynbatch column at two settings of an option, "
                                                 "each (case, setting) alone in a fresh process.")
    parser.add_argument("setting", type=ab.setting, help="KEY=A,B: a dynbatch option at two settings")
    parser.add_argument("cases", nargs="+", help="PROBLEM:LABEL, as the bench names them (sweep:B=256)")
    parser.add_argument("--calls", type=int, default=200, help="timed calls per run")
    parser.add_argument("--out", type=Path, default=None, help="also write the table, with its provenance, here (.md)")
    args = parser.parse_args(argv)
    if len(args.setting[1]) != 2:
        parser.error(f"give KEY=A,B: two settings, got {len(args.setting[1])}")
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    key, ((first, _), (second, _)) = args.setting
    lines = [f"{key}: {second} over {first}; each run alone in a fresh process, one torch thread", "",
             "| case | core | setting | median ms | faults per call | programs from 128 KiB | cores | max abs diff vs eager |",
             "|---|---|---|---|---|---|---|---|"]

    def show(line: str) -> None:
        lines.append(line)
        print(line, flush=True)

    for line in lines[2:]:
        print(line)
    ratios = [_case(key, (first, second), case, args.calls, show) for case in args.cases]
    show("")
    show(f"{second} / {first}: geometric mean ×{math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f} "
         f"over {len(ratios)} cases")
    if args.out:
        args.out.write_text("\n".join([*_provenance(argv), "", *lines]) + "\n")
    return 0


def _case(key: str, settings: tuple[str, str], case: str, calls: int, show) -> float:
    """One case's four timed runs (each setting on each core), shown as rows; the second
    setting's median over the first's (geometric mean of the two placements)."""
    with tempfile.TemporaryDirectory(prefix="ab-per-process-") as folder:
        caches = {text: os.path.join(folder, str(i)) for i, text in enumerate(settings)}
        medians = _timed_runs(key, settings, case, calls, caches, show)
    first, second = settings
    ratio = math.sqrt(medians[second][0] * medians[second][1] / (medians[first][0] * medians[first][1]))
    show(f"| {case} | | {second} / {first} | ×{ratio:.3f} | | | | |")
    return ratio


def _timed_runs(key: str, settings: tuple[str, str], case: str, calls: int, caches: dict[str, str],
                show) -> dict[str, list[float]]:
    """Each setting's medians, one per core, after a first untimed run per setting filled its cache."""
    problem, _, label = case.partition(":")
    medians: dict[str, list[float]] = {text: [] for text in settings}
    warm_ups = [_start(key, text, problem, label, 0, core, caches[text]) for core, text in enumerate(settings)]
    for run in warm_ups:  # compiled once, untimed: the timed runs load the programs from the cache
        _, err = run.communicate()
        if run.returncode != 0:
            raise SystemExit(f"{case}: compiling failed:\n{err[-3000:]}")
    for placed in (settings, settings[::-1]):
        runs = [_start(key, text, problem, label, calls, core, caches[text]) for core, text in enumerate(placed)]
        for core, (text, run) in enumerate(zip(placed, runs)):
            out, err = run.communicate()
            if run.returncode != 0:
                raise SystemExit(f"{case} {text} on core {core} failed:\n{err[-3000:]}")
            cell = json.loads(out.strip().splitlines()[-1])
            medians[text].append(cell["median_ms"])
            show(f"| {case} | {core} | {text} | {cell['median_ms']:.4g} | {cell['faults']:.0f} "
                 f"| {cell['counters'].get(FLOOR_LOWERED, 0)} | {cell['cores']:.2f} | {cell['error']:.2g} |")
    return medians


def _start(key: str, text: str, problem: str, label: str, calls: int, core: int, cache: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_CACHE_DIR": cache}
    return subprocess.Popen(["taskset", "-c", str(core), sys.executable, "-m", __name__, key, text, problem, label,
                             str(calls)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _provenance(argv: list[str]) -> list[str]:
    """What ran, where, when: the command, the machine, torch, the code's commit."""
    import torch

    from . import runner

    meta = runner.machine_meta(torch.device("cpu"))
    command = "python -m dynbatch.bench ab_per_process " + " ".join(f"'{a}'" if " " in a else a for a in argv)
    git = functools.partial(subprocess.run, capture_output=True, text=True, check=False)
    commit = git(["git", "rev-parse", "--short", "HEAD"]).stdout.strip()
    dirty = git(["git", "status", "--porcelain", "--untracked-files=no"]).stdout.strip()
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return [f"<!-- generated by: {command} -->",
            f"`{command}`, {when}; {meta['cpu']}, {meta['cpu_count']} cores; torch {meta['torch']}, "
            f"Python {meta['python']}; code at {commit}{' with changes not committed' if dirty else ''}."]


def _run_case(key: str, text: str, problem_name: str, label: str, calls: str) -> None:
    """One run, in its own process: the case's data alone, compiled at one setting, timed;
    its figures printed as one JSON line."""
    import resource
    import statistics

    import torch

    import dynbatch

    from . import variants

    torch.set_num_threads(1)
    program, problem, case = _one_case(problem_name, label, key, ab.value(text))
    x, v = case.x, case.cotangents
    for _ in range(UNTIMED_CALLS):
        program(x, v)
    times = []
    faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    cpu = time.process_time()
    start = time.perf_counter()
    while int(calls) and (len(times) < int(calls) or time.perf_counter() - start < MIN_TIMED_S):
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


def _one_case(problem_name: str, label: str, key: str, value):
    """The case's program compiled with ``{key: value}``, its problem and the case; only this
    case's data is made: other sizes' tensors would shape the heap (NOTE [Programs that fault])."""
    import torch

    from . import variants
    from .workloads import WORKLOADS

    workload = problem_name.split("/")[0]
    size = label.rpartition("=")[2]
    size = int(size) if size.isdigit() else None
    cpu = torch.device("cpu")
    if label.startswith("N="):
        problems = WORKLOADS[workload]("cpu", None, cpu, atoms=[size])
    else:
        problems = WORKLOADS[workload]("cpu", [size] if label[0] in "BK" or " K=" in label else None, cpu)
    problem = next(p for p in problems if p.name == problem_name)
    case = next(c for c in problem.cases if c.label == label)
    program = torch.compile(variants.with_own_code(variants.batched_program(problem)), backend="dynbatch",
                            options={key: value})
    return program, problem, case


if __name__ == "__main__":  # one run (_start): the command itself is dynbatch.bench's
    _run_case(*sys.argv[1:6])
