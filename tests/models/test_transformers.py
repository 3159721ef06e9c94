"""A transformer block from Hugging Face transformers (``BertLayer``) under dynbatch:
the block compiled, Jacobians, per-sample grads and Hessian-vector products taken
around it, each against the eager block in float64.  No weights are downloaded: the
block is built from a small ``BertConfig``."""

from __future__ import annotations

import pytest
import torch

import dynbatch

pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[models]')")
from transformers.models.bert.modeling_bert import BertConfig, BertLayer  # noqa: E402

pytestmark = pytest.mark.models
DTYPE = torch.float64
CLOSE = {"rtol": 1e-7, "atol": 1e-10}


def _block(attention: str = "sdpa") -> torch.nn.Module:
    torch.manual_seed(0)
    config = BertConfig(hidden_size=32, num_attention_heads=4, intermediate_size=64, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    config._attn_implementation = attention
    return BertLayer(config).to(DTYPE).eval()


def _out(result):
    return result[0] if isinstance(result, tuple) else result


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_jacobian(first_call, attention):
    block = _block(attention)
    compiled = torch.compile(block, backend="dynbatch")
    x = torch.randn(2, 5, 32, dtype=DTYPE)

    def jacobian(m):
        return torch.autograd.functional.jacobian(lambda t: _out(m(t)), x, vectorize=True)

    torch.testing.assert_close(first_call(jacobian, compiled), jacobian(block), **CLOSE)
    assert sum(dynbatch.counters().get(k, 0) for k in ("outside_batched_saved", "outside_batched_compiled")) >= 1


def test_per_sample_grads(first_call):
    block = _block()
    compiled = torch.compile(block, backend="dynbatch")
    x, target = torch.randn(6, 5, 32, dtype=DTYPE), torch.randn(6, 5, 32, dtype=DTYPE)
    params = [p for p in block.parameters()]

    def per_sample(m):
        losses = (_out(m(x)) - target).pow(2).mean(dim=(1, 2))
        return torch.autograd.grad(losses, params, torch.eye(len(losses), dtype=DTYPE), is_grads_batched=True)

    for g, e in zip(first_call(per_sample, compiled), per_sample(block), strict=True):
        torch.testing.assert_close(g, e, **CLOSE)
    assert sum(dynbatch.counters().get(k, 0) for k in ("outside_batched_saved", "outside_batched_compiled")) >= 1


def test_hessian_vector_product(first_call):
    block = _block("eager")  # torch has no double backward of the CPU SDPA kernel, eager included
    compiled = torch.compile(block, backend="dynbatch")
    x = torch.randn(2, 5, 32, dtype=DTYPE)
    params = [p for p in block.parameters()]
    vs = [torch.randn_like(p) for p in params]

    def hvp(m):
        grads = torch.autograd.grad(_out(m(x)).tanh().pow(2).sum(), params, create_graph=True)
        return torch.autograd.grad(grads, params, vs)

    for g, e in zip(first_call(hvp, compiled), hvp(block), strict=True):
        torch.testing.assert_close(g, e, **CLOSE)
    assert dynbatch.counters()["graphs"] >= 1 and dynbatch.counters().get("fallbacks", 0) == 0
