"""AOTAutograd's node, as a region's backward meets it: found, called, routed.

A region (region/edge.py) whose outputs come from one AOTAutograd ``CompiledFunction``
call over the graph's own arguments can answer a plain backward by that node's
backward alone (NOTE [AOTAutograd's backward, called directly]), and can hand the
node to the caller's graph, its class's backward routed to dynbatch's paths for
create_graph and batched grads (NOTE [AOTAutograd's node in the caller's graph] in
region/direct.py).  This module holds what that takes of autograd's and
AOTAutograd's runtime: which node made a set of outputs, a node's backward run as
the engine would run it, the class's backward replaced once, and a call of the node
as a program's backward sees it (``AotCall``: which argument is which input, for
region/saved_backward.py).

Region logic, not a version shim, so it lives here rather than in ``_compat``; it
reads AOTAutograd's ``CompiledFunction`` classes (``_forward_cls``, ``metadata``) and
autograd nodes' ``_input_metadata`` and ``variable`` itself.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, NamedTuple, Sequence

import torch


def aot_backward_node(tensors: Sequence[torch.Tensor]) -> Any | None:
    """The backward node of the one AOTAutograd ``CompiledFunction`` call that made
    every tensor in ``tensors``, or None."""
    node = tensors[0].grad_fn if tensors else None
    if node is None or any(t.grad_fn is not node for t in tensors):
        return None
    forward = getattr(type(node), "_forward_cls", None)
    if forward is None or forward.__name__ != "CompiledFunction" or not hasattr(forward, "metadata"):
        return None
    metas = getattr(node, "_input_metadata", None)
    if metas is None or any(m.is_nested_tensor or m.is_cpp_nested_tensor for m in metas):
        return None
    return node


def route_backward(node: Any, router: Callable[[Callable], Callable]) -> type | None:
    """Replace the backward of the autograd.Function class whose node is ``node``
    (AOTAutograd's CompiledFunction, a class per compiled graph) by
    ``router(original)``, once; the class, or None where it has no backward of its own.
    The engine reads ``_forward_cls.backward`` at each call (BackwardCFunction)."""
    forward_cls = getattr(type(node), "_forward_cls", None)
    if forward_cls is None or "backward" not in vars(forward_cls):
        return None
    with _ROUTED:
        if not vars(forward_cls).get("_dynbatch_routed", False):
            forward_cls.backward = staticmethod(router(forward_cls.backward))
            forward_cls._dynbatch_routed = True
    return forward_cls


_ROUTED = threading.Lock()


def call_backward_node(node: Any, grads: dict[int, torch.Tensor]) -> tuple:
    """Run a Python autograd node's backward as the engine would, with ``grads`` by
    output position; its other outputs get zeros, as the engine materialises them
    (AOTAutograd reads only the grads of its differentiable outputs)."""
    args = [grads[i] if i in grads else torch.zeros(m.shape, dtype=m.dtype, device=m.device)
            for i, m in enumerate(node._input_metadata)]
    return node.apply(*args)


def accumulated_tensor(node: Any) -> torch.Tensor | None:
    """The leaf an AccumulateGrad node accumulates into; None for any other node."""
    return getattr(node, "variable", None)


# NOTE [AOTAutograd's backward, called directly]
# Where the inner graph is one AOTAutograd node whose inputs are the leaves
# themselves (a region's usual shape), the plain path calls that node's
# backward itself instead of starting a nested engine over the graph: the
# nested torch.autograd.grad (its Python, a graph task, the capture of each
# leaf) cost about 5 % of a small force-training step.  The node is asked as
# the engine would ask it (zeros for outputs without a grad) and frees its saved
# tensors as the engine would let it (it reads the running backward's
# retain_graph).  Any other shape -- a view or another node between a leaf and
# the compiled function -- takes the engine.

def backward_called_directly(inner, outputs, grads, leaves, needed) -> tuple | None:
    """The plain backward of the inner graph by AOTAutograd's node alone, or None
    where the graph is not that one node over the leaves."""
    node = aot_backward_node(list(inner.values()))
    pairs = None if node is None else _arguments_that_are_leaves(node, leaves)
    if pairs is None:
        return None
    by_output: dict[int, torch.Tensor] = {}
    for k, g in zip(outputs, grads):
        nr = inner[k].output_nr
        by_output[nr] = g if nr not in by_output else by_output[nr] + g
    node_grads = call_backward_node(node, by_output)
    result: list[torch.Tensor | None] = [None] * len(leaves)
    for i, target in pairs:
        g = node_grads[i]
        if g is not None and needed[target]:
            result[target] = g if result[target] is None else result[target] + g
    return tuple(result)


def _arguments_that_are_leaves(node: Any, leaves: Sequence[torch.Tensor]) -> list[tuple[int, int]] | None:
    """(argument of the node's forward, leaf) for each argument that requires grad; None
    where one is not a leaf's own accumulator."""
    position = {id(leaf): i for i, leaf in enumerate(leaves)}
    # The node's edges, in order, are those of its forward's arguments that require
    # grad (its other arguments, SymInts included, get no edge): the leaf of each.
    wanted = [i for i, w in enumerate(node.needs_input_grad) if w]
    edges = [edge for edge, _ in node.next_functions if edge is not None]
    targets = [position.get(id(accumulated_tensor(edge))) for edge in edges]
    if len(edges) != len(wanted) or None in targets:
        return None
    return list(zip(wanted, targets))


class AotCall(NamedTuple):
    """One call of AOTAutograd's node as a program's backward sees it (region/saved_backward.py)."""

    node: Any  # the node, which is also its ctx (what its forward saved)
    input_at: tuple[int | None, ...]  # per argument of its forward: the program input it is, if any
    output_nr: dict[int, int]  # the program's output -> the node's output


def aot_call_over_leaves(inner: dict[int, torch.Tensor] | None,
                         leaves: Sequence[torch.Tensor] | None) -> AotCall | None:
    """The inner graph of a program's node as one call of AOTAutograd's node over the
    leaves, or None where it is not that (NOTE [AOTAutograd's backward, called directly])."""
    node = aot_backward_node(list(inner.values())) if inner else None
    pairs = None if node is None else _arguments_that_are_leaves(node, leaves)
    if pairs is None:
        return None
    input_at: list[int | None] = [None] * len(node.needs_input_grad)
    for i, leaf in pairs:
        input_at[i] = leaf
    return AotCall(node, tuple(input_at), {k: t.output_nr for k, t in inner.items()})
