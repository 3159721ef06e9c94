"""The ``mace`` workload: a real model (mace-torch) in the calls its users make.

A small MACE (2 interactions, hidden irreps 8x0e+8x1o, float64; built as MACE's own
compile helper builds it: e3nn's TorchScript code generation off, e3nn modules
simplified with ``torch.fx``) on a batch of small molecules from ase.  Problems, one per
call, each on that batch:

- ``training_step``: ``model(batch, training=True, compute_force=True)`` (forces with
  create_graph), loss ``sum((E - E_ref)^2) + mean((F - F_ref)^2)``, ``loss.backward()``;
  the result compared is the parameter grads, flattened;
- ``inference_forces``: ``model(batch, training=False, compute_force=True)``; the forces;
- ``calculator_forces``: the forces as MACE's ASE calculator takes them from a compiled
  model: parameters frozen, positions and node attributes requiring grad,
  ``training=True`` (``calculator_forces``);
- ``hessian``: ``compute_hessian=True`` as well (MACE's own ``torch.vmap`` of a vjp,
  ``chunk_size=1``); the Hessian.

Columns (``COLUMNS``): eager; stock ``torch.compile(model)`` (Inductor) after MACE's
own preparation, ``mace.tools.compile.configure_autograd_for_compile(True)``; and
``torch.compile(model, backend="dynbatch")`` with no preparation.  That preparation is
global (``allow_in_graph(torch.autograd.grad)``, ``trace_autograd_ops=True``), so the
stock column applies it around each of its own calls and undoes it after
(``stock.grad_traced_as_mace_does``): the other columns never see it.  Each compiled
column compiles a forward with a code object of its own (NOTE [A code object per
compiled column] in variants.py).

The columns run through training.py's ``run_problem`` (cells, first calls, interleaved
timing, cores used, errors against eager).  Without mace-torch every cell reads
"skipped: mace-torch is not installed ...".
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable

import torch
from torch import nn

from . import stock, training
from .variants import Runner, VariantUnavailable, with_own_forward

COLUMNS = ("eager", "stock_mace_prep", "dynbatch")
REFERENCE = "eager"
DESCRIPTIONS = {
    "eager": "MACE in eager PyTorch; the reference for ratios and errors",
    "stock_mace_prep": "torch.compile(model) (Inductor) after MACE's "
                       "mace.tools.compile.configure_autograd_for_compile(True), applied around this "
                       "column's calls only",
    "dynbatch": 'torch.compile(model, backend="dynbatch"), no preparation',
}
NOT_INSTALLED = "mace-torch is not installed (pip install -e '.[models]')"

# The molecules of the batch, per size tier.
_MOLECULES = {"quick": ("H2O", "CH4"), "cpu": ("CH3OH", "CH3CH2OH", "H2O"), "cuda": ("CH3OH", "CH3CH2OH", "H2O")}
DTYPE = torch.float64
Z_TABLE = (1, 6, 8)  # H, C, O
# call -> (model keyword arguments, what is compared with eager's).
_CALLS = {
    "training_step": ({"training": True, "compute_force": True}, "the parameter grads"),
    "inference_forces": ({"training": False, "compute_force": True}, "the forces"),
    "calculator_forces": ({"training": True, "compute_force": True},
                          "the forces, parameters frozen, positions and node attributes requiring grad"),
    "hessian": ({"training": False, "compute_force": True, "compute_hessian": True}, "the Hessian"),
}


@dataclasses.dataclass(frozen=True)
class Case:
    label: str
    batch: dict[str, Any] | None  # MACE's input dict; None where mace-torch is missing
    e_ref: torch.Tensor | None = None  # per molecule (training_step)
    f_ref: torch.Tensor | None = None  # per atom


@dataclasses.dataclass(frozen=True)
class Problem:
    name: str
    description: str
    call: str  # a key of _CALLS
    make_model: Callable[[], nn.Module]
    cases: tuple[Case, ...]


def _import_mace():
    """The mace modules, or VariantUnavailable.  ``mace`` first: it sets up e3nn's loading."""
    try:
        import mace  # noqa: F401
        import ase.build
        import numpy as np
        from e3nn import o3
        from mace import data, modules, tools
        from mace.tools import compile as mace_compile
        from mace.tools import torch_geometric
    except ImportError:
        raise VariantUnavailable(NOT_INSTALLED) from None
    return ase, np, o3, data, modules, tools, mace_compile, torch_geometric


def make_model(device: torch.device | str = "cpu", seed: int = 0) -> nn.Module:
    """A 2-interaction MACE over H, C, O (24,096 parameters, float64), built as MACE's own
    compile helper builds it; the bench's and tests/models/test_mace.py's model."""
    _, np, o3, _, modules, tools, mace_compile, _ = _import_mace()
    torch.manual_seed(seed)  # the same parameters in every column
    block = modules.interaction_classes["RealAgnosticResidualInteractionBlock"]
    with mace_compile.disable_e3nn_codegen():
        built = modules.ScaleShiftMACE(
            r_max=4.0, num_bessel=6, num_polynomial_cutoff=5, max_ell=2, interaction_cls=block,
            interaction_cls_first=block, num_interactions=2, num_elements=3,
            hidden_irreps=o3.Irreps("8x0e+8x1o"), MLP_irreps=o3.Irreps("8x0e"),
            atomic_energies=np.array([-1.0, -2.0, -3.0]), avg_num_neighbors=6.0,
            atomic_numbers=tools.AtomicNumberTable(Z_TABLE).zs, correlation=2, gate=torch.nn.functional.silu,
            atomic_inter_scale=1.0, atomic_inter_shift=0.0)
    return mace_compile.simplify(built).to(device=device, dtype=DTYPE)


def make_batch(names, device: torch.device | str = "cpu", *, seed: int = 0, box: float | None = None) -> dict[str, Any]:
    """The molecules from ase, shaken (seeded), as one MACE batch; in a periodic cubic
    box of side ``box`` if given."""
    ase, np, _, data, _, tools, _, torch_geometric = _import_mace()
    rng, z_table = np.random.default_rng(seed), tools.AtomicNumberTable(Z_TABLE)
    dataset = []
    for name in names:
        atoms = ase.build.molecule(name)
        atoms.positions += rng.normal(scale=0.05, size=atoms.positions.shape)
        if box is not None:
            atoms.set_cell([box, box, box])
            atoms.set_pbc(True)
            atoms.center()
        dataset.append(data.AtomicData.from_config(data.config_from_atoms(atoms), z_table=z_table, cutoff=4.0))
    loader = torch_geometric.dataloader.DataLoader(dataset, batch_size=len(dataset), shuffle=False)
    out = next(iter(loader)).to_dict()
    return {k: (v.to(device=device, dtype=DTYPE) if v.is_floating_point() else v.to(device))
            if torch.is_tensor(v) else v for k, v in out.items()}


def fresh(batch: dict[str, Any]) -> dict[str, Any]:
    """A copy of the batch with positions requiring grad, as MACE expects of a compiled
    model's caller (its prepare_graph skips it under torch.compile)."""
    copy = {k: v.clone() if torch.is_tensor(v) else v for k, v in batch.items()}
    copy["positions"].requires_grad_(True)
    return copy


def mace(tier: str, device: torch.device, atoms=None) -> list[Problem]:
    """The problems, one per call, on the tier's batch (``atoms`` is not used: the batch is molecules)."""
    names = _MOLECULES[tier]
    try:
        batch = make_batch(names, device)
        gen = torch.Generator().manual_seed(34)
        n_atoms = batch["positions"].shape[0]
        label = f"{'+'.join(names)} N={n_atoms} float64"
        case = Case(label, batch, torch.randn(len(names), generator=gen, dtype=DTYPE).to(device),
                    0.1 * torch.randn(n_atoms, 3, generator=gen, dtype=DTYPE).to(device))
    except VariantUnavailable:
        case = Case(f"{'+'.join(names)} float64", None)
    what = (f"a 2-interaction MACE (hidden irreps 8x0e+8x1o, 24,096 parameters, float64) on {'+'.join(names)}: "
            "model(batch, {}); compared: {}")
    return [Problem(name=f"mace/{call}", call=call, make_model=functools.partial(_model_for, call, device),
                    cases=(case,),
                    description=what.format(", ".join(f"{k}={v}" for k, v in kwargs.items()), compared)
                    + (", after loss = sum((E - E_ref)^2) + mean((F - F_ref)^2) and loss.backward()"
                       if call == "training_step" else ""))
            for call, (kwargs, compared) in _CALLS.items()]


def _model_for(call: str, device: torch.device) -> nn.Module:
    model = make_model(device)
    return model.requires_grad_(False) if call == "calculator_forces" else model  # as MACE's calculator


WORKLOADS = {"mace": mace}


# --- the columns ----------------------------------------------------------------

def mace_prep() -> contextlib.AbstractContextManager[None]:
    """MACE's preparation for torch.compile, undone on exit."""
    *_, mace_compile, _ = _import_mace()
    return stock.grad_traced_as_mace_does(functools.partial(mace_compile.configure_autograd_for_compile, True))


def _program(call: str, model: nn.Module, run: nn.Module) -> Callable[..., torch.Tensor]:
    """``call`` through ``run`` (the model, compiled or not); returns what is compared."""
    kwargs, _ = _CALLS[call]
    params = list(model.parameters())
    if call == "training_step":
        def step(batch, e_ref, f_ref):
            for p in params:
                p.grad = None
            out = run(fresh(batch), **kwargs)
            loss = ((out["energy"] - e_ref) ** 2).sum() + ((out["forces"] - f_ref) ** 2).mean()
            loss.backward()
            return torch.cat([p.grad.reshape(-1) for p in params])

        return step
    if call == "calculator_forces":
        return calculator_forces(run)
    key = "hessian" if call == "hessian" else "forces"
    return lambda batch, e_ref, f_ref: run(fresh(batch), **kwargs)[key].detach()


def calculator_forces(run: nn.Module) -> Callable[..., torch.Tensor]:
    """The forces as MACE's ``MACECalculator`` takes them from a compiled model: the model's
    parameters frozen (the caller's part: ``requires_grad_(False)``), positions and node
    attributes requiring grad, ``training=True`` (the forces with create_graph)."""

    def forces(batch, e_ref, f_ref):
        copy = fresh(batch)
        copy["node_attrs"].requires_grad_(True)
        return run(copy, training=True, compute_force=True)["forces"].detach()

    return forces


def build(column: str, problem: Problem, device: torch.device) -> Runner:
    """One column's runner: its own copy of the model, compiled lazily on the first call."""
    from .variants import _graph_counter  # noqa: PLC0415 - shared with the batched-grad columns

    _import_mace()
    model = problem.make_model()
    counts: Callable[[], int | None] = lambda: None
    if column == "eager":
        call = _program(problem.call, model, model)
    elif column == "dynbatch":
        counts = _graph_counter()
        call = _program(problem.call, model, torch.compile(with_own_forward(model), backend="dynbatch"))
    elif column == "stock_mace_prep":
        if problem.call == "hessian":
            # Dynamo traces torch.vmap's chunk loop in Python: one traced backward per row.
            raise VariantUnavailable(
                "not run: stock Dynamo unrolls MACE's torch.vmap(vjp, chunk_size=1) into one traced "
                "backward per Hessian row (3N of them), a compile that grows with the atoms")
        counts = _graph_counter()
        program = _program(problem.call, model, torch.compile(with_own_forward(model)))

        def call(*args):
            with mace_prep():
                return program(*args)
    else:
        raise KeyError(f"unknown column {column!r}; choose from {COLUMNS}")
    return Runner(variant=column, call=call, prepare=lambda case: (case.batch, case.e_ref, case.f_ref),
                  to_torch=lambda r: r, compiles=counts)


def run(workload: str, settings, bar) -> list[dict[str, Any]]:
    problems = WORKLOADS[workload](settings.tier, settings.device, settings.atoms)
    # The stock column runs when the run's columns include stock_compile (the default does).
    columns = tuple(c for c in COLUMNS if c != "stock_mace_prep" or "stock_compile" in settings.variants)
    bar.total += sum(len(p.cases) * len(columns) for p in problems)
    return [training.run_problem(p, columns, settings.device, settings.budget, settings.interleave, bar,
                                 build=build, workload=workload) for p in problems]

