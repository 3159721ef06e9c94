"""A frame traced aside: with ``options={"dynbatch.compile": "background"}`` a frame's first
calls run eagerly while Dynamo traces it on another thread (NOTE [Traced aside] in
dynbatch/capture/traced_aside.py).  Every call must give eager's values, before, at and after
the handover; the counters must say which ran; a state that changed since the first call
must compile on the calling thread, never run a graph traced for another; no thread may be
left behind.  The inner compiler is aot_eager here (test_background_compile.py runs the
Inductor worker behind it).
"""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

import dynbatch
from conftest import assert_backend_ran, assert_same_grads, compile_dynbatch, until_traced_aside
from dynbatch.capture import traced_aside
from test_background_compile import checked_vjp_call, vjp_rows

ASIDE = {"dynbatch.compile": "background"}


def _counts():
    c = dynbatch.counters()
    return {k: c.get(k, 0) for k in ("traced_aside", "aside_eager_calls", "aside_handovers", "aside_guard_misses")}


def _aside_threads():
    return [t for t in threading.enumerate() if t.name.startswith("dynbatch-trace-aside")]


def test_the_first_calls_run_eagerly_until_the_trace_aside_is_handed_over():
    call = checked_vjp_call(compile_dynbatch(vjp_rows, options=ASIDE))
    call()
    assert _counts() == {"traced_aside": 1, "aside_eager_calls": 1, "aside_handovers": 0, "aside_guard_misses": 0}
    until_traced_aside(call)
    handed = _counts()
    assert handed["traced_aside"] == 1 and handed["aside_handovers"] == 1, handed
    assert not _aside_threads()
    assert_backend_ran(graphs=1, batched=1)
    # A repeat compiles nothing and runs the compiled code.
    for _ in range(3):
        call()
    assert _counts() == handed
    assert_backend_ran(graphs=1, batched=1)


class ForcesModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

    def forward(self, pos):
        pos.requires_grad_(True)
        diff = pos.unsqueeze(1) - pos.unsqueeze(0)
        r = ((diff * diff).sum(-1) + torch.eye(pos.shape[0], dtype=pos.dtype)).sqrt()
        energy = (self.mlp(r.unsqueeze(-1)).squeeze(-1) * torch.ones_like(r).triu(1)).sum()
        return energy, -torch.autograd.grad(energy, pos, create_graph=True)[0]


def _training_step(model):
    def step(pos, e_ref, f_ref):
        energy, forces = model(pos)
        loss = (energy - e_ref) ** 2 + ((forces - f_ref) ** 2).mean()
        loss.backward()
        return loss.detach()

    return step


def test_a_compiled_training_step_gets_eager_grads_while_its_calls_set_them():
    """Each step sets every parameter's ``.grad``, which the trace reads: it traces a copy
    made at the first call, so its graph and its guards agree (the live objects changed
    under it: Dynamo failed building a guard on a ``.grad``)."""
    torch.manual_seed(0)
    eager = ForcesModel().double()
    model = ForcesModel().double()
    model.load_state_dict(eager.state_dict())
    compiled = torch.compile(_training_step(model), backend="dynbatch", fullgraph=True, options=ASIDE)
    gen = torch.Generator().manual_seed(1)

    def call():
        pos = torch.randn(6, 3, dtype=torch.float64, generator=gen)
        e_ref = torch.randn((), dtype=torch.float64, generator=gen)
        f_ref = torch.randn(6, 3, dtype=torch.float64, generator=gen)
        for m in (model, eager):
            for p in m.parameters():
                p.grad = None
        loss = compiled(pos, e_ref, f_ref)
        assert_same_grads(loss, _training_step(eager)(pos.clone(), e_ref, f_ref))
        assert_same_grads(tuple(p.grad for p in model.parameters()), tuple(p.grad for p in eager.parameters()))

    until_traced_aside(call)
    for _ in range(2):
        call()
    c = _counts()
    assert c["aside_handovers"] == 1 and c["aside_guard_misses"] == 0, c
    assert_backend_ran(graphs=1)


class Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = 2  # a Python int: Dynamo specialises the graph on it

    def forward(self, x, V):
        return vjp_rows(x, V) * self.scale


def test_a_state_changed_since_the_first_call_compiles_on_the_calling_thread(caplog):
    model = Scaled()
    compiled = compile_dynbatch(model, options=ASIDE)
    x, V = torch.randn(5, 6, dtype=torch.float64), torch.randn(3, 5, 6, dtype=torch.float64)
    assert_same_grads(compiled(x, V), model(x, V))  # the trace aside copies scale = 2
    model.scale = 3
    with caplog.at_level(logging.INFO, logger="dynbatch"):
        while _counts()["aside_guard_misses"] == 0:
            assert_same_grads(compiled(x, V), model(x, V))  # eagerly, then compiled here: scale = 3
            assert _counts()["aside_handovers"] == 0, _counts()
    assert "its guards fail on this call's objects" in caplog.text, caplog.text
    for _ in range(2):
        assert_same_grads(compiled(x, V), model(x, V))
    # The graph traced aside (scale = 2) and the one compiled here (scale = 3); no other.
    assert_backend_ran(graphs=2, batched=2)
    assert _counts()["aside_handovers"] == 0


def test_a_recompile_traces_on_the_calling_thread_with_the_reason_logged(caplog):
    compiled = compile_dynbatch(vjp_rows, options=ASIDE)
    x = torch.randn(5, 6, dtype=torch.float64)
    until_traced_aside(lambda: compiled(x, torch.randn(3, 5, 6, dtype=torch.float64)))
    before = _counts()
    y, V = torch.randn(7, 6, dtype=torch.float64), torch.randn(3, 7, 6, dtype=torch.float64)
    with caplog.at_level(logging.INFO, logger="dynbatch"):
        got = compiled(y, V)  # 7 rows, not 5: the guards fail, a recompile
    assert_same_grads(got, vjp_rows(y, V))
    assert "a recompile" in caplog.text, caplog.text
    assert _counts() == before
    assert_backend_ran(graphs=2, batched=2)


def test_random_numbers_drawn_while_a_frame_is_traced_aside_are_not_drawn_again():
    """Dynamo restores the generator state it saved when its trace began; on the thread
    that restore would rewind the numbers the user's calls drew meanwhile."""
    compiled = compile_dynbatch(vjp_rows, options=ASIDE)
    x, V = torch.randn(5, 6, dtype=torch.float64), torch.randn(3, 5, 6, dtype=torch.float64)
    drawn = []
    until_traced_aside(lambda: (compiled(x, V), drawn.append(torch.rand(4))))
    drawn += [torch.rand(4) for _ in range(50)]
    assert len(drawn) > 50
    assert len({tuple(d.tolist()) for d in drawn}) == len(drawn), "a random number was drawn twice"
    assert torch.random.set_rng_state is traced_aside._set_rng_state  # restored once no trace runs


def test_reset_waits_for_a_trace_aside_and_leaves_no_thread():
    compiled = compile_dynbatch(vjp_rows, options=ASIDE)
    x, V = torch.randn(5, 6, dtype=torch.float64), torch.randn(3, 5, 6, dtype=torch.float64)
    assert_same_grads(compiled(x, V), vjp_rows(x, V))
    assert _counts()["traced_aside"] == 1
    dynbatch.reset()
    assert not _aside_threads()
    assert traced_aside._ASIDE == {}
    assert_same_grads(compiled(x, V), vjp_rows(x, V))


_211 = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < (2, 12)


_EXIT_MID_TRACE = """
import atexit, threading

def alive_after_dynbatch_stopped():  # registered before dynbatch's own handler: runs after it
    print("alive at exit:", [t.name for t in threading.enumerate()
                             if t.name.startswith(("dynbatch-trace-aside", "dynbatch-compile-aside",
                                                   "dynbatch-background"))])

atexit.register(alive_after_dynbatch_stopped)

import torch, dynbatch
from torch.autograd import functional

model = torch.compile(torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh()).double(),
                      backend="dynbatch", options={"dynbatch.compile": "background"})

def users_hessian(pos):
    return functional.hessian(lambda p: model(p).sum(), pos, vectorize=True)

users_hessian(torch.randn(5, 3, dtype=torch.double))  # the trace starts as it returns; the script ends
"""


def test_a_process_that_ends_while_a_trace_runs_aside_waits_for_it(tmp_path):
    """A thread still inside torch when the interpreter finalizes aborts the process
    ("terminate called without an active exception"): at exit dynbatch waits for the traces
    and compiles running aside, then stops the worker (``dynbatch._stop_compiles``)."""
    import os
    import subprocess
    import sys

    script = tmp_path / "exit_mid_trace.py"
    script.write_text(_EXIT_MID_TRACE)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert "alive at exit: []" in out.stdout, out.stdout


@pytest.mark.parametrize("fullgraph", [True, pytest.param(False, marks=pytest.mark.xfail(
    _211, strict=False, reason="torch 2.11: once a frame was traced aside and Dynamo reset, the resume "
                              "function after a later frame's break is not compiled (its calls stay eager)"))])
def test_a_graph_break_is_met_as_on_the_calling_thread(fullgraph):
    def breaks(x, V):
        torch._dynamo.graph_break()
        return vjp_rows(x, V)

    x, V = torch.randn(5, 6, dtype=torch.float64), torch.randn(3, 5, 6, dtype=torch.float64)
    compiled = compile_dynbatch(breaks, options=ASIDE, fullgraph=fullgraph)
    deadline = time.monotonic() + 120
    if fullgraph:  # eagerly while it is traced aside; then the trace's error, raised here
        with pytest.raises(torch._dynamo.exc.Unsupported):
            while time.monotonic() < deadline:
                assert_same_grads(compiled(x, V), vjp_rows(x, V))
        assert _counts()["aside_handovers"] == 0
        return
    # The frame's code before the break, then the code after it (its resume function, or on
    # torch 2.11 the function it calls), each traced aside or compiled here, until one graph ran.
    while dynbatch.counters().get("graphs", 0) == 0 or _counts()["traced_aside"] > _counts()["aside_handovers"]:
        assert_same_grads(compiled(x, V), vjp_rows(x, V))
        assert time.monotonic() < deadline, _counts()
    before = _counts()
    assert_same_grads(compiled(x, V), vjp_rows(x, V))
    assert _counts() == before
    assert_backend_ran(graphs=1, batched=1)


def _outside_paths():
    return {k: v for k, v in dynbatch.counters().items() if k.startswith("outside_")}


def test_a_hessian_around_a_compiled_model_waits_for_none_of_its_outside_programs():
    """``functional.hessian`` around a compiled PaiNN-style model (NOTE [Outside paths aside] in
    dynbatch/region/paths.py): the forward that returns the energy's grads is a frame traced
    aside, the batched backward of its saved activations compiles on a thread; meanwhile each
    Hessian is eager's, by the eager path.  Nothing else compiles for the request (no
    recomputing program), and once both have arrived a repeat compiles nothing."""
    import torch.autograd.functional as AF

    from test_outside import MessagePassing

    torch.manual_seed(0)
    model = MessagePassing().double()
    m = compile_dynbatch(model, fullgraph=False, options=ASIDE)
    pos = torch.randn(6, 3, dtype=torch.float64)

    def call():
        assert_same_grads(AF.hessian(m, pos, vectorize=True), AF.hessian(model, pos, vectorize=True))

    deadline = time.monotonic() + 300
    while _counts()["aside_handovers"] < 2 or not _outside_paths().get("outside_batched_saved"):
        call()
        assert time.monotonic() < deadline, (_counts(), _outside_paths())
        time.sleep(0.01)
    first = dict(dynbatch.counters()), sum(torch._dynamo.utils.counters["frames"].values())
    paths = _outside_paths()
    # The model's frame and the forward with grads were traced aside; the outside programs'
    # first calls ran eagerly; the one path per request is the saved activations'.
    assert _counts()["traced_aside"] == 2 and _counts()["aside_guard_misses"] == 0, _counts()
    assert dynbatch.counters().get("compiled_aside") == 1, dynbatch.counters()  # the saved activations' program
    assert paths.get("outside_eager_while_aside", 0) >= 2, paths
    assert "outside_batched_compiled" not in paths and "outside_eager" not in paths, paths
    for _ in range(2):
        call()
    again = dynbatch.counters()
    assert {k: v for k, v in again.items() if not k.startswith("outside_")} == \
        {k: v for k, v in first[0].items() if not k.startswith("outside_")}, (first[0], again)
    assert sum(torch._dynamo.utils.counters["frames"].values()) == first[1]
    assert _outside_paths() == {**paths, "outside_grads_at_forward": paths["outside_grads_at_forward"] + 2,
                                "outside_batched_saved": paths["outside_batched_saved"] + 2}
    dynbatch.reset()
    assert not [t for t in threading.enumerate()
                if t.name.startswith(("dynbatch-trace-aside", "dynbatch-compile-aside"))]


def test_a_trace_waits_for_the_function_of_the_users_code_that_made_the_first_call():
    """A model's first call inside ``functional.hessian`` returns before the Hessian's backward
    runs: the trace waits until the user's function that called ``hessian`` has returned, not
    only the model's call (``traced_aside._entry_frame``, asked from the model's caller)."""
    import sys

    import torch.autograd.functional as AF

    seen = []

    def energy(x):
        seen.append(traced_aside._entry_frame(sys._getframe(1)))
        return (x ** 3).sum()

    def users_hessian(x):
        return AF.hessian(energy, x)

    def users_hessian_through_a_lambda(x):  # torch calls the user's lambda, which calls the model
        return AF.hessian(lambda y: energy(y), x)

    users_hessian(torch.randn(3, dtype=torch.float64))
    users_hessian_through_a_lambda(torch.randn(3, dtype=torch.float64))
    assert [f.f_code.co_name for f in seen] == ["users_hessian", "users_hessian_through_a_lambda"], seen
    seen.clear()
    energy(torch.randn(3))  # called by the user's code itself
    assert [f.f_code.co_name for f in seen] == [sys._getframe().f_code.co_name], seen


def test_calls_that_ran_eagerly_meanwhile_do_not_count_toward_dynamos_recompile_limit():
    """Dynamo numbers every call it is asked about, and a compile numbered past
    ``accumulated_recompile_limit`` fails: the calls that ran eagerly while the frame was traced
    aside take their numbers back, so a later recompile (another size) still compiles."""
    compiled = compile_dynbatch(vjp_rows, options=ASIDE)
    x = torch.randn(5, 6, dtype=torch.float64)
    with torch._dynamo.config.patch(accumulated_recompile_limit=3):
        for _ in range(5):  # before the trace starts (it waits for this function, a second at most)
            assert_same_grads(compiled(x, V := torch.randn(3, 5, 6, dtype=torch.float64)), vjp_rows(x, V))
        until_traced_aside(lambda: compiled(x, torch.randn(3, 5, 6, dtype=torch.float64)))
        assert _counts()["aside_eager_calls"] >= 5, _counts()
        y, V = torch.randn(7, 6, dtype=torch.float64), torch.randn(3, 7, 6, dtype=torch.float64)
        assert_same_grads(compiled(y, V), vjp_rows(y, V))  # 7 rows: a recompile, here
    assert_backend_ran(graphs=2, batched=2)
