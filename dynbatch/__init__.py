"""dynbatch: batched ``torch.autograd.grad`` under ``torch.compile``.

>>> import torch
>>> W = torch.randn(8, 8)
>>> @torch.compile(backend="dynbatch", fullgraph=True)
... def jacobian(x):
...     x = x.detach().requires_grad_()
...     y = torch.tanh(x @ W)
...     V = torch.eye(8).expand(x.shape[0], 8, 8).movedim(1, 0)
...     return torch.autograd.grad(y, x, V, is_grads_batched=True)[0]
>>> jacobian(torch.randn(4, 8)).shape
torch.Size([8, 4, 8])

Pipeline (docs/design.md): four stages, 1 capture/grad_calls.py -> 2 batching/grad_pass.py ->
3 batching/shape_checks.py -> 4 lowering/inductor.py, joined by backend.py; and two parts that
are not numbered stages: memory within a budget (planning/memory.py, planning/chunking.py,
around lowering) and the edge of the region (region/edge.py, around each compiled
graph).
"""

from __future__ import annotations

import atexit

from . import _compat
from .backend import UnsupportedGraph, dynbatch_backend
from .batching.batched_grad import batched_grad
from .batching.grad_pass import BatchingResult, batch_grads
from .graph_text import graph_text
from .options import Options
from .records import STATS, CompileRecord
from .sparsity import compressed as _compressed
from .sparsity.compressed import hessian, jacobian

__all__ = [
    "BatchingResult", "CompileRecord", "Options", "UnsupportedGraph", "batch_grads",
    "batched_grad", "compile_records", "counters", "dynbatch_backend", "fallback_reasons",
    "graph_text", "hessian", "jacobian", "register", "reset",
]
__version__ = "0.1.0"


def counters() -> dict[str, int]:
    """Cumulative counts: graphs, graphs_batched, grads_batched, grads_plain, fallbacks."""
    return dict(STATS.counters)


def fallback_reasons() -> dict[str, int]:
    return dict(STATS.fallback_reasons)


def compile_records() -> list[CompileRecord]:
    """The last 64 compiles, oldest first, with the text of each graph and a weak reference
    to the region each compiled into (``record.region``; None where the graph fell back)."""
    return list(STATS.records)


def reset() -> None:
    """Clear counters, records and the sparse derivatives' plans, wait for the frames traced
    aside, and stop the background compiles' worker process (Dynamo's own caches are
    torch._dynamo.reset())."""
    _stop_compiles()
    STATS.reset()
    _compressed.clear_caches()


def _stop_compiles() -> None:
    """Wait for the traces and compiles running aside, then stop the background worker once
    its compiles have finished (they may still send it graphs).  Also at exit: a thread still
    inside torch when the interpreter finalizes aborts the process."""
    from .capture import traced_aside
    from .lowering import background

    traced_aside.shutdown()
    background.shutdown()


atexit.register(_stop_compiles)


def register() -> None:
    """Register "dynbatch" with Dynamo in-process (the entry point does this too)."""
    _compat.register_backend(dynbatch_backend, "dynbatch")
