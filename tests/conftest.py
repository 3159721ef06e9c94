"""Shared fixtures: every test starts from a fresh Dynamo and fresh dynbatch counters."""

from __future__ import annotations

import os
import pathlib
import time

import pytest
import torch

import dynbatch

# The suite's options.  compile_dynbatch merges ``options`` over AOT_EAGER, so the
# others are overlays: INDUCTOR, FALLBACK, both (DEFAULTS), plus a test's own keys.
#
# Cheap inner compiler for semantic tests: same capture and batching pass,
# same AOTAutograd trace, no Inductor codegen (seconds per compile on 2 cores).
# "error": a graph dynbatch cannot batch raises, so no test passes through a silent fallback.
AOT_EAGER = {"dynbatch.inner_compiler": "aot_eager", "dynbatch.on_unsupported": "error"}
# For tests that need Inductor itself: its lowering, its kernels, failures of its own
# (still "error").
INDUCTOR = {"dynbatch.inner_compiler": "inductor"}
# A graph dynbatch cannot batch runs eagerly: for tests about the fallback path, which
# assert that it was taken (assert_fell_back), and for tests that compiled with dynbatch's
# default "fallback" before conftest held the options (they assert no fallback, or nothing
# about it).
FALLBACK = {"dynbatch.on_unsupported": "fallback"}
# What a plain torch.compile(fn, backend="dynbatch") gives a user: Inductor, and a
# graph dynbatch cannot batch runs eagerly.
DEFAULTS = {**INDUCTOR, **FALLBACK}


def pytest_configure(config):
    # Under pytest-xdist (the README's ``-n 2``) each worker gets its share of the cores:
    # two workers at torch's default of one thread per core would each run OpenMP teams
    # on cores the other is using.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // workers))


# The key under which a pytest-xdist worker hands the controller its OpInfo outcomes
# (test_opinfo.records()); the controller prints their figures, merged.
OPINFO_WORKER_OUTPUT = "dynbatch_opinfo_outcomes"
_OPINFO_FROM_WORKERS: list[dict] = []


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: absent without it
def pytest_testnodedown(node, error):
    outcomes = getattr(node, "workeroutput", {}).get(OPINFO_WORKER_OUTPUT)
    if outcomes:
        _OPINFO_FROM_WORKERS.append(outcomes)


def pytest_terminal_summary(terminalreporter):
    if _FIRST_CALLS:
        terminalreporter.section("real models: first compiled call (compile included), seconds")
        for name, seconds in _FIRST_CALLS:
            terminalreporter.write_line(f"{seconds:8.1f}  {name}")
    if not _OPINFO_FROM_WORKERS:
        return
    import test_opinfo  # tests/ is on sys.path, as for every test module's imports

    terminalreporter.section("dynbatch OpInfo figures, every worker's")
    for line in test_opinfo.figures(test_opinfo.merge_records(_OPINFO_FROM_WORKERS)):
        terminalreporter.write_line(line)


# --- the real-model suite (tests/models, -m models) -----------------------------------

_MODELS = pathlib.Path(__file__).parent / "models"
_FIRST_CALLS: list[tuple[str, float]] = []


def pytest_ignore_collect(collection_path, config):
    """tests/models is not even imported unless ``-m`` selects the models: importing a
    package such as mace-torch changes process state (it sets TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD)."""
    if _MODELS not in (collection_path, *collection_path.parents):
        return None
    expression = config.getoption("markexpr") or ""
    return True if "models" not in expression or "not models" in expression else None


@pytest.fixture
def first_call(request):
    """``first_call(fn, *args)``: ``fn(*args)``, its seconds (compile included) kept for the
    summary that ends a real-model run."""
    def timed(fn, *args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        _FIRST_CALLS.append((request.node.name, time.perf_counter() - start))
        return out

    return timed


def reset_all() -> None:
    dynbatch.reset()  # first: it waits for the frames traced aside, which Dynamo's reset must not cut short
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()


@pytest.fixture(autouse=True)
def fresh_dynamo():
    reset_all()
    yield
    reset_all()


@pytest.fixture
def recompute_outside(monkeypatch):
    """Legacy-batched grads taken outside a region recompute its forward (the program's
    compiled batched backward, counted ``outside_batched_compiled``) instead of batching
    AOTAutograd's backward over the saved activations (``outside_batched_saved``): for
    tests of the recompute path, which stays the fallback of the saved one."""
    from dynbatch.region import paths

    monkeypatch.setattr(paths, "batched_grads", lambda *args: None)


def compile_dynbatch(fn, *, options=None, fullgraph=True, **kwargs):
    """The one compile helper of the suite: ``options`` are merged over ``AOT_EAGER``
    (e.g. ``options={**INDUCTOR, "dynbatch.chunk_size": 2}``); ``kwargs`` such as
    ``dynamic=`` and ``mode=`` go to ``torch.compile`` unchanged."""
    return torch.compile(fn, backend="dynbatch", fullgraph=fullgraph, options={**AOT_EAGER, **(options or {})},
                         **kwargs)


def _as_tuple(x):
    return (x,) if isinstance(x, torch.Tensor) else tuple(x)


def loop_grads(outputs, inputs, grad_outputs, *, create_graph=False, allow_unused=True):
    """The oracle: one eager torch.autograd.grad per sample, stacked.

    A grad is None only if it is None for every sample (a property of the
    autograd graph, so it is either always or never None).
    """
    outputs, inputs, grad_outputs = _as_tuple(outputs), _as_tuple(inputs), _as_tuple(grad_outputs)
    batch = grad_outputs[0].shape[0]
    assert batch > 0, "the loop oracle needs at least one sample"
    per_sample = [
        torch.autograd.grad(outputs, inputs, tuple(g[b] for g in grad_outputs), retain_graph=True,
                            create_graph=create_graph, allow_unused=allow_unused)
        for b in range(batch)
    ]
    result = []
    for i in range(len(inputs)):
        grads = [s[i] for s in per_sample]
        assert len({g is None for g in grads}) == 1, "None-ness of a grad differs between samples"
        result.append(None if grads[0] is None else torch.stack(grads))
    return tuple(result)


def assert_same_grads(actual, expected, *, atol=None, rtol=None, msg=""):
    """Values within dtype tolerance, same shapes and dtypes, and the same Nones."""
    actual, expected = _as_tuple(actual), _as_tuple(expected)
    assert len(actual) == len(expected), f"{msg}: {len(actual)} grads, expected {len(expected)}"
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert (a is None) == (e is None), f"{msg}: result {i}: None-ness differs ({a is None} vs {e is None})"
        if a is not None:
            torch.testing.assert_close(a, e, atol=atol, rtol=rtol, equal_nan=True,
                                       msg=lambda m, i=i: f"{msg}: result {i}: {m}")


def assert_fell_back(caplog, fallbacks=1):
    """dynbatch counted ``fallbacks`` fallbacks and logged each with its reason.

    ``caplog`` must have captured the "dynbatch" logger at WARNING.
    """
    c = dynbatch.counters()
    assert c.get("fallbacks", 0) == fallbacks, (c, dynbatch.fallback_reasons())
    assert caplog.text.count("falling back to eager") == fallbacks, caplog.text
    for reason in dynbatch.fallback_reasons():
        assert reason in caplog.text, (reason, caplog.text)


def until_traced_aside(call, timeout=300.0):
    """Call ``call()`` (it checks its own values) until a frame traced aside (NOTE [Traced aside])
    was handed over: with ``dynbatch.compile="background"`` its first calls run eagerly."""
    import time

    handed = dynbatch.counters().get("aside_handovers", 0)
    deadline = time.monotonic() + timeout
    while True:
        call()
        if dynbatch.counters().get("aside_handovers", 0) > handed:
            return
        assert time.monotonic() < deadline, f"no frame traced aside was handed over in {timeout} s: {dynbatch.counters()}"
        time.sleep(0.01)


def assert_backend_ran(graphs=1, batched=None):
    c = dynbatch.counters()
    assert c.get("graphs", 0) == graphs, c
    assert c.get("fallbacks", 0) == 0, dynbatch.fallback_reasons()
    if batched is not None:
        assert c.get("grads_batched", 0) == batched, c


def run_two_ranks(worker: str, tmp_path) -> str:
    """Run ``worker`` (a script that ``mp.spawn``s two ranks, each printing "rank R ok ...")
    in a fresh process with a file store under ``tmp_path``; its output once both ranks passed."""
    import os
    import subprocess
    import sys

    script = tmp_path / "worker.py"
    script.write_text(worker)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "store")], capture_output=True, text=True,
                          timeout=600, env=env, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count(" ok ") == 2, done.stdout
    return done.stdout
