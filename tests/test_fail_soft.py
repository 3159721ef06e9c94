"""Failing soft when torch internals move (docs/design.md, "Torch versions").

Each test breaks one hook the way a new torch release could, and checks that
the feature turns off with one warning naming it while compiles go on with
eager's values: never a crash of every compile, never a wrong gradient.
The hooks are Dynamo's and the batching pass's, so the compiles take
``aot_eager`` (FALLBACK: a graph dynbatch cannot batch runs eagerly, as for
a user); Inductor would add its compile time and nothing these tests check.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.torch_version import TorchVersion

import dynbatch
from conftest import FALLBACK, assert_same_grads, compile_dynbatch
from test_parity import Square
from dynbatch import _compat, fail_soft
from dynbatch.batching import batch_rules
from dynbatch.capture import autograd_functions, grad_calls, fake_cuda_guard, requires_grad_tracing
from dynbatch.lowering import inductor

W = torch.randn(6, 6, generator=torch.Generator().manual_seed(0)) / 3


def vjp(x, V):
    return torch.autograd.grad(torch.tanh(x @ W), x, V, is_grads_batched=True)


def args(B=3):
    return torch.randn(4, 6, requires_grad=True), torch.randn(B, 4, 6)


@pytest.fixture(autouse=True)
def fresh_hooks():
    fail_soft.HOOK_FAILURES.clear()
    fail_soft._WARNED.clear()
    yield
    fail_soft.HOOK_FAILURES.clear()
    fail_soft._WARNED.clear()


def _hook_warnings(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, RuntimeWarning) and "dynbatch" in str(w.message)]


def test_a_refactored_compile_entry_point_turns_capture_off():
    """A plain (*args, **kwargs) wrapper around convert_frame._compile, as a refactor
    in a new torch could leave it: before, every dynbatch compile raised
    "ValueError: 'compiler_fn' is not in list"."""
    import torch._dynamo.convert_frame as convert_frame

    # dynbatch's wrapper off: the refactored entry point is what torch would ship
    convert_frame._compile = getattr(convert_frame._compile, "_dynbatch_original", convert_frame._compile)
    stock = convert_frame._compile

    def _compile(*a, **k):
        return stock(*a, **k)

    convert_frame._compile = _compile
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            grad_calls.install()
        assert any("capture" in m and "compiler_fn" in m for m in _hook_warnings(seen)), _hook_warnings(seen)
        x, V = args()
        assert_same_grads(compile_dynbatch(vjp, options=FALLBACK, fullgraph=False)(x, V), vjp(x, V))
        assert not dynbatch.counters().get("grads_batched"), dynbatch.counters()  # stock Dynamo: eager grad
    finally:
        convert_frame._compile = stock
        grad_calls.install()
    assert convert_frame._compile._dynbatch_original is stock


def test_a_capture_piece_that_cannot_enter_is_off_and_the_rest_works(monkeypatch):
    def moved(module_name):
        raise AttributeError("trace_rules.get_torch_obj_rule_map")

    monkeypatch.setattr(grad_calls, "dynamo_inlines_module", moved)

    def jac(x):
        return torch.autograd.functional.jacobian(lambda z: torch.tanh(z @ W), x, vectorize=True)

    x = torch.randn(3, 6)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert_same_grads(compile_dynbatch(jac, options=FALLBACK, fullgraph=False)(x), jac(x))
        xv, V = args()
        assert_same_grads(compile_dynbatch(vjp, options=FALLBACK)(xv, V), vjp(xv, V))
    messages = _hook_warnings(seen)
    assert sum("tracing into torch.autograd.functional" in m for m in messages) == 1, messages
    assert dynbatch.counters()["grads_batched"] >= 1  # plain is_grads_batched code still batched


def test_a_moved_requires_grad_hook_leaves_dynamos_graph_break(monkeypatch):
    # The MACE idiom then graph-breaks at pos.requires_grad_() as under stock Dynamo.
    def moved():
        raise AttributeError("InstructionTranslatorBase.dispatch_table")

    monkeypatch.setattr(requires_grad_tracing, "dynamo_traces_requires_grad_of_inputs", moved)

    def forces(w, pos):
        pos.requires_grad_(True)
        energy = torch.tanh(pos @ w).sum()
        return energy, torch.autograd.grad(energy, pos, create_graph=True)[0]

    w, pos = torch.randn(3, 3, requires_grad=True), torch.randn(4, 3)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = compile_dynbatch(forces, options=FALLBACK, fullgraph=False)(w, pos.clone())
    want = forces(w, pos.clone())
    assert_same_grads(got, want)
    assert_same_grads(torch.autograd.grad(got[1].sum(), w), torch.autograd.grad(want[1].sum(), w))
    messages = _hook_warnings(seen)
    assert sum("tracing requires_grad_() of graph inputs" in m for m in messages) == 1, messages
    assert any("requires_grad" in reason for reason in torch._dynamo.utils.counters["graph_break"]), \
        dict(torch._dynamo.utils.counters["graph_break"])


def test_a_moved_autograd_function_hook_warns_and_first_order_grads_stay_eagers(monkeypatch):
    # Without it a Function's backward is traced as stock traces it: under no_grad.
    def moved():
        raise AttributeError("AutogradFunctionApplyVariable.trace_backward_graph")

    monkeypatch.setattr(autograd_functions, "dynamo_traces_backwards_in_their_grad_mode", moved)

    def forces(pos):
        return torch.autograd.grad(Square.apply(pos).sin().sum(), pos)[0]

    pos = torch.randn(4, 3, requires_grad=True)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = compile_dynbatch(forces, options=FALLBACK)(pos)
    assert_same_grads(got, forces(pos))
    messages = _hook_warnings(seen)
    assert sum("autograd.Function backwards traced differentiable" in m for m in messages) == 1, messages


def test_a_batching_rule_for_an_op_this_torch_lacks_keeps_functorchs(monkeypatch):
    ours = batch_rules.all_rules()
    monkeypatch.setattr(batch_rules, "all_rules", lambda: {**ours, "not_an_op_in_this_torch": lambda *a: None})
    x, V = args()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for B in (3, 5, 8):
            x, V = args(B)
            assert_same_grads(compile_dynbatch(vjp, options=FALLBACK)(x, V), vjp(x, V))
    messages = _hook_warnings(seen)
    assert sum("aten::not_an_op_in_this_torch" in m for m in messages) == 1, messages
    c = dynbatch.counters()
    assert c["graphs"] == c["graphs_batched"] == 2 and not c.get("fallbacks"), c  # B stays symbolic


def test_an_untested_torch_warns_once_at_first_compile(monkeypatch):
    monkeypatch.setattr(_compat, "TORCH_VERSION", TorchVersion("2.15.0"))
    x, V = args()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        compiled = compile_dynbatch(vjp, options=FALLBACK)
        assert not _hook_warnings(seen)  # nothing before the first compile
        compiled(x, V)
        compiled(*args(5))
    messages = [m for m in _hook_warnings(seen) if "tested on torch" in m]
    assert len(messages) == 1 and "2.15.0" in messages[0], messages


def test_on_unsupported_error_raises_unsupported_graph_for_a_lowering_failure(monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("an Inductor internal moved")

    monkeypatch.setattr(inductor, "lower", broken)
    x, V = args()
    with pytest.raises(Exception) as raised:
        compile_dynbatch(vjp, fullgraph=False)(x, V)  # AOT_EAGER: on_unsupported="error"
    chain, e = [], raised.value
    while e is not None:
        chain.append(e)
        e = e.__cause__ or e.__context__
    ours = [e for e in chain if isinstance(e, dynbatch.UnsupportedGraph)]
    assert ours and "lowering the batched graph failed: RuntimeError: an Inductor internal moved" in str(ours[0])
    torch._dynamo.reset()
    dynbatch.reset()
    # the same failure under "fallback" gives eager's values
    assert_same_grads(compile_dynbatch(vjp, options=FALLBACK, fullgraph=False)(x, V), vjp(x, V))
    assert dynbatch.counters()["fallbacks"] == 1


def test_a_failing_fake_cuda_guard_workaround_is_off_and_compiles_work(monkeypatch):
    """The thread workaround for FakeTensorMode's CUDA guard (``fake_cuda_guard``) calls a
    private torch function; if it raises, only threads are at risk again."""
    monkeypatch.setattr(fake_cuda_guard, "_FAKE_CUDA_GUARD_PINNED", False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def moved():
        raise RuntimeError("moved")

    monkeypatch.setattr(torch._C, "_ensureCUDADeviceGuardSet", moved, raising=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fake_cuda_guard.fake_cuda_guard_outlives_threads()
    assert any("CUDA guard" in m for m in _hook_warnings(seen)), _hook_warnings(seen)
    monkeypatch.undo()  # the real torch again for the compile
    x, V = args()
    got = compile_dynbatch(vjp, options=FALLBACK)(x, V)
    assert_same_grads(got, torch.autograd.grad(torch.tanh(x @ W), x, V, is_grads_batched=True))
    assert dynbatch.counters()["graphs_batched"] == 1
