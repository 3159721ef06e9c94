"""Inductor really generates the kernels: C++ on CPU here, Triton on CUDA (test_cuda.py)."""

from __future__ import annotations

import torch
from torch._inductor.utils import run_and_get_code

import dynbatch
from conftest import DEFAULTS, assert_backend_ran, assert_same_grads, compile_dynbatch

W = torch.randn(16, 16) / 4


def vjp(x, V):
    return torch.autograd.grad(torch.tanh(torch.tanh(x @ W) @ W), x, V, is_grads_batched=True)


def test_cpu_backward_is_fused_cpp():
    compiled = compile_dynbatch(vjp, options=DEFAULTS)
    x, V = torch.randn(4, 16, requires_grad=True), torch.randn(6, 4, 16)
    result, code = run_and_get_code(compiled, x, V)
    assert_same_grads(result, vjp(x, V))
    assert_backend_ran(graphs=1, batched=1)
    source = "\n".join(code)
    assert "cpp_fused" in source  # Inductor's C++ kernels for the pointwise backward
    assert "triton" not in source
