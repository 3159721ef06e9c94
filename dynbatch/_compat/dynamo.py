"""Dynamo: its config, variables, exceptions and backend registry.  No version shim: each private
name below is alike on 2.11-2.14 (2.11.0-2.14.1 sources); a fallback only guards a later torch."""

from __future__ import annotations

from typing import Any, Callable

import torch


__all__ = ["compile_cache_counts", "compile_time_totals", "dynamo_control_exceptions", "dynamo_disable", "dynamo_exceptions", "dynamo_skip_frame",
           "dynamo_torch_function_handlers", "dynamo_utils_module", "graph_break",
           "mark_batch_dynamic", "register_backend", "restart_analysis_exceptions",
           "trace_autograd_ops_enabled"]


def trace_autograd_ops_enabled() -> Any:
    """A context manager that lets Dynamo put ``torch.autograd.grad`` in the graph (private config)."""
    return torch._dynamo.config.patch(trace_autograd_ops=True)


def dynamo_utils_module() -> Any:
    """The module whose ``run_node`` Dynamo calls to fake-run each captured node (private)."""
    import torch._dynamo.utils as dynamo_utils

    if not hasattr(dynamo_utils, "run_node"):  # pragma: no cover - version guard
        raise ImportError(f"torch {torch.__version__}: torch._dynamo.utils.run_node is gone")
    return dynamo_utils


def dynamo_torch_function_handlers() -> dict:
    """Dynamo's table of special handlers of torch functions (``torch.autograd.grad``'s
    among them): one cached dict, ``handler(variable, tx, *args, **kwargs)`` (private)."""
    from torch._dynamo.variables.torch import TorchInGraphFunctionVariable

    return TorchInGraphFunctionVariable._get_handlers()


def dynamo_exceptions() -> Any:
    """``torch._dynamo.exc``: ``Unsupported`` (a graph break) and ``SkipFrame`` (run the frame
    eagerly, its callees still compiled); private."""
    from torch._dynamo import exc

    return exc


def graph_break(gb_type: str, *, context: str, explanation: str) -> None:
    """Break Dynamo's graph at the call being traced, as its own handlers do: private
    ``exc.unimplemented``, keyword-only on 2.11-2.14 (none of them has ``unimplemented_v2``)."""
    dynamo_exceptions().unimplemented(gb_type=f"dynbatch: {gb_type}", context=context,
                                      explanation=explanation, hints=[])


def register_backend(fn: Callable, name: str) -> None:
    """``register_backend`` unless ``name`` has a compiler already (registering twice raises): private
    ``_COMPILER_FNS`` holds the loaded ones; ``_BACKENDS`` also holds entry points not yet loaded."""
    from torch._dynamo.backends import registry

    if name not in getattr(registry, "_COMPILER_FNS", {}):
        registry.register_backend(fn, name=name)


def dynamo_disable(fn: Callable) -> Callable:
    """Keep Dynamo out of ``fn``: a backward of a compiled graph runs whenever the
    user calls it, perhaps under an active torch.compile frame, and dynbatch's own
    plumbing is not user code to compile.  Public twin: ``torch.compiler.disable``."""
    return torch._dynamo.disable(fn, reason="dynbatch's region backward")


def dynamo_skip_frame(fn: Callable) -> Callable:
    """Dynamo does not trace ``fn``'s own frame, but compiled functions it calls still compile
    (``disable``'s default, recursive, would run them eagerly).  Public twin: ``torch.compiler.disable``."""
    return torch._dynamo.disable(fn, recursive=False, reason="dynbatch's chunk loop")


def mark_batch_dynamic(t: torch.Tensor) -> None:
    """Let Dynamo compile the batch dim of a chunk symbolic from its first call.  A chunk of one
    (even chunks have one only when the chunk size is below 3, or B is 1) is still specialised
    (``maybe_mark_dynamic``: documented API, though in ``torch._dynamo``)."""
    torch._dynamo.maybe_mark_dynamic(t, 0)


def dynamo_control_exceptions() -> tuple[type[BaseException], ...]:
    """Exceptions Dynamo uses to steer tracing; they must pass through us (all six on 2.11-2.14)."""
    from torch._subclasses import fake_tensor
    from torch.fx.experimental import symbolic_shapes

    excs: list[type[BaseException]] = [dynamo_exceptions().TorchDynamoException]
    for mod, name in [
        (fake_tensor, "DataDependentOutputException"),
        (fake_tensor, "DynamicOutputShapeException"),
        (fake_tensor, "UnsupportedOperatorException"),
        (fake_tensor, "UnsupportedFakeTensorException"),
        (symbolic_shapes, "GuardOnDataDependentSymNode"),
        (symbolic_shapes, "PendingUnbackedSymbolNotFound"),
    ]:
        if hasattr(mod, name):
            excs.append(getattr(mod, name))
    return tuple(excs)


def restart_analysis_exceptions() -> tuple[type[BaseException], ...]:
    """What AOTAutograd raises to make Dynamo re-trace the frame (e.g.
    TensorifyScalarRestartAnalysis); a backend must let these through."""
    restart = getattr(dynamo_exceptions(), "RestartAnalysis", None)
    return (restart,) if restart is not None else ()


# Torch's compile timers (``dynamo_timed`` keys) a first call is split by
# (NOTE [Where a first call goes] in records.py), and the name each is read as.
_COMPILE_TIMERS = {
    "backend": ("OutputGraph.call_user_compiler",),
    "inductor": ("compile_fx_inner",),
    "cpp_compile": ("compile_file", "async_compile.wait"),
}
_CACHE_COUNTERS = {
    "inductor": ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass"),
    "aot_autograd": ("autograd_cache_hit", "autograd_cache_miss", "autograd_cache_bypass"),
}


def compile_time_totals() -> dict[str, float]:
    """Seconds spent so far in each of torch's compile phases dynbatch splits a first call
    by (``torch._dynamo.utils.compilation_time_metrics``, private; same keys 2.11-2.14)."""
    from torch._dynamo.utils import compilation_time_metrics as metrics

    return {name: sum(sum(metrics.get(key, ())) for key in keys) for name, keys in _COMPILE_TIMERS.items()}


def compile_cache_counts() -> dict[str, int]:
    """Lookups so far in Inductor's FX graph cache and AOTAutograd's cache, by outcome
    (``torch._dynamo.utils.counters``, private; same names 2.11-2.14)."""
    from torch._dynamo.utils import counters

    return {key: counters[group][key] for group, keys in _CACHE_COUNTERS.items() for key in keys}
