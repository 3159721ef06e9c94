"""Shared fixtures: every test starts from a fresh Dynamo and fresh dynbatch counters."""

from __future__ import annotations

import pytest
import torch

import dynbatch

# Cheap inner compiler for semantic tests: same capture and batching pass,
# same AOTAutograd trace, no Inductor codegen (seconds per compile on 2 cores).
AOT_EAGER = {"dynbatch.inner_compiler": "aot_eager", "dynbatch.on_unsupported": "error"}


def reset_all() -> None:
    torch._dynamo.reset()
    dynbatch.reset()
    torch._dynamo.utils.counters.clear()


@pytest.fixture(autouse=True)
def fresh_dynamo():
    reset_all()
    yield
    reset_all()


def compile_dynbatch(fn, *, options=AOT_EAGER, fullgraph=True, **kwargs):
    return torch.compile(fn, backend="dynbatch", fullgraph=fullgraph, options=options, **kwargs)


def eager_loop_grad(outputs, inputs, grad_outputs, **kwargs):
    """The oracle: one torch.autograd.grad per sample, stacked (None stays None)."""
    outputs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    grad_outputs = (grad_outputs,) if isinstance(grad_outputs, torch.Tensor) else tuple(grad_outputs)
    batch = grad_outputs[0].shape[0]
    per_sample = [
        torch.autograd.grad(outputs, inputs, tuple(g[b] for g in grad_outputs), retain_graph=True, **kwargs)
        for b in range(batch)
    ]
    return tuple(
        None if per_sample[0][i] is None else torch.stack([s[i] for s in per_sample])
        for i in range(len(inputs))
    )


def assert_same_grads(actual, expected, *, atol=None, rtol=None):
    """Values within dtype tolerance, same shapes and dtypes, and the same Nones."""
    actual = (actual,) if isinstance(actual, torch.Tensor) else tuple(actual)
    expected = (expected,) if isinstance(expected, torch.Tensor) else tuple(expected)
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert (a is None) == (e is None), f"result {i}: None-ness differs ({a is None} vs {e is None})"
        if a is not None:
            assert a.shape == e.shape, f"result {i}: shape {tuple(a.shape)} vs {tuple(e.shape)}"
            torch.testing.assert_close(a, e, atol=atol, rtol=rtol, msg=lambda m: f"result {i}: {m}")


def assert_backend_ran(graphs=1, batched=None):
    c = dynbatch.counters()
    assert c.get("graphs", 0) == graphs, c
    assert c.get("fallbacks", 0) == 0, dynbatch.fallback_reasons()
    if batched is not None:
        assert c.get("grads_batched", 0) == batched, c
