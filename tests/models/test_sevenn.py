"""SevenNet (``sevenn``, NequIP-style e3nn interactions) under dynbatch: the forces and stress
of its ASE calculator, a training step with forces, and the Hessian of the energy with respect
to the positions, each against the same eager SevenNet in float32.

The model is ``sevenn.model_build.build_E3_equivariant_model``'s from a small config (random
weights, no checkpoint), and the structure five atoms in a periodic cubic cell smaller than
twice the cutoff, so that edges cross the cell.  SevenNet's forces are the grad of the energy
with respect to the edge vectors (``ForceStressOutputFromEdge``), which the model marks with
``requires_grad_`` itself (``AtomGraphSequential._preprocess``), before a graph break.
"""

from __future__ import annotations

import copy

import pytest
import torch

import dynbatch

pytest.importorskip("sevenn", reason="sevenn is not installed (pip install sevenn)")
import ase  # noqa: E402
import numpy as np  # noqa: E402
import sevenn._keys as KEY  # noqa: E402
from sevenn._const import DEFAULT_E3_EQUIVARIANT_MODEL_CONFIG  # noqa: E402
from sevenn.atom_graph_data import AtomGraphData  # noqa: E402
from sevenn.calculator import SevenNetCalculator  # noqa: E402
from sevenn.model_build import build_E3_equivariant_model  # noqa: E402
from sevenn.train.dataload import unlabeled_atoms_to_graph  # noqa: E402

pytestmark = [pytest.mark.models,
              pytest.mark.filterwarnings("ignore:No tensor product accelerator:UserWarning")]
CLOSE = {"rtol": 1e-4, "atol": 1e-5}
CUTOFF = 4.0


def _model(seed: int = 0):
    config = copy.deepcopy(DEFAULT_E3_EQUIVARIANT_MODEL_CONFIG)
    config.update({
        KEY.CUTOFF: CUTOFF, KEY.NODE_FEATURE_MULTIPLICITY: 4, KEY.LMAX: 1, KEY.NUM_CONVOLUTION: 2,
        KEY.CONVOLUTION_WEIGHT_NN_HIDDEN_NEURONS: [8], KEY.CONV_DENOMINATOR: 4.0,
        KEY.NUM_SPECIES: 2, KEY.TYPE_MAP: {1: 0, 8: 1}, KEY.SHIFT: 0.0, KEY.SCALE: 1.0,
    })
    torch.manual_seed(seed)
    return build_E3_equivariant_model(config)


def _atoms(seed: int = 0):
    rng = np.random.default_rng(seed)
    return ase.Atoms("OH2OH", positions=rng.random((5, 3)) * 2.5, cell=np.eye(3) * 5.0, pbc=True)


def _graph(atoms):
    """A fresh graph, as the calculator builds it (the model writes into it), plus the cell
    and each edge's cell shift."""
    return AtomGraphData.from_numpy_dict(unlabeled_atoms_to_graph(atoms, CUTOFF, with_shift=True))


def test_calculator_forces_and_stress(first_call):
    """``SevenNetCalculator`` as given a model instance (eval mode, unbatched data), its
    model swapped for the compiled one."""
    model = _model()
    eager = SevenNetCalculator(model, file_type="model_instance")
    compiled = SevenNetCalculator(model, file_type="model_instance")
    compiled.model = torch.compile(model, backend="dynbatch")
    atoms = _atoms()
    properties = ["energy", "forces", "stress"]

    def results(calc):
        calc.calculate(atoms.copy(), properties)
        return dict(calc.results)

    got = first_call(results, compiled)
    expected = results(eager)
    for key in properties:
        torch.testing.assert_close(torch.as_tensor(got[key]), torch.as_tensor(expected[key]), **CLOSE)
    counts = dynbatch.counters()
    # the energy's grad runs eagerly after a graph break, through the compiled graphs' backward
    assert counts["graphs"] >= 1 and counts.get("outside_plain", 0) >= 1, counts
    assert not dynbatch.fallback_reasons(), dynbatch.fallback_reasons()


def test_training_step_with_forces(first_call):
    model = _model().train()  # the forces' grad with create_graph
    model.set_is_batch_data(False)
    compiled = torch.compile(model, backend="dynbatch")
    atoms = _atoms()
    g = torch.Generator().manual_seed(1)
    energy_target, forces_target = torch.randn((), generator=g), torch.randn(len(atoms), 3, generator=g)

    def step(m):
        model.zero_grad()
        out = m(_graph(atoms))
        loss = (out[KEY.PRED_TOTAL_ENERGY] - energy_target).pow(2) + (out[KEY.PRED_FORCE] - forces_target).pow(2).mean()
        loss.backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    got = first_call(step, compiled)
    expected = step(model)
    assert len(got) == len(expected) > 0
    for a, e in zip(got, expected):
        torch.testing.assert_close(a, e, **CLOSE)
    assert dynbatch.counters()["graphs"] >= 1, dynbatch.counters()
    assert not dynbatch.fallback_reasons(), dynbatch.fallback_reasons()


def test_hessian_around_the_compiled_model(first_call):
    """The edge vectors computed from the positions as SevenNet's ``EdgePreprocess`` does;
    training mode, so that the model's own forces grad (``create_graph``) keeps the energy's
    graph for the Hessian's grads (in eval mode it frees it, in eager too)."""
    model = _model().train()
    model.set_is_batch_data(False)
    compiled = torch.compile(model, backend="dynbatch")
    atoms = _atoms()

    def energy(m):
        def of(pos):
            data = _graph(atoms)
            src, dst = data[KEY.EDGE_IDX]
            data[KEY.EDGE_VEC] = pos[dst] - pos[src] + data[KEY.CELL_SHIFT] @ data[KEY.CELL]
            return m(data)[KEY.PRED_TOTAL_ENERGY]
        return of

    graph = _graph(atoms)
    src, dst = graph[KEY.EDGE_IDX]
    pos = graph[KEY.POS]
    # the edge vectors above are the graph's own
    torch.testing.assert_close(pos[dst] - pos[src] + graph[KEY.CELL_SHIFT] @ graph[KEY.CELL], graph[KEY.EDGE_VEC])
    got = first_call(torch.autograd.functional.hessian, energy(compiled), pos.clone())
    expected = torch.autograd.functional.hessian(energy(model), pos.clone())
    torch.testing.assert_close(got, expected, **CLOSE)
    counts = dynbatch.counters()
    assert counts["graphs"] >= 1 and counts.get("outside_plain", 0) >= 1, counts
    assert not dynbatch.fallback_reasons(), dynbatch.fallback_reasons()
