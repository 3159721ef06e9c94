"""``python -m dynbatch.bench ab``: one option at several settings, side by side.

    python -m dynbatch.bench ab dynbatch.cpu_matmul=aten,auto --threads 1
    python -m dynbatch.bench ab dynbatch.cpu_matmul=aten,onednn --workloads sweep,mlp_jacobian --threads 1
    python -m dynbatch.bench ab cpp_wrapper=False,True --workloads sweep --batch-sizes 1,4,16
    python -m dynbatch.bench ab dynbatch.memory_budget=None,32MiB,auto --workloads full_hessian --threads 1
    python -m dynbatch.bench ab dynbatch.cpu_matmul=aten,auto --workloads force_training --column dynbatch_step

Each setting is a column: the problem's batched program compiled by dynbatch with
``options={KEY: value}`` (over the ``--option`` settings every column shares;
a key without the ``dynbatch.`` prefix is Inductor's, as in ``torch.compile``).
Each column's program has a code object of its own, so the columns do not share
Dynamo's cache or its recompile limit.  ``force_training`` times one of its dynbatch
columns (``--column``, training.py) per setting, each on its own copy of the model.
Per case, the columns are first called in turn (the first call, compile included;
peak memory; the difference from the first column's result), then timed
interleaved (measure.interleaved_times), so a drifting machine slows every column
alike.  Also per cell: the minor page faults of one steady call (getrusage), the
memory plan of the graphs the case compiled (planning/memory.py) and the cores the timed
calls kept busy; at the end, the CPU product kernels ``cpu_matmul="auto"``
measured (cpu/matmul_kernels.py).  ``--out FILE.json`` also writes the rows with the
run's provenance, for ``python -m dynbatch.bench report`` to show as a table
(part ``ab``, NOTE [Generated blocks] in report.py) instead of figures copied into prose.
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import resource
import statistics
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

import dynbatch
from dynbatch.cpu import matmul_kernels

from . import cli, measure, runner, training, variants
from .workloads import WORKLOADS

DEFAULT_WORKLOADS = ("sweep", "mlp_jacobian", "gelu_vjp")


def value(text: str) -> Any:
    """An option's value as Python reads it (``None``, ``True``, ``1024``), else the text (``"256MiB"``)."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def setting(text: str) -> tuple[str, list[tuple[str, Any]]]:
    """``KEY=V1,V2,...`` -> (KEY, [(text, value), ...])."""
    key, sep, values = text.partition("=")
    texts = [v.strip() for v in values.split(",") if v.strip()]
    if not sep or not key.strip() or not texts:
        raise argparse.ArgumentTypeError(f"give KEY=VALUE[,VALUE...], got {text!r}")
    return key.strip(), [(t, value(t)) for t in texts]


def option(text: str) -> tuple[str, Any]:
    key, texts = setting(text)
    if len(texts) != 1:
        raise argparse.ArgumentTypeError(f"--option takes one KEY=VALUE, got {text!r}")
    return key, texts[0][1]


def parse_args(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="dynbatch-bench ab",
        description="A/B of torch.compile(backend='dynbatch') options on the same cells, in one process: "
                    "one column per value, timed interleaved, ratios over the first.")
    parser.add_argument("setting", type=setting,
                        help="KEY=V1,V2[,...]: one column per value, e.g. dynbatch.cpu_matmul=aten,auto")
    parser.add_argument("--option", type=option, action="append", default=[],
                        help="KEY=VALUE every column compiles with (repeatable), "
                             "e.g. dynbatch.inner_compiler=aot_eager")
    cli.add_problem_flags(parser, [*WORKLOADS, *training.WORKLOADS], default_workloads=DEFAULT_WORKLOADS)
    parser.add_argument("--column", choices=training.DYNBATCH_COLUMNS, default="dynbatch_step",
                        help="force_training: the way of compiling the step each setting is timed in "
                             "(default dynbatch_step)")
    parser.add_argument("--out", type=Path, default=None,
                        help="also write the rows and the run's provenance to this JSON file "
                             "(python -m dynbatch.bench report shows it as a table: part 'ab')")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    cli.use_threads(args)
    device = cli.device(args)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    warnings.filterwarnings("ignore")  # legacy vmap's per-op "performance drop" warnings
    dynbatch.register()
    key, values = args.setting
    shared = dict(args.option)
    columns = {f"{key}={text}": {**shared, key: v} for text, v in values}
    first = next(iter(columns))
    meta = {**runner.machine_meta(device), "setting": key, "options": {k: repr(v) for k, v in shared.items()},
            "cold_compile_cache": runner.compile_cache_empty(), "timing": "interleaved",
            "budget": vars(cli.budget(args))}
    print(f"torch {torch.__version__}, {device}, {torch.get_num_threads()} threads; every column: "
          f"options={shared}; medians, ratios over {first}; faults: minor page faults of one call; "
          "cores: CPU time over wall time of the timed calls")
    print("| " + " | ".join(HEADER) + " |")
    print("|" + "---|" * len(HEADER), flush=True)
    rows: list[dict[str, Any]] = []

    def show(row: dict[str, Any]) -> None:
        rows.append(row)
        print("| " + " | ".join(text_row(row)) + " |", flush=True)

    batched = argparse.Namespace(**{**vars(args), "workloads": [w for w in args.workloads if w in WORKLOADS]})
    for problem in cli.problems(batched):
        def build(name, options, problem=problem):
            return variants.dynbatch_runner(name, problem, options)

        for row in measure_problem(problem, columns, device, cli.budget(args), build):
            show(row)
    for name in (w for w in args.workloads if w in training.WORKLOADS):
        for problem in training.WORKLOADS[name](cli.tier(args), device, args.atoms):
            def build(name, options, problem=problem):
                return training.build(args.column, problem, device, options, name)

            for row in measure_problem(problem, columns, device, cli.budget(args), build):
                show(row)
    chosen = matmul_kernels.chosen()
    if chosen:
        print("CPU product kernels measured, by (M, K, N).bit_length() and the operands' layouts: "
              + ", ".join(f"{k[:5]} {name}" for k, name in sorted(chosen.items(), key=lambda kv: kv[0][:5])))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"meta": meta, "problems": [], "ab": rows}, indent=1, default=str) + "\n")
        print(f"json: {args.out}")
    return 0


HEADER = ("problem", "case", "column", "median ms", "/ first", "first call s", "peak MiB", "faults",
          "graphs compiled", "max abs diff", "cores")


def text_row(row: dict[str, Any]) -> list[str]:
    """One row of the table, as ``HEADER`` names its cells."""
    if row["status"] != "ok":
        return [row["problem"], row["case"], row["column"], row["status"], *[""] * (len(HEADER) - 4)]
    return [row["problem"], row["case"], row["column"], f"{row['median_s'] * 1e3:.4g}",
            f"×{row['ratio']:.2f}" if row["ratio"] is not None else "–", f"{row['first_call_s']:.2f}",
            f"{row['peak_mem_bytes'] / 2 ** 20:.3g}", str(row["faults"]), row["graphs"],
            "–" if row["max_abs_err"] is None else f"{row['max_abs_err']:.2g}", f"{row['cores_used']:.2f}"]


def measure_problem(problem, columns: dict[str, dict[str, Any]], device: torch.device,
                    budget: measure.Budget, make_runner: Callable[..., variants.Runner]) -> Iterator[dict[str, Any]]:
    """One row per case and column (``text_row`` shows it); ``make_runner(name, options)`` builds a column."""
    torch._dynamo.reset()  # the columns of the last problem are done with
    sync = measure.synchronizer(device)
    cells: list[dict[str, dict[str, Any]]] = [{} for _ in problem.cases]
    calls: list[dict[str, Callable[[], Any]]] = [{} for _ in problem.cases]
    references: list[torch.Tensor | None] = [None] * len(problem.cases)
    for name, options in columns.items():
        dynbatch.reset()  # the compile records from here on are this column's
        column = make_runner(name, options)
        for i, case in enumerate(problem.cases):
            call = functools.partial(column.call, *column.prepare(case))
            compiled_before = _compiles()
            try:
                cell, result = measure.measure_cell(call, device, budget, column.to_torch, references[i],
                                                    steady=False)
            except Exception as e:  # noqa: BLE001 - a setting that fails is a result
                cells[i][name] = {"status": f"crashed: {measure.short_error(e)}"}
                continue
            compiled = _compiles() - compiled_before
            cell["graphs"] = _plans(dynbatch.compile_records()[-compiled:] if compiled else [])
            cell["faults"] = minor_faults(call, sync)
            if references[i] is None:
                references[i], cell["max_abs_err"] = result, 0.0
            cells[i][name], calls[i][name] = cell, call
    for case, case_cells, case_calls in zip(problem.cases, cells, calls):
        for name, figures in measure.interleaved_times(case_calls, sync, budget).items():
            case_cells[name]["median_s"] = statistics.median(figures["times_s"])
            case_cells[name]["cores_used"] = figures["cores_used"]
        base = next(iter(case_cells.values())).get("median_s")
        for name in columns:
            cell = case_cells[name]
            row = {"problem": problem.name, "case": case.label, "column": name, "status": cell["status"]}
            if cell["status"] == "ok":
                row.update({key: cell[key] for key in ("median_s", "first_call_s", "peak_mem_bytes", "faults",
                                                        "graphs", "max_abs_err", "cores_used")},
                           ratio=cell["median_s"] / base if base else None)
            yield row


def minor_faults(call: Callable[[], Any], sync: Callable[[], None]) -> int:
    """Minor page faults of this process during one call (getrusage)."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    call()
    sync()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def _compiles() -> int:
    """dynbatch's compiles so far: one compile record each (the last 64 are kept)."""
    counts = dynbatch.counters()
    return counts.get("graphs", 0) + counts.get("chunk_programs", 0)


def _plans(records) -> str:
    """The graphs a case compiled and how each runs its batched grads (planning/memory.py's plan)."""
    plans = []
    for record in records:
        if record.chunk_program:
            continue
        if record.fell_back:
            plans.append("fell back")
            continue
        chunked = [p for p in record.memory_plan if p.applied]
        plans.append(", ".join(f"chunks of {p.chunk_size}" for p in chunked) if chunked else "unchunked")
    return "; ".join(plans) or "none (an earlier graph)"
