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
import warnings
from typing import Iterator, Sequence

import torch


def slice_backward(grad: torch.Tensor, input_sizes: Sequence, dim: int, start, end, step):
    rank = len(input_sizes)
    dim = dim % rank
    size = input_sizes[dim]
    # The forward's slice bounds as autograd saved them: may be negative or 2**63-1.
    start = start + size if start < 0 else start
    end = end + size if end < 0 else end
    start = min(max(start, 0), size)
    end = min(max(end, start), size)
    if step != 1:
        return grad.new_zeros(input_sizes).slice_scatter(grad, dim, start, end, step)
    return torch.constant_pad_nd(grad, [0, 0] * (rank - 1 - dim) + [start, size - end], 0.0)


@contextlib.contextmanager
def symbolic_batch_rules() -> Iterator[None]:
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Overriding a previously registered kernel" is the point
        lib.impl("slice_backward", slice_backward, "FuncTorchBatched")
    try:
        yield
    finally:
        lib._destroy()
