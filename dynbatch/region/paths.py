"""A region's backward: the path each call takes, and the plain and batched paths.

``backward`` picks the path by what the call receives (NOTE [Region backward] in
region/edge.py; docs/design.md has the table): the grads computed at forward time and
``create_graph=True`` go to region/create_graph.py; plain grads run the inner
graph, AOTAutograd's compiled backward (NOTE [Inner graph's lifetime]); legacy-batched
grads run AOTAutograd's backward graph over the saved activations
(region/saved_backward.py) or, where that is not exact, the program's compiled batched
backward; batched grads loop over the inner graph per sample where the graph draws
random numbers, and re-run the program eagerly where nothing compiled applies.
Called by a program's node (region/program.py) and by AOTAutograd's routed node
(region/direct.py).
"""

from __future__ import annotations

import functools

import torch

from .. import _compat
from ..records import STATS
from .aot_node import aot_call_over_leaves, backward_called_directly
from .args import select, spread
from .which_vmap import batching_of
from .create_graph import EAGER, create_graph_backward, grads_from_forward
from .saved_backward import COMPILING_ASIDE, SAVED, batched_grads

# Counter names (dynbatch.counters()): a backward from outside answered by AOTAutograd's
# compiled backward, by the program's compiled batched backward (which recomputes the
# forward), or per sample; saved_backward.SAVED counts the saved activations' path.
PLAIN, BATCHED, LOOP = "outside_plain", "outside_batched_compiled", "outside_per_sample"
# ... or eagerly while the program it would run compiles aside (NOTE [Outside paths aside]).
ASIDE = "outside_eager_while_aside"
UNKNOWN = object()  # backward's batching, not yet read from the cotangents


def backward(program, inputs, leaves, others, inner, out_grads, needed, forward_grads, first_grad, call=None,
             batching=UNKNOWN, ran_eagerly=False):
    """Pick the path for one backward call (NOTE [Region backward] in region/edge.py).  ``call``:
    AOTAutograd's node that made the outputs, where the caller knows it (region/direct.py);
    otherwise it is found in the inner graph, if that is one such node over the leaves.
    ``batching``: ``batching_of`` the cotangents, where the caller has it already.
    ``ran_eagerly``: the program's forward ran eagerly, its compile traced aside."""
    cotangents = [g for _, g in out_grads]
    if batching is UNKNOWN:
        batching = batching_of(cotangents)
    if program.linear is not None:
        grads = grads_from_forward(program, out_grads, needed, batching, forward_grads)
        if grads is not None:
            return grads
        # Asked for other grads, or a plain backward that left them unused.
        program.missed = program.missed or torch.is_grad_enabled() or all(k < first_grad for k, _ in out_grads)
    if ran_eagerly:
        return _while_aside(program, inputs, leaves, others, inner, out_grads, needed)
    if torch.is_grad_enabled():
        return create_graph_backward(program, inputs, others, out_grads, needed, batching)
    if batching is not None and batching.compiled_outside() and not program.random_ops:
        with batching.unwrapped(out_grads, leave_vmap=True) as (physical, batch_size, rewrap):
            grads, counter = _legacy_batched(program, inputs, others, physical, needed, batch_size,
                                             lambda: call or aot_call_over_leaves(inner, leaves))
        if grads is not None:
            STATS.count(counter)
            return rewrap(grads)
        if counter == ASIDE:  # its program compiles aside: eager answers meanwhile
            STATS.count(ASIDE)
            return program.eager_backward(inputs, others, out_grads, needed, create_graph=False)
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
    [Batched grads from the saved activations] in region/saved_backward.py) wherever they
    apply, else the program's compiled batched backward, which recomputes the forward.  The
    choice is fixed by the program and the device, before anything compiles (NOTE [One path
    per request])."""
    if not (program.creates_graph and any(g.device.type != "cpu" for _, g in physical)):
        grads = batched_grads(program, aot_call(), physical, needed, batch_size)
        if grads is COMPILING_ASIDE:
            return None, ASIDE
        if grads is not None:
            return grads, SAVED
    return program.compiled_backward(inputs, others, physical, needed, batched=True), BATCHED


# NOTE [Outside paths aside]
# With dynbatch.compile='background' no call waits for a trace (NOTE [Traced aside] in
# capture/traced_aside.py), the outside paths' programs included.  A program compiled by
# Dynamo (a vjp, a forward that returns its grads) is a frame like any other: traced aside,
# its calls run it eagerly meanwhile, and a backward through such a call answers from the
# eager graph that call made (``_while_aside``).  A program of the saved activations is
# compiled aside on a thread of its own (region/saved_backward.py); meanwhile the backward
# re-runs the program eagerly.  Either way nothing else compiles for the request: once the
# program arrives, the request takes the path it would have taken from its first call.

def _while_aside(program, inputs, leaves, others, inner, out_grads, needed):
    """The grads of a call whose forward ran eagerly (its program traced aside): eager's, from
    the graph that forward made, or (create_graph, whose grads must reach the inputs) a re-run."""
    STATS.count(ASIDE)
    if torch.is_grad_enabled():
        return program.eager_backward(inputs, others, out_grads, needed, create_graph=True)
    return _inner_backward(inner, leaves, [k for k, _ in out_grads], needed, [g for _, g in out_grads])


# NOTE [One path per request]
# What a backward receives (plain, batched by eager or by one torch.vmap, create_graph) and
# which grads it asks for decide its program, and its first call compiles it; later calls
# reuse it.  A legacy-batched backward takes the saved activations wherever they apply.  For
# a graph that takes create_graph grads itself (forces in a force field's forward, an HVP's
# gradient) that is the double backward of AOTAutograd's backward graph: it skips the forward
# and first backward that the recompute path runs again, but reads every activation the
# forward saved, where the recompute's program fuses them.  Timed in turn in one process on
# one core (2026-11, the development CPU): x0.84-0.89 of the recompute's time on the
# benchmark's HVPs, Laplacian and LJ N = 24, x0.96-1.00 on its Hessian rows and LJ N = 100,
# x1.22 on MACE's Hessian rows.  An earlier build measured both paths per region and kept
# the faster; that compiled a second program for every such region and changed path on its
# fifth call, for a few percent, so the saved activations answer.  Off the CPU such a graph
# recomputes (the saved double backward was never measured on a card).


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
