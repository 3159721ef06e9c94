"""Inductor: its config, compile entry points, lowerings, extern kernels and codegen helpers.
Version shims: ``inductor_stride_at_module``, ``inductor_inline_limits``.  Every other name is
private (no public API for it) and alike on 2.11-2.14 (2.11.0-2.14.1 sources), but for the
background compile's (Inductor's subprocess compile, read on 2.13.0 only: a release without one
of them compiles in the foreground, ``inductor_subprocess_compile_missing``)."""

from __future__ import annotations

import contextlib
import types
from typing import Any, Callable, Iterator

import torch

from .functorch import outside_legacy_vmap


__all__ = ["compile_fx", "inductor_compiled_graph_class", "compile_fx_inner", "custom_graph_pass_base", "inductor_cache_dir",
           "inductor_compile_fx_module", "inductor_compile_in_child", "inductor_decomposition_module",
           "inductor_fx_graph_cache", "inductor_graph_pickler_ops", "inductor_subprocess_compile_missing",
           "inductor_out_of_process_compile", "inductor_subprocess_pool",
           "inductor_config_patches", "inductor_config_value", "inductor_empty_strided_cpu",
           "inductor_fallback", "inductor_inline_limits", "inductor_lowerings",
           "inductor_patterns_registered", "inductor_stride_at_module", "inductor_sympy_subs",
           "inductor_wrapper_function", "is_symbolic", "raise_inductor_inline_limits",
           "register_extern_kernel", "storage_address", "storage_use_count"]


def inductor_config_patches(mode: str | None, options: dict | None) -> dict:
    """Translate torch.compile's ``mode``/``options`` as the inductor backend does, with its
    validation (``_TorchCompileInductorWrapper``: an unknown option raises as there)."""
    wrapper = torch._TorchCompileInductorWrapper(mode, options, None)
    return dict(wrapper.config)


def inductor_cache_dir() -> str:
    """Inductor's cache directory ($TORCHINDUCTOR_CACHE_DIR, else its per-user default)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()


def inductor_config_value(name: str) -> Any:
    """Inductor's global config setting ``name`` (what a graph gets unless its options patch it)."""
    from torch._inductor import config as inductor_config

    return getattr(inductor_config, name)


def compile_fx(gm: Any, example_inputs: Any, *, inner_compile: Callable, config_patches: dict) -> Any:
    from torch._inductor.compile_fx import compile_fx as _compile_fx

    return _compile_fx(gm, example_inputs, inner_compile=inner_compile, config_patches=config_patches)


def compile_fx_inner() -> Callable:
    from torch._inductor.compile_fx import compile_fx_inner as _inner

    return _inner


def inductor_decomposition_module() -> Any:
    """``torch._inductor.decomposition``, whose decompositions ask of sizes through its module
    global ``guard_or_false`` (2.11-2.14)."""
    from torch._inductor import decomposition

    return decomposition


def inductor_stride_at_module() -> Any:
    """The module whose global ``stride_at`` Inductor's C++ vectorizer calls (through
    ``stride_at_vec_range``, by its global name): ``torch._inductor.codegen.cpp`` on 2.11-2.12,
    ``torch._inductor.sizevars`` on 2.13-2.14.  Retire the cpp branch when 2.12 is dropped."""
    from torch._inductor import sizevars

    if hasattr(sizevars, "stride_at"):
        return sizevars
    from torch._inductor.codegen import cpp

    return cpp


def inductor_sympy_subs(expr: Any, replacements: dict) -> Any:
    """Inductor's substitution into an index expression (its symbols' assumptions kept)."""
    from torch._inductor.utils import sympy_subs

    return sympy_subs(expr, replacements)


def custom_graph_pass_base() -> type:
    """Base class Inductor requires of a cacheable ``post_grad_custom_pre_pass``."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    return CustomGraphPass


@contextlib.contextmanager
def inductor_lowerings(wrappers: dict) -> Iterator[None]:
    """Inductor's lowering of each op replaced by ``wrappers[op](op, lowering)`` for the
    length of the block (one graph's lowering); ``lowering`` is None for an op Inductor has
    no lowering of, which gets one for the block only."""
    from torch._inductor import lowering

    saved = {op: lowering.lowerings.get(op) for op in wrappers}
    try:
        for op, original in saved.items():
            lowering.lowerings[op] = wrappers[op](op, original)
        yield
    finally:
        for op, original in saved.items():
            if original is None:
                lowering.lowerings.pop(op, None)
            else:
                lowering.lowerings[op] = original


def inductor_fallback(op: torch._ops.OpOverload) -> Callable:
    """Inductor's lowering that calls the aten kernel (an extern call)."""
    from torch._inductor import lowering

    return lowering.fallback_handler(op, add_to_fallback_set=False)


def register_extern_kernel(name: str, fn: Callable) -> None:
    """Make ``fn`` callable from Inductor's generated code as ``extern_kernels.<name>``
    (where Inductor's own extern kernels live), also for code loaded from its FX cache."""
    from torch._inductor.select_algorithm import extern_kernels

    setattr(extern_kernels, name, fn)


def is_symbolic(size: Any) -> bool:
    """An Inductor IR size (sympy) or a SymInt that is not a plain number."""
    if isinstance(size, torch.SymInt):
        return size.node.expr.free_symbols != set()
    return bool(getattr(size, "free_symbols", None))


def inductor_inline_limits(device: str) -> tuple[int, int]:
    """The ops and loads of a pointwise body above which Inductor stores it instead of
    inlining it (ir.py ``has_large_inner_fn``, ``has_exceeded_max_reads``).  Plain ints on 2.11-2.12;
    2.13-2.14 default them to None, "the device's" (``realize_cpu_*``): no branch to retire."""
    from torch._inductor import config as c

    ops, reads = c.realize_opcount_threshold, c.realize_acc_reads_threshold
    cpu = device == "cpu"
    if ops is None:
        ops = c.realize_cpu_opcount_threshold if cpu else c._realize_opcount_threshold_default
    if reads is None:
        reads = c.realize_cpu_acc_reads_threshold if cpu else c._realize_acc_reads_threshold_default
    return ops, reads


def raise_inductor_inline_limits(device: str, ops: int, reads: int) -> None:
    """At least ``ops`` and ``reads`` (inductor_inline_limits) for the graph being
    compiled: the caller's config patch restores them."""
    from torch._inductor import config as c

    current_ops, current_reads = inductor_inline_limits(device)
    c.realize_opcount_threshold = max(current_ops, ops)
    c.realize_acc_reads_threshold = max(current_reads, reads)


def inductor_empty_strided_cpu() -> Callable[[Any, Any, torch.dtype], torch.Tensor]:
    """The function Inductor's generated code allocates a CPU buffer with: ``(size, stride, dtype)``."""
    return torch._C._dynamo.guards._empty_strided_cpu


def inductor_wrapper_function(compiled: Any) -> types.FunctionType | None:
    """The function of a compiled program's generated Python wrapper that runs a call
    (``Runner.call`` on 2.11-2.14; its module namespace is its ``__globals__``, where
    ``empty_strided_cpu`` is bound), or None (a C++ wrapper, an unknown output type)."""
    call = getattr(compiled, "current_callable", None)
    call = getattr(call, "__func__", call)
    return call if isinstance(call, types.FunctionType) else None


def storage_address(t: torch.Tensor) -> int:
    """The address of ``t``'s storage, for ``storage_use_count`` while ``t`` keeps it alive."""
    return t.untyped_storage()._cdata


def storage_use_count(address: int) -> int:
    """How many holders (tensors, storage objects) share the storage at ``address``, as
    cudagraph_trees reads it."""
    return torch._C._storage_Use_Count(address)


def inductor_patterns_registered(device: torch.device | None) -> None:
    """Register Inductor's pattern-matcher patterns now (lazily, at a process's first
    compile, otherwise), with both vmaps set aside: it traces example functions."""
    from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack
    from torch._inductor.fx_passes import joint_graph, post_grad

    with outside_legacy_vmap(), temporarily_clear_interpreter_stack():
        joint_graph.lazy_init(device)
        post_grad.lazy_init()


def inductor_compiled_graph_class() -> type:
    """Inductor's compiled graph (``output_code.CompiledFxGraph``), whose ``post_compile`` runs
    on every program Inductor hands out, compiled or loaded from a cache (private; 2.11-2.14)."""
    from torch._inductor.output_code import CompiledFxGraph

    return CompiledFxGraph


# --- the background compile (lowering/background.py) ---------------------------------
# Inductor's out-of-process compile (compile_fx_ext.py, compile_fx_subproc.py: what
# TORCHINDUCTOR_FX_COMPILE_MODE=subprocess runs), private and experimental upstream; read on
# 2.13.0.  A name missing on another release makes the background compile fall back to the
# foreground one, logged (background.applies).


def inductor_subprocess_compile_missing() -> str | None:
    """What of the pieces below this torch lacks, or None (every one is there)."""
    try:
        from torch._inductor.compile_fx_subproc import _SubprocessFxCompile
        from torch._inductor.compile_worker.subproc_pool import SubprocKind, SubprocPool  # noqa: F401
        from torch.fx._graph_pickler import GraphPickler, Options  # noqa: F401

        inductor_compile_fx_module()
        inductor_fx_graph_cache()._save_graph  # noqa: B018
        for name in ("serialize_compile", "_postprocess", "_run_in_child_subprocess"):
            getattr(_SubprocessFxCompile, name)
        if "ops_filter" not in Options.__dataclass_fields__:
            raise AttributeError("GraphPickler's Options has no ops_filter")
    except (ImportError, AttributeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def inductor_compile_fx_module() -> types.ModuleType:
    """``torch._inductor.compile_fx``, whose ``_compile_fx_inner`` calls its module global
    ``fx_codegen_and_compile`` on an FX-cache miss (the one compile of one aten graph)."""
    from torch._inductor import compile_fx as module

    if not callable(getattr(module, "fx_codegen_and_compile", None)):
        raise AttributeError("torch._inductor.compile_fx has no fx_codegen_and_compile")
    return module


def inductor_out_of_process_compile() -> Any:
    """Inductor's subprocess FxCompile: its ``serialize_compile(gm, example_inputs,
    inputs_to_check, graph_kwargs)`` gives ``(pickled input, constants)`` or None (a graph it
    cannot send), and ``_postprocess(output)`` replays the child's logs, warnings and metrics."""
    from torch._inductor.compile_fx_subproc import _SubprocessFxCompile

    return _SubprocessFxCompile()


def inductor_compile_in_child(pickled_input: Any, extra_env: dict) -> Any:
    """In a worker process: Inductor's compile of a pickled input, its output pickled (what
    ``_SubprocessFxCompile``'s pool runs), with the worker's Inductor caches cleared first."""
    from torch._inductor.compile_fx_subproc import _SubprocessFxCompile

    return _SubprocessFxCompile._run_in_child_subprocess(pickled_input, extra_env)


def inductor_subprocess_pool() -> Any:
    """A pool of one spawned worker behind Inductor's sidecar process (``SubprocPool``:
    ``submit(fn, *args)`` -> Future, ``shutdown()``), as ``_SubprocessFxCompile`` makes its own."""
    from torch._inductor.compile_worker.subproc_pool import SubprocKind, SubprocPool

    return SubprocPool(1, kind=SubprocKind.SPAWN)


def inductor_fx_graph_cache() -> type:
    """Inductor's FX graph cache (``codecache.FxGraphCache``): ``_save_graph(key,
    compiled_graph, ...)`` asserts a ``CompiledFxGraph``."""
    from torch._inductor.codecache import FxGraphCache

    return FxGraphCache


def _picklable_meta(key: str) -> bool:
    """GraphPickler's default metadata filter drops the module and source stacks, which hold
    classes, but not a backward node's ``fwd_nn_module_stack`` (2.11-2.14): a module made by
    ``torch.fx.symbolic_trace`` is of a class local to ``GraphModule.__new__``, which pickle
    refuses (MACE's e3nn modules, simplified by fx, compiled in the foreground)."""
    return not key.endswith(("nn_module_stack", "source_fn_stack"))


@contextlib.contextmanager
def inductor_graph_pickler_ops(prefixes: tuple[str, ...]) -> Iterator[None]:
    """Inside the block, ``GraphPickler.dumps`` (torch.fx._graph_pickler: what Inductor's
    subprocess compile pickles a graph and its output with) takes the ops whose names start
    with ``prefixes``, where its default filter takes aten's alone and bypasses the rest,
    and leaves out every stack of modules (``_picklable_meta``)."""
    from torch.fx._graph_pickler import GraphPickler, Options

    saved = GraphPickler.__dict__["dumps"]
    dumps = saved.__func__

    def dumps_with_ops(cls, obj, options=None):
        if options is None:
            options = Options(ops_filter=lambda name: name.startswith(prefixes),
                              node_metadata_key_filter=_picklable_meta)
        return dumps(cls, obj, options)

    GraphPickler.dumps = classmethod(dumps_with_ops)
    try:
        yield
    finally:
        GraphPickler.dumps = saved
