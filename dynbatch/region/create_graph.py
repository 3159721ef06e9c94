"""A region's backward with ``create_graph=True``: grads that autograd can differentiate again.

Three answers, tried in order: the grads computed at forward time, scaled by the
cotangent (NOTE [Forces at forward time]); the program's vjp, itself a compiled
program (NOTE [Compiled create_graph] in region/program.py); the program re-run
eagerly and differentiated by eager autograd, where the compiled vjp does not
apply.  A graph that draws random numbers cannot be re-run, and says so.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from .. import _compat
from ..records import STATS
from .args import select, spread, why_run_eagerly

log = logging.getLogger("dynbatch")

# Counter names (dynbatch.counters()): a create_graph backward answered by the compiled vjp,
# by the grads computed at forward time, or (also batched grads paths.py cannot
# compile) by the program re-run eagerly.
VJP, FORWARD_GRADS, EAGER = "outside_vjp_compiled", "outside_grads_at_forward", "outside_eager"


def create_graph_backward(program, inputs, others, out_grads, needed, batching):
    """``create_graph=True``: the compiled vjp where it applies, else the eager re-run."""
    program.refuse_rerun_if_random()
    reason = why_vjp_runs_eagerly(batching, inputs, out_grads)
    if reason is None:
        grads = _from_a_forward_with_grads(program, inputs, others, out_grads, needed)
        if grads is not None:
            STATS.count(FORWARD_GRADS)
            return grads
        grads = program.compiled_backward(inputs, others, out_grads, needed, batched=False)
        if grads is not None:
            STATS.count(VJP)
            return grads
        reason = "its compiled vjp failed"
    program.log_once(f"create_graph: {reason}", "dynbatch: create_graph=True through a compiled graph: "
                     "re-running it eagerly for a differentiable backward (%s)", reason)
    STATS.count(EAGER)
    return program.eager_backward(inputs, others, out_grads, needed, create_graph=True)


def why_vjp_runs_eagerly(batching, inputs, out_grads) -> str | None:
    """A compiled vjp sees plain tensors only (as a region's forward does)."""
    if batching is not None:
        return f"the grads are batched ({batching.kind} vmap)"
    if _compat.functorch_transform_active():
        return "a torch.func transform is active"
    return why_run_eagerly([*inputs, *(g for _, g in out_grads)])


# NOTE [Forces at forward time]
# Force-field training takes F = -dE/dpos with create_graph=True outside the
# compiled model, then differentiates a loss of E and F.  Answering with the
# compiled vjp costs the forward twice and two compiled backwards (the model's,
# for E, and the vjp's, for F).  A vjp is linear in its cotangent, so for an
# output of one element it is that cotangent times the vjp of ones.  Once a
# create_graph backward has asked a region for the grads of such an output, the
# region's later forwards run one program that returns the outputs and those
# grads (for a cotangent of ones), and the create_graph backward returns them
# scaled: they are outputs of the same autograd node as E, so the loss's
# backward reaches that node once, with grads for E and F together, and runs
# one compiled backward -- the structure of the whole step compiled.  A
# backward that does not match (another output, other inputs, or a plain
# backward that leaves the grads unused) takes the general paths, and the
# region stops computing grads at forward time until asked again.

def with_grads_of(program: Callable, index: int, needed: tuple[bool, ...]) -> Callable:
    """The forward that also returns output ``index``'s grads w.r.t. the ``needed``
    inputs, for a cotangent of ones (``Region.learn_grads_at_forward``)."""
    def forward_with_grads(inputs, others):
        outs = program(inputs, others)
        grads = torch.autograd.grad(outs[index], select(inputs, needed), torch.ones_like(outs[index]),
                                    create_graph=True, allow_unused=True)
        return (*outs, *grads)

    return forward_with_grads


def _from_a_forward_with_grads(program, inputs, others, out_grads, needed):
    """The first create_graph backward of a region's one-element output: the forward that
    returns its grads (NOTE [Forces at forward time]), re-run now on the saved inputs, its
    grads scaled.  The region's later forwards run the same program, so the batched grads of
    those grads (a Hessian's rows) take the same programs at every call: nothing compiles
    twice.  None where it does not apply (the compiled vjp answers)."""
    region = program.region
    with_grads = region.learn_grads_at_forward(out_grads, needed) if region is not None else None
    if with_grads is None:
        return None
    try:
        if with_grads.grads_ignore is None:
            with_grads.grads_ignore = _inputs_the_grads_ignore(with_grads, inputs, others)
        outs = with_grads(inputs, program._for_a_recompute(others), others)
    except Exception as e:  # noqa: BLE001 - the compiled vjp or the eager path is always right
        log.warning("dynbatch: compiling a forward that returns its grads failed, using the vjp instead: "
                    "%s: %s", type(e).__name__, e)
        with_grads.failed, region.with_grads = f"{type(e).__name__}: {e}", None
        return None
    _, computed, first = with_grads.linear
    scale = out_grads[0][1].reshape(())
    return tuple(None if g is None else g * scale for g in spread(outs[first:], computed))


def _inputs_the_grads_ignore(with_grads, inputs, others) -> tuple[bool, ...]:
    """Per input, does no grad output of ``with_grads`` depend on it?  AOTAutograd's backward
    of the forward that returns E and its grads materializes E's missing cotangent as zeros,
    so an input only E depends on (a last bias, for forces) would get a zero grad where eager
    gets None; its node answers None for those (``_ProgramFunction.backward``).  Read once,
    from one eager run of the program and a grad of its grads."""
    _, computed, first = with_grads.linear
    leaves = [t.detach().requires_grad_(t.requires_grad) for t in inputs]
    with torch.enable_grad():
        grads = [g for g in with_grads.python(leaves, with_grads._for_a_recompute(others))[first:]
                 if g is not None and g.requires_grad]
        wanted = [t for t in leaves if t.requires_grad]
        if not grads or not wanted:
            return tuple(True for _ in leaves)
        reached = iter(torch.autograd.grad(grads, wanted, [torch.ones_like(g) for g in grads], allow_unused=True))
    return tuple(next(reached) is None if t.requires_grad else True for t in leaves)


def grads_from_forward(program, out_grads, needed, batching, forward_grads):
    """The create_graph backward from the grads computed at forward time, or None."""
    index, computed, _ = program.linear
    if (not torch.is_grad_enabled() or len(out_grads) != 1 or out_grads[0][0] != index
            or any(n and not c for n, c in zip(needed, computed))):
        return None
    if why_vjp_runs_eagerly(batching, (), out_grads) is not None:
        return None
    STATS.count(FORWARD_GRADS)
    scale = out_grads[0][1].reshape(())
    return tuple(g * scale if n and g is not None else None
                 for n, g in zip(needed, spread(forward_grads, computed)))
