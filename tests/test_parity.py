"""The construct corpus: what real models write, at every place users take grads, against eager.

Each case builds a small float64 potential whose middle is one construct real models use
(custom ``autograd.Function``s of each kind, a ``torch.library`` op with autograd, tensor
hooks, ``no_grad`` and ``inference_mode`` parts, ``detach``, checkpoint, a buffer written
in place, ``.item()`` and ``nonzero()`` graph breaks, ``requires_grad_`` on inputs and
intermediates, dict inputs), and takes grads of it at one call site: around a compiled
model (plain, ``create_graph``, ``is_grads_batched``, ``functional.hessian/jacobian``,
``torch.vmap`` over a grad, ``backward()``) or inside one compiled function.  Everything a
user can observe is compared with eager (``observe``): values, which results are
differentiable, each input's ``requires_grad`` after the call, the leaves' ``.grad``, the
buffers, and the exception where eager raises (its type and first line).

The default run takes every construct at the sites where constructs broke (create_graph,
batched Hessians, training, around and inside) and every site on a few constructs; ``-m
slow`` runs the full cross product, and the same cases under stock ``torch.compile``
(``aot_eager``) to tell a divergence stock shares from one of dynbatch's.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import pathlib
import subprocess
import sys
import textwrap
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint
from conftest import AOT_EAGER, FALLBACK

import dynbatch

DTYPE = torch.float64
N_ATOMS, WIDTH = 4, 6


# --- constructs: h -> h, in the middle of a potential ---------------------------------

class Square(torch.autograd.Function):
    """Saves its input; the backward is written in differentiable ops."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


class Cube(torch.autograd.Function):
    """``setup_context``, saving its input and output."""

    @staticmethod
    def forward(x):
        return x ** 3

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0], output)

    @staticmethod
    def backward(ctx, g):
        x, y = ctx.saved_tensors
        return (3 * x * x + 0 * y) * g


class SinWithVmapRule(torch.autograd.Function):
    """``setup_context`` with ``generate_vmap_rule``."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return torch.sin(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * torch.cos(x)


class ScaleWithVmap(torch.autograd.Function):
    """A ``vmap`` staticmethod, a float kept on ``ctx``."""

    @staticmethod
    def forward(x, scale):
        return x * scale

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.scale = inputs[1]

    @staticmethod
    def backward(ctx, g):
        return g * ctx.scale, None

    @staticmethod
    def vmap(info, in_dims, x, scale):
        return x * scale, in_dims[0]


class SquareOnce(Square):
    """A ``once_differentiable`` backward: eager raises when it is differentiated."""

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


class SplitSign(torch.autograd.Function):
    """Two outputs, one marked non-differentiable; an intermediate kept on ``ctx``."""

    @staticmethod
    def forward(ctx, x):
        t = torch.tanh(x)
        ctx.t = t
        return t, (x > 0).to(x.dtype)

    @staticmethod
    def backward(ctx, g, _):
        return g * (1 - ctx.t * ctx.t)

    @classmethod
    def first(cls, x):
        t, sign = cls.apply(x)
        return t + sign


class DoubleTimes(torch.autograd.Function):
    """``2 * x * g``, the Function ``SquareWithAFunctionInBackward``'s backward applies."""

    @staticmethod
    def forward(ctx, x, g):
        ctx.save_for_backward(x, g)
        return 2 * x * g

    @staticmethod
    def backward(ctx, gg):
        x, g = ctx.saved_tensors
        return 2 * g * gg, 2 * x * gg


class SquareWithAFunctionInBackward(Square):
    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return DoubleTimes.apply(x, g)


@torch.library.custom_op("dynbatch_parity::cubed", mutates_args=())
def cubed(x: torch.Tensor) -> torch.Tensor:
    return x ** 3


@cubed.register_fake
def _(x):
    return torch.empty_like(x)


def _cubed_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _cubed_backward(ctx, g):
    (x,) = ctx.saved_tensors
    return 3 * x * x * g


cubed.register_autograd(_cubed_backward, setup_context=_cubed_setup)


def _checkpointed(h):
    return torch.utils.checkpoint.checkpoint(lambda t: torch.sin(t) * t, h, use_reentrant=False)


def _hooked(h):
    h = h * 1.5
    if h.requires_grad:
        h.register_hook(lambda g: g * 2)
    return torch.sin(h)


def _no_grad_part(h):
    with torch.no_grad():
        scale = h.abs().mean() + 1
    return h / scale


def _inference_mode_part(h):
    with torch.inference_mode():
        scale = h.detach().abs().mean() + 1
    return h / scale.clone()


def _detached(h):
    return h + h.detach() ** 2


def _requires_grad_of_an_intermediate(h):
    leaf = h.detach().requires_grad_()
    return h * torch.sigmoid(leaf)


def _item_break(h):
    return h / (1 + h.detach().abs().max().item())


def _nonzero_break(h):
    rows = (h[:, 0] > -10).nonzero()[:, 0]
    return torch.sin(h[rows])


CONSTRUCTS: dict[str, Callable] = {
    "function": Square.apply,
    "function_setup_context": Cube.apply,
    "function_generate_vmap_rule": SinWithVmapRule.apply,
    "function_vmap_staticmethod": lambda h: ScaleWithVmap.apply(h, 0.5) * h,
    "function_once_differentiable": SquareOnce.apply,
    "function_non_differentiable_output": SplitSign.first,
    "function_in_a_backward": SquareWithAFunctionInBackward.apply,
    "library_custom_op": cubed,
    "tensor_hook": _hooked,
    "no_grad": _no_grad_part,
    "inference_mode": _inference_mode_part,
    "detach": _detached,
    "requires_grad_of_intermediate": _requires_grad_of_an_intermediate,
    "checkpoint": _checkpointed,
    "item_break": _item_break,
    "nonzero_break": _nonzero_break,
}


class Potential(nn.Module):
    """E(pos) = sum(lin2(tanh(construct(lin1(pos))))), with a buffer written in place
    (a running mean, as a BatchNorm keeps) where ``running`` is set."""

    def __init__(self, construct: str, running: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.lin1 = nn.Linear(3, WIDTH, dtype=DTYPE)
        self.lin2 = nn.Linear(WIDTH, 1, dtype=DTYPE)
        self.construct = CONSTRUCTS[construct]
        self.running = running
        self.register_buffer("mean", torch.zeros(WIDTH, dtype=DTYPE))

    def forward(self, pos):
        h = self.lin1(pos)
        if self.running:
            self.mean.mul_(0.9).add_(0.1 * h.detach().mean(0))
            h = h - self.mean
        h = self.construct(h)
        return self.lin2(torch.tanh(h)).sum()


class ForceModel(nn.Module):
    """Forces in the forward (``pos.requires_grad_(True)``, MACE / TorchMD-Net / SevenNet),
    optionally a graph break right after it (a neighbour list's ``.item()``) and the
    positions in a dict (SevenNet's ``data['edge_vec']``)."""

    def __init__(self, construct: str, break_after_requires_grad: bool, dict_input: bool):
        super().__init__()
        self.potential = Potential(construct)
        self.break_after, self.dict_input = break_after_requires_grad, dict_input

    def forward(self, data, z):
        pos = data["pos"] if self.dict_input else data
        batch = torch.zeros_like(z)  # an op before the break that does not read pos (TorchMD-Net)
        pos.requires_grad_(True)
        if self.break_after:
            torch._dynamo.graph_break()
        energy = self.potential(pos) * (batch + 1).sum() / len(z)
        (grad,) = torch.autograd.grad(energy, pos, create_graph=self.training)
        return energy, -grad


# --- call sites -----------------------------------------------------------------------

def _positions():
    torch.manual_seed(1)
    return torch.randn(N_ATOMS, 3, dtype=DTYPE)


def _params(model):
    return [p for p in model.parameters()]


def site_grad(m, model, pos):
    pos = pos.requires_grad_()
    return torch.autograd.grad(m(pos), pos)


def site_create_graph(m, model, pos):
    pos = pos.requires_grad_()
    (g,) = torch.autograd.grad(m(pos), pos, create_graph=True)
    second = torch.autograd.grad((g * g).sum(), [pos, *_params(model)], allow_unused=True)
    return (g, *second)


def site_grads_batched(m, model, pos):
    pos = pos.requires_grad_()
    (g,) = torch.autograd.grad(m(pos), pos, create_graph=True)
    basis = torch.eye(pos.numel(), dtype=DTYPE).view(-1, *pos.shape)
    return torch.autograd.grad(g, pos, basis, is_grads_batched=True)


def site_hessian(m, model, pos):
    return (torch.autograd.functional.hessian(m, pos),)


def site_hessian_vectorized(m, model, pos):
    return (torch.autograd.functional.hessian(m, pos, vectorize=True),)


def site_jacobian_vectorized(m, model, pos):
    def forces(p):
        p = p.requires_grad_() if not p.requires_grad else p
        return torch.autograd.grad(m(p), p, create_graph=True)[0]

    return (torch.autograd.functional.jacobian(forces, pos, vectorize=True),)


def site_vmap_over_a_grad(m, model, pos):
    pos = pos.requires_grad_()
    (g,) = torch.autograd.grad(m(pos), pos, create_graph=True)
    basis = torch.eye(pos.numel(), dtype=DTYPE).view(-1, *pos.shape)
    return (torch.vmap(lambda v: torch.autograd.grad(g, pos, v, retain_graph=True)[0])(basis),)


def site_train(m, model, pos):
    pos = pos.requires_grad_()
    energy = m(pos)
    (g,) = torch.autograd.grad(energy, pos, create_graph=True)
    loss = energy + (g * g).sum()
    loss.backward()
    return (loss,)


SITES = {
    "grad": site_grad,
    "create_graph": site_create_graph,
    "grads_batched": site_grads_batched,
    "hessian": site_hessian,
    "hessian_vectorized": site_hessian_vectorized,
    "jacobian_vectorized": site_jacobian_vectorized,
    "vmap_over_a_grad": site_vmap_over_a_grad,
    "train": site_train,
}
# Inside one compiled function: the same sites, the model called as it is.
INSIDE = ("create_graph", "hessian_vectorized", "train")


# --- what a user can observe ----------------------------------------------------------

@dataclasses.dataclass
class Observed:
    results: list[Any]                  # tensors (detached copies) or None
    differentiable: list[bool | None]  # each result's requires_grad
    inputs_require_grad: list[bool]
    leaf_grads: dict[str, Any]
    buffers: dict[str, torch.Tensor]
    raised: tuple[type, str] | None = None


def observe(call: Callable[[], Any], model: nn.Module, inputs: list[torch.Tensor]) -> Observed:
    model.zero_grad(set_to_none=True)
    try:
        results = call()
    except Exception as e:  # noqa: BLE001 - eager's exception is part of what is compared
        return Observed([], [], [], {}, {}, raised=(_eager_type(e), _first_line(e)))
    results = results if isinstance(results, (list, tuple)) else (results,)
    return Observed(
        [None if r is None else r.detach().clone() for r in results],
        [None if r is None else r.requires_grad for r in results],
        [t.requires_grad for t in inputs],
        {k: None if p.grad is None else p.grad.detach().clone() for k, p in model.named_parameters()},
        {k: b.detach().clone() for k, b in model.named_buffers()},
    )


def _eager_type(e: BaseException) -> type:
    # Dynamo re-raises an error met while it traced as its own type, chained to the user's.
    from torch._dynamo.exc import TorchRuntimeError
    while isinstance(e, TorchRuntimeError) and e.__cause__ is not None:
        e = e.__cause__
    return type(e)


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0]


def differences(got: Observed, eager: Observed, rtol: float = 1e-8) -> list[str]:
    """Every observable way ``got`` differs from ``eager``; empty when they agree."""
    if eager.raised or got.raised:
        if got.raised is None:
            return [f"eager raises {eager.raised[0].__name__}: {eager.raised[1]}; this returned"]
        if eager.raised is None:
            return [f"raises {got.raised[0].__name__}: {got.raised[1]}; eager returns"]
        if not issubclass(got.raised[0], eager.raised[0]) or eager.raised[1] not in got.raised[1]:
            return [f"raises {got.raised}; eager raises {eager.raised}"]
        return []
    out = []
    if len(got.results) != len(eager.results):
        return [f"{len(got.results)} results; eager {len(eager.results)}"]
    for i, (g, e) in enumerate(zip(got.results, eager.results)):
        if (g is None) != (e is None):
            out.append(f"result {i}: {'None' if g is None else 'a tensor'}; eager {'None' if e is None else 'a tensor'}")
        elif e is not None and not _close(g, e, rtol):
            out.append(f"result {i}: max |diff| {(g - e).abs().max():.3g} of max |eager| {e.abs().max():.3g}")
    if got.differentiable != eager.differentiable:
        out.append(f"requires_grad of the results {got.differentiable}; eager {eager.differentiable}")
    if got.inputs_require_grad != eager.inputs_require_grad:
        out.append(f"requires_grad of the inputs {got.inputs_require_grad}; eager {eager.inputs_require_grad}")
    for name in eager.leaf_grads:
        g, e = got.leaf_grads.get(name), eager.leaf_grads[name]
        if (g is None) != (e is None) or (e is not None and not _close(g, e, rtol)):
            out.append(f"{name}.grad differs from eager's")
    for name, e in eager.buffers.items():
        if not _close(got.buffers[name], e, rtol):
            out.append(f"buffer {name} differs from eager's")
    return out


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float) -> bool:
    scale = float(b.abs().max()) if b.numel() else 0.0
    return a.shape == b.shape and bool(torch.allclose(a, b, rtol=rtol, atol=rtol * max(1.0, scale)))


# --- the cases ------------------------------------------------------------------------

# Cases where dynbatch runs Dynamo's graph eagerly, with the reason it logs (a fallback:
# eager's values, counted in dynbatch.fallback_reasons()).  Stock compile gives zeros there.
FALLS_BACK = {
    ("checkpoint", "hessian_vectorized", "inside"):
        "2 disjoint backward regions that require recomputation",  # AOTAutograd's remat
}
# Cases stock torch.compile cannot run either, kept out of the cross product: the upstream
# reason, and a test that the reason still holds.
STOCK_OWN = {
    "inference_mode": "Dynamo's fake run of an inference_mode block fails (\"Cannot set version_counter for "
                      "inference tensor\") and leaves the dispatcher's state broken for the process",
}


def run_case(construct: str, site: str, where: str, backend: str) -> Observed:
    """One call of ``site`` over a Potential with ``construct``, under ``backend``
    ("eager", "dynbatch", or a stock backend), around the compiled model or inside
    one compiled function.  dynbatch runs as a user's does (a graph it cannot batch runs
    eagerly), its inner compiler the cheap one."""
    model = Potential(construct, running=construct == "buffer_written")
    pos = _positions()
    call_site = SITES[site]
    if backend == "eager":
        return observe(lambda: call_site(model, model, pos), model, [pos])
    options = {"options": {**AOT_EAGER, **FALLBACK}} if backend == "dynbatch" else {}
    if where == "around":
        m = torch.compile(model, backend=backend, **options)
        return observe(lambda: call_site(m, model, pos), model, [pos])
    fn = torch.compile(functools.partial(call_site, model, model), backend=backend, **options)
    return observe(lambda: fn(pos), model, [pos])


CONSTRUCTS["buffer_written"] = lambda h: h  # the buffer is Potential's own (running=True)

# The sites where constructs broke, for every construct; every site on a few constructs.
DEFAULT_SITES = ("create_graph", "hessian_vectorized", "train")
EVERY_SITE_ON = ("function", "function_once_differentiable", "library_custom_op")


def _cases(full: bool):
    constructs = [c for c in CONSTRUCTS if c not in STOCK_OWN]
    for construct, site, where in itertools.product(constructs, SITES, ("around", "inside")):
        if where == "inside" and site not in INSIDE:
            continue
        default = site in DEFAULT_SITES or construct in EVERY_SITE_ON
        if default != full:
            yield construct, site, where


def _check(construct, site, where):
    eager = run_case(construct, site, where, "eager")
    torch._dynamo.reset()
    dynbatch.reset()
    got = run_case(construct, site, where, "dynbatch")
    assert not differences(got, eager), differences(got, eager)
    assert dynbatch.counters().get("graphs", 0) >= 1  # dynbatch compiled something
    reasons = " ".join(dynbatch.fallback_reasons())
    expected = _falls_back(construct, site, where)
    if expected and not torch.__version__.startswith("2.13"):
        assert expected in reasons or not reasons, reasons  # other versions' AOTAutograd may compile it
    else:
        assert (expected in reasons) if expected else not reasons, reasons


def _falls_back(construct, site, where) -> str | None:
    from dynbatch import _compat

    if construct == "requires_grad_of_intermediate" and not _compat.DYNAMO_TRACES_REQUIRES_GRAD_:
        # torch 2.11: the backport's check (NOTE in capture/requires_grad_tracing.py)
        return "a leaf that requires_grad_() created inside the graph"
    return FALLS_BACK.get((construct, site, where))


@pytest.mark.parametrize("construct,site,where", list(_cases(full=False)))
def test_a_construct_at_a_call_site_equals_eager(construct, site, where):
    _check(construct, site, where)


@pytest.mark.slow
@pytest.mark.parametrize("construct,site,where", list(_cases(full=True)))
def test_a_construct_at_a_call_site_equals_eager_all(construct, site, where):
    _check(construct, site, where)


@pytest.mark.slow
@pytest.mark.parametrize("construct,site,where", list(FALLS_BACK))
def test_where_dynbatch_falls_back_stock_is_wrong(construct, site, where):
    """A fallback listed above is a case stock compile gets wrong: not one dynbatch made."""
    eager = run_case(construct, site, where, "eager")
    torch._dynamo.reset()
    assert differences(run_case(construct, site, where, "aot_eager"), eager)


@pytest.mark.slow
@pytest.mark.parametrize("construct", list(STOCK_OWN))
def test_what_stock_cannot_run_raises_under_dynbatch_too(construct):
    """In a process of its own: the failure breaks the process's dispatcher state."""
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(pathlib.Path(__file__).parent)!r})
        import test_parity as T
        backend = sys.argv[1]
        got = T.run_case({construct!r}, "create_graph", "around", backend)
        print(got.raised[0].__name__ if got.raised else "returned")
    """)
    for backend in ("aot_eager", "dynbatch"):
        out = subprocess.run([sys.executable, "-c", script, backend], capture_output=True, text=True, timeout=300)
        assert out.stdout.split()[-1] == "BackendCompilerFailed", (backend, out.stdout, out.stderr[-2000:])


# --- forces in the model's forward: requires_grad_() on an input ------------------------

FORCE_MODELS = {
    "requires_grad_": dict(break_after_requires_grad=False, dict_input=False),
    "requires_grad_then_break": dict(break_after_requires_grad=True, dict_input=False),
    "requires_grad_of_a_dict_entry_then_break": dict(break_after_requires_grad=True, dict_input=True),
}


def _force_step(model, m, data, train: bool):
    energy, forces = m(data, torch.arange(N_ATOMS))
    if not train:
        return energy, forces
    loss = energy + (forces * forces).sum()
    loss.backward()
    return loss, forces


def run_force_case(kind: str, construct: str, train: bool, where: str, backend: str) -> Observed:
    model = ForceModel(construct, **FORCE_MODELS[kind]).train(train)
    pos = _positions()
    data = {"pos": pos} if FORCE_MODELS[kind]["dict_input"] else pos
    options = {"options": {**AOT_EAGER, **FALLBACK}} if backend == "dynbatch" else {}
    if backend == "eager":
        call = functools.partial(_force_step, model, model, data, train)
    elif where == "around":
        call = functools.partial(_force_step, model, torch.compile(model, backend=backend, **options), data, train)
    else:
        call = functools.partial(torch.compile(_force_step, backend=backend, **options), model, model, data, train)
    return observe(call, model, [pos])


@pytest.mark.parametrize("where", ["around", "inside"])
@pytest.mark.parametrize("train", [False, True], ids=["forces", "train"])
@pytest.mark.parametrize("kind", list(FORCE_MODELS))
def test_requires_grad_of_an_input_in_the_forward_takes_effect(kind, train, where):
    eager = run_force_case(kind, "function", train, where, "eager")
    torch._dynamo.reset()
    got = run_force_case(kind, "function", train, where, "dynbatch")
    assert not differences(got, eager), differences(got, eager)
    assert dynbatch.counters().get("graphs", 0) >= 1
    assert not dynbatch.fallback_reasons()


# --- the two reproductions, as users wrote them ----------------------------------

def _energy_through_square(pos):
    return Square.apply(pos).sin().sum()


def test_a_function_in_a_compiled_energy_has_eager_second_derivatives():
    f = torch.compile(_energy_through_square, backend="dynbatch", options=AOT_EAGER)
    pos = _positions().requires_grad_()
    (g,) = torch.autograd.grad(f(pos), pos, create_graph=True)
    (eager,) = torch.autograd.grad(_energy_through_square(pos), pos, create_graph=True)
    assert g.grad_fn is not None
    torch.testing.assert_close(g, eager)
    hessian = torch.autograd.functional.hessian(f, pos.detach())
    torch.testing.assert_close(hessian, torch.autograd.functional.hessian(_energy_through_square, pos.detach()))
    assert hessian.abs().max() > 0
    assert dynbatch.counters().get("outside_eager", 0) == 0  # compiled paths, not the eager re-run


def _forces_after_break(z, pos):
    batch = torch.zeros_like(z)
    pos.requires_grad_(True)
    torch._dynamo.graph_break()
    e = (pos.pow(2).sum(-1) * (batch + 1)).sum()
    return -torch.autograd.grad(e, pos)[0]


def test_requires_grad_of_an_input_before_a_graph_break_takes_effect():
    pos = _positions()
    got = torch.compile(_forces_after_break, backend="dynbatch", options=AOT_EAGER)(torch.arange(4), pos)
    torch.testing.assert_close(got, _forces_after_break(torch.arange(4), _positions()))
    assert pos.requires_grad
    assert dynbatch.counters()["graphs"] >= 1


def test_verify_counts_a_result_that_is_not_differentiable_where_eagers_is():
    from dynbatch.lowering import verify

    x = torch.randn(3, dtype=DTYPE, requires_grad=True)
    eager = [x * 2]
    assert "not differentiable" in verify.mismatch([eager[0].detach()], eager)
    assert verify.mismatch([x * 2], eager) is None
    assert verify.mismatch([x.detach() * 2], [x.detach() * 2]) is None


def _energy_and_its_grad(x):
    e = (x.sin() * x).sum()
    (g,) = torch.autograd.grad(e, x)  # frees e's graph in eager
    return e, g


def test_a_second_backward_through_a_graph_a_compiled_grad_consumed_is_the_one_leniency():
    """Eager raises "Trying to backward through the graph a second time" here; in one compiled
    graph the returned energy's backward is AOTAutograd's, which a grad inside never freed,
    so it runs and gives what eager gives with retain_graph=True (docs/design.md, "Fallback:
    never a wrong gradient").  The saved activations live as long as the energy does."""
    x = torch.randn(5, dtype=DTYPE, requires_grad=True)
    e, _ = _energy_and_its_grad(x)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        e.backward()
    x.grad = None
    e, g = torch.compile(_energy_and_its_grad, backend="dynbatch", fullgraph=True, options=AOT_EAGER)(x)
    e.backward()
    expected = x.detach().requires_grad_()
    (expected_grad,) = torch.autograd.grad((expected.sin() * expected).sum(), expected)
    torch.testing.assert_close(x.grad, expected_grad)
    torch.testing.assert_close(g, expected_grad)
    assert dynbatch.counters()["graphs"] == 1


# --- each path that answers "as eager would", held to it -------------------------------

@pytest.mark.parametrize("site", ["create_graph", "hessian", "train"])
@pytest.mark.parametrize("construct", ["function", "library_custom_op", "buffer_written", "checkpoint"])
def test_the_eager_rerun_of_a_regions_backward_keeps_eagers_contract(monkeypatch, construct, site):
    """``outside_eager``: the region's graph re-run eagerly for a create_graph backward
    (forced here) gives differentiable grads whose second derivatives are eager's."""
    from dynbatch.region import create_graph

    monkeypatch.setattr(create_graph, "why_vjp_runs_eagerly", lambda *args: "forced by the test")
    eager = run_case(construct, site, "around", "eager")
    torch._dynamo.reset()
    got = run_case(construct, site, "around", "dynbatch")
    assert not differences(got, eager), differences(got, eager)
    assert dynbatch.counters().get("outside_eager", 0) >= 1 and not dynbatch.fallback_reasons()


@pytest.mark.parametrize("construct", ["function", "library_custom_op", "buffer_written", "tensor_hook"])
def test_the_captured_graph_run_eagerly_keeps_eagers_contract(monkeypatch, construct):
    """The backend's fallback (a batched graph it cannot lower runs as Dynamo captured it),
    forced for a Hessian inside one compiled function."""
    from dynbatch import backend

    def cannot_lower(*args, **kwargs):
        raise RuntimeError("forced by the test")

    monkeypatch.setattr(backend, "_lower_within_budget", cannot_lower)
    eager = run_case(construct, "hessian_vectorized", "inside", "eager")
    torch._dynamo.reset()
    got = run_case(construct, "hessian_vectorized", "inside", "dynbatch")
    assert not differences(got, eager), differences(got, eager)
    assert "forced by the test" in " ".join(dynbatch.fallback_reasons())


class StopGradient(torch.autograd.Function):
    """A Function whose backward gives no grad: autograd still runs the nodes before it."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return None


def test_a_backward_that_reaches_a_compiled_model_with_no_grad():
    """The engine calls the model's node with no grad at all (a SevenNet Hessian's rows):
    its backward answers None for every input (it once returned too few Nones)."""
    model = Potential("function")
    pos = _positions().requires_grad_()

    def site(m):
        return torch.autograd.grad(StopGradient.apply(m(pos)) + (pos * pos).sum(), pos)

    eager = observe(lambda: site(model), model, [pos])
    got = observe(lambda: site(torch.compile(model, backend="dynbatch", options=AOT_EAGER)), model, [pos])
    assert not differences(got, eager), differences(got, eager)
    assert dynbatch.counters()["graphs"] == 1
