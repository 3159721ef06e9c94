"""Forward mode's zero tangents with symbolic sizes (part of stage 1, capture).

NOTE [Zero tangents keep sizes symbolic]
Forward mode gives each tensor that is not a dual an efficient zero tangent (a
ZeroTensor).  aten's ZeroTensor kernels of mul/div/add/sub (BinaryOps.cpp) build
their result from the broadcast sizes read as ints, so a jvp through ``u * 2``
or ``u + c`` specialised every size: ``jacfwd`` (or forward-mode
``functional.jacobian``) compiled one graph per input size.  The kernels below
are aten's, with symbolic sizes; dynbatch registers them for the ZeroTensor
dispatch key only while it compiles (grad_calls.capture_scope).
"""

from __future__ import annotations

import contextlib
from numbers import Number

import torch

from .. import _compat
from . import batch_rules

Operand = torch.Tensor | Number  # a Python number arrives as itself (a wrapped number)


def _is_zero(x: Operand) -> bool:
    return isinstance(x, torch.Tensor) and _compat.is_zero_tensor(x)


def _result(self: Operand, other: Operand, *, true_division: bool = False) -> dict:
    """Size, dtype and device of the result, as aten's kernels compute them,
    without calling an op on a ZeroTensor (its fallback materialises it at int sizes)."""

    def probe(x):  # dtype and "dimension category" only
        return torch.empty((0,) if x.dim() else (), dtype=x.dtype, device="meta") if isinstance(x, torch.Tensor) else x

    dtype = torch.result_type(probe(self), probe(other))
    if true_division and not (dtype.is_floating_point or dtype.is_complex):
        dtype = torch.get_default_dtype()
    tensors = [x for x in (self, other) if isinstance(x, torch.Tensor)]
    # aten's correct_out_device: self on the CPU (a number is a CPU tensor there) takes other's device
    device = tensors[-1].device if not isinstance(self, torch.Tensor) or self.device.type == "cpu" \
        else self.device
    return dict(size=torch.broadcast_shapes(*(t.shape for t in tensors)), dtype=dtype, device=device)


def _zeros(out: dict) -> torch.Tensor:
    return torch.ops.aten._efficientzerotensor.default(out["size"], dtype=out["dtype"], device=out["device"])


def _copy(x: Operand, out: dict) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        return torch.full(out["size"], x, dtype=out["dtype"], device=out["device"])
    return torch.ops.aten._to_copy.default(x.expand(out["size"]), dtype=out["dtype"], device=out["device"])


def mul(self: Operand, other: Operand) -> torch.Tensor:
    return _zeros(_result(self, other))


def add(self: Operand, other: Operand, *, alpha: Number = 1) -> torch.Tensor:
    out = _result(self, other)
    if _is_zero(self) and _is_zero(other):
        return _zeros(out)
    if _is_zero(self):
        result = _copy(other, out)
        return result if alpha == 1 else result.mul(alpha)
    return _copy(self, out)


def sub(self: Operand, other: Operand, *, alpha: Number = 1) -> torch.Tensor:
    return add(self, other, alpha=-alpha)


def div(self: Operand, other: Operand) -> torch.Tensor:
    out = _result(self, other, true_division=True)
    if _is_zero(self):  # 0/x is zero, 0/0 NaN, x/0 inf: aten's choices, kept
        return torch.full(out["size"], float("nan"), dtype=out["dtype"], device=out["device"]) \
            if _is_zero(other) else _zeros(out)
    return torch.full(out["size"], float("inf"), dtype=out["dtype"], device=out["device"])


def symbolic_zero_tangents() -> contextlib.AbstractContextManager:
    """The kernels above for the ZeroTensor key, until the context exits."""
    aten = torch.ops.aten
    return batch_rules.override_kernels(
        "aten", {aten.mul.Tensor: mul, aten.add.Tensor: add, aten.sub.Tensor: sub, aten.div.Tensor: div},
        "ZeroTensor")
