"""Bad input raises eager's exception and message; options are validated — issue 2 items 5-7."""

from __future__ import annotations

import logging

import pytest
import torch

import dynbatch
from dynbatch import shape_checks
from dynbatch.options import Options
from conftest import AOT_EAGER, compile_dynbatch

FALLBACK = {**AOT_EAGER, "dynbatch.on_unsupported": "fallback"}
W = torch.randn(4, 4)


def vjp_program(x, V):
    return torch.autograd.grad(torch.tanh(x @ W), x, V, is_grads_batched=True)


def two_output_program(x, V1, V2):
    return torch.autograd.grad((x.sin(), x.cos()), x, (V1, V2), is_grads_batched=True)


def implicit_program(x):
    return torch.autograd.grad(x.sin(), x, None, is_grads_batched=True)


CASES = {
    "batched_shape_mismatch": (vjp_program, lambda: (torch.randn(3, 4, requires_grad=True), torch.randn(2, 3, 5))),
    "complex_grad_for_real_output": (vjp_program, lambda: (torch.randn(3, 4, requires_grad=True), torch.randn(2, 3, 4, dtype=torch.complex64))),
    "implicit_grad_of_non_scalar": (implicit_program, lambda: (torch.randn(3, requires_grad=True),)),
    "batch_sizes_disagree": (two_output_program, lambda: (torch.randn(3, requires_grad=True), torch.randn(2, 3), torch.randn(5, 3))),
    "batch_size_zero": (vjp_program, lambda: (torch.randn(3, 4, requires_grad=True), torch.randn(0, 3, 4))),
}


def eager_error(fn, args):
    with pytest.raises(Exception) as info:
        fn(*args)
    return info.value


@pytest.mark.parametrize("fullgraph", [True, False])
@pytest.mark.parametrize("case", sorted(CASES))
def test_compiled_error_is_eagers(case, fullgraph, caplog):
    fn, make_args = CASES[case]
    args = make_args()
    expected = eager_error(fn, args)
    compiled = compile_dynbatch(fn, options=FALLBACK, fullgraph=fullgraph)
    with caplog.at_level(logging.WARNING, logger="dynbatch"):
        with pytest.raises(Exception) as info:
            compiled(*args)
    assert type(info.value) is type(expected)
    assert str(info.value) == str(expected)
    # It was compiled (no graph break) and the fallback was logged and counted.
    assert dynbatch.counters()["fallbacks"] == 1
    assert "falling back to eager" in caplog.text


def test_on_unsupported_error_raises_with_the_reason():
    fn, make_args = CASES["batched_shape_mismatch"]
    # Dynamo wraps every backend exception in BackendCompilerFailed.
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        compile_dynbatch(fn)(*make_args())
    assert isinstance(info.value.inner_exception, dynbatch.UnsupportedGraph)
    assert "If `is_grads_batched=True`" in str(info.value.inner_exception)


def test_good_call_after_bad_call_compiles_and_batches():
    compiled = compile_dynbatch(vjp_program, options=FALLBACK)
    with pytest.raises(RuntimeError):
        compiled(torch.randn(3, 4, requires_grad=True), torch.randn(2, 3, 5))
    x, V = torch.randn(3, 4, requires_grad=True), torch.randn(2, 3, 4)
    torch.testing.assert_close(compiled(x, V), vjp_program(x, V))
    assert dynbatch.counters()["graphs_batched"] == 1


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
    from torch.fx.experimental.symbolic_shapes import ShapeEnv, DimDynamic, StatelessSymbolicContext

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


# --- options (item 6) ----------------------------------------------------------

def test_unknown_dynbatch_option_lists_known_ones():
    with pytest.raises(ValueError, match=r"dynbatch.inner_compiler"):
        Options.from_compile_args(None, {"dynbatch.inner_compilr": "aot_eager"})


def test_unknown_option_at_compile_time_raises():
    compiled = torch.compile(vjp_program, backend="dynbatch", options={"dynbatch.nope": 1})
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
    torch.compile(vjp_program, backend="dynbatch", options={"epilogue_fusion": False})(x, V)
    assert seen[-1]["epilogue_fusion"] is False
    torch._dynamo.reset()
    # reduce-overhead: cheap to compile here (CUDA graphs are skipped on the CPU)
    torch.compile(vjp_program, backend="dynbatch", mode="reduce-overhead")(x, V)
    assert seen[-1]["triton.cudagraphs"] is True
    assert Options.from_compile_args("max-autotune-no-cudagraphs", None).inductor_config["max_autotune"] is True
