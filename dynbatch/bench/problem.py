"""What a workload hands the benchmark: a function to differentiate, its cases, its floor.

A :class:`Problem` says *what* is differentiated (the rule); how each variant
batches the backward (the plumbing) lives in variants.py and never looks
inside a problem beyond these fields.  Every variant computes the same thing:
for each cotangent ``v`` in ``cotangents`` (shape ``[B, *f(x).shape]``), the
vector-Jacobian product ``v^T df/dx``, stacked to ``[B, *x.shape]``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch

Tensor = torch.Tensor


@dataclasses.dataclass(frozen=True)
class Floor:
    """The matrix products any batched backward of a case must do, timed alone.

    ``make(device)`` allocates the operands once and returns a thunk that runs
    the products; ``what`` says which products, for the report.
    """

    what: str
    make: Callable[[torch.device], Callable[[], Any]]


@dataclasses.dataclass(frozen=True)
class BatchedMemory:
    """Estimated peak bytes of a batched backward that holds all B samples at once.

    Two figures, because a compiled program fuses chains of pointwise ops and so
    keeps fewer ``[B, ...]`` buffers alive than eager PyTorch does.
    """

    eager: int  # eager PyTorch: every intermediate of the B samples materialised
    compiled: int  # a compiled program (Inductor, XLA)

    def bytes(self, compiled: bool) -> int:
        return self.compiled if compiled else self.eager


@dataclasses.dataclass(frozen=True)
class Case:
    """One point of a problem's batch-size sweep."""

    label: str  # e.g. "B=128" or "N=24", shown in tables
    batch: int  # B: how many cotangents (rows of the Jacobian) the case asks for
    x: Tensor  # the primal input, on the run's device
    cotangents: Tensor  # [B, *f(x).shape], on the run's device
    floor: Floor
    # What a backward holding all B samples at once needs (None: small enough never
    # to check). The runner skips a column whose share of it does not fit in the
    # memory available (runner.py, "the memory guard").
    batched_memory: BatchedMemory | None = None


@dataclasses.dataclass(frozen=True)
class Problem:
    """A function written once per dialect, and the cases to run it on.

    ``f`` may itself call ``torch.autograd.grad(create_graph=True)`` (Hessians,
    Laplacians); ``f_func`` is the same mathematics in the torch.func dialect
    (``torch.func.grad`` instead), which vmap/vjp can transform.  ``jax_f``
    builds the JAX dialect on demand, so JAX is imported only when asked for.
    """

    workload: str  # the workload this belongs to, e.g. "mlp_jacobian"
    name: str  # unique, e.g. "mlp_jacobian/w128"
    description: str
    f: Callable[[Tensor], Tensor]
    cases: Sequence[Case]
    f_func: Callable[[Tensor], Tensor] | None = None
    # Called as post(grads) on every variant's [B, *x.shape] result, inside the
    # timed region; written with methods torch tensors and jax arrays share.
    post: Callable[[Any], Any] | None = None
    # Split the cotangents in chunks of this many rows, one call per chunk.
    chunk: int | None = None
    # Replaces grad(..., is_grads_batched=True) in the batched variants, e.g.
    # torch.autograd.functional.jacobian(vectorize=True). Called as (x, V).
    batched_api: Callable[[Tensor, Tensor], Tensor] | None = None
    jax_f: Callable[[], Callable[[Any], Any]] | None = None

    @property
    def func_f(self) -> Callable[[Tensor], Tensor]:
        return self.f_func or self.f


# --- floors ---------------------------------------------------------------

def mm_floor(shapes: Sequence[tuple[int, int, int]], what: str, dtype=torch.float32) -> Floor:
    """A floor made of ``[m, k] @ [k, n]`` products, one per ``(m, k, n)``."""

    def make(device: torch.device):
        gen = torch.Generator().manual_seed(0)
        pairs = [
            (torch.randn(m, k, generator=gen, dtype=dtype).to(device),
             torch.randn(k, n, generator=gen, dtype=dtype).to(device))
            for m, k, n in shapes
        ]

        def run():
            return [a @ b for a, b in pairs]

        return run

    return Floor(what, make)


def conv_input_grad_floor(
    convs: Sequence[tuple[tuple[int, ...], tuple[int, ...], dict]],
    mms: Sequence[tuple[int, int, int]],
    what: str,
    dtype=torch.float32,
) -> Floor:
    """Input-gradient convolutions ``(grad_out shape, weight shape, conv kwargs)`` plus products."""
    mm = mm_floor(mms, what, dtype)

    def make(device: torch.device):
        gen = torch.Generator().manual_seed(0)
        ops = [
            (torch.randn(g, generator=gen, dtype=dtype).to(device),
             torch.randn(w, generator=gen, dtype=dtype).to(device), kw)
            for g, w, kw in convs
        ]
        products = mm.make(device)

        def run():
            outs = [torch.nn.functional.conv_transpose2d(g, w, **kw) for g, w, kw in ops]
            return outs, products()

        return run

    return Floor(what, make)
