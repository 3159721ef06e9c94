"""PNG figures of the results, drawn with matplotlib's Agg backend (no display needed).

- ``time_vs_batch.png``: steady-state median time against B, one panel per workload;
- ``compile_vs_batch.png``: first-call time (compile included) against B, same panels;
- ``speedup.png``: each column's speedup over ``eager_batched``, per case.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from .report import REFERENCE, columns, figure, ok

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
                  with_floor: bool = False) -> Path:
    """One panel per workload: ``key`` against B, a line per (column, problem)."""
    plt = _pyplot()
    cols = columns(results)
    colors = _colors(cols)
    groups = _by_workload(results)
    fig, axes = _panels(len(groups))
    for ax, (workload, problems) in zip(axes, groups.items()):
        for p_index, problem in enumerate(problems):
            marker = MARKERS[p_index % len(MARKERS)]
            for v in cols:
                points = [(c["batch"], figure(c, v, key)) for c in problem["cases"]]
                points = [(b, y) for b, y in points if y is not None]
                if points:
                    ax.plot(*zip(*points), marker=marker, color=colors[v], label=v if p_index == 0 else None)
            if with_floor:
                floor = [(c["batch"], c["floor"]["median_s"]) for c in problem["cases"]
                         if c.get("floor", {}).get("median_s")]
                if floor:
                    ax.plot(*zip(*floor), linestyle="--", color="black", marker=marker,
                            label="floor" if p_index == 0 else None)
        names = ", ".join(f"{MARKERS[i]} {p['problem']}" for i, p in enumerate(problems)) if len(problems) > 1 else ""
        ax.set_title(workload + (f"\n{names}" if names else ""), fontsize=9)
        ax.set_xscale("log", base=2)
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
    fig.legend(handles, labels, loc="lower center", ncol=min(8, len(labels)), fontsize=8)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.06, 1, 0.97))
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
    from matplotlib.ticker import FuncFormatter, NullFormatter

    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}×"))
    ax.xaxis.set_minor_formatter(NullFormatter())  # minor labels overlap on a short log axis
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("speedup over eager is_grads_batched (eager_batched time / column time; log scale)")
    ax.grid(True, axis="x", which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(results: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    device = results["meta"]["device_name"]
    return {
        "time_vs_batch": against_batch(results, "median_s", "median time per call (s)",
                                       f"Steady-state time vs batch size — {device}",
                                       out_dir / "time_vs_batch.png", with_floor=True),
        "compile_vs_batch": against_batch(results, "first_call_s", "first call (s)",
                                          f"First call, compile included, vs batch size — {device}",
                                          out_dir / "compile_vs_batch.png"),
        "speedup": speedup(results, out_dir / "speedup.png"),
    }
