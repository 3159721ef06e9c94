"""Version shims and thin wrappers over private torch APIs, by torch subsystem.

Dynamo, AOTAutograd, functorch and Inductor internals move between releases;
the stages reach them through the small functions below.  Stage logic stays in
its stage (a stage module that patches torch internals itself says so), and a
hook that fails turns one feature off (fail_soft.py).  Tested: torch 2.11 - 2.14.

Only shims and wrappers, each hiding one private API or version difference; logic
built on them lives with the part it serves (region_aot_node.py, fake_cuda_guard.py;
the Inductor scheduler fix in lowering.py, a late lowering's fakes and guard check in
memory.py, the count of a fake run's unbacked sizes in capture.py).
"""

from __future__ import annotations

import contextlib
import types
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.autograd import forward_ad as _forward_ad
from torch.torch_version import TorchVersion

from . import fail_soft


# --- versions --------------------------------------------------------------------

TORCH_VERSION = TorchVersion(torch.__version__)

# Half-open range of the releases dynbatch is tested on.  Others install and run
# (pyproject.toml has no upper bound); dynbatch warns once at first use, and a
# hook whose internals moved turns itself off (``fail_soft.hook_failed``).  TorchVersion
# compares numerically, so "2.9" < "2.11" holds.
MIN_TORCH, MAX_TORCH = "2.11", "2.15"

# Dynamo traces Tensor.requires_grad_() inside a compiled function from 2.12 on
# (seen on 2.12.1 and 2.13.0); 2.11 graph-breaks on it (seen on 2.11.0), which
# also affects torch.autograd.functional.jacobian/hessian.
DYNAMO_TRACES_REQUIRES_GRAD_ = TORCH_VERSION >= "2.12"


def torch_is_supported() -> bool:
    return MIN_TORCH <= TORCH_VERSION < MAX_TORCH


def warn_once_if_untested() -> None:
    """At a backend's first compile (not at import: importing is not using)."""
    if not torch_is_supported():
        fail_soft.warn_once("version", f"dynbatch is tested on torch {MIN_TORCH} up to (not including) "
                                       f"{MAX_TORCH}, not {TORCH_VERSION}; a feature whose torch internals "
                                       "changed turns itself off with a warning")


# --- Dynamo ----------------------------------------------------------------------

def trace_autograd_ops_enabled() -> Any:
    """A context manager that lets Dynamo put ``torch.autograd.grad`` in the graph."""
    return torch._dynamo.config.patch(trace_autograd_ops=True)


def dynamo_utils_module() -> Any:
    """The module whose ``run_node`` Dynamo calls to fake-run each captured node."""
    import torch._dynamo.utils as dynamo_utils

    if not hasattr(dynamo_utils, "run_node"):  # pragma: no cover - version guard
        raise ImportError(f"torch {torch.__version__}: torch._dynamo.utils.run_node is gone")
    return dynamo_utils


def dynamo_torch_function_handlers() -> dict:
    """Dynamo's table of special handlers of torch functions (``torch.autograd.grad``'s
    among them): one cached dict, ``handler(variable, tx, *args, **kwargs)``."""
    from torch._dynamo.variables.torch import TorchInGraphFunctionVariable

    return TorchInGraphFunctionVariable._get_handlers()


def dynamo_exceptions() -> Any:
    """``torch._dynamo.exc``: ``Unsupported`` (a graph break) and ``SkipFrame`` (run the frame
    eagerly, its callees still compiled)."""
    from torch._dynamo import exc

    return exc


def graph_break(gb_type: str, *, context: str, explanation: str) -> None:
    """Break Dynamo's graph at the call being traced, as its own handlers do (``unimplemented``
    with keywords on 2.11-2.14; ``unimplemented_v2`` where a torch still has that name)."""
    exc = dynamo_exceptions()
    unimplemented = getattr(exc, "unimplemented_v2", None) or exc.unimplemented
    unimplemented(gb_type=f"dynbatch: {gb_type}", context=context, explanation=explanation, hints=[])


def register_backend(fn: Callable, name: str) -> None:
    """``register_backend`` unless ``name`` has a compiler already (registering twice raises).
    ``_COMPILER_FNS`` holds the loaded ones on 2.11-2.14; ``_BACKENDS`` cannot tell (it may
    hold the entry point itself, 2.14, or None, 2.13)."""
    from torch._dynamo.backends import registry

    if name not in getattr(registry, "_COMPILER_FNS", {}):
        registry.register_backend(fn, name=name)


def dynamo_disable(fn: Callable) -> Callable:
    """Keep Dynamo out of ``fn``: a backward of a compiled graph runs whenever the
    user calls it, perhaps under an active torch.compile frame, and dynbatch's own
    plumbing is not user code to compile."""
    return torch._dynamo.disable(fn, reason="dynbatch's region backward")


def dynamo_skip_frame(fn: Callable) -> Callable:
    """Dynamo does not trace ``fn``'s own frame, but compiled functions it calls still compile
    (``disable``'s default, recursive, would run them eagerly)."""
    return torch._dynamo.disable(fn, recursive=False, reason="dynbatch's chunk loop")


def mark_batch_dynamic(t: torch.Tensor) -> None:
    """Let Dynamo compile the batch dim of a chunk symbolic from its first call.  A chunk of one
    (even chunks have one only when the chunk size is below 3, or B is 1) is still specialised."""
    torch._dynamo.maybe_mark_dynamic(t, 0)


def dynamo_control_exceptions() -> tuple[type[BaseException], ...]:
    """Exceptions Dynamo uses to steer tracing; they must pass through us."""
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


# --- AOTAutograd -----------------------------------------------------------------

def aot_autograd(**kwargs: Any) -> Callable:
    from torch._dynamo.backends.common import aot_autograd as _aot_autograd

    return _aot_autograd(**kwargs)


def make_boxed_func(fn: Callable) -> Callable:
    from torch._functorch.aot_autograd import make_boxed_func as _make_boxed_func

    return _make_boxed_func(fn)


def aot_config_patch(**settings: Any) -> Any:
    """AOTAutograd config for one compile; settings this torch lacks are skipped."""
    import torch._functorch.config as aot_config

    return aot_config.patch(**{k: v for k, v in settings.items() if hasattr(aot_config, k)})


def aot_records_no_donated_buffers() -> None:
    """While AOTAutograd compiles a graph with ``donated_buffer=False``: record on its
    metadata that the backward has no donated buffers (``bw_donated_idxs = []``).
    AOTAutograd leaves None there, and its backward refuses ``retain_graph`` and
    ``create_graph`` unless the list is empty whenever the *global* flag is on at backward
    time; from torch 2.13 it reads the flag in the context the running backward copied
    when it started, where no toggle inside a region's backward reaches.  A lazily
    compiled backward first run with ``retain_graph`` sets [] itself; one compiled
    eagerly (symbolic sizes) or first run without it kept None."""
    context = torch._guards.TracingContext.try_get()
    meta = getattr(context, "fw_metadata", None)
    if meta is not None and getattr(meta, "bw_donated_idxs", ()) is None:
        meta.bw_donated_idxs = []


def aot_mutates_differentiable_input() -> bool:
    """While AOTAutograd compiles a graph: does it write in place to an input that
    requires grad?  Unknown metadata answers True (the cautious answer)."""
    context = torch._guards.TracingContext.try_get()
    meta = getattr(context, "fw_metadata", None)
    infos = getattr(meta, "input_info", None)
    if infos is None:
        return True
    return any(i.requires_grad and (i.mutates_data or i.mutates_metadata) for i in infos)


def aot_backward_graph(forward_cls: type) -> Any:
    """The aten backward graph of an AOTAutograd ``CompiledFunction`` class, as traced: kept for
    its lazy compile (2.11-2.14), compiled or not; None where not kept (a cached graph)."""
    graph = getattr(getattr(forward_cls, "_lazy_backward_info", None), "bw_module", None)
    return graph if isinstance(graph, torch.fx.GraphModule) else None


def aot_saved_for_backward(ctx: Any) -> tuple[list, list, list]:
    """(SymInts, tensors, opaque objects) an AOTAutograd node's forward saved, in its backward
    graph's order (2.13 keeps tensors saved without a version check, and opaques, apart)."""
    return (list(ctx.symints), [*ctx.saved_tensors, *getattr(ctx, "_tensors_no_vc_check", ())],
            list(getattr(ctx, "opaque_objects", ())))


def aot_mutated_inputs() -> tuple[int, ...]:
    """While AOTAutograd compiles a graph: the positions of the inputs it writes in place
    (a BatchNorm's running statistics in training mode), by its metadata."""
    context = torch._guards.TracingContext.try_get()
    infos = getattr(getattr(context, "fw_metadata", None), "input_info", None) or ()
    return tuple(i for i, info in enumerate(infos) if info.mutates_data or info.mutates_metadata)


GRAD_NODE_META = "dynbatch_grad"  # node.meta key: the Dynamo grad node a batched_grad call came from


def current_grad_node_name() -> str | None:
    """The Dynamo grad node AOTAutograd is tracing now (it replays node meta while it traces)."""
    meta = torch.fx.traceback.get_current_meta() if torch.fx.traceback.has_preserved_node_meta() else None
    return (meta or {}).get(GRAD_NODE_META)


# --- functorch and vmap (torch.func's, and eager's legacy one) -------------------

def functorch_transform_active() -> bool:
    return torch._C._functorch.peek_interpreter_stack() is not None


def current_vmap_level() -> int:
    from torch._C import _functorch

    return _functorch.current_level()


def functorch_level(t: torch.Tensor) -> int:
    """The vmap level of ``t``'s outermost functorch wrapper (-1: a plain tensor)."""
    return torch._C._functorch.maybe_get_level(t)


def is_functorch_wrapped(t: torch.Tensor) -> bool:
    return torch._C._functorch.is_functorch_wrapped_tensor(t)


def is_functorch_batched(t: torch.Tensor) -> bool:
    return torch._C._functorch.is_batchedtensor(t)


def unwrap_at(t: torch.Tensor, level: int) -> tuple[torch.Tensor, int | None]:
    """A tensor's (value, batch dim) at vmap ``level``, as a batching rule sees it:
    (t, None) when ``t`` is not batched at that level."""
    from torch._C import _functorch

    return _functorch._unwrap_batched(t, level)


def rewrap_batched(value: torch.Tensor, bdim: int, level: int) -> torch.Tensor:
    from torch._C import _functorch

    return _functorch._add_batch_dim(value, bdim, level)


def only_transform_is(level: int) -> bool:
    """Is the functorch transform at ``level`` the only one active (the top of a stack of one)?"""
    from torch._C import _functorch

    stack = _functorch.get_interpreter_stack()
    return stack is not None and len(stack) == 1 and stack[0].level() == level


def outside_functorch() -> Any:
    """A context without the top functorch transform: plain tensors dispatch as plain, and
    Dynamo compiles frames (it steps aside while a transform is active)."""
    from torch._functorch.pyfunctorch import temporarily_pop_interpreter_stack

    return temporarily_pop_interpreter_stack()


def below_vmap() -> Any:
    """Dispatch past functorch's batching layer (inside a batching rule)."""
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.FuncTorchBatched)
    return torch._C._ExcludeDispatchKeyGuard(keys)


def functorch_has_batch_rule(op: torch._ops.OpOverload) -> bool:
    """Does vmap batch ``op`` with a rule (C++, or one of functorch's Python
    decompositions), rather than its slow per-sample fallback?"""
    from torch._functorch.vmap import lazy_load_decompositions

    lazy_load_decompositions()  # functorch registers some rules only on first use
    return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "FuncTorchBatched")


def functorch_vmap_module() -> Any:
    """``torch._functorch.vmap``: ``vmap_impl`` (what ``torch.vmap`` calls) and its one-call branch."""
    import torch._functorch.vmap as vmap_module

    names = ("vmap_impl", "_process_batched_inputs", "_flat_vmap", "_check_out_dims_is_int_or_int_pytree")
    if not all(hasattr(vmap_module, n) for n in names):  # pragma: no cover - version guard
        raise ImportError(f"torch {torch.__version__}: torch._functorch.vmap moved")
    return vmap_module


def decomposition_table() -> dict:
    from torch._decomp import decomposition_table as table

    return table


# Legacy vmap's dispatch key, parsed once: the pybind enum lacks it, and parsing its
# name on each query costs ~3 us, four times per batched backward.
_VMAP_MODE = torch._C._parse_dispatch_key("VmapMode")


def legacy_vmap_level() -> int:
    """How deep eager's legacy vmap (``torch._vmap_internals``) is nested; 0 outside it."""
    keyed = torch._C._dispatch_tls_is_dispatch_key_included(_VMAP_MODE)
    level = torch._C._vmapmode_increment_nesting()
    torch._C._vmapmode_decrement_nesting()  # back at 0 it also turns the key off
    if keyed and level == 1:  # a device thread's key without its count (region_batching._legacy_level_of)
        torch._C._dispatch_tls_set_dispatch_key_included(_VMAP_MODE, True)
    return level - 1


def legacy_vmap_keyed() -> bool:
    """Is legacy vmap's dispatch key on in this thread?  Where it is off, no legacy
    BatchedTensor is live (vmap unwraps its outputs as it exits; the engine's device threads
    inherit the key): one C++ call instead of a check of each tensor."""
    return torch._C._dispatch_tls_is_dispatch_key_included(_VMAP_MODE)


def legacy_vmap_active() -> bool:
    """Inside eager's legacy vmap, also on a device thread that has its key without its level."""
    return bool(legacy_vmap_level()) or legacy_vmap_keyed()


def is_legacy_batched(t: torch.Tensor) -> bool:
    return torch._C._functorch.is_legacy_batchedtensor(t)


def legacy_remove_batch_dim(t: torch.Tensor, level: int, batch_size: int, out_dim: int) -> torch.Tensor:
    """The physical tensor of legacy vmap ``level``; a tensor not batched there is expanded to ``batch_size``."""
    return torch._remove_batch_dim(t, level, batch_size, out_dim)


def legacy_add_batch_dim(t: torch.Tensor, batch_dim: int, level: int) -> torch.Tensor:
    return torch._add_batch_dim(t, batch_dim, level)


class outside_legacy_vmap:  # noqa: N801 - used as a function, like contextlib's
    """Leave eager's legacy vmap mode, levels and dispatch key, until the context exits.
    A class, not a generator: every batched grad through a compiled graph enters it."""

    def __enter__(self) -> None:
        self.depth = depth = legacy_vmap_level()
        for _ in range(depth):
            torch._C._vmapmode_decrement_nesting()
        # On a device thread the key is on with a count of 0 (region_batching._legacy_level_of).
        self.keyed = torch._C._dispatch_tls_is_dispatch_key_included(_VMAP_MODE)
        if self.keyed:
            torch._C._dispatch_tls_set_dispatch_key_included(_VMAP_MODE, False)

    def __exit__(self, *exc: Any) -> None:
        if self.keyed:
            torch._C._dispatch_tls_set_dispatch_key_included(_VMAP_MODE, True)
        for _ in range(self.depth):
            torch._C._vmapmode_increment_nesting()


def _guarding_frames(most: int = 2) -> str:
    """The innermost frames that asked for a guard, past the ShapeEnv's and sympy's own."""
    import traceback

    skip = ("/torch/fx/experimental/", "/sympy/", "/torch/utils/_sympy/", "/torch/__init__.py", __file__)
    frames = [f for f in traceback.extract_stack()[:-2] if not any(s in f.filename for s in skip)]
    return "; ".join(f"{'/'.join(f.filename.split('/')[-2:])}:{f.lineno} {f.name}" for f in reversed(frames[-most:]))


@contextlib.contextmanager
def ignored_shape_guards(shape_env: Any) -> Iterator[list[str] | None]:
    """The guards a frozen ShapeEnv ignores in the block, as text (``expr == value``), or
    None where it cannot tell.  Its ``_check_frozen`` (torch 2.11-2.14) sees each, and also
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


# --- Inductor --------------------------------------------------------------------

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


def inductor_stride_at_module() -> Any:
    """The module whose global ``stride_at`` Inductor's C++ vectorizer calls (through
    ``stride_at_vec_range``, by its global name): ``torch._inductor.sizevars`` from torch
    2.13, ``torch._inductor.codegen.cpp`` on 2.11-2.12."""
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
    inlining it (ir.py ``has_large_inner_fn``, ``has_exceeded_max_reads``); torch 2.13
    added CPU defaults, with None meaning "the device's"."""
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
    (``Runner.call`` on 2.13; its module namespace is its ``__globals__``, where
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


# --- autograd and the dispatcher -------------------------------------------------

def tensor_or_tensors_to_tuple(tensors: Any, length: int) -> tuple:
    """How ``torch.autograd.grad`` normalises ``grad_outputs``."""
    return torch.autograd._tensor_or_tensors_to_tuple(tensors, length)


def shapes_for_message(output: Any, first_grad: Any, is_grads_batched: bool) -> tuple:
    """The (output, grad) shapes eager prints in its mismatch message, by eager's own helper
    (a batched message shows ``grad.shape[2:]``: users compare our text with eager's)."""
    return torch.autograd._calculate_shape(output, first_grad, is_grads_batched)


def functional_forward_jacobian() -> Callable | None:
    """``torch.autograd.functional._jacfwd``, which dynbatch traces as vmap over jvp."""
    return getattr(torch.autograd.functional, "_jacfwd", None)


def functional_as_tuple(*args: Any) -> Any:
    return torch.autograd.functional._as_tuple(*args)


def functional_standard_basis(*args: Any) -> Any:
    return torch.autograd.functional._construct_standard_basis_for(*args)


def functional_tuple_postprocess(*args: Any) -> Any:
    return torch.autograd.functional._tuple_postprocess(*args)


def forward_ad_level() -> int:
    """The innermost active ``torch.autograd.forward_ad.dual_level`` (-1: none)."""
    return _forward_ad._current_level


def has_tangent(t: torch.Tensor) -> bool:
    return _forward_ad.unpack_dual(t).tangent is not None


def backward_keeps_graph() -> bool:
    """Does the running backward keep its graph (``retain_graph``/``create_graph``)?"""
    return torch._C._autograd._get_current_graph_task_keep_graph()


def engine_will_execute(node: Any) -> bool:
    """Will the running backward execute ``node``, or capture what reaches it?  Autograd
    refuses to answer only for a leaf's accumulator that ``torch.autograd.grad`` captures
    (``topological_nr() == 0 && captures_`` in ``_will_engine_execute_node``, since torch
    1.13), so the refusal is itself the answer: that leaf's grad is wanted."""
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError as e:
        if "leaf node was passed to _will_engine_execute_node" in str(e):
            return True
        raise


def engine_will_execute_each(nodes: Sequence[Any]) -> tuple[bool, ...]:
    """``engine_will_execute`` of each of the running node's next nodes (None: no edge).

    A captured leaf's answer is an exception, which costs 30-50 us (a C++ error
    with its backtrace), a tenth of a small call.  The node asking runs, so
    autograd wants at least one of its edges: where every other edge is not
    wanted, the last one's answer is yes without asking.  Leaves go last, and of
    them the data last of all: a Jacobian or the forces are taken w.r.t. the
    data, the parameters' grads by ``backward()``, where no answer raises."""
    edges = [k for k, n in enumerate(nodes) if n is not None]
    if len(edges) == 1:  # the only edge: wanted, unasked
        return tuple(n is not None for n in nodes)
    # Three lists, not a sort by key: this runs on every batched or create_graph backward.
    inner, parameters, data = [], [], []
    for k, n in enumerate(nodes):
        if n is None:
            continue
        if type(n).__name__ != "AccumulateGrad":
            inner.append(k)
        elif isinstance(n.variable, torch.nn.Parameter):
            parameters.append(k)
        else:
            data.append(k)
    order = inner + parameters + data
    answers = [False] * len(nodes)
    last = len(order) - 1
    for position, k in enumerate(order):
        answers[k] = True if position == last and not any(answers) else engine_will_execute(nodes[k])
    return tuple(answers)


def storage_of(t: Any) -> Any:
    """A hashable handle of a tensor's storage (fake ones too, as AOTAutograd's aliasing
    analysis reads them), or None for anything else."""
    if not isinstance(t, torch.Tensor):
        return None
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.untyped_storage())


def is_zero_tensor(t: torch.Tensor) -> bool:
    """A ZeroTensor: autograd's grad known to be zero, with no storage of its own."""
    return t._is_zerotensor()


def op_schema(op: torch._ops.OpOverload) -> Any:
    """An op overload's ``FunctionSchema`` (its private ``_schema``): name and arguments."""
    return op._schema


def is_view_op(target: Any) -> bool:
    return isinstance(target, torch._ops.OpOverload) and target.is_view


def drop_library(lib: torch.library.Library) -> None:
    """Unregister every kernel ``lib`` registered: the ones it overrode are in effect again."""
    lib._destroy()


# The dispatcher's thread-local key sets of plain user code (read when dynbatch loads).
_USER_DISPATCH_KEYS = (torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set())


@contextlib.contextmanager
def outside_custom_op() -> Iterator[None]:
    """Inside a custom op's kernel, as if called from user code: a kernel runs with every key
    above the backend excluded (no autograd, no functorch), and no dispatch mode that
    AOTAutograd's runtime set for its checks stays active (under one, Dynamo would not compile)."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch._C._ForceDispatchKeyGuard(*_USER_DISPATCH_KEYS):
        yield


# --- symbolic shapes, fake tensors and FX ----------------------------------------

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
    """Symbol -> value in the example inputs (renamed backed_var_to_val in torch 2.13)."""
    hints = getattr(shape_env, "backed_var_to_val", None)
    return hints if hints is not None else shape_env.var_to_val


@contextlib.contextmanager
def real_tensors() -> Iterator[None]:
    """A context where new tensors are plain real tensors: outside a compile's
    FakeTensorMode and outside the user's transforms (functorch's, eager's legacy vmap),
    which a compile may run under (a Hessian's outer vmap)."""
    from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily(), outside_legacy_vmap(), temporarily_clear_interpreter_stack():
        yield


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
