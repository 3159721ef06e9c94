"""The batching rule: ``torch.autograd.grad(..., is_grads_batched=True)`` on functorch.

Stage 2 with batching/grad_pass.py, which points grad calls here; stage 3's shape checks
run inside it, and stage 4 traces it.

Eager PyTorch maps the backward over the batch with the legacy
``torch._vmap_internals._vmap``, which loops per sample over every op that has
no legacy batching rule and cannot see symbolic sizes.  ``torch.func.vmap``
has batching rules for the backward ops and traces with a symbolic batch size,
so one call here becomes one set of batched kernels whatever B is.

This module is the rule alone; finding the calls to rewrite is batching/grad_pass.py.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .. import _compat
from . import markers
from . import shape_checks


def _as_tuple(x: Any) -> tuple:
    if isinstance(x, torch.Tensor):
        return (x,)
    if isinstance(x, dict):
        return tuple(x.values())
    return tuple(x)


def batched_grad(
    outputs: torch.Tensor | Sequence[torch.Tensor],
    inputs: torch.Tensor | Sequence[torch.Tensor],
    grad_outputs: torch.Tensor | Sequence[torch.Tensor | None] | None = None,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    only_inputs: bool = True,
    allow_unused: bool | None = None,
    is_grads_batched: bool = True,
    materialize_grads: bool = False,
) -> tuple[torch.Tensor | None, ...]:
    """Same contract as ``torch.autograd.grad(..., is_grads_batched=True)``.

    >>> x = torch.randn(3, requires_grad=True)
    >>> y = x.sin()
    >>> (jac,) = batched_grad(y, x, torch.eye(3))
    >>> torch.allclose(jac, torch.diag(x.cos()))
    True
    """
    if not is_grads_batched:
        raise ValueError("batched_grad is the is_grads_batched=True rule")
    if materialize_grads and allow_unused is False:
        raise ValueError(
            "Expected allow_unused to be True or not passed when materialize_grads=True, "
            "but got: allow_unused=False."
        )
    if allow_unused is None:
        allow_unused = materialize_grads
    if retain_graph is None:
        retain_graph = create_graph
    outputs, inputs = _as_tuple(outputs), _as_tuple(inputs)
    if len(inputs) == 0:
        raise RuntimeError("`inputs` argument to `grad()` cannot be empty.")
    cotangents = _compat.tensor_or_tensors_to_tuple(grad_outputs, len(outputs))
    # Eager pairs outputs with grad_outputs by zip(): extra cotangents are ignored.
    cotangents = cotangents[: len(outputs)]
    shape_checks.check_grad_outputs(outputs, cotangents, is_grads_batched=True)

    # vmap cannot return None, so the per-sample function returns the used
    # grads only and remembers which were None; that pattern is a property of
    # the autograd graph, the same for every sample.
    unused: list[bool] = []

    def vjp(*per_sample: torch.Tensor) -> tuple[torch.Tensor, ...]:
        grads = torch.autograd.grad(
            outputs,
            inputs,
            per_sample,
            retain_graph=retain_graph,
            create_graph=create_graph,
            allow_unused=allow_unused,
        )
        unused[:] = [g is None for g in grads]
        return tuple(g for g in grads if g is not None)

    # Markers around the batched backward let the memory plan find it (planning/memory.py).
    cotangents = markers.mark(cotangents, markers.COTANGENT, create_graph)
    used_grads = iter(markers.mark(torch.func.vmap(vjp)(*cotangents), markers.GRAD, create_graph))
    result = tuple(None if is_unused else next(used_grads) for is_unused in unused)
    if materialize_grads:
        # Eager materialises unused grads unbatched (zeros_like(input)); match it.
        result = tuple(
            g if g is not None else torch.zeros_like(inp, requires_grad=create_graph)
            for g, inp in zip(result, inputs)
        )
    return result


def forward_mode_jacobian(func, inputs, strict=False, vectorize=False):
    """``torch.autograd.functional``'s forward-mode Jacobian, as Dynamo traces it
    inside a dynbatch compile: ``torch.func.vmap`` over ``torch.func.jvp``.

    Eager's version maps the jvp with the legacy ``_vmap``, on which Dynamo
    graph-breaks; the user function then runs as a frame of its own, called
    with dual tensors.  This one is one graph, batched over the basis
    (symbolic in its size), with the same results and result layout.
    """
    if strict:
        raise RuntimeError(
            "torch.autograd.functional.jacobian: `strict=True` "
            'and `strategy="forward-mode"` are not supported together (yet). '
            "Please either set `strict=False` or "
            '`strategy="reverse-mode"`.'
        )
    if not vectorize:
        raise NotImplementedError(
            "Computing Jacobian using forward-AD or forward-over-reverse Hessian is"
            "only implemented for `vectorize=True`."
        )
    is_inputs_tuple, inputs = _compat.functional_as_tuple(inputs, "inputs", "jacobian")
    is_outputs_tuple, outputs = _compat.functional_as_tuple(func(*inputs), "outputs", "jacobian")
    numels = tuple(t.numel() for t in inputs)
    basis = _compat.functional_standard_basis(inputs, numels)

    def jvp(*tangents):
        tangents = tuple(t.view_as(x) for t, x in zip(tangents, inputs))
        return torch.func.jvp(lambda *xs: _as_tuple(func(*xs)), inputs, tangents)[1]

    columns = torch.func.vmap(jvp)(*basis)
    # As eager's: the basis dim comes last, then the input's shape.
    jacobian = tuple(
        tuple(j.permute(*range(1, j.ndim), 0).reshape((*out.shape, *x.shape))
              for j, x in zip(col.split(numels, dim=0), inputs))
        for col, out in zip(columns, outputs)
    )
    return _compat.functional_tuple_postprocess(jacobian, (is_outputs_tuple, is_inputs_tuple))


def vmap_in_one_call(func, in_dims, out_dims, randomness, chunk_size, *args, **kwargs):
    """``torch.vmap``'s ``vmap_impl`` with ``chunk_size`` ignored, as Dynamo traces it inside
    a dynbatch compile: one mapped call, where Dynamo would unroll a call per chunk (docs/
    design.md, stage 1).  The batched grads inside are then bounded by the memory budget."""
    vmap = _compat.functorch_vmap_module()
    vmap.lazy_load_decompositions()
    vmap._check_out_dims_is_int_or_int_pytree(out_dims, func)
    batch_size, flat_in_dims, flat_args, args_spec = vmap._process_batched_inputs(in_dims, args, func)
    return vmap._flat_vmap(func, batch_size, flat_in_dims, flat_args, args_spec, out_dims, randomness, **kwargs)
