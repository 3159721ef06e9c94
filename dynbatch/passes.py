"""Aten-graph passes run before Inductor lowers dynbatch's batched graph."""

from __future__ import annotations

import torch
import torch.fx

from . import _compat

aten = torch.ops.aten


def _is_pointwise(node: torch.fx.Node) -> bool:
    target = node.target
    return (
        node.op == "call_function"
        and isinstance(target, torch._ops.OpOverload)
        and torch.Tag.pointwise in target.tags
        # A random op on B expanded copies draws B samples; computed once it
        # would draw one. Only deterministic ops may move past the expand.
        and torch.Tag.nondeterministic_seeded not in target.tags
    )


def sink_expands(graph: torch.fx.Graph) -> int:
    """op(expand(a, S), expand(b, S), scalars) -> expand(op(a, b, scalars), S), to a fixed point.

    After vmap, the derivative factor of an elementwise op (gelu'(x), tanh'(y), ...) is computed
    on x.expand(B, ...): B times the transcendental work for a value that does not depend on B.
    """
    changed = 0
    for node in list(graph.nodes):
        if not _is_pointwise(node):
            continue
        tensors = [a for a in node.args if isinstance(a, torch.fx.Node)]
        if not tensors or any(a.target is not aten.expand.default for a in tensors):
            continue
        sizes = {tuple(a.args[1]) for a in tensors}
        if len(sizes) != 1:
            continue
        (size,) = sizes
        swap = {a: a.args[0] for a in tensors}
        new_args = tuple(swap.get(a, a) if isinstance(a, torch.fx.Node) else a for a in node.args)
        val = node.meta.get("val")
        with graph.inserting_before(node):
            inner = graph.call_function(node.target, new_args, dict(node.kwargs))
            out = graph.call_function(aten.expand.default, (inner, list(size)))
        if val is not None:
            with val.fake_mode:
                inner.meta["val"] = node.target(*[a.meta["val"] if isinstance(a, torch.fx.Node) else a
                                                  for a in new_args], **node.kwargs)
                out.meta["val"] = inner.meta["val"].expand(val.shape)
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        changed += 1
    graph.eliminate_dead_code()
    return changed


class SinkExpands(_compat.custom_graph_pass_base()):
    """``sink_expands`` as an Inductor ``post_grad_custom_pre_pass`` (uuid keys the FX cache)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.count = sink_expands(graph)

    def uuid(self) -> str:
        # also keys lowering.py's choice of extern convolutions, which Inductor's
        # FX graph cache would not see otherwise
        return "dynbatch-sink-expands-v2+extern-convolutions-v1"
