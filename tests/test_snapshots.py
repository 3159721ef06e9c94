"""Snapshots of the graphs at each stage, for six representative programs — issue 2 item 8.

For each program: the graph Dynamo captured, the graph after the batching
pass, and the aten graph(s) handed to Inductor, taken from the second
compile so the batch size is symbolic (``s0``).  Regenerate with
``EXPECTTEST_ACCEPT=1 pytest tests/test_snapshots.py`` and review the diff.
"""

from __future__ import annotations

import re

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


def vmapped_hessian_rows(x, V):
    """MACE's spelling of Hessian rows: ``torch.vmap`` of a vjp, chunked (NOTE [Grads under torch.vmap])."""
    x = x.detach().requires_grad_()
    (g,) = torch.autograd.grad(torch.tanh(x @ W1).pow(2).sum(), x, create_graph=True)
    return torch.vmap(lambda v: torch.autograd.grad(g, x, v, retain_graph=True)[0], chunk_size=1)(V)


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
    "vmapped_hessian_rows": (vmapped_hessian_rows, lambda B: (torch.randn(2, 8), torch.randn(B, 2, 8))),
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
    # A user's plain torch.compile (Inductor, "fallback"): the snapshots are of what users get.
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


def test_chunked_graph_snapshot():
    """hessian_rows with dynbatch.chunk_size=3: the grad becomes dynbatch::chunked_grad in the
    aten graph, and its chunk program (the forward part re-run, then the batched grad) is a
    graph of its own, compiled with the chunk's batch dim symbolic."""
    fn, make_inputs = PROGRAMS["hessian_rows"]
    compiled = torch.compile(fn, backend="dynbatch", fullgraph=True, options={"dynbatch.chunk_size": 3})  # as above
    for B in (4, 7):  # even chunks: 2+2, then 3+2+2
        args = make_inputs(B)
        assert_same_grads(compiled(*args), fn(*args), atol=1e-4, rtol=1e-4)
    main = [r for r in dynbatch.compile_records() if not r.chunk_program][-1]
    (program,) = [r for r in dynbatch.compile_records() if r.chunk_program]
    (plan,) = main.memory_plan
    assert plan.applied and plan.chunk_size == 3 and plan.chunks == 3
    # The op names its program by a key that differs per compile.
    main_text = re.sub(r"chunked_grad\.default\('[0-9a-f]+'", "chunked_grad.default('<key>'", record_text(main))
    text = "\n".join([main_text, f"plan: chunks of {plan.chunk_size}, {plan.chunks} at B={plan.batch}\n",
                      "chunk program:", record_text(program)])
    assert_snapshot("chunked_hessian_rows", text)
