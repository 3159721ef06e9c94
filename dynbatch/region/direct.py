"""AOTAutograd's node in the caller's graph: a region's later calls skip a node of their own.

Once a region's first call has shown that AOTAutograd's node alone made its outputs
from the graph's arguments, ``learn`` returns a ``Direct``: the region's later calls
return AOTAutograd's outputs as they are, and the node's class has its backward
routed, plain grads to AOTAutograd's own backward, create_graph and batched ones to
paths.backward on the call's arguments, kept on the node with their
versions (NOTE [AOTAutograd's node in the caller's graph]).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from .. import _compat
from . import paths
from ..records import STATS
from .aot_node import AotCall, accumulated_tensor, aot_backward_node, route_backward
from .args import merge
from .which_vmap import batching_of


# NOTE [AOTAutograd's node in the caller's graph]
# A region whose inner graph is one AOTAutograd node over the graph's own
# arguments -- a model's usual shape -- needs no node of its own for a plain
# backward: AOTAutograd's compiled backward is the answer.  Its own node in
# front (_ProgramFunction: detached aliases, saved tensors, a Python backward
# that calls AOTAutograd's) cost about a tenth of a small force-training step
# (docs/benchmarks.md).  So once
# the first call has shown that shape, the region returns AOTAutograd's outputs
# as they are, as stock torch.compile does, and the backward of the node's class
# (one class per compiled graph) is routed: a plain backward runs AOTAutograd's
# own; a create_graph or batched one, which AOTAutograd refuses or cannot batch,
# takes dynbatch's paths (NOTE [Region backward] in region/edge.py) on the call's arguments.  Those
# are kept on the node with their versions, so an in-place change raises as
# autograd's saved tensors would.  Graphs that draw random numbers keep the
# program's node: their batched grads loop per sample over the inner graph.

def learn(region: Any, outs: Sequence[Any], diff: Sequence[int], leaves: Sequence[torch.Tensor],
          others: Sequence[Any]) -> Direct | None:
    """After the first call through the program's node of ``region`` (a region.Region): its
    calls from now on, where AOTAutograd's node alone made the outputs from the graph's
    arguments; None where it did not (NOTE [AOTAutograd's node in the caller's graph])."""
    if region.program.random_ops or not diff:
        return None  # batched grads loop per sample over the inner graph (the program's node)
    node = aot_backward_node([outs[k] for k in diff])
    if node is None:
        return None
    args = merge(region.is_input, leaves, others)
    tensor_args = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    edges = [edge for edge, _ in node.next_functions]
    if len(node.needs_input_grad) != len(args) or len(edges) != len(tensor_args):
        return None
    for edge, i in zip(edges, tensor_args):
        if (edge is not None) != region.is_input[i] or (
                edge is not None and accumulated_tensor(edge) is not args[i]):
            return None
    forward_cls = route_backward(node, _routed_backward)
    if forward_cls is None:
        return None
    # The node's forward takes the graph's arguments as they are (checked above).
    input_at = tuple(region.diff_args.index(i) if region.is_input[i] else None for i in range(len(args)))
    return Direct(region, forward_cls, {k: outs[k].output_nr for k in diff},
                  [tensor_args.index(i) for i in region.diff_args], input_at)


class Direct:
    """A region's calls that return AOTAutograd's outputs, and their routed backward."""

    def __init__(self, region: Any, forward_cls: type, output_nrs: dict[int, int],
                 diff_edges: list[int], input_at: tuple[int | None, ...]) -> None:
        self.region = region
        self.forward_cls = forward_cls  # AOTAutograd's CompiledFunction of this graph
        self.output_nrs = tuple(output_nrs.items())  # (graph output, the node's output) that need grad
        self.first = next(iter(output_nrs))
        self.diff_edges = diff_edges  # the node's edge of each differentiable input
        self.input_at = input_at  # per argument: the differentiable input it is, if any

    def __call__(self, args: Sequence[Any], before: Sequence[Any] | None) -> tuple | None:
        """``before``: the arguments as a recompute must see them (None: ``args``)."""
        outs = self.region.compiled(*args)
        node = outs[self.first].grad_fn
        if node is None or getattr(type(node), "_forward_cls", None) is not self.forward_cls:
            return None
        kept = args if before is None else before
        node._dynbatch_call = (self, kept, tuple(a._version if isinstance(a, torch.Tensor) else None
                                                 for a in kept))
        return outs

    def backward(self, ctx, args, versions, grads, batching) -> tuple:
        """A create_graph or batched backward, by dynbatch's paths; one grad per argument.
        Called only from ``_routed_backward``'s backward, whose ``dynamo_disable`` (recursive)
        keeps Dynamo out of this too: a second wrapper would cost each call its frame swaps."""
        for a, version in zip(args, versions):
            if version is not None and a._version != version:
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified by an "
                    f"inplace operation: [{a.type()} {list(a.shape)}] is at version {a._version}; "
                    f"expected version {version} instead (an input of a dynbatch-compiled graph)")
        region = self.region
        wanted = _compat.engine_will_execute_each([node for node, _ in ctx.next_functions])
        needed = tuple(wanted[e] for e in self.diff_edges)
        out_grads = [(k, grads[nr]) for k, nr in self.output_nrs if grads[nr] is not None]
        result: list[Any] = [None] * len(args)
        if out_grads and any(needed):
            inputs = [args[i] for i in region.diff_args]
            others = [a for i, a in enumerate(args) if not region.is_input[i]]
            call = AotCall(ctx, self.input_at, dict(self.output_nrs))
            # The caller read ``batching`` off every grad: the same reading where these are all of them.
            same = len(out_grads) == sum(g is not None for g in grads)
            grads_in = paths.backward(region.program, inputs, None, others, None, out_grads, needed, (),
                                                region.n_outputs, call,
                                                batching if same else paths.UNKNOWN)
            for i, g in zip(region.diff_args, grads_in):
                result[i] = g
        return tuple(result)


def _routed_backward(original: Callable) -> Callable:
    """The backward of a routed AOTAutograd class: its own for plain grads and for
    nodes a Direct did not make (a program's inner graph), dynbatch's otherwise.
    Kept from Dynamo as every entry from the engine is: a grad call that graph-broke runs
    the engine with Dynamo's frame hook on, which then traced this plumbing."""
    @_compat.dynamo_disable
    def backward(ctx, *args):
        call = getattr(ctx, "_dynbatch_call", None)
        if call is not None:
            # torch 2.13 on hands this class's grads over as one list (boxed_grads_call).
            grads = args[0] if len(args) == 1 and isinstance(args[0], list) else args
            batching = batching_of([g for g in grads if g is not None])
            if batching is not None or torch.is_grad_enabled():
                direct, call_args, versions = call
                return direct.backward(ctx, call_args, versions, grads, batching)
            STATS.count(paths.PLAIN)
            if not _compat.backward_keeps_graph():
                ctx._dynbatch_call = None  # the graph is freed: let the arguments go with it
        return original(ctx, *args)

    return backward
