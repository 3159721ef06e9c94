"""Compiled batched grads give eager's answers (values, shapes, Nones) — issue 2 item 4.

Each program runs eagerly and under dynbatch with fullgraph=True; the
counters prove the backend compiled and batched it (no silent fallback).
"""

from __future__ import annotations

import pytest
import torch

import dynbatch
from conftest import DEFAULTS, assert_backend_ran, assert_same_grads, compile_dynbatch, loop_grads

torch.manual_seed(0)
W1, W2 = torch.randn(6, 6) / 3, torch.randn(6, 6) / 3


def mlp(x):
    return torch.tanh(torch.tanh(x @ W1) @ W2)




def leaf(x):
    """A fresh leaf that requires grad, made outside the compiled function.

    Dynamo in torch 2.11 cannot trace ``requires_grad_()``, so the programs
    differentiate with respect to inputs that already require grad.
    """
    return x.detach().requires_grad_()


def check(fn, *args, primals=1, batched=1, atol=None, rtol=None):
    args = [leaf(a) for a in args[:primals]] + list(args[primals:])
    expected = fn(*args)
    actual = compile_dynbatch(fn)(*args)
    assert_same_grads(actual, expected, atol=atol, rtol=rtol)
    assert_backend_ran(graphs=1, batched=batched)
    return actual


def test_single_tensor_input_matches_eager_and_loop():
    def f(x, V):
        return torch.autograd.grad(mlp(x), x, V, is_grads_batched=True)

    x, V = torch.randn(4, 6), torch.randn(5, 4, 6)
    got = check(f, x, V)
    xl = leaf(x)
    assert_same_grads(got, loop_grads(mlp(xl), xl, V))


@pytest.mark.parametrize("container", [tuple, list])
def test_several_outputs_and_inputs(container):
    def f(x, z, V1, V2):
        y1 = (x * z).sin()
        y2 = (x.exp() @ W1).sum(0)
        return torch.autograd.grad(container([y1, y2]), container([x, z]), container([V1, V2]),
                                   is_grads_batched=True)

    check(f, torch.randn(4, 6), torch.randn(4, 6), torch.randn(3, 4, 6), torch.randn(3, 6), primals=2)


def test_allow_unused_gives_none_where_eager_does():
    def f(x, z, V):
        return torch.autograd.grad(mlp(x), (x, z), V, is_grads_batched=True, allow_unused=True)

    got = check(f, torch.randn(4, 6), torch.randn(3), torch.randn(2, 4, 6), primals=2)
    assert got[1] is None


def test_materialize_grads_matches_eager_shapes():
    # Eager materialises unused batched grads as zeros_like(input), unbatched.
    def f(x, z, V):
        return torch.autograd.grad(mlp(x), (x, z), V, is_grads_batched=True, materialize_grads=True)

    got = check(f, torch.randn(4, 6), torch.randn(3), torch.randn(2, 4, 6), primals=2)
    assert got[1].shape == (3,)


def test_retain_graph_allows_a_second_grad():
    def f(x, V):
        y = mlp(x)
        (g1,) = torch.autograd.grad(y, x, V, is_grads_batched=True, retain_graph=True)
        (g2,) = torch.autograd.grad(y, x, 2 * V, is_grads_batched=True)
        return g1, g2

    check(f, torch.randn(4, 6), torch.randn(3, 4, 6), batched=2)


def test_create_graph_hessian_rows_and_backprop_through_batched_result():
    def f(x, V):
        (g,) = torch.autograd.grad(mlp(x).pow(2).sum(), x, create_graph=True)
        (H,) = torch.autograd.grad(g, x, V, is_grads_batched=True, create_graph=True)
        (third,) = torch.autograd.grad(H.pow(2).sum(), x)  # backprop through the batched result
        return H.detach(), third

    x = torch.randn(2, 6)
    V = torch.eye(12).reshape(12, 2, 6)
    check(f, x, V)


def test_grad_of_batched_grad_create_graph():
    def f(x, V):
        (g,) = torch.autograd.grad((x.sin() * x), x, V, is_grads_batched=True, create_graph=True)
        return torch.autograd.grad(g.sum(), x)

    check(f, torch.randn(5), torch.randn(3, 5))


def test_non_leaf_intermediate_input():
    def f(x, V):
        h = x * 2
        return torch.autograd.grad(mlp(h), h, V, is_grads_batched=True)

    check(f, torch.randn(4, 6), torch.randn(3, 4, 6))


def test_requires_grad_inside_the_compiled_function():
    def f(x, V):
        x = x.detach().requires_grad_()
        return torch.autograd.grad(mlp(x), x, V, is_grads_batched=True)

    check(f, torch.randn(4, 6), torch.randn(3, 4, 6), primals=0)


def test_leaf_graph_input_requiring_grad():
    def f(x, V):
        return torch.autograd.grad(mlp(x), x, V, is_grads_batched=True)

    check(f, torch.randn(4, 6, requires_grad=True), torch.randn(3, 4, 6))


@pytest.mark.parametrize("layout", ["non_contiguous", "expanded", "stride0_batch"])
def test_cotangent_layouts(layout):
    def f(x, V):
        return torch.autograd.grad(mlp(x), x, V, is_grads_batched=True)

    V = {
        "non_contiguous": torch.randn(6, 4, 3).permute(2, 1, 0),
        "expanded": torch.randn(1, 4, 6).expand(3, 4, 6),
        "stride0_batch": torch.randn(4, 1).expand(4, 6).unsqueeze(0).expand(3, 4, 6),
    }[layout]
    check(f, torch.randn(4, 6), V)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_dtypes(dtype):
    def f(x, V):
        return torch.autograd.grad(torch.tanh(x @ W1.to(x.dtype)), x, V, is_grads_batched=True)

    got = check(f, torch.randn(4, 6, dtype=dtype), torch.randn(3, 4, 6, dtype=dtype))
    assert got[0].dtype == dtype


def test_batch_size_one():
    def f(x, V):
        return torch.autograd.grad(mlp(x), x, V, is_grads_batched=True)

    check(f, torch.randn(4, 6), torch.randn(1, 4, 6))


def test_functional_jacobian_vectorize():
    def f(x):
        return torch.autograd.functional.jacobian(mlp, x, vectorize=True)

    check(f, torch.randn(3, 6))


def test_functional_hessian_vectorize():
    def f(x):
        return torch.autograd.functional.hessian(lambda z: mlp(z).sum(), x, vectorize=True)

    # hessian = vectorised jacobian of a plain (scalar-output) create_graph grad.
    check(f, torch.randn(6), batched=1)
    assert dynbatch.counters()["grads_plain"] == 1


@pytest.mark.parametrize("chunk_size", [None, 1, 4])
def test_torch_vmap_of_grads_with_a_chunk_size_is_one_batched_grad(chunk_size):
    """MACE's Hessian: ``torch.vmap(vjp, chunk_size=1)`` over an identity basis.  The chunk
    loop is not unrolled into one grad per chunk: the vmapped grad is traced once."""

    def f(pos):
        forces = -torch.autograd.grad(mlp(pos).pow(2).sum(), pos, create_graph=True)[0]
        flat = forces.view(-1)

        def vjp(v):
            return torch.autograd.grad(-1 * flat, pos, v, retain_graph=True)

        basis = torch.eye(flat.shape[0])
        return torch.vmap(vjp, in_dims=0, out_dims=0, chunk_size=chunk_size)(basis)[0]

    check(f, torch.randn(3, 6), batched=1)  # the vmapped grad, once (not 18 times)
    assert dynbatch.counters()["grads_plain"] == 1  # the forces


def test_plain_grad_and_batched_grad_in_one_graph():
    """Forces (-dE/dx) by a plain grad and the Hessian by a batched grad."""

    def f(pos, V):
        d = (pos.unsqueeze(0) - pos.unsqueeze(1)).pow(2).sum(-1) + torch.eye(pos.shape[0])
        energy = (d.pow(-6) - d.pow(-3)).sum()
        (g,) = torch.autograd.grad(energy, pos, create_graph=True)
        (H,) = torch.autograd.grad(g, pos, V, is_grads_batched=True)
        return -g.detach(), H

    pos = torch.arange(12.0).reshape(4, 3).sin() * 2
    check(f, pos, torch.eye(12).reshape(12, 4, 3))
    assert dynbatch.counters()["grads_plain"] == 1


def test_result_under_inductor():
    """The same program through Inductor's C++ backend (the default inner compiler)."""

    def f(x, V):
        return torch.autograd.grad(mlp(x), x, V, is_grads_batched=True)

    x, V = leaf(torch.randn(4, 6)), torch.randn(5, 4, 6)
    got = compile_dynbatch(f, options=DEFAULTS)(x, V)
    assert_same_grads(got, f(x, V))
    assert_backend_ran(graphs=1, batched=1)
    record = dynbatch.compile_records()[-1]
    assert "aten.mm.default" in record.aten_graphs[0]
