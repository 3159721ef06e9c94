"""AOTAutograd's node, as a region's backward meets it: found, called, routed.

A region (region.py) whose outputs come from one AOTAutograd ``CompiledFunction``
call over the graph's own arguments can answer a plain backward by that node's
backward alone, and can hand the node to the caller's graph, its class's backward
routed to dynbatch's paths for create_graph and batched grads (NOTE [AOTAutograd's
node in the caller's graph] in region.py).  This module holds what that takes of
autograd's and AOTAutograd's runtime: which node made a set of outputs, a node's
backward run as the engine would run it, and the class's backward replaced once.

Region logic, not a version shim, so it lives here rather than in ``_compat``; it
reads AOTAutograd's ``CompiledFunction`` classes (``_forward_cls``, ``metadata``) and
autograd nodes' ``_input_metadata`` and ``variable`` itself.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

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
