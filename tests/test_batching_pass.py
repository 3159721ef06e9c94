"""The batching pass as a plain graph-to-graph function, without Dynamo."""

from __future__ import annotations

import operator

import torch
import torch.fx

from dynbatch import batch_grads
from dynbatch.batching.grad_pass import batch_vmapped_grads
from dynbatch.batching.batched_grad import batched_grad
from dynbatch.batching.grad_pass import TRACE_ERROR
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


def vmapped_grad_graph(*, y_uses_the_vmapped_tensor=False) -> torch.fx.GraphModule:
    """What Dynamo makes of ``torch.vmap(lambda v: grad(-1 * y, x, v, retain_graph=True)[0],
    in_dims=1)(V)``, y = tanh(x) * x: the grad inside the vmap, batched in its cotangent."""
    F = torch._C._functorch
    x, V = torch.randn(4, requires_grad=True), torch.randn(4, 6)
    g = torch.fx.Graph()
    xn, Vn = g.placeholder("x"), g.placeholder("V")
    y = g.call_function(operator.mul, (g.call_function(torch.tanh, (xn,)), xn))
    g.call_function(F._vmap_increment_nesting, (6, "error"))
    v = g.call_function(F._add_batch_dim, (Vn, 1, 1))
    if y_uses_the_vmapped_tensor:
        y = g.call_function(operator.mul, (y, v))
    neg = g.call_function(operator.mul, (-1, y))
    grads = g.call_function(torch.autograd.grad, (neg, xn, v), {"retain_graph": True})
    out = g.call_function(F._remove_batch_dim, (g.call_function(operator.getitem, (grads, 0)), 1, 6, 0))
    g.call_function(F._vmap_decrement_nesting, ())
    g.output((out,))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    for node, value in zip(gm.graph.nodes, (x, V)):
        node.meta["example_value"] = value
    for node in gm.graph.nodes:  # the unbatched values Dynamo records
        if node.target is operator.getitem:
            node.meta["example_value"] = torch.empty(4)
    return gm, x, V


def test_a_grad_under_vmap_batched_in_its_cotangent_becomes_a_batched_grad_before_the_vmap():
    gm, x, V = vmapped_grad_graph()
    new_gm = batch_vmapped_grads(gm)
    assert new_gm is not gm and [n.kwargs.get("is_grads_batched") for n in grad_nodes(gm)] == [None]
    order = [n.name for n in new_gm.graph.nodes]
    (new,) = grad_nodes(new_gm)
    assert new.kwargs["is_grads_batched"] and new.kwargs["retain_graph"]
    # the grad and the unbatched -1 * y it differentiates moved before the vmap
    assert order.index(new.name) < order.index("_vmap_increment_nesting")
    assert order.index(new.args[0].name) < order.index("_vmap_increment_nesting")
    assert_same_grads(new_gm(x, V), gm(x, V))
    assert batch_grads(new_gm).batched == (new.name,)


def test_a_grad_whose_output_depends_on_the_vmapped_tensor_is_left_alone():
    gm, x, V = vmapped_grad_graph(y_uses_the_vmapped_tensor=True)
    assert batch_vmapped_grads(gm) is gm


def test_a_grad_under_a_vmap_that_allows_random_ops_is_left_alone():
    gm, x, V = vmapped_grad_graph()
    (vmap,) = [n for n in gm.graph.nodes if getattr(n.target, "__name__", "") == "_vmap_increment_nesting"]
    vmap.args = (6, "different")  # a random op in the vmap could then stand where the grad would move
    assert batch_vmapped_grads(gm) is gm
