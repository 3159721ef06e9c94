"""Stage 1: capture ``torch.autograd.grad`` calls into the Dynamo graph.

Stock Dynamo graph-breaks on ``torch.autograd.grad`` unless
``torch._dynamo.config.trace_autograd_ops`` is set, and with it set Dynamo
fake-runs batched grads through the legacy ``_vmap_internals``, which crashes
once the batch size is symbolic.  dynbatch changes both, for its own compiles
only.

NOTE [Scoped capture]
``torch.compile`` does not forward a backend's ``backend_ctx_ctor``, so the
change cannot be a context around the compiled call.  Instead dynbatch wraps
Dynamo's per-frame compile entry point once (``wrap_dynamo_compile``)
and, only when the frame is being compiled for dynbatch, enters a scope that
(1) sets ``trace_autograd_ops=True``, (2) lets Dynamo inline
``torch.autograd.functional`` (jacobian/hessian with vectorize=True call
``torch.autograd.grad(..., is_grads_batched=True)`` inside), (3) swaps in
batching rules that keep B symbolic (NOTE [Symbolic batch rules] in
batching/batch_rules.py), and (4) routes Dynamo's fake-tensor run
of each captured ``torch.autograd.grad`` node through ``trace_grad`` below,
and (5) on torch 2.11 traces ``requires_grad_()`` of in-graph tensors as
2.13 does (``x.detach().requires_grad_()``; jacobian/hessian call it).
All five are undone when that frame's compile ends, and each fails soft:
where a torch release moved what it hooks, that piece is off (one warning,
``fail_soft.HOOK_FAILURES``) and the compile goes on with stock behaviour.  Dynamo compiles one frame
at a time under a global lock, so the scope never overlaps another backend's
compile, and other backends see stock Dynamo.  The hooks are capture's logic,
so they live here (and in capture/requires_grad_tracing.py), not in ``_compat``, and
patch Dynamo's own tables: its compile entry, ``utils.run_node``, the
trace-rule map and the polyfill handlers.

NOTE [Errors are eager's]
If a captured grad would raise (bad shapes, unused input without
allow_unused, a freed graph, ...), Dynamo would wrap the error in its own
``TorchRuntimeError``.  ``trace_grad`` instead records eager's error on the
node (``node.meta[TRACE_ERROR]``) and returns stand-in results of the right
shapes so tracing can go on.  The batching pass sees the record and the
backend runs the captured graph eagerly, so the call raises exactly eager's
exception, message and type, at run time.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from typing import Any, Callable, Iterator

import torch

from .. import _compat, fail_soft
from ..batching import batch_rules, zero_tangents
from . import autograd_functions, fake_cuda_guard, requires_grad_tracing, traced_aside
from ..batching.batched_grad import batched_grad, forward_mode_jacobian, vmap_in_one_call
from ..batching.grad_pass import TRACE_ERROR, UNSUPPORTED
from .. import records
from ..records import STATS

log = logging.getLogger("dynbatch")



def install() -> None:
    """Hook dynbatch's capture scope into Dynamo (idempotent). Runs when dynbatch loads."""
    wrap_dynamo_compile(_scope_for)


def wrap_dynamo_compile(scope_for: Callable[[Any], Any]) -> None:
    """Enter ``scope_for(backend)`` around each Dynamo frame compile.

    Dynamo has no public hook that runs before tracing *and* knows the
    backend: ``torch.compile`` does not forward a backend's
    ``backend_ctx_ctor``, and compile start/end callbacks are wiped by
    ``torch._dynamo.reset()``.  ``convert_frame._compile`` is the per-frame
    entry point and receives the backend as ``compiler_fn``; we wrap it once.
    For other backends the wrapper only unwraps the backend and compares it.
    """
    import torch._dynamo.convert_frame as convert_frame

    original = getattr(convert_frame, "_compile", None)
    if getattr(original, "_dynbatch_original", None) is not None:
        return
    try:
        params = list(inspect.signature(original).parameters)
        position = params.index("compiler_fn")
    except (TypeError, ValueError) as e:
        # Without the hook dynbatch cannot scope its capture: torch.autograd.grad
        # graph-breaks as under stock Dynamo and runs eagerly, with eager's values.
        fail_soft.hook_failed("capture (convert_frame._compile with a compiler_fn parameter)", e)
        return

    signature = inspect.signature(original)

    @functools.wraps(original)
    def _compile(*args: Any, **kwargs: Any) -> Any:
        backend = args[position] if len(args) > position else kwargs.get("compiler_fn")
        unwrapped = unwrap_backend(backend)
        if getattr(unwrapped, "_dynbatch_backend", False) and _traced_aside(backend):
            # NOTE [Traced aside] in capture/traced_aside.py
            # By name: _compile's parameters differ between releases.
            answer = traced_aside.compile_or_aside(_compile, dict(signature.bind(*args, **kwargs).arguments))
            if answer is not None:
                return answer
        with scope_for(unwrapped):
            return original(*args, **kwargs)

    _compile._dynbatch_original = original  # type: ignore[attr-defined]
    convert_frame._compile = _compile


def _traced_aside(backend: Any) -> bool:
    """Whether dynbatch's options, as ``torch.compile`` passed them, trace a frame aside."""
    return _compiles_in_background(backend) and not traced_aside.on_thread()


def _compiles_in_background(backend: Any) -> bool:
    """Whether ``backend``'s options say ``dynbatch.compile="background"``, kept on the backend:
    Dynamo asks at every call of a frame traced aside, and parsing the options builds Inductor's
    options wrapper (which looks up its cache directory on disk)."""
    known = getattr(backend, "_dynbatch_in_background", None)
    if known is not None:
        return known
    from ..options import Options

    try:
        known = Options.from_compile_args(**_backend_kwargs(backend)).compile == "background"
    except (ValueError, TypeError):
        known = False  # bad options: the compile here raises eager's error for them
    with contextlib.suppress(AttributeError, TypeError):  # (a backend without a __dict__: parsed each time)
        backend._dynbatch_in_background = known
    return known


def _backend_kwargs(fn: Any) -> dict[str, Any]:
    """The ``mode`` and ``options`` torch.compile gave the backend (``_TorchCompileWrapper.kwargs``),
    or a region's program was compiled with (backend.py's partial); none for a chunk program,
    which runs inside its graph's compiled code."""
    seen = set()
    while fn is not None and id(fn) not in seen:
        seen.add(id(fn))
        kwargs = getattr(fn, "kwargs", None)
        if isinstance(kwargs, dict) and getattr(fn, "compiler_fn", None) is not None and (
                kwargs.get("mode") is not None or kwargs.get("options") is not None):
            return {k: kwargs.get(k) for k in ("mode", "options")}
        if isinstance(fn, functools.partial):
            if fn.keywords.get("chunk_program"):
                break
            return {k: fn.keywords.get(k) for k in ("mode", "options")}
        fn = getattr(fn, "_torchdynamo_orig_backend", None) or getattr(fn, "compiler_fn", None)
    return {"mode": None, "options": None}


def unwrap_backend(fn: Any) -> Any:
    """Peel Dynamo's and torch.compile's wrappers off a backend callable."""
    seen = set()
    while fn is not None and id(fn) not in seen:
        seen.add(id(fn))
        if hasattr(fn, "_torchdynamo_orig_backend"):  # WrapBackendDebug, callbacks
            fn = fn._torchdynamo_orig_backend
        elif hasattr(fn, "compiler_fn"):  # torch._TorchCompileWrapper
            fn = fn.compiler_fn
        elif isinstance(fn, functools.partial):
            fn = fn.func
    return fn


@contextlib.contextmanager
def _scope_for(backend: Any) -> Iterator[None]:
    if not getattr(backend, "_dynbatch_backend", False):
        yield
        return
    # The frame's seconds go to the records it makes (NOTE [Where a first call goes] in records.py).
    with records.compile_span(frame=True), capture_scope():
        yield


@contextlib.contextmanager
def capture_scope():
    """Trace ``torch.autograd.grad`` into the graph, batched grads via functorch.

    Each piece is one feature that fails soft (``fail_soft.soft``): where this
    torch's internals moved, that piece is off with a warning and the compile
    goes on with stock behaviour (a graph break, functorch's own rule)."""
    _compat.warn_once_if_untested()
    fake_cuda_guard.fake_cuda_guard_outlives_threads()
    soft = fail_soft.soft
    jacfwd = _compat.functional_forward_jacobian()
    with (
        soft("dynbatch's batching rules", batch_rules.symbolic_batch_rules),
        soft("symbolic sizes of forward mode's zero tangents", zero_tangents.symbolic_zero_tangents),
        soft("capture of torch.autograd.grad", _grads_traced_by_dynbatch),
        soft("tracing into torch.autograd.functional",
             lambda: dynamo_inlines_module("torch.autograd.functional")),
        # after the line above, which maps every function of the module to plain inlining
        soft("the forward-mode Jacobian",
             lambda: dynamo_substitutes(jacfwd, forward_mode_jacobian) if jacfwd
             else contextlib.nullcontext()),
        soft("one mapped call for a chunked torch.vmap",
             lambda: dynamo_substitutes(_compat.functorch_vmap_module().vmap_impl, vmap_in_one_call)),
        soft("one graph where a grad consumes what the frame returns", _returned_graphs_stay_whole),
        soft("a backward() through another frame's graph runs eagerly", _backward_across_frames_breaks),
        soft("tracing requires_grad_() (torch 2.11)",
             requires_grad_tracing.dynamo_traces_requires_grad_of_intermediates),
        # after the line above: inputs here, the rest passed on to it
        soft("tracing requires_grad_() of graph inputs", requires_grad_tracing.dynamo_traces_requires_grad_of_inputs),
        soft("autograd.Function backwards traced differentiable",
             autograd_functions.dynamo_traces_backwards_in_their_grad_mode),
    ):
        yield


@contextlib.contextmanager
def dynamo_inlines_module(module_name: str) -> Iterator[None]:
    """Let Dynamo trace *into* a torch module's functions instead of calling them.

    Dynamo lists ``torch.autograd.functional.jacobian`` and friends as
    in-graph functions and then cannot put them in the graph (they take a
    Python callable), so it graph-breaks.  Inlining them exposes the
    ``torch.autograd.grad(..., is_grads_batched=True)`` call inside.
    """
    from torch._dynamo import trace_rules
    from torch._dynamo.variables import UserFunctionVariable

    rules = trace_rules.get_torch_obj_rule_map()  # functools.cache: one shared dict
    saved = {k: v for k, v in rules.items() if getattr(k, "__module__", None) == module_name}
    rules.update(dict.fromkeys(saved, UserFunctionVariable))
    try:
        yield
    finally:
        rules.update(saved)


@contextlib.contextmanager
def dynamo_substitutes(original: Callable, replacement: Callable) -> Iterator[None]:
    """While the block runs, Dynamo traces ``replacement`` wherever user code
    calls ``original`` (its polyfill mechanism, scoped instead of global).
    Eager calls of ``original`` are unchanged, and guards see the same object."""
    from torch._dynamo import trace_rules
    from torch._dynamo.variables.functions import PolyfilledFunctionVariable

    rules = trace_rules.get_torch_obj_rule_map()
    handlers = PolyfilledFunctionVariable._get_polyfill_handlers()
    saved_rule, saved_handler = rules.get(original), handlers.get(original)

    @functools.wraps(original)
    def handler(*args: Any, **kwargs: Any) -> Any:
        return original(*args, **kwargs)

    handler.__torch_dynamo_polyfill__ = replacement  # type: ignore[attr-defined]
    rules[original], handlers[original] = PolyfilledFunctionVariable, handler
    try:
        yield
    finally:
        for table, value in ((rules, saved_rule), (handlers, saved_handler)):
            if value is None:
                table.pop(original, None)
            else:
                table[original] = value


@contextlib.contextmanager
def _returned_graphs_stay_whole():
    """NOTE [A grad that consumes returned tensors]

    MACE's inference returns the energy whose graph its force grad consumed
    (``retain_graph=False``).  Stock Dynamo then re-traces the frame with a graph
    break before the grad (``_validate_outputs_safe_for_autograd_nodes``): the
    graph before the break returns the energy *and* the tensors the grad
    differentiates by (MACE's displacement), siblings to autograd, so the grad
    w.r.t. them is None and MACE's stress zero.  dynbatch keeps the frame whole:
    the grad stays in the graph and AOTAutograd computes it; the batching pass
    traces every grad with ``retain_graph=True`` so that AOTAutograd can still
    differentiate the returned tensors (a compiled graph is functional: nothing
    is freed at run time either way).  The one difference from eager: a backward
    through the returned energy later works where eager raises "Trying to
    backward through the graph a second time"."""
    from torch._dynamo.output_graph import OutputGraph

    name = "_validate_outputs_safe_for_autograd_nodes"
    original = OutputGraph.__dict__.get(name)
    if original is None:  # torch 2.11: no such check, nothing to undo
        yield
        return
    setattr(OutputGraph, name, lambda self, rv, tx: None)
    try:
        yield
    finally:
        setattr(OutputGraph, name, original)


@contextlib.contextmanager
def _backward_across_frames_breaks():
    """NOTE [A backward across frames]

    With ``trace_autograd_ops`` on (stage 1's first change), Dynamo traces
    ``loss.backward()`` as ``torch.autograd.grad`` w.r.t. the leaves *this frame*
    knows, then ``accumulate_grad_`` into each (``TensorVariable.method_backward``).
    Where the loss's history runs through another frame's graph -- a graph break in
    the model, or between the forward and ``backward()`` -- the leaves there are not
    this frame's: with none here Dynamo traces nothing at all, and every parameter's
    ``.grad`` stays None, silently (stock Dynamo graph-breaks on ``backward()`` and
    eager's engine reaches them all).  So a ``backward()`` whose loss reaches a grad_fn
    made outside the frame graph-breaks here: eager's engine runs it, through each
    region's backward (NOTE [Region backward] in region/edge.py).  A backward whose history
    is all in the frame stays in the graph (a training step compiled whole)."""
    from torch._dynamo.variables.tensor import TensorVariable

    original = TensorVariable.__dict__.get("method_backward")
    if original is None:  # a torch that does not trace backward(): it graph-breaks already
        yield
        return

    @functools.wraps(original)
    def method_backward(self: Any, tx: Any, *args: Any, **kwargs: Any) -> Any:
        outside = _grad_fns_outside_frame(self, tx)
        if outside:
            _compat.graph_break(
                "backward() through another frame's graph",
                context=f"the loss's history reaches {', '.join(outside)}",
                explanation="backward() would reach leaves that another compiled graph or eager code uses; "
                            "dynbatch runs it eagerly so that every one gets its grad")
        return original(self, tx, *args, **kwargs)

    # 2.14 dispatches named methods through a table of its own (``tp_methods``).
    table = getattr(TensorVariable, "tp_methods", {})
    entry = table.get("backward")
    TensorVariable.method_backward = method_backward
    if entry is not None:
        table["backward"] = type(entry)(method_backward)
    try:
        yield
    finally:
        TensorVariable.method_backward = original
        if entry is not None:
            table["backward"] = entry


def _grad_fns_outside_frame(var: Any, tx: Any) -> list[str]:
    """Sources of the frame's inputs whose grad_fn (made outside the frame) the tensor
    variable ``var``'s autograd history reaches, walked on the fake tensors."""
    from torch._dynamo.variables import TensorVariable

    external: dict[Any, str] = {}
    for source, input_var in tx.output.input_source_to_var.items():
        value = _example_value(input_var) if isinstance(input_var, TensorVariable) else None
        if value is None:
            continue
        for grad_fn in (value.grad_fn, value._base.grad_fn if value._base is not None else None):
            if grad_fn is not None:
                external[grad_fn] = getattr(source, "name", str(source))
    value = _example_value(var)
    if not external or value is None or value.grad_fn is None:
        return []
    reached, seen, stack = [], set(), [value.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if node in external:
            reached.append(external[node])
            continue  # what lies beyond is outside the frame
        stack.extend(next_node for next_node, _ in node.next_functions)
    return reached


def _example_value(var: Any) -> torch.Tensor | None:
    node = var.as_proxy().node
    value = node.meta.get("example_value") if node is not None else None
    return value if isinstance(value, torch.Tensor) else None


@contextlib.contextmanager
def _grads_traced_by_dynbatch():
    """``torch.autograd.grad`` as a graph node, fake-run by ``trace_grad``: both or
    neither (stock Dynamo's fake run of a batched grad crashes on symbolic sizes)."""
    utils = _compat.dynamo_utils_module()
    original_run_node = utils.run_node

    def run_node(tracer: Any, node: torch.fx.Node, args: Any, kwargs: Any, nnmodule: Any) -> Any:
        if node.op == "call_function" and node.target is torch.autograd.grad:
            return trace_grad(node, args, kwargs)
        return original_run_node(tracer, node, args, kwargs, nnmodule)

    handlers = _compat.dynamo_torch_function_handlers()
    original_handler = handlers.get(torch.autograd.grad)
    with _compat.trace_autograd_ops_enabled():
        utils.run_node = run_node
        if original_handler is not None:
            handlers[torch.autograd.grad] = _with_grad_tensors_positional(original_handler)
        try:
            yield
        finally:
            utils.run_node = original_run_node
            if original_handler is not None:
                handlers[torch.autograd.grad] = original_handler


# Counted when a frame runs eagerly: NOTE [A grad split from its intermediates].
FRAMES_RUN_EAGERLY = "frames_run_eagerly"
# torch.autograd.grad's leading parameters, in order.
_GRAD_POSITIONAL = ("outputs", "inputs", "grad_outputs")


def _with_grad_tensors_positional(handler: Callable) -> Callable:
    """Dynamo's handler of ``torch.autograd.grad``, called with ``outputs``, ``inputs``
    and ``grad_outputs`` positional however the user spelt them.

    Dynamo's checks of a traced grad (torch/_dynamo/variables/torch.py,
    ``handle_autograd_grad``: GradientEdge arguments, external grad_fns, returned
    tensors whose graph the grad consumed) read ``args[0]`` and ``args[1]`` only.
    MACE's ``compute_forces`` calls ``grad(outputs=[e], inputs=[pos], ...)``: Dynamo
    then missed that the returned energy's graph was consumed, and the compile failed
    with "Trying to backward through the graph a second time".  With the tensors
    positional, every check sees them and the node in the graph is the same."""
    def handle_autograd_grad(variable: Any, tx: Any, *args: Any, **kwargs: Any) -> Any:
        args = list(args)
        for name in _GRAD_POSITIONAL[len(args):]:
            if name not in kwargs:
                break
            args.append(kwargs.pop(name))
        try:
            return handler(variable, tx, *args, **kwargs)
        except _compat.dynamo_exceptions().Unsupported:
            intermediates = _intermediates_differentiated(args[1]) if len(args) > 1 else []
            if not intermediates or getattr(tx, "one_graph", False):
                raise
            # NOTE [A grad split from its intermediates]
            reason = (f"torch.autograd.grad w.r.t. {', '.join(intermediates)}, computed in this frame, "
                      "would run after a graph break that makes them outputs of the compiled graph, "
                      "unconnected to the outputs it differentiates")
            log.warning("dynbatch: %s: the frame %s runs eagerly (its callees still compile)", reason,
                        getattr(getattr(tx, "f_code", None), "co_name", "?"))
            STATS.count(FRAMES_RUN_EAGERLY)
            raise _compat.dynamo_exceptions().SkipFrame(f"dynbatch: {reason}") from None

    return handle_autograd_grad


# NOTE [A grad split from its intermediates]
# Where Dynamo breaks the graph at a torch.autograd.grad (it cannot trace a grad through an
# input's grad_fn made outside the frame, nor one that consumes a graph a grad consumed
# before), the grad runs after the compiled graph, and each tensor it differentiates w.r.t.
# reaches it as one more output of that graph.  For a graph
# input that is the same tensor; for a non-leaf computed inside the graph it is a sibling
# output of AOTAutograd's node, which the differentiated outputs do not depend on: the grad
# is None (stock Dynamo with any backend; MACE's stress came out zero).  Such a frame runs
# eagerly instead (Dynamo's SkipFrame: the functions it calls are still compiled), counted
# as ``frames_run_eagerly``.  Under fullgraph=True Dynamo's own graph-break error stands.

def _intermediates_differentiated(inputs: Any) -> list[str]:
    """Names of the non-leaf tensors computed in the frame among a grad's ``inputs``
    (Dynamo variables: a tensor, or a list or tuple of them)."""
    from torch._dynamo.variables import BaseListVariable, TensorVariable

    variables = inputs.items if isinstance(inputs, BaseListVariable) else [inputs]
    names = []
    for var in variables:
        if not isinstance(var, TensorVariable):  # a GradientEdge, a constant: not a tensor of the graph
            continue
        node = var.as_proxy().node
        value = node.meta.get("example_value") if node is not None else None
        if (isinstance(value, torch.Tensor) and node.op != "placeholder" and value.requires_grad
                and value.grad_fn is not None):
            names.append(node.name)
    return names


@contextlib.contextmanager
def discarding_fresh_unbacked_symbols() -> Iterator[Callable[[], int]]:
    """Discard the unbacked SymInts a fake run allocates; yield a counter of them.

    A backward can allocate unbacked sizes that its grads do not carry (e.g.
    ``nonzero`` in index_put's backward with a boolean mask); left pending,
    Dynamo fails with PendingUnbackedSymbolNotFound.  The caller learns how
    many were made (the yielded function) and decides what to do.
    """
    from torch._guards import detect_fake_mode

    shape_env = getattr(detect_fake_mode(), "shape_env", None)
    if shape_env is None or not hasattr(shape_env, "ignore_fresh_unbacked_symbols"):
        yield lambda: 0
        return
    before = shape_env.counter["create_unbacked_symbol"]
    with shape_env.ignore_fresh_unbacked_symbols():
        yield lambda: shape_env.counter["create_unbacked_symbol"] - before


def trace_grad(node: torch.fx.Node | None, args: Any, kwargs: Any) -> Any:
    """Fake-run one captured grad call. See NOTE [Errors are eager's]."""
    fn = batched_grad if kwargs.get("is_grads_batched", False) else torch.autograd.grad
    try:
        with discarding_fresh_unbacked_symbols() as made_unbacked:
            result = fn(*args, **kwargs)
        if made_unbacked() and node is not None:
            # Data-dependent sizes inside the backward: AOTAutograd's size-oblivious
            # tracing of them is not reliable (index_fill with a 1-element index
            # compiles to a graph that fails at run time), so run this one eagerly.
            node.meta[UNSUPPORTED] = "the backward has data-dependent sizes (unbacked SymInts)"
        return result
    except _compat.dynamo_control_exceptions():
        raise
    except Exception as e:  # noqa: BLE001 - any error is eager's to raise
        reason = f"{type(e).__name__}: {e}"
        log.debug("captured grad %s raises at trace time: %s", getattr(node, "name", "?"), reason)
        if node is not None:
            node.meta[TRACE_ERROR] = reason
        return _stand_in_grads(args, kwargs)


def _stand_in_grads(args: Any, kwargs: Any) -> tuple[torch.Tensor, ...]:
    """Zeros shaped like the grads eager would return, so tracing can go on."""
    inputs = args[1] if len(args) > 1 else kwargs["inputs"]
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    grad_outputs = args[2] if len(args) > 2 else kwargs.get("grad_outputs")
    requires_grad = bool(kwargs.get("create_graph", False))
    batch: tuple = ()
    if kwargs.get("is_grads_batched", False):
        firsts = [g for g in _compat.tensor_or_tensors_to_tuple(grad_outputs, 1)
                  if isinstance(g, torch.Tensor) and g.dim() > 0]
        batch = (firsts[0].shape[0],) if firsts else (1,)
    return tuple(
        torch.zeros((*batch, *inp.shape), dtype=inp.dtype, device=inp.device,
                    requires_grad=requires_grad and inp.dtype.is_floating_point)
        for inp in inputs
        if isinstance(inp, torch.Tensor)
    )
