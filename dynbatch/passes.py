"""Aten-graph passes run before Inductor lowers dynbatch's batched graph (stage 4, lowering)."""

from __future__ import annotations

import torch
import torch.fx

from . import _compat, fx_utils, matmul_kernels

aten = torch.ops.aten


def _expanded(node: torch.fx.Node) -> tuple[torch.fx.Node, list] | None:
    """(a, S) for ``expand(a, S)``."""
    if node.op == "call_function" and node.target is aten.expand.default:
        return node.args[0], list(node.args[1])
    return None


def _broadcast_sizes(sizes: list[list]) -> list | None:
    """The broadcast of expand sizes (ints, or nodes for symbolic sizes), right-aligned like
    broadcasting; None where two differ and neither is a literal 1, or where one is -1."""
    out = []
    for i in range(1, max(map(len, sizes)) + 1):
        entries = [s[-i] for s in sizes if len(s) >= i]
        if any(isinstance(e, int) and e == -1 for e in entries):
            return None
        real = [e for e in entries if not (isinstance(e, int) and e == 1)]
        if any(e != real[0] for e in real[1:]):  # nodes compare by identity
            return None
        out.append(real[0] if real else 1)
    return out[::-1]


def sink_expands(graph: torch.fx.Graph) -> int:
    """op(expand(a, S1), expand(b, S2), scalars) -> expand(op(a, b, scalars), broadcast(S1, S2)),
    to a fixed point.

    After vmap, the derivative factor of an elementwise op (gelu'(x), tanh'(y), ...) is computed
    on x.expand(B, ...): B times the transcendental work for a value that does not depend on B.
    Broadcasting composes, so any pointwise op whose tensor operands are all expanded may run
    on the unexpanded ones and be expanded after: layer_norm's x_hat = (x - mean) * rstd
    arrives as expand(x, [B, N, D]), expand(mean, [B, N, 1]), expand(rstd, [B, N, 1])
    (each under a ``clone``, itself pointwise, which its batching rule's ``.contiguous()`` adds).
    Random ops stay: on B expanded copies they draw B samples, computed once they would draw one.

    Coupled with batch_rules.gelu_backward, which keeps functorch's layout (the unbatched
    operand expanded to [B, ...]) and leaves it to this pass to compute gelu'(x) once.
    """
    changed = 0
    for node in list(graph.nodes):
        if (not fx_utils.is_pointwise(node) or fx_utils.draws_random_numbers(node)
                or any(isinstance(v, torch.fx.Node) for v in node.kwargs.values())):
            continue
        tensors = [a for a in node.args if isinstance(a, torch.fx.Node)]
        sources = [_expanded(a) for a in tensors]
        if not tensors or any(src is None for src in sources):
            continue
        size = _broadcast_sizes([s for _, s in sources])
        if size is None:
            continue
        swap = {a: src for a, (src, _) in zip(tensors, sources)}
        new_args = tuple(swap.get(a, a) if isinstance(a, torch.fx.Node) else a for a in node.args)
        val = node.meta.get("val")
        with graph.inserting_before(node):
            inner = graph.call_function(node.target, new_args, dict(node.kwargs))
            out = graph.call_function(aten.expand.default, (inner, size))
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


def _is_transpose(node) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and (
        node.target is aten.t.default
        or (node.target is aten.permute.default and list(node.args[1]) in ([1, 0], [-1, -2], [1, -2], [-1, 0])))


def route_matmuls(graph: torch.fx.Graph, kernel: str = "auto") -> int:
    """mm(a, w.t()) -> dynbatch::linear_nt(a, w, kernel) for float32 CPU products whose
    kernel is chosen by measurement (matmul_kernels.py, NOTE [CPU matmul kernels]).

    A product whose sizes are all known is measured now and keeps ATen's ``mm``
    unless oneDNN won; one with a symbolic size (M = B*N) is measured at run time
    for each bucket of M, by the op, unless "auto" would never measure it (M known
    and below MIN_ROWS).  ``kernel="aten"`` leaves the graph as it is.
    """
    if kernel == "aten" or not matmul_kernels.onednn_available():
        return 0
    changed = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.mm.default or not _is_transpose(node.args[1]):
            continue
        a, w = node.args[0], node.args[1].args[0]
        if _is_transpose(w):  # a @ w: oneDNN would need w.t() copied
            continue
        vals = [getattr(x, "meta", {}).get("val") for x in (a, w, node)]
        if any(not isinstance(v, torch.Tensor) for v in vals):
            continue
        a_val, w_val, out_val = vals
        if any(v.device.type != "cpu" or v.dtype != torch.float32 or v.dim() != 2 for v in vals):
            continue
        sizes = (a_val.shape[0], a_val.shape[1], w_val.shape[0])
        if not any(map(_compat.is_symbolic, sizes)):
            if matmul_kernels.choice_for_static_shape(*map(int, sizes), torch.float32, kernel) != "onednn":
                continue
        elif kernel == "auto" and not _compat.is_symbolic(sizes[0]) and int(sizes[0]) < matmul_kernels.MIN_ROWS:
            # A known short height (B in K or N, as in an HVP's [n, d] @ [d, K]) would take
            # ATen at every call: routing it only adds the op's Python call.
            continue
        with graph.inserting_before(node):
            routed = graph.call_function(matmul_kernels.op(), (a, w, kernel))
        routed.meta["val"] = out_val
        node.replace_all_uses_with(routed)
        graph.erase_node(node)
        changed += 1
    graph.eliminate_dead_code()
    return changed


class PostGradPasses(_compat.custom_graph_pass_base()):
    """dynbatch's aten passes as an Inductor ``post_grad_custom_pre_pass``: sink_expands,
    then route_matmuls (uuid keys the FX cache)."""

    def __init__(self, cpu_matmul: str = "auto") -> None:
        self.cpu_matmul = cpu_matmul
        if cpu_matmul != "aten" and matmul_kernels.onednn_available():
            # Registered now, not when the pass runs: a graph loaded from Inductor's
            # FX cache calls the kernel without this pass having run in this process.
            matmul_kernels.register()
        self.counts: dict[str, int] = {}

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.counts = {"sink_expands": sink_expands(graph),
                       "route_matmuls": route_matmuls(graph, self.cpu_matmul)}

    def uuid(self) -> str:
        # also keys lowering.py's choice of extern convolutions, which Inductor's
        # FX graph cache would not see otherwise
        return f"dynbatch-sink-expands-v3+extern-convolutions-v1+matmuls-v4-{self.cpu_matmul}"
