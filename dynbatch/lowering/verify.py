"""``dynbatch.verify``: each compiled graph's first call checked against eager.

The net for miscompiles nobody has found yet (NOTE [Verify the first call]).  A thin
wrapper around a graph's compiled callable (a ``region.Region``); the backend puts it
there when the option is on, and nothing else knows of it.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import torch

from ..records import STATS, CompileRecord

log = logging.getLogger("dynbatch")

# NOTE [Verify the first call]
# With ``options={"dynbatch.verify": True}`` the first call of each compiled graph
# also runs the graph Dynamo captured eagerly (eager autograd, eager's batched grads),
# on copies of the inputs the graph writes in place, and compares every output and
# every written input.  Equal: the compiled outputs are returned and later calls run
# the compiled code alone.  Different: eager's outputs (and eager's writes) are
# returned, the graph runs eagerly from then on, and the reason is logged (WARNING)
# and counted as a fallback (``dynbatch.fallback_reasons()``).  A graph with random
# ops is not verified (eager would draw other numbers); that is logged too.
# It checks what the graph returns, batched grads computed inside it included; a
# backward taken from outside runs programs that dynbatch compiles as graphs of
# their own (verified the same way), except the plain backward, which is
# AOTAutograd's compiled backward and is not checked.
# A result eager can differentiate (a create_graph grad) must be differentiable too.
# "Equal" is per dtype, relative to the largest magnitude of eager's output: miscompiles
# show as errors of percents; reordered float sums as errors near the dtype's epsilon.
_RTOL = {torch.float64: 1e-6, torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 5e-2,
         torch.complex128: 1e-6, torch.complex64: 1e-3}


def mismatch(compiled: Any, eager: Any) -> str | None:
    """Why ``compiled`` is not ``eager`` (lists and tuples of outputs); None when they agree."""
    c_leaves, e_leaves = _leaves(compiled), _leaves(eager)
    if len(c_leaves) != len(e_leaves):
        return f"{len(c_leaves)} outputs where eager has {len(e_leaves)}"
    for i, (c, e) in enumerate(zip(c_leaves, e_leaves)):
        why = _tensor_mismatch(c, e) if isinstance(e, torch.Tensor) else (
            None if c == e else f"{c!r} where eager has {e!r}")
        if why is not None:
            return f"output {i}: {why}"
    return None


def _leaves(outputs: Any) -> list[Any]:
    """A graph's outputs, flat (Dynamo's graphs return lists and tuples of tensors)."""
    if isinstance(outputs, (list, tuple)):
        return [leaf for o in outputs for leaf in _leaves(o)]
    return [outputs]


def _tensor_mismatch(c: Any, e: torch.Tensor) -> str | None:
    if not isinstance(c, torch.Tensor) or c.shape != e.shape or c.dtype != e.dtype:
        return (f"{type(c).__name__} {getattr(c, 'dtype', '')}{list(getattr(c, 'shape', []))} where eager has "
                f"Tensor {e.dtype}{list(e.shape)}")
    if e.requires_grad and not c.requires_grad:
        return "not differentiable where eager's is (requires_grad=False: a create_graph grad without grad_fn)"
    c, e = c.detach(), e.detach()
    rtol = _RTOL.get(e.dtype)
    if rtol is None:  # integers and bools: exact
        return None if torch.equal(c, e) else "values differ"
    if not torch.equal(c.isnan(), e.isnan()):
        return "NaN at different places"
    c, e = c.nan_to_num(0.0, 0.0, 0.0), e.nan_to_num(0.0, 0.0, 0.0)
    if not torch.equal(c.isinf() if not c.is_complex() else c.abs().isinf(),
                       e.isinf() if not e.is_complex() else e.abs().isinf()):
        return "infinities at different places"
    finite = e.abs() < float("inf")
    if e.numel() == 0 or not bool(finite.any()):
        return None
    scale = float(e.abs()[finite].max())
    error = float((c - e).abs()[finite].max())
    if error > rtol * scale + rtol * 1e-6:
        return f"max |compiled - eager| = {error:.3g} where max |eager| = {scale:.3g} ({e.dtype}, rtol {rtol:g})"
    return None


class Verified:
    """A compiled graph whose first call is checked against ``eager`` (the captured graph)."""

    def __init__(self, compiled: Callable[..., Any], eager: Callable[..., Any], record: CompileRecord,
                 written_inputs: Sequence[int]) -> None:
        self.compiled = compiled
        self.eager = eager
        self.record = record
        self.written_inputs = tuple(written_inputs)
        self.state = "first"  # then "compiled" or "eager"

    def __call__(self, *args: Any) -> Any:
        if self.state == "compiled":
            return self.compiled(*args)
        if self.state == "eager":
            return self.eager(*args)
        return self._first_call(list(args))

    def _first_call(self, args: list[Any]) -> Any:
        if self.record.random_ops:
            log.info("dynbatch: verify: a graph with random ops (%s) is not verified: eager would draw "
                     "other numbers", ", ".join(self.record.random_ops))
            self.state = "compiled"
            return self.compiled(*args)
        eager_args = list(args)
        for i in self.written_inputs:
            eager_args[i] = args[i].clone()
        eager_outs = self.eager(*eager_args)
        compiled_outs = self.compiled(*args)
        why = mismatch(compiled_outs, eager_outs) or mismatch(
            [args[i] for i in self.written_inputs], [eager_args[i] for i in self.written_inputs])
        if why is None:
            self.state = "compiled"
            return compiled_outs
        with torch.no_grad():  # the inputs as eager left them
            for i in self.written_inputs:
                args[i].copy_(eager_args[i])
        self.state = "eager"
        reason = f"verify: the compiled graph's first call differs from eager's: {why}"
        STATS.fell_back_later(self.record, reason)
        log.warning("dynbatch: %s; this graph runs eagerly from now on", reason)
        return eager_outs
