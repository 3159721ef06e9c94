"""Reading a run's results.json: its cells, columns and figures, for its tables and plots."""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable

from .variants import VARIANTS


def geomean(ratios: list[float]) -> float:
    return math.exp(sum(math.log(r) for r in ratios) / len(ratios))


def ok(cell: dict[str, Any] | None) -> bool:
    return bool(cell) and cell.get("status") == "ok"


def rows(results: dict[str, Any]) -> Iterable[tuple[dict, dict]]:
    """(problem, case) pairs in run order."""
    for problem in results["problems"]:
        for case in problem["cases"]:
            yield problem, case


def columns(results: dict[str, Any]) -> list[str]:
    chosen = results["meta"].get("variants") or list(VARIANTS)
    return [v for v in VARIANTS if v in chosen]


def figure(case: dict[str, Any], variant: str, key: str) -> float | None:
    cell = case["variants"].get(variant)
    return cell.get(key) if ok(cell) else None


def same_memory_method(meta: dict[str, Any]) -> Callable[[dict], bool]:
    """Cells whose peak memory was measured the run's way (JAX's sampled RSS is not comparable)."""
    return lambda cell: cell.get("mem_method", meta["memory_method"]) == meta["memory_method"]
