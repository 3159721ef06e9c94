"""Stage 3: shape checks for batched ``grad_outputs`` that hold for any batch size.

These mirror ``torch.autograd._make_grads``: sizes are compared with
``sym_eq`` and asserted with ``expect_true``, so under a symbolic batch size
the check becomes a guard or a runtime assert instead of specialising the
size.  Messages are eager's own, so a log line reads like the error the user
would see.  (The error the user actually sees comes from eager itself: see
NOTE [Errors are eager's] in capture/grad_calls.py.)
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .. import _compat


def check_grad_outputs(
    outputs: Sequence[torch.Tensor],
    grad_outputs: Sequence[Any],
    *,
    is_grads_batched: bool,
) -> None:
    """Raise eager's error if ``grad_outputs`` cannot be paired with ``outputs``."""
    for i, (out, grad) in enumerate(zip(outputs, grad_outputs)):
        if grad is None:
            _check_implicit_grad(out, is_grads_batched)
            continue
        if not isinstance(grad, torch.Tensor):
            raise TypeError(
                "gradients can be either Tensors or None, but got " + type(grad).__name__
            )
        _check_sizes(i, out, grad, is_grads_batched)
        if out.dtype.is_complex != grad.dtype.is_complex:
            raise RuntimeError(
                "For complex Tensors, both grad_output and output are required to have "
                f"the same dtype. Mismatch in dtype: grad_output[{i}] has a dtype of "
                f"{grad.dtype} and output[{i}] has a dtype of {out.dtype}."
            )
    if is_grads_batched:
        check_batch_sizes_agree(grad_outputs)


def _check_sizes(i: int, out: torch.Tensor, grad: torch.Tensor, batched: bool) -> None:
    if batched:
        if grad.dim() == 0:
            raise IndexError("invalid index of a 0-dim tensor.")
        # eager indexes grad[0]; compare the trailing sizes without touching data.
        per_sample = grad.shape[1:]
    else:
        per_sample = grad.shape
    if _compat.expect_true(_compat.sym_eq(out.shape, per_sample)):
        return
    out_shape, grad_shape = _compat.shapes_for_message(out, grad[0] if batched else grad, batched)
    if batched:
        raise RuntimeError(
            "If `is_grads_batched=True`, we interpret the first dimension of each "
            "grad_output as the batch dimension. The sizes of the remaining dimensions "
            "are expected to match the shape of corresponding output, but a mismatch "
            f"was detected: grad_output[{i}] has a shape of {grad_shape} and "
            f"output[{i}] has a shape of {out_shape}. If you only want some tensors in "
            "`grad_output` to be considered batched, consider using vmap."
        )
    raise RuntimeError(
        f"Mismatch in shape: grad_output[{i}] has a shape of {grad_shape} and "
        f"output[{i}] has a shape of {out_shape}."
    )


def _check_implicit_grad(out: torch.Tensor, batched: bool) -> None:
    if out.requires_grad and out.numel() != 1:
        raise RuntimeError("grad can be implicitly created only for scalar outputs")
    if out.requires_grad and not out.dtype.is_floating_point:
        raise RuntimeError(
            "grad can be implicitly created only for real scalar outputs"
            f" but got {out.dtype}"
        )
    if batched:
        # Eager builds an unbatched ones_like() (or passes None on) and then
        # fails to map over it; there is no batched meaning to copy.
        raise ValueError(
            "dynbatch: a grad_output is None under is_grads_batched=True; eager "
            "cannot batch an implicit gradient either"
        )


def check_batch_sizes_agree(grad_outputs: Sequence[Any]) -> None:
    """All batched grad_outputs must share their first dimension."""
    sizes = [(i, g.shape[0]) for i, g in enumerate(grad_outputs) if isinstance(g, torch.Tensor)]
    if not sizes:
        return
    i0, b0 = sizes[0]
    # Eager indexes grad_outputs[0][0]; Dynamo always specialises a size of 0.
    if isinstance(b0, int) and b0 == 0:
        raise IndexError("index 0 is out of bounds for dimension 0 with size 0")
    for i, b in sizes[1:]:
        if not _compat.expect_true(_compat.sym_eq(b, b0)):
            raise ValueError(
                "is_grads_batched=True: every grad_output must have the same batch size, "
                f"but grad_outputs[{i0}] has batch size {b0} and grad_outputs[{i}] has "
                f"batch size {b}"
            )
