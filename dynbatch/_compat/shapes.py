"""Symbolic shapes, fake tensors and FX: guards, hints, tracing contexts, printers.
No version shim: each name below is alike on 2.11-2.14 (2.11.0-2.14.1 sources), private or, for
``torch.fx.experimental.symbolic_shapes``'s, experimental; a fallback only guards a later torch."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from .functorch import outside_legacy_vmap


__all__ = ["add_shape_guard", "backed_hints", "empty_graph_like", "expect_true", "guard_printer",
           "has_unbacked_symbols", "ignored_shape_guards", "in_tracing_context", "is_fake", "real_tensors",
           "realized_graph_module", "size_hint", "sym_eq", "tracing_context"]


def _guarding_frames(most: int = 2) -> str:
    """The innermost frames that asked for a guard, past the ShapeEnv's and sympy's own."""
    import traceback

    skip = ("/torch/fx/experimental/", "/sympy/", "/torch/utils/_sympy/", "/torch/__init__.py", "/dynbatch/_compat/")
    frames = [f for f in traceback.extract_stack()[:-2] if not any(s in f.filename for s in skip)]
    return "; ".join(f"{'/'.join(f.filename.split('/')[-2:])}:{f.lineno} {f.name}" for f in reversed(frames[-most:]))


@contextlib.contextmanager
def ignored_shape_guards(shape_env: Any) -> Iterator[list[str] | None]:
    """The guards a frozen ShapeEnv ignores in the block, as text (``expr == value``), or
    None where it cannot tell.  Its ``_check_frozen`` (2.11-2.14) sees each, and also
    those asked while guards are suppressed (FakeTensor's cache rebuilds a view with
    ``set_`` so), which no frame would have installed: those are left out, as its counter
    ("ignored_backward_guard") does not."""
    seen: list[str] = []
    check = getattr(shape_env, "_check_frozen", None)
    suppressed = getattr(shape_env, "_suppress_guards_tls", None)
    if check is None or suppressed is None:  # pragma: no cover - version guard: the counter tells
        yield None
        return

    def noting(expr: Any, concrete_val: Any) -> None:
        if shape_env.frozen and not suppressed():
            seen.append(f"{expr} == {concrete_val} (at {_guarding_frames()})")
        check(expr, concrete_val)

    shape_env._check_frozen = noting
    try:
        yield seen
    finally:
        del shape_env._check_frozen

def sym_eq(a: Any, b: Any) -> Any:
    from torch.fx.experimental.symbolic_shapes import sym_eq as _sym_eq

    return _sym_eq(a, b)


def expect_true(a: Any) -> bool:
    from torch.fx.experimental.symbolic_shapes import expect_true as _expect_true

    return _expect_true(a)


def has_unbacked_symbols(x: Any) -> bool:
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    return bool(free_unbacked_symbols(x))


def add_shape_guard(condition: Any) -> None:
    """Guard the compiled frame on a sympy condition of its size symbols (true at the example)."""
    shape_env = getattr(getattr(tracing_context(), "fake_mode", None), "shape_env", None)
    if shape_env is not None:
        shape_env.evaluate_expr(condition)


def tracing_context() -> Any:
    """Dynamo's tracing context of the frame being compiled (None outside a compile)."""
    from torch._guards import TracingContext

    return TracingContext.try_get()


@contextlib.contextmanager
def in_tracing_context(context: Any) -> Iterator[None]:
    """Re-enter a frame's tracing context after its compile (a lowering made later)."""
    from torch._guards import tracing

    with tracing(context):
        yield


def size_hint(size: Any) -> int | None:
    """An int, or a SymInt's value in the example inputs (None for one without)."""
    if isinstance(size, torch.SymInt):
        return int(size.node.hint) if size.node.has_hint() else None
    return int(size)


def backed_hints(shape_env: Any) -> dict:
    """Symbol -> value in the example inputs (``backed_var_to_val`` on 2.11-2.14)."""
    return shape_env.backed_var_to_val


@contextlib.contextmanager
def real_tensors() -> Iterator[None]:
    """A context where new tensors are plain real tensors: outside a compile's
    FakeTensorMode and outside the user's transforms (functorch's, eager's legacy vmap),
    which a compile may run under (a Hessian's outer vmap)."""
    from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily(), outside_legacy_vmap(), temporarily_clear_interpreter_stack():
        yield


def is_fake(t: Any) -> bool:
    """Whether ``t`` is a FakeTensor (or a subclass wrapping one): a value only in shape."""
    from torch._subclasses.fake_tensor import is_fake as _is_fake

    return _is_fake(t)


def realized_graph_module(gm: Any) -> Any:
    """``gm`` with its generated ``forward`` in place: Dynamo will not trace into
    a lazy graph module's placeholder ``_lazy_forward`` (MOD_SKIPLIST)."""
    real_recompile = getattr(gm, "real_recompile", None)  # _LazyGraphModule only
    if real_recompile is not None:
        real_recompile()
    return gm


def empty_graph_like(graph: torch.fx.Graph) -> torch.fx.Graph:
    """An empty graph that generates code as ``graph`` does: its private ``_codegen``
    holds Dynamo's pytree handling of inputs and outputs."""
    new = torch.fx.Graph()
    new._codegen = graph._codegen
    return new


def guard_printer() -> Any:
    """The printer that writes sympy expressions as Python, as Dynamo prints its guards."""
    from torch.utils._sympy.printers import PythonPrinter

    return PythonPrinter()
