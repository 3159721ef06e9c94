"""Batching rules dynbatch swaps into functorch while a dynbatch compile traces.

NOTE [Symbolic batch rules]
functorch's C++ batching rule for ``aten.slice_backward`` (and the one for
``slice_scatter``) builds the batched sizes with ``grad.size(0)``, not
``grad.sym_size(0)``.  Under a symbolic batch size that reads B as a plain
int, so Dynamo adds the guard ``B == <example value>`` and every new B
recompiles.  Any batched backward through a slice hits it, e.g. the Hessian
of a loss in a flat parameter vector sliced with ``w[:k]``.  For ``step == 1``
slice_backward is a zero pad, whose batching rule keeps B symbolic; other
steps keep the old rule (right, only specialising).

The override is registered only for the length of a dynbatch compile (the
capture scope), so code outside dynbatch sees functorch unchanged.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch

from . import _compat


def slice_backward(grad: torch.Tensor, input_sizes: Sequence, dim: int, start, end, step):
    rank = len(input_sizes)
    dim = dim % rank
    if _data_dependent(start) or _data_dependent(end):
        # e.g. tensor_split with tensor indices: `start < 0` below cannot be decided.
        return _functorch_rule(grad, input_sizes, dim, start, end, step)
    size = input_sizes[dim]
    # The forward's slice bounds as autograd saved them: may be negative or 2**63-1.
    start = start + size if start < 0 else start
    end = end + size if end < 0 else end
    start = min(max(start, 0), size)
    end = min(max(end, start), size)
    if step != 1:
        return grad.new_zeros(input_sizes).slice_scatter(grad, dim, start, end, step)
    return torch.constant_pad_nd(grad, [0, 0] * (rank - 1 - dim) + [start, size - end], 0.0)


def _data_dependent(x) -> bool:
    return isinstance(x, torch.SymInt) and _compat.has_unbacked_symbols(x)


def _functorch_rule(grad: torch.Tensor, input_sizes: Sequence, dim: int, start, end, step):
    """What functorch's C++ rule does (batch dim to the front, one unbatched
    slice_backward), reading B as a SymInt; no Python branching on the bounds."""
    value, bdim, level = _compat.unwrap_batched(grad)
    value = value.movedim(bdim, 0)
    with _compat.below_vmap():
        out = torch.ops.aten.slice_backward(value, [value.size(0), *input_sizes], dim + 1, start, end, step)
    return _compat.rewrap_batched(out, 0, level)


def symbolic_batch_rules() -> contextlib.AbstractContextManager:
    """Our rules in place of functorch's, until the context exits."""
    return _compat.override_kernel("aten", "slice_backward", slice_backward, "FuncTorchBatched")
