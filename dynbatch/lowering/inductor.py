"""Stage 4: lowering the batched graph through AOTAutograd to Inductor.

AOTAutograd traces the graph (running ``batched_grad`` under functorch's
vmap, so the backward is emitted once with a symbolic batch size), then the
inner compiler turns the aten graph into kernels: Inductor's C++ on CPU and
Triton on CUDA, or eager kernels for cheap test sweeps.  Both inner
compilers are wrapped to keep the aten graph's text for the compile record.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import types
import warnings
from typing import Any, Callable, Iterator, Sequence

import sympy
import torch
import torch.fx

from .. import _compat, fail_soft, fx_utils, records
from ..cpu import kept_buffers, matmul_kernels
from ..batching import markers
from ..planning import memory
from . import aot_cache, aten_passes, background, frame_stack
from ..graph_text import count_nodes, graph_text
from ..options import Options
from ..records import CompileRecord

log = logging.getLogger("dynbatch")


@frame_stack.with_room  # NOTE [A compile on a chunk's edge]; the region's own lowerings enter here
def lower(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    options: Options,
    record: CompileRecord,
    planner: memory.Planner | None = None,
    cache: bool = False,
) -> Callable[..., Any]:
    """Raises memory.Replan when the plan wants grads chunked (the backend rewrites and lowers again).
    ``cache``: the graph may come from AOTAutograd's cache (NOTE [What a cache hit must not lose])."""
    # A backward taken from outside may run the compiled backward with
    # retain_graph=True (region/edge.py), which donated buffers forbid (and _remember
    # records that there are none, _compat.aot_records_no_donated_buffers).
    # Torch's deprecation warnings about its own internals are not the user's to see.
    planner = planner or memory.Planner(None, None)
    fx_utils.forget_cleared_sources(gm)
    cache = cache and options.inner_compiler == "inductor" and aot_cache.available()
    # NOTE [Background compile] in lowering/background.py
    in_background = options.compile == "background" and background.applies(options, record, planner,
                                                                            example_inputs)
    # NOTE [An entry needs its backward] in lowering/aot_cache.py
    backward_now = cache and options.aot_cache == "with_backward"
    with (_compat.aot_config_patch(donated_buffer=False, enable_autograd_cache=cache,
                                   **({"force_non_lazy_backward_lowering": True} if backward_now else {})),
          torch_internal_deprecations_hidden(),
          aot_cache.lowering(record, _buffers_kept(options)) if cache else contextlib.nullcontext(),
          markers.collecting() if planner.active else contextlib.nullcontext()):
        if options.inner_compiler == "inductor":
            return _lower_with_inductor(gm, example_inputs, options, record, planner, cache, in_background)
        return _lower_with_aot_eager(gm, example_inputs, options, record, planner)


@contextlib.contextmanager
def torch_internal_deprecations_hidden() -> Iterator[None]:
    """Hide Future/DeprecationWarnings raised *by torch modules* while dynbatch
    lowers a graph (Inductor's aten.diagonal lowering calls the deprecated
    ``torch._prims_common.check``): code that asserts no warnings should not
    see torch's notes to itself.  Warnings attributed to user code still show."""
    with warnings.catch_warnings():
        for category in (FutureWarning, DeprecationWarning):
            warnings.filterwarnings("ignore", category=category, module=r"torch(\.|$)")
        yield


@contextlib.contextmanager
def inductor_scheduler_keeps_mutation_renames() -> Iterator[None]:
    """Inductor's ``SchedulerNode.recompute_size_and_body`` (torch 2.11-2.14, and
    upstream's main as of this writing) re-reads a node's dependencies from its loop body
    and renames them past earlier in-place writes only when the node also has a fake
    dependency.  The C++ backend calls it to align the loops of two nodes it fuses, so a
    node reading the result of a scatter (``zeros(N).index_add(...)``) then reads the
    zero-filled buffer by its old name, fusion sees no cycle, and the read runs before
    the scatter.  Applying the renames again is what the method means to do (renames
    are idempotent: a node's renames map old names to names it does not rename)."""
    from torch._inductor.scheduler import SchedulerNode

    original = SchedulerNode.recompute_size_and_body

    def recompute_size_and_body(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.set_read_writes(self.read_writes.rename(self.mutation_renames))

    SchedulerNode.recompute_size_and_body = recompute_size_and_body
    try:
        yield
    finally:
        SchedulerNode.recompute_size_and_body = original


@contextlib.contextmanager
def inductor_strides_without_full_simplify() -> Iterator[None]:
    """Inductor's C++ vectorizer asks the stride of every index expression along each loop
    variable: ``stride_at`` substitutes ``var + 1`` and calls ``sympy.simplify`` on the
    difference (torch 2.11-2.14).  Where the index holds Inductor's index functions --
    ``ModularIndexing`` of the ``Where(Min(Max(...)) < 0, ... + n, ...)`` that wraps a
    gather's negative indices -- simplify tries its general strategies for 0.3 s to 16 s a
    call and returns the difference as it came: MACE's Hessian rows, batched from
    AOTAutograd's saved activations, spent over 17 minutes of one compile there.  For such
    an index the difference is taken as it is (terms alike cancel as sympy builds it).  Every
    caller reads the stride as a number, 0 or 1, or an expression free of the loop
    variables, so a stride that sympy could have folded and this does not only leaves a load
    unvectorised: never a wrong index.  (Upstream, pytorch/pytorch#186319 drops the same
    kind of simplify from ``simplify_index_in_vec_range``, for the same reason:
    ``inductor_vec_range_without_full_simplify``.)"""
    with _replaced(_compat.inductor_stride_at_module(), "stride_at", _stride_at_without_full_simplify):
        yield


@contextlib.contextmanager
def inductor_vec_range_without_full_simplify() -> Iterator[None]:
    """``simplify_index_in_vec_range``, which the vectorizer calls before ``stride_at``,
    replaces the loop variable's lane-uniform ``FloorDiv``/``ModularIndexing`` terms by
    symbols and then runs ``sympy.simplify`` over the whole index, only to hand it to
    ``stride_at``, which takes the difference along the variable and simplifies that.
    Here it runs without the whole-index simplify, as upstream's pytorch/pytorch#186319
    has it: the replacements are the same, the index the same value.  MACE's Hessian
    compiled in 146 s with it and 171 s without, to the same code."""
    with _replaced(_compat.inductor_stride_at_module(), "simplify_index_in_vec_range", _without_simplify):
        yield


@contextlib.contextmanager
def inductor_small_products_without_size_guards() -> Iterator[None]:
    """Inductor's CPU decompositions of ``mm`` and ``addmm`` rewrite a product small enough
    (operands of at most 32 elements, sides of at most 16) as pointwise ops, and ask with
    ``guard_or_false``, which for a symbolic size adds a guard that bounds it (``s0 + 16 <=
    32``): a graph traced with its atom count marked dynamic at 12 atoms compiled again at 18
    (NequIP's forces).  Here the decompositions ask with ``statically_known_true``: the
    same answer for static sizes, and for a symbolic one the product stays a product, with
    no bound.  Either way the product is right; the rewrite only saves a call."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    with _replaced(_compat.inductor_decomposition_module(), "guard_or_false", lambda _: statically_known_true):
        yield


@contextlib.contextmanager
def _replaced(module: Any, name: str, replacement: Callable[[Callable], Callable]) -> Iterator[None]:
    """``module.name`` is ``replacement(module.name)`` inside the block (Inductor reads it by its
    global name at each call), the original again after it."""
    original = getattr(module, name)
    setattr(module, name, replacement(original))
    try:
        yield
    finally:
        setattr(module, name, original)


def _stride_at_without_full_simplify(original: Callable) -> Callable:
    @functools.lru_cache(maxsize=None)
    def stride_at(index: sympy.Expr, var: sympy.Symbol) -> sympy.Expr:
        if not index.has(var) or not index.atoms(sympy.core.function.Application):
            return original(index, var)  # a polynomial index: simplify is quick there
        return sympy.expand(_compat.inductor_sympy_subs(index, {var: var + 1}) - index, deep=False)

    return stride_at


class _SympyWithoutSimplify:
    """``sympy`` as a function of Inductor's module sees it, with a ``simplify`` that
    returns its argument (``inductor_vec_range_without_full_simplify``)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(sympy, name)

    @staticmethod
    def simplify(expr: Any, *args: Any, **kwargs: Any) -> Any:
        return expr


def _without_simplify(original: Callable) -> Callable:
    """``original`` (a function of Inductor's, memoised with ``functools.lru_cache``)
    running on a copy of its module's globals in which ``sympy`` is
    ``_SympyWithoutSimplify``, its recursive calls included, with a cache of its own:
    whatever else the body does (torch 2.11-2.14 differ), it does as before."""
    function = getattr(original, "__wrapped__", original)
    scope = dict(function.__globals__, sympy=_SympyWithoutSimplify())
    copy = functools.update_wrapper(
        types.FunctionType(function.__code__, scope, function.__name__, function.__defaults__, function.__closure__),
        function)
    copy.__kwdefaults__ = function.__kwdefaults__
    if function is not original:
        copy = functools.lru_cache(maxsize=None)(copy)
    scope[function.__name__] = copy
    return copy


def _remember(gm: torch.fx.GraphModule, record: CompileRecord, title: str, keep_text: bool,
              planner: memory.Planner, fused: bool) -> None:
    # First the plan: it removes planning/memory.py's markers, which no compiler or record should see.
    with records.own_pass("memory_plan"):
        planner.observe(gm, fused)
    record.aten_node_counts.append(count_nodes(gm))
    if keep_text:
        record.aten_graphs.append(graph_text(gm, title))
    # What the region's backward from outside must know (region/edge.py).
    record.random_ops = tuple(sorted(set(record.random_ops) | set(random_ops(gm))))
    record.mutates_differentiable_input |= _compat.aot_mutates_differentiable_input()
    record.mutated_inputs = tuple(sorted(set(record.mutated_inputs) | set(_compat.aot_mutated_inputs())))
    # Compiled without donated buffers (lower): say so, or AOTAutograd's backward may still
    # refuse retain_graph/create_graph by the global flag.
    _compat.aot_records_no_donated_buffers()


def _buffers_kept(options: Options) -> Callable[[Any], None] | None:
    """What each compiled or loaded program gets where large CPU buffers are kept."""
    if not options.keep_cpu_buffers:
        return None

    def keep(compiled: Any) -> None:
        try:  # NOTE [Reused CPU buffers] in cpu/kept_buffers.py
            kept_buffers.install(compiled, adapt=options.keep_cpu_buffers is True)
        except Exception as e:  # noqa: BLE001 - the generated code moved: it allocates as before
            fail_soft.hook_failed("keeping a compiled program's large CPU buffers", e)

    return keep


def random_ops(gm: torch.fx.GraphModule) -> list[str]:
    """Ops that draw random numbers: a re-run of the graph would draw others."""
    return [str(n.target) for n in gm.graph.nodes if fx_utils.draws_random_numbers(n)]


def _lower_with_inductor(gm, example_inputs, options: Options, record: CompileRecord, planner, cache=False,
                         in_background=False):
    inner = _compat.compile_fx_inner()

    @frame_stack.with_room  # a backward AOTAutograd compiles at its first call enters here
    def recording_inner_compile(aten_gm, aten_inputs, **kwargs):
        # A backward AOTAutograd compiles at its first call: its seconds join the record's.
        with (contextlib.nullcontext() if records.in_compile_span()
              else records.compile_span(frame=False, record=record)):
            return inner_compile(aten_gm, aten_inputs, **kwargs)

    def inner_compile(aten_gm, aten_inputs, **kwargs):
        title = "aten backward" if kwargs.get("is_backward") else "aten forward"
        # A background program runs eager (unfused) kernels first: its plan is theirs, the larger.
        _remember(aten_gm, record, title, options.record_graphs, planner, fused=not in_background)
        keep = _buffers_kept(options)
        with inductor_patched(cpu_matmul), \
                (background.compiled_in_worker(cpu_matmul, options.recompute, keep) if in_background
                 else contextlib.nullcontext()):
            compiled = inner(aten_gm, aten_inputs, **kwargs)
        if keep is not None and not background.is_background_program(compiled):
            keep(compiled)  # a background program keeps them when its compiled code arrives
        return compiled

    inductor_patterns_registered_outside_transforms(example_inputs)
    cpu_matmul = _cpu_matmul(options)
    config_patches = dict(options.inductor_config)
    # After vmap, elementwise derivative factors are computed on expanded (B-fold)
    # copies of the primal: compute them once (aten_passes.sink_expands); scatters into
    # expanded tensors get storage of their own (aten_passes.clone_overlapping_scatter_targets);
    # a large pointwise tensor several kernels read is recomputed in each where that costs
    # less than storing it (planning/recompute.py);
    # tall CPU products take the kernel measured fastest (aten_passes.route_matmuls).  A pass
    # the user brought replaces the speed passes, not the one that keeps values right.
    users = config_patches.get("post_grad_custom_pre_pass",
                               _compat.inductor_config_value("post_grad_custom_pre_pass"))
    config_patches["post_grad_custom_pre_pass"] = aten_passes.PostGradPasses(cpu_matmul, users_pass=users,
                                                                        recompute_mode=options.recompute)
    # The recompute pass raises Inductor's inline limits for the graph it copied chains in
    # (NOTE [Copies Inductor inlines]): patched here, so the raise ends with this compile.
    for name in ("realize_opcount_threshold", "realize_acc_reads_threshold"):
        config_patches.setdefault(name, _compat.inductor_config_value(name))
    if in_background:
        config_patches.update(background.config_patches())
    if cache:
        # Forces inside a graph are a torch.autograd.grad node, which AOTAutograd's cache
        # does not know to be safe: it is torch's own, so torch's version keys it.
        marked = config_patches.get("unsafe_marked_cacheable_functions",
                                    _compat.inductor_config_value("unsafe_marked_cacheable_functions"))
        config_patches["unsafe_marked_cacheable_functions"] = {**marked, "torch.autograd.grad": torch.__version__}
    # AOTAutograd traces with Inductor's decompositions inside compile_fx.
    with fail_soft.soft("Inductor's small products without size guards", inductor_small_products_without_size_guards):
        return _compat.compile_fx(
            gm,
            example_inputs,
            inner_compile=recording_inner_compile,
            config_patches=config_patches,
        )


@contextlib.contextmanager
def inductor_patched(cpu_matmul: str) -> Iterator[None]:
    """dynbatch's patches of Inductor for one aten graph's lowering (in this process, or in
    the background compile's worker: lowering/background.py)."""
    routed_matmul_lowerings = matmul_kernels.lowerings() if cpu_matmul != "aten" else {}
    # Inductor's scheduler can read a scattered buffer before the scatter runs
    # (inductor_scheduler_keeps_mutation_renames): never a wrong value.
    with _compat.inductor_lowerings({**_CONVOLUTIONS_AS_EXTERN_WHEN_B_SIZES_THE_WEIGHT,
                                     **routed_matmul_lowerings}), \
            fail_soft.soft("the fix of Inductor's fused reads of scattered buffers",
                           inductor_scheduler_keeps_mutation_renames), \
            fail_soft.soft("Inductor's strides without sympy's full simplify",
                           inductor_strides_without_full_simplify), \
            fail_soft.soft("Inductor's vector index ranges without sympy's full simplify",
                           inductor_vec_range_without_full_simplify):
        yield


def inductor_patterns_registered_outside_transforms(example_inputs: Any) -> None:
    """Inductor registers its pattern-matcher patterns at a process's first compile,
    by tracing example functions, one of which draws ``randperm``.  When that first
    compile happens under a functorch transform (a region's backward taken inside
    vmap, eager's legacy one or functorch's), the tracing fails: "random operations
    inside of vmap".  Register them with both set aside; Inductor's own calls then
    find them cached (the same device argument)."""
    if not (_compat.legacy_vmap_active() or _compat.functorch_transform_active()):
        return
    device = next((t.device for t in example_inputs if isinstance(t, torch.Tensor)), None)
    _compat.inductor_patterns_registered(device)


def _cpu_matmul(options: Options) -> str:
    """The CPU product kernel choice this graph can take: Inductor's C++ wrapper
    (``cpp_wrapper``) calls extern kernels from C++ and has no call for the routed
    Python kernel (its codegen fails), so there every product stays ATen's ``mm``."""
    if options.cpu_matmul != "aten" and options.inductor_config.get(
            "cpp_wrapper", _compat.inductor_config_value("cpp_wrapper")):
        log.debug("dynbatch: cpp_wrapper is on: CPU products stay with ATen (dynbatch.cpu_matmul=%r ignored)",
                  options.cpu_matmul)
        return "aten"
    return options.cpu_matmul


def _extern_when_weight_is_symbolic(weight: int, groups: int) -> Callable:
    """Inductor's lowerings of ``convolution`` and ``convolution_backward`` read
    the weight's sizes and the groups as ints (guard_int_seq), for its Triton
    templates.  The batching rules fold B into exactly those to batch a weight
    grad (batch_rules.convolution_backward), so the lowering would specialise B
    and every new B would compile again.  There, call the aten kernel as an
    extern call instead, which takes symbolic sizes, as Inductor's own fallback
    for these ops does; other convolutions keep Inductor's lowering."""

    def wrap(op: torch._ops.OpOverload, lowering: Callable) -> Callable:
        extern = _compat.inductor_fallback(op)
        names = [a.name for a in _compat.op_schema(op).arguments]

        def lower_convolution(*args, **kwargs):
            w, g = (args[i] if i < len(args) else kwargs[names[i]] for i in (weight, groups))
            if _compat.is_symbolic(g) or any(map(_compat.is_symbolic, w.get_size())):
                return extern(*args, **kwargs)
            return lowering(*args, **kwargs)

        return lower_convolution

    return wrap


# op -> wrapper of its lowering, given where the op's schema puts weight and groups.
# Coupled with batch_rules.convolution and batch_rules.convolution_backward: they fold
# B into a weight's sizes or the groups, which is what these wrappers look for.
_CONVOLUTIONS_AS_EXTERN_WHEN_B_SIZES_THE_WEIGHT = {
    torch.ops.aten.convolution.default: _extern_when_weight_is_symbolic(1, 8),
    torch.ops.aten.convolution_backward.default: _extern_when_weight_is_symbolic(2, 9),
}


def _lower_with_aot_eager(gm, example_inputs, options: Options, record: CompileRecord, planner):
    def compiler(title: str):
        def compile_graph(aten_gm, aten_inputs):
            _remember(aten_gm, record, title, options.record_graphs, planner, fused=False)
            return _compat.make_boxed_func(aten_gm.forward)

        return compile_graph

    backend = _compat.aot_autograd(
        fw_compiler=compiler("aten forward"),
        bw_compiler=compiler("aten backward"),
        inference_compiler=compiler("aten forward"),
    )
    return backend(gm, example_inputs)
