"""``python -m dynbatch.bench first_call``: a force-training step's first call, cold and warm.

Each column builds and runs one training step (the force_training workload's model, its
first case) in a fresh process: ``cold`` with an empty Inductor cache directory, then
``warm`` in a second process on the cache the first one filled, as a restarted job or
the next MD run meets it.  The seconds cover ``torch.compile`` and the first step
(stock's ``torch.compile`` imports Inductor; dynbatch's imports it at the first call),
split by phase from torch's compile timers (NOTE [Where a first call goes] in
dynbatch/records.py); the ratio is to the stock column of the same start.

A column with "+background" compiles with ``options={"dynbatch.compile": "background"}``
(NOTE [Background compile] in dynbatch/lowering/background.py): its first call runs eager
kernels, and the process then calls the step again, back to back, until Inductor's programs
took over; ``handover`` gives those calls and the seconds from the first call's start.

``--call hessian`` takes ``functional.hessian`` of the model's energy in the positions around
the compiled model instead (a vibrational analysis; a PaiNN-style force field's Hessian), its
ratio to eager's: stock's peer is its own first call without a compile, the stance
"eager_then_compile" (a Hessian around a stock-compiled model raises from the second call on,
when it compiles).  ``call`` is the first call alone, without ``torch.compile``'s own seconds
(its imports: 0.1-0.2 s; stock's, which imports Inductor, 0.9 s); ``max diff`` the first
call's largest difference from eager's result.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

from .. import records
from . import training, variants
from .cli import pin_to_cores

# A column with "+no_aot_cache" runs with options={"dynbatch.aot_cache": False}, one with
# "+background" with options={"dynbatch.compile": "background"} (not run by default:
# --columns eager,dynbatch_step,dynbatch_step+background compares them).
COLUMNS = ("stock_traced", "dynbatch_model_in", "dynbatch_model_in+no_aot_cache", "dynbatch_step",
           "dynbatch_step+no_aot_cache")
STOCK = "stock_traced"  # stock as MACE's users set it up: the strongest peer
EXTRAS = {"no_aot_cache": {"dynbatch.aot_cache": False}, "background": {"dynbatch.compile": "background"}}
HANDOVER_TIMEOUT = 1800.0  # seconds a "+background" column waits for its compiled programs
HESSIAN_COLUMNS = ("eager", "stock_eager_then_compile", "dynbatch", "dynbatch+background")
REFERENCE = {"step": STOCK, "hessian": "eager"}  # each call's ratios are to this column's


def _child(column: str, kind: str, atoms: int, call: str = "step") -> dict[str, Any]:
    """One first call in this process, with its phases, then its difference from eager's."""
    import dynbatch

    (problem,) = [p for p in training.force_training("cpu", torch.device("cpu"), [atoms]) if p.kind == kind]
    case = problem.cases[0]
    base, _, extra = column.partition("+")
    build = training.build if call == "step" else hessian_runner
    built = {}

    def first_call():
        runner = built["runner"] = build(base, problem, torch.device("cpu"), options=EXTRAS.get(extra), name=column)
        args = built["args"] = runner.prepare(case)
        start = time.perf_counter()
        built["result"] = runner.call(*args)
        built["call"] = time.perf_counter() - start

    start = time.perf_counter()
    seconds, phases, caches = timed_by_phase(first_call)
    done = handover(built["runner"], built["args"], start) if extra == "background" else None
    eager = build("eager", problem, torch.device("cpu"))
    error = (built["result"] - eager.call(*eager.prepare(case))).abs().max().item()
    return {"column": column, "seconds": seconds, "call": built["call"], "phases": phases, "caches": caches,
            "dynbatch_graphs": dynbatch.counters().get("graphs", 0), "handover": done, "max_diff": error}


def hessian_runner(column: str, problem: training.Problem, device: torch.device,
                   options: dict[str, Any] | None = None, name: str | None = None) -> variants.Runner:
    """``functional.hessian`` of the model's energy in the positions, around the model as
    ``column`` (one of HESSIAN_COLUMNS, less its "+background") compiles it."""
    from torch.autograd import functional

    model = problem.make_model()
    if column == "eager":
        energy = model
    elif column == "stock_eager_then_compile":
        torch.compiler.set_stance("eager_then_compile")  # this process's every compile
        energy = torch.compile(variants.with_own_forward(model))
    elif column == "dynbatch":
        energy = torch.compile(variants.with_own_forward(model), backend="dynbatch", options=options)
    else:
        raise KeyError(f"unknown column {column!r} for the Hessian; choose from {HESSIAN_COLUMNS}")

    def call(pos: torch.Tensor, *graph: torch.Tensor) -> torch.Tensor:
        return functional.hessian(lambda p: energy(p, *graph), pos, vectorize=True)

    return variants.Runner(variant=name or column, call=call, prepare=lambda case: case.inputs,
                           to_torch=lambda r: r)


def timed_by_phase(call) -> tuple[float, dict[str, float], dict[str, int]]:
    """``call()``'s seconds, the seconds of each compile phase in it (records.PHASES), and
    the cache lookups it made."""
    import dynbatch

    span_record = records.CompileRecord()
    before = {id(r) for r in dynbatch.compile_records()}
    start = time.perf_counter()
    with records.compile_span(frame=True, record=span_record):
        call()
    seconds = time.perf_counter() - start
    # dynbatch's graphs keep their own spans' seconds (nested in this one): add them back.
    # Cache lookups count in every open span: this one has them all.
    phases = dict(span_record.seconds)
    for r in dynbatch.compile_records():
        if id(r) not in before:
            for k, v in r.seconds.items():
                phases[k] = phases.get(k, 0.0) + v
    return seconds, phases, span_record.caches


def handover(runner, args, start: float) -> dict[str, Any]:
    """Steps after the first, back to back, until each frame traced aside was handed over and
    each program compiled in the background ran its compiled code: {"calls": steps after the
    first, "seconds": since the first's start}."""
    import dynbatch

    calls = 0
    while time.perf_counter() - start < HANDOVER_TIMEOUT:
        before = dynbatch.counters()
        runner.call(*args)
        calls += 1
        after = dynbatch.counters()
        if after.get("background_compile_failures"):
            raise RuntimeError(f"a background compile failed: {after}")
        traced = after.get("aside_handovers", 0) + after.get("aside_compiled_here", 0)  # NOTE [Traced aside]
        if (traced == after.get("traced_aside", 0)
                and all(after.get(k, 0) == before.get(k, 0)  # no call of this step ran eagerly
                        for k in ("aside_eager_calls", "background_eager_calls", "outside_eager_while_aside"))
                and before.get("background_compiles_finished", 0) == before.get("background_compiles", 0)
                # (on torch < 2.14 a call while a compile aside runs make_fx runs eagerly, uncounted)
                and before.get("compiled_aside_finished", 0) == before.get("compiled_aside", 0)):
            return {"calls": calls, "seconds": time.perf_counter() - start,
                    "programs": after.get("background_compiles", 0)}
    raise RuntimeError(f"no handover in {HANDOVER_TIMEOUT} s: {dynbatch.counters()}")


def _run(column: str, kind: str, atoms: int, cache: str, threads: int, call: str = "step") -> dict[str, Any]:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "OMP_NUM_THREADS": str(threads)}
    out = subprocess.run([sys.executable, "-m", "dynbatch.bench.first_call", "--child", column, kind, str(atoms),
                          "--call", call], env=env, capture_output=True, text=True, check=False)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode or not lines:
        return {"column": column, "error": (out.stderr.strip().splitlines() or ["no output"])[-1]}
    return json.loads(lines[-1])


def _table(rows: list[dict[str, Any]], reference: str = STOCK) -> str:
    head = ["model", "column", "start", "seconds", f"/ {reference}", "call", f"call / {reference}'s",
            *records.PHASES, "caches", "handover", "max diff"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    ref = {(r["model"], r["start"]): r for r in rows if r["column"] == reference and "error" not in r}

    def ratio(r: dict[str, Any], key: str) -> str:
        of = ref.get((r["model"], r["start"]), {}).get(key)
        return f"{r[key] / of:.2f}" if of and r.get(key) is not None else "-"

    def secs(t: float | None) -> str:
        return "-" if t is None else f"{t:.1f}" if t >= 0.1 else f"{t:.3f}"  # eager's and the first calls'

    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['column']} | {r['start']} | failed: {r['error']} |")
            continue
        caches = ", ".join(f"{k} {v}" for k, v in sorted(r["caches"].items()) if v)
        took_over = r.get("handover")
        took_over = f"{took_over['calls']} calls, {took_over['seconds']:.1f} s" if took_over else "-"
        diff = f"{r['max_diff']:.1e}" if r.get("max_diff") is not None else "-"
        lines.append("| " + " | ".join([r["model"], r["column"], r["start"], secs(r["seconds"]), ratio(r, "seconds"),
                                        secs(r.get("call")), ratio(r, "call"),
                                        *(f"{r['phases'].get(p, 0):.1f}" for p in records.PHASES), caches,
                                        took_over, diff]) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="dynbatch-bench first_call", description=__doc__.splitlines()[0])
    parser.add_argument("--child", nargs=3, metavar=("COLUMN", "KIND", "ATOMS"), help=argparse.SUPPRESS)
    parser.add_argument("--call", choices=tuple(REFERENCE), default="step",
                        help="a training step, or a Hessian around the compiled model (default %(default)s)")
    parser.add_argument("--models", default="pair:16,message_passing:16",
                        help="comma list of KIND:ATOMS (pair, message_passing), default %(default)s")
    parser.add_argument("--columns", help=f"comma list, default {','.join(COLUMNS)} "
                                          f"(--call hessian: {','.join(HESSIAN_COLUMNS)})")
    parser.add_argument("--threads", type=int, default=1, help="torch threads and cores per process")
    parser.add_argument("--out", help="write the table (markdown) here too")
    args = parser.parse_args(argv)
    if args.child:
        column, kind, atoms = args.child
        print(json.dumps(_child(column, kind, int(atoms), args.call)))
        return 0
    pin_to_cores(args.threads)
    columns = args.columns.split(",") if args.columns else COLUMNS if args.call == "step" else HESSIAN_COLUMNS
    rows = []
    for model in args.models.split(","):
        kind, atoms = model.split(":")
        for column in columns:
            with tempfile.TemporaryDirectory(prefix="dynbatch-first-call-") as cache:
                for start in ("cold", "warm"):
                    row = {"model": f"{kind} N={atoms}", "start": start,
                           **_run(column, kind, int(atoms), cache, args.threads, args.call)}
                    rows.append(row)
                    print(f"{row['model']} {column} {start}: {row.get('seconds', row.get('error'))}", flush=True)
    table = _table(rows, REFERENCE[args.call])
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
