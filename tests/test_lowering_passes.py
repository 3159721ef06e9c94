"""The passes around lowering: sink_expands (post-grad) and dynbatch's batching rules (batching/batch_rules.py)."""

from __future__ import annotations

import contextlib
import functools
import warnings

import pytest
import torch
import torch.fx
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import dynbatch
from dynbatch.batching import batch_rules
from dynbatch.lowering.aten_passes import sink_expands
from conftest import DEFAULTS, FALLBACK, assert_same_grads, compile_dynbatch, loop_grads

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


def test_sink_expands_broadcasts_expands_of_different_sizes_and_skips_contiguous_copies():
    """layer_norm's backward under vmap: (clone(expand(x)) - clone(expand(mean))) * expand(rstd)."""
    g = torch.fx.Graph()
    x, mean, rstd = g.placeholder("x"), g.placeholder("mean"), g.placeholder("rstd")
    ex = g.call_function(aten.clone.default, (g.call_function(aten.expand.default, (x, [3, 4, 5])),),
                         {"memory_format": torch.contiguous_format})
    em = g.call_function(aten.clone.default, (g.call_function(aten.expand.default, (mean, [3, 4, 1])),))
    er = g.call_function(aten.expand.default, (rstd, [3, 4, 1]))
    out = g.call_function(aten.mul.Tensor, (g.call_function(aten.sub.Tensor, (ex, em)), er))
    g.output(out)
    before = torch.fx.GraphModule(torch.nn.Module(), g)
    args = torch.randn(4, 5), torch.randn(4, 1), torch.randn(4, 1)
    expected = before(*args)
    assert sink_expands(g) == 4  # both clones, the sub and the mul
    after = torch.fx.GraphModule(torch.nn.Module(), g)
    (expand,) = [n for n in g.nodes if n.target is aten.expand.default]  # one, of the result
    assert [u.op for u in expand.users] == ["output"] and expand.args[1] == [3, 4, 5]
    torch.testing.assert_close(after(*args), expected)


def test_sink_expands_keeps_ops_whose_expands_disagree():
    g = torch.fx.Graph()
    a, b, n = g.placeholder("a"), g.placeholder("b"), g.placeholder("n")
    ea = g.call_function(aten.expand.default, (a, [n, 4]))
    eb = g.call_function(aten.expand.default, (b, [3, 4]))  # n is not known to be 3
    g.output(g.call_function(aten.add.Tensor, (ea, eb)))
    assert sink_expands(g) == 0


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

    compiled = compile_dynbatch(hvp_rows, options=FALLBACK)
    theta = torch.randn(10, requires_grad=True)
    for K in (2, 3, 5, 8, 13):
        V = torch.randn(K, 10)
        assert_same_grads(compiled(theta, V), hvp_rows(theta, V))
    assert dynbatch.counters()["graphs"] <= 2, dynbatch.counters()


def test_batched_grad_through_a_slice_outside_dynbatch_compiles():
    # Outside a dynbatch compile functorch's own slice_backward rule runs; results agree anyway.
    x = torch.randn(6, requires_grad=True)
    y = x[1:4].sin()
    V = torch.randn(3, 3)
    eager = torch.autograd.grad(y, x, V, is_grads_batched=True, retain_graph=True)
    rule = dynbatch.batched_grad(y, x, V, retain_graph=True)
    assert_same_grads(rule, eager)


def _has_batched_kernel(op: torch._ops.OpOverload) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "FuncTorchBatched")


def test_mm_with_only_the_right_operand_batched_is_one_bmm_without_copies():
    """a.T @ g[b] (attention's p.T @ g): functorch's rule computed it transposed, with a
    transposed copy of g in and of the result out; batch_rules.mm makes it a bmm."""
    a = torch.randn(6, 6)

    def f(x, w, V):
        y = a @ torch.tanh(x @ w)  # grad of x: a.T @ g (right batched); of w: x.T @ g'
        return torch.autograd.grad(y, (x, w), V, is_grads_batched=True)

    compiled = compile_dynbatch(f)
    x, w = torch.randn(6, 4, requires_grad=True), torch.randn(4, 5, requires_grad=True)
    for B in (2, 3, 7):
        V = torch.randn(B, 6, 5)
        assert_same_grads(compiled(x, w, V), loop_grads(a @ torch.tanh(x @ w), (x, w), V), msg=f"B={B}")
    assert dynbatch.counters()["graphs"] <= 2, dynbatch.counters()
    graph = dynbatch.compile_records()[-1].aten_graphs[-1]
    assert "aten.bmm" in graph and "aten.clone" not in graph, graph


def test_overrides_are_scoped_to_dynbatch_compiles():
    no_rule = [op for op in batch_rules.decomposed_rules() if not _has_batched_kernel(op)]
    assert aten.rrelu_with_noise_backward.default in no_rule  # no functorch rule on any supported torch
    with batch_rules.symbolic_batch_rules():
        assert all(_has_batched_kernel(op) for op in no_rule)
    assert not any(_has_batched_kernel(op) for op in no_rule)  # functorch's own dispatch again


_TARGET, _INDICES = torch.randn(4, 6), torch.tensor([[0, 2], [3, 3]])
# name -> (input shape, layer).  Each layer's backward goes through one of dynbatch's rules.
_LAYERS = {
    # no functorch rule: vmap's per-sample fallback (a graph that grows with B)
    "mish": ((4, 6), F.mish),
    "rrelu": ((4, 6), lambda x: F.rrelu(x, training=False)),
    "soft_margin": ((4, 6), lambda x: F.soft_margin_loss(x, _TARGET, reduction="none")),
    "batch_norm_with_update": ((4, 6), lambda x: aten._batch_norm_with_update(  # batch_norm_backward
        x, torch.ones(6, dtype=x.dtype), torch.zeros(6, dtype=x.dtype),
        torch.zeros(6, dtype=x.dtype), torch.ones(6, dtype=x.dtype), 0.1, 1e-5)[0]),
    # functorch rules that read B as an int
    "gelu": ((4, 6), F.gelu),
    "glu": ((4, 6), F.glu),
    "binary_cross_entropy": ((4, 6), lambda x: F.binary_cross_entropy(torch.sigmoid(x), _TARGET.sigmoid().to(x.dtype),
                                                                      reduction="none")),
    "embedding": ((4, 6), lambda w: F.embedding(_INDICES, w)),
    "split": ((4, 6), lambda x: x.split([2, 3, 1], dim=1)[1].sin()),  # cat of batched and zeros
    "avg_pool2d": ((2, 3, 4, 6), lambda x: F.avg_pool2d(x, 2)),
    "max_pool2d": ((2, 3, 4, 6), lambda x: F.max_pool2d(x, 2)),
    "adaptive_max_pool3d": ((2, 3, 4, 6), lambda x: F.adaptive_max_pool3d(x[None], (1, 2, 2))[0]),  # size-1 dim 0
    "reflection_pad": ((2, 3, 4, 6), lambda x: F.pad(x, (1, 2, 1, 0), mode="reflect")),
}


@pytest.mark.parametrize("layer", list(_LAYERS))
def test_backward_keeps_batch_size_symbolic(layer):
    """One graph for every B >= 2, values equal eager's (which loops per sample)."""
    shape, fn = _LAYERS[layer]

    def f(x, V):
        y = fn(x)
        return torch.autograd.grad(y, x, V.reshape(V.shape[0], *y.shape), is_grads_batched=True)

    compiled = compile_dynbatch(f, options=FALLBACK)
    x = torch.randn(shape, requires_grad=True)
    n_out = fn(x).numel()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*performance drop.*")  # vmap's per-sample fallback
        for B in (2, 3, 5, 8):
            V = torch.randn(B, n_out)
            assert_same_grads(compiled(x, V), f(x, V))
    assert dynbatch.counters()["graphs"] <= 2, dynbatch.counters()
    assert dynbatch.counters().get("fallbacks", 0) == 0


@pytest.mark.parametrize("layer", ["mish", "rrelu", "soft_margin", "batch_norm_with_update", "glu",
                                   "binary_cross_entropy", "split", "avg_pool2d", "layer_norm"])
def test_double_backward_through_rules_matches_eager(layer):
    """create_graph=True: autograd records the batched backward for a second
    grad.  Found by the fuzz tests: a decomposition that takes the forward's
    mean/rstd as inputs gave a wrong second-order grad through layer_norm."""
    shape, fn = {**_LAYERS, "layer_norm": ((4, 6), lambda x: F.layer_norm(x, (6,)))}[layer]

    def f(x, V):
        y = fn(x)
        (g,) = torch.autograd.grad(y, x, V.reshape(V.shape[0], *y.shape), create_graph=True, is_grads_batched=True)
        return torch.autograd.grad((g * g).sum(), x)

    compiled = compile_dynbatch(f, options=FALLBACK)
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    V = torch.randn(3, fn(x).numel(), dtype=torch.float64)
    assert_same_grads(compiled(x, V), f(x, V))
    assert dynbatch.counters().get("fallbacks", 0) == 0


def _cats(b, e):
    """cat with batched x and unbatched b / e (1-d empty: skipped by cat)."""
    return {
        "mixed": lambda x: torch.cat([x, b, e], 0),
        "negative dim": lambda x: torch.cat([b[None], x[None]], -1),
        "transposed": lambda x: torch.cat([x[:, None], x[:, None].mul(2)], 1),
        "nested": lambda x: torch.func.vmap(lambda r: torch.cat([r, x]))(b[:, None].expand(4, 3)),
    }


@pytest.mark.parametrize("case", list(_cats(torch.zeros(1), torch.zeros(1))))
def test_cat_rule_equals_functorchs(case):
    b, e = torch.randn(4), torch.zeros(0)
    fn = _cats(b, e)[case]
    x = torch.randn(5, 4)
    want = torch.func.vmap(fn)(x)
    with batch_rules.symbolic_batch_rules():
        got = torch.func.vmap(fn)(x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


_GELU_CASES = {  # in_dims, grad_output shape, self shape (B = 5)
    "batched grad": ((0, None), (5, 3, 4), (3, 4)),
    "batched self": ((None, 0), (3, 4), (5, 3, 4)),
    "both, grad bdim 1": ((1, 0), (3, 5, 4), (5, 3, 4)),
    "both": ((0, 0), (5, 3, 4), (5, 3, 4)),
}


@pytest.mark.parametrize("case", list(_GELU_CASES))
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_backward_rule_equals_functorchs(case, approximate):
    in_dims, g_shape, x_shape = _GELU_CASES[case]
    g, x = torch.randn(g_shape), torch.randn(x_shape)

    def fn(a, b):
        return torch.ops.aten.gelu_backward(a, b, approximate=approximate)

    want = torch.func.vmap(fn, in_dims=in_dims)(g, x)
    with batch_rules.symbolic_batch_rules():
        got = torch.func.vmap(fn, in_dims=in_dims)(g, x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


_FMA_CASES = {  # in_dims, shapes of a, b, c (B = 5): softmax's backward, fma(-y, sum(g*y), g*y)
    "all batched": ((0, 0, 0), (5, 3, 4), (5, 3, 1), (5, 3, 4)),
    "sum unbatched": ((0, None, 0), (5, 3, 4), (3, 1), (5, 3, 4)),
    "one batched, bdim 1": ((None, 1, None), (3, 4), (3, 5, 1), (3, 4)),
    "ranks differ": ((0, 0, None), (5, 2, 3, 4), (5, 4), (3, 1)),
}


@pytest.mark.parametrize("case", list(_FMA_CASES))
def test_inductors_fma_rule_is_one_batched_op_equal_to_the_loop(case):
    import torch._inductor.inductor_prims  # noqa: F401 - defines prims.fma

    in_dims, *shapes = _FMA_CASES[case]
    a, b, c = (torch.randn(s, dtype=torch.float64) for s in shapes)
    fma = torch.ops.prims.fma.default
    want = torch.stack([fma(*(t if d is None else t.select(d, i) for t, d in zip((a, b, c), in_dims)))
                        for i in range(5)])
    batched = functools.partial(torch.func.vmap(fma, in_dims=in_dims))
    with batch_rules.symbolic_batch_rules():
        got = batched(a, b, c)
        # One fma over a symbolic B (functorch's fallback runs it once per sample).
        traced = make_fx(batched, tracing_mode="symbolic")(a, b, c)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert [n.target for n in traced.graph.nodes].count(fma) == 1, traced.code


@pytest.mark.parametrize("p", [0.0, 0.5, 1.0, 2.0, float("inf")])
@pytest.mark.parametrize("shapes", [((5, 4), (6, 4)), ((2, 5, 4), (2, 6, 4)), ((2, 1, 1, 2), (1, 2, 2)),
                                    ((0, 4, 5), (3, 5))], ids=["2d", "batched", "broadcast", "empty"])
def test_cdist_backward_matches_the_loop(p, shapes):
    """functorch's _cdist_backward rule gave wrong batched grads (off by up to 200
    for p=0.5, torch 2.13); found by the all-samples OpInfo sweep."""
    x1 = torch.randn(shapes[0], dtype=torch.float64, requires_grad=True)
    x2 = torch.randn(shapes[1], dtype=torch.float64, requires_grad=True)

    def f(x1, x2, V):
        return torch.autograd.grad(torch.cdist(x1, x2, p=p), (x1, x2), V, is_grads_batched=True)

    compiled = compile_dynbatch(f, options=FALLBACK)
    V = torch.randn(3, *torch.cdist(x1, x2).shape, dtype=torch.float64)
    assert_same_grads(compiled(x1, x2, V), loop_grads(torch.cdist(x1, x2, p=p), [x1, x2], [V]))
    assert dynbatch.counters()["grads_batched"] == 1 and dynbatch.counters().get("fallbacks", 0) == 0


@pytest.mark.parametrize("shape,shifts,dims", [((), 10, ()), ((3, 4), 2, ()), ((3, 4), (1, -1), (0, 1)),
                                               ((2, 3, 4), 5, (-1,))])
def test_roll_backward_matches_the_loop(shape, shifts, dims):
    """functorch's roll rule rolled a 0-d sample across the batch: the batched grad of
    torch.roll of a 0-d tensor came out rotated (found by the all-samples OpInfo sweep)."""
    def f(x, V):
        return torch.autograd.grad(torch.roll(x, shifts, dims), x, V, is_grads_batched=True)

    compiled = compile_dynbatch(f, options=FALLBACK)
    x = torch.randn(shape, requires_grad=True)
    V = torch.randn(3, *shape)
    assert_same_grads(compiled(x, V), loop_grads(torch.roll(x, shifts, dims), [x], [V]))
    assert dynbatch.counters()["grads_batched"] == 1


def _check_batch_sweep(compiled, primals, target, batch_sizes=(2, 3, 5)):
    """compiled(*primals, V) equals the loop over V's rows for each B, and one
    graph serves every B after the first (the second B makes it symbolic)."""
    for B in batch_sizes:
        out = target(*primals)
        V = torch.randn(B, *out.shape, dtype=out.dtype)
        assert_same_grads(compiled(*primals, V), loop_grads(out, primals, [V]), msg=f"B={B}")
    assert dynbatch.counters()["graphs"] <= 2, dynbatch.counters()


# (spatial dims, transposed, groups, stride, dilation, padding, bias)
_CONVS = [
    (1, False, 1, 1, 1, 0, True),
    (2, False, 2, 2, 1, 1, True),
    (2, True, 1, 1, 1, 1, False),
    (2, True, 2, 2, 2, 0, True),
    (3, False, 1, 1, 2, 1, False),
    (3, True, 2, 1, 1, 0, True),
]


def _conv_case(dim, transposed, groups, stride, dilation, padding, bias, dtype=torch.float64):
    n, c_in, c_out, size = 2, 4, 6, 8 if dim < 3 else 6
    x = torch.randn(n, c_in, *[size] * dim, dtype=dtype, requires_grad=True)
    w_shape = (c_in, c_out // groups) if transposed else (c_out, c_in // groups)
    w = torch.randn(*w_shape, *[3] * dim, dtype=dtype, requires_grad=True)
    b = torch.randn(c_out, dtype=dtype, requires_grad=True) if bias else None
    conv = getattr(F, f"conv_transpose{dim}d" if transposed else f"conv{dim}d")

    def layer(x, w, b):
        return conv(x, w, b, stride=stride, padding=padding, dilation=dilation, groups=groups)

    return layer, [t for t in (x, w, b) if t is not None]


@pytest.mark.parametrize("config", _CONVS, ids=lambda c: "conv{}d{}-g{}-s{}-d{}-p{}{}".format(
    c[0], "T" if c[1] else "", c[2], c[3], c[4], c[5], "-bias" if c[6] else ""))
@pytest.mark.parametrize("order", ["first", "second"])
def test_convolution_rules_match_the_loop_with_one_graph_for_every_B(config, order):
    """functorch's convolution and convolution_backward rules read B as an int,
    so every new B compiled again.  First order: only the cotangents carry B.
    Second order (a grad of the input grad, create_graph): the double backward
    convolves batched inputs or weights, folded into the groups."""
    layer, primals = _conv_case(*config)

    def f(*args):
        *ps, V = args
        y = layer(*ps) if len(ps) == 3 else layer(ps[0], ps[1], None)
        if order == "second":
            (y,) = torch.autograd.grad((y * y).sum(), ps[:2], create_graph=True)[1:]  # the weight grad
        return torch.autograd.grad(y, ps, V, is_grads_batched=True)

    def target(*ps):
        y = layer(*ps) if len(ps) == 3 else layer(ps[0], ps[1], None)
        return torch.autograd.grad((y * y).sum(), ps[1], create_graph=True)[0] if order == "second" else y

    _check_batch_sweep(compile_dynbatch(f, options=FALLBACK), primals, target)
    assert dynbatch.counters().get("fallbacks", 0) == 0


def test_convolution_weight_grad_keeps_batch_size_symbolic_through_inductor():
    """The rules fold B into the weight's sizes of a convolution_backward, which
    Inductor's lowering reads as ints; dynbatch's lowering makes those calls
    extern.  float64: PyTorch picks the CPU kernel for float32 by whether
    B*N >= 16, a guard of its own (see docs/usage.md)."""
    layer, primals = _conv_case(2, False, 2, 1, 1, 1, True)

    def f(x, w, b, V):
        return torch.autograd.grad(layer(x, w, b), (x, w, b), V, is_grads_batched=True)

    compiled = compile_dynbatch(f, options=DEFAULTS)
    from torch._inductor import lowering as inductor

    lowering_before = dict(inductor.lowerings)
    for B in (2, 3, 5, 16):
        y = layer(*primals)
        V = torch.randn(B, *y.shape, dtype=y.dtype)
        assert_same_grads(compiled(*primals, V), loop_grads(y, primals, [V]), msg=f"B={B}")
    assert dynbatch.counters()["graphs"] == 2, dynbatch.counters()
    assert dict(inductor.lowerings) == lowering_before  # scoped to dynbatch's lowering


# name -> (input shape, affine shape, layer(x, w, b)).  float64.
_NORMS = {
    "layer_norm": ((3, 5), (5,), lambda x, w, b: F.layer_norm(x, (5,), w, b)),
    "layer_norm_2d": ((2, 3, 4), (3, 4), lambda x, w, b: F.layer_norm(x, (3, 4), w, b)),
    "layer_norm_whole": ((2, 3), (2, 3), lambda x, w, b: F.layer_norm(x, (2, 3), w, b)),
    "batch_norm": ((4, 3, 2), (3,), lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True)),
    "batch_norm_2d_input": ((5, 3), (3,), lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True)),
    "batch_norm_eval": ((4, 3, 2), (3,), lambda x, w, b: F.batch_norm(
        x, torch.linspace(-1, 1, 3, dtype=x.dtype), torch.linspace(0.5, 2, 3, dtype=x.dtype), w, b)),
    "instance_norm": ((2, 3, 4), (3,), lambda x, w, b: F.instance_norm(x, weight=w, bias=b)),
    "group_norm": ((2, 4, 3), (4,), lambda x, w, b: F.group_norm(x, 2, w, b)),
    "group_norm_4d": ((2, 6, 3, 2), (6,), lambda x, w, b: F.group_norm(x, 3, w, b)),
    "group_norm_2d_input": ((3, 4), (4,), lambda x, w, b: F.group_norm(x, 2, w, b)),
    "group_norm_one_sample": ((1, 4, 3), (4,), lambda x, w, b: F.group_norm(x, 2, w, b)),
    "group_norm_no_samples": ((0, 4, 3), (4,), lambda x, w, b: F.group_norm(x, 2, w, b)),
}


def _norm_case(name):
    x_shape, w_shape, layer = _NORMS[name]
    x = torch.randn(x_shape, dtype=torch.float64, requires_grad=True)
    w = torch.randn(w_shape, dtype=torch.float64, requires_grad=True)
    b = torch.randn(w_shape, dtype=torch.float64, requires_grad=True)
    return layer, [x, w, b]


@pytest.mark.parametrize("name", list(_NORMS))
def test_norm_backward_rules_match_the_loop_with_one_graph_for_every_B(name):
    """functorch's layer, batch and group norm backward rules read B as an int."""
    layer, primals = _norm_case(name)

    def f(x, w, b, V):
        return torch.autograd.grad(layer(x, w, b), (x, w, b), V, is_grads_batched=True)

    compiled = compile_dynbatch(f, options=FALLBACK)
    _check_batch_sweep(compiled, primals, layer)
    y = layer(*primals)
    # stride 0 along B (a new layout, so Dynamo compiles again); with one sample
    # the folded grad stays strided, which the CPU group norm kernel misreads
    V = torch.randn(1, *y.shape, dtype=y.dtype).expand(4, *y.shape)
    assert_same_grads(compiled(*primals, V), loop_grads(y, primals, [V]), msg="expanded")
    assert dynbatch.counters().get("fallbacks", 0) == 0


@pytest.mark.parametrize("name", list(_NORMS))
def test_norm_weight_grads_under_create_graph_differentiate_like_the_loop(name):
    """Batched weight grads with create_graph=True, then a grad of them by the
    input.  functorch's rules computed the weight grad from the forward's saved
    mean and rstd, which autograd does not differentiate: torch.func.vmap and
    dynbatch returned a wrong input grad here (torch 2.13: off by 6 for layer
    norm, 8 for batch and instance norm; eager is_grads_batched was right)."""
    layer, primals = _norm_case(name)

    def second(gs):
        return torch.autograd.grad(sum((g * g.sin()).sum() for g in gs), primals,
                                   allow_unused=True, materialize_grads=True)

    def f(x, w, b, V):
        gs = torch.autograd.grad(layer(x, w, b), (x, w, b), V, create_graph=True, is_grads_batched=True)
        return torch.autograd.grad(sum((g * g.sin()).sum() for g in gs), (x, w, b),
                                   allow_unused=True, materialize_grads=True)

    compiled = compile_dynbatch(f, options=FALLBACK)
    y = layer(*primals)
    V = torch.randn(4, *y.shape, dtype=y.dtype)
    expected = second(loop_grads(y, primals, [V], create_graph=True))
    assert_same_grads(compiled(*primals, V), expected)
    assert dynbatch.counters()["grads_batched"] == 1 and dynbatch.counters().get("fallbacks", 0) == 0


def test_batch_norm_with_a_strided_weight_gets_the_true_gradient():
    """Eager's CPU native_batch_norm_backward reads a non-contiguous weight as if
    it were dense (torch 2.13: gradcheck fails, the input grad is off by ~0.3),
    so the eager loop is wrong here; dynbatch's rule repeats the weight into a
    dense tensor and matches the loop run with the same weight made dense."""
    weight = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64).t()[0]  # [1, 3], stride 2
    x = torch.randn(4, 2, dtype=torch.float64, requires_grad=True)

    def f(x, V):
        return torch.autograd.grad(F.batch_norm(x, None, None, weight, None, training=True), x, V,
                                   is_grads_batched=True)

    compiled = compile_dynbatch(f, options=FALLBACK)
    V = torch.randn(3, 4, 2, dtype=torch.float64)
    dense = F.batch_norm(x, None, None, weight.contiguous(), None, training=True)
    assert_same_grads(compiled(x, V), loop_grads(dense, [x], [V]))
    assert dynbatch.counters()["grads_batched"] == 1


@pytest.mark.parametrize("op_name", ["cudnn_batch_norm_backward", "miopen_batch_norm_backward"])
def test_gpu_batch_norm_backward_rules_batch_like_the_native_op_to_second_order(op_name):
    """On CUDA, batch norm with weight and bias differentiates through cuDNN's
    (ROCm: MIOpen's) backward op, whose functorch rule is the native one's
    (B read as an int, a wrong double backward).  dynbatch's rule makes it the
    native op in training mode; that needs no GPU to check, since the rule runs
    before any kernel: vmap over the GPU op on CPU tensors equals a loop of the
    native op, in value and in a grad of the batched grads (tests/test_cuda.py
    runs the real cuDNN path)."""
    aten = torch.ops.aten
    gen = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*shape, generator=gen, dtype=torch.float64, requires_grad=True)
               for shape in ((4, 3, 2, 2), (3,), (3,)))
    eps = 1e-5
    y, mean, invstd = aten.native_batch_norm(x, w, b, None, None, True, 0.1, eps)
    V = torch.randn(5, *y.shape, generator=gen, dtype=torch.float64)
    extra = (torch.empty(0),) if op_name.startswith("cudnn") else ()

    def gpu_backward(go):
        return getattr(aten, op_name)(x, go, w, None, None, mean, invstd, eps, *extra)

    with batch_rules.symbolic_batch_rules():
        got = torch.vmap(gpu_backward)(V)
    loop = [torch.stack(g) for g in zip(*(
        aten.native_batch_norm_backward(v, x, w, None, None, mean, invstd, True, eps, [True] * 3) for v in V))]
    assert_same_grads(got, loop)

    def second(gs):
        return torch.autograd.grad(sum((g * g.sin()).sum() for g in gs), (x, w, b),
                                   allow_unused=True, materialize_grads=True)

    assert_same_grads(second(got), second(loop))


# (query [N, H, L, E], key/value length S, mask, is_causal, scale)
_ATTENTIONS = {
    "plain": ((2, 3, 4, 8), 4, None, False, None),
    "causal_scaled": ((2, 3, 5, 8), 5, None, True, 0.3),
    "cross_bool_mask": ((2, 2, 4, 8), 6, "bool_ls", False, None),
    "float_mask_per_row": ((3, 2, 4, 8), 5, "float_n1ls", False, None),
    "one_row": ((1, 2, 4, 8), 4, "float_n1ls", False, None),
}


def _attention_case(name):
    (N, H, L, E), S, mask_kind, is_causal, scale = _ATTENTIONS[name]
    q = torch.randn(N, H, L, E, dtype=torch.float64, requires_grad=True)
    k = torch.randn(N, H, S, E, dtype=torch.float64, requires_grad=True)
    v = torch.randn(N, H, S, E, dtype=torch.float64, requires_grad=True)
    mask = {None: None, "bool_ls": torch.rand(L, S) > 0.3,
            "float_n1ls": torch.randn(N, 1, L, S, dtype=torch.float64)}[mask_kind]
    if mask is not None and mask.dtype == torch.bool:
        mask[:, 0] = True  # no row fully masked (NaN in eager and compiled alike)

    def layer(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale)

    return layer, [q, k, v]


@pytest.mark.parametrize("name", list(_ATTENTIONS))
def test_cpu_attention_backward_rule_matches_the_loop_with_one_graph_for_every_B(name):
    """The CPU flash-attention backward has no functorch rule (vmap looped per
    sample, one graph per B); dynbatch folds B into the attention batch."""
    from torch.utils._python_dispatch import TorchDispatchMode

    layer, primals = _attention_case(name)

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.add(func)
            return func(*args, **(kwargs or {}))

    seen: set = set()
    with Ops():
        layer(*primals)
    assert aten._scaled_dot_product_flash_attention_for_cpu.default in seen, "not the flash path: the rule is not exercised"

    def f(q, k, v, V):
        return torch.autograd.grad(layer(q, k, v), (q, k, v), V, is_grads_batched=True)

    _check_batch_sweep(compile_dynbatch(f, options=FALLBACK), primals, layer)
    assert dynbatch.counters().get("fallbacks", 0) == 0


def _cuda_attention_backwards(N=2, H=3, L=5, S=7, E=8):
    """Each CUDA attention backward as a function of grad_out, on meta tensors
    (their meta kernels run anywhere; the values are checked in test_cuda.py)."""
    r = functools.partial(torch.randn, device="meta")
    q, k, v, o, lse, bias = r(N, H, L, E), r(N, H, S, E), r(N, H, S, E), r(N, H, L, E), r(N, H, L), r(1, 1, L, S)
    e = torch.empty(0, device="meta")
    t = functools.partial(torch.transpose, dim0=1, dim1=2)  # [N, L, H, E], _efficient_attention's layout
    return {
        "flash": lambda g: aten._scaled_dot_product_flash_attention_backward(
            g, q, k, v, o, lse, None, None, L, S, 0.0, False, e, e, scale=0.3),
        "sdpa_efficient": lambda g: aten._scaled_dot_product_efficient_attention_backward(
            g, q, k, v, bias, o, lse, e, e, 0.0, [True, True, True, False]),
        "sdpa_efficient_bias_grad": lambda g: aten._scaled_dot_product_efficient_attention_backward(
            g, q, k, v, bias.expand(N, H, L, S), o, lse, e, e, 0.0, [True, True, True, True]),
        "efficient": lambda g: aten._efficient_attention_backward(
            t(g), t(q), t(k), t(v), None, t(o), None, None, L, S, lse, 0.0, e, e, 0, False),
        "cudnn": lambda g: aten._scaled_dot_product_cudnn_attention_backward(
            g, q, k, v, o, lse, e, e, bias, None, None, L, S, 0.0, False, scale=0.5),
    }, (N, H, L, E)


@pytest.mark.parametrize("name", ["flash", "sdpa_efficient", "sdpa_efficient_bias_grad", "efficient", "cudnn"])
@pytest.mark.parametrize("ours", [True, False])
def test_cuda_attention_backward_rules_fold_b_into_the_attention_batch(name, ours):
    """Under vmap the rule calls the op once on [B*N, ...] (vmap's fallback calls
    it B times), with each grad's per-sample shape."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from dynbatch.batching import batch_rules

    backwards, shape = _cuda_attention_backwards()
    backward = backwards[name]
    calls = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            calls.append(func)
            return func(*args, **(kwargs or {}))

    def defined(g):  # vmap returns tensors only: the placeholder grad_bias is left out
        return tuple(x for x in backward(g) if x is not None and x.dim() > 0)

    B = 4
    with batch_rules.symbolic_batch_rules() if ours else contextlib.nullcontext(), Count():
        grads = torch.vmap(defined)(torch.randn(B, *shape, device="meta"))
    expected = defined(torch.randn(*shape, device="meta"))
    assert [g.shape for g in grads] == [(B, *x.shape) for x in expected]
    assert sum("attention" in str(f) for f in calls) == (1 if ours else B)


def test_strides_of_wrapped_gather_indices_skip_sympys_full_simplify(monkeypatch):
    """``inductor.inductor_strides_without_full_simplify``: while dynbatch lowers a graph, the
    stride of an index holding Inductor's index functions (a gather's negative indices
    wrapped, inside ModularIndexing, as MACE's are) is the difference sympy builds, without
    ``sympy.simplify`` (0.3-16 s a call there), and equals what Inductor's own gives; a
    polynomial index keeps Inductor's."""
    import sympy
    from torch.utils._sympy.functions import ModularIndexing, Where

    from dynbatch import _compat
    from dynbatch.lowering import inductor

    module = _compat.inductor_stride_at_module()
    original = module.stride_at
    d0, d1 = sympy.symbols("d0 d1", integer=True, nonnegative=True)
    clamped = sympy.Min(39, sympy.Max(-40, d1 - 32))
    index = 24 * d0 + ModularIndexing(Where(clamped < 0, clamped + 40, clamped), 5, 8) + 16

    def refused(*args, **kwargs):
        raise AssertionError("sympy.simplify called")

    with inductor.inductor_strides_without_full_simplify():
        assert module.stride_at is not original
        with monkeypatch.context() as patched:
            patched.setattr(sympy, "simplify", refused)
            along_d0, along_d1 = module.stride_at(index, d0), module.stride_at(index, d1)
        assert module.stride_at(24 * d0 + d1, d1) == 1
    assert module.stride_at is original
    assert along_d0 == 24 and along_d1 == original(index, d1) and along_d1.has(d1)


def test_vector_index_ranges_of_wrapped_gather_indices_skip_sympys_full_simplify(monkeypatch):
    """``inductor.inductor_vec_range_without_full_simplify``: while dynbatch lowers a graph,
    ``simplify_index_in_vec_range`` still replaces the loop variable's lane-uniform terms by
    symbols but calls no ``sympy.simplify`` (seconds on MACE's indices), and its index has
    the values of Inductor's own."""
    import random

    import sympy
    from torch.utils._sympy.functions import FloorDiv, ModularIndexing, Where

    from dynbatch import _compat
    from dynbatch.lowering import inductor

    module = _compat.inductor_stride_at_module()
    original = module.simplify_index_in_vec_range
    d0, d1 = sympy.symbols("d0 d1", integer=True, nonnegative=True)
    clamped = sympy.Min(39, sympy.Max(-40, d1 - 32))
    wrapped = 24 * FloorDiv(d0, 16) + ModularIndexing(Where(clamped < 0, clamped + 40, clamped), 5, 8) + 3 * d0
    polynomial = 2 * FloorDiv(d0, 16) + 4 * d0 + d1 + 3

    def refused(*args, **kwargs):
        raise AssertionError("sympy.simplify called")

    with inductor.inductor_vec_range_without_full_simplify():
        ours = module.simplify_index_in_vec_range
        assert ours is not original
        with monkeypatch.context() as patched:
            patched.setattr(sympy, "simplify", refused)
            results = [ours(index, d0, 16) for index in (wrapped, polynomial)]
    assert module.simplify_index_in_vec_range is original
    rng = random.Random(0)
    for index, result in zip((wrapped, polynomial), results):
        expected = original(index, d0, 16)
        assert not result.has(FloorDiv(d0, 16))  # the lane-uniform term became a symbol
        symbols = sorted(result.free_symbols | expected.free_symbols, key=str)
        for _ in range(20):
            point = {s: rng.randrange(0, 100) for s in symbols}
            assert result.subs(point) == expected.subs(point)
