"""Markers the batching rule puts around each batched backward, for the memory plan.

The rule (batched_grad.py) brackets its batched backward's cotangents and grads with
an identity custom op while AOTAutograd traces; the plan (planning/memory.py) finds
the backward between them and removes them before lowering.  They live with the rule
that emits them, so the rule never imports the planner above it.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Sequence

import torch

from .. import _compat

COTANGENT, GRAD = 0, 1  # marker roles


# --- markers ------------------------------------------------------------------

@torch.library.custom_op("dynbatch::batch_marker", mutates_args=())
def batch_marker(x: torch.Tensor, grad: str, role: int) -> torch.Tensor:
    """Identity that brackets one batched backward in the traced graph (removed before lowering)."""
    return x.clone()


@batch_marker.register_fake
def _(x, grad, role):
    # Same strides as x: users traced on the marker stay valid once it is removed.
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)


_collecting = threading.local()


@contextlib.contextmanager
def collecting() -> Iterator[None]:
    """While AOTAutograd traces a dynbatch graph: batched_grad emits markers."""
    previous = getattr(_collecting, "on", False)
    _collecting.on = True
    try:
        yield
    finally:
        _collecting.on = previous


def mark(tensors: Sequence[torch.Tensor | None], role: int, create_graph: bool) -> tuple:
    """Bracket a batched backward, when a plan is being collected and chunking could apply."""
    grad = _compat.current_grad_node_name()
    if (not getattr(_collecting, "on", False) or grad is None or create_graph
            or _compat.functorch_transform_active()
            or any(t is not None and t.requires_grad for t in tensors)):
        return tuple(tensors)
    return tuple(t if t is None or _lazy(t) else batch_marker(t, grad, role) for t in tensors)


def _lazy(t: torch.Tensor) -> bool:
    """Zero tensors (a grad known to be zero) and conj/neg views: an op would materialise
    them, at sizes it reads as ints (specialising B); they hold no batched memory anyway."""
    return _compat.is_zero_tensor(t) or t.is_conj() or t.is_neg()
