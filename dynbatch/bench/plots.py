"""PNG figures of the results, drawn with matplotlib's Agg backend (no display needed).

- ``time_vs_batch.png``: steady-state median time against B, one panel per workload;
- ``compile_vs_batch.png``: first-call time (compile included) against B, same panels;
- ``memory_vs_batch.png``: peak memory per call against B, same panels, with
  ``dynbatch_budget``'s budget and the memory available drawn as lines;
- ``speedup.png``: each column's speedup over ``eager_batched``, per case;
- ``training.png``: force_training's time per step of each column against N, one
  panel per model.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

from .cells import columns, figure, ok, same_memory_method
from .training import COLUMNS as TRAINING_COLUMNS
from .variants import REFERENCE, TIGHT_BUDGET

MARKERS = "osD^v<>p*h"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    return plt


def _colors(cols: list[str]) -> dict[str, Any]:
    plt = _pyplot()
    cycle = plt.get_cmap("tab10")
    return {v: cycle(i) for i, v in enumerate(cols)}


def _by_workload(results: dict[str, Any]) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    for problem in results["problems"]:
        groups.setdefault(problem["workload"], []).append(problem)
    return groups


def _panels(n: int):
    plt = _pyplot()
    ncols = min(3, n)
    nrows = math.ceil(n / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5 * ncols, 3.6 * nrows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, list(axes.flat[:n])


def against_batch(results: dict[str, Any], key: str, ylabel: str, title: str, path: Path,
                  with_floor: bool = False, scale: float = 1.0, usable=lambda cell: True,
                  levels: tuple[tuple[str, float, str], ...] = ()) -> Path:
    """One panel per workload: ``key`` (times ``scale``) against B, a line per (column, problem).

    Only cells with ``usable(cell)`` and a positive figure are drawn (the axes are
    logarithmic); ``levels`` are (label, y, line style) horizontal lines, drawn on a
    panel whose figures reach a tenth of them (elsewhere they would only squash it).
    """
    plt = _pyplot()
    cols = columns(results)
    colors = _colors(cols)
    groups = _by_workload(results)
    fig, axes = _panels(len(groups))
    for ax, (workload, problems) in zip(axes, groups.items()):
        top = 0.0
        batches = sorted({c["batch"] for problem in problems for c in problem["cases"]})
        for p_index, problem in enumerate(problems):
            marker = MARKERS[p_index % len(MARKERS)]
            for j, v in enumerate(cols):
                points = [(c["batch"], figure(c, v, key)) for c in problem["cases"]
                          if ok(c["variants"].get(v)) and usable(c["variants"][v])]
                points = [(b, y * scale) for b, y in points if y is not None and y > 0]
                if points:
                    # Later columns get smaller markers, so columns with equal figures
                    # (dynbatch and compiled_func often) still both show.
                    ax.plot(*zip(*points), marker=marker, markersize=3 + 0.6 * (len(cols) - j), color=colors[v],
                            label=v if p_index == 0 else None)
                    top = max(top, max(y for _, y in points))
            if with_floor:
                floor = [(c["batch"], c["floor"]["median_s"]) for c in problem["cases"]
                         if c.get("floor", {}).get("median_s")]
                if floor:
                    ax.plot(*zip(*floor), linestyle="--", color="black", marker=marker,
                            label="floor" if p_index == 0 else None)
        for label, y, style in levels:
            if top >= y / 10:
                ax.axhline(y, color="grey", linestyle=style, linewidth=0.9, label=label)
        names = ", ".join(f"{MARKERS[i]} {p['problem']}" for i, p in enumerate(problems)) if len(problems) > 1 else ""
        ax.set_title(workload + (f"\n{names}" if names else ""), fontsize=9)
        ax.set_xscale("log", base=2)
        if len(batches) <= 8:  # few sizes: tick each B the panel ran (log2 ticks may show none)
            from matplotlib.ticker import NullFormatter, NullLocator

            ax.xaxis.set_minor_locator(NullLocator())
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_yscale("log")
        ax.set_xlabel("batch size B")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    for ax in axes[1:]:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    # Legend below the panels, about two entries per inch of width, in as many rows as it needs.
    width, height = fig.get_size_inches()
    ncol = max(1, min(len(labels), int(width / 2.2)))
    fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=8)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, min(0.4, (0.2 * math.ceil(len(labels) / ncol) + 0.15) / height), 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def speedup(results: dict[str, Any], path: Path) -> Path:
    """Horizontal bars: eager_batched time over each column's time, per case (log scale)."""
    plt = _pyplot()
    colors = _colors(columns(results))
    cases = [(p, c) for p in results["problems"] for c in p["cases"] if ok(c["variants"].get(REFERENCE))]
    cols = [v for v in columns(results) if v != REFERENCE and any(figure(c, v, "median_s") for _, c in cases)]
    fig, ax = plt.subplots(figsize=(9, 0.11 * max(1, len(cols)) * max(1, len(cases)) + 1.5))
    height = 0.8 / max(1, len(cols))
    for j, v in enumerate(cols):
        ys, xs = [], []
        for i, (_, case) in enumerate(cases):
            value = figure(case, v, "median_s")
            if value:
                ys.append(i + j * height)
                xs.append(figure(case, REFERENCE, "median_s") / value)
        ax.barh(ys, xs, height=height, color=colors[v], label=v)
    ax.set_yticks([i + 0.4 - height / 2 for i in range(len(cases))])
    ax.set_yticklabels([f"{p['problem']} {c['label']}" for p, c in cases], fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    # 1-2-5 steps, each labelled: a short log axis would otherwise label only 1×
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}×"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("speedup over eager is_grads_batched (eager_batched time / column time; log scale)")
    ax.grid(True, axis="x", which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def training(results: dict[str, Any], path: Path) -> Path:
    """force_training: time per step against N, a line per column, a panel per model."""
    plt = _pyplot()
    problems = results["training"]
    cols = list(TRAINING_COLUMNS)
    colors = _colors(cols)
    fig, axes = _panels(len(problems))
    for ax, problem in zip(axes, problems):
        for k, v in enumerate(cols):
            points = [(int(c["label"].split()[0][2:]), figure(c, v, "median_s")) for c in problem["cases"]]  # "N=64 ..."
            points = [(n, t) for n, t in points if t]
            if points:
                ax.plot(*zip(*points), marker=MARKERS[k % len(MARKERS)], color=colors[v], label=v)
        ax.set_xscale("log")
        ax.set_yscale("log")
        sizes = [int(c["label"].split()[0][2:]) for c in problem["cases"]]
        ax.set_xticks(sizes, [str(n) for n in sizes], minor=False)
        ax.set_xticks([], minor=True)
        ax.set_title(problem["problem"], fontsize=9)
        ax.set_xlabel("atoms N")
        ax.set_ylabel("time per training step (s)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"Training with forces — {results['meta']['device_name']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def figures(results: dict[str, Any]) -> dict[str, Callable[[Path], Path]]:
    """The figures ``results`` has data for: name -> a function that draws it into a path.

    Naming them apart from drawing lets ``report`` link a figure without matplotlib.
    """
    device = results["meta"]["device_name"]
    found: dict[str, Callable[[Path], Path]] = {}
    if results["problems"]:
        found["time_vs_batch"] = lambda path: against_batch(
            results, "median_s", "median time per call (s)", f"Steady-state time vs batch size — {device}", path,
            with_floor=True)
        found["compile_vs_batch"] = lambda path: against_batch(
            results, "first_call_s", "first call (s)", f"First call, compile included, vs batch size — {device}",
            path)
        found["memory_vs_batch"] = lambda path: memory_vs_batch(results, path)
        found["speedup"] = lambda path: speedup(results, path)
    if results.get("training"):
        found["training"] = lambda path: training(results, path)
    return found


def write(results: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    return {name: draw(out_dir / f"{name}.png") for name, draw in figures(results).items()}


def memory_vs_batch(results: dict[str, Any], path: Path) -> Path:
    """Peak memory per call against B, with the tight budget and the memory available as lines."""
    meta = results["meta"]
    levels = []
    if "dynbatch_budget" in columns(results):
        levels.append((f"dynbatch_budget's budget ({TIGHT_BUDGET / 2 ** 20:g} MiB)", TIGHT_BUDGET / 2 ** 20, ":"))
    if meta.get("memory_available_at_start"):
        levels.append(("memory available at the start", meta["memory_available_at_start"] / 2 ** 20, "-."))
    return against_batch(results, "peak_mem_bytes", "peak memory per call (MiB)",
                         f"Peak memory vs batch size — {meta['device_name']}", path,
                         scale=1 / 2 ** 20, usable=same_memory_method(meta), levels=tuple(levels))
