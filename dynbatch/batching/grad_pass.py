"""Stage 2: the batching pass, a plain function from FX graph to FX graph.

It finds every ``torch.autograd.grad(..., is_grads_batched=True)`` call and
points it at :func:`dynbatch.batching.batched_grad.batched_grad`, the functorch-based
rule.  Nothing else changes, so when AOTAutograd traces the new graph the
backward is traced once, under vmap's batching rules, with B symbolic.

Invariants (like Inductor's fx_passes/README.md):
- the input graph module is never mutated; the result is a copy;
- a grad call is rewritten only if capture recorded no eager error for it
  (NOTE [Errors are eager's] in capture/grad_calls.py); otherwise the whole graph is
  reported unsupported and the backend falls back;
- unbatched grads are left alone: AOTAutograd traces them as they are, except
  a grad whose only batched arguments are its cotangents, under ``torch.vmap``
  (NOTE [Grads under torch.vmap]).

NOTE [Grads under torch.vmap]
``torch.vmap(vjp)(basis)`` with ``vjp = lambda v: grad(out, x, v)`` is a batched
grad spelt another way (MACE's Hessian, torch.func users' Jacobians).  Traced
as it is, functorch batches the backward too, but the grad is not one of
dynbatch's batched grads, so the memory plan cannot see or chunk it.  When the
grad's outputs, inputs and the cotangents' unbatched values depend on no
vmapped tensor, it is rewritten into ``grad(out, x, V, is_grads_batched=True)``
on the cotangents' physical tensors (batch dim first), and its results are
batched again at the vmap's level for the rest of the mapped function.  The
values are the same; the grad now has a memory plan.  Capture traces such a
vmap in one call even where the user gave a ``chunk_size`` (capture/grad_calls.py).
"""

from __future__ import annotations

import dataclasses
import inspect
import operator
from typing import Any

import torch
import torch.fx

from .. import _compat, fx_utils
from .batched_grad import batched_grad

# node.meta keys that capture (stage 1) leaves on grad calls it could not trace; owned
# by the pass, which reports them, so that capture imports the pass and not the reverse.
# The "Type: message" this grad call raised while traced.
TRACE_ERROR = "dynbatch_trace_error"
# Why this grad call must run eagerly although eager would not raise.
UNSUPPORTED = "dynbatch_unsupported"


_GRAD_SIGNATURE = inspect.signature(torch.autograd.grad)


@dataclasses.dataclass(frozen=True)
class Unsupported:
    node: str
    reason: str


@dataclasses.dataclass(frozen=True)
class BatchingResult:
    graph_module: torch.fx.GraphModule
    batched: tuple[str, ...]  # names of the grad nodes now batched with functorch
    plain: tuple[str, ...]  # unbatched grad nodes, left as they are
    unsupported: tuple[Unsupported, ...]

    @property
    def modified(self) -> bool:
        return bool(self.batched)


def is_grad_call(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is torch.autograd.grad


def is_batched_grad_call(node: torch.fx.Node) -> bool:
    return is_grad_call(node) and bool(node.kwargs.get("is_grads_batched", False))


def _grad_arguments(node: torch.fx.Node) -> dict | None:
    """A grad call's arguments by name; None where eager would refuse the call."""
    try:
        return _GRAD_SIGNATURE.bind_partial(*node.args, **node.kwargs).arguments
    except TypeError:
        return None


def frees_its_graph(node: torch.fx.Node) -> bool:
    """A grad call that, eagerly, frees the autograd graph it differentiates (neither
    ``retain_graph`` nor ``create_graph``; the batching pass retains it all the same:
    NOTE [A grad that consumes returned tensors] in capture/grad_calls.py)."""
    if not is_grad_call(node):
        return False
    bound = _grad_arguments(node)
    if bound is None:  # not a call eager would accept: assume the worst
        return True
    retain, create = bound.get("retain_graph"), bound.get("create_graph", False)
    return not (retain if retain is not None else create)


def creates_graph(node: torch.fx.Node) -> bool:
    """A grad call with ``create_graph=True``: what it returns is differentiable, so a
    backward through the graph that holds it is a double backward."""
    if not is_grad_call(node):
        return False
    bound = _grad_arguments(node)
    return bound is None or bound.get("create_graph", False) is not False  # unbound: the worst


def batch_grads(gm: torch.fx.GraphModule) -> BatchingResult:
    """Rewrite batched grad calls in a copy of ``gm``; report what could not be."""
    if leaks_traced_requires_grad(gm):
        return BatchingResult(gm, (), (), (Unsupported(
            "output", "it returns a tensor made from a leaf that requires_grad_() created inside the graph, "
                      "with requires_grad (AOTAutograd would drop its autograd state; torch 2.13 graph-breaks)"),))
    new_gm = fx_utils.copy_graph_module(gm)
    batched, plain, unsupported = [], [], []
    for node in new_gm.graph.nodes:
        if not is_grad_call(node):
            continue
        if TRACE_ERROR in node.meta:
            unsupported.append(Unsupported(node.name, f"tracing it raises {node.meta[TRACE_ERROR]}"))
        elif UNSUPPORTED in node.meta:
            unsupported.append(Unsupported(node.name, node.meta[UNSUPPORTED]))
        elif is_batched_grad_call(node):
            _retain_graph(node)
            node.target = batched_grad
            node.meta[_compat.GRAD_NODE_META] = node.name  # how the memory plan names it
            batched.append(node.name)
        else:
            _retain_graph(node)
            plain.append(node.name)
    if unsupported:
        # The caller falls back on the original graph; don't hand out a half-rewritten one.
        return BatchingResult(gm, (), tuple(plain), tuple(unsupported))
    new_gm.recompile()
    return BatchingResult(new_gm, tuple(batched), tuple(plain), ())


def _retain_graph(node: torch.fx.Node) -> None:
    """Trace the grad with ``retain_graph=True``: the graph may return tensors whose autograd
    graph it consumes, which AOTAutograd then differentiates (NOTE [A grad that consumes
    returned tensors] in capture/grad_calls.py)."""
    if len(node.args) > 3:  # retain_graph given by position
        node.args = (*node.args[:3], True, *node.args[4:])
    else:
        node.kwargs = {**node.kwargs, "retain_graph": True}


def _is_add_batch_dim(node: torch.fx.Node) -> bool:
    """``_add_batch_dim(x, in_dim, level)``: how Dynamo's trace of ``torch.vmap`` batches an input."""
    return node.op == "call_function" and getattr(node.target, "__name__", "") == "_add_batch_dim"


def _vmapped_nodes(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The nodes that depend on a tensor ``torch.vmap`` batched (graph order is topological)."""
    vmapped: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if _is_add_batch_dim(node) or any(a in vmapped for a in node.all_input_nodes):
            vmapped.add(node)
    return vmapped


def _as_nodes(x) -> list | None:
    if isinstance(x, torch.fx.Node):
        return [x]
    if isinstance(x, (list, tuple)) and all(isinstance(n, torch.fx.Node) for n in x):
        return list(x)
    return None


def batch_vmapped_grads(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm``, or a copy whose grads under ``torch.vmap`` batched in their cotangents only
    are batched grads before the vmap (NOTE [Grads under torch.vmap])."""
    if not any(is_grad_call(n) and not is_batched_grad_call(n) for n in gm.graph.nodes):
        return gm
    new_gm = fx_utils.copy_graph_module(gm)
    if not vmapped_grads_as_batched(new_gm.graph):
        return gm
    new_gm.recompile()
    return new_gm


def vmapped_grads_as_batched(graph: torch.fx.Graph) -> list[str]:
    """``batch_vmapped_grads`` in place on ``graph``; the new grads' names."""
    vmapped = _vmapped_nodes(graph)  # a rewrite adds only _add_batch_dim nodes, which say so themselves
    rewritten = []
    for node in list(graph.nodes):
        if not is_grad_call(node) or is_batched_grad_call(node) or TRACE_ERROR in node.meta:
            continue
        try:
            args = dict(_GRAD_SIGNATURE.bind(*node.args, **node.kwargs).arguments)
        except TypeError:
            continue
        outputs, inputs, cotangents = (_as_nodes(args.get(k)) for k in ("outputs", "inputs", "grad_outputs"))
        if not (outputs and inputs and cotangents) or len(cotangents) < len(outputs):
            continue
        cotangents = cotangents[: len(outputs)]
        if not all(_is_add_batch_dim(c) and len(c.args) == 3 for c in cotangents):
            continue
        levels = {c.args[2] for c in cotangents}
        values = [c.args[0] for c in cotangents]
        if (len(levels) != 1 or not all(isinstance(v, torch.fx.Node) for v in values)
                or any(n in vmapped or _is_add_batch_dim(n) for n in (*outputs, *inputs, *values))
                or any(u.target is not operator.getitem for u in node.users)):
            continue
        vmap = _enclosing_vmap(node)
        hoisted = _hoistable(vmap, [*outputs, *inputs, *values]) if vmap is not None else None
        if hoisted is None:
            continue
        for n in hoisted:
            vmap.prepend(n)
        rewritten.append(_rewrite_vmapped_grad(graph, node, args, cotangents, levels.pop(), vmap))
    return rewritten


def _enclosing_vmap(node: torch.fx.Node) -> torch.fx.Node | None:
    """The ``_vmap_increment_nesting`` node of the innermost vmap around ``node``."""
    depth = 0
    for n in reversed(list(node.graph.nodes)[: list(node.graph.nodes).index(node)]):
        name = getattr(n.target, "__name__", "") if n.op == "call_function" else ""
        if name == "_vmap_decrement_nesting":
            depth += 1
        elif name == "_vmap_increment_nesting":
            if depth == 0:
                return n
            depth -= 1
    return None


def _hoistable(vmap: torch.fx.Node, roots: list[torch.fx.Node]) -> list[torch.fx.Node] | None:
    """The nodes inside the vmap that ``roots`` need, in graph order, if they can move
    before it: the vmap raises on random ops (randomness="error"), and they write nothing."""
    randomness = vmap.args[1] if len(vmap.args) > 1 else vmap.kwargs.get("randomness")
    if randomness != "error":
        return None
    order = {n: i for i, n in enumerate(vmap.graph.nodes)}
    needed, stack = set(), [r for r in roots if order[r] > order[vmap]]
    while stack:
        n = stack.pop()
        if n in needed:
            continue
        name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
        if n.op not in ("call_function", "call_method") or name.endswith("_") or "setitem" in name:
            return None
        needed.add(n)
        stack.extend(a for a in n.all_input_nodes if order[a] > order[vmap])
    return sorted(needed, key=order.__getitem__)


def _rewrite_vmapped_grad(graph, node, args, cotangents, level, vmap) -> str:
    with graph.inserting_before(vmap):
        physical = []
        for c in cotangents:
            value, in_dim = c.args[0], c.args[1]
            moved = value if in_dim == 0 else graph.call_method("movedim", (value, in_dim, 0))
            if moved is not value:
                moved.meta["example_value"] = _val(value).movedim(in_dim, 0)
            physical.append(moved)
        rest = {k: v for k, v in args.items() if k not in ("outputs", "inputs", "grad_outputs")}
        new = graph.call_function(torch.autograd.grad, (args["outputs"], args["inputs"], tuple(physical)),
                                  {**rest, "is_grads_batched": True})
    new.meta.update({k: v for k, v in node.meta.items() if k != "example_value"})
    batch = _val(physical[0]).shape[0]
    inputs = _as_nodes(args["inputs"])
    used = {u.args[1] for u in node.users if _val(u) is not None}
    new.meta["example_value"] = tuple(
        _val(x).new_empty((batch, *_val(x).shape)) if i in used else None for i, x in enumerate(inputs))
    for user in list(node.users):
        with graph.inserting_before(vmap):
            item = graph.call_function(operator.getitem, (new, user.args[1]))
        item.meta.update(user.meta)
        item.meta["example_value"] = new.meta["example_value"][user.args[1]]
        if _val(user) is None:
            user.replace_all_uses_with(item)
        else:
            with graph.inserting_before(user):
                rebatched = graph.call_function(cotangents[0].target, (item, 0, level))
            rebatched.meta.update(user.meta)
            user.replace_all_uses_with(rebatched)
        graph.erase_node(user)
    graph.erase_node(node)
    for c in dict.fromkeys(cotangents):  # the batched cotangents, now read by nothing
        if not c.users:
            graph.erase_node(c)
    return new.name


def _val(node: torch.fx.Node):
    return node.meta.get("example_value", node.meta.get("val"))


def leaks_traced_requires_grad(gm: Any) -> bool:
    """Does the graph return, with requires_grad, a tensor made from a leaf that
    ``requires_grad_()`` created inside it?  AOTAutograd's functionalization
    drops that autograd state (2.13's Dynamo graph-breaks for it)."""
    # Later nodes read the tensor the method changed in place (its argument), as in user code.
    tainted = {n.args[0] for n in gm.graph.nodes if n.op == "call_method" and n.target == "requires_grad_"}
    if not tainted:
        return False
    for n in gm.graph.nodes:
        if n not in tainted and any(i in tainted for i in n.all_input_nodes):
            tainted.add(n)
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    flat = torch.utils._pytree.tree_leaves(output.args)
    return any(isinstance(o, torch.fx.Node) and o in tainted
               and getattr(o.meta.get("example_value"), "requires_grad", False) for o in flat)
