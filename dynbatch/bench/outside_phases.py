"""A grad taken outside a compiled model, split into phases: ``bench overhead``'s second table.

``OutsideSplit`` times each ``dynbatch_outside`` call's phases (NOTE [An outside call,
phase by phase]); ``phase_text`` and ``phase_summary`` show its rows, as ``overhead``
prints them and as ``report`` shows the ``outside_phases`` that ``overhead --out`` kept.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator

from .cells import geomean
from .measure import fmt_us, median_us


# NOTE [An outside call, phase by phase]
# ``dynbatch_outside`` times the compiled model's forward and the is_grads_batched grad
# taken around it (variants.outside_program).  Each of its calls is cut at the compiled
# model's calls (``OptimizedModule.__call__``) and at dynbatch's backward, the routed
# AOTAutograd node's (``direct.Direct.backward``) or the program node's
# (``program._ProgramFunction.backward``), outermost only:
# - forward: the model's compiled forward with Dynamo's frame (per chunk, for a workload
#   that takes its cotangents in chunks);
# - torch's grad: the rest of the call less dynbatch's backward: torch.autograd.grad's own
#   checks (``_make_grads``), the legacy vmap's wrapping and unwrapping, the engine,
#   AOTAutograd's node, the few lines of the routed backward before Direct.backward, and the
#   workload's own lines around them (a leaf made of the input; chunks concatenated);
# - dynbatch's backward: dynbatch's plumbing, less the Inductor programs it runs;
# - backward programs: those programs (the batched backward from the saved activations or
#   the recompute path's program), Inductor's wrapper and kernels.
# Medians of each call's own phases (a median of differences, not a difference of medians);
# ``inside``: the ``dynbatch`` column's median where it ran beside, the same grad compiled
# with the model.  Torch's share is what any backend's node pays; dynbatch's is what
# dynbatch can cut.

class OutsideSplit:
    """Each ``dynbatch_outside`` call's phases (NOTE [An outside call, phase by phase])."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, ...]] = []  # (whole, forward, torch's, dynbatch's, programs) per call
        self._call: dict[str, float] | None = None  # the call being timed: its stamps and sums
        self._depth = 0  # 1 while dynbatch's backward runs (a backward may reach another)
        self._in_program = False  # an Inductor program runs (a chunked one calls others)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        from torch._dynamo.eval_frame import OptimizedModule
        from torch._inductor.output_code import CompiledFxGraph

        from dynbatch.region import direct
        from dynbatch.region import program as region_program

        def forward(real: Callable[..., Any]) -> Callable[..., Any]:
            """The compiled model's call (an OptimizedModule's): its seconds."""
            def run(*args, **kwargs):
                if self._call is None or self._depth:
                    return real(*args, **kwargs)
                start = time.perf_counter()
                try:
                    return real(*args, **kwargs)
                finally:
                    self._call["forward"] = self._call.get("forward", 0.0) + time.perf_counter() - start

            return run

        def backward(real: Callable[..., Any]) -> Callable[..., Any]:
            """dynbatch's backward: its outermost calls' seconds."""
            def run(*args, **kwargs):
                if self._call is None or self._depth:
                    return real(*args, **kwargs)
                self._depth = 1
                start = time.perf_counter()
                try:
                    return real(*args, **kwargs)
                finally:
                    self._call["dynbatch"] = self._call.get("dynbatch", 0.0) + time.perf_counter() - start
                    self._depth = 0

            return run

        def program(real: Callable[..., Any]) -> Callable[..., Any]:
            """An Inductor program that dynbatch's backward runs: its outermost calls' seconds."""
            def run(*args, **kwargs):
                if self._call is None or not self._depth or self._in_program:
                    return real(*args, **kwargs)
                self._in_program = True
                start = time.perf_counter()
                try:
                    return real(*args, **kwargs)
                finally:
                    self._call["programs"] = self._call.get("programs", 0.0) + time.perf_counter() - start
                    self._in_program = False

            return run

        # Not torch.autograd.grad: the dynbatch column's program traces it, and Dynamo would
        # compile that program again for a wrapper in its place.
        patches = [(OptimizedModule, "__call__", forward(OptimizedModule.__call__)),
                   (direct.Direct, "backward", backward(direct.Direct.backward)),
                   (region_program._ProgramFunction, "backward",
                    staticmethod(backward(region_program._ProgramFunction.backward))),
                   (CompiledFxGraph, "__call__", program(CompiledFxGraph.__call__))]
        saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in patches]
        try:
            for owner, name, new in patches:
                setattr(owner, name, new)
            yield
        finally:
            for owner, name, old in saved:
                setattr(owner, name, old)

    def whole(self, call: Callable[[], Any]) -> Callable[[], Any]:
        def run():
            self._call = stamps = {}
            start = time.perf_counter()
            try:
                result = call()
            finally:
                self._call = None
            whole = time.perf_counter() - start
            if "forward" in stamps:
                forward, ours, programs = stamps["forward"], stamps.get("dynbatch", 0.0), stamps.get("programs", 0.0)
                self.calls.append((whole, forward, whole - forward - ours, ours - programs, programs))
            return result

        return run

    def row(self, problem: str, case: str, inside_us: float | None) -> dict[str, Any]:
        """This case's medians in microseconds (None: no call reached the grad), beside the
        inside column's median: a row of ``--out``'s ``outside_phases``."""
        medians = [median_us(list(phase)) for phase in zip(*self.calls)] if self.calls else [None] * 5
        return {"problem": problem, "case": case, **dict(zip(PHASE_KEYS, medians)), "inside_us": inside_us}


# An OutsideSplit row's medians, in the order of OutsideSplit.calls' tuples.
PHASE_KEYS = ("whole_us", "forward_us", "torch_us", "dynbatch_us", "programs_us")
PHASE_HEADER = ("problem", "case", "whole us", "forward us", "torch's grad us", "dynbatch's backward us",
                "backward programs us", "inside us", "whole / inside", "less dynbatch's backward / inside")
ONE_MS_US = 1000.0  # from an inside call of 1 ms, a per-call cost should no longer dominate


def phase_ratios(row: dict[str, Any]) -> tuple[float, float] | None:
    """(whole / inside, (whole - dynbatch's backward) / inside): the call, and the call were
    dynbatch's plumbing free (its programs kept), over the grad inside; None: no figures."""
    whole, ours, inside = row["whole_us"], row["dynbatch_us"], row["inside_us"]
    if not whole or not inside or ours is None:
        return None
    return whole / inside, (whole - ours) / inside


def phase_text(row: dict[str, Any]) -> list[str]:
    """A row of ``outside_phases`` as the table shows it (the ratios computed here)."""
    ratios = phase_ratios(row)
    shown = ["–", "–"] if ratios is None else [f"×{r:.2f}" for r in ratios]
    return [row["problem"], row["case"], *(fmt_us(row[k]) for k in PHASE_KEYS), fmt_us(row["inside_us"]), *shown]


def phase_summary(rows: list[dict[str, Any]]) -> list[str]:
    """The two ratios' geometric means, and the cases from an inside call of 1 ms over ×1.2."""
    ratios = [(row, r) for row in rows if (r := phase_ratios(row)) is not None]
    if not ratios:
        return []
    large = [(row, r) for row, r in ratios if row["inside_us"] >= ONE_MS_US]
    whole, less = (geomean([r[k] for _, r in ratios]) for k in (0, 1))
    return [f"Over {len(ratios)} case{'s' * (len(ratios) != 1)}, whole / inside: geometric mean ×{whole:.2f}; "
            f"less dynbatch's backward: ×{less:.2f}. "
            f"Of the {len(large)} cases whose inside call takes 1 ms or more, over ×1.2: "
            f"{sum(r[0] > 1.2 for _, r in large)}, and {sum(r[1] > 1.2 for _, r in large)} "
            "less dynbatch's backward."]
