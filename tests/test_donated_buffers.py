"""retain_graph and create_graph through graphs dynbatch compiles (issue 60, item 4).

dynbatch compiles every graph with AOTAutograd's ``donated_buffer=False``, yet
AOTAutograd's backward refused ``retain_graph``/``create_graph`` ("This backward
function was compiled with non-empty donated buffers") wherever the global flag was
on at backward time and its record of the graph's donated buffers was still unset:
a backward compiled eagerly (symbolic sizes) or first run without retain_graph.  From
torch 2.13 that backward reads the flag in the context the running backward copied
when it started, so turning it off inside the region's backward did not reach it.
The pattern is TorchANI's Hessian: forces by ``create_graph=True``, then one grad per
force component with ``retain_graph=True``.  Every test compares with eager PyTorch.
"""

from __future__ import annotations

import pytest
import torch

import dynbatch
from conftest import AOT_EAGER, INDUCTOR, assert_backend_ran, assert_same_grads, compile_dynbatch

grad = torch.autograd.grad


def energy_model() -> torch.nn.Module:
    """Energies of C molecules of A atoms from their coordinates [C, A, 3] (float32, as
    TorchANI's models run)."""
    torch.manual_seed(0)

    class Energy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.atomic = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.CELU(0.1), torch.nn.Linear(16, 1))

        def forward(self, coordinates):
            d2 = (coordinates[:, :, None, :] - coordinates[:, None, :, :]).pow(2).sum(-1)
            return self.atomic(torch.exp(-d2)[..., :6]).sum((1, 2))

    return Energy()


def hessians(energies, coordinates):
    """torchani.grad.forces_and_hessians (TorchANI 2.9): the last component's grad frees the graph."""
    forces = -grad([energies.sum()], [coordinates], retain_graph=True, create_graph=True)[0]
    components = forces.view(forces.shape[0], -1).unbind(1)
    rows = [grad([c.sum()], [coordinates], retain_graph=True if j < len(components) - 1 else None)[0]
            for j, c in enumerate(components)]
    return -torch.stack([r.view(forces.shape[0], -1) for r in rows], 1)


def coordinates():
    torch.manual_seed(1)
    return torch.randn(1, 12, 3, requires_grad=True)


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("options", [AOT_EAGER, INDUCTOR], ids=["aot_eager", "inductor"])
def test_retain_graph_after_a_plain_backward(options, dynamic):
    # The first call's backward frees its graph (AOTAutograd's lazy backward compile then
    # left the donated buffers unset); the later ones retain it, where the region returns
    # AOTAutograd's own node (NOTE [AOTAutograd's node in the caller's graph]).
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    m = compile_dynbatch(model, options=options, dynamic=dynamic)
    x = torch.randn(5, 3, requires_grad=True)
    want = grad(model(x).sum(), x)
    assert_same_grads(grad(m(x).sum(), x), want, msg="plain")
    for call in range(2):
        y = m(x).sum()
        assert_same_grads(grad(y, x, retain_graph=True), want, msg=f"call {call}, retained")
        assert_same_grads(grad(y, x), want, msg=f"call {call}, again")
    assert_backend_ran()


def test_hessian_around_a_compiled_model():
    # Symbolic sizes: AOTAutograd compiles the backward eagerly.  The first call gave
    # eager's Hessian, the second raised.
    model = energy_model()
    m = compile_dynbatch(model, dynamic=True)
    x = coordinates()
    want = hessians(model(x), x)
    for call in range(3):
        torch.testing.assert_close(hessians(m(x), x), want, msg=lambda s, call=call: f"call {call}: {s}")
    counters = dynbatch.counters()
    assert counters.get("fallbacks", 0) == 0 and counters["graphs"] >= 1, counters
    assert counters.get("outside_plain", 0) > 0, counters


def test_hessian_inside_a_compiled_function():
    # The energies' graph breaks before the grads (as TorchANI's model does), so they run
    # eagerly over the region; this raised on the first call.
    model = energy_model()

    def energies_and_hessians(x):
        energies = model(x)
        torch._dynamo.graph_break()
        return energies, hessians(energies, x)

    f = compile_dynbatch(energies_and_hessians, dynamic=True, fullgraph=False)
    x = coordinates()
    want = energies_and_hessians(x)
    for call in range(2):
        assert_same_grads(f(x), want, msg=f"call {call}")
    counters = dynbatch.counters()
    assert counters.get("fallbacks", 0) == 0 and counters["graphs"] >= 2, counters
    assert counters.get("outside_plain", 0) > 0, counters
