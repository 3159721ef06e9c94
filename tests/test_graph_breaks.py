"""A compiled training step that graph-breaks: every leaf gets eager's grad.

With ``trace_autograd_ops`` on, Dynamo traces ``loss.backward()`` into accumulations
into the leaves *its frame* knows; where the loss's history runs through another
frame's graph (a break in the model, or between the forward and ``backward()``) the
other frame's leaves got nothing, silently (NOTE [A backward across frames] in
dynbatch/capture/grad_calls.py).  Each case compares every parameter's and input's ``.grad`` with
the same eager step, over the kinds of break users meet and every place one can fall,
plain and with forces; each asserts that dynbatch compiled the frames.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch

import dynbatch
from conftest import INDUCTOR, compile_dynbatch
from helpers_reliability import graph_breaks


def _break_by_call(t):
    torch._dynamo.graph_break()


def _break_by_print(t):
    print(t, file=io.StringIO())


def _break_by_item(t):
    return t.sum().item()


def _break_by_nonzero(t):
    return (t > 0).nonzero()


BREAKS = {"graph_break": _break_by_call, "print": _break_by_print, "item": _break_by_item,
          "nonzero": _break_by_nonzero}
PLACES = ("before_model", "inside_model", "before_grad", "before_backward", "after_backward")


class Model(torch.nn.Module):
    def __init__(self, brk=None) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(3, 16)
        self.out = torch.nn.Linear(16, 1)
        self.brk = brk

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        if self.brk is not None:
            self.brk(h)
        return self.out(h).sum()


def training_step(model: Model, brk, place: str, forces: bool):
    """A step as users write it: forward (with forces, F = -dE/dx with create_graph), a
    loss, ``loss.backward()``; ``brk`` graph-breaks at ``place``.  The positions ``x`` and
    ``scale`` are inputs that require grad, so the step's input grads are checked too."""
    def at(where, t):
        if place == where:
            brk(t)

    def step(x, scale):
        at("before_model", x)
        if forces:
            energy = model(x) * scale
            at("before_grad", energy)
            f = -torch.autograd.grad(energy, x, create_graph=True)[0]
            loss = energy ** 2 + (f ** 2).sum()
        else:
            loss = (model(x) * scale) ** 2
        at("before_backward", loss)
        loss.backward()
        at("after_backward", loss)
        return loss.detach()

    return step


def _leaves(model, x, scale):
    return [*model.parameters(), x, scale]


def _run_both(brk_name: str, place: str, forces: bool, options=None):
    brk = BREAKS[brk_name]
    torch.manual_seed(0)
    eager_model = Model(brk if place == "inside_model" else None).double()
    model = copy.deepcopy(eager_model)
    eager_x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    eager_scale = torch.tensor(1.5, dtype=torch.float64, requires_grad=True)
    x, scale = (t.detach().clone().requires_grad_() for t in (eager_x, eager_scale))

    expected = training_step(eager_model, brk, place, forces)(eager_x, eager_scale)
    compiled = compile_dynbatch(training_step(model, brk, place, forces), options=options, fullgraph=False)
    for _ in range(2):  # the second call runs what the first compiled
        for leaf in _leaves(model, x, scale):
            leaf.grad = None
        loss = compiled(x, scale)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=0)
    for i, (got, want) in enumerate(zip(_leaves(model, x, scale), _leaves(eager_model, eager_x, eager_scale))):
        assert got.grad is not None, f"leaf {i} ({tuple(got.shape)}) has no grad"
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-9, atol=1e-12, msg=lambda m, i=i: f"leaf {i}: {m}")
    c = dynbatch.counters()
    assert c.get("graphs", 0) >= 1 and c.get("fallbacks", 0) == 0, c
    assert graph_breaks() > 0


CASES = [(b, p, f) for b in BREAKS for f in (False, True) for p in PLACES if f or p != "before_grad"]


@pytest.mark.parametrize("brk,place,forces", CASES, ids=[f"{b}-{p}-{'forces' if f else 'plain'}" for b, p, f in CASES])
def test_every_leaf_gets_eagers_grad_across_a_break(brk, place, forces):
    _run_both(brk, place, forces)


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("forces", [False, True], ids=["plain", "forces"])
def test_every_leaf_gets_eagers_grad_across_a_break_under_inductor(place, forces):
    if place == "before_grad" and not forces:
        pytest.skip(reason="a plain step takes no grad before its backward")
    _run_both("graph_break", place, forces, options=INDUCTOR)


@pytest.mark.slow
@pytest.mark.parametrize("brk,place,forces", CASES, ids=[f"{b}-{p}-{'forces' if f else 'plain'}" for b, p, f in CASES])
def test_every_leaf_gets_eagers_grad_across_a_break_under_inductor_every_kind(brk, place, forces):
    _run_both(brk, place, forces, options=INDUCTOR)


def test_the_issues_reproduction():
    """Two linears, a break before backward(): stock's grads, not None."""
    torch.manual_seed(0)
    lin1, lin2 = torch.nn.Linear(3, 16), torch.nn.Linear(16, 1)
    params = (*lin1.parameters(), *lin2.parameters())

    def step(x):
        loss = lin2(torch.tanh(lin1(x))).sum() ** 2
        torch._dynamo.graph_break()
        loss.backward()
        return loss.detach()

    x = torch.randn(5, 3)
    step(x)
    expected = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    torch.compile(step, backend="dynbatch")(x)
    for got, want in zip(params, expected):
        assert got.grad is not None
        torch.testing.assert_close(got.grad, want)
    assert dynbatch.counters()["outside_plain"] == 1  # the region's backward answered it


def test_a_step_without_a_break_keeps_its_backward_in_the_graph():
    """The fix breaks only where the loss's history leaves the frame: a step compiled
    whole is still one graph, its backward inside, and a repeat compiles nothing."""
    torch.manual_seed(0)
    model = Model().double()
    eager = copy.deepcopy(model)
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    step = training_step(model, None, "", forces=True)
    compiled = compile_dynbatch(step, fullgraph=True)
    for _ in range(2):
        for leaf in (*model.parameters(), x):
            leaf.grad = None
        compiled(x, torch.tensor(1.5, dtype=torch.float64))
    training_step(eager, None, "", forces=True)(x, torch.tensor(1.5, dtype=torch.float64))
    for got, want in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-9, atol=1e-12)
    c = dynbatch.counters()
    assert c["graphs"] == 1 and c.get("outside_plain", 0) == 0, c
    assert graph_breaks() == 0


def test_fullgraph_refuses_a_backward_through_another_frame():
    """Under fullgraph=True the break is Dynamo's error, as stock's for backward()."""
    lin = torch.nn.Linear(3, 1)
    h = lin(torch.randn(4, 3))  # history made outside the frame

    def step(h):
        h.sum().backward()
        return h.detach()

    with pytest.raises(torch._dynamo.exc.Unsupported, match="another frame's graph"):
        compile_dynbatch(step, fullgraph=True)(h)


def _force_step_that_sets_requires_grad(model: Model, brk, place: str):
    """A force step as force fields write it: the positions come in without
    requires_grad and the step calls ``pos.requires_grad_()`` itself, right before
    the break when ``place`` is "before_model" (or the model breaks first thing)."""
    def step(pos):
        pos.requires_grad_()
        if place == "before_model":
            brk(pos)
        energy = model(pos)
        if place == "before_grad":
            brk(energy)
        f = -torch.autograd.grad(energy, pos, create_graph=True)[0]
        loss = energy ** 2 + (f ** 2).sum()
        if place == "before_backward":
            brk(loss)
        loss.backward()
        return loss.detach()

    return step


@pytest.mark.parametrize("brk", ["graph_break", "item"])
@pytest.mark.parametrize("place", ["before_model", "inside_model", "before_grad", "before_backward"])
def test_requires_grad_set_in_the_step_survives_a_break(brk, place):
    """``pos.requires_grad_()`` followed by a break leaves a graph with no op, which
    Dynamo hands no backend: the traced requires_grad_() was lost and the force grad
    after the break raised "does not require grad" where eager works."""
    torch.manual_seed(0)
    eager_model = Model(BREAKS[brk] if place == "inside_model" else None).double()
    model = copy.deepcopy(eager_model)
    pos = torch.randn(5, 3, dtype=torch.float64)
    expected = _force_step_that_sets_requires_grad(eager_model, BREAKS[brk], place)(eager_pos := pos.clone())
    compiled = compile_dynbatch(_force_step_that_sets_requires_grad(model, BREAKS[brk], place), fullgraph=False)
    for _ in range(2):
        for p in model.parameters():
            p.grad = None
        got_pos = pos.clone()
        loss = compiled(got_pos)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=0)
    assert got_pos.requires_grad
    torch.testing.assert_close(got_pos.grad, eager_pos.grad, rtol=1e-9, atol=1e-12)
    for got, want in zip(model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-9, atol=1e-12)
    c = dynbatch.counters()
    assert c.get("graphs", 0) >= 1 and c.get("fallbacks", 0) == 0, c
    assert graph_breaks() > 0
