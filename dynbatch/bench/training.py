"""The ``force_training`` workload: one training step of a machine-learned potential.

What every learned interatomic potential does: energy ``E = model(pos)``, forces
``F = -dE/dpos`` taken with ``create_graph=True``, a force-matching loss
``(E - E_ref)^2 + mean((F - F_ref)^2)`` and ``loss.backward()`` into the
model's parameters.  Unlike the batched-grad workloads (variants.py), the
columns here are the ways a user can compile that step:

- ``eager``: no compile (the reference of every ratio);
- ``stock_compile``: ``torch.compile(model)`` with Inductor, forces outside (it
  raises: AOTAutograd has no double backward; the cell records the error);
- ``stock_traced``: the honest peer: stock Inductor of the model that computes the
  forces in its forward, configured as MACE configures it for torch.compile
  (``allow_in_graph(torch.autograd.grad)``, ``trace_autograd_ops=True``, the caller
  sets ``pos.requires_grad_()``), that configuration applied around its own calls only;
- ``dynbatch_model_in``: the model computes the forces in its forward, after
  ``pos.requires_grad_(True)`` (the MACE / NequIP idiom), compiled by dynbatch;
- ``dynbatch_model_out``: the model returns E, compiled by dynbatch; the forces
  are taken outside with ``create_graph=True``;
- ``dynbatch_step``: the whole step, ``loss.backward()`` included, compiled by dynbatch;
- ``*_cudagraphs``: each dynbatch column with ``mode="reduce-overhead"`` (CUDA only);
- ``jax``: ``jit(grad(loss))`` with the forces by ``jax.grad`` inside the loss.

Each column returns the parameter grads, flattened, compared with eager's.  Two
models: a pair potential (an MLP of Gaussian features of every pair distance)
and a small message-passing network over a fixed neighbour list.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Any, Callable

import torch
from torch import nn

from . import measure, stock, variants
from .variants import Runner, VariantUnavailable
from .workloads import _lattice

COLUMNS = ("eager", "stock_compile", "stock_traced", "dynbatch_model_in", "dynbatch_model_out", "dynbatch_step",
           "dynbatch_model_in_cudagraphs", "dynbatch_model_out_cudagraphs", "dynbatch_step_cudagraphs", "jax")
# mode="reduce-overhead" of a dynbatch column: CUDA graphs replay its kernels.  On the
# CPU Inductor compiles that mode as the default one, so runs there leave them out.
CUDAGRAPHS = "_cudagraphs"
REDUCE_OVERHEAD = {"triton.cudagraphs": True}  # what mode="reduce-overhead" sets in Inductor
REFERENCE = "eager"
DESCRIPTIONS = {
    "eager": "the step in eager PyTorch; the reference for ratios",
    "stock_compile": "torch.compile(model) (Inductor), forces taken outside with create_graph=True",
    "stock_traced": "torch.compile(model) (Inductor) of the model that computes the forces in its forward, "
                    "configured as MACE configures it (allow_in_graph(torch.autograd.grad), "
                    "trace_autograd_ops=True, pos.requires_grad_() by the caller)",
    "dynbatch_model_in": 'torch.compile(model, backend="dynbatch") of a model whose forward calls '
                         "pos.requires_grad_(True) and returns E and F (create_graph=True)",
    "dynbatch_model_out": 'torch.compile(model, backend="dynbatch"); F = -grad(E, pos, create_graph=True) '
                          "outside the model",
    "dynbatch_step": 'torch.compile(step, backend="dynbatch") of the whole step, loss.backward() included',
    **{f"{column}{CUDAGRAPHS}": f'{column} with mode="reduce-overhead" (CUDA graphs; each step begins with '
                                "torch.compiler.cudagraph_mark_step_begin())"
       for column in ("dynbatch_model_in", "dynbatch_model_out", "dynbatch_step")},
    "jax": 'JAX jit(grad(loss)), forces by jax.grad inside the loss, jax_default_matmul_precision="highest"',
}

# Atom counts per tier: (pair potential, message passing); none: that model is left out (the
# quick tier: message passing compiles 3x as long; --atoms sizes both).
_SIZES = {"quick": ([8], []), "cpu": ([20, 64, 256], [64, 256]), "cuda": ([64, 256, 1024], [1024, 4096])}
_WIDTH, _RBF, _GAMMA = 32, 8, 4.0  # hidden width; Gaussian radial features exp(-gamma (r - c)^2)
_CUTOFF = 2.5  # message passing: neighbours within this distance (about 30 per atom on the lattice)


# --- the models ---------------------------------------------------------------

def _rbf(r: torch.Tensor, centres: torch.Tensor) -> torch.Tensor:
    return torch.exp(-_GAMMA * (r.unsqueeze(-1) - centres) ** 2)


def _envelope(r: torch.Tensor) -> torch.Tensor:
    """A smooth cutoff: 1 at r = 0, 0 (with its derivative) from the cutoff on, as in
    learned potentials; it keeps E a sum over near neighbours (O(N), not O(N^2))."""
    return 0.5 * (torch.cos(r.clamp(max=_CUTOFF) * (math.pi / _CUTOFF)) + 1)


class PairPotential(nn.Module):
    """E = sum over i < j of an MLP (8 -> 32 -> 32 -> 1, tanh) of Gaussian features of r_ij,
    times a smooth cutoff."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("centres", torch.linspace(0.8, 4.0, _RBF))
        self.mlp = nn.Sequential(nn.Linear(_RBF, _WIDTH), nn.Tanh(), nn.Linear(_WIDTH, _WIDTH), nn.Tanh(),
                                 nn.Linear(_WIDTH, 1))

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        n = pos.shape[0]
        diff = pos.unsqueeze(1) - pos.unsqueeze(0)
        # + eye keeps the diagonal's distance (and its derivative) finite; the mask drops it.
        r = ((diff * diff).sum(-1) + torch.eye(n, dtype=pos.dtype, device=pos.device)).sqrt()
        pair = self.mlp(_rbf(r, self.centres)).squeeze(-1) * _envelope(r)
        return (pair * torch.ones(n, n, dtype=pos.dtype, device=pos.device).triu(1)).sum()


class MessagePassing(nn.Module):
    """A SchNet-like network: two interactions over a fixed neighbour list, then a readout."""

    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.register_buffer("centres", torch.linspace(0.8, _CUTOFF, _RBF))
        self.embedding = nn.Parameter(torch.ones(_WIDTH))
        self.filters = nn.ModuleList(nn.Sequential(nn.Linear(_RBF, _WIDTH), nn.Tanh(), nn.Linear(_WIDTH, _WIDTH))
                                     for _ in range(layers))
        self.updates = nn.ModuleList(nn.Linear(_WIDTH, _WIDTH) for _ in range(layers))
        self.readout = nn.Sequential(nn.Linear(_WIDTH, _WIDTH), nn.Tanh(), nn.Linear(_WIDTH, 1))

    def forward(self, pos: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        diff = pos[dst] - pos[src]
        r = (diff * diff).sum(-1).sqrt()
        features = _rbf(r, self.centres) * _envelope(r).unsqueeze(-1)
        h = self.embedding.expand(pos.shape[0], _WIDTH)
        for filt, update in zip(self.filters, self.updates):
            messages = h[src] * filt(features)
            h = h + torch.tanh(update(torch.zeros_like(h).index_add(0, dst, messages)))
        return self.readout(h).sum()


class ForcesInForward(nn.Module):
    """The same model, computing the forces in its forward (the MACE / NequIP idiom)."""

    def __init__(self, potential: nn.Module) -> None:
        super().__init__()
        self.potential = potential

    def forward(self, pos: torch.Tensor, *graph: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos.requires_grad_(True)
        energy = self.potential(pos, *graph)
        return energy, -torch.autograd.grad(energy, pos, create_graph=True)[0]


def _jax_energy(kind: str, params: dict[str, Any]):
    import jax.numpy as jnp

    def rbf(r, centres):
        return jnp.exp(-_GAMMA * (r[..., None] - centres) ** 2)

    def envelope(r):
        return 0.5 * (jnp.cos(jnp.minimum(r, _CUTOFF) * (math.pi / _CUTOFF)) + 1)

    def linear(p, name, x):
        return x @ p[name + ".weight"].T + p[name + ".bias"]

    if kind == "pair":
        def energy(p, pos):
            n = pos.shape[0]
            diff = pos[:, None, :] - pos[None, :, :]
            r = jnp.sqrt((diff * diff).sum(-1) + jnp.eye(n, dtype=pos.dtype))
            h = jnp.tanh(linear(p, "mlp.0", rbf(r, params["centres"])))
            h = jnp.tanh(linear(p, "mlp.2", h))
            pair = linear(p, "mlp.4", h)[..., 0] * envelope(r)
            return (pair * jnp.triu(jnp.ones((n, n), pos.dtype), 1)).sum()

        return energy

    def energy(p, pos, src, dst):
        diff = pos[dst] - pos[src]
        r = jnp.sqrt((diff * diff).sum(-1))
        features = rbf(r, params["centres"]) * envelope(r)[:, None]
        h = jnp.broadcast_to(p["embedding"], (pos.shape[0], _WIDTH))
        for k in range(2):
            w = linear(p, f"filters.{k}.2", jnp.tanh(linear(p, f"filters.{k}.0", features)))
            messages = h[src] * w
            h = h + jnp.tanh(linear(p, f"updates.{k}", jnp.zeros_like(h).at[dst].add(messages)))
        return linear(p, "readout.2", jnp.tanh(linear(p, "readout.0", h))).sum()

    return energy


# --- problems -----------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Case:
    label: str
    inputs: tuple[torch.Tensor, ...]  # pos, then the neighbour list (message passing)
    e_ref: torch.Tensor
    f_ref: torch.Tensor


@dataclasses.dataclass(frozen=True)
class Problem:
    name: str
    description: str
    kind: str  # "pair" or "message_passing"
    make_model: Callable[[], nn.Module]
    cases: tuple[Case, ...]


def _neighbours(pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    close = torch.cdist(pos, pos) < _CUTOFF
    close.fill_diagonal_(False)
    src, dst = close.nonzero(as_tuple=True)
    return src, dst


def _model(cls: type[nn.Module], device) -> Callable[[], nn.Module]:
    def make():
        torch.manual_seed(0)  # the same parameters in every column
        return cls().to(device)

    return make


def force_training(tier: str, device, atoms=None) -> list[Problem]:
    pair_sizes, mp_sizes = _SIZES[tier]
    problems = []
    for kind, cls, sizes, what in (
            ("pair", PairPotential, atoms or pair_sizes,
             f"a pair potential (Gaussian features of r_ij -> tanh MLP {_RBF}-{_WIDTH}-{_WIDTH}-1, times a smooth "
             f"cutoff at {_CUTOFF}, summed over all i<j)"),
            ("message_passing", MessagePassing, atoms or mp_sizes,
             f"a message-passing network (2 interactions of width {_WIDTH} over neighbours within {_CUTOFF})")):
        if not sizes:
            continue
        cases = []
        for n in sizes:
            gen = torch.Generator().manual_seed(700 + n)
            pos = _lattice(n, gen)
            graph = _neighbours(pos) if kind == "message_passing" else ()
            e_ref = torch.randn((), generator=gen)
            f_ref = 0.1 * torch.randn(n, 3, generator=gen)
            label = f"N={n}" + (f" E={len(graph[0])}" if graph else "")
            cases.append(Case(label, tuple(t.to(device) for t in (pos, *graph)), e_ref.to(device), f_ref.to(device)))
        problems.append(Problem(
            name=f"force_training/{kind}", kind=kind, make_model=_model(cls, device), cases=tuple(cases),
            description=f"one force-matching training step of {what}: E, F = -dE/dpos (create_graph=True), "
                        "loss = (E - E_ref)^2 + mean((F - F_ref)^2), loss.backward()"))
    return problems


WORKLOADS = {"force_training": force_training}


# --- the columns ----------------------------------------------------------------

def _loss(energy, forces, e_ref, f_ref):
    return (energy - e_ref) ** 2 + ((forces - f_ref) ** 2).mean()


def _step_outside(model: nn.Module) -> Callable:
    def step(pos, *rest):
        *graph, e_ref, f_ref = rest
        pos = pos.detach().requires_grad_()
        energy = model(pos, *graph)
        forces = -torch.autograd.grad(energy, pos, create_graph=True)[0]
        loss = _loss(energy, forces, e_ref, f_ref)
        loss.backward()
        return loss.detach()

    return step


def _step_inside(model: nn.Module, caller_sets_requires_grad: bool = False) -> Callable:
    """``caller_sets_requires_grad``: the positions arrive requiring grad, as MACE's callers
    pass them to a compiled model (its own ``requires_grad_`` is skipped under torch.compile)."""
    def step(pos, *rest):
        *graph, e_ref, f_ref = rest
        pos = pos.detach().requires_grad_() if caller_sets_requires_grad else pos.detach()
        energy, forces = model(pos, *graph)
        loss = _loss(energy, forces, e_ref, f_ref)
        loss.backward()
        return loss.detach()

    return step


def _torch_runner(column: str, model: nn.Module, step: Callable, counts: Callable[[], int | None]) -> Runner:
    params = list(model.parameters())

    def call(*args):
        for p in params:
            p.grad = None
        step(*args)
        return torch.cat([p.grad.reshape(-1) for p in params])

    return Runner(variant=column, call=call, prepare=lambda case: (*case.inputs, case.e_ref, case.f_ref),
                  to_torch=lambda r: r, compiles=counts)


DYNBATCH_COLUMNS = ("dynbatch_model_in", "dynbatch_model_out", "dynbatch_step")


def build(column: str, problem: Problem, device: torch.device, options: dict[str, Any] | None = None,
          name: str | None = None, mode: str | None = None) -> Runner:
    """One column's runner: its own copy of the model, compiled lazily on the first call
    (the dynbatch columns with ``options``), each compiled function or module's forward
    with a code object of its own (NOTE [A code object per compiled column] in variants.py)."""
    from .variants import _graph_counter  # noqa: PLC0415 - shared with the batched-grad columns

    if column.endswith(CUDAGRAPHS):
        return variants.replayed_steps(build(column[:-len(CUDAGRAPHS)], problem, device, options,
                                             name or column, mode="reduce-overhead"))
    model = problem.make_model()
    name = name or column

    def compile_(fn, backend: str = "dynbatch"):
        fn = variants.with_own_forward(fn) if isinstance(fn, nn.Module) else variants.with_own_code(fn)
        if backend != "dynbatch":
            return torch.compile(fn, backend=backend)
        if mode is not None and options:
            # torch.compile takes mode= or options=, not both: the mode's Inductor setting as an option
            return torch.compile(fn, backend=backend, options={**options, **REDUCE_OVERHEAD})
        return torch.compile(fn, backend=backend, options=options, mode=mode)

    if column == "eager":
        return _torch_runner(name, model, _step_outside(model), lambda: None)
    if column == "stock_compile":
        return _torch_runner(name, model, _step_outside(compile_(model, "inductor")), _graph_counter())
    if column == "stock_traced":
        step = _step_inside(compile_(ForcesInForward(model), "inductor"), caller_sets_requires_grad=True)

        def traced(*args):
            with stock.grad_traced_as_mace_does():
                return step(*args)

        return _torch_runner(name, model, traced, _graph_counter())
    if column == "dynbatch_model_in":
        return _torch_runner(name, model, _step_inside(compile_(ForcesInForward(model))), _graph_counter())
    if column == "dynbatch_model_out":
        return _torch_runner(name, model, _step_outside(compile_(model)), _graph_counter())
    if column == "dynbatch_step":
        return _torch_runner(name, model, compile_(_step_outside(model)), _graph_counter())
    if column == "jax":
        return _jax_runner(problem, model, device)
    raise KeyError(f"unknown column {column!r}; choose from {COLUMNS}")


def _jax_runner(problem: Problem, model: nn.Module, device: torch.device) -> Runner:
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    try:
        import jax
        import jax.numpy as jnp
        import numpy as np
    except ImportError as e:
        raise VariantUnavailable(f"jax not installed ({e.name}); pip install 'dynbatch[jax]'") from None
    from .variants import _jax_devices  # noqa: PLC0415 - one core for XLA as for the batched columns

    platform = "gpu" if device.type == "cuda" else "cpu"
    jax_device = _jax_devices(jax, platform, one_core=platform == "cpu" and torch.get_num_threads() == 1)[0]
    jax.config.update("jax_default_matmul_precision", "highest")
    names = [name for name, _ in model.named_parameters()]

    def put(t: torch.Tensor):
        return jax.device_put(t.detach().cpu().numpy(), jax_device)

    params = {name: put(p) for name, p in model.named_parameters()}
    energy = _jax_energy(problem.kind, {"centres": put(model.centres)})

    def loss(p, pos, *rest):
        *graph, e_ref, f_ref = rest
        e, de = jax.value_and_grad(energy, argnums=1)(p, pos, *graph)
        return (e - e_ref) ** 2 + ((-de - f_ref) ** 2).mean()

    @jax.jit
    def step(p, *args):
        grads = jax.grad(loss)(p, *args)
        return jnp.concatenate([grads[name].reshape(-1) for name in names])

    return Runner(
        variant="jax", call=lambda *args: step(params, *args).block_until_ready(),
        prepare=lambda case: tuple(put(t) for t in (*case.inputs, case.e_ref, case.f_ref)),
        to_torch=lambda r: torch.from_numpy(np.asarray(r)).to(device),
        compiles=lambda: step._cache_size(), note=f"jax {jax.__version__} on {jax_device}", torch_tensors=False)


# --- running a problem ------------------------------------------------------------

def run_problem(problem: Problem, columns: tuple[str, ...], device: torch.device, budget: measure.Budget,
                interleave: bool, bar, build: Callable[..., Runner] = build,
                workload: str = "force_training") -> dict[str, Any]:
    """Every column on every case, eager first (the values the others are checked against);
    then the steady-state times, interleaved per case.  ``build(column, problem, device)``
    makes a column's runner (another workload with columns of its own passes its own:
    mace_workload.py)."""
    torch._dynamo.reset()
    cases = [{"label": c.label, "variants": {}} for c in problem.cases]
    out = {"workload": workload, "problem": problem.name, "description": problem.description,
           "cases": cases, "graphs": {}, "notes": {}}
    references: list[torch.Tensor | None] = [None] * len(cases)
    calls: list[dict[str, Callable[[], Any]]] = [{} for _ in cases]
    for column in columns:
        bar.set_description(f"{problem.name}: {column}")
        try:
            runner = build(column, problem, device)
        except VariantUnavailable as e:
            for record in cases:
                record["variants"][column] = {"status": f"skipped: {e}"}
            bar.update(len(cases))
            continue
        for i, (case, record) in enumerate(zip(problem.cases, cases)):
            call = functools.partial(runner.call, *runner.prepare(case))
            try:
                cell, result = measure.measure_cell(call, device, budget, runner.to_torch, references[i],
                                                    runner.torch_tensors, steady=not interleave)
                if column == REFERENCE:
                    references[i], cell["max_abs_err"] = result, 0.0
                    record["reference_max_abs"] = result.abs().max().item()
            except Exception as e:  # noqa: BLE001 - a failing column is a result (stock_compile's is the point)
                cell = {"status": f"crashed: {measure.short_error(e)}"}
            record["variants"][column] = cell
            if interleave and cell["status"] == "ok":
                calls[i][column] = call
            bar.update(1)
        out["graphs"][column] = runner.compiles()
        if runner.note:
            out["notes"][column] = runner.note
    if interleave:
        sync = measure.synchronizer(device)
        for record, case_calls in zip(cases, calls):
            bar.set_description(f"{problem.name} {record['label']}: interleaved timing")
            for name, figures in measure.interleaved_times(case_calls, sync, budget).items():
                record["variants"][name].update(measure.summarize(figures["times_s"]), **figures,
                                                timing="interleaved")
    return out


def run(workload: str, settings, bar) -> list[dict[str, Any]]:
    problems = WORKLOADS[workload](settings.tier, settings.device, settings.atoms)
    # The stock columns run when the run's columns include stock_compile, jax when they
    # include it (the default does both).
    stock_ = {"stock_compile": "stock_compile", "stock_traced": "stock_compile", "jax": "jax"}
    columns = tuple(c for c in COLUMNS if (c not in stock_ or stock_[c] in settings.variants)
                    and (settings.device.type == "cuda" or not c.endswith(CUDAGRAPHS)))
    bar.total += sum(len(p.cases) * len(columns) for p in problems)
    return [run_problem(p, columns, settings.device, settings.budget, settings.interleave, bar) for p in problems]
