"""MACE (mace-torch, e3nn) under dynbatch: inference forces, a training step with forces,
Hessian rows and stress, each against eager MACE in float64.

The model and batches are the ``mace`` bench workload's (``dynbatch.bench.mace_workload``),
built as MACE's own compile helper builds it (``mace.tools.compile``: e3nn's
TorchScript code generation off, e3nn modules simplified with ``torch.fx``; Dynamo cannot
trace e3nn's scripted modules, stock or dynbatch).  The other half of that helper,
``allow_in_graph(torch.autograd.grad)`` with ``trace_autograd_ops=True``, is not used:
dynbatch needs no configuration.  As MACE expects when compiled, the caller sets
``positions.requires_grad_(True)`` (``prepare_graph`` skips it under ``torch.compile``).
"""

from __future__ import annotations

import pytest
import torch

import dynbatch

pytest.importorskip("mace", reason="mace-torch is not installed (pip install -e '.[models]')")
from dynbatch.bench.mace_workload import DTYPE, calculator_forces, fresh, make_batch, make_model  # noqa: E402

pytestmark = pytest.mark.models
CLOSE = {"rtol": 1e-7, "atol": 1e-10}


def test_inference_forces(first_call):
    model = make_model()
    compiled = torch.compile(model, backend="dynbatch")
    for i, names in enumerate((["CH3OH", "CH3CH2OH", "H2O"], ["CH3OH", "CH3CH2OH", "H2O"], ["H2O", "CH4"])):
        batch = make_batch(names, seed=i)
        run = first_call if i == 0 else (lambda fn, *args, **kwargs: fn(*args, **kwargs))
        got = run(compiled, fresh(batch), training=False, compute_force=True)
        expected = model(fresh(batch), training=False, compute_force=True)
        torch.testing.assert_close(got["energy"], expected["energy"], **CLOSE)
        torch.testing.assert_close(got["forces"], expected["forces"], **CLOSE)
    counts = dynbatch.counters()
    # the forces' grad is in the graph, though the energy it consumed is returned
    # (NOTE [A grad that consumes returned tensors]); no grad runs outside it
    assert counts["grads_plain"] >= 1 and counts.get("fallbacks", 0) == 0 and not counts.get("outside_plain"), counts


def test_forces_as_maces_calculator_takes_them(first_call):
    """MACE's ASE calculator with compile_mode set: parameters frozen, positions and node
    attributes requiring grad, training=True (the forces' grad with create_graph)."""
    model = make_model().requires_grad_(False)
    forces = calculator_forces(torch.compile(model, backend="dynbatch"))
    for i, names in enumerate((["CH3OH", "CH3CH2OH", "H2O"], ["CH3OH", "CH3CH2OH", "H2O"])):
        batch = make_batch(names, seed=i)
        got = first_call(forces, batch, None, None) if i == 0 else forces(batch, None, None)
        torch.testing.assert_close(got, calculator_forces(model)(batch, None, None), **CLOSE)
    counts = dynbatch.counters()
    assert counts["grads_plain"] >= 1 and counts.get("fallbacks", 0) == 0 and not counts.get("outside_plain"), counts


def test_training_step_with_forces(first_call):
    model = make_model()
    compiled = torch.compile(model, backend="dynbatch")
    batch = make_batch(["CH3OH", "CH3CH2OH", "H2O"])

    def step(m):
        model.zero_grad()
        out = m(fresh(batch), training=True, compute_force=True)
        (out["energy"].pow(2).sum() + 10 * out["forces"].pow(2).sum()).backward()
        return [p.grad.clone() for p in model.parameters()]

    for i in range(2):
        got = first_call(step, compiled) if i == 0 else step(compiled)
        for g, e in zip(got, step(model)):
            torch.testing.assert_close(g, e, **CLOSE)
    assert dynbatch.counters()["grads_plain"] >= 1 and dynbatch.counters().get("fallbacks", 0) == 0


def test_hessian_rows_outside_the_compiled_model(first_call):
    model = make_model()
    compiled = torch.compile(model, backend="dynbatch")
    batch = make_batch(["CH3OH"])

    def hessian(m):
        inputs = fresh(batch)
        forces = m(inputs, training=True, compute_force=True)["forces"]
        pos = inputs["positions"]
        basis = torch.eye(pos.numel(), dtype=DTYPE).view(-1, *pos.shape)
        return torch.autograd.grad(forces, pos, basis, is_grads_batched=True)[0]

    torch.testing.assert_close(first_call(hessian, compiled), hessian(model), **CLOSE)
    assert sum(dynbatch.counters().get(k, 0) for k in ("outside_batched_saved", "outside_batched_compiled")) >= 1


def test_own_hessian_is_one_batched_graph(first_call):
    """``compute_hessian=True``: MACE maps its vjp with ``torch.vmap(..., chunk_size=1)``; the
    chunks are not unrolled (one grad per row): the mapped grad is one batched grad."""
    model = make_model()
    compiled = torch.compile(model, backend="dynbatch")
    batch = make_batch(["CH4", "H2O"])
    kwargs = {"training": False, "compute_force": True, "compute_hessian": True}
    got = first_call(compiled, fresh(batch), **kwargs)
    expected = model(fresh(batch), **kwargs)
    for key in ("energy", "forces", "hessian"):
        torch.testing.assert_close(got[key], expected[key], **CLOSE)
    counts = dynbatch.counters()
    # one graph: the forces, and the vmapped vjp as one batched grad over all 24 rows
    assert counts["graphs"] == 1 and counts["grads_plain"] == 1 and counts["grads_batched"] == 1, counts
    assert counts.get("fallbacks", 0) == 0, dynbatch.fallback_reasons()


def test_stress_of_a_periodic_cell(first_call):
    model = make_model()
    compiled = torch.compile(model, backend="dynbatch")
    batch = make_batch(["CH3OH", "H2O"], box=6.0)
    kwargs = {"training": False, "compute_force": True, "compute_stress": True}
    got = first_call(compiled, fresh(batch), **kwargs)
    expected = model(fresh(batch), **kwargs)
    for key in ("energy", "forces", "stress", "virials"):
        torch.testing.assert_close(got[key], expected[key], **CLOSE)
    assert dynbatch.counters()["graphs"] >= 1 and dynbatch.counters().get("fallbacks", 0) == 0


def test_bench_workload(tmp_path):
    """``python -m dynbatch.bench --workloads mace`` at its smallest size: eager and dynbatch
    run every call and agree.  The stock column (MACE's preparation, Inductor) is left out
    (``--variants dynbatch``): it compiles MACE's chunked Hessian one row at a time."""
    import json

    from dynbatch.bench import mace_workload
    from dynbatch.bench.__main__ import main

    assert main(["--quick", "--workloads", "mace", "--variants", "dynbatch", "--threads", "1",
                 "--out", str(tmp_path), "--no-progress"]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert [p["problem"] for p in results["mace"]] == ["mace/training_step", "mace/inference_forces",
                                                       "mace/calculator_forces", "mace/hessian"]
    for problem in results["mace"]:
        (case,) = problem["cases"]
        cells = case["variants"]
        assert set(cells) == set(mace_workload.COLUMNS) - {"stock_mace_prep"}
        for column in ("eager", "dynbatch"):
            cell = cells[column]
            assert cell["status"] == "ok", (problem["problem"], column, cell["status"])
            assert cell["median_s"] > 0 and cell["first_call_s"] > 0 and cell["cores_used"] < 1.5
        assert cells["dynbatch"]["max_abs_err"] <= 1e-8 * max(case["reference_max_abs"], 1.0), problem["problem"]


def test_sparse_hessian_of_a_batch_of_molecules_is_block_diagonal():
    """dynbatch.hessian of MACE's energy over a batch of four molecules: the pattern found
    in its aten graph couples atoms within a molecule only, so the colours are the largest
    molecule's coordinates (CH3OH: 18) and the values equal eager's."""
    model = make_model()
    batch = make_batch(("H2O", "CH4", "CH3OH", "H2O"))

    def energy(pos):
        return model({**batch, "positions": pos}, training=False, compute_force=False)["energy"].sum()

    pos = batch["positions"].detach().clone()
    got = dynbatch.hessian(energy, pos, options={"dynbatch.inner_compiler": "aot_eager"})
    torch.testing.assert_close(got, torch.autograd.functional.hessian(energy, pos), rtol=1e-10, atol=1e-12)
    c = dynbatch.counters()
    assert c["grads_compressed"] == 1 and c["colours"] == 18 and c["rows"] == pos.numel(), c
