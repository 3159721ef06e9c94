"""Batched grads over an identity, inside a compiled graph, computed by colours.

NOTE [Identity grads by colours]
``functional.jacobian(f, x, vectorize=True)`` and ``functional.hessian`` (and
``is_grads_batched`` over an eye) reach the backend as one batched
``torch.autograd.grad`` of the flattened output w.r.t. a leaf made from an input, with
``create_graph=False``.  With ``dynbatch.sparse`` on, that node becomes one opaque op,
``dynbatch::structured_grad``, over the function that computes the output from the leaf
(a subgraph of the captured graph, the tensors it reads from outside as arguments).  At
run time the op checks that its seeds are the identity and asks compressed.py for the
Jacobian (pattern at the call's values, colours, one batched grad per colour, exact);
other seeds take the same compiled batched grad uncompressed.  The op's inputs are
detached: a grad without ``create_graph`` returns tensors without history, as eager's.
"""

from __future__ import annotations

import itertools
import logging
import operator
import threading
from typing import Any

import torch
import torch.fx

from ..records import STATS
from . import compressed

log = logging.getLogger("dynbatch")

_FUNCTIONS: dict[int, tuple[str, torch.fx.GraphModule, dict[str, Any] | None]] = {}
_KEYS = itertools.count()


@torch.library.custom_op("dynbatch::structured_grad", mutates_args=())
def structured_grad(key: int, seeds: torch.Tensor, x: torch.Tensor, captured: list[torch.Tensor]) -> torch.Tensor:
    kind, fn, options = _FUNCTIONS[key]
    # An op's kernel runs below autograd (its dispatch keys excluded, AOTAutograd's no_grad
    # around a graph without grads), and the derivative this op takes needs autograd: it
    # runs in a thread of its own, whose dispatch state is a fresh thread's.
    result: dict[str, Any] = {}

    def work():
        try:
            result["out"] = _structured_grad(kind, fn, options, seeds, x, captured)
        except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
            result["error"] = e

    thread = threading.Thread(target=work, name="dynbatch-structured-grad")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["out"]


def _structured_grad(kind, fn, options, seeds, x, captured) -> torch.Tensor:
    rows = seeds.shape[0]
    flat = seeds.reshape(rows, -1)
    if flat.shape[1] == rows and torch.equal(flat, torch.eye(rows, dtype=seeds.dtype, device=seeds.device)):
        derivative = compressed.hessian if kind == "hessian" else compressed.jacobian
        return derivative(fn, x, *captured, options=options).reshape(rows, *x.shape).clone()
    products = compressed._programs(fn, options)[kind]
    if kind == "hessian":  # the seeds are over the grad, flattened in x's order
        seeds = seeds.reshape(rows, *x.shape)
    return compressed._products(products, x, seeds, tuple(captured), None).reshape(rows, *x.shape)


@structured_grad.register_fake
def _(key, seeds, x, captured):
    return seeds.new_empty((seeds.shape[0], *x.shape))


def _as_leaf(t: torch.Tensor) -> torch.Tensor:
    # The products' program hands a leaf in (it differentiates w.r.t. it); the pattern's
    # trace hands a plain tensor, and the function's inner grads need a leaf.
    return t if t.requires_grad else t.detach().requires_grad_()


def compress_identity_grads(gm: torch.fx.GraphModule, options: dict[str, Any] | None) -> int:
    """Rewrite each batched grad of one output w.r.t. one leaf, without create_graph,
    into ``dynbatch::structured_grad``, in place; the number rewritten."""
    done = 0
    for node in list(gm.graph.find_nodes(op="call_function", target=torch.autograd.grad)):
        try:
            if _rewrite(gm, node, options):
                done += 1
        except Exception as e:  # noqa: BLE001 - a node we cannot rewrite keeps its batched grad
            log.info("dynbatch: %s kept its batched grad (%s: %s)", node, type(e).__name__, e)
    if done:
        gm.graph.lint()
        gm.recompile()
        STATS.counters["grads_structured"] += done
    return done


def _rewrite(gm: torch.fx.GraphModule, grad: torch.fx.Node, options) -> bool:
    kwargs = grad.kwargs
    if not kwargs.get("is_grads_batched") or kwargs.get("create_graph"):
        return False
    outputs, inputs, seeds = (tuple(a) if isinstance(a, (tuple, list)) else (a,) for a in grad.args[:3])
    if not (len(outputs) == len(inputs) == len(seeds) == 1 and all(isinstance(a, torch.fx.Node)
                                                                    for a in (*outputs, *inputs, *seeds))):
        return False
    (out,), (leaf,), (seed,) = outputs, inputs, seeds
    if not (leaf.op == "call_method" and leaf.target == "detach" and leaf.args[0].op == "placeholder"):
        return False
    if not all(u.op == "call_function" and u.target is operator.getitem and u.args[1] == 0 for u in grad.users):
        return False
    energy = _energy_of(out, leaf)
    kind = "hessian" if energy is not None else "jacobian"
    fn, captured = _function_of(gm, leaf, energy if energy is not None else out)
    key = next(_KEYS)
    _FUNCTIONS[key] = (kind, fn, options)
    with gm.graph.inserting_before(grad):
        x = gm.graph.call_method("detach", (leaf.args[0],))
        args = [gm.graph.call_method("detach", (c,)) for c in captured]
        new = gm.graph.call_function(torch.ops.dynbatch.structured_grad.default, (key, seed, x, args))
    new.meta = dict(next(iter(grad.users)).meta)
    for user in list(grad.users):
        user.replace_all_uses_with(new)
        gm.graph.erase_node(user)
    gm.graph.erase_node(grad)
    return True


_RESHAPES = {"view", "reshape", "flatten", "view_as", "contiguous"}


def _energy_of(out: torch.fx.Node, leaf: torch.fx.Node) -> torch.fx.Node | None:
    """The scalar whose grad w.r.t. ``leaf`` ``out`` is, in x's element order (reshapes,
    a one-tensor stack, the grad's only result), or None: then ``out`` is a Jacobian's."""
    n = out
    while True:
        if n.op == "call_method" and n.target in _RESHAPES:
            n = n.args[0]
        elif n.op == "call_function" and n.target is torch.stack and len(n.args[0]) == 1:
            n = n.args[0][0]
        elif n.op == "call_function" and n.target is operator.getitem and n.args[1] == 0:
            n = n.args[0]
            break
        else:
            return None
    if not (n.op == "call_function" and n.target is torch.autograd.grad and not n.kwargs.get("is_grads_batched")):
        return None
    outputs, inputs = (tuple(a) if isinstance(a, (tuple, list)) else (a,) for a in n.args[:2])
    if len(outputs) != 1 or len(inputs) != 1:
        return None
    wrt = inputs[0]
    while wrt is not leaf and wrt.op == "call_method" and wrt.target in _RESHAPES:
        wrt = wrt.args[0]
    value = outputs[0].meta.get("example_value")
    if wrt is not leaf or not isinstance(value, torch.Tensor) or value.numel() != 1:
        return None
    return outputs[0]


def _function_of(gm: torch.fx.GraphModule, leaf: torch.fx.Node, out: torch.fx.Node):
    """The subgraph from ``leaf`` to ``out`` as a module ``f(x, *captured)``, and the nodes
    it reads from outside (none of which depends on the leaf)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    ancestors, stack = set(), [out]
    while stack:
        n = stack.pop()
        if n in ancestors:
            continue
        ancestors.add(n)
        stack.extend(n.all_input_nodes)
    descendants, stack = set(), [leaf]
    while stack:
        n = stack.pop()
        if n in descendants:
            continue
        descendants.add(n)
        stack.extend(n.users)
    body = sorted((ancestors & descendants) - {leaf}, key=order.__getitem__)
    captured = sorted({a for n in body for a in n.all_input_nodes if a not in descendants}, key=order.__getitem__)
    for c in captured:
        if not isinstance(c.meta.get("example_value"), torch.Tensor):
            raise ValueError(f"the function reads {c}, which is not a tensor")
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    env = {c: graph.placeholder(f"captured_{i}") for i, c in enumerate(captured)}
    env[leaf] = graph.call_function(_as_leaf, (x,))
    for n in body:
        env[n] = graph.node_copy(n, env.__getitem__)
    graph.output(env[out])
    return torch.fx.GraphModule(gm, graph), captured
