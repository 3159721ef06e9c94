"""Snapshots of the graphs at each stage, for six representative programs — issue 2 item 8.

For each program: the graph Dynamo captured, the graph after the batching
pass, and the aten graph(s) handed to Inductor, taken from the second
compile so the batch size is symbolic (``s0``).  Regenerate with
``EXPECTTEST_ACCEPT=1 pytest tests/test_snapshots.py`` and review the diff.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dynbatch
from conftest import assert_same_grads
from snapshot import assert_snapshot

pytestmark = pytest.mark.skipif(
    not str(torch.__version__).startswith("2.13."),
    reason="graph snapshots are recorded with torch 2.13 (CI's); other versions trace different aten graphs",
)

g = torch.Generator().manual_seed(0)
W1, W2, W3 = (torch.randn(8, 8, generator=g) / 3 for _ in range(3))
Wq, Wk, Wv = (torch.randn(8, 8, generator=g) / 3 for _ in range(3))


def mlp_jacobian(x, V):
    x = x.detach().requires_grad_()
    y = torch.tanh(torch.tanh(torch.tanh(x @ W1) @ W2) @ W3)
    return torch.autograd.grad(y, x, V, is_grads_batched=True)


def multi_output_allow_unused(x, z, V1, V2):
    x, z = x.detach().requires_grad_(), z.detach().requires_grad_()
    unused = z * 2
    return torch.autograd.grad((x.sin() @ W1, x.exp().sum(-1)), (x, unused), (V1, V2),
                               is_grads_batched=True, allow_unused=True)


def hessian_rows(x, V):
    x = x.detach().requires_grad_()
    (g,) = torch.autograd.grad(torch.tanh(x @ W1).pow(2).sum(), x, create_graph=True)
    return torch.autograd.grad(g, x, V, is_grads_batched=True)


def functional_jacobian(x, _V):
    return torch.autograd.functional.jacobian(lambda z: torch.tanh(z @ W1), x, vectorize=True)


def attention_block(x, V):
    x = x.detach().requires_grad_()
    q, k, v = x @ Wq, x @ Wk, x @ Wv
    attn = torch.softmax(q @ k.transpose(-1, -2) / 8 ** 0.5, dim=-1)
    y = F.layer_norm(attn @ v + x, (8,))
    return torch.autograd.grad(y, x, V, is_grads_batched=True)


def fallback_bad_cotangent(x, V):
    x = x.detach().requires_grad_()
    return torch.autograd.grad(x.sin(), x, V[..., :-2], is_grads_batched=True)


PROGRAMS = {
    # name: (fn, inputs for B=3, inputs for B=5)
    "mlp_jacobian": (mlp_jacobian, lambda B: (torch.randn(4, 8), torch.randn(B, 4, 8))),
    "multi_output_allow_unused": (
        multi_output_allow_unused,
        lambda B: (torch.randn(4, 8), torch.randn(3), torch.randn(B, 4, 8), torch.randn(B, 4)),
    ),
    "hessian_rows": (hessian_rows, lambda B: (torch.randn(2, 8), torch.randn(B, 2, 8))),
    "functional_jacobian": (functional_jacobian, lambda B: (torch.randn(B, 8), None)),
    "attention_block": (attention_block, lambda B: (torch.randn(6, 8), torch.randn(B, 6, 8))),
    "fallback_bad_cotangent": (fallback_bad_cotangent, lambda B: (torch.randn(4), torch.randn(B, 5))),
}


def record_text(record: dynbatch.CompileRecord) -> str:
    parts = [record.dynamo_graph]
    if record.fell_back:
        parts.append(f"fallback: {record.fallback_reason}\n")
    else:
        parts.append(record.batched_graph)
        parts.extend(record.aten_graphs)
    return "\n".join(parts)


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_graph_snapshots(name):
    fn, make_inputs = PROGRAMS[name]
    compiled = torch.compile(fn, backend="dynbatch", fullgraph=True)
    for B in (3, 5):
        args = make_inputs(B)
        if name.startswith("fallback"):
            with pytest.raises(RuntimeError) as eager:
                fn(*args)
            with pytest.raises(RuntimeError, match=None) as ours:
                compiled(*args)
            assert str(ours.value) == str(eager.value)
        else:
            assert_same_grads(compiled(*args), fn(*args), atol=1e-4, rtol=1e-4)
    record = dynbatch.compile_records()[-1]
    assert record.fell_back == name.startswith("fallback")
    assert_snapshot(name, record_text(record))
