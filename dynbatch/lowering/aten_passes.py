"""Aten-graph passes run before Inductor lowers dynbatch's batched graph (stage 4, lowering);
the store-or-recompute pass has a module of its own (planning/recompute.py)."""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .. import _compat, fx_utils, records
from ..cpu import matmul_kernels
from ..planning import recompute

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


# Ops Inductor's reinplace pass may turn into in-place writes to their first argument
# (torch/_inductor/fx_passes/reinplace.py: ``inplaceable_ops`` and the view-scatter ops it
# canonicalises into a generalised scatter).
_REINPLACEABLE = (aten.index_put.default, aten._unsafe_index_put.default, aten.slice_scatter.default,
                  aten.select_scatter.default, aten.diagonal_scatter.default, aten.as_strided_scatter.default)


def _overlaps_itself(t: torch.Tensor) -> bool:
    """Some element of ``t`` is stored where another is: a stride of 0 over more than one
    element, as ``expand`` makes.  A symbolic size counts as more than one."""
    return any(statically_known_true(st == 0) and not statically_known_true(sz == 1)
               for sz, st in zip(t.shape, t.stride()))


def clone_overlapping_scatter_targets(graph: torch.fx.Graph) -> int:
    """index_put(expand(z), ...) -> index_put(clone(expand(z)), ...), and the same for the
    view-scatter ops: their target gets storage of its own before Inductor sees it.

    NOTE [Scatters into expanded tensors]
    functorch's batching rule of ``index_put`` (and so of ``index_add``, ``index_copy``
    and the backward of every gather) expands an unbatched target to [B, ...]: a
    message-passing potential's ``zeros(N, F).index_add(0, idx, msg)`` becomes an
    accumulating ``index_put`` into ``zeros(N, F).expand(B, N, F)`` in its batched
    backward.  Functional semantics make that a fresh [B, N, F] result.  Inductor's
    reinplace pass (torch 2.11-2.14) writes a functional ``index_put`` in place into its
    first argument when nothing reads that storage later, without asking whether the
    argument overlaps itself: all B samples then accumulate into one [N, F] buffer
    (Hessians of such potentials were 13-37 % off).  A clone is a new storage, which the
    reinplace pass may then write in place, as it is meant to.
    """
    changed = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _REINPLACEABLE:
            continue
        target = node.args[0]
        val = getattr(target, "meta", {}).get("val")
        if not isinstance(val, torch.Tensor) or not _overlaps_itself(val):
            continue
        with graph.inserting_before(node):
            copy = graph.call_function(aten.clone.default, (target,), {"memory_format": torch.contiguous_format})
        with val.fake_mode:
            copy.meta["val"] = val.clone(memory_format=torch.contiguous_format)
        node.replace_input_with(target, copy)
        changed += 1
    return changed


def _product(node: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node | None] | None:
    """(a, b, bias) of ``mm(a, b)`` or ``addmm(bias, a, b)`` (with beta = alpha = 1)."""
    if node.op != "call_function":
        return None
    if node.target is aten.mm.default and not node.kwargs:
        return node.args[0], node.args[1], None
    if (node.target is aten.addmm.default and len(node.args) == 3
            and all(node.kwargs.get(k, 1) == 1 for k in ("beta", "alpha")) and set(node.kwargs) <= {"beta", "alpha"}):
        return node.args[1], node.args[2], node.args[0]
    return None


# The dtypes each forced kernel takes; "auto" measures among the kernels that apply.
_ROUTED_DTYPES = {"auto": (torch.float32, torch.float64), "flipped": (torch.float32, torch.float64),
                  "onednn": (torch.float32,), "openblas": (torch.float32, torch.float64),
                  "avx2": (torch.float32,), "avx512": (torch.float32,)}


def route_matmuls(graph: torch.fx.Graph, kernel: str = "auto") -> int:
    """mm(a, b) -> dynbatch::mm(a, b, kernel), and addmm(bias, a, b) -> that + bias (a
    pointwise add Inductor fuses into what follows), for CPU products whose kernel is
    chosen by measurement (cpu/matmul_kernels.py, NOTE [CPU matmul kernels]).

    A product whose sizes are all known is measured now, in its operands' layouts,
    and keeps ATen's ``mm`` unless another kernel won; one with a symbolic size
    (B*N in M or in K) is measured at run time for each bucket of sizes, by the op,
    unless "auto" would never measure it (M and K known and short).
    ``kernel="aten"`` leaves the graph as it is.
    """
    if kernel == "aten":
        return 0
    changed = 0
    for node in list(graph.nodes):
        product = _product(node)
        if product is None:
            continue
        a, b, bias = product
        vals = [getattr(x, "meta", {}).get("val") for x in (a, b, node)]
        if any(not isinstance(v, torch.Tensor) for v in vals):
            continue
        a_val, b_val, out_val = vals
        if any(v.device.type != "cpu" or v.dtype not in _ROUTED_DTYPES[kernel] or v.dim() != 2 for v in vals):
            continue
        sizes = (a_val.shape[0], a_val.shape[1], b_val.shape[1])
        if not any(map(_compat.is_symbolic, sizes)):
            layouts = matmul_kernels.layout(a_val) + matmul_kernels.layout(b_val)
            if matmul_kernels.choice_for_static_shape(*map(int, sizes), a_val.dtype, kernel, layouts) == "aten":
                continue
        elif (kernel == "auto" and not any(map(_compat.is_symbolic, sizes[:2]))
              and not matmul_kernels.tall(int(sizes[0]), int(sizes[1]))):
            # A known short product (B in N only, as in an HVP's [n, d] @ [d, K]) would
            # take ATen at every call: routing it only adds the op's Python call.
            continue
        with graph.inserting_before(node):
            routed = graph.call_function(matmul_kernels.op(), (a, b, kernel))
            result = routed if bias is None else graph.call_function(aten.add.Tensor, (routed, bias))
        result.meta["val"] = out_val
        if bias is not None:  # the product alone: a new row-major matrix of the output's shape
            with getattr(out_val, "fake_mode", None) or contextlib.nullcontext():
                routed.meta["val"] = torch.empty_like(out_val, memory_format=torch.contiguous_format)
        node.replace_all_uses_with(result)
        graph.erase_node(node)
        changed += 1
    graph.eliminate_dead_code()
    return changed


class PostGradPasses(_compat.custom_graph_pass_base()):
    """dynbatch's aten passes as an Inductor ``post_grad_custom_pre_pass``: sink_expands,
    recompute.recompute_fanouts, recompute.store_broadcast_factors,
    clone_overlapping_scatter_targets, route_matmuls (uuid
    keys the FX cache).  With a pass of the user's, only the clones run, then the user's pass."""

    def __init__(self, cpu_matmul: str = "auto", users_pass: Callable | None = None,
                 recompute_mode: str = "auto") -> None:
        self.cpu_matmul = cpu_matmul
        self.users_pass = users_pass
        self.recompute_mode = recompute_mode
        if cpu_matmul != "aten" and users_pass is None:
            # Registered now, not when the pass runs: a graph loaded from Inductor's
            # FX cache calls the kernel without this pass having run in this process.
            matmul_kernels.register()
        self.counts: dict[str, int] = {}

    def __call__(self, graph: torch.fx.Graph) -> None:
        with records.own_pass("aten_passes"):
            self._run(graph)

    def _run(self, graph: torch.fx.Graph) -> None:
        if self.users_pass is not None:
            self.counts = {"clone_overlapping_scatter_targets": clone_overlapping_scatter_targets(graph)}
            self.users_pass(graph)
            return
        # The copies after sink_expands (whose B-free factors they then read, not copy);
        # the clones after sink_expands, which would move a clone (pointwise) past its expand.
        self.counts = {"sink_expands": sink_expands(graph),
                       "recompute_fanouts": recompute.inline_copies(graph, self.recompute_mode),
                       "store_broadcast_factors": recompute.store_broadcast_factors(graph, self.recompute_mode),
                       "clone_overlapping_scatter_targets": clone_overlapping_scatter_targets(graph),
                       "route_matmuls": route_matmuls(graph, self.cpu_matmul)}

    def uuid(self) -> Any:
        # also keys lowering/inductor.py's choice of extern convolutions, the scheduler fix
        # (inductor.inductor_scheduler_keeps_mutation_renames) and the C++ strides and
        # vector index ranges (inductor.inductor_strides_without_full_simplify,
        # inductor_vec_range_without_full_simplify) and small products
        # (inductor_small_products_without_size_guards), which Inductor's FX graph cache and
        # AOTAutograd's would not see otherwise
        ours = ("dynbatch-clone-scatter-targets-v1+scheduler-renames-v1+extern-convolutions-v1"
                "+strides-without-full-simplify-v1+vec-range-without-full-simplify-v1"
                "+small-products-unbounded-v1")
        if self.users_pass is not None:
            users = getattr(self.users_pass, "uuid", None)
            return None if users is None else (ours, users())  # None: Inductor does not cache
        return f"{ours}+sink-expands-v3+recompute-v1+store-factors-v2-{self.recompute_mode}+matmuls-v6-{self.cpu_matmul}"
