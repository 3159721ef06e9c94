"""The ``dynbatch`` Dynamo backend: capture -> batching pass -> shape checks -> lowering.

Registered under the name "dynbatch" through the ``torch_dynamo_backends``
entry point (pyproject.toml), so ``torch.compile(fn, backend="dynbatch")``
works without importing dynbatch first.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Sequence

import torch.fx

from . import _compat, batching, capture, lowering, region
from .graph_text import graph_text
from .options import Options
from .records import STATS, CompileRecord

log = logging.getLogger("dynbatch")


class UnsupportedGraph(RuntimeError):
    """Raised instead of falling back when ``dynbatch.on_unsupported="error"``."""


def dynbatch_backend(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    mode: str | None = None,
    options: dict[str, Any] | None = None,
) -> Callable[..., Any]:
    opts = Options.from_compile_args(mode, options)
    record = CompileRecord()
    if opts.record_graphs:
        record.dynamo_graph = graph_text(gm, "dynamo")

    result = batching.batch_grads(gm)
    record.batched, record.plain = result.batched, result.plain
    if result.unsupported:
        reason = "; ".join(f"{u.node}: {u.reason}" for u in result.unsupported)
        return _fall_back(gm, record, opts, reason)
    if opts.record_graphs:
        record.batched_graph = graph_text(result.graph_module, "batched")

    try:
        compiled = lowering.lower(result.graph_module, example_inputs, opts, record)
    except _compat.restart_analysis_exceptions():
        raise  # Dynamo asks to re-trace the frame (e.g. to tensorify a float); not a failure
    except Exception as e:  # noqa: BLE001 - never hand back a graph we could not lower
        if not result.batched or opts.on_unsupported == "error":
            raise
        return _fall_back(gm, record, opts, f"lowering the batched graph failed: {type(e).__name__}: {e}")
    STATS.add(record)
    log.info("dynbatch: compiled a graph with %d batched and %d plain grad(s)",
             len(record.batched), len(record.plain))
    # What a grad taken outside this graph gets: NOTE [Region backward] in region.py.
    return region.Region(
        gm, compiled, example_inputs,
        recompile=functools.partial(_compile_like, mode=mode, options=options),
        random_ops=record.random_ops,
        mutates_differentiable_input=record.mutates_differentiable_input,
    )


def _compile_like(fn: Callable, *, mode: str | None, options: dict[str, Any] | None) -> Callable:
    """``fn`` compiled by dynbatch with a graph's own mode and options."""
    backend = functools.partial(dynbatch_backend, mode=mode, options=options)
    return torch.compile(fn, backend=backend, fullgraph=True)


dynbatch_backend._dynbatch_backend = True  # how capture.py recognises our compiles


def _fall_back(gm: torch.fx.GraphModule, record: CompileRecord, opts: Options, reason: str):
    """Run the captured graph eagerly: eager's gradients, eager's errors."""
    record.fallback_reason = reason
    record.batched = ()
    STATS.add(record)
    if opts.on_unsupported == "error":
        raise UnsupportedGraph(f"dynbatch cannot batch this graph: {reason}")
    log.warning("dynbatch: falling back to eager for this graph: %s", reason)
    return gm.forward


capture.install()
