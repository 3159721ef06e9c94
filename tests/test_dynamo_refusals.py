"""Calls Dynamo itself refuses keep Dynamo's behaviour under dynbatch — issue 2 item 2.

With fullgraph=False they graph-break and run eagerly (eager's result);
with fullgraph=True they raise Dynamo's Unsupported error.  Never a wrong result.
"""

from __future__ import annotations

import pytest
import torch

import dynbatch
from conftest import assert_same_grads, compile_dynbatch
from helpers_reliability import graph_breaks


def gradient_edge_program(x, V):
    y = x.sin()
    edge = torch.autograd.graph.get_gradient_edge(y)
    return torch.autograd.grad(y.cos(), edge, V, is_grads_batched=True)


def consumed_graph_program(x, V):
    y = x * 2
    (g,) = torch.autograd.grad(y, x, V, is_grads_batched=True)
    return y, g  # y's graph was consumed by the grad


def outside_path_program(h, W, V):
    # grad w.r.t. W must traverse h's grad_fn, which was built outside.
    return torch.autograd.grad(torch.tanh(h @ W), W, V, is_grads_batched=True)


CASES = {
    "gradient_edge": (gradient_edge_program, lambda: (torch.randn(3, requires_grad=True), torch.randn(2, 3))),
    "grad_fn_from_outside": (
        outside_path_program,
        lambda: ((torch.randn(4, requires_grad=True) * 2).reshape(2, 2), torch.randn(2, 2, requires_grad=True),
                 torch.randn(3, 2, 2)),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_graph_break_gives_eagers_result(case):
    fn, make_args = CASES[case]
    args = make_args()
    try:
        expected = fn(*args)
    except Exception as e:  # where eager refuses, the compiled call raises the same type
        with pytest.raises(type(e)):
            compile_dynbatch(fn, fullgraph=False)(*args)
    else:
        got = compile_dynbatch(fn, fullgraph=False)(*args)
        for a, b in zip(_as_tuple(got), _as_tuple(expected), strict=True):  # same number of results too
            if isinstance(a, tuple):
                assert_same_grads(a, b)
            else:
                torch.testing.assert_close(a, b)
    # Dynamo's refusal is a graph break (the grad runs eagerly), not a dynbatch fallback.
    assert graph_breaks() > 0
    assert not dynbatch.counters().get("fallbacks"), dynbatch.fallback_reasons()


def _as_tuple(r):
    return tuple(r) if isinstance(r, (tuple, list)) else (r,)


@pytest.mark.parametrize("case", sorted(CASES))
def test_fullgraph_raises_dynamos_error(case):
    fn, make_args = CASES[case]
    with pytest.raises(torch._dynamo.exc.Unsupported):
        compile_dynbatch(fn, fullgraph=True)(*make_args())


def test_a_returned_tensor_whose_graph_the_grad_consumed_stays_in_one_graph():
    """Stock Dynamo refuses this frame in one graph (it breaks before the grad); dynbatch keeps
    it whole (NOTE [A grad that consumes returned tensors] in capture/grad_calls.py), with eager's values."""
    x, V = torch.randn(3, requires_grad=True), torch.randn(2, 3)
    y, g = compile_dynbatch(consumed_graph_program)(x, V)  # fullgraph=True
    y_eager, g_eager = consumed_graph_program(x, V)
    torch.testing.assert_close((y, g), (y_eager, g_eager))
    assert dynbatch.counters()["graphs"] == 1 and dynbatch.counters()["grads_batched"] == 1
    assert graph_breaks() == 0
