"""Bad-input corpus: what eager rejects, compiled with dynbatch, raises eager's error.

Each case is a small program around ``torch.autograd.grad``.  The test runs
it eagerly first and records what eager does *at run time* (the exception's
type and message, or the values); then the same program compiled with
dynbatch, with ``fullgraph=True`` and ``fullgraph=False``, must raise an
exception of the same type with the same message, or return the same values.
Nothing here is copied from a run.

REJECTED: cases eager raises on.  ACCEPTED: cases eager silently accepts
(extra grad_outputs, float64 / integer / stride-0 cotangents, B=1, ...).

A rejected case reaches eager's error through dynbatch's fallback (the
graph runs eagerly): those tests compile with ``on_unsupported="fallback"``
and assert the fallback was counted and logged; under the suite's default
``"error"`` the same graph raises ``dynbatch.UnsupportedGraph``.  Accepted
cases compile under ``"error"``, so they cannot pass through a fallback.

``DYNAMO_REFUSES`` lists the cases where, under ``fullgraph=True``, Dynamo
itself refuses the program before dynbatch sees a graph (Dynamo's own
checks, not dynbatch's); for them the test asserts exactly that refusal and,
with ``fullgraph=False``, eager's behaviour through a graph break.

Also here (issue 2, items 5-7): ``shape_checks`` on its own, and validation of
the options.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Any, Callable

import pytest
import torch

import dynbatch
from dynbatch.batching import shape_checks
from dynbatch.options import Options
from conftest import FALLBACK, assert_fell_back, assert_same_grads, compile_dynbatch
from helpers_reliability import assert_same_exception, graph_breaks, outcome

grad = torch.autograd.grad


@dataclasses.dataclass
class Case:
    program: Callable[..., Any]
    make_args: Callable[[torch.Generator], tuple]
    needs_cuda: bool = False


def _g(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(gen, *shape, dtype=torch.float32, requires_grad=False):
    t = torch.randn(*shape, generator=gen, dtype=dtype)
    return t.requires_grad_() if requires_grad else t


def _x(gen, *shape):
    return _randn(gen, *shape, requires_grad=True)


# --- programs -----------------------------------------------------------------

def p_batched(x, V):
    return grad(torch.tanh(x * 2), x, V, is_grads_batched=True)


def p_unbatched(x, v):
    return grad(torch.tanh(x * 2), x, v)


def p_complex_output(x, V):
    y = torch.view_as_complex(torch.stack([x.sin(), x.cos()], -1))
    return grad(y, x, V, is_grads_batched=True)


def p_implicit_non_scalar(x):
    return grad(x.sin(), x, None, is_grads_batched=True)


def p_implicit_complex_scalar(x):
    y = torch.view_as_complex(torch.stack([x.sin(), x.cos()], -1)).sum()
    return grad(y, x)


def p_implicit_complex_scalar_batched(x):
    y = torch.view_as_complex(torch.stack([x.sin(), x.cos()], -1)).sum()
    return grad(y, x, None, is_grads_batched=True)


def p_unused_input(x, z, V):
    return grad(x.sin(), (x, z), V, is_grads_batched=True)


def p_input_not_requiring_grad(x, w, V):
    return grad(x.sin() * w, (x, w), V, is_grads_batched=True)


def p_output_not_requiring_grad(x, w, V):
    return grad(w * 2, x, V, is_grads_batched=True)


def p_two_outputs(x, V1, V2):
    return grad((x.sin(), x.cos()), x, (V1, V2), is_grads_batched=True)


def p_two_outputs_one_grad(x, V1):
    return grad((x.sin(), x.cos()), x, (V1,), is_grads_batched=True)


def p_non_tensor_grad_output(x):
    return grad(x.sin(), x, [1.0], is_grads_batched=True)


def p_empty_inputs(x, V):
    return grad(x.sin(), [], V, is_grads_batched=True)


def p_materialize_without_allow_unused(x, z, V):
    return grad(x.sin(), (x, z), V, is_grads_batched=True, materialize_grads=True, allow_unused=False)


def p_freed_graph(x, V):
    y = torch.exp(x)
    first = grad(y, x, V, is_grads_batched=True)
    second = grad(y, x, V, is_grads_batched=True)
    return first, second


def p_saved_tensor_modified(x, V):
    y = torch.exp(x)  # exp saves its result
    y.mul_(2)
    return grad(y, x, V, is_grads_batched=True)


def p_scalar_grad_output_batched(x, v):
    return grad((x * x).sum(), x, v, is_grads_batched=True)


def p_inputs_not_tensors(x, V):
    return grad(x.sin(), 3, V, is_grads_batched=True)


def p_implicit_scalar_batched(x):
    return grad(x.sin().sum(), x, None, is_grads_batched=True)


def p_extra_grad_outputs(x, V1, V2):
    return grad(x.sin(), x, (V1, V2), is_grads_batched=True)


def p_batched_create_graph(x, V):
    (g,) = grad(torch.tanh(x * 2), x, V, is_grads_batched=True, create_graph=True)
    return g, g.requires_grad


def p_allow_unused(x, z, V):
    return grad(x.sin(), (x, z), V, is_grads_batched=True, allow_unused=True)


def p_materialize(x, z, V):
    return grad(x.sin(), (x, z), V, is_grads_batched=True, materialize_grads=True)


REJECTED: dict[str, Case] = {
    "batched_shape_mismatch": Case(p_batched, lambda g: (_x(g, 3, 4), _randn(g, 2, 3, 5))),
    "batched_rank_mismatch": Case(p_batched, lambda g: (_x(g, 3, 4), _randn(g, 2, 12))),
    "unbatched_shape_mismatch": Case(p_unbatched, lambda g: (_x(g, 3, 4), _randn(g, 3, 5))),
    "complex_grad_for_real_output": Case(
        p_batched, lambda g: (_x(g, 3, 4), _randn(g, 2, 3, 4, dtype=torch.complex64))),
    "real_grad_for_complex_output": Case(p_complex_output, lambda g: (_x(g, 3), _randn(g, 2, 3))),
    "unbatched_complex_grad_for_real_output": Case(
        p_unbatched, lambda g: (_x(g, 3, 4), _randn(g, 3, 4, dtype=torch.complex64))),
    "implicit_grad_of_non_scalar": Case(p_implicit_non_scalar, lambda g: (_x(g, 3),)),
    "implicit_grad_of_complex_scalar": Case(p_implicit_complex_scalar, lambda g: (_x(g, 3),)),
    "implicit_grad_of_complex_scalar_batched": Case(p_implicit_complex_scalar_batched, lambda g: (_x(g, 3),)),
    "implicit_grad_of_real_scalar_batched": Case(p_implicit_scalar_batched, lambda g: (_x(g, 3),)),
    "unused_input_without_allow_unused": Case(p_unused_input, lambda g: (_x(g, 3), _x(g, 2), _randn(g, 4, 3))),
    "input_not_requiring_grad": Case(p_input_not_requiring_grad, lambda g: (_x(g, 3), _randn(g, 3), _randn(g, 4, 3))),
    "output_not_requiring_grad": Case(p_output_not_requiring_grad, lambda g: (_x(g, 3), _randn(g, 3), _randn(g, 4, 3))),
    "too_few_grad_outputs": Case(p_two_outputs_one_grad, lambda g: (_x(g, 3), _randn(g, 4, 3))),
    "batch_sizes_differ": Case(p_two_outputs, lambda g: (_x(g, 3), _randn(g, 2, 3), _randn(g, 5, 3))),
    "non_tensor_grad_outputs": Case(p_non_tensor_grad_output, lambda g: (_x(g, 3),)),
    "empty_inputs": Case(p_empty_inputs, lambda g: (_x(g, 3), _randn(g, 4, 3))),
    "materialize_grads_with_allow_unused_false": Case(
        p_materialize_without_allow_unused, lambda g: (_x(g, 3), _x(g, 2), _randn(g, 4, 3))),
    "second_backward_through_freed_graph": Case(p_freed_graph, lambda g: (_x(g, 3), _randn(g, 4, 3))),
    "batch_size_zero": Case(p_batched, lambda g: (_x(g, 3, 4), _randn(g, 0, 3, 4))),
    "zero_dim_batched_grad_output": Case(p_scalar_grad_output_batched, lambda g: (_x(g, 3), torch.tensor(1.0))),
    "saved_tensor_modified_in_place": Case(p_saved_tensor_modified, lambda g: (_x(g, 3), _randn(g, 4, 3))),
    "inputs_not_tensors": Case(p_inputs_not_tensors, lambda g: (_x(g, 3), _randn(g, 4, 3))),
    "grad_output_on_meta_device": Case(p_batched, lambda g: (_x(g, 3, 4), torch.empty(2, 3, 4, device="meta"))),
    "grad_output_on_wrong_device": Case(
        p_batched, lambda g: (_x(g, 3, 4), _randn(g, 2, 3, 4).to("cuda")), needs_cuda=True),
}

ACCEPTED: dict[str, Case] = {
    "extra_grad_outputs": Case(p_extra_grad_outputs, lambda g: (_x(g, 3), _randn(g, 4, 3), _randn(g, 4, 7))),
    "float64_cotangents": Case(p_batched, lambda g: (_x(g, 3, 4), _randn(g, 2, 3, 4, dtype=torch.float64))),
    "integer_cotangents": Case(p_batched, lambda g: (_x(g, 3, 4), torch.randint(-3, 3, (2, 3, 4), generator=g))),
    "stride_0_cotangents": Case(p_batched, lambda g: (_x(g, 3, 4), _randn(g, 1, 3, 4).expand(5, 3, 4))),
    "fully_stride_0_cotangents": Case(p_batched, lambda g: (_x(g, 3, 4), _randn(g, 1, 1, 1).expand(5, 3, 4))),
    "non_contiguous_cotangents": Case(p_batched, lambda g: (_x(g, 3, 4), _randn(g, 2, 4, 3).transpose(1, 2))),
    "batch_size_one": Case(p_batched, lambda g: (_x(g, 3, 4), _randn(g, 1, 3, 4))),
    "allow_unused": Case(p_allow_unused, lambda g: (_x(g, 3), _x(g, 2), _randn(g, 4, 3))),
    "materialize_grads": Case(p_materialize, lambda g: (_x(g, 3), _x(g, 2), _randn(g, 4, 3))),
    "create_graph": Case(p_batched_create_graph, lambda g: (_x(g, 3), _randn(g, 4, 3))),
}

# Cases where Dynamo itself refuses the program under fullgraph=True (before
# any backend runs): the exception type Dynamo raises and a fragment of its
# message.  These are Dynamo's checks, not dynbatch's.
DYNAMO_REFUSES: dict[str, tuple[type[BaseException], str, str]] = {
    # torch/_dynamo/variables/torch.py (handle_autograd_grad) graph-breaks when
    # `inputs` is not a tensor or a sequence of tensors, before running anything.
    "inputs_not_tensors": (
        torch._dynamo.exc.Unsupported, "autograd.grad with unsupported argument type",
        "Dynamo validates grad()'s argument types itself"),
    # Dynamo tracks which grad_fns an earlier captured grad consumed and
    # graph-breaks on a second grad through them (same file).
    "second_backward_through_freed_graph": (
        torch._dynamo.exc.Unsupported, "autograd.grad with already consumed grad_fn",
        "Dynamo refuses a second backward through a consumed graph itself"),
}


def _run(fn: Callable, case: Case) -> tuple[str, Any]:
    return outcome(fn, *case.make_args(_g()))


def _assert_same_values(got: Any, want: Any, name: str) -> None:
    flat_got, spec_got = torch.utils._pytree.tree_flatten(got)
    flat_want, spec_want = torch.utils._pytree.tree_flatten(want)
    assert spec_got == spec_want, f"{name}: result structure {spec_got} vs eager {spec_want}"
    for i, (a, e) in enumerate(zip(flat_got, flat_want)):
        if isinstance(e, torch.Tensor):
            assert isinstance(a, torch.Tensor), f"{name}: leaf {i} is {type(a)}"
            assert a.dtype == e.dtype, f"{name}: leaf {i} dtype {a.dtype} vs eager {e.dtype}"
            assert_same_grads([a], [e], msg=f"{name} leaf {i}")
        else:
            assert a == e, f"{name}: leaf {i}: {a!r} vs eager {e!r}"


def _skip_without_device(case: Case) -> None:
    if case.needs_cuda and not torch.cuda.is_available():
        pytest.skip(reason="needs a CUDA device: this machine has none")


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "graph_breaks_allowed"])
@pytest.mark.parametrize("name", sorted(REJECTED))
def test_rejected_like_eager(name, fullgraph, caplog):
    case = REJECTED[name]
    _skip_without_device(case)
    e_kind, expected = _run(case.program, case)
    assert e_kind == "raise", f"{name}: eager accepts this program now: {expected!r}"
    compiled = compile_dynbatch(case.program, fullgraph=fullgraph, options=FALLBACK)
    with caplog.at_level(logging.WARNING, logger="dynbatch"):
        kind, got = _run(compiled, case)
    assert kind == "raise", f"{name}: compiled returned {got!r}, eager raises {expected!r}"
    if name in DYNAMO_REFUSES:
        if fullgraph:
            exc_type, fragment, _why = DYNAMO_REFUSES[name]
            assert isinstance(got, exc_type) and fragment in str(got), (
                f"{name}: expected Dynamo's refusal {exc_type.__name__} ({fragment!r}), "
                f"got {type(got).__name__}: {got}")
            assert not dynbatch.counters().get("graphs"), dynbatch.counters()
            return
        # Dynamo graph-breaks at the grad call, so eager runs it: no dynbatch fallback.
        assert_same_exception(got, expected, name)
        assert graph_breaks() > 0
        assert not dynbatch.counters().get("fallbacks"), dynbatch.fallback_reasons()
        return
    assert_same_exception(got, expected, name)
    # dynbatch got the whole grad call in one graph (no graph break), could not
    # batch it and ran it eagerly: one fallback, counted and logged with its reason.
    assert graph_breaks() == 0
    assert dynbatch.counters().get("graphs") == 1, dynbatch.counters()
    assert_fell_back(caplog)


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "graph_breaks_allowed"])
@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_accepted_like_eager(name, fullgraph):
    case = ACCEPTED[name]
    e_kind, expected = _run(case.program, case)
    assert e_kind == "ok", f"{name}: eager rejects this program now: {expected!r}"
    compiled = compile_dynbatch(case.program, fullgraph=fullgraph)  # on_unsupported="error"
    kind, got = _run(compiled, case)
    assert kind == "ok", f"{name}: compiled raises {type(got).__name__}: {got}"
    _assert_same_values(got, expected, name)
    # The batched path, in one graph, under fullgraph=False as well.
    c = dynbatch.counters()
    assert c.get("graphs") == c.get("graphs_batched") == 1 and not c.get("fallbacks"), c
    assert graph_breaks() == 0


# A fragment of the message of each of eager's checks of grad()'s arguments that a user
# can trip, from torch.autograd (_make_grads, grad, vmap) and the engine; a tuple where
# the supported torch versions word it differently.
EAGER_CHECKS = (
    "If `is_grads_batched=True`, we interpret the first dimension",  # batched shape
    "Mismatch in shape",  # unbatched shape
    "For complex Tensors, both grad_output and output are required to have the same dtype",
    "grad can be implicitly created only for scalar outputs",
    "grad can be implicitly created only for real scalar outputs",
    "invalid index of a 0-dim tensor",  # a 0-dim batched grad_output
    "index 0 is out of bounds for dimension 0 with size 0",  # B = 0
    "Expected all tensors to have the same size in the mapped dimension",  # batch sizes differ
    "got 2 tensors and 1 gradients",
    "gradients can be either Tensors or None",
    ("`inputs` argument to `grad()` cannot be empty", "grad requires non-empty inputs"),  # 2.13+, 2.11
    "does not require grad and does not have a grad_fn",  # an output
    "One of the differentiated Tensors does not require grad",  # an input
    "appears to not have been used in the graph",
    "Expected allow_unused to be True or not passed when materialize_grads=True",
    "modified by an inplace operation",
    "Trying to backward through the graph a second time",
    "expected device",
)


def test_corpus_covers_each_of_eagers_checks():
    """Each check in EAGER_CHECKS is what eager raises, at run time, for a case of
    REJECTED (test_rejected_like_eager compiles every case); every DYNAMO_REFUSES
    entry names a case, so none of its expectations goes unused."""
    messages = [str(_run(case.program, case)[1]) for case in REJECTED.values() if not case.needs_cuda]
    missing = [check for check in EAGER_CHECKS
               if not any(fragment in m for fragment in _alternatives(check) for m in messages)]
    assert not missing, (missing, messages)
    assert set(DYNAMO_REFUSES) <= set(REJECTED)


def _alternatives(check: str | tuple[str, ...]) -> tuple[str, ...]:
    return check if isinstance(check, tuple) else (check,)


def test_on_unsupported_error_raises_with_the_reason():
    """The suite's default, on_unsupported="error": where test_rejected_like_eager
    falls back, dynbatch raises UnsupportedGraph with the reason instead."""
    case = REJECTED["batched_shape_mismatch"]
    _, expected = _run(case.program, case)
    # Dynamo wraps every backend exception in BackendCompilerFailed.
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        compile_dynbatch(case.program)(*case.make_args(_g()))
    assert isinstance(info.value.inner_exception, dynbatch.UnsupportedGraph)
    assert "If `is_grads_batched=True`" in str(info.value.inner_exception)
    assert str(expected) in str(info.value.inner_exception)  # the reason quotes eager's message


def test_good_call_after_bad_call_compiles_and_batches(caplog):
    compiled = compile_dynbatch(p_batched, options=FALLBACK)
    with caplog.at_level(logging.WARNING, logger="dynbatch"):
        with pytest.raises(RuntimeError):
            compiled(*REJECTED["batched_shape_mismatch"].make_args(_g()))
    assert_fell_back(caplog)
    x, V = _x(_g(1), 3, 4), _randn(_g(2), 2, 3, 4)
    assert_same_grads(compiled(x, V), p_batched(x, V))
    c = dynbatch.counters()  # the good shapes compile a second graph, batched
    assert c["graphs"] == 2 and c["graphs_batched"] == 1 and c["fallbacks"] == 1, c


# --- shape_checks on its own: eager's messages, no specialisation of B ---------

def _make_grads_error(outputs, grads):
    with pytest.raises(Exception) as info:
        torch.autograd._make_grads(outputs, grads, is_grads_batched=True)
    return info.value


@pytest.mark.parametrize("grad", [torch.randn(2, 3, 5), torch.randn(2, 3, 4, dtype=torch.complex64)])
def test_shape_checks_messages_equal_make_grads(grad):
    out = torch.randn(3, 4, requires_grad=True) * 1
    expected = _make_grads_error((out,), (grad,))
    with pytest.raises(type(expected)) as info:
        shape_checks.check_grad_outputs((out,), (grad,), is_grads_batched=True)
    assert str(info.value) == str(expected)


def test_shape_checks_keep_batch_size_symbolic():
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    shape_env = ShapeEnv()
    mode = FakeTensorMode(shape_env=shape_env)
    ctx = StatelessSymbolicContext(
        dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC, DimDynamic.STATIC], constraint_sizes=[None] * 3
    )
    V = mode.from_tensor(torch.randn(5, 3, 4), source=ConstantSource("V"), symbolic_context=ctx)
    with mode:
        out = torch.empty(3, 4)
        shape_checks.check_grad_outputs((out,), (V,), is_grads_batched=True)
    assert isinstance(V.shape[0], torch.SymInt)
    assert not V.shape[0].node.expr.is_number  # B was not specialised
    guards = [str(g.expr) for g in shape_env.guards]
    assert not any(str(V.shape[0].node.expr) + " == 5" in g for g in guards), guards


def test_shape_checks_name_both_batch_sizes():
    out = torch.randn(3, requires_grad=True) * 1
    with pytest.raises(ValueError, match="batch size 2 .* batch size 5"):
        shape_checks.check_grad_outputs((out, out), (torch.randn(2, 3), torch.randn(5, 3)), is_grads_batched=True)


# --- options ---------------------------------------------------------------------

def test_unknown_dynbatch_option_lists_known_ones():
    with pytest.raises(ValueError, match=r"dynbatch.inner_compiler"):
        Options.from_compile_args(None, {"dynbatch.inner_compilr": "aot_eager"})


@pytest.mark.parametrize("name, values, bad", [
    ("keep_cpu_buffers", [True, "large", False], ["largest", 1, None]),
    ("aot_cache", [True, "with_backward", False], ["backward", 1, None]),
])
def test_an_option_of_a_few_values_takes_each_and_names_them_for_another(name, values, bad):
    for good in values:
        assert getattr(Options.from_compile_args(None, {f"dynbatch.{name}": good}), name) == good
    for value in bad:
        with pytest.raises(ValueError, match=rf"{name}=.*choose one of {re.escape(str(values))}"):
            Options.from_compile_args(None, {f"dynbatch.{name}": value})


def test_unknown_option_at_compile_time_raises():
    # The user's torch.compile(options=...), not compile_dynbatch: the options as given reach dynbatch.
    compiled = torch.compile(p_batched, backend="dynbatch", options={"dynbatch.nope": 1})
    with pytest.raises(Exception, match="known dynbatch options"):
        compiled(torch.randn(3, 4, requires_grad=True), torch.randn(2, 3, 4))


def test_unknown_inductor_option_raises_like_inductor():
    with pytest.raises(RuntimeError, match="Unexpected optimization option not_an_option"):
        Options.from_compile_args(None, {"not_an_option": True})


def test_mode_and_options_reach_inductor(monkeypatch):
    from dynbatch import _compat

    seen = []
    real = _compat.compile_fx

    def spy(gm, example_inputs, *, inner_compile, config_patches):
        seen.append(dict(config_patches))
        return real(gm, example_inputs, inner_compile=inner_compile, config_patches=config_patches)

    monkeypatch.setattr(_compat, "compile_fx", spy)
    x, V = torch.randn(3, 4, requires_grad=True), torch.randn(2, 3, 4)
    # The user's torch.compile(mode=, options=), not compile_dynbatch: nothing but these reaches Inductor.
    torch.compile(p_batched, backend="dynbatch", options={"epilogue_fusion": False})(x, V)
    assert seen[-1]["epilogue_fusion"] is False
    torch._dynamo.reset()
    # reduce-overhead: cheap to compile here (CUDA graphs are skipped on the CPU)
    torch.compile(p_batched, backend="dynbatch", mode="reduce-overhead")(x, V)
    assert seen[-1]["triton.cudagraphs"] is True
    assert Options.from_compile_args("max-autotune-no-cudagraphs", None).inductor_config["max_autotune"] is True
