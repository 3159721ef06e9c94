"""Stage 4: lowering the batched graph through AOTAutograd to Inductor.

AOTAutograd traces the graph (running ``batched_grad`` under functorch's
vmap, so the backward is emitted once with a symbolic batch size), then the
inner compiler turns the aten graph into kernels: Inductor's C++ on CPU and
Triton on CUDA, or eager kernels for cheap test sweeps.  Both inner
compilers are wrapped to keep the aten graph's text for the compile record.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch.fx

from . import _compat, passes
from .graph_text import count_nodes, graph_text
from .options import Options
from .records import CompileRecord


def lower(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    options: Options,
    record: CompileRecord,
) -> Callable[..., Any]:
    if options.inner_compiler == "inductor":
        return _lower_with_inductor(gm, example_inputs, options, record)
    return _lower_with_aot_eager(gm, example_inputs, options, record)


def _remember(gm: torch.fx.GraphModule, record: CompileRecord, title: str, keep_text: bool) -> None:
    record.aten_node_counts.append(count_nodes(gm))
    if keep_text:
        record.aten_graphs.append(graph_text(gm, title))


def _lower_with_inductor(gm, example_inputs, options: Options, record: CompileRecord):
    inner = _compat.compile_fx_inner()

    def recording_inner_compile(aten_gm, aten_inputs, **kwargs):
        title = "aten backward" if kwargs.get("is_backward") else "aten forward"
        _remember(aten_gm, record, title, options.record_graphs)
        return inner(aten_gm, aten_inputs, **kwargs)

    config_patches = dict(options.inductor_config)
    # After vmap, elementwise derivative factors are computed on expanded (B-fold)
    # copies of the primal; compute them once (passes.SinkExpands), unless the
    # user brought their own pass.
    config_patches.setdefault("post_grad_custom_pre_pass", passes.SinkExpands())
    return _compat.compile_fx(
        gm,
        example_inputs,
        inner_compile=recording_inner_compile,
        config_patches=config_patches,
    )


def _lower_with_aot_eager(gm, example_inputs, options: Options, record: CompileRecord):
    def compiler(title: str):
        def compile_graph(aten_gm, aten_inputs):
            _remember(aten_gm, record, title, options.record_graphs)
            return _compat.make_boxed_func(aten_gm.forward)

        return compile_graph

    backend = _compat.aot_autograd(
        fw_compiler=compiler("aten forward"),
        bw_compiler=compiler("aten backward"),
        inference_compiler=compiler("aten forward"),
    )
    return backend(gm, example_inputs)
