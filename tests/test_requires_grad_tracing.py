"""``x.detach().requires_grad_()`` inside a dynbatch compile on torch 2.11.

Stock Dynamo 2.11 graph-breaks on ``requires_grad_()``;
``requires_grad_tracing.dynamo_traces_requires_grad_of_intermediates`` traces it as 2.13
does, and the batching pass runs a graph eagerly where such a new leaf leaks
as an output with requires_grad.  On 2.13 (CI) the backport is forced on, so
these tests exercise it there too; on 2.11 it is the code path users get.
"""

from __future__ import annotations

import pytest
import torch

import dynbatch
from conftest import FALLBACK, assert_same_grads, compile_dynbatch
from dynbatch import _compat
from dynbatch.batching import grad_pass


@pytest.fixture(params=["backport", "this torch's dynamo"])
def tracing(request, monkeypatch):
    if request.param == "backport":
        monkeypatch.setattr(_compat, "DYNAMO_TRACES_REQUIRES_GRAD_", False)
    elif not _compat.DYNAMO_TRACES_REQUIRES_GRAD_:
        pytest.skip(reason="this torch's Dynamo graph-breaks on requires_grad_()")
    return request.param


W = torch.randn(6, 6, generator=torch.Generator().manual_seed(0)) / 3


def jacobian_rows(x, V):
    x = x.detach().requires_grad_()
    return torch.autograd.grad(torch.tanh(x @ W), x, V, is_grads_batched=True)[0]


def test_new_leaf_is_traced_and_batched(tracing):
    compiled = compile_dynbatch(jacobian_rows)
    for B in (3, 5, 8):
        x, V = torch.randn(4, 6), torch.randn(B, 4, 6)
        assert_same_grads(compiled(x, V), jacobian_rows(x, V), msg=f"B={B}")
    c = dynbatch.counters()
    assert c["graphs"] == c["graphs_batched"] == 2 and not c.get("fallbacks"), c


def test_functional_jacobian_is_one_graph(tracing):
    def jac(x):
        return torch.autograd.functional.jacobian(lambda z: torch.tanh(z @ W), x, vectorize=True)

    x = torch.randn(3, 6)
    assert_same_grads(compile_dynbatch(jac)(x), jac(x))
    c = dynbatch.counters()
    assert c["graphs"] == c["grads_batched"] == 1 and not c.get("fallbacks"), c


def test_a_leaked_new_leaf_runs_eagerly_with_a_reason(monkeypatch):
    """The new leaf returned with requires_grad: AOTAutograd would drop its
    autograd state, so the graph runs eagerly (2.13's Dynamo graph-breaks)."""
    monkeypatch.setattr(_compat, "DYNAMO_TRACES_REQUIRES_GRAD_", False)

    def f(x, V):
        x = x.detach().requires_grad_()
        y = torch.tanh(x @ W)
        return torch.autograd.grad(y, x, V, retain_graph=True, is_grads_batched=True)[0], y

    x, V = torch.randn(4, 6), torch.randn(3, 4, 6)
    (g, y), (g_eager, y_eager) = compile_dynbatch(f, options=FALLBACK, fullgraph=False)(x, V), f(x, V)
    assert y.requires_grad and y.grad_fn is not None
    assert_same_grads((g, y.detach()), (g_eager, y_eager.detach()))
    if dynbatch.counters().get("fallbacks"):
        reasons = " ".join(dynbatch.fallback_reasons())
        assert dynbatch.counters()["fallbacks"] == 1 and "requires_grad_()" in reasons, reasons
    else:
        # torch 2.14's Dynamo checks graph outputs itself and graph-breaks first
        breaks = " ".join(torch._dynamo.utils.counters["graph_break"])
        assert _compat.TORCH_VERSION >= "2.14" and "requires_grad_() intermediate leaked" in breaks, breaks


def _graph(returns_leaf_descendant: bool, requires_grad: bool) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    leaf = graph.call_method("detach", (x,))
    graph.call_method("requires_grad_", (leaf,))
    y = graph.call_function(torch.tanh, (leaf if returns_leaf_descendant else x,))
    y.meta["example_value"] = torch.zeros(2, requires_grad=requires_grad)
    graph.output((y,))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


@pytest.mark.parametrize("returns_leaf_descendant, requires_grad, leaks", [
    (True, True, True), (True, False, False), (False, True, False)])
def test_leak_check_on_hand_built_graphs(returns_leaf_descendant, requires_grad, leaks):
    assert grad_pass.leaks_traced_requires_grad(_graph(returns_leaf_descendant, requires_grad)) is leaks
