"""Stage 2: the batching pass, a plain function from FX graph to FX graph.

It finds every ``torch.autograd.grad(..., is_grads_batched=True)`` call and
points it at :func:`dynbatch.batched_grad.batched_grad`, the functorch-based
rule.  Nothing else changes, so when AOTAutograd traces the new graph the
backward is traced once, under vmap's batching rules, with B symbolic.

Invariants (like Inductor's fx_passes/README.md):
- the input graph module is never mutated; the result is a copy;
- a grad call is rewritten only if capture recorded no eager error for it
  (NOTE [Errors are eager's] in capture.py); otherwise the whole graph is
  reported unsupported and the backend falls back;
- unbatched grads are left alone: AOTAutograd traces them as they are.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx

from . import _compat, fx_utils, requires_grad_tracing
from .batched_grad import batched_grad
from .capture import TRACE_ERROR, UNSUPPORTED


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


def batch_grads(gm: torch.fx.GraphModule) -> BatchingResult:
    """Rewrite batched grad calls in a copy of ``gm``; report what could not be."""
    if requires_grad_tracing.leaks_traced_requires_grad(gm):
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
            node.target = batched_grad
            node.meta[_compat.GRAD_NODE_META] = node.name  # how the memory plan names it
            batched.append(node.name)
        else:
            plain.append(node.name)
    if unsupported:
        # The caller falls back on the original graph; don't hand out a half-rewritten one.
        return BatchingResult(gm, (), tuple(plain), tuple(unsupported))
    new_gm.recompile()
    return BatchingResult(new_gm, tuple(batched), tuple(plain), ())
