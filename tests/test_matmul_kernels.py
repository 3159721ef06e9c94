"""The CPU matmul kernel choice (matmul_kernels.py, passes.route_matmuls), against eager's products and grads."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

import dynbatch
from dynbatch import matmul_kernels
from dynbatch.passes import route_matmuls
from conftest import DEFAULTS, INDUCTOR, assert_same_grads, compile_dynbatch, loop_grads

aten = torch.ops.aten
needs_onednn = pytest.mark.skipif(not matmul_kernels.onednn_available(), reason="torch built without oneDNN")


@pytest.fixture(autouse=True)
def fresh_choices():
    matmul_kernels.forget()
    yield
    matmul_kernels.forget()


@pytest.fixture
def kernel_calls(monkeypatch):
    """How often each kernel computed a product."""
    calls = {name: 0 for name in matmul_kernels.KERNELS}
    for name, kernel in list(matmul_kernels.KERNELS.items()):
        def counted(a, w, name=name, kernel=kernel):
            calls[name] += 1
            return kernel(a, w)
        monkeypatch.setitem(matmul_kernels.KERNELS, name, counted)
    return calls


@needs_onednn
@pytest.mark.parametrize("kernel", matmul_kernels.CHOICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("m", [8, matmul_kernels.MIN_ROWS + 100])
def test_linear_nt_equals_mm(kernel, dtype, m):
    a, w = torch.randn(m, 24, dtype=dtype), torch.randn(40, 24, dtype=dtype)
    torch.testing.assert_close(matmul_kernels.op()(a, w, kernel), a @ w.t())


@needs_onednn
def test_auto_measures_once_per_bucket_and_only_tall_float32_products(kernel_calls):
    w = torch.randn(16, 32)
    matmul_kernels.linear_nt(torch.randn(8, 32), w)  # short: ATen, unmeasured
    matmul_kernels.linear_nt(torch.randn(40, 32, dtype=torch.float64), w.double())  # oneDNN: float32 only
    assert matmul_kernels.chosen() == {}
    assert kernel_calls == {"aten": 2, "onednn": 0}
    tall = matmul_kernels.MIN_ROWS + 10
    matmul_kernels.linear_nt(torch.randn(tall, 32), w)
    (key, name), = matmul_kernels.chosen().items()
    assert key == matmul_kernels.shape_key(tall, 32, 16, torch.float32) and name in matmul_kernels.KERNELS
    measured = dict(kernel_calls)
    assert measured["aten"] > 2 and measured["onednn"] > 0  # both were timed
    matmul_kernels.linear_nt(torch.randn(tall + 5, 32), w)  # same bucket: the remembered kernel, once
    assert len(matmul_kernels.chosen()) == 1
    assert sum(kernel_calls.values()) == sum(measured.values()) + 1 and kernel_calls[name] == measured[name] + 1


@needs_onednn
@pytest.mark.parametrize("onednn_cost, expected", [(0.97, "onednn"), (1.03, "aten")])
def test_auto_takes_the_kernel_measured_faster(monkeypatch, onednn_cost, expected):
    """The measured times decide (a fake clock that each kernel advances by its cost)."""
    clock = {"now": 0.0}
    cost = {"aten": 1.0, "onednn": onednn_cost}  # seconds of the fake clock per product
    monkeypatch.setattr(matmul_kernels, "time", types.SimpleNamespace(perf_counter=lambda: clock["now"]))
    for name, kernel in list(matmul_kernels.KERNELS.items()):
        def timed(a, w, name=name, kernel=kernel):
            clock["now"] += cost[name]
            return kernel(a, w)
        monkeypatch.setitem(matmul_kernels.KERNELS, name, timed)
    a, w = torch.randn(matmul_kernels.MIN_ROWS, 8), torch.randn(4, 8)
    name, out = matmul_kernels.measure(a, w)
    assert name == expected
    torch.testing.assert_close(out, a @ w.t())


def _traced(fn, *args, mode="symbolic"):
    return make_fx(fn, tracing_mode=mode)(*args)


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


@needs_onednn
def test_route_matmuls_rewrites_transposed_float32_products_only():
    def f(a, w, v):
        return torch.mm(a, w.t()).tanh() + torch.mm(a, v)  # the second: not a transposed weight

    a, w, v = torch.randn(20, 6), torch.randn(5, 6), torch.randn(6, 5)
    gm = _traced(f, a, w, v)
    expected = f(a, w, v)
    assert route_matmuls(gm.graph, "onednn") == 1
    gm.recompile()
    assert _targets(gm).count(aten.mm.default) == 1 and matmul_kernels.op() in _targets(gm)
    a2 = torch.randn(33, 6)  # M is symbolic: another height runs the same graph
    torch.testing.assert_close(gm(a2, w, v), f(a2, w, v))
    torch.testing.assert_close(gm(a, w, v), expected)

    double = _traced(f, a.double(), w.double(), v.double())
    assert route_matmuls(double.graph, "onednn") == 0
    assert route_matmuls(_traced(f, a, w, v).graph, "aten") == 0


@needs_onednn
def test_route_matmuls_measures_static_products_at_compile_time():
    def f(a, w):
        return torch.mm(a, w.t())

    short = _traced(f, torch.randn(8, 6), torch.randn(5, 6), mode="fake")
    assert route_matmuls(short.graph, "auto") == 0 and matmul_kernels.chosen() == {}  # below MIN_ROWS
    m = matmul_kernels.MIN_ROWS + 24
    tall = _traced(f, torch.randn(m, 6), torch.randn(5, 6), mode="fake")
    routed = route_matmuls(tall.graph, "auto")
    (name,) = matmul_kernels.chosen().values()  # measured on real operands of that shape
    assert routed == (name == "onednn")


def _traced_with_dynamic_dims(fn, *tensors_and_dims):
    """``fn`` traced on fake tensors whose dims flagged True are symbolic, the others static
    (make_fx's "symbolic" mode makes every size symbolic)."""
    mode = FakeTensorMode(shape_env=ShapeEnv())
    fakes = [mode.from_tensor(t, symbolic_context=StatelessSymbolicContext(
        dynamic_sizes=[DimDynamic.DYNAMIC if d else DimDynamic.STATIC for d in dims]))
        for t, dims in tensors_and_dims]
    with mode:
        return make_fx(fn, tracing_mode="real")(*fakes)


@needs_onednn
def test_route_matmuls_leaves_a_known_short_height_to_aten():
    """B in N only (an HVP's [n, d] @ [d, K]): "auto" would pick ATen at every call, so the
    product is not routed; a symbolic or tall known height is."""
    def f(a, w):
        return torch.mm(a, w.t())

    def traced(m, m_symbolic):
        return _traced_with_dynamic_dims(f, (torch.randn(m, 6), (m_symbolic, False)),
                                         (torch.randn(5, 6), (True, False))).graph

    assert route_matmuls(traced(8, False), "auto") == 0
    assert route_matmuls(traced(8, False), "onednn") == 1
    assert route_matmuls(traced(8, True), "auto") == 1
    assert route_matmuls(traced(matmul_kernels.MIN_ROWS, False), "auto") == 1


def _mlp(width, depth, dtype):
    weights = [torch.randn(width, width, dtype=dtype) / width ** 0.5 for _ in range(depth)]

    def f(x):
        for i, w in enumerate(weights):
            # F.linear's forward is mm(x, w.t()) (routed), its backward g @ w (not);
            # x @ w's backward is g @ w.t() (routed in the batched backward).
            x = torch.tanh(F.linear(x, w) if i % 2 else x @ w)
        return x

    return f


@needs_onednn
@pytest.mark.parametrize("kernel", ["onednn", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_compiled_batched_grads_match_the_loop(kernel, dtype, kernel_calls):
    """Inductor, B symbolic: one graph for every B >= 2, grads equal the eager loop's."""
    f = _mlp(16, 3, dtype)

    def vjps(x, V):
        y = f(x)
        return torch.autograd.grad(y, x, V, is_grads_batched=True)

    compiled = compile_dynbatch(vjps, options={**INDUCTOR, "dynbatch.cpu_matmul": kernel})
    x = torch.randn(8, 16, dtype=dtype, requires_grad=True)
    tall = -(-matmul_kernels.MIN_ROWS // 8) + 3  # B*8 rows >= MIN_ROWS: "auto" measures
    for B in (1, 2, 3, tall):
        V = torch.randn(B, 8, 16, dtype=dtype)
        assert_same_grads(compiled(x, V), loop_grads(f(x), x, V), msg=f"B={B}")
    assert dynbatch.counters()["graphs"] == 2, dynbatch.counters()  # B=1, then one graph for B >= 2
    if dtype == torch.float32:
        assert kernel_calls["onednn"] > 0
    else:
        assert kernel_calls["onednn"] == 0 and matmul_kernels.chosen() == {}


@needs_onednn
def test_model_compiled_alone_differentiated_outside(kernel_calls):
    """The region's forward and its batched backward from outside both take the routed kernel."""
    f = _mlp(16, 2, torch.float32)
    compiled = compile_dynbatch(f, options={**INDUCTOR, "dynbatch.cpu_matmul": "onednn"})
    x = torch.randn(8, 16, requires_grad=True)
    y = compiled(x)
    forward_calls = kernel_calls["onednn"]
    assert forward_calls > 0
    torch.testing.assert_close(y, f(x))
    for B in (3, 5):
        V = torch.randn(B, 8, 16)
        got = torch.autograd.grad(y, x, V, is_grads_batched=True, retain_graph=True)
        assert_same_grads(got, loop_grads(f(x), x, V), msg=f"B={B}")
    assert kernel_calls["onednn"] > forward_calls
    assert dynbatch.counters().get("fallbacks", 0) == 0


@needs_onednn
def test_generated_code_calls_the_kernel_directly_not_through_the_dispatcher():
    from torch._inductor.utils import run_and_get_code

    f = _mlp(16, 2, torch.float32)

    def vjps(x, V):
        return torch.autograd.grad(f(x), x, V, is_grads_batched=True)

    compiled = compile_dynbatch(vjps, options={**DEFAULTS, "dynbatch.cpu_matmul": "onednn"})
    x, V = torch.randn(8, 16, requires_grad=True), torch.randn(3, 8, 16)
    out, code = run_and_get_code(compiled, x, V)
    assert_same_grads(out, loop_grads(f(x), x, V))
    text = "\n".join(code)
    assert f"extern_kernels.{matmul_kernels.EXTERN_NAME}(" in text, text
    assert "torch.ops.dynbatch.linear_nt.default(" not in text, text  # (assert_size_stride names the op)


@needs_onednn
def test_cpp_wrapper_keeps_products_on_aten_instead_of_falling_back():
    """Inductor's C++ wrapper cannot call the routed Python kernel: with it on, the default
    "auto" leaves every product to ATen, and the graph still compiles (no eager fallback)."""
    from torch._inductor.utils import run_and_get_code

    f = _mlp(16, 2, torch.float32)

    def vjps(x, V):
        return torch.autograd.grad(f(x), x, V, is_grads_batched=True)

    compiled = compile_dynbatch(vjps, dynamic=True,  # M = B*8 symbolic: routable
                                options={**INDUCTOR, "cpp_wrapper": True})
    x, V = torch.randn(8, 16, requires_grad=True), torch.randn(3, 8, 16)
    out, code = run_and_get_code(compiled, x, V)
    assert_same_grads(out, loop_grads(f(x), x, V))
    assert dynbatch.counters()["graphs_batched"] == 1 and dynbatch.counters().get("fallbacks", 0) == 0
    assert matmul_kernels.EXTERN_NAME not in "\n".join(code)
