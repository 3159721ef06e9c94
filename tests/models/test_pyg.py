"""SchNet from PyTorch Geometric (``torch_geometric.nn.models.SchNet``) under dynbatch:
message passing over an edge list, its messages summed into atoms by scatter.

The model is compiled and differentiated outside, as a force field's user does: forces,
a training step with forces (``create_graph=True``), and the Hessian, whose batched
backward scatters into expanded zeros (NOTE [Scatters into expanded tensors]): each
against eager SchNet in float64.  The interaction graph is every pair of atoms within one
molecule, given as a module (PyG's radius graph needs torch-cluster).
"""

from __future__ import annotations

import itertools

import pytest
import torch

import dynbatch

pytest.importorskip("torch_geometric", reason="torch_geometric is not installed (pip install -e '.[models]')")
from torch_geometric.nn.models import SchNet  # noqa: E402

pytestmark = pytest.mark.models
DTYPE = torch.float64
CLOSE = {"rtol": 1e-7, "atol": 1e-10}


class AllPairs(torch.nn.Module):
    """SchNet's ``interaction_graph``: every ordered pair of atoms of one molecule."""

    def __init__(self, edge_index: torch.Tensor):
        super().__init__()
        self.register_buffer("edge_index", edge_index)

    def forward(self, pos, batch):
        row, col = self.edge_index
        return self.edge_index, (pos[row] - pos[col]).norm(dim=-1)


def _molecules(sizes=(5, 7), seed=0):
    g = torch.Generator().manual_seed(seed)
    batch = torch.cat([torch.full((n,), i) for i, n in enumerate(sizes)])
    starts = [0, *itertools.accumulate(sizes)]
    pairs = [(a, b) for s, e in zip(starts, starts[1:]) for a in range(s, e) for b in range(s, e) if a != b]
    z = torch.randint(1, 9, (starts[-1],), generator=g)
    pos = torch.rand(starts[-1], 3, generator=g, dtype=DTYPE) * 3
    return z, pos, batch, torch.tensor(pairs).T


def _schnet(edge_index, seed=0):
    torch.manual_seed(seed)
    return SchNet(hidden_channels=32, num_filters=32, num_interactions=2, num_gaussians=16, cutoff=5.0,
                  interaction_graph=AllPairs(edge_index)).to(DTYPE)


def test_forces(first_call):
    z, pos, batch, edges = _molecules()
    model = _schnet(edges)
    compiled = torch.compile(model, backend="dynbatch")

    def forces(m):
        p = pos.clone().requires_grad_()
        return -torch.autograd.grad(m(z, p, batch).sum(), p)[0]

    torch.testing.assert_close(first_call(forces, compiled), forces(model), **CLOSE)
    assert dynbatch.counters()["outside_plain"] >= 1


def test_training_step_with_forces(first_call):
    z, pos, batch, edges = _molecules()
    model = _schnet(edges)
    compiled = torch.compile(model, backend="dynbatch")

    def step(m):
        model.zero_grad()
        p = pos.clone().requires_grad_()
        energy = m(z, p, batch)
        (forces,) = torch.autograd.grad(energy.sum(), p, create_graph=True)
        (energy.pow(2).sum() + forces.pow(2).sum()).backward()
        return [q.grad.clone() for q in model.parameters() if q.grad is not None]

    for i in range(2):
        got = first_call(step, compiled) if i == 0 else step(compiled)
        for g, e in zip(got, step(model), strict=True):
            torch.testing.assert_close(g, e, **CLOSE)
    assert dynbatch.counters()["graphs"] >= 1 and dynbatch.counters().get("fallbacks", 0) == 0


def test_hessian(first_call):
    z, pos, batch, edges = _molecules((6,))
    model = _schnet(edges)
    compiled = torch.compile(model, backend="dynbatch")

    def hessian(m):
        return torch.autograd.functional.hessian(lambda p: m(z, p, batch).sum(), pos, vectorize=True)

    torch.testing.assert_close(first_call(hessian, compiled), hessian(model), **CLOSE)
    assert sum(dynbatch.counters().get(k, 0) for k in ("outside_batched_saved", "outside_batched_compiled")) >= 1


def test_sparse_hessian_of_a_batch_of_molecules_is_block_diagonal():
    """dynbatch.hessian of SchNet's energy over three molecules (5, 7 and 4 atoms): the
    pattern found in its aten graph keeps the molecules apart, so the colours are the
    largest molecule's coordinates (21), and the values equal eager's."""
    z, pos, batch, edges = _molecules(sizes=(5, 7, 4))
    model = _schnet(edges)

    def energy(p):
        return model(z, p, batch).sum()

    got = dynbatch.hessian(energy, pos, options={"dynbatch.inner_compiler": "aot_eager"})
    torch.testing.assert_close(got, torch.autograd.functional.hessian(energy, pos), **CLOSE)
    c = dynbatch.counters()
    assert c["grads_compressed"] == 1 and c["colours"] == 21 and c["rows"] == pos.numel(), c
