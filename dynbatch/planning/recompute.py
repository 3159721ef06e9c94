"""Store or recompute: each consumer of a large, cheap pointwise tensor gets its own copy,
and a factor that a batched loop would recompute B times is stored once.

Aten passes of stage 4 (lowering), run with lowering/aten_passes.py's before Inductor lowers the graph.

NOTE [Store or recompute]
A batched backward of a pair potential builds a ``[B, N, N, 3]`` tensor of pair terms
from small inputs (positions ``[N, 3]``, cotangents ``[B, N, 3]``, a ``[B, N, N]``
factor) and reduces it twice: over i and over j.  Inductor inlines a pointwise node
into each of its users unless the node is read by more than one kernel and its body
reads more than ``realize_reads_threshold`` buffers or is long: then it is written
once and read back by each reduction, three passes over the largest tensor of the
graph, where the inputs it is computed from are a third of its size or less.  XLA's
priority fusion duplicates such a producer into every consuming fusion instead
(xla/service/gpu/transforms/priority_fusion.cc).

This pass makes that choice per node, by a cost model: per element of the tensor,
storing costs one write and k reads (k users), recomputing costs k - 1 more
evaluations of the chain (its flops at the device's bytes-per-flop) and k reads of
the chain's own inputs; a tensor whose store and loads are too small to cost more than
a kernel launch stays stored.  Where recomputing wins, every user but the first gets a copy
of the chain (the pointwise and view nodes back to non-pointwise nodes, graph inputs
and tensors much smaller than the result), so each of Inductor's kernels computes
the tensor in its own loop.  A copy Inductor would realize anyway (a body over its
``realize_*`` thresholds) would only add stores, so such chains stay.  Random ops are
never copied: a copy would draw other numbers.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
import torch.fx

from .. import _compat, fx_utils

log = logging.getLogger("dynbatch")
aten = torch.ops.aten

# Ops Inductor lowers to views of their input: free to copy, no kernel of their own.
VIEWS = frozenset({
    aten.expand.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.permute.default,
    aten.t.default, aten.transpose.int, aten.slice.Tensor, aten.select.int, aten.alias.default,
})
# Reductions Inductor fuses their pointwise input into (a loop over the reduced dims).
REDUCTIONS = frozenset({
    aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.amax.default, aten.amin.default,
    aten.prod.dim_int, aten.var.correction,
})
# Ops whose loop reads one argument through indices, by its position: Inductor inlines a
# pointwise producer of the values a scatter adds (a message-passing potential's [B, E, F]
# edge terms) or of the tensor a gather reads -- never of a scatter's target, which it writes.
INDEXED = {aten.index_put.default: 2, aten._unsafe_index_put.default: 2, aten.index.Tensor: 0}
# Pointwise ops that cost more than one arithmetic op (special-function units on a GPU,
# polynomial approximations in Inductor's vectorised C++), in flops of plain arithmetic.
TRANSCENDENTAL_FLOPS = 8
TRANSCENDENTAL = frozenset({
    aten.exp.default, aten.log.default, aten.tanh.default, aten.sigmoid.default, aten.sqrt.default,
    aten.rsqrt.default, aten.sin.default, aten.cos.default, aten.erf.default, aten.pow.Tensor_Tensor,
    aten.log1p.default, aten.expm1.default, aten.atan2.default, aten.reciprocal.default,
})
# Inputs of a chain smaller than this fraction of its result are read, not copied: a
# broadcast [N, N] factor of a [B, N, N, 3] tensor is loaded, not recomputed B times.
SMALL_FRACTION = 4
# The copies may add at most this many nodes per node of the graph (a bound on compile time).
MAX_GROWTH = 1.0
# A copy's body may reach this multiple of Inductor's inline limits (NOTE [Copies Inductor inlines]).
LIMITS_RAISE = 3

# NOTE [Copies Inductor inlines]
# Inductor stores a pointwise body whose ops or loads exceed ``realize_opcount_threshold``
# or ``realize_acc_reads_threshold`` (30 and 8 on a GPU; from torch 2.13, 50 and 12 on
# the CPU), whatever its users: a copy over them would be stored once per copy.  The
# pass copies chains up to LIMITS_RAISE times those limits, and a graph where it copied
# one is lowered with the limits raised to its largest copy -- for that graph only:
# lowering/inductor.py patches both settings around each compile, so the raise ends with it.
# A copy's body is estimated as Inductor builds it, from above: the chain, the small
# pointwise nodes Inductor inlines with it, an op per constant and per input read.
# The Lennard-Jones pair forces (47 ops and 6 loads in Inductor's count, 64 and 11 in
# this one) fit the CPU's limits; on a GPU Inductor stores them even with one user.


@dataclasses.dataclass(frozen=True)
class DeviceCost:
    """What a flop costs against a byte moved, on one kind of device."""

    bytes_per_flop: float  # bytes the memory system moves in the time of one fp32 flop
    min_saved_bytes: int  # a split must save at least this much traffic (its store and loads)


# H100 / H200 SXM: 3.35-4.8 TB/s of HBM against 67 TFLOP/s of fp32 (not tensor-core)
# math: a flop costs the time of 0.05-0.07 bytes.  A store and its loads under 16 MiB
# take less than one kernel launch (~4 us at 4 TB/s), and stay in L2 between kernels:
# splitting them gains nothing.  On an H200 (`bench ab dynbatch.recompute=never,auto
# --device cuda`, 2026-11-28) lj_forces N = 24 (a 0.5 MB pair tensor) read x1.21 when
# recomputed, N = 100 (36 MB) x0.89, N = 500 and full_hessian/lj N = 200, 500 x0.33-0.40.
#
# No CPU entry: on the CPU "auto" leaves the choice to Inductor.  On one core of this
# project's 2-core AMD EPYC (Zen 3), recomputing wherever Inductor would inline the
# copies gained nothing consistent: `python -m dynbatch.bench ab dynbatch.recompute=never,always
# --workloads full_hessian,lj_forces,pinn --threads 1` read x0.88-1.03, the force-training
# step x0.86-1.02 (docs/benchmarks.md).  dynbatch's CPU chunks (memory.CPU_AUTO_BUDGET)
# keep a stored tensor in cache, where reading it back is cheap.
COSTS = {"cuda": DeviceCost(bytes_per_flop=0.07, min_saved_bytes=16 * 2**20)}


@dataclasses.dataclass(frozen=True)
class Chain:
    """The nodes a tensor is computed from that a copy repeats, inputs first."""

    nodes: list[torch.fx.Node]
    flops: int  # per element of the result, one evaluation
    input_bytes: float  # bytes of the chain's inputs read per element of the result
    ops: int  # Inductor's count of the copy's body, about: its ops, constants and loads
    reads: int  # the chain's inputs: the loads of the copy's body, about


def _numel_hint(node: Any) -> int | None:
    val = getattr(node, "meta", {}).get("val")
    if not isinstance(val, torch.Tensor):
        return None
    return _compat.size_hint(val.numel())


def _copyable(node: torch.fx.Node) -> bool:
    return (node.op == "call_function" and not fx_utils.draws_random_numbers(node)
            and (fx_utils.is_pointwise(node) or node.target in VIEWS)
            and isinstance(node.meta.get("val"), torch.Tensor))


def _consumers_fuse(node: torch.fx.Node) -> bool:
    """Every user (through views) is a kernel Inductor can inline ``node`` into: a pointwise
    op, a reduction, the values of a scatter.  A graph output, a product or the target of a
    scatter needs it stored anyway."""
    for user in node.users:
        if user.op != "call_function" or fx_utils.draws_random_numbers(user):
            return False
        if user.target in VIEWS:
            if not _consumers_fuse(user):
                return False
        elif user.target in INDEXED:
            if [i for i, arg in enumerate(user.args) if _holds(arg, node)] != [INDEXED[user.target]]:
                return False
        elif not (fx_utils.is_pointwise(user) or user.target in REDUCTIONS):
            return False
    return True


def _holds(arg: Any, node: torch.fx.Node) -> bool:
    return arg is node or (isinstance(arg, (list, tuple)) and any(a is node for a in arg))


def _chain(root: torch.fx.Node, max_ops: int) -> Chain | None:
    """The copyable ancestors of ``root`` at least 1/SMALL_FRACTION of its size; smaller
    ones, and what is not pointwise, are the chain's inputs (read, not copied).  None
    where the copy's body would exceed ``max_ops``."""
    size = _numel_hint(root)
    if not size:
        return None
    nodes, inputs = _walk(root, lambda node: (_numel_hint(node) or 0) * SMALL_FRACTION >= size)
    if any(_numel_hint(a) is None for a in inputs):
        return None  # an unbacked size: no cost to weigh
    flops = sum(TRANSCENDENTAL_FLOPS if n.target in TRANSCENDENTAL else 1 for n in nodes if n.target not in VIEWS)
    input_bytes = sum(_numel_hint(a) * a.meta["val"].element_size() for a in inputs) / size
    # Inductor inlines the small pointwise inputs too: the copy's body reaches back to
    # what is stored (graph inputs, reductions, products), as the original's does.
    body, loads = _walk(root, lambda node: True, most=max_ops)
    if len(body) > max_ops:
        return None
    ops = len(loads) + sum(1 + sum(not isinstance(a, torch.fx.Node) for a in n.args)  # op and constants
                           for n in body if n.target not in VIEWS)
    return Chain(_inputs_first(root, set(nodes)), flops, input_bytes, ops, len(loads))


def _walk(root: torch.fx.Node, follow, most: int | None = None) -> tuple[list[torch.fx.Node], set[torch.fx.Node]]:
    """(``root`` and its copyable ancestors that ``follow`` accepts, the tensors they read
    that are not among them), stopping past ``most`` nodes.  Size arguments (SymInt
    nodes) are neither."""
    nodes, stack, seen, inputs = [], [root], {root}, set()
    while stack and (most is None or len(nodes) <= most):
        node = stack.pop()
        nodes.append(node)
        for arg in node.all_input_nodes:
            if arg in seen or not isinstance(arg.meta.get("val"), torch.Tensor):
                continue
            seen.add(arg)
            if _copyable(arg) and follow(arg):
                stack.append(arg)
            else:
                inputs.add(arg)
    return nodes, inputs


def _inputs_first(root: torch.fx.Node, members: set[torch.fx.Node]) -> list[torch.fx.Node]:
    """``members`` in an order that defines each before its users (copies made earlier in
    the pass are not in the graph's original order)."""
    ordered, done, stack = [], set(), [(root, False)]
    while stack:
        node, inputs_done = stack.pop()
        if inputs_done:
            ordered.append(node)
            continue
        if node in done:
            continue
        done.add(node)
        stack.append((node, True))
        stack.extend((arg, False) for arg in node.all_input_nodes if arg in members and arg not in done)
    return ordered


@dataclasses.dataclass
class Recomputed:
    """What :func:`recompute_fanouts` did: tensors split, and the largest copy's body."""

    count: int = 0
    ops: int = 0
    reads: int = 0


def recompute_pays(chain: Chain, users: int, itemsize: int, cost: DeviceCost, numel: int) -> bool:
    """Per element of the result: k evaluations (and k reads of the chain's inputs) cost
    less than one evaluation, a store and k loads; and the store and loads saved are
    large enough to show (``cost.min_saved_bytes``)."""
    if numel * itemsize * (1 + users) < cost.min_saved_bytes:
        return False
    store = chain.flops * cost.bytes_per_flop + chain.input_bytes + itemsize * (1 + users)
    recompute = users * (chain.flops * cost.bytes_per_flop + chain.input_bytes)
    return recompute < store


def _copy(graph: torch.fx.Graph, chain: Chain, before: torch.fx.Node) -> torch.fx.Node:
    copies: dict[torch.fx.Node, torch.fx.Node] = {}
    with graph.inserting_before(before):
        for node in chain.nodes:
            copies[node] = graph.node_copy(node, lambda arg: copies.get(arg, arg))
    return copies[chain.nodes[-1]]


def recompute_fanouts(graph: torch.fx.Graph, mode: str = "auto", device: str | None = None,
                      limits: tuple[int, int] | None = None) -> Recomputed:
    """Give each user of a large pointwise tensor its own copy of the tensor's chain where
    recomputing costs less than storing (NOTE [Store or recompute]).  ``mode``: "auto"
    (the cost model of ``device``'s kind; none on the CPU, see COSTS), "always" (wherever
    the copies fit ``limits``), "never".  ``limits``: the ops and loads a copy's body may have (default: Inductor's
    inline limits; NOTE [Copies Inductor inlines])."""
    done = Recomputed()
    device = device or _graph_device(graph)
    cost = COSTS.get(device)
    if mode == "never" or device is None or (mode == "auto" and cost is None):
        return done
    max_ops, max_reads = limits or _compat.inductor_inline_limits(device)
    budget = int(MAX_GROWTH * len(graph.nodes))
    # In graph order, each node with the users it had: a chain's copies give its inputs
    # more users, and splitting those too would copy what every copy already recomputes.
    for root in list(graph.nodes):
        users = list(root.users)
        if len(users) < 2 or not _copyable(root) or root.target in VIEWS or not _consumers_fuse(root):
            continue
        chain = _chain(root, max_ops)
        itemsize = root.meta["val"].element_size()
        # Only a tensor larger than what it is computed from: else storing it is as cheap.
        if chain is None or chain.input_bytes >= itemsize or chain.ops > max_ops or chain.reads > max_reads:
            continue
        extra = (len(users) - 1) * len(chain.nodes)
        if extra > budget:
            continue
        # Judged at the sizes the graph was traced with (B's hint where B is symbolic).
        if mode == "auto" and not recompute_pays(chain, len(users), itemsize, cost, _numel_hint(root) or 0):
            continue
        for user in users[1:]:
            user.replace_input_with(root, _copy(graph, chain, before=user))
        budget -= extra
        done.count += 1
        done.ops, done.reads = max(done.ops, chain.ops), max(done.reads, chain.reads)
        log.debug("dynbatch: %s recomputed for each of its %d users (%d nodes, %d flops per element)",
                  root.name, len(users), len(chain.nodes), chain.flops)
    return done


def inline_copies(graph: torch.fx.Graph, mode: str = "auto") -> int:
    """:func:`recompute_fanouts` as lowering runs it: copies up to LIMITS_RAISE times
    Inductor's inline limits, which are then raised to the largest copy's for this
    graph (NOTE [Copies Inductor inlines])."""
    device = _graph_device(graph)
    if device is None:
        return 0
    limits = tuple(LIMITS_RAISE * limit for limit in _compat.inductor_inline_limits(device))
    done = recompute_fanouts(graph, mode, device, limits)
    if done.count:
        _compat.raise_inductor_inline_limits(device, done.ops, done.reads)
    return done.count


# NOTE [Store broadcast factors]
# The other direction.  A batched backward multiplies its [B, ...] tensors by factors
# that do not depend on B: a pair potential's [N, N] coefficients (powers of 1/r^2 and
# their masks), an activation's derivative.  Inductor inlines a pointwise producer into
# each consumer, and the consumer's loop runs over B: the factor's whole chain is
# evaluated B times per element.  In the Lennard-Jones Hessian rows ~15 of the ~20 scalar
# ops of each (b, i, j) were the pair's coefficients, recomputed for every sample.  So a
# pointwise node that a fusable consumer reads broadcast at least BROADCAST_RATIO times
# over (the consumer's loop has that many elements per element of the node), and whose
# inlined chain costs at least MIN_STORED_FLOPS per element, is stored: Inductor is made
# to realise it (``prims.inductor_force_stride_order`` at its own strides), and the
# consumers load it from a buffer B times smaller than their loop, which stays in cache.
# One core of the Xeon, `bench ab dynbatch.recompute=never,auto --threads 1`: lj_forces
# x0.74, x0.52, full_hessian/lj x0.64-0.92, hessian rows x0.84 and HVPs x0.85-0.86,
# pinn/jacobian x0.94, force training x0.95-0.99; nothing stored elsewhere.  A factor read
# only 8 times over (an HVP of K = 8) cost its store: x1.04, hence 16.  On CUDA a
# recomputed chain costs little against the memory it reads, and nothing is measured
# there yet: "auto" stores on the CPU only.
BROADCAST_RATIO = 16
MIN_STORED_FLOPS = 4
STORED_DEVICES = ("cpu",)


def _fused_consumers(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The kernels that would inline ``node``: its users through views, those that are
    pointwise ops or reductions (a product or an output stores it anyway)."""
    found = []
    for user in node.users:
        if user.op != "call_function":
            continue
        if user.target in VIEWS:
            found += _fused_consumers(user)
        elif fx_utils.is_pointwise(user) or user.target in REDUCTIONS:
            found.append(user)
    return found


def _loop_elements(consumer: torch.fx.Node) -> int:
    """The elements of a consumer's loop: its result's, or a reduction's input's."""
    return max(_numel_hint(n) or 0 for n in (consumer, *consumer.all_input_nodes))


def _chain_flops(node: torch.fx.Node, most: int = 64) -> int:
    """Per element, the flops of what Inductor inlines into a consumer of ``node``: the
    node and its pointwise ancestors back to what is stored (the first ``most`` of them)."""
    body, _ = _walk(node, lambda n: True, most=most)
    return sum(TRANSCENDENTAL_FLOPS if n.target in TRANSCENDENTAL else 1 for n in body if n.target not in VIEWS)


def store_broadcast_factors(graph: torch.fx.Graph, mode: str = "auto", device: str | None = None) -> int:
    """Store each pointwise factor a batched loop would recompute per sample (NOTE [Store
    broadcast factors]); ``mode`` as :func:`recompute_fanouts`'s.  Returns how many."""
    device = device or _graph_device(graph)
    if mode == "never" or device is None or (mode == "auto" and device not in STORED_DEVICES):
        return 0
    stored = 0
    # In graph order: a stored factor is where its descendants' chains start.
    for node in list(graph.nodes):
        if not _copyable(node) or node.target in VIEWS:
            continue
        size = _numel_hint(node)
        if not size or not any(_loop_elements(c) >= BROADCAST_RATIO * size for c in _fused_consumers(node)):
            continue
        flops = _chain_flops(node)
        if flops < MIN_STORED_FLOPS:
            continue
        val = node.meta["val"]
        users = list(node.users)
        with graph.inserting_before(node.next):
            strides = [_size_node(graph, node, d, stride) for d, stride in enumerate(val.stride())]
            store = graph.call_function(torch.ops.prims.inductor_force_stride_order.default, (node, strides))
        store.meta["val"] = val
        for user in users:
            user.replace_input_with(node, store)
        stored += 1
        log.debug("dynbatch: %s %s stored: read broadcast, %d flops per element", node.name, list(val.shape), flops)
    return stored


def _size_node(graph: torch.fx.Graph, node: torch.fx.Node, dim: int, stride: Any) -> Any:
    """A stride for a node's argument: an int, or a node reading the symbolic one."""
    if not _compat.is_symbolic(stride):
        return int(stride)
    read = graph.call_function(aten.sym_stride.int, (node, dim))
    read.meta["val"] = stride
    return read


def _graph_device(graph: torch.fx.Graph) -> str | None:
    for node in graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            return val.device.type
    return None
