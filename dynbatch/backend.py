"""The ``dynbatch`` Dynamo backend: capture -> batching pass -> shape checks -> lowering.

It joins the four stages (docs/design.md; 1 capture/grad_calls.py, 2 batching/grad_pass.py, 3
batching/shape_checks.py, 4 lowering/inductor.py) and the two parts that are not numbered stages:
memory within a budget (planning/memory.py, planning/chunking.py; ``_lower_within_budget``) and
the edge of the region (region/edge.py; each compiled graph is handed back to Dynamo
inside a ``Region``).

Registered under the name "dynbatch" through the ``torch_dynamo_backends``
entry point (pyproject.toml), so ``torch.compile(fn, backend="dynbatch")``
works without importing dynbatch first.
"""

from __future__ import annotations

import functools
import logging
import weakref
from typing import Any, Callable, Sequence

import torch.fx

from . import _compat, fx_utils, records
from .batching import grad_pass
from .capture import grad_calls, requires_grad_tracing
from .lowering import aot_cache, frame_stack, inductor, verify
from .planning import chunking, memory
from .region import edge
from .sparsity import rewrite
from .graph_text import graph_text
from .options import Options
from .records import STATS, CompileRecord

log = logging.getLogger("dynbatch")


class UnsupportedGraph(RuntimeError):
    """Raised instead of falling back when ``dynbatch.on_unsupported="error"``."""


@frame_stack.with_room  # NOTE [A compile on a chunk's edge]
def dynbatch_backend(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    mode: str | None = None,
    options: dict[str, Any] | None = None,
    chunk_program: bool = False,
) -> Callable[..., Any]:
    opts = Options.from_compile_args(mode, options)
    record = CompileRecord(chunk_program=chunk_program)
    call_values, example_inputs = example_inputs, requires_grad_tracing.with_traced_requires_grad(gm, example_inputs)
    if opts.record_graphs:
        record.dynamo_graph = graph_text(gm, "dynamo")

    with records.own_pass("batching_pass"):
        eager_gm, gm = gm, grad_pass.batch_vmapped_grads(gm)
        # After the vmaps' grads became batched grads: a vmap over an eye is one too.
        if opts.sparse and not opts.inductor_config.get("triton.cudagraphs"):  # the op compiles: never in a replay
            rewrite.compress_identity_grads(gm, options, call_values if opts.sparse == "auto" else None)
        result = grad_pass.batch_grads(gm)
    record.batched, record.plain = result.batched, result.plain
    if result.unsupported:
        reason = "; ".join(f"{u.node}: {u.reason}" for u in result.unsupported)
        return _fall_back(eager_gm, record, opts, reason)
    if opts.record_graphs:
        record.batched_graph = graph_text(result.graph_module, "batched")

    try:
        compiled = _lower_within_budget(gm, result.graph_module, example_inputs, opts, record, mode, options)
    except _compat.restart_analysis_exceptions():
        raise  # Dynamo asks to re-trace the frame (e.g. to tensorify a float); not a failure
    except Exception as e:  # noqa: BLE001 - never hand back a graph we could not lower
        if not result.batched:
            raise  # nothing of ours in it: the inner compiler's own error
        # "error" raises UnsupportedGraph here, chained to the lowering's exception.
        return _fall_back(eager_gm, record, opts, f"lowering the batched graph failed: {type(e).__name__}: {e}")
    STATS.add(record)
    log.info("dynbatch: compiled a graph with %d batched and %d plain grad(s)%s",
             len(record.batched), len(record.plain), _plan_text(record))
    # What a grad taken outside this graph gets: NOTE [Region backward] in region/edge.py.
    graph_region = edge.Region(
        gm, compiled, example_inputs,
        recompile=functools.partial(_compile_like, mode=mode, options=options),
        random_ops=record.random_ops,
        mutates_differentiable_input=record.mutates_differentiable_input,
        mutated_inputs=record.mutated_inputs,
        options=opts,
    )
    record.region = weakref.ref(graph_region)
    if opts.verify:
        return verify.Verified(graph_region, _eager_forward(eager_gm), record, record.mutated_inputs)
    return graph_region


def _lower_within_budget(gm, batched_gm, example_inputs, opts: Options, record: CompileRecord,
                         mode: str | None, options: dict[str, Any] | None):
    """Lower the batched graph; where the memory plan asks, with grads run chunk by chunk
    (NOTE [Chunked batched grads] in planning/chunking.py)."""
    planner = memory.Planner(memory.resolve_budget(opts.memory_budget, example_inputs), opts.chunk_size)
    record.memory_budget = planner.budget
    # A chunk program is compiled like this graph, without a budget, and without CUDA
    # graphs: it runs inside the graph's chunk loop, which is never replayed (the op is
    # cudagraph_unsafe), and a replay would overwrite one chunk's grads with the next's.
    unbudgeted = {**(options or {}), "dynbatch.memory_budget": None, "dynbatch.chunk_size": None,
                  "triton.cudagraphs": False, "dynbatch.sparse": False}
    compile_program = functools.partial(_compile_like, mode=mode, options=unbudgeted, chunk_program=True)

    def lower_chunked(grads: Sequence[str], inputs: Sequence[Any]) -> Callable[..., Any]:
        chunked_gm, refused = chunking.chunk_grads(gm, batched_gm, grads, planner, compile_program)
        planner.refused.update(refused)
        planner.chunked = tuple(g for g in grads if g not in refused)
        return inductor.lower(chunked_gm if planner.chunked else batched_gm, inputs, opts, record, planner)

    try:
        # AOTAutograd's cache for graphs without a batched grad, whose record is all a hit must
        # bring back (NOTE [What a cache hit must not lose] in lowering/aot_cache.py); not for a
        # graph compiled in the background, whose programs arrive after the entry is written.
        compiled = inductor.lower(batched_gm, example_inputs, opts, record, planner,
                                  cache=opts.aot_cache and opts.compile != "background"
                                  and not (record.batched or record.chunk_program))
    except Exception as e:  # noqa: BLE001 - only a Replan is handled here
        replan = fx_utils.find_cause(e, memory.Replan)
        if replan is None:
            raise
        record.aten_graphs.clear()
        record.aten_node_counts.clear()
        compiled = lower_chunked(replan.grads, example_inputs)
    else:
        if planner.fits_while is not None:
            compiled = _fused_while_it_fits(compiled, planner, example_inputs, record,
                                            lambda inputs: lower_chunked(planner.grads_to_chunk(), inputs))
    record.memory_plan = planner.records()
    return compiled


def _fused_while_it_fits(fused, planner: memory.Planner, example_inputs, record: CompileRecord,
                         lower_chunked: Callable[[Sequence[Any]], Callable]) -> Callable[..., Any]:
    """NOTE [One dynamic graph across the budget] in planning/memory.py; a guard where the
    sizes cannot be read off the arguments."""
    context = _compat.tracing_context()
    # Dynamo hands a backend the real example tensors; AOTAutograd fakes them with the
    # frame's symbols.  Faked now, while new guards still count: later, one is ignored.
    fakes = memory.fake_example_inputs(context, example_inputs) if context is not None else None
    fits = planner.fits_checker(fakes) if fakes is not None else None
    if fits is None:
        planner.guard_fits()
        return fused

    def lower_when_needed() -> Callable[..., Any]:
        # The frame's guards are installed: the lowering runs in its tracing context,
        # and one that would need a new guard on the sizes is refused (it would be ignored).
        with _compat.in_tracing_context(context), grad_calls.capture_scope(), \
                memory.refusing_new_shape_guards(context):
            chunked = lower_chunked(fakes)
        if not planner.chunked:
            raise RuntimeError("; ".join(planner.refused.values()) or "no grad can be chunked")
        record.memory_plan = planner.records()
        STATS.add_chunked(record)
        log.info("dynbatch: lowered the chunked program of a graph that stopped fitting its budget%s",
                 _plan_text(record))
        return chunked

    return chunking.FusedWhileItFits(fused, fits, lower_when_needed)


def _plan_text(record: CompileRecord) -> str:
    parts = [f"{p.grad}: {p.bytes_per_sample} B/sample, B={p.batch}, "
             + (f"chunks of {p.chunk_size} ({p.chunks} at this B)" if p.applied else f"unchunked ({p.reason})")
             for p in record.memory_plan]
    return f"; memory budget {record.memory_budget} B: " + "; ".join(parts) if parts else ""


def _compile_like(fn: Callable, *, mode: str | None, options: dict[str, Any] | None,
                  chunk_program: bool = False) -> Callable:
    """``fn`` compiled by dynbatch with a graph's own mode and options."""
    backend = functools.partial(dynbatch_backend, mode=mode, options=options, chunk_program=chunk_program)
    return torch.compile(fn, backend=backend, fullgraph=True)


dynbatch_backend._dynbatch_backend = True  # how capture/grad_calls.py recognises our compiles


def _fall_back(gm: torch.fx.GraphModule, record: CompileRecord, opts: Options, reason: str):
    """Run the captured graph eagerly: eager's gradients, eager's errors."""
    record.fallback_reason = reason
    record.batched = ()
    STATS.add(record)
    if opts.on_unsupported == "error":
        raise UnsupportedGraph(f"dynbatch cannot batch this graph: {reason}")
    log.warning("dynbatch: falling back to eager for this graph: %s", reason)
    return _eager_forward(gm)


def _eager_forward(gm: torch.fx.GraphModule) -> Callable[..., Any]:
    """The captured graph run eagerly, with the requires_grad_() of inputs it traced."""
    marked = requires_grad_tracing.inputs_given_requires_grad(gm)
    if not marked:
        return gm.forward

    def forward(*args):
        for i in marked:  # the requires_grad_() the graph traced, as eager does it
            args[i].requires_grad_(True)
        return gm.forward(*args)

    return forward


grad_calls.install()
aot_cache.install()
