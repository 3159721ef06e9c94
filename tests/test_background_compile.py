"""The background compile: ``options={"dynbatch.compile": "background"}``.

NOTE [Background compile] in dynbatch/lowering/background.py.  A graph's first calls run
its batched aten graphs with eager kernels while a worker process compiles them; the
compiled programs take over at a later call.  Every call must give eager PyTorch's values,
before and after the handover; the counters must show which program ran; the worker must
leave no process behind.  Each test compiles in an Inductor cache directory of its own, so
the worker's compile is cold: no FX-cache hit skips it, and it builds its C++ itself.
"""

from __future__ import annotations

import copy
import logging
import os
import time

import pytest
import torch

import dynbatch
from conftest import INDUCTOR, assert_backend_ran, assert_same_grads, compile_dynbatch, until_traced_aside
from dynbatch.lowering import background

BACKGROUND = {**INDUCTOR, "dynbatch.compile": "background"}
HANDOVER_TIMEOUT = 300.0  # seconds: a cold compile on a busy core, with room


@pytest.fixture(autouse=True)
def own_cache_and_quick_idle(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    # The worker stops this long after its last compile (the tests wait for that).
    monkeypatch.setattr(background, "IDLE_SECONDS", 0.2)


def _counts():
    c = dynbatch.counters()
    return {k: c.get(k, 0) for k in ("background_compiles", "background_compiles_finished",
                                     "background_compile_failures", "background_eager_calls",
                                     "background_compiled_calls")}


def _until_handed_over(call, programs):
    """Call ``call()`` (it checks its own values) until each of the ``programs`` compiled in
    the background ran its compiled code."""
    deadline = time.monotonic() + HANDOVER_TIMEOUT
    while True:
        before = _counts()
        call()
        after = _counts()
        if (before["background_compiles_finished"] == programs
                and after["background_compiled_calls"] - before["background_compiled_calls"] == programs
                and after["background_eager_calls"] == before["background_eager_calls"]):
            return
        assert after["background_compile_failures"] == 0, after
        assert time.monotonic() < deadline, f"no handover in {HANDOVER_TIMEOUT} s: {after}"
        time.sleep(0.05)  # the worker shares the cores


def _worker_processes():
    """Live processes of the background worker: Inductor's sidecar with ``--kind=spawn`` and
    the workers it spawned, found by this process group (an orphan keeps it) in /proc."""
    group, found = os.getpgid(0), set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                state, _, pgrp = f.read().rsplit(")", 1)[1].split()[:3]
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if state != "Z" and int(pgrp) == group and (
                ("compile_worker" in cmdline and "--kind=spawn" in cmdline) or "spawn_main" in cmdline):
            found.add(int(entry))
    return found


def _niceness(pid):
    """A process's nice value (/proc/PID/stat's 19th field), None once it has gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[16])
    except OSError:
        return None


def _assert_no_worker_left(before=frozenset(), timeout=30.0):
    deadline = time.monotonic() + timeout
    while _worker_processes() - before:
        assert time.monotonic() < deadline, f"worker processes left: {_worker_processes() - before}"
        time.sleep(0.05)


# --- a batched VJP ------------------------------------------------------------------

W = torch.randn(6, 6, dtype=torch.float64) / 2


def vjp_rows(x, V):
    x = x.detach().requires_grad_()
    y = torch.tanh(torch.tanh(x @ W) @ W.T)
    return torch.autograd.grad(y, x, V, is_grads_batched=True)[0]


def checked_vjp_call(compiled):
    """A call of ``compiled`` (``vjp_rows``) on new cotangents, checked against eager's."""
    x = torch.randn(5, 6, dtype=torch.float64)

    def call():
        V = torch.randn(3, 5, 6, dtype=torch.float64)
        assert_same_grads(compiled(x, V), vjp_rows(x, V))

    return call


def test_a_batched_vjp_runs_eager_kernels_until_inductor_takes_over():
    call = checked_vjp_call(compile_dynbatch(vjp_rows, options=BACKGROUND))
    before = _worker_processes()  # (another test's, if any, is not this one's to find)
    until_traced_aside(call)  # the first calls run eagerly while Dynamo traces (NOTE [Traced aside])
    first = _counts()
    # The first compiled call did not wait for the compile: it ran the eager kernels.
    assert first["background_compiles"] == 1 and first["background_eager_calls"] == 1, first
    assert first["background_compiled_calls"] == 0, first
    assert background._WORKER.pid() in _worker_processes()

    niceness = set()  # of the worker's processes, seen between calls
    _until_handed_over(lambda: (call(), niceness.update(_niceness(p) for p in _worker_processes() - before)),
                       programs=1)
    handed_over = _counts()
    assert handed_over["background_compiles_finished"] == 1, handed_over
    # The process that compiled ran below this one's priority (its C++ builds take what the
    # user's calls leave of the cores).
    assert os.nice(0) + background.WORKER_NICENESS in niceness, niceness
    # The compile finished: the worker stops once idle, and leaves no process.
    _assert_no_worker_left(before)

    # Later calls compile nothing and run the compiled code.
    for _ in range(2):
        call()
    after = _counts()
    assert after["background_compiles"] == 1, after
    assert after["background_eager_calls"] == handed_over["background_eager_calls"], after
    assert after["background_compiled_calls"] == handed_over["background_compiled_calls"] + 2, after
    assert_backend_ran(graphs=1, batched=1)

    # The program was written to Inductor's FX graph cache when it arrived: the graph compiled
    # again (as in a new process) loads it and runs compiled code from its first call.
    torch._dynamo.reset()
    call = checked_vjp_call(compile_dynbatch(vjp_rows, options=BACKGROUND))
    until_traced_aside(call)
    assert dynbatch.compile_records()[-1].caches.get("fxgraph_cache_hit") == 1, dynbatch.compile_records()[-1]
    assert _counts() == after, _counts()
    assert background._WORKER.pid() is None  # nothing to compile: no worker started


# --- a force-training step ------------------------------------------------------------

class ForcesModel(torch.nn.Module):
    """Energy of a few atoms (an MLP of pair distances) and its forces, create_graph=True.
    The MLP is traced by ``torch.fx``, as MACE's compile helper simplifies e3nn's modules:
    its class, local to ``GraphModule.__new__``, rides in the backward graph's metadata, which
    Inductor's pickler refused (every graph compiled in the foreground)."""

    def __init__(self):
        super().__init__()
        self.mlp = torch.fx.symbolic_trace(
            torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)))

    def forward(self, pos):
        pos.requires_grad_(True)  # the MACE / NequIP idiom
        diff = pos.unsqueeze(1) - pos.unsqueeze(0)
        r = ((diff * diff).sum(-1) + torch.eye(pos.shape[0], dtype=pos.dtype)).sqrt()
        energy = (self.mlp(r.unsqueeze(-1)).squeeze(-1) * torch.ones_like(r).triu(1)).sum()
        forces = -torch.autograd.grad(energy, pos, create_graph=True)[0]
        return energy, forces


def _step(model, pos, e_ref, f_ref):
    for p in model.parameters():
        p.grad = None
    energy, forces = model(pos)
    loss = (energy - e_ref) ** 2 + ((forces - f_ref) ** 2).mean()
    loss.backward()
    return (loss.detach(), forces.detach(), *(p.grad for p in model.parameters()))


def test_a_force_training_step_gives_eager_values_before_and_after_the_handover():
    torch.manual_seed(0)
    eager = ForcesModel().double()
    model = copy.deepcopy(eager)
    compiled = compile_dynbatch(model, options=BACKGROUND)
    gen = torch.Generator().manual_seed(1)

    def call():
        pos = torch.randn(6, 3, dtype=torch.float64, generator=gen)
        e_ref = torch.randn((), dtype=torch.float64, generator=gen)
        f_ref = torch.randn(6, 3, dtype=torch.float64, generator=gen)
        assert_same_grads(_step(compiled, pos, e_ref, f_ref), _step(eager, pos.clone(), e_ref, f_ref))

    before = _worker_processes()
    until_traced_aside(call)
    first = _counts()
    # Its forward and the backward of loss.backward(): two programs, two compiles, and the
    # first compiled step ran both on eager kernels.
    programs = first["background_compiles"]
    assert programs == 2, first
    assert first["background_eager_calls"] == programs and first["background_compiled_calls"] == 0, first

    _until_handed_over(call, programs=programs)
    handed_over = _counts()
    assert handed_over["background_compiles"] == handed_over["background_compiles_finished"] == programs
    _assert_no_worker_left(before)
    call()
    after = _counts()
    assert after["background_compiles"] == programs, after
    assert after["background_eager_calls"] == handed_over["background_eager_calls"], after
    assert after["background_compiled_calls"] == handed_over["background_compiled_calls"] + programs, after
    assert_backend_ran(graphs=1)


# --- the worker's lifetime, the option, where it does not apply ------------------------

def test_reset_lets_the_compile_in_progress_finish_then_stops_the_worker(tmp_path):
    """A C++ build killed midway would stay half-written in Inductor's cache (a later load:
    "file too short"): reset waits for the compile sent, then stops the worker, and the
    graph hands over to its program at the next call."""
    before = _worker_processes()
    compiled = compile_dynbatch(vjp_rows, options=BACKGROUND)
    x, V = torch.randn(5, 6, dtype=torch.float64), torch.randn(4, 5, 6, dtype=torch.float64)
    until_traced_aside(lambda: assert_same_grads(compiled(x, V), vjp_rows(x, V)))
    assert _worker_processes() - before
    assert _counts()["background_compiles_finished"] == 0
    background.shutdown()  # what dynbatch.reset() does, without clearing the counters
    assert background._WORKER.pid() is None
    _assert_no_worker_left(before)  # processes exit within seconds; a loaded machine takes longer
    assert _counts()["background_compiles_finished"] == _counts()["background_compiles"] == 1
    assert not list((tmp_path / "inductor").rglob("*CxxBuild")), "a C++ build was cut short"
    assert_same_grads(compiled(x, V), vjp_rows(x, V))
    assert _counts()["background_compiled_calls"] == 1


def test_an_unknown_compile_option_raises():
    with pytest.raises(ValueError, match=r"dynbatch.compile='later'.*\['foreground', 'background'\]"):
        dynbatch.Options.from_compile_args(None, {"dynbatch.compile": "later"})
    compiled = compile_dynbatch(vjp_rows, options={**BACKGROUND, "dynbatch.compile": True})
    with pytest.raises(Exception, match="dynbatch.compile=True"):
        compiled(torch.randn(5, 6, dtype=torch.float64), torch.randn(2, 5, 6, dtype=torch.float64))


def test_where_it_does_not_apply_the_graph_compiles_as_before_with_the_reason_logged(caplog):
    x, V = torch.randn(5, 6, dtype=torch.float64), torch.randn(3, 5, 6, dtype=torch.float64)
    with caplog.at_level(logging.INFO, logger="dynbatch"):
        compiled = compile_dynbatch(vjp_rows, options={"dynbatch.compile": "background"})  # aot_eager
        until_traced_aside(lambda: assert_same_grads(compiled(x, V), vjp_rows(x, V)))
    assert "compiles in the foreground" in caplog.text and "compiles no kernels" in caplog.text, caplog.text
    assert _counts() == dict.fromkeys(_counts(), 0)
    assert background._WORKER.pid() is None
    assert_backend_ran(graphs=1, batched=1)


def test_a_chunked_grad_compiles_in_the_foreground_with_the_reason_logged(caplog):
    # chunk_size=2 at B=4: the memory plan chunks the batched grad, whose chunk programs
    # compile with the graph (in the foreground), and so does the graph.
    compiled = compile_dynbatch(vjp_rows, options={**BACKGROUND, "dynbatch.chunk_size": 2})
    x, V = torch.randn(5, 6, dtype=torch.float64), torch.randn(4, 5, 6, dtype=torch.float64)
    with caplog.at_level(logging.INFO, logger="dynbatch"):
        until_traced_aside(lambda: assert_same_grads(compiled(x, V), vjp_rows(x, V)))
        assert_same_grads(compiled(x, V + 1), vjp_rows(x, V + 1))
    assert "compiles in the foreground" in caplog.text and "chunk by chunk" in caplog.text, caplog.text
    assert dynbatch.counters().get("grads_chunked") == 1, dynbatch.counters()
    # The plan asked for chunks before any aten graph went to the worker: none started.
    assert _counts() == dict.fromkeys(_counts(), 0), _counts()
    assert background._WORKER.pid() is None


def test_a_failed_background_compile_leaves_the_eager_kernels_running(caplog):
    # A C++ compiler that is not there: the worker's compile fails (the user's process builds
    # nothing), and the graph keeps its eager kernels, with eager's values.
    options = {**BACKGROUND, "cpp.cxx": ("/nonexistent/c++",)}
    compiled = compile_dynbatch(vjp_rows, options=options)
    x = torch.randn(5, 6, dtype=torch.float64)
    deadline = time.monotonic() + HANDOVER_TIMEOUT
    with caplog.at_level(logging.WARNING, logger="dynbatch"):
        while not _counts()["background_compile_failures"]:
            V = torch.randn(3, 5, 6, dtype=torch.float64)
            assert_same_grads(compiled(x, V), vjp_rows(x, V))
            assert time.monotonic() < deadline, _counts()
            time.sleep(0.05)
        for _ in range(2):
            V = torch.randn(3, 5, 6, dtype=torch.float64)
            assert_same_grads(compiled(x, V), vjp_rows(x, V))
    c = _counts()
    assert c["background_compiles"] == 1 and c["background_compiles_finished"] == 0, c
    assert c["background_compiled_calls"] == 0 and c["background_eager_calls"] >= 3, c
    assert "background compile of a forward graph failed" in caplog.text and "InvalidCxxCompiler" in caplog.text, caplog.text
