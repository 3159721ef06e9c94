"""Dynamo: its config, variables, exceptions and backend registry.  No version shim: each private
name below is alike on 2.11-2.14 (2.11.0-2.14.1 sources); a fallback only guards a later torch."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch


__all__ = ["compile_cache_counts", "compile_time_totals", "current_global_state", "dynamo_control_exceptions",
           "dynamo_disable", "dynamo_exceptions", "dynamo_skip_frame", "dynamo_torch_function_handlers",
           "dynamo_utils_module", "frame_compile_context", "frame_runs_eagerly", "fx_tracing_flag_is_global",
           "global_state_at_frame", "graph_break", "mark_batch_dynamic", "nested_fx_trace_errors_set",
           "no_fullgraph_count_for_this_call", "register_backend", "restart_analysis_exceptions",
           "trace_autograd_ops_enabled", "uncount_frame_compile"]


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


def frame_runs_eagerly() -> Any:
    """What Dynamo's frame callback returns to run this call of the frame without compiling it,
    its callees on code already compiled or eagerly, and ask again at the next call (private
    ``ConvertFrameReturn``; the stance "eager_then_compile" returns its like)."""
    from torch._dynamo.types import ConvertFrameReturn, FrameAction, FrameExecStrategy

    return ConvertFrameReturn(frame_exec_strategy=FrameExecStrategy(FrameAction.DEFAULT, FrameAction.RUN_ONLY),
                              apply_to_code=False)


def no_fullgraph_count_for_this_call() -> None:
    """Leave this call out of ``fullgraph=True``'s count of compiled frames: after a call that
    counted none it raises "found no compiled frames" (2.13-2.14), and a frame run eagerly for
    now counts none.  Private ``set_fullgraph_compiled_frame_count``: 0 starts the count, -1
    ends it (the call's check then reads -1 and passes); it takes no other value.  2.11 has
    no such check."""
    from torch._C._dynamo import eval_frame

    setter = getattr(eval_frame, "set_fullgraph_compiled_frame_count", None)
    if setter is not None:
        setter(-1)


def fx_tracing_flag_is_global() -> bool:
    """Whether FX's "symbolic tracing" flag is process-wide (2.11-2.13: a module global that
    ``make_fx`` sets; 2.14 keeps it per thread, ``_is_fx_tracing_tls``).  While it is set, a call
    of a compiled function on another thread raises "Detected that you are using FX to
    symbolically trace a dynamo-optimized function" unless Dynamo's private config
    ``error_on_nested_fx_trace`` is off (then the call runs eagerly)."""
    return not hasattr(torch.fx._symbolic_trace, "_is_fx_tracing_tls")


def nested_fx_trace_errors_set(value: bool) -> Callable[[], None]:
    """Dynamo's private ``error_on_nested_fx_trace`` set to ``value`` on every thread; returns
    what undoes it.  Where a config entry keeps the value code sets per context (2.13: a
    ContextVar, so a thread's own), the entry's forced value, which every context reads
    first, carries it; elsewhere the module attribute does."""
    config = torch._dynamo.config
    entry = getattr(config, "_config", {}).get("error_on_nested_fx_trace")
    if entry is not None and hasattr(entry, "user_override") and hasattr(entry, "env_value_force"):
        previous = entry.env_value_force

        def undo() -> None:
            entry.env_value_force = previous

        entry.env_value_force = value
        return undo
    previous = config.error_on_nested_fx_trace
    config.error_on_nested_fx_trace = value
    return lambda: setattr(config, "error_on_nested_fx_trace", previous)


def uncount_frame_compile(compile_id: Any) -> None:
    """Take back the number Dynamo gave a call of a frame that compiled nothing (private
    ``convert_frame.FRAME_COMPILE_COUNTER``, 2.11-2.14): a compile whose number reaches
    ``accumulated_recompile_limit`` (256) fails, so a frame called 256 times while its trace
    runs aside could never compile again.  Only where no other call has taken one since."""
    from torch._dynamo import convert_frame

    counter = getattr(convert_frame, "FRAME_COMPILE_COUNTER", None)
    frame_id, number = getattr(compile_id, "frame_id", None), getattr(compile_id, "frame_compile_id", None)
    if counter is not None and frame_id is not None and number is not None and counter[frame_id] == number + 1:
        counter[frame_id] = number


def frame_compile_context(compile_id: Any) -> Any:
    """The context ``ConvertFrameAssert`` enters around ``convert_frame._compile`` (private,
    thread-local: a frame compiled on another thread enters it there)."""
    from torch._guards import CompileContext, compile_context

    return compile_context(CompileContext(compile_id))


@contextlib.contextmanager
def global_state_at_frame(state: Any) -> Iterator[None]:
    """Dynamo's global-state guard of the frame being compiled (``convert_frame.initial_global_state``,
    a module global ``ConvertFrameAssert`` sets around ``_compile``; private)."""
    import torch._dynamo.convert_frame as convert_frame

    saved, convert_frame.initial_global_state = convert_frame.initial_global_state, state
    try:
        yield
    finally:
        convert_frame.initial_global_state = saved


def current_global_state() -> Any:
    """The guard ``ConvertFrameAssert`` made for the frame now compiling on this thread."""
    import torch._dynamo.convert_frame as convert_frame

    return convert_frame.initial_global_state


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
