"""TensorNet from TorchMD-Net (``torchmdnet``) under dynbatch: forces from the model's own
``derivative=True`` grad, a training step with forces, and the Hessian of the energy, both
around the compiled model and inside one compiled function, each against the same eager
TensorNet in float64.

The model is ``torchmdnet.models.model.create_model``'s (random weights) with TensorNet's
pure-torch tensor ops, the ones it takes without warp-lang (its warp kernels are custom ops
without a vmap rule, in eager too), and its own neighbour list: ``OptimizedDistance``, a
``torch.autograd.Function`` whose forward is a warp kernel (it runs on the CPU) and whose
backward is written in torch ops, so the Hessian differentiates that backward.  Stock
``torch.compile`` traced the backward under ``no_grad``: the Hessians came out zero and the
force-training grads wrong.  ``num_systems`` is passed: without it the compiled reduce uses
a size set by an eager call.
"""

from __future__ import annotations

import pytest
import torch

import dynbatch

pytest.importorskip("torchmdnet", reason="torchmd-net is not installed (pip install torchmd-net)")
from torchmdnet.models import tensornet  # noqa: E402
from torchmdnet.models.model import create_model  # noqa: E402

pytestmark = pytest.mark.models
DTYPE = torch.float64
CLOSE = {"rtol": 1e-8, "atol": 1e-10}
CUTOFF = 5.0
ATOMS = 6


@pytest.fixture(autouse=True, scope="module")
def pure_torch_ops():
    """TensorNet's module-level tensor ops as it binds them when warp-lang is missing."""
    with pytest.MonkeyPatch.context() as patch:
        for name in ("compose_tensor", "decompose_tensor", "tensor_matmul_o3", "tensor_matmul_so3"):
            patch.setattr(tensornet, name, getattr(tensornet, "_" + name))
        yield


def _model(derivative: bool, seed: int = 0):
    torch.manual_seed(seed)
    model = create_model({
        "model": "tensornet", "precision": 64, "embedding_dimension": 16, "num_layers": 1, "num_rbf": 8,
        "rbf_type": "expnorm", "trainable_rbf": False, "activation": "silu", "cutoff_lower": 0.0,
        "cutoff_upper": CUTOFF, "max_z": 10, "max_num_neighbors": ATOMS, "equivariance_invariance_group": "O(3)",
        "static_shapes": False, "derivative": derivative, "atom_filter": -1, "prior_model": None,
        "output_model": "Scalar", "reduce_op": "sum",
    })
    for module in model.modules():
        if hasattr(module, "opt"):
            module.opt = False  # TensorNet's pure-torch message passing and output
    return model


def _molecule(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    z = torch.randint(1, 10, (ATOMS,), generator=g)
    pos = torch.rand(ATOMS, 3, generator=g, dtype=DTYPE) * 2.5
    return z, pos, torch.zeros(ATOMS, dtype=torch.long)


def test_forces(first_call):
    model = _model(derivative=True).eval()
    compiled = torch.compile(model, backend="dynbatch")
    z, pos, batch = _molecule()

    def energy_forces(m):
        return m(z, pos.clone(), batch, num_systems=1)  # the model sets requires_grad on pos

    got = first_call(energy_forces, compiled)
    expected = energy_forces(model)
    torch.testing.assert_close(got[0], expected[0], **CLOSE)
    torch.testing.assert_close(got[1], expected[1], **CLOSE)
    counts = dynbatch.counters()
    # the model's own grad (the forces): in a graph, or after the neighbour list's graph
    # breaks through the compiled graphs' backward
    assert counts["graphs"] >= 1 and counts.get("grads_plain", 0) + counts.get("outside_plain", 0) >= 1, counts
    assert not dynbatch.fallback_reasons(), dynbatch.fallback_reasons()


def test_training_step_with_forces(first_call):
    model = _model(derivative=True)  # training mode: the forces' grad with create_graph
    compiled = torch.compile(model, backend="dynbatch")
    z, pos, batch = _molecule()
    g = torch.Generator().manual_seed(1)
    energy_target = torch.randn(1, 1, generator=g, dtype=DTYPE)
    forces_target = torch.randn(ATOMS, 3, generator=g, dtype=DTYPE)

    def step(m):
        model.zero_grad()
        energy, forces = m(z, pos.clone(), batch, num_systems=1)
        loss = (energy - energy_target).pow(2).mean() + (forces - forces_target).pow(2).mean()
        loss.backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    got = first_call(step, compiled)
    expected = step(model)
    assert len(got) == len(expected) > 0
    for a, e in zip(got, expected):
        torch.testing.assert_close(a, e, **CLOSE)
    counts = dynbatch.counters()
    assert counts["graphs"] >= 1 and counts["grads_plain"] >= 1, counts
    assert not dynbatch.fallback_reasons(), dynbatch.fallback_reasons()


def test_hessian_around_the_compiled_model(first_call):
    model = _model(derivative=False)
    compiled = torch.compile(model, backend="dynbatch")
    z, pos, batch = _molecule()

    def hessian(m):
        return torch.autograd.functional.hessian(lambda p: m(z, p, batch, num_systems=1)[0].sum(), pos.clone())

    got = first_call(hessian, compiled)
    torch.testing.assert_close(got, hessian(model), **CLOSE)
    counts = dynbatch.counters()
    # the Hessian's rows are grads taken outside, through the compiled graph's backward
    assert counts["graphs"] >= 1 and counts.get("outside_plain", 0) >= 1, counts
    assert not dynbatch.fallback_reasons(), dynbatch.fallback_reasons()


def test_hessian_inside_one_compiled_function(first_call):
    model = _model(derivative=False)
    z, pos, batch = _molecule()

    def energy(p):
        return model(z, p, batch, num_systems=1)[0].sum()

    compiled = torch.compile(lambda p: torch.autograd.functional.hessian(energy, p, vectorize=True), backend="dynbatch")
    got = first_call(compiled, pos.clone())
    torch.testing.assert_close(got, torch.autograd.functional.hessian(energy, pos.clone()), **CLOSE)
    counts = dynbatch.counters()
    # the vmapped vjp of the vectorized Hessian is one batched grad in the graph
    assert counts["graphs"] >= 1 and counts["grads_batched"] >= 1, counts
    assert not dynbatch.fallback_reasons(), dynbatch.fallback_reasons()
