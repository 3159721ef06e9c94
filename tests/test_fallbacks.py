"""Fallbacks that are safe: what dynbatch does not batch still gives eager's answer.

Every program here is compiled with dynbatch and run next to eager PyTorch
(``torch.autograd.grad(..., is_grads_batched=True)``, which maps the
backward with the legacy ``torch._vmap_internals``).  When dynbatch cannot
batch a grad it runs the captured graph eagerly, logs the reason on the
"dynbatch" logger and counts it in ``dynbatch.counters()["fallbacks"]``; the
user then gets eager's values or eager's exception.  Tests of that path
compile with ``on_unsupported="fallback"`` (``FALLBACK``) and assert the
fallback; tests of the batched path keep the suite's ``"error"``.

What we found (torch 2.13, CPU):

* Custom ``torch.autograd.Function`` whose backward calls ``.item()``, draws
  random numbers, or writes a batched grad into an unbatched buffer in place:
  Dynamo traces the Function into the graph (the ``autograd_function_apply``
  higher-order op), functorch's vmap rejects the backward at trace time, and
  dynbatch falls back.  Eager's legacy vmap rejects these backwards too, so
  the user gets eager's exception type and message -- followed by a context
  note: the higher-order op runs the traced backward through
  ``torch.fx.Interpreter`` (torch/_functorch/autograd_function.py), which
  appends "While executing %node ..." to the message.  That note is
  PyTorch's, not dynbatch's (``assert_eager_error``).
* Data-dependent control flow in a Function's backward: Dynamo refuses to
  trace the Function ("Data-dependent branching"), so under fullgraph=True
  the call raises Dynamo's Unsupported; without fullgraph it graph-breaks,
  the grad runs eagerly, and the user gets eager's exact error.  No dynbatch
  fallback is involved (Dynamo's behaviour).
* Data-dependent sizes in the backward (index_put with a boolean mask,
  index_fill): dynbatch falls back; eager's values.
* A backward functorch cannot batch but eager's legacy vmap can
  (masked_select of a broadcast 0-dim input): dynbatch falls back; eager's
  values.
* In-place on a saved tensor: eager's "modified by an inplace operation"
  error, through a fallback.
* Functions with a ``vmap`` staticmethod or ``generate_vmap_rule=True`` are
  batched and equal to the per-sample loop.  Their vmap rule is never
  consulted (checked): dynbatch vmaps the *backward* only, and Dynamo inlines
  the Function's backward as ordinary ops, so the rule is not needed.  A
  Function applied *inside* another Function's backward cannot be traced by
  Dynamo ("Unresolved GetAttrVariable comparison"): without fullgraph it
  graph-breaks and eager computes the grad.
* A backward that round-trips through NumPy: Dynamo traces the NumPy calls as
  torch ops, so dynbatch batches it and returns the per-sample loop's values,
  while eager's legacy vmap raises ("Batching rule not implemented for
  aten::detach").  This is the one place where dynbatch answers where eager
  raises; the test pins it down.
"""

from __future__ import annotations

import logging

import pytest
import torch

import dynbatch
from conftest import FALLBACK, assert_same_grads, compile_dynbatch, loop_grads
from helpers_reliability import assert_same_exception, counters_delta, graph_breaks, outcome

grad = torch.autograd.grad


def assert_eager_error(got: BaseException, expected: BaseException, *, through_hop: bool) -> None:
    """Eager's type and message; through the autograd.Function higher-order op,
    eager's message followed by torch.fx.Interpreter's "While executing" note."""
    if not through_hop:
        assert_same_exception(got, expected)
        return
    assert type(got) is type(expected), f"{type(got).__name__}: {got}\neager: {type(expected).__name__}: {expected}"
    assert str(got).startswith(str(expected) + "\n\nWhile executing %"), (
        f"compiled: {str(got)[:600]}\neager:    {expected}")


# --- custom autograd.Functions -------------------------------------------------------

class _SinBase(torch.autograd.Function):
    @staticmethod
    def forward(x):
        return x.sin()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])


class ItemInBackward(_SinBase):
    """No vmap rule; .item() in the backward."""

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * x.cos() * g.sum().item()


class RandomInBackward(_SinBase):
    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * x.cos() * torch.rand_like(g)


class InPlaceIntoUnbatchedBuffer(_SinBase):
    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        buf = torch.zeros_like(x)
        buf.add_(g)
        return buf * x.cos()


class BranchInBackward(_SinBase):
    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        if g.sum() > 0:
            return g * x.cos()
        return -g * x.cos()


class OldStyleItemInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.sin()

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * x.cos() * float(g.sum())


VMAP_RULE_CALLS: list[str] = []


class WithVmapRule(_SinBase):
    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * x.cos()

    @staticmethod
    def vmap(info, in_dims, x):
        VMAP_RULE_CALLS.append("WithVmapRule")
        return x.sin(), in_dims[0]


class WithGeneratedVmapRule(_SinBase):
    generate_vmap_rule = True

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * x.cos()


class NumpyInBackward(_SinBase):
    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return torch.from_numpy(g.detach().numpy() * 2) * x.cos()


class _Inner(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(g, x):
        return g * x.cos()

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, gg):
        return None, None


class FunctionInsideBackward(_SinBase):
    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return _Inner.apply(g, x)


def function_program(F):
    def program(x, V):
        return grad(F.apply(x) * 2, x, V, is_grads_batched=True)

    program.__name__ = f"program_{F.__name__}"
    return program


def _args():
    g = torch.Generator().manual_seed(0)
    return torch.randn(3, generator=g).requires_grad_(), torch.randn(4, 3, generator=g)


def _run_compiled(program, fullgraph, caplog):
    torch.manual_seed(0)
    before = dynbatch.counters()
    with caplog.at_level(logging.WARNING, logger="dynbatch"):
        kind, value = outcome(compile_dynbatch(program, fullgraph=fullgraph, options=FALLBACK), *_args())
    return kind, value, counters_delta(before)


def _assert_logged_fallback(caplog, delta, fragment: str) -> None:
    assert delta.get("fallbacks", 0) == 1, delta
    assert "falling back to eager" in caplog.text, caplog.text
    assert fragment in caplog.text, caplog.text
    assert any(fragment in reason for reason in dynbatch.fallback_reasons()), dynbatch.fallback_reasons()


FALLBACK_ERRORS = {
    # Function: a fragment of the functorch error that is the logged reason
    ItemInBackward: "calling .item() on a Tensor",
    OldStyleItemInBackward: "calling .item() on a Tensor",
    RandomInBackward: "random operation",
    InPlaceIntoUnbatchedBuffer: "doesn't match the broadcast shape",
}


@pytest.mark.parametrize("F", list(FALLBACK_ERRORS), ids=lambda F: F.__name__)
def test_function_backward_vmap_cannot_batch_falls_back_to_eagers_error(F, caplog):
    program = function_program(F)
    torch.manual_seed(0)
    e_kind, expected = outcome(program, *_args())
    assert e_kind == "raise", "eager's legacy vmap is expected to reject this backward too"
    kind, got, delta = _run_compiled(program, True, caplog)
    assert kind == "raise", got
    assert_eager_error(got, expected, through_hop=True)
    _assert_logged_fallback(caplog, delta, FALLBACK_ERRORS[F])


@pytest.mark.parametrize("F", list(FALLBACK_ERRORS), ids=lambda F: F.__name__)
def test_function_backward_vmap_cannot_batch_without_fullgraph(F, caplog):
    """Without fullgraph, Dynamo may graph-break first (item() without
    capture_scalar_outputs); either way the error is eager's."""
    program = function_program(F)
    torch.manual_seed(0)
    e_kind, expected = outcome(program, *_args())
    kind, got, delta = _run_compiled(program, False, caplog)
    assert kind == "raise", got
    assert_eager_error(got, expected, through_hop=bool(delta.get("fallbacks")))
    if delta.get("fallbacks"):
        _assert_logged_fallback(caplog, delta, FALLBACK_ERRORS[F])
    else:  # then Dynamo graph-broke and eager ran the grad
        assert graph_breaks() > 0, delta


def test_data_dependent_branch_in_backward_is_dynamos_refusal(caplog):
    program = function_program(BranchInBackward)
    e_kind, expected = outcome(program, *_args())
    assert e_kind == "raise"
    kind, got, _ = _run_compiled(program, True, caplog)
    assert isinstance(got, torch._dynamo.exc.Unsupported) and "Data-dependent branching" in str(got), got
    kind, got, delta = _run_compiled(program, False, caplog)
    assert_same_exception(got, expected)
    assert not delta.get("fallbacks"), "Dynamo graph-breaks; dynbatch does not see this grad"
    assert any("Data-dependent branching" in k for k in torch._dynamo.utils.counters["graph_break"])


@pytest.mark.parametrize("F", [WithVmapRule, WithGeneratedVmapRule], ids=lambda F: F.__name__)
def test_functions_with_vmap_rules_are_batched(F):
    VMAP_RULE_CALLS.clear()
    program = function_program(F)
    x, V = _args()
    expected = loop_grads((F.apply(x) * 2,), (x,), (V,))
    got = compile_dynbatch(program, fullgraph=True)(x, V)
    assert_same_grads(got, expected)
    assert_same_grads(got, program(x, V))  # and eager is_grads_batched agrees
    c = dynbatch.counters()
    assert c.get("grads_batched") == 1 and not c.get("fallbacks"), c
    assert VMAP_RULE_CALLS == [], "the Function's vmap rule is not needed to batch its backward"


def test_a_function_applied_inside_a_backward_runs_eagerly():
    """Its backward, traced differentiable, would run the inner Function under vmap, which
    Dynamo's op for it cannot; stock inlined the inner forward, whose derivative is not the
    inner backward (NOTE [Functions differentiate as in eager]).  So the outer Function
    graph-breaks and runs as eager runs it."""
    program = function_program(FunctionInsideBackward)
    x, V = _args()
    expected = loop_grads((FunctionInsideBackward.apply(x) * 2,), (x,), (V,))
    got = compile_dynbatch(program, fullgraph=False)(x, V)
    assert_same_grads(got, expected)
    assert dynbatch.counters()["graphs"] >= 1 and not dynbatch.fallback_reasons()
    assert any("backward applies another Function" in reason for reason in torch._dynamo.utils.counters["graph_break"])


def test_numpy_in_backward_is_batched_where_eager_raises():
    program = function_program(NumpyInBackward)
    x, V = _args()
    e_kind, e_val = outcome(program, x, V)
    assert e_kind == "raise" and "Batching rule not implemented for aten::detach" in str(e_val)
    got = compile_dynbatch(program, fullgraph=True)(x, V)
    assert_same_grads(got, loop_grads((NumpyInBackward.apply(x) * 2,), (x,), (V,)))
    assert dynbatch.counters().get("grads_batched") == 1


# --- programs without custom Functions ----------------------------------------------------

MASK = torch.tensor([True, True, False, True, False])


def index_put_bool_mask(x, v, V):
    return grad(torch.index_put(x, (MASK,), v), (x, v), V, is_grads_batched=True)


def index_fill_one_index(x, index, val, V):
    return grad(torch.index_fill(x, 0, index, val), (x, val), V, is_grads_batched=True)


def masked_select_broadcast(x, mask, V):
    return grad(torch.masked_select(x, mask), x, V, is_grads_batched=True)


def in_place_on_saved(x, V):
    y = torch.exp(x)
    y.mul_(2)
    return grad(y, x, V, is_grads_batched=True)


def _g():
    return torch.Generator().manual_seed(1)


VALUE_FALLBACKS = {
    "index_put_bool_mask": (
        index_put_bool_mask,
        lambda g: (torch.randn(5, 5, generator=g).requires_grad_(), torch.randn(5, generator=g).requires_grad_(),
                   torch.randn(4, 5, 5, generator=g)),
        "data-dependent sizes"),
    "index_fill_one_index": (
        index_fill_one_index,
        lambda g: (torch.randn((), generator=g).requires_grad_(), torch.tensor([0]),
                   torch.randn((), generator=g).requires_grad_(), torch.randn(3, generator=g)),
        "data-dependent sizes"),
    "masked_select_broadcast_0dim": (
        masked_select_broadcast,
        lambda g: (torch.randn((), generator=g).requires_grad_(), torch.rand(10, 10, generator=g) > 0.5,
                   None),
        "must match the size"),
}


# Cases whose sizes are data-dependent on some torch versions only: torch 2.11's and 2.12's
# fake _unique gives a one-element index a static size, so index_fill's value
# grad batches there; 2.13's is unbacked, and dynbatch falls back.
STATIC_ON_SOME_VERSIONS = {"index_fill_one_index"}


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "graph_breaks_allowed"])
@pytest.mark.parametrize("name", sorted(VALUE_FALLBACKS))
def test_fallback_gives_eagers_values(name, fullgraph, caplog):
    program, make_args, fragment = VALUE_FALLBACKS[name]
    args = list(make_args(_g()))
    if args[-1] is None:  # masked_select: the output size is data-dependent
        n = int(torch.masked_select(args[0], args[1]).numel())
        args[-1] = torch.randn(3, n, generator=_g())
    e_kind, expected = outcome(program, *args)
    assert e_kind == "ok", expected
    before = dynbatch.counters()
    with caplog.at_level(logging.WARNING, logger="dynbatch"):
        got = compile_dynbatch(program, fullgraph=fullgraph, options=FALLBACK)(*args)
    assert_same_grads(got, expected, rtol=0, atol=0)
    delta = counters_delta(before)
    if name in STATIC_ON_SOME_VERSIONS and not delta.get("fallbacks") and not graph_breaks():
        assert delta.get("graphs_batched") == 1, delta  # batched, with eager's values (above)
    elif fullgraph:
        _assert_logged_fallback(caplog, delta, fragment)
    elif delta.get("fallbacks"):
        _assert_logged_fallback(caplog, delta, fragment)
    else:
        # Without fullgraph Dynamo may graph-break on the data-dependent op first.
        assert graph_breaks() > 0, delta


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "graph_breaks_allowed"])
def test_in_place_on_saved_tensor_is_eagers_error(fullgraph, caplog):
    g = torch.Generator().manual_seed(0)
    args = (torch.randn(3, generator=g).requires_grad_(), torch.randn(4, 3, generator=g))
    e_kind, expected = outcome(in_place_on_saved, *args)
    assert e_kind == "raise"
    before = dynbatch.counters()
    with caplog.at_level(logging.WARNING, logger="dynbatch"):
        kind, got = outcome(compile_dynbatch(in_place_on_saved, fullgraph=fullgraph, options=FALLBACK), *args)
    assert kind == "raise"
    assert_same_exception(got, expected)
    _assert_logged_fallback(caplog, counters_delta(before), "modified by an inplace operation")


def test_fallback_counts_add_up():
    """Two distinct unsupported graphs: two fallbacks, two reasons, nothing batched."""
    x, V = _args()
    for program in (function_program(ItemInBackward), function_program(RandomInBackward)):
        with pytest.raises(RuntimeError):
            compile_dynbatch(program, fullgraph=True, options=FALLBACK)(x, V)
    c = dynbatch.counters()
    assert c.get("fallbacks") == 2 and c.get("graphs") == 2 and not c.get("graphs_batched"), c
    assert len(dynbatch.fallback_reasons()) == 2


# --- regressions: graphs that must not fall back ---------------------------------------------

def add_with_0dim(x, y, V):
    return grad(torch.add(x, y, alpha=2), (x, y), V, is_grads_batched=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_restart_analysis_is_not_taken_for_a_lowering_failure(dtype, caplog):
    """float64 with a 0-dim input: AOTAutograd asks Dynamo to re-trace
    (TensorifyScalarRestartAnalysis).  dynbatch used to catch that as a lowering
    failure and fall back (110 float64 OpInfo ops ran eagerly); now it lets it
    through and the re-traced graph is batched."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, dtype=dtype, generator=g).requires_grad_()
    y = torch.randn((), dtype=dtype, generator=g).requires_grad_()
    V = torch.randn(3, 5, dtype=dtype, generator=g)
    with caplog.at_level(logging.WARNING, logger="dynbatch"):
        got = compile_dynbatch(add_with_0dim)(x, y, V)
    assert_same_grads(got, loop_grads((torch.add(x, y, alpha=2),), (x, y), (V,)))
    c = dynbatch.counters()
    assert c.get("graphs_batched") == 1 and not c.get("fallbacks"), (c, dynbatch.fallback_reasons())
    assert "falling back" not in caplog.text
