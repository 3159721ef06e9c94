"""The CPU matmul kernel choice (cpu/matmul_kernels.py, aten_passes.route_matmuls), against eager's products and grads."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

import dynbatch
from dynbatch.cpu import matmul_kernels, native_gemm
from dynbatch.lowering.aten_passes import route_matmuls
from conftest import DEFAULTS, INDUCTOR, assert_same_grads, compile_dynbatch, loop_grads

aten = torch.ops.aten
needs_onednn = pytest.mark.skipif(not matmul_kernels.onednn_available(), reason="torch built without oneDNN")
needs_openblas = pytest.mark.skipif(not matmul_kernels.available("openblas"),
                                    reason="no numpy with OpenBLAS, or no threadpoolctl")


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
        def counted(a, b, out=None, name=name, kernel=kernel):
            calls[name] += 1
            return kernel(a, b, out)
        monkeypatch.setitem(matmul_kernels.KERNELS, name, counted)
    return calls


@pytest.mark.parametrize("kernel", matmul_kernels.CHOICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("layouts", ["rr", "rc", "cr", "cc"])
@pytest.mark.parametrize("m, k", [(8, 24), (matmul_kernels.MIN_ROWS + 100, 24), (24, matmul_kernels.MIN_ROWS + 100)])
def test_every_kernel_equals_mm_in_every_layout(kernel, dtype, layouts, m, k):
    a, b = matmul_kernels.operands(m, k, 40, dtype, layouts)
    out = matmul_kernels.op()(a, b, kernel)
    # against the float64 product: the kernels sum in different orders, float32 rounding grows with K
    exact = (a.double() @ b.double()).to(dtype)
    torch.testing.assert_close(out, exact, **({"rtol": 1e-5, "atol": 1e-6 * k} if dtype == torch.float32 else {}))
    assert out.is_contiguous()  # the layout Inductor's lowering declares


@pytest.mark.parametrize("kernel", matmul_kernels.CHOICES)
@pytest.mark.parametrize("layouts", ["rr", "rc", "cr"])
@pytest.mark.parametrize("m, k", [(8, 24), (matmul_kernels.MIN_ROWS + 100, 24)])
def test_every_kernel_writes_the_product_into_inductors_buffer(kernel, layouts, m, k):
    """NOTE [Products into Inductor's buffers]: the generated code's call, ``mm_out(a, b,
    kernel, out=buf)``, leaves the product in ``buf`` (a reused buffer: any old values go),
    at the first call of a shape (measured) and the later ones."""
    a, b = matmul_kernels.operands(m, k, 40, torch.float32, layouts)
    exact = (a.double() @ b.double()).float()
    for _ in range(2):
        buf = torch.full((m, 40), float("nan"))
        result = matmul_kernels.mm_out(a, b, kernel, out=buf)
        assert result is buf
        torch.testing.assert_close(buf, exact, rtol=1e-5, atol=1e-6 * k)


def _hugepage_advised(t: torch.Tensor) -> bool:
    """Whether /proc/self/smaps flags MADV_HUGEPAGE ("hg") on the mapping holding t's first whole 2 MiB page."""
    page = native_gemm.HUGE_PAGE
    address, inside = (t.data_ptr() + page - 1) & ~(page - 1), False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if head.endswith(":"):
            if inside and head == "VmFlags:":
                return "hg" in line.split()[1:]
        else:  # a mapping's first line: "start-end perms ..."
            low, high = (int(x, 16) for x in head.split("-"))
            inside = low <= address < high
    return False


@pytest.mark.skipif(not Path("/proc/self/smaps").exists() or native_gemm._madvise() is None,
                    reason="Linux only: madvise and /proc/self/smaps")
@pytest.mark.parametrize("kernel", ["aten", "openblas", "avx2", "avx512"])
def test_an_output_of_megabytes_is_advised_huge_pages_and_keeps_its_values(kernel):
    """NOTE [huge pages for large outputs]: each kernel that writes into an output it is
    given gets one whose aligned interior is advised, and every value is still the product."""
    if not matmul_kernels.available(kernel):
        pytest.skip(reason=f"no {kernel} kernel in this process")
    gen = torch.Generator().manual_seed(7)
    a, b = torch.randn(1203, 9, generator=gen), torch.randn(9, 2600, generator=gen)  # 12.5 MB out
    for _ in range(2):  # a second, fresh output too
        out = matmul_kernels.KERNELS[kernel](a, b)
        torch.testing.assert_close(out, (a.double() @ b.double()).float(), rtol=1e-5, atol=1e-5)
        assert out.is_contiguous() and _hugepage_advised(out)
        buf = torch.empty(1203, 2600)  # Inductor's buffer, not yet written
        matmul_kernels.mm_out(a, b, kernel, out=buf)
        torch.testing.assert_close(buf, out, rtol=0, atol=0)
        assert _hugepage_advised(buf)
    assert 1023 * 1024 * 4 < native_gemm.HUGE_OUTPUT <= 1024 * 1024 * 4  # under 4 MiB: plain torch.mm


@needs_onednn
def test_onednn_applies_to_float32_with_a_row_major_left_operand_only():
    a, b = matmul_kernels.operands(64, 32, 16, torch.float32)
    assert matmul_kernels.applies("onednn", a, b)  # b copied to [N, K] (a small matrix)
    assert matmul_kernels.applies("onednn", a, b.t().contiguous().t())
    assert not matmul_kernels.applies("onednn", a.t().contiguous().t(), b)
    assert not matmul_kernels.applies("onednn", a.double(), b.double())
    big = torch.randn(32, matmul_kernels.COPY_LIMIT // 16)  # b too large to copy
    assert not matmul_kernels.applies("onednn", torch.randn(8, 32), big)


@needs_openblas
def test_openblas_runs_at_torchs_thread_count_and_gives_numpy_its_own_back(monkeypatch):
    import numpy as np

    blas = matmul_kernels.numpy_blas().blas
    before = blas.get_num_threads()
    seen = []
    real_matmul = np.matmul

    def matmul(*args, **kwargs):
        seen.append(blas.get_num_threads())
        return real_matmul(*args, **kwargs)

    threads = torch.get_num_threads()
    blas.set_num_threads(2)
    torch.set_num_threads(1)
    monkeypatch.setattr(matmul_kernels.numpy_blas(), "np", types.SimpleNamespace(matmul=matmul))
    try:
        a, b = matmul_kernels.operands(64, 32, 16, torch.float32, "rc")
        torch.testing.assert_close(matmul_kernels.openblas(a, b), a @ b)
        assert seen == [1] and blas.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
        blas.set_num_threads(before)


@needs_openblas
def test_openblas_takes_float_matrices_numpy_can_view():
    a, b = matmul_kernels.operands(64, 32, 16, torch.float32)
    assert matmul_kernels.applies("openblas", a, b) and matmul_kernels.applies("openblas", a.double(), b.double())
    assert not matmul_kernels.applies("openblas", a.half(), b.half())
    assert not matmul_kernels.applies("openblas", a, b.double())
    assert not matmul_kernels.applies("openblas", a, torch._neg_view(b))


def test_auto_measures_once_per_bucket_and_only_tall_products(kernel_calls):
    w = torch.randn(16, 32)
    matmul_kernels.mm(torch.randn(8, 32), w.t())  # short: ATen, unmeasured
    assert matmul_kernels.chosen() == {} and kernel_calls["aten"] == 1 and sum(kernel_calls.values()) == 1
    tall = matmul_kernels.MIN_ROWS + 10
    a = torch.randn(tall, 32)
    matmul_kernels.mm(a, w.t())
    (key, name), = matmul_kernels.chosen().items()
    assert key == matmul_kernels.shape_key(a, w.t()) and name in matmul_kernels.KERNELS
    measured = dict(kernel_calls)
    assert measured["aten"] > 2 and measured["flipped"] > 0  # both were timed
    assert (measured["onednn"] > 0) == matmul_kernels.onednn_available()
    assert (measured["openblas"] > 0) == matmul_kernels.available("openblas")
    assert (measured["avx2"] > 0) == matmul_kernels.available("avx2")
    assert (measured["avx512"] > 0) == matmul_kernels.available("avx512")
    matmul_kernels.mm(torch.randn(tall + 5, 32), w.t())  # same bucket: the remembered kernel, once
    assert len(matmul_kernels.chosen()) == 1
    assert sum(kernel_calls.values()) == sum(measured.values()) + 1 and kernel_calls[name] == measured[name] + 1
    # a long reduction (a weight grad) is measured too, in its own bucket; float64 without oneDNN
    before = kernel_calls["onednn"]
    g, x = torch.randn(tall, 16, dtype=torch.float64), torch.randn(tall, 8, dtype=torch.float64)
    torch.testing.assert_close(matmul_kernels.mm(g.t(), x), g.t() @ x)
    assert len(matmul_kernels.chosen()) == 2 and kernel_calls["onednn"] == before


@pytest.mark.parametrize("costs, expected", [
    ({"aten": 1.0, "flipped": 1.2, "onednn": 0.9, "openblas": 1.1, "avx2": 1.05, "avx512": 1.1}, "onednn"),
    ({"aten": 1.0, "flipped": 1.2, "onednn": 1.03, "openblas": 1.1, "avx2": 1.05, "avx512": 1.1}, "aten"),
    ({"aten": 1.0, "flipped": 1.2, "onednn": 0.97, "openblas": 1.1, "avx2": 0.98, "avx512": 0.96},
     "aten"),  # a near tie
    ({"aten": 1.0, "flipped": 0.3, "onednn": 1.03, "openblas": 1.1, "avx2": 1.05, "avx512": 1.1}, "flipped"),
    ({"aten": 1.0, "flipped": 1.2, "onednn": 1.03, "openblas": 0.8, "avx2": 1.05, "avx512": 1.1}, "openblas"),
    ({"aten": 1.0, "flipped": 1.2, "onednn": 1.03, "openblas": 0.8, "avx2": 0.7, "avx512": 1.1}, "avx2"),
    ({"aten": 1.0, "flipped": 1.2, "onednn": 1.03, "openblas": 0.8, "avx2": 0.7, "avx512": 0.5}, "avx512"),
])
def test_auto_takes_the_kernel_measured_fastest(monkeypatch, costs, expected):
    """The measured times decide (a fake clock that each kernel advances by its cost); a
    kernel within ``MARGIN`` of ATen's time leaves the product to ATen."""
    if not matmul_kernels.available(expected):
        pytest.skip(reason=f"no {expected} kernel in this process")
    clock = {"now": 0.0}
    monkeypatch.setattr(matmul_kernels, "time", types.SimpleNamespace(perf_counter=lambda: clock["now"]))
    for name, kernel in list(matmul_kernels.KERNELS.items()):
        def timed(a, b, name=name, kernel=kernel):
            clock["now"] += costs[name]
            return kernel(a, b)
        monkeypatch.setitem(matmul_kernels.KERNELS, name, timed)
    a, w = torch.randn(matmul_kernels.MIN_ROWS, 8), torch.randn(4, 8)
    name, out = matmul_kernels.measure(a, w.t())
    assert name == expected
    torch.testing.assert_close(out, a @ w.t())


@pytest.mark.parametrize("later_cost, expected", [(0.5, "flipped"), (0.97, "aten")])
def test_a_win_over_aten_is_confirmed_head_to_head(monkeypatch, later_cost, expected):
    """A kernel that beat ATen in the round of every kernel keeps the product only if it
    beats ATen again, the two alone: here `flipped` costs 0.5 in that round (its untimed
    call included), then ``later_cost``."""
    clock = {"now": 0.0}
    monkeypatch.setattr(matmul_kernels, "time", types.SimpleNamespace(perf_counter=lambda: clock["now"]))
    calls = {"flipped": 0}
    for name, kernel in list(matmul_kernels.KERNELS.items()):
        def timed(a, b, name=name, kernel=kernel):
            if name == "flipped":
                calls["flipped"] += 1
                clock["now"] += 0.5 if calls["flipped"] <= 1 + matmul_kernels.TRIALS else later_cost
            else:
                clock["now"] += 1.0
            return kernel(a, b)
        monkeypatch.setitem(matmul_kernels.KERNELS, name, timed)
    a, w = torch.randn(matmul_kernels.MIN_ROWS, 8), torch.randn(4, 8)
    name, out = matmul_kernels.measure(a, w.t())
    assert name == expected and calls["flipped"] == 1 + 2 * matmul_kernels.TRIALS
    torch.testing.assert_close(out, a @ w.t())


def _traced(fn, *args, mode="symbolic"):
    return make_fx(fn, tracing_mode=mode)(*args)


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_route_matmuls_rewrites_every_product_and_addmm():
    def f(a, w, v, bias):
        return torch.mm(a, w.t()).tanh() + torch.mm(a, v) + torch.addmm(bias, a, v)

    a, w, v, bias = torch.randn(20, 6), torch.randn(5, 6), torch.randn(6, 5), torch.randn(5)
    gm = _traced(f, a, w, v, bias)
    expected = f(a, w, v, bias)
    assert route_matmuls(gm.graph, "flipped") == 3
    gm.recompile()
    targets = _targets(gm)
    assert aten.mm.default not in targets and aten.addmm.default not in targets
    assert targets.count(matmul_kernels.op()) == 3
    a2 = torch.randn(33, 6)  # M is symbolic: another height runs the same graph
    torch.testing.assert_close(gm(a2, w, v, bias), f(a2, w, v, bias))
    torch.testing.assert_close(gm(a, w, v, bias), expected)

    def scaled(a, v, bias):
        return torch.addmm(bias, a, v, beta=2.0)  # not a plain product + bias: left alone

    assert route_matmuls(_traced(scaled, a, v, bias).graph, "flipped") == 0
    args64 = [t.double() for t in (a, w, v, bias)]
    if matmul_kernels.onednn_available():
        assert route_matmuls(_traced(f, *args64).graph, "onednn") == 0  # oneDNN: float32 only
    assert route_matmuls(_traced(f, *args64).graph, "flipped") == 3
    assert route_matmuls(_traced(f, a, w, v, bias).graph, "aten") == 0


def test_route_matmuls_measures_static_products_at_compile_time():
    def f(a, w):
        return torch.mm(a, w.t())

    short = _traced(f, torch.randn(8, 6), torch.randn(5, 6), mode="fake")
    assert route_matmuls(short.graph, "auto") == 0 and matmul_kernels.chosen() == {}  # M and K short
    m = matmul_kernels.MIN_ROWS + 24
    tall = _traced(f, torch.randn(m, 6), torch.randn(5, 6), mode="fake")
    routed = route_matmuls(tall.graph, "auto")
    (name,) = matmul_kernels.chosen().values()  # measured on real operands of that shape and layout
    assert routed == (name != "aten")
    (key,) = matmul_kernels.chosen()
    assert key[3:5] == ("r", "c")  # a row-major, w.t() a transposed view


def test_route_matmuls_routes_a_weight_grad_when_flipping_it_is_faster(monkeypatch):
    """g.t() @ x, the reduction over a long dim of a weight grad, measured in its layouts."""
    def f(g, x):
        return torch.mm(g.t(), x)

    clock = {"now": 0.0}
    monkeypatch.setattr(matmul_kernels, "time", types.SimpleNamespace(perf_counter=lambda: clock["now"]))
    for name, kernel in list(matmul_kernels.KERNELS.items()):
        def timed(a, b, name=name, kernel=kernel):
            clock["now"] += 0.2 if name == "flipped" else 1.0
            return kernel(a, b)
        monkeypatch.setitem(matmul_kernels.KERNELS, name, timed)
    k = matmul_kernels.MIN_ROWS + 24
    gm = _traced(f, torch.randn(k, 16), torch.randn(k, 8), mode="fake")
    assert route_matmuls(gm.graph, "auto") == 1
    assert matmul_kernels.chosen() == {(5, k.bit_length(), 4, "c", "r", torch.float32, torch.get_num_threads()):
                                       "flipped"}


def _traced_with_dynamic_dims(fn, *tensors_and_dims):
    """``fn`` traced on fake tensors whose dims flagged True are symbolic, the others static
    (make_fx's "symbolic" mode makes every size symbolic)."""
    mode = FakeTensorMode(shape_env=ShapeEnv())
    fakes = [mode.from_tensor(t, symbolic_context=StatelessSymbolicContext(
        dynamic_sizes=[DimDynamic.DYNAMIC if d else DimDynamic.STATIC for d in dims]))
        for t, dims in tensors_and_dims]
    with mode:
        return make_fx(fn, tracing_mode="real")(*fakes)


def test_route_matmuls_leaves_a_known_short_product_to_aten():
    """B in N only (an HVP's [n, d] @ [d, K]): "auto" would pick ATen at every call, so the
    product is not routed; a symbolic or tall known height is, and so is a symbolic K."""
    def f(a, w):
        return torch.mm(a, w.t())

    def traced(m, m_symbolic, k_symbolic=False):
        return _traced_with_dynamic_dims(f, (torch.randn(m, 6), (m_symbolic, k_symbolic)),
                                         (torch.randn(5, 6), (True, k_symbolic))).graph

    assert route_matmuls(traced(8, False), "auto") == 0
    assert route_matmuls(traced(8, False), "flipped") == 1
    assert route_matmuls(traced(8, True), "auto") == 1
    assert route_matmuls(traced(8, False, k_symbolic=True), "auto") == 1
    assert route_matmuls(traced(matmul_kernels.MIN_ROWS, False), "auto") == 1


def _mlp(width, depth, dtype):
    weights = [torch.randn(width, width, dtype=dtype) / width ** 0.5 for _ in range(depth)]

    def f(x):
        for i, w in enumerate(weights):
            # F.linear's forward is mm(x, w.t()), its backward g @ w; x @ w's backward
            # is g @ w.t(): every layout is routed.
            x = torch.tanh(F.linear(x, w) if i % 2 else x @ w)
        return x

    return f


@needs_onednn
@pytest.mark.parametrize("kernel", ["flipped", "onednn", "openblas", "avx2", "avx512", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_compiled_batched_grads_match_the_loop(kernel, dtype, kernel_calls):
    """Inductor, B symbolic: one graph for every B >= 2, grads equal the eager loop's."""
    if not matmul_kernels.available(kernel):
        pytest.skip(reason=f"no {kernel} kernel in this process")
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
    if kernel in ("flipped", "openblas"):
        assert kernel_calls[kernel] > 0
    elif kernel in ("avx2", "avx512"):  # float32 only: float64 products stay with ATen
        assert (kernel_calls[kernel] > 0) == (dtype == torch.float32)
    elif dtype == torch.float32:  # oneDNN forced, or timed by "auto"
        assert kernel_calls["onednn"] > 0
    else:
        assert kernel_calls["onednn"] == 0


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
    # into a buffer of Inductor's wrapper, as its own extern_kernels.mm(..., out=buf)
    calls = [line for line in text.splitlines() if f"extern_kernels.{matmul_kernels.EXTERN_NAME}(" in line]
    assert calls and all("out=buf" in line for line in calls), calls
    assert "torch.ops.dynbatch.mm.default(" not in text, text  # (assert_size_stride names the op)


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
