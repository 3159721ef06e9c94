"""Writing the results: ``results.json`` (every raw figure) and ``results.md`` (tables);
and ``python -m dynbatch.bench report``, which rewrites the tables and plots a markdown
file shows (docs/benchmarks.md) from committed results files (NOTE [Generated blocks]).

Every ratio is computed here from the raw figures, never stored as an input:
each column's figure over ``eager_batched``'s, and dynbatch's over the best
other column's (and, for time, over the problem's floor).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable

from . import mace_workload, training
from .cells import columns, figure, geomean, ok, rows, same_memory_method
from .variants import COMPILED, REFERENCE

OURS = "dynbatch"
# dynbatch's own other configurations (a tight memory budget; CUDA graphs; the grad outside the
# compiled f): not rival columns, so "best other" leaves them out.
OURS_TOO = ("dynbatch_budget", "dynbatch_cudagraphs", "dynbatch_outside", "dynbatch_outside_vmap",
            "dynbatch_outside_cudagraphs")
# The grad taken outside a compiled model (is_grads_batched; torch.vmap over a vjp): the
# summary shows each one's cost over the grad inside.
OUTSIDE = "dynbatch_outside"
OUTSIDES = (OUTSIDE, "dynbatch_outside_vmap")


# --- ratios and the best other column (cells.py reads the cells) ---------------

def ratio(value: float | None, base: float | None) -> float | None:
    if value is None or base is None or base <= 0:
        return None
    return value / base


def best_other(case: dict[str, Any], key: str, usable=lambda cell: True,
               exclude: tuple[str, ...] = ()) -> tuple[str | None, float | None]:
    """The column other than dynbatch (and ``exclude``) with the smallest ``key`` figure."""
    figures = [(cell[key], name) for name, cell in case["variants"].items()
               if name != OURS and name not in OURS_TOO + exclude and ok(cell) and cell.get(key) is not None
               and usable(cell)]
    if not figures:
        return None, None
    value, name = min(figures)
    return name, value


# --- formatting -------------------------------------------------------------------

def fmt(value: float | None, scale: float = 1.0) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    v = value * scale
    if v == 0:
        return "0"
    return f"{v:.3g}" if abs(v) >= 1e-3 else f"{v:.1e}"


def fmt_ratio(r: float | None) -> str:
    return "–" if r is None else f"×{r:.2f}" if r < 10 else f"×{r:.3g}"


class Footnotes:
    """Turns long statuses ("crashed: ...") into a short cell and a numbered note."""

    def __init__(self) -> None:
        self.notes: list[str] = []
        self._index: dict[tuple[str, str], int] = {}

    def cell(self, variant: str, where: str, status: str) -> str:
        kind = status.split(":", 1)[0]
        key = (variant, status)  # one note per distinct message, naming the first case it hit
        if key not in self._index:
            self.notes.append(f"`{variant}`, first at {where}: {status}")
            self._index[key] = len(self.notes)
        return f"{kind} [{self._index[key]}]"

    def markdown(self) -> str:
        return "\n".join(f"{i + 1}. {note}" for i, note in enumerate(self.notes))


def table(header: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * len(header)) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return "\n".join(lines)


# --- the tables ---------------------------------------------------------------------

def _case_cells(problem, case, cols, notes, render: Callable[[dict, str], str]) -> list[str]:
    where = f"{problem['problem']} {case['label']}"
    out = []
    for v in cols:
        cell = case["variants"].get(v)
        if cell is None:
            out.append("–")
        elif not ok(cell):
            out.append(notes.cell(v, where, cell["status"]))
        else:
            out.append(render(case, v))
    return out


def summary_table(results) -> str:
    """dynbatch's time per case and its ratios, including to the best torch column
    (JAX is another framework: its lead says less about what dynbatch could reach), and,
    where the run had it, what taking the grad outside a compiled model costs."""
    outside = [c for c in OUTSIDES if c in columns(results)]
    body = []
    for problem, case in rows(results):
        ours = figure(case, OURS, "median_s")
        if ours is None:
            continue
        base = figure(case, REFERENCE, "median_s")
        floor = case.get("floor", {}).get("median_s")
        cells = [problem["problem"], case["label"], fmt(ours, 1e3), fmt_ratio(ratio(ours, base))]
        for exclude in ((), ("jax",)):
            other, value = best_other(case, "median_s", exclude=exclude)
            cells.append(f"{fmt_ratio(ratio(ours, value))} ({other})" if other else "–")
        cells.append(fmt_ratio(ratio(ours, floor)))
        cells += [fmt_ratio(ratio(figure(case, column, "median_s"), ours)) for column in outside]
        body.append(cells)
    return table(["problem", "case", "dynbatch ms", "/ eager_batched", "/ best other column",
                  "/ best torch column", "/ floor"] + [f"{column} / dynbatch" for column in outside], body)


def versus_best_other(results, exclude: tuple[str, ...] = ()) -> dict[str, Any] | None:
    """dynbatch's time over the best other column's, per case where both ran: the
    geometric mean, and the cases above 1.1 (issue 12's bars), or None."""
    found = []
    for problem, case in rows(results):
        ours = figure(case, OURS, "median_s")
        other, value = best_other(case, "median_s", exclude=exclude)
        if ours is not None and value:
            found.append((f"{problem['problem']} {case['label']}", ours / value, other))
    if not found:
        return None
    return {"geomean": geomean([r for _, r, _ in found]), "cases": len(found),
            "above_1_1": [(name, r, other) for name, r, other in found if r > 1.1]}


def versus_sentence(results) -> str:
    parts = []
    for exclude, label in (((), "best other column"), (("jax",), "best torch column")):
        v = versus_best_other(results, exclude)
        if v is None:
            continue
        worst = ", ".join(f"{n} ×{r:.2f} ({o})" for n, r, o in sorted(v["above_1_1"], key=lambda t: -t[1]))
        parts.append(f"dynbatch / {label}: geometric mean ×{v['geomean']:.2f} over {v['cases']} cases; "
                     f"{len(v['above_1_1'])} above ×1.1" + (f": {worst}." if worst else "."))
    for column in OUTSIDES:
        outside = [r for _, case in rows(results)
                   if (r := ratio(figure(case, column, "median_s"), figure(case, OURS, "median_s"))) is not None]
        if outside:
            parts.append(f"{column} / dynbatch: geometric mean ×{geomean(outside):.2f} over {len(outside)} cases.")
    return " ".join(parts)


def time_table(results, notes: Footnotes) -> str:
    cols = columns(results)
    ours_cols = ["dynbatch / eager_batched", "dynbatch / best other", "dynbatch / floor"] if OURS in cols else []
    header = ["problem", "case", "floor ms"] + [f"{v} ms" for v in cols] + ours_cols
    body = []
    for problem, case in rows(results):
        base = figure(case, REFERENCE, "median_s")

        render = functools.partial(_median_ms_cell, base=base)

        ours = figure(case, OURS, "median_s")
        other, other_value = best_other(case, "median_s")
        floor = case.get("floor", {}).get("median_s")
        ours_cells = [fmt_ratio(ratio(ours, base)),
                      f"{fmt_ratio(ratio(ours, other_value))} ({other})" if other else "–",
                      fmt_ratio(ratio(ours, floor))]
        body.append([problem["problem"], case["label"], fmt(floor, 1e3)]
                    + _case_cells(problem, case, cols, notes, render) + ours_cells[:len(ours_cols)])
    return table(header, body)


# --- the force_training workload (training.py) -----------------------------------------

TRAINING_OURS = ("dynbatch_model_in", "dynbatch_model_out", "dynbatch_step")


def _training_columns(results) -> list[str]:
    """The columns a run measured (CUDA graphs' run on CUDA only)."""
    return [c for c in training.COLUMNS if any(c in case["variants"] for p in results.get("training", [])
                                               for case in p["cases"])]


def training_table(results, notes: Footnotes) -> str:
    """Each column's time per step, ×ratio to eager; dynbatch's columns over the whole
    compiled step, and the whole step over JAX."""
    cols = _training_columns(results)
    # The step replayed as CUDA graphs, where measured: the launch-free step against JAX's.
    steps = ["dynbatch_step"] + [c for c in cols if c == "dynbatch_step" + training.CUDAGRAPHS]
    header = (["problem", "case"] + [f"{c} ms" for c in cols]
              + [f"{c[len('dynbatch_'):]} / step" for c in TRAINING_OURS[:2]]
              + [f"{c[len('dynbatch_'):]} / jax" for c in steps])
    body = []
    for problem in results.get("training", []):
        for case in problem["cases"]:
            base = figure(case, training.REFERENCE, "median_s")

            render = functools.partial(_median_ms_cell, base=base)

            step = figure(case, "dynbatch_step", "median_s")
            extra = [fmt_ratio(ratio(figure(case, c, "median_s"), step)) for c in TRAINING_OURS[:2]]
            extra += [fmt_ratio(ratio(figure(case, c, "median_s"), figure(case, "jax", "median_s"))) for c in steps]
            body.append([problem["problem"], case["label"]] + _case_cells(problem, case, cols, notes, render) + extra)
    return table(header, body)


def training_cores_and_errors(results) -> str:
    cols = _training_columns(results)
    body = []
    for problem in results.get("training", []):
        for case in problem["cases"]:
            cells = case["variants"]
            body.append([problem["problem"], case["label"]] + [
                (f"{fmt(cells[c].get('cores_used'))} / {fmt(cells[c].get('max_abs_err'))}" if ok(cells.get(c)) else "–")
                for c in cols])
    return table(["problem", "case"] + [f"{c} cores / err" for c in cols], body)


# --- the mace workload (mace_workload.py) -------------------------------------------------

def _mace_columns(results) -> list[str]:
    return [c for c in mace_workload.COLUMNS
            if any(c in case["variants"] for p in results.get("mace", []) for case in p["cases"])]


def mace_table(results, notes: Footnotes) -> str:
    """Each column's median time per call, ± IQR, ×ratio to eager; then, column by column,
    the first call (compile included), the cores used while timed and the max abs error
    against eager."""
    cols = _mace_columns(results)
    body = []
    for problem in results.get("mace", []):
        for case in problem["cases"]:
            base = figure(case, mace_workload.REFERENCE, "median_s")

            render = functools.partial(_median_ms_cell, base=base)

            each = [" / ".join(fmt(figure(case, c, key)) for c in cols)
                    for key in ("first_call_s", "cores_used", "max_abs_err")]
            body.append([problem["problem"], case["label"]] + _case_cells(problem, case, cols, notes, render) + each)
    per_column = f"({' / '.join(cols)})"
    return table(["call", "case"] + [f"{c} ms" for c in cols]
                 + [f"first call s {per_column}", "cores used", "max abs err vs eager"], body)


def simple_table(results, notes: Footnotes, key: str, scale: float, unit: str,
                 usable=lambda cell: True) -> str:
    """One figure per cell with its ratio to eager_batched, and dynbatch over the best other.

    ``usable(cell)`` false: the figure was measured another way and is not compared ("n/a").
    """
    cols = columns(results)
    header = ["problem", "case"] + [f"{v} {unit}" for v in cols] + (["dynbatch / best other"] if OURS in cols else [])
    body = []
    for problem, case in rows(results):
        base = figure(case, REFERENCE, key)

        def render(case, v, base=base):
            cell = case["variants"][v]
            if not usable(cell):
                return "n/a"
            return f"{fmt(cell.get(key), scale)} {fmt_ratio(ratio(cell.get(key), base))}"

        ours = figure(case, OURS, key)
        other, other_value = best_other(case, key, usable)
        ours_cells = [f"{fmt_ratio(ratio(ours, other_value))} ({other})" if other else "–"] if OURS in cols else []
        body.append([problem["problem"], case["label"]] + _case_cells(problem, case, cols, notes, render)
                    + ours_cells)
    return table(header, body)




def _workload_section(title: str, intro: str, tables: list[str], problems: list, descriptions: dict) -> list[str]:
    """A section of a workload's own tables, then what each problem and column is."""
    return [title, intro, *tables,
            "\n".join(f"- {p['problem']}: {p['description']}" for p in problems),
            "\n".join(f"- `{k}`: {v}" for k, v in descriptions.items())]


def _median_ms_cell(case, v, base) -> str:
    """A column's median ms per call, ± IQR, ×ratio to ``base`` (seconds)."""
    cell = case["variants"][v]
    return f"{fmt(cell['median_s'], 1e3)} ±{fmt(cell['iqr_s'], 1e3)} {fmt_ratio(ratio(cell['median_s'], base))}"

def cores_table(results, notes: Footnotes) -> str:
    """Process CPU time over wall time while each cell was timed (older runs: –)."""
    def render(case, v):
        cores = case["variants"][v].get("cores_used")
        return "–" if cores is None else f"{cores:.2f}"

    cols = columns(results)
    body = [[problem["problem"], case["label"]] + _case_cells(problem, case, cols, notes, render)
            for problem, case in rows(results)]
    return table(["problem", "case"] + cols, body)


def max_cores_used(results) -> tuple[float, str] | None:
    """The busiest timed cell of the run, and where it was."""
    seen = [(cell["cores_used"], f"{v}, {p['problem']} {c['label']}")
            for p in results["problems"] for c in p["cases"] for v, cell in c["variants"].items()
            if ok(cell) and cell.get("cores_used") is not None]
    return max(seen) if seen else None


def error_table(results, notes: Footnotes) -> str:
    cols = columns(results)
    body = []
    for problem, case in rows(results):
        body.append([problem["problem"], case["label"]] + _case_cells(
            problem, case, cols, notes, lambda c, v: fmt(c["variants"][v].get("max_abs_err"))))
    return table(["problem", "case"] + cols, body)


def graphs_table(results, notes: Footnotes | None = None) -> str:
    """Graphs per compiled column, and dynbatch's own counters for each dynbatch configuration
    that ran: batched graphs, fallbacks (their reasons as notes) and, where dynbatch counts
    them, grads run in chunks (a memory budget at work)."""
    notes = notes or Footnotes()
    cols = [v for v in columns(results) if v in COMPILED]
    ours = [v for v in (OURS, "dynbatch_budget") if v in cols or v == OURS]
    chunked = any("grads_chunked" in (p.get(v) or {}) for p in results["problems"] for v in ours)
    header = ["problem", "cases (in order)"] + cols
    for v in ours:
        header += [f"{v} batched graphs", f"{v} fallbacks"] + ([f"{v} chunked grads"] if chunked else [])
    body = []
    for problem in results["problems"]:
        row = [problem["problem"], ", ".join(c["label"] for c in problem["cases"])]
        row += [("–" if problem["graphs"].get(v) is None else str(problem["graphs"][v])) for v in cols]
        for v in ours:
            delta = problem.get(v) or {}
            fallbacks = str(delta.get("fallbacks", 0) if delta else "–")
            for reason in dict.fromkeys(delta.get("fallback_reasons") or []):
                fallbacks += " " + notes.cell(v, problem["problem"], f"fell back: {reason}").rsplit(" ", 1)[1]
            row += [str(delta.get("graphs_batched", "–")), fallbacks]
            if chunked:
                row.append(str(delta.get("grads_chunked", "–")))
        body.append(row)
    return table(header, body)


def floors_list(results) -> str:
    lines = []
    for problem in results["problems"]:
        whats = sorted({c.get("floor", {}).get("what", "") for c in problem["cases"]})
        lines.append(f"- **{problem['problem']}**: {problem['description']}. Floor: {'; '.join(whats)}.")
    return "\n".join(lines)


def memory_note(meta: dict[str, Any]) -> str:
    """How the memory guard decided which cells to skip (docs/benchmarks.md)."""
    available = meta.get("memory_available_at_start")
    headroom = meta.get("memory_headroom")
    if not available or not headroom:
        return ""
    return (f"Cells \"skipped: needs about ...\" were not run: the case's estimate for the samples the column "
            f"holds at once (or the column's own peak on a smaller case, scaled) exceeded {headroom:g} of the "
            f"memory available, {fmt(available, 1 / 2 ** 30)} GiB at the start.")


def markdown(results: dict[str, Any]) -> str:
    meta = results["meta"]
    notes = Footnotes()
    jax_line = (f"JAX {meta['jax']} with jax_default_matmul_precision=\"highest\" (torch fp32 matmuls)"
                if meta.get("jax") else "JAX not installed: the jax column is skipped")
    parts = [
        "# dynbatch benchmark",
        f"{meta['date_utc']} on **{meta['device_name']}** ({meta['device']}, {meta['torch_threads']} torch threads); "
        f"torch {meta['torch']}, dynbatch {meta['dynbatch']}, Python {meta['python']}; size tier `{meta['tier']}`, "
        f"{meta['dtype']}. {jax_line}. Compile caches: {'cold (empty Inductor/Triton cache folders)' if meta['cold_compile_cache'] else 'warm (the user caches)'}.",
    ]
    if results["problems"]:
        parts += _batched_sections(results, meta, notes)
    if results.get("training"):
        parts += _workload_section(
            "## Training with forces (force_training)",
            "Median time per training step, ± interquartile range, in ms; ×ratio to `eager`; the "
            "dynbatch columns over `dynbatch_step` (the whole step compiled), and that over JAX.",
            [training_table(results, notes), "Cores used while timed / max abs error of the parameter grads "
             "against eager:", training_cores_and_errors(results)],
            results["training"], training.DESCRIPTIONS)
    if results.get("mace"):
        parts += _workload_section(
            "## A real model (mace)",
            "Median time per call, ± interquartile range, in ms; ×ratio to `eager`; then per column the "
            "first call (compile included), the cores used while timed and the max abs error against eager.",
            [mace_table(results, notes)], results["mace"], mace_workload.DESCRIPTIONS)
    if notes.notes:
        parts += ["## Notes", notes.markdown()]
    if results["problems"]:
        parts += ["## Columns", "\n".join(f"- `{k}`: {v}" for k, v in meta["variant_descriptions"].items())]
    return "\n\n".join(parts) + "\n"


def _batched_sections(results: dict[str, Any], meta: dict[str, Any], notes: Footnotes) -> list[str]:
    return [
        "## Summary: dynbatch per case",
        "dynbatch's median time per call and its ratios (below 1: dynbatch is faster).",
        summary_table(results),
        versus_sentence(results),
        "## Steady-state time per call",
        "Median over repeated calls, ± interquartile range, in ms; ×ratio to `eager_batched`. "
        "`dynbatch / best other` names the fastest other column; `floor` is the matrix products any "
        "batched backward must do, timed alone in the same run.",
        time_table(results, notes),
        "## Cores used while timed",
        "The process's CPU time over wall time during each cell's timed calls (`cores_used` in "
        "results.json): a column held to one core reads at most about 1. " + _cores_sentence(results, meta),
        cores_table(results, notes),
        "## First call (compile included)",
        "Seconds for the first call of each case, in sweep order: a later case's first call includes "
        "a recompile if the column needed one.",
        simple_table(results, notes, "first_call_s", 1.0, "s"),
        "## Peak memory",
        f"MiB; {meta['memory_method']}. A cell measured another way shows n/a (JAX's memory is outside "
        "torch's allocators; its sampled RSS growth is in results.json). " + memory_note(meta),
        simple_table(results, notes, "peak_mem_bytes", 1 / 2 ** 20, "MiB", usable=same_memory_method(meta)),
        "## Graphs compiled over each problem's cases",
        "Dynamo graphs (JAX: jit cache entries) compiled while the column ran the cases in the order "
        "listed; a batch size that stays symbolic needs no new graph.",
        graphs_table(results, notes),
        f"## Max abs error against {meta.get('error_reference', 'eager_loop')}",
        error_table(results, notes),
        "## Problems and floors",
        floors_list(results),
    ]


def _cores_sentence(results, meta: dict[str, Any]) -> str:
    busiest = max_cores_used(results)
    pinned = meta.get("cpu_affinity")
    where = f"The process ran on cores {pinned}. " if pinned else ""
    return where + (f"Busiest cell: {busiest[0]:.2f} ({busiest[1]})." if busiest else "")


def write(results: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "results.json", "md": out_dir / "results.md"}
    paths["json"].write_text(json.dumps(results, indent=1, default=str) + "\n")
    paths["md"].write_text(markdown(results))
    return paths


# --- python -m dynbatch.bench report: the docs' generated blocks -------------------------
# NOTE [Generated blocks]
# docs/benchmarks.md shows each committed results file between two markers:
#
#   <!-- generated by python -m dynbatch.bench report: docs/results/cpu.json -->
#   ...
#   <!-- end generated -->
#
# with, where one file holds both and the doc shows them apart, a part after the path
# ("batched", "training", "mace", "ab", "outside" or "overhead").  A block of a .md
# results file (`gemm --out`, bench ab_per_process) shows that file as it is.
# `report` rewrites what lies between the markers of the files it is given (none given:
# every file the doc names), from those files, and nothing else: the doc's tables cannot
# drift from the results, a re-run replaces them instead of adding a dated section, and
# running it twice gives the same file.  Every table of docs/benchmarks.md lies in a block
# (tests/test_bench_report.py).  The path is read from the current folder, as the
# command line's are.

BEGIN = "<!-- generated by python -m dynbatch.bench report: "
END = "<!-- end generated -->"
BLOCK = re.compile(rf"^(?P<begin>{re.escape(BEGIN)}(?P<source>\S+)(?: (?P<part>\S+))? -->)\n.*?^{re.escape(END)}$",
                   re.M | re.S)
PARTS = {"batched": "problems", "training": "training", "mace": "mace", "ab": "ab",  # part -> the results key it shows
         "outside": "outside_phases", "overhead": "overhead"}


def part_of(results: dict[str, Any], part: str | None) -> dict[str, Any]:
    """``results`` with only ``part``'s problems (None: all), so that tables and plots
    made from it show that part alone."""
    if part is None:
        return results
    if part not in PARTS:
        raise SystemExit(f"dynbatch-bench report: unknown part {part!r} in a marker; choose from {', '.join(PARTS)}")
    return {**results, **{key: [] for name, key in PARTS.items() if name != part}}


def _each(value) -> list:
    """A merged run (cuda.json: two calls on one machine) records a list where a run records one value."""
    return value if isinstance(value, list) else [value]


def provenance(meta: dict[str, Any]) -> str:
    """Where, when and how the figures were measured, in one line, as the run recorded it."""
    host = f"host {meta['cpu']}, " if meta["device"] != "cpu" else ""
    threads = meta["torch_threads"]
    cores = f" on cores {meta['cpu_affinity']}" if meta["device"] == "cpu" and meta.get("cpu_affinity") else ""
    dates = ", ".join(date[:16].replace("T", " ") for date in _each(meta["date_utc"])) + " UTC"
    argvs = meta["argv"] if isinstance(meta["argv"][0], list) else [meta["argv"]]
    commands = "; ".join(f"`python -m dynbatch.bench {' '.join(argv[1:])}`" for argv in argvs)
    runs = f" Runs: {meta['runs']}." if meta.get("runs") else ""
    return (f"Measured on **{meta['device_name']}** ({host}{meta['cpu_count']} cores), {threads} torch "
            f"thread{'' if threads == 1 else 's'}{cores}; torch {meta['torch']}, "
            f"{'JAX ' + meta['jax'] if meta.get('jax') else 'no JAX'}, Python {meta['python']}; "
            f"{'cold' if meta['cold_compile_cache'] else 'warm'} compile caches; {dates}: {commands}.{runs}")


def doc_block(results: dict[str, Any], images: list[str]) -> str:
    """What a block shows: the provenance, dynbatch's summary per case with its geometric
    means, the training table, their notes, and the plots (``images``: markdown links)."""
    notes = Footnotes()
    parts = [provenance(results["meta"])]
    if results["problems"]:
        parts += [summary_table(results), versus_sentence(results)]
    if results.get("training"):
        parts.append(training_table(results, notes))
    if results.get("mace"):
        parts.append(mace_table(results, notes))
    if results.get("ab"):
        parts.append(ab_table(results))
    if results.get("overhead"):
        parts.append(overhead_table(results))
    if results.get("outside_phases"):
        parts.append(outside_phases_table(results))
    if notes.notes:
        parts.append(notes.markdown())
    if images:
        parts.append(" ".join(images))  # one paragraph: the plots side by side, and a short doc
    return "\n\n".join(parts) + "\n"


def ab_table(results: dict[str, Any]) -> str:
    """An A/B run's rows (``python -m dynbatch.bench ab --out``): one setting per column row,
    ratios over the first setting of each case."""
    from . import ab

    meta = results["meta"]
    options = f" (every column also {', '.join(f'{k}={v}' for k, v in meta['options'].items())})" \
        if meta.get("options") else ""
    lines = [f"`{meta['setting']}` A/B{options}; medians, interleaved; cores: CPU time over wall time.", "",
             "| " + " | ".join(ab.HEADER) + " |", "|" + "---|" * len(ab.HEADER)]
    lines += ["| " + " | ".join(ab.text_row(row)) + " |" for row in results["ab"]]
    return "\n".join(lines)


def outside_phases_table(results: dict[str, Any]) -> str:
    """``python -m dynbatch.bench overhead --out``'s rows: each ``dynbatch_outside`` call by
    phase beside the grad inside the compiled function (NOTE [An outside call, phase by phase]
    in outside_phases.py)."""
    from . import outside_phases as phases

    lines = ["`dynbatch_outside`'s calls by phase, medians in µs, interleaved with `dynbatch`'s.", "",
             "| " + " | ".join(phases.PHASE_HEADER) + " |", "|" + "---|" * len(phases.PHASE_HEADER)]
    lines += ["| " + " | ".join(phases.phase_text(row)) + " |" for row in results["outside_phases"]]
    return "\n".join([*lines, "", *phases.phase_summary(results["outside_phases"])])


def overhead_table(results: dict[str, Any]) -> str:
    """``python -m dynbatch.bench overhead --out``'s per-call rows: each column's call, its
    stack, its programs and its products, and the floor over JAX's call (NOTE [What a call
    costs at the least] in overhead.py)."""
    from . import overhead

    rows = results["overhead"]
    beside = rows_beside_jax(rows)
    if beside is None:
        header, body = list(overhead.header()), [overhead.row_text(row) for row in rows]
    else:
        header, body = [*overhead.header(), "jax whole us"], beside
    lines = ["Per call, medians in µs, the columns interleaved.", "", table(header, body)]
    return "\n".join([*lines, "", *overhead.floor_summary(rows)])


def rows_beside_jax(rows: list[dict[str, Any]]) -> list[list[str]] | None:
    """Where JAX ran beside a column's floor: a row per case and such column, JAX's whole
    call as its last cell, so that a run's table stays one row per case (None: no floor).
    Left out are JAX's own rows and those of a column without a floor (``dynbatch_outside``,
    whose stack is measured per whole call: the ``outside`` part shows its calls by phase)."""
    from . import overhead
    from .measure import fmt_us

    jax = {(r["problem"], r["case"]): r["whole_us"] for r in rows if r["column"] == overhead.JAX and r["status"] == "ok"}
    floored = [r for r in rows if r.get("floor_over_jax") is not None]
    if not floored:
        return None
    return [[*overhead.row_text(r), fmt_us(jax[r["problem"], r["case"]])] for r in floored]


def image_path(img_dir: Path, source: Path, figure: str) -> Path:
    """A figure of ``source``'s run: img_dir/<the file's stem>_<figure>.png (cpu.json: cpu_speedup.png)."""
    return img_dir / f"{source.stem}_{figure}.png"


def image_links(results: dict[str, Any], source: Path, img_dir: Path, doc: Path) -> list[str]:
    from . import plots  # matplotlib, imported only where plots are drawn

    links = []
    for figure in plots.figures(results):
        link = os.path.relpath(image_path(img_dir, source, figure), doc.parent).replace(os.sep, "/")
        links.append(f"![{figure.replace('_', ' ')}, {source.name}]({link})")
    return links


def regenerate(text: str, render: Callable[[Path, str | None], str | None]
               ) -> tuple[str, list[tuple[Path, str | None]]]:
    """``text`` with each block's body replaced by ``render(source, part)`` (None: left as is),
    and the (source, part) of each block replaced."""
    done = []

    def replace(match: re.Match) -> str:
        if BEGIN in match[0][len(match["begin"]):]:  # a marker left open would swallow the next block
            raise SystemExit(f"dynbatch-bench report: {match['begin']} has no {END} before the next block")
        source, part = Path(match["source"]), match["part"]
        body = render(source, part)
        if body is None:
            return match[0]
        done.append((source, part))
        return f"{match['begin']}\n{body}{END}"

    return BLOCK.sub(replace, text), done


def parse_report_args(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="dynbatch-bench report",
        description="Rewrite the result tables and plots a markdown file shows between "
                    "'<!-- generated by python -m dynbatch.bench report: PATH [part] -->' and "
                    f"'{END}' (part: {'|'.join(PARTS)}), from the results files given; a .md "
                    "results file is shown as it is (NOTE [Generated blocks] in report.py). "
                    "Text outside the markers, and blocks of files not given, are left as they are.",
        epilog="To regenerate all of docs/benchmarks.md: python -m dynbatch.bench report "
               "(no paths: every block the doc names; add --no-plots without matplotlib).")
    parser.add_argument("results", nargs="*", type=Path,
                        help="results files of earlier runs (docs/results/*.json, *.md); "
                             "none: every file the doc's markers name")
    parser.add_argument("--doc", type=Path, default=Path("docs/benchmarks.md"),
                        help="the markdown file to update (default docs/benchmarks.md)")
    parser.add_argument("--img-dir", type=Path, default=None,
                        help="folder of the plots, named <results file's stem>_<figure>.png "
                             "(default: img/ beside --doc)")
    parser.add_argument("--no-plots", action="store_true",
                        help="rewrite the tables and links only, not the PNG files (no matplotlib needed)")
    return parser.parse_args(argv)


def named_sources(text: str) -> list[Path]:
    """The results files a doc's markers name, once each, in the doc's order."""
    return list(dict.fromkeys(Path(m["source"]) for m in BLOCK.finditer(text)))


def load(path: Path) -> dict[str, Any] | str:
    """A results file: a run's JSON, or a .md file's text, which its block shows as it is."""
    text = path.read_text()
    return text if path.suffix == ".md" else json.loads(text)


def markdown_block(text: str, source: Path, part: str | None) -> str:
    """A .md results file's block: the file as it is."""
    if part is not None:
        raise SystemExit(f"dynbatch-bench report: {source} is shown whole; its marker takes no part ({part!r})")
    if BEGIN in text or END in text:  # its markers would end the block early, or open another
        raise SystemExit(f"dynbatch-bench report: {source} holds a report marker; it cannot be shown in a block")
    return text if text.endswith("\n") else text + "\n"


def main(argv=None) -> int:
    args = parse_report_args(argv)
    img_dir = args.img_dir or args.doc.parent / "img"
    text = args.doc.read_text()
    paths = args.results or named_sources(text)
    missing = [str(path) for path in paths if not path.is_file()]
    if missing:  # a marker's path is read from the current folder: run from the repository's root
        raise SystemExit(f"dynbatch-bench report: no such results file: {', '.join(missing)}")
    # Markers and arguments name a file by paths that may differ (./docs/..., absolute).
    runs = {path.resolve(): load(path) for path in paths}

    def render(source: Path, part: str | None) -> str | None:
        run = runs.get(source.resolve())
        if run is None:
            return None  # a block of a file not given stays as it is
        if isinstance(run, str):
            return markdown_block(run, source, part)
        results = part_of(run, part)
        return doc_block(results, image_links(results, source, img_dir, args.doc))

    text, done = regenerate(text, render)
    args.doc.write_text(text)
    for source, part in dict.fromkeys(done):
        run = runs[source.resolve()]
        skip_plots = args.no_plots or isinstance(run, str)  # a .md file has no plots
        drawn = [] if skip_plots else _draw(part_of(run, part), source, img_dir)
        print(f"{args.doc}: {source}{' ' + part if part else ''}" + "".join(f"\n  {path}" for path in drawn))
    shown = {source.resolve() for source, _ in done}
    for path in paths:
        if path.resolve() not in shown:
            print(f"{args.doc}: no block shows {path}; add its markers where it belongs", file=sys.stderr)
    return 0


def _draw(results: dict[str, Any], source: Path, img_dir: Path) -> list[Path]:
    from . import plots

    img_dir.mkdir(parents=True, exist_ok=True)
    return [draw(image_path(img_dir, source, figure)) for figure, draw in plots.figures(results).items()]
