"""The passes around lowering: sink_expands (post-grad) and the symbolic slice_backward rule."""

from __future__ import annotations

import torch
import torch.fx

import dynbatch
from dynbatch.passes import sink_expands
from conftest import assert_same_grads

aten = torch.ops.aten


def _graph(op, *, random=False):
    """out = op(expand(a, [3, 4, 5]), expand(b, [3, 4, 5]))"""
    g = torch.fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    ea = g.call_function(aten.expand.default, (a, [3, 4, 5]))
    eb = g.call_function(aten.expand.default, (b, [3, 4, 5]))
    out = g.call_function(op, (ea,) if random else (ea, eb))
    g.output(out)
    return g


def test_sink_expands_computes_pointwise_once_and_keeps_values():
    g = _graph(aten.mul.Tensor)
    before = torch.fx.GraphModule(torch.nn.Module(), g)
    a, b = torch.randn(4, 1), torch.randn(5)
    expected = before(a, b)
    assert sink_expands(g) == 1
    after = torch.fx.GraphModule(torch.nn.Module(), g)
    targets = [n.target for n in g.nodes if n.op == "call_function"]
    assert targets == [aten.mul.Tensor, aten.expand.default]
    torch.testing.assert_close(after(a, b), expected)


def test_sink_expands_leaves_random_ops_alone():
    g = _graph(aten.bernoulli.p, random=True)
    node = [n for n in g.nodes if n.target is aten.bernoulli.p][0]
    node.args = (node.args[0], 0.5)
    assert sink_expands(g) == 0


def test_sliced_hessian_keeps_batch_size_symbolic():
    """slice_backward under vmap used to read B as an int: one graph per B."""
    w = torch.randn(10)

    def hvp_rows(theta, V):
        loss = (torch.tanh(theta[:6] * w[:6]).sum() + theta[6:].pow(3).sum())
        (g,) = torch.autograd.grad(loss, theta, create_graph=True)
        return torch.autograd.grad(g, theta, V, is_grads_batched=True)

    compiled = torch.compile(hvp_rows, backend="dynbatch", fullgraph=True,
                             options={"dynbatch.inner_compiler": "aot_eager"})
    theta = torch.randn(10, requires_grad=True)
    for K in (2, 3, 5, 8, 13):
        V = torch.randn(K, 10)
        assert_same_grads(compiled(theta, V), hvp_rows(theta, V))
    assert dynbatch.counters()["graphs"] <= 2, dynbatch.counters()


def test_slice_backward_override_is_scoped_to_dynbatch_compiles():
    # Outside a dynbatch compile functorch's own rule runs; results agree anyway.
    x = torch.randn(6, requires_grad=True)
    y = x[1:4].sin()
    V = torch.randn(3, 3)
    eager = torch.autograd.grad(y, x, V, is_grads_batched=True, retain_graph=True)
    rule = dynbatch.batched_grad(y, x, V, retain_graph=True)
    assert_same_grads(rule, eager)
