"""The batching pass as a plain graph-to-graph function, without Dynamo."""

from __future__ import annotations

import operator

import torch
import torch.fx

from dynbatch import batch_grads
from dynbatch.batched_grad import batched_grad
from dynbatch.capture import TRACE_ERROR
from conftest import assert_same_grads


def grad_graph(**grad_kwargs) -> torch.fx.GraphModule:
    """y = tanh(x) * x; return grad(y, x, V, **grad_kwargs)[0]"""
    g = torch.fx.Graph()
    x, V = g.placeholder("x"), g.placeholder("V")
    y = g.call_function(operator.mul, (g.call_function(torch.tanh, (x,)), x))
    grads = g.call_function(torch.autograd.grad, (y, x, V), dict(grad_kwargs))
    g.output((g.call_function(operator.getitem, (grads, 0)),))
    return torch.fx.GraphModule(torch.nn.Module(), g)


def grad_nodes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in (torch.autograd.grad, batched_grad)]


def test_batched_grad_is_rewritten_in_a_copy():
    gm = grad_graph(is_grads_batched=True, retain_graph=True)
    result = batch_grads(gm)
    assert result.modified and len(result.batched) == 1
    assert [n.target for n in grad_nodes(result.graph_module)] == [batched_grad]
    assert [n.target for n in grad_nodes(gm)] == [torch.autograd.grad]  # input untouched


def test_rewritten_graph_computes_eagers_batched_grads():
    gm = grad_graph(is_grads_batched=True, retain_graph=True)
    new_gm = batch_grads(gm).graph_module
    x = torch.randn(4, requires_grad=True)
    V = torch.randn(6, 4)
    assert_same_grads(new_gm(x, V), gm(x, V))


def test_unbatched_grad_is_left_alone():
    gm = grad_graph(retain_graph=True)
    result = batch_grads(gm)
    assert not result.modified and result.plain == (grad_nodes(gm)[0].name,)
    assert [n.target for n in grad_nodes(result.graph_module)] == [torch.autograd.grad]


def test_grad_that_raised_at_trace_time_is_reported_not_rewritten():
    gm = grad_graph(is_grads_batched=True)
    grad_nodes(gm)[0].meta[TRACE_ERROR] = "RuntimeError: boom"
    result = batch_grads(gm)
    assert result.graph_module is gm
    assert not result.batched
    (unsupported,) = result.unsupported
    assert "RuntimeError: boom" in unsupported.reason


def test_graph_without_grads_is_unchanged():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_function(torch.sin, (x,)))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    result = batch_grads(gm)
    assert not result.modified and not result.unsupported and not result.plain
    torch.testing.assert_close(result.graph_module(torch.ones(2)), torch.ones(2).sin())
