"""Training through a compiled model with forces (issue 23; dynbatch/region/edge.py).

The pattern of machine-learned potentials: ``model = torch.compile(model)``, the
forces ``F = -dE/dpos`` taken with ``create_graph=True`` -- outside the model, or
inside its forward after ``pos.requires_grad_(True)`` -- a loss of E and F, and
``loss.backward()`` into parameters that require grad.  Every test compares with
the same eager program and asserts, through dynbatch's counters, that the
compiled paths ran (NOTE [Region backward], NOTE [Compiled create_graph],
NOTE [Forces at forward time]) and that nothing ran eagerly.
"""

from __future__ import annotations

import re

import pytest
import torch

import dynbatch
from conftest import AOT_EAGER, INDUCTOR, assert_same_grads, compile_dynbatch

grad = torch.autograd.grad


class PairPotential(torch.nn.Module):
    """E = sum over atom pairs of an MLP of the distance (a learned pair potential)."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.inner = torch.nn.Sequential(torch.nn.Linear(1, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))

    def energy(self, pos: torch.Tensor) -> torch.Tensor:
        d = pos[:, None, :] - pos[None, :, :]
        r = ((d * d).sum(-1) + 1).sqrt()  # + 1: smooth at r = 0 (the diagonal)
        return self.inner(r.unsqueeze(-1)).sum()

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        return self.energy(pos)


class ForcesInForward(PairPotential):
    """The MACE / NequIP idiom: forces computed in the forward."""

    def forward(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos.requires_grad_(True)
        energy = self.energy(pos)
        return energy, -grad(energy, pos, create_graph=self.training)[0]


class ForcesByAttribute(PairPotential):
    def forward(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos.requires_grad = True
        energy = self.energy(pos)
        return energy, -grad(energy, pos, create_graph=self.training)[0]


class ForcesInEvaluation(PairPotential):
    """Evaluation of a force model: grad mode on inside, the caller under no_grad."""

    def forward(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.enable_grad():
            pos.requires_grad_(True)
            energy = self.energy(pos)
            forces = -grad(energy, pos)[0]
        return energy.detach(), forces


def models(cls, dtype=torch.float64):
    torch.manual_seed(0)
    eager = cls().to(dtype)
    twin = cls().to(dtype)
    twin.load_state_dict(eager.state_dict())
    return eager, twin


def positions(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, generator=g, dtype=torch.float64)


def loss_of(energy, forces, n):
    g = torch.Generator().manual_seed(n)
    f_ref = torch.randn(n, 3, generator=g, dtype=torch.float64)
    return (energy - 0.5) ** 2 + ((forces - f_ref) ** 2).mean()


def outside_step(model, pos):
    """Forces taken outside the model; returns the parameter grads and pos.grad."""
    model.zero_grad()
    pos = pos.clone().requires_grad_()
    energy = model(pos)
    forces = -grad(energy, pos, create_graph=True)[0]
    loss_of(energy, forces, len(pos)).backward()
    return [p.grad.clone() for p in model.parameters()], pos.grad


def inside_step(model, pos):
    model.zero_grad()
    pos = pos.clone()
    energy, forces = model(pos)
    assert pos.requires_grad, "requires_grad_() in the forward must reach the caller's tensor, as in eager"
    loss_of(energy, forces, len(pos)).backward()
    return [p.grad.clone() for p in model.parameters()], pos.grad


def paths() -> dict[str, int]:
    return {k: v for k, v in dynbatch.counters().items() if k.startswith("outside_") or k == "eager_calls"}


# Under Inductor: a minute of compiles (five graphs, two sizes), behind the slow marker.
@pytest.mark.parametrize("options", [pytest.param(AOT_EAGER, id="aot_eager"),
                                     pytest.param(INDUCTOR, id="inductor", marks=pytest.mark.slow)])
def test_forces_outside_a_compiled_model_train_compiled(options):
    eager, twin = models(PairPotential)
    compiled = compile_dynbatch(twin, options=options)
    for step, n in enumerate((5, 5, 5, 7)):
        pos = positions(n, seed=step)
        got, want = outside_step(compiled, pos), outside_step(eager, pos)
        assert_same_grads(tuple(got[0]), tuple(want[0]), msg=f"step {step}: parameter grads")
        assert_same_grads(got[1], want[1], msg=f"step {step}: pos.grad")
    c = paths()
    # The first create_graph backward runs the forward that returns the forces' grads with
    # E, and every later forward is that program (NOTE [Forces at forward time]).
    assert c.get("outside_grads_at_forward", 0) == 4 and c.get("outside_vjp_compiled", 0) == 0, c
    assert c.get("outside_eager", 0) == 0, c


def test_forces_at_forward_time_give_way_to_other_grads():
    # A region that learned to return E's grads w.r.t. pos is then asked for other grads
    # (w.r.t. the parameters, a cotangent that is not 1, a plain backward): eager's values.
    eager, twin = models(PairPotential)
    compiled = compile_dynbatch(twin)
    pos = positions(5)
    outside_step(compiled, pos)
    outside_step(compiled, pos)  # now the forward computes the forces
    for wrt in ("params", "scaled", "plain"):
        x, xe = pos.clone().requires_grad_(), pos.clone().requires_grad_()
        e, ee = compiled(x), eager(xe)
        if wrt == "params":
            got = grad(e, list(twin.parameters()), create_graph=True)
            want = grad(ee, list(eager.parameters()), create_graph=True)
        elif wrt == "scaled":
            got = grad(3 * e, x, create_graph=True)
            want = grad(3 * ee, xe, create_graph=True)
            got, want = grad(got[0].sum(), x), grad(want[0].sum(), xe)
        else:
            got, want = grad(e, x), grad(ee, xe)
        assert_same_grads(got, want, msg=wrt)
    assert paths().get("outside_eager", 0) == 0, paths()


def test_third_order_through_a_compiled_model_runs_compiled():
    eager, twin = models(PairPotential)
    compiled = compile_dynbatch(twin)

    def third(model, pos):
        pos = pos.clone().requires_grad_()
        (g1,) = grad(model(pos), pos, create_graph=True)
        (g2,) = grad(g1.pow(2).sum(), pos, create_graph=True)
        return grad(g2.sum(), [pos, *model.parameters()], allow_unused=True)

    pos = positions(4)
    assert_same_grads(third(compiled, pos), third(eager, pos))
    c = paths()
    # The first order from the forward that returns the grads, the second its compiled vjp.
    assert c.get("outside_grads_at_forward", 0) == 1 and c.get("outside_vjp_compiled", 0) == 1, c
    assert c.get("outside_eager", 0) == 0, c


def test_maces_vmap_hessian_over_a_compiled_models_forces_runs_compiled():
    """MACE's Hessian idiom, ``torch.vmap`` over a vjp of the forces, around a compiled
    model: the backward leaves the vmap and runs a batched program (B symbolic), not the
    eager re-run."""
    eager, twin = models(PairPotential)
    compiled = compile_dynbatch(twin)

    def hessian(model, pos):
        pos = pos.clone().requires_grad_()
        forces = -grad(model(pos), pos, create_graph=True)[0]
        basis = torch.eye(pos.numel(), dtype=pos.dtype).reshape(-1, *pos.shape)
        return torch.vmap(lambda v: grad(-forces, pos, v, retain_graph=True)[0])(basis)

    for call in range(4):
        pos = positions(5, seed=call)
        assert_same_grads(hessian(compiled, pos), hessian(eager, pos), msg=f"call {call}")
        if call == 0:
            first = {k: v for k, v in dynbatch.counters().items() if not k.startswith("outside_")}
    c = paths()
    assert c.get("outside_eager", 0) == 0, c
    # One path from the first call on: the forward that returns the forces, the saved
    # activations' batched backward; the later calls compile nothing.
    assert c.get("outside_grads_at_forward") == 4 and c.get("outside_batched_saved") == 4, c
    assert {k: v for k, v in dynbatch.counters().items() if not k.startswith("outside_")} == first


@pytest.mark.parametrize("cls", [ForcesInForward, ForcesByAttribute], ids=["requires_grad_", "attribute"])
def test_requires_grad_of_an_input_inside_the_forward_is_one_graph(cls):
    eager, twin = models(cls)
    compiled = compile_dynbatch(twin)  # fullgraph=True: a graph break raises
    for n in (5, 5, 7, 9):
        pos = positions(n)
        got, want = inside_step(compiled, pos), inside_step(eager, pos)
        assert_same_grads(tuple(got[0]), tuple(want[0]), msg=f"N={n}: parameter grads")
        assert_same_grads(got[1], want[1], msg=f"N={n}: pos.grad")
    c = dynbatch.counters()
    assert c.get("graphs") == 2 and c.get("fallbacks", 0) == 0, c  # static, then N symbolic
    assert c.get("outside_plain", 0) == 4 and c.get("outside_eager", 0) == 0, c


def test_forces_in_evaluation_under_no_grad():
    eager, twin = models(ForcesInEvaluation)
    compiled = compile_dynbatch(twin)
    for n in (5, 8):
        pos, pos_eager = positions(n), positions(n)
        with torch.no_grad():
            got, want = compiled(pos), eager(pos_eager)
        assert_same_grads(got, want)
        assert pos.requires_grad and not got[1].requires_grad
    assert dynbatch.counters().get("graphs") == 2, dynbatch.counters()


def test_requires_grad_of_an_input_keeps_eager_errors():
    # An integer input cannot require grad: eager's error, not a traced graph.
    def f(x):
        x.requires_grad_(True)
        return x * 2

    with pytest.raises(RuntimeError) as want:
        f(torch.arange(3))
    with pytest.raises(Exception) as got:
        compile_dynbatch(f, fullgraph=False)(torch.arange(3))
    assert str(want.value) in str(got.value)


def test_batched_jacobian_of_a_module_computes_no_parameter_grads():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()
    compiled = compile_dynbatch(model, fullgraph=False)
    x = torch.randn(2, 4, dtype=torch.float64)
    got = torch.autograd.functional.jacobian(compiled, x, vectorize=True)
    assert_same_grads(got, torch.autograd.functional.jacobian(model, x, vectorize=True))
    assert paths() == {"outside_batched_saved": 1}, paths()
    # The batched backward (AOTAutograd's, over the saved activations) returns x's grad
    # alone: one grad of [B, 2, 4], B symbolic.
    (program,) = [r for r in dynbatch.compile_records() if r.saved_backward]
    returned = program.aten_graphs[-1].splitlines()[-1]
    (out,) = re.findall(r"%\w+", returned)
    assert re.search(rf"{out}: f64\[s\d+, 2, 4\] =", program.aten_graphs[-1]), program.aten_graphs[-1]
