"""A ``torch.autograd.Function`` in a dynbatch graph differentiates as eager's does.

Dynamo traces ``Fn.apply`` into the ``autograd_function_apply`` higher-order op, with
the forward and the backward as graphs of their own; AOTAutograd inlines both.  Two
things kept a Function's second derivative from being eager's (NOTE [Functions
differentiate as in eager]):
- Dynamo traces the backward under ``no_grad``, so its result is never differentiated:
  the second derivative through a Function came out zero, silently.  Inside the capture
  scope the backward is traced in the grad mode it runs in, as eager runs it
  (``dynamo_traces_backwards_in_their_grad_mode``); a ``once_differentiable`` backward
  stays a graph break, so the Function runs eagerly and a second derivative raises
  eager's error;
- Dynamo cannot trace the op itself, which the programs dynbatch compiles from a
  region's graph (a vjp, the forward that returns its grads) meet: ``with_functions_applied``
  turns each such node back into the ``Fn.apply`` call Dynamo traces.
Capture-stage logic beside capture/grad_calls.py, which enters the patch; like its
other hooks it reaches into Dynamo's classes and fails soft as a whole.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.fx

from .. import fx_utils


# NOTE [Functions differentiate as in eager]
# Eager runs a Function's backward in the engine's grad mode, ``create_graph``:
# a backward written in differentiable ops gives a differentiable grad, so
# Hessians, force training and every higher order go through it.  Dynamo traces
# the backward with grad disabled ("TODO - revisit if we need enable_grad" in
# its AutogradFunctionApplyVariable), which is right for the one first-order
# backward AOTAutograd compiles and wrong for every grad dynbatch takes with
# create_graph=True: inside a graph, AOTAutograd traces such a grad by running
# the op's backward, and a no_grad backward leaves the second derivative
# unconnected (zeros where materialised).  Traced in the ambient grad mode, the
# backward graph's ops carry no grad mode of their own and run in the mode the
# engine gives them: AOTAutograd's first-order backward (grad off) is the same
# graph as stock's, a create_graph grad (grad on) differentiates the backward
# as written.  A ``once_differentiable`` backward is the exception: eager raises
# when its grads are differentiated, through a DelayedError node that Dynamo
# cannot trace.  Tracing it under no_grad would return a grad that is silently
# constant, so it graph-breaks instead and the Function runs as eager runs it.
# So does a Function whose backward applies another Function: traced in grad
# mode, the inner one is an ``autograd_function_apply`` op too, which a batched
# backward then runs under vmap, and the op's own Function has no vmap rule
# (stock inlined the inner forward, whose derivative is not the inner backward).

@contextlib.contextmanager
def dynamo_traces_backwards_in_their_grad_mode() -> Iterator[None]:
    """Inside the capture scope, Dynamo traces a Function's backward in the grad mode
    it runs in, and graph-breaks on a ``once_differentiable`` one (NOTE [Functions
    differentiate as in eager])."""
    from torch._dynamo.exc import unimplemented
    from torch._dynamo.variables import higher_order_ops

    cls = higher_order_ops.AutogradFunctionApplyVariable
    original_call, original_trace = cls.call_function, cls.trace_backward_graph
    speculate = higher_order_ops.speculate_subgraph_with_auto_output_flattening

    def runs_eagerly(self, why):
        unimplemented(gb_type=f"dynbatch: an autograd.Function whose backward {why}", context=str(self.bwd_fn),
                      explanation="it runs eagerly, so every derivative through it is eager's", hints=[])

    def call_function(self, tx, args, kwargs):
        if is_once_differentiable(self.bwd_fn):
            runs_eagerly(self, "is once_differentiable")
        return original_call(self, tx, args, kwargs)

    def in_their_grad_mode(*args, **kwargs):
        if kwargs.get("enable_grad") is False:
            kwargs["enable_grad"] = None
        return speculate(*args, **kwargs)

    def trace_backward_graph(self, *args, **kwargs):
        # The backward's speculation is the only call of it whose grad mode is False.
        higher_order_ops.speculate_subgraph_with_auto_output_flattening = in_their_grad_mode
        try:
            traced = original_trace(self, *args, **kwargs)
        finally:
            higher_order_ops.speculate_subgraph_with_auto_output_flattening = speculate
        if traced[2].find_nodes(op="call_function", target=_HOP):
            runs_eagerly(self, "applies another Function")
        return traced

    cls.call_function, cls.trace_backward_graph = call_function, trace_backward_graph
    try:
        yield
    finally:
        cls.call_function, cls.trace_backward_graph = original_call, original_trace


def is_once_differentiable(backward: Any) -> bool:
    """Whether ``backward`` is wrapped by ``torch.autograd.function.once_differentiable``."""
    fn = getattr(backward, "__func__", backward)
    return getattr(fn, "__code__", None) is _ONCE_DIFFERENTIABLE_CODE


_ONCE_DIFFERENTIABLE_CODE = torch.autograd.function.once_differentiable(lambda ctx: None).__code__


def with_functions_applied(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` where each ``autograd_function_apply`` node calls the Function that its
    forward and backward graphs make: the same values and derivatives, in code Dynamo
    can trace again.  ``gm`` itself where it has none."""
    if not gm.graph.find_nodes(op="call_function", target=_HOP):
        return gm
    new = fx_utils.copy_graph_module(gm)
    for node in new.graph.find_nodes(op="call_function", target=_HOP):
        fwd, bwd, *args = node.args
        function = _function_of(getattr(new, fwd.target), getattr(new, bwd.target),
                                **{k: tuple(node.kwargs.get(k, ())) for k in _HOP_KWARGS})
        node.target, node.args, node.kwargs = _applier(function), tuple(args), {}
        for graph_attr in (fwd, bwd):
            if not graph_attr.users:  # only the op read it; nothing else is removed
                new.graph.erase_node(graph_attr)
    new.recompile()
    return new


_HOP = torch.ops.higher_order.autograd_function_apply
_HOP_KWARGS = ("non_differentiable_idx", "saved_for_backward_idx", "dirty_idx")


def _applier(function: type):
    def apply_function(*args: Any) -> Any:
        return function.apply(*args)

    return apply_function


def _function_of(fwd: torch.fx.GraphModule, bwd: torch.fx.GraphModule, *, non_differentiable_idx: tuple = (),
                 saved_for_backward_idx: tuple = (), dirty_idx: tuple = ()) -> type:
    """The Function ``autograd_function_apply(fwd, bwd, ...)`` runs (the op makes its own at
    each call, which Dynamo cannot trace): the forward graph returns the outputs and the
    saved values, the backward graph takes the grads and the saved values.  What the
    user's forward saved with ``save_for_backward`` is saved so again (autograd checks it
    for in-place writes), what it kept on ``ctx`` stays there."""

    class FromGraphs(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *args):
            outputs, saved = fwd(*args)
            ctx.save_for_backward(*(s for i, s in enumerate(saved) if i in saved_for_backward_idx))
            ctx.kept = tuple(s for i, s in enumerate(saved) if i not in saved_for_backward_idx)
            ctx.n_saved = len(saved)
            if dirty_idx:
                ctx.mark_dirty(*(o for i, o in enumerate(outputs) if i in dirty_idx))
            if non_differentiable_idx:
                ctx.mark_non_differentiable(*(o for i, o in enumerate(outputs) if i in non_differentiable_idx))
            return outputs

        @staticmethod
        def backward(ctx, *grads):
            tensors, kept = iter(ctx.saved_tensors), iter(ctx.kept)
            saved = [next(tensors) if i in saved_for_backward_idx else next(kept) for i in range(ctx.n_saved)]
            return bwd(*grads, *saved)

    return FromGraphs
