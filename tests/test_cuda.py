"""CUDA: the batched backward through Inductor's Triton backend, with TF32 off."""

from __future__ import annotations

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import dynbatch
from conftest import assert_backend_ran, assert_same_grads, loop_grads

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(autouse=True)
def no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def make_mlp(width=64):
    g = torch.Generator().manual_seed(0)
    Ws = [(torch.randn(width, width, generator=g) / width ** 0.5).cuda() for _ in range(3)]

    def vjp(x, V):
        y = x
        for W in Ws:
            y = torch.tanh(y @ W)
        return torch.autograd.grad(y, x, V, is_grads_batched=True)

    return vjp


def test_triton_kernels_and_eager_parity():
    vjp = make_mlp()
    compiled = torch.compile(vjp, backend="dynbatch", fullgraph=True)
    x, V = torch.randn(8, 64, device="cuda", requires_grad=True), torch.randn(16, 8, 64, device="cuda")
    result, code = run_and_get_code(compiled, x, V)
    assert_same_grads(result, vjp(x, V), atol=1e-5, rtol=1e-4)
    assert "triton" in "\n".join(code)
    assert_backend_ran(graphs=1, batched=1)


def test_batch_sweep_on_cuda_compiles_at_most_two_graphs():
    vjp = make_mlp()
    compiled = torch.compile(vjp, backend="dynbatch", fullgraph=True)
    x = torch.randn(8, 64, device="cuda", requires_grad=True)
    for B in (2, 3, 5, 8, 13, 32, 64, 100, 128):
        V = torch.randn(B, 8, 64, device="cuda")
        assert_same_grads(compiled(x, V), vjp(x, V), atol=1e-5, rtol=1e-4)
    c = dynbatch.counters()
    assert c["graphs"] == c["graphs_batched"] <= 2, c


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hessian_rows_and_loop_oracle_on_cuda(dtype):
    W = (torch.randn(32, 32) / 6).to("cuda", dtype)

    def hess_rows(x, V):
        (g,) = torch.autograd.grad(torch.tanh(x @ W).pow(2).sum(), x, create_graph=True)
        return torch.autograd.grad(g, x, V, is_grads_batched=True)

    x = torch.randn(2, 32, device="cuda", dtype=dtype, requires_grad=True)
    V = torch.eye(64, device="cuda", dtype=dtype).reshape(64, 2, 32)
    got = torch.compile(hess_rows, backend="dynbatch", fullgraph=True)(x, V)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    assert_same_grads(got, hess_rows(x, V), **tol)
    xl = x.detach().requires_grad_()
    (g,) = torch.autograd.grad(torch.tanh(xl @ W).pow(2).sum(), xl, create_graph=True)
    assert_same_grads(got, loop_grads(g, xl, V), **tol)


def test_error_is_eagers_on_cuda():
    vjp = make_mlp()
    x, V = torch.randn(8, 64, device="cuda", requires_grad=True), torch.randn(4, 8, 63, device="cuda")
    with pytest.raises(RuntimeError) as eager:
        vjp(x, V)
    with pytest.raises(RuntimeError) as ours:
        torch.compile(vjp, backend="dynbatch")(x, V)
    assert str(ours.value) == str(eager.value)


def _conv_norm_net():
    g = torch.Generator().manual_seed(0)
    w1 = (torch.randn(8, 3, 3, 3, generator=g) / 5).cuda().requires_grad_()
    w2 = (torch.randn(8, 8, 3, 3, generator=g) / 8).cuda().requires_grad_()
    gamma = torch.rand(8, generator=g).add(0.5).cuda().requires_grad_()
    ln_w = torch.rand(8, generator=g).add(0.5).cuda().requires_grad_()
    params = [w1, w2, gamma, ln_w]

    def net(x):
        h = torch.nn.functional.conv2d(x, w1, padding=1)
        h = torch.nn.functional.batch_norm(h, None, None, gamma, None, training=True).tanh()
        h = torch.nn.functional.conv_transpose2d(h, w2.transpose(0, 1), groups=1)
        return torch.nn.functional.layer_norm(h.mean((2, 3)), (8,), ln_w)

    return net, params


def test_conv_and_norm_rules_on_cuda_keep_b_symbolic():
    """dynbatch's convolution and norm rules (batch_rules.py) on cuDNN: values
    equal the loop, one graph for every B >= 2 (on CPU, float32 convolutions add
    PyTorch's B*N >= 16 oneDNN guard; CUDA has none).  Not yet run on a GPU:
    written in a session without one."""
    net, params = _conv_norm_net()
    x = torch.randn(2, 3, 8, 8, device="cuda")

    def f(*args):
        *ps, V = args
        return torch.autograd.grad(net(x), ps, V, is_grads_batched=True)

    compiled = torch.compile(f, backend="dynbatch", fullgraph=True)
    for B in (2, 3, 5, 9):
        V = torch.randn(B, 2, 8, device="cuda")
        assert_same_grads(compiled(*params, V), loop_grads(net(x), params, [V]), atol=1e-4, rtol=1e-4)
    c = dynbatch.counters()
    assert c["graphs"] <= 2 and not c.get("fallbacks"), c
