"""A region's backward: the path each call takes, and the plain and batched paths.

``backward`` picks the path by what the call receives (NOTE [Region backward] in
region.py; docs/design.md has the table): the grads computed at forward time and
``create_graph=True`` go to region_create_graph.py; plain grads run the inner
graph, AOTAutograd's compiled backward (NOTE [Inner graph's lifetime]); legacy-batched
grads run AOTAutograd's backward graph over the saved activations
(region_saved_backward.py) or, where that is not exact, the program's compiled batched
backward; batched grads loop over the inner graph per sample where the graph draws
random numbers, and re-run the program eagerly where nothing compiled applies.
Called by a program's node (region_program.py) and by AOTAutograd's routed node
(region_direct.py).
"""

from __future__ import annotations

import functools
import time

import torch

from . import _compat
from .records import STATS
from .region_aot_node import aot_call_over_leaves, backward_called_directly
from .region_args import select, spread
from .region_batching import batching_of
from .region_create_graph import EAGER, create_graph_backward, grads_from_forward
from .region_saved_backward import SAVED, batched_grads

# Counter names (dynbatch.counters()): a backward from outside answered by AOTAutograd's
# compiled backward, by the program's compiled batched backward (which recomputes the
# forward), or per sample; region_saved_backward.SAVED counts the saved activations' path.
PLAIN, BATCHED, LOOP = "outside_plain", "outside_batched_compiled", "outside_per_sample"
UNKNOWN = object()  # backward's batching, not yet read from the cotangents


def backward(program, inputs, leaves, others, inner, out_grads, needed, forward_grads, first_grad, call=None,
             batching=UNKNOWN):
    """Pick the path for one backward call (NOTE [Region backward] in region.py).  ``call``:
    AOTAutograd's node that made the outputs, where the caller knows it (region_direct.py);
    otherwise it is found in the inner graph, if that is one such node over the leaves.
    ``batching``: ``batching_of`` the cotangents, where the caller has it already."""
    cotangents = [g for _, g in out_grads]
    if batching is UNKNOWN:
        batching = batching_of(cotangents)
    if program.linear is not None:
        grads = grads_from_forward(program, out_grads, needed, batching, forward_grads)
        if grads is not None:
            return grads
        # Asked for other grads, or a plain backward that left them unused.
        program.missed = program.missed or torch.is_grad_enabled() or all(k < first_grad for k, _ in out_grads)
    if torch.is_grad_enabled():
        return create_graph_backward(program, inputs, others, out_grads, needed, batching)
    if batching is not None and batching.compiled_outside() and not program.random_ops:
        with batching.unwrapped(out_grads, leave_vmap=True) as (physical, batch_size, rewrap):
            grads, counter = _legacy_batched(program, inputs, others, physical, needed, batch_size,
                                             lambda: call or aot_call_over_leaves(inner, leaves))
        if grads is not None:
            STATS.count(counter)
            return rewrap(grads)
    inner_backward = functools.partial(_inner_backward, inner, leaves, [k for k, _ in out_grads], needed)
    if batching is None:
        STATS.count(PLAIN)
        return inner_backward(cotangents)
    if program.random_ops and batching.kind != "nested":
        STATS.count(LOOP)
        return _per_sample(batching, out_grads, inner_backward)
    program.log_once("batched", "dynbatch: batched grads through a compiled graph (%s vmap): "
                     "re-running it eagerly for the backward", batching.kind)
    STATS.count(EAGER)
    return program.eager_backward(inputs, others, out_grads, needed, create_graph=False)


def _legacy_batched(program, inputs, others, physical, needed, batch_size, aot_call) -> tuple:
    """(grads, counter) of a legacy-batched backward: from the saved activations (NOTE
    [Batched grads from the saved activations] in region_saved_backward.py) or the program's
    compiled batched backward, which recomputes the forward; measured where neither is
    always faster (NOTE [Saved or recomputed, measured])."""
    trial = _trial(program, physical, needed, batch_size)
    if trial is None or trial.wants_saved():
        start = time.perf_counter()
        grads = batched_grads(program, aot_call(), physical, needed, batch_size)
        if trial is not None:
            trial.took(SAVED, None if grads is None else time.perf_counter() - start, program)
        if grads is not None:
            return grads, SAVED
    start = time.perf_counter()
    grads = program.compiled_backward(inputs, others, physical, needed, batched=True)
    if trial is not None and grads is not None:
        trial.took(BATCHED, time.perf_counter() - start, program)
    return grads, BATCHED


# NOTE [Saved or recomputed, measured]
# A graph that takes create_graph grads itself (forces in a force field's forward, an HVP's
# gradient) has a double backward for AOTAutograd's backward graph.  Vmapped over the
# cotangents from the saved activations it skips the forward and first backward that the
# recompute path runs again, but it reads every activation the forward saved, where the
# recompute path's program fuses them.  Timed in turn in one process on one core (glibc's
# mmap threshold raised, else its page faults swamp the difference): ×0.84-0.89 of the
# recompute's time on the benchmark's HVPs (K = 8), Laplacian and LJ N = 24, ×0.96-1.00 on its
# Hessian rows and LJ N = 100; ×1.22 on MACE's Hessian rows (one run, glibc as it is).  So such
# a region measures both.  Its first calls
# (per set of grads and B's power of two) take the recompute path, which a one-off call (a
# Hessian computed once) then never leaves: nothing else compiles.  After WARM of them the
# saved activations' program compiles and runs WARM calls; a path's first calls compile it
# and let the product router measure its kernels (matmul_kernels.py), several times a
# product's own time.  Then the two alternate, TIMED calls each, and the faster by its best
# time answers the later calls; where the saved path does not apply, the recompute path
# does.  Timing needs the kernels finished: off the CPU (CUDA's calls return before their
# kernels) the recompute path stays (a synchronizing trial is what the CUDA sync test
# forbids; not measured on a card).
WARM = 2  # untimed calls of each path: its compile, the router's measurements
TIMED = 3  # timed calls of each path, alternating, before the choice


class _Trial:
    """The two batched paths' times for one set of grads and B's power of two, then the choice."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = {SAVED: [], BATCHED: []}
        self.calls = {SAVED: 0, BATCHED: 0}
        self.chosen: str | None = None

    def wants_saved(self) -> bool:
        if self.chosen is not None:
            return self.chosen == SAVED
        if self.calls[BATCHED] < WARM:
            return False
        if self.calls[SAVED] < WARM:
            return True
        return len(self.times[SAVED]) <= len(self.times[BATCHED])

    def took(self, path: str, seconds: float | None, program) -> None:
        """One call of ``path`` took ``seconds`` (None: the saved path did not apply)."""
        if self.chosen is not None:
            return
        if seconds is None:
            self.chosen = BATCHED
            return
        self.calls[path] += 1
        if self.calls[path] > WARM:
            self.times[path].append(seconds)
        if all(len(t) >= TIMED for t in self.times.values()):
            best = {p: min(t) for p, t in self.times.items()}
            self.chosen = min(best, key=best.get)
            program.log_once(f"measured {id(self)}", "dynbatch: batched grads through a graph that takes "
                             "create_graph grads itself: from the saved activations %.3g ms, recomputing its "
                             "forward %.3g ms; taking %s", best[SAVED] * 1e3, best[BATCHED] * 1e3,
                             "the saved activations" if self.chosen == SAVED else "the recompute")


_NOT_TIMED = _Trial()
_NOT_TIMED.chosen = BATCHED  # off the CPU (NOTE [Saved or recomputed, measured])


def _trial(program, physical, needed, batch_size) -> _Trial | None:
    """The trial of this call's set of grads and B, where the program measures its paths."""
    if not program.measure_batched or program.recompute_batched is not None:
        return None
    if any(g.device.type != "cpu" for _, g in physical):
        return _NOT_TIMED
    key = (needed, max(batch_size, 1).bit_length())
    trial = program.batched_choice.get(key)
    if trial is None:  # not setdefault: that builds a _Trial on every call
        trial = program.batched_choice[key] = _Trial()
    return trial


# NOTE [Inner graph's lifetime]
# The plain path runs AOTAutograd's backward of the inner graph, a graph of its
# own, so it has its own retain_graph.  Retaining it always (freed with this
# node) is correct but slow: AOTAutograd keeps its saved tensors through its
# compiled backward, and a small call pays for it (about 90 us of a 1 ms force
# training step).  So the inner graph keeps what the caller's backward keeps:
# freed now unless the caller passed retain_graph=True (or create_graph=True),
# in which case this node survives too and a second backward finds both.

def _inner_backward(inner, leaves, outputs, needed, grads, again: bool = False):
    """The plain path: the inner graph's backward for ``grads`` of ``outputs``.
    ``again``: this backward runs it once more (per-sample grads)."""
    # The inner graph keeps what the caller's graph keeps (NOTE [Inner graph's lifetime]).
    keep = again or _compat.backward_keeps_graph()
    if not again:
        direct = backward_called_directly(inner, outputs, grads, leaves, needed)
        if direct is not None:
            return direct
    return spread(torch.autograd.grad([inner[k] for k in outputs], select(leaves, needed), grads,
                                      retain_graph=keep, allow_unused=True), needed)


def _per_sample(batching, out_grads, grad_fn):
    with batching.unwrapped(out_grads) as (physical, batch_size, rewrap):
        # Eager's vmap refuses B = 0 before any backward runs, so there is a sample.
        per_sample = [grad_fn([g[b] for _, g in physical], again=b < batch_size - 1) for b in range(batch_size)]
        grads = tuple(None if first is None else torch.stack([s[k] for s in per_sample])
                      for k, first in enumerate(per_sample[0]))
    return rewrap(grads)
