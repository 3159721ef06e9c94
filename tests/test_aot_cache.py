"""AOTAutograd's cache for dynbatch's graphs: a warm start loses nothing a cold one knew.

NOTE [What a cache hit must not lose] in dynbatch/lowering/aot_cache.py.  Each test
compiles with ``dynbatch.aot_cache`` in an Inductor cache of its own (cold), then again
after ``torch._dynamo.reset()`` in the same cache (warm, as a second process would): the
warm graph must come from AOTAutograd's cache (counted), carry the cold graph's record,
and give eager's values for grads taken outside it.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

import dynbatch
from conftest import INDUCTOR, assert_same_grads, compile_dynbatch, until_traced_aside

grad = torch.autograd.grad
CACHED = {**INDUCTOR, "dynbatch.aot_cache": True}


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    path = tmp_path / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(path))
    return path


def _fresh():
    torch._dynamo.reset()
    dynbatch.reset()


def _record():
    """The compiled model's or step's own graph: the first compiled (a grad taken outside it
    may compile programs of its own after it)."""
    return [r for r in dynbatch.compile_records() if not r.chunk_program and not r.saved_backward][0]


def _batchnorm_mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 3)).double()


def _outside_jacobian_and_step(model, x, V):
    """A batched Jacobian taken outside the compiled model, then a training step's grads."""
    out = model(x)
    jac = grad(out, x, V, is_grads_batched=True, retain_graph=True)[0]
    out.square().sum().backward()
    return jac, tuple(p.grad for p in model.parameters())


def test_a_warm_graph_keeps_its_inputs_written_in_place_and_its_path(cache_dir):
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    V = torch.randn(3, 5, 3, dtype=torch.float64)
    eager = _batchnorm_mlp()
    want = _outside_jacobian_and_step(eager, x, V)
    seen = []
    for start in ("cold", "warm"):
        _fresh()
        model = _batchnorm_mlp()
        got = _outside_jacobian_and_step(compile_dynbatch(model, options=CACHED, fullgraph=False), x, V)
        assert_same_grads(got, want, msg=start)
        assert_same_grads(tuple(model.buffers()), tuple(eager.buffers()), msg=f"{start}: running statistics")
        record = _record()
        seen.append((record.mutated_inputs, record.mutates_differentiable_input, record.random_ops))
        hit = record.caches.get("autograd_cache_hit", 0)
        assert hit == (start == "warm"), (start, record.caches)
        # Warm too, the Jacobian batches the saved activations, from the backward graph the
        # entry kept (NOTE [The backward graph of a hit]).
        assert dynbatch.counters().get("outside_batched_saved") == 1, (start, dynbatch.counters())
    assert seen[0] == seen[1], seen
    assert seen[0][0], seen  # BatchNorm's running statistics are written in place


def test_a_warm_graph_keeps_its_random_ops(cache_dir):
    x, V = torch.randn(5, 4, dtype=torch.float64, requires_grad=True), torch.randn(3, 5, 3, dtype=torch.float64)
    ops = []
    for start in ("cold", "warm"):
        _fresh()
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 3)).double()
        grad(compile_dynbatch(model, options=CACHED, fullgraph=False)(x), x, V, is_grads_batched=True)
        record = _record()
        assert record.caches.get("autograd_cache_hit", 0) == (start == "warm"), (start, record.caches)
        ops.append(record.random_ops)
        # Dropout's masks are the forward's: never a re-run for the batched grads.
        assert dynbatch.counters().get("outside_per_sample") == 1, dynbatch.counters()
    assert ops[0] == ops[1] and ops[0], ops


def test_an_entry_without_dynbatchs_record_is_traced_again(cache_dir):
    lin = torch.nn.Linear(4, 1).double()
    x = torch.randn(5, 4, dtype=torch.float64)
    for start in ("cold", "record lost"):
        _fresh()
        compile_dynbatch(lambda x: torch.tanh(lin(x)).sum(), options=CACHED)(x).backward()
        caches = _record().caches
        assert caches.get("autograd_cache_miss", 0) == 1 and not caches.get("autograd_cache_hit"), (start, caches)
        shutil.rmtree(cache_dir / "dynbatch_records")


def test_a_graph_with_a_batched_grad_is_traced_every_time(cache_dir):
    W = torch.randn(4, 4, dtype=torch.float64)

    def rows(x):
        x = x.detach().requires_grad_()
        V = torch.eye(4, dtype=x.dtype).expand(x.shape[0], 4, 4).transpose(0, 1)
        return grad(torch.tanh(x @ W), x, V, is_grads_batched=True)[0]

    for _ in range(2):
        _fresh()
        compile_dynbatch(rows, options=CACHED)(torch.randn(3, 4, dtype=torch.float64))
        caches = _record().caches
        assert not any(k.startswith("autograd_cache") and v for k, v in caches.items()), caches


def test_the_mega_cache_brings_a_warm_start_to_an_empty_cache_directory(tmp_path, monkeypatch):
    lin = torch.nn.Linear(4, 1).double()
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)

    def step(x):
        return torch.tanh(lin(x)).square().sum()

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "first"))
    torch.compiler.reset()
    _fresh()
    cold = compile_dynbatch(step, options=CACHED)(x)
    cold.backward()
    cold_grads = tuple(p.grad.clone() for p in lin.parameters())
    saved = torch.compiler.save_cache_artifacts()
    assert saved is not None
    artifacts, info = saved
    assert getattr(info, "dynbatch_record_artifacts", None), info

    empty = tmp_path / "second"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(empty))
    torch.compiler.load_cache_artifacts(artifacts)
    assert os.listdir(empty / "dynbatch_records")
    _fresh()
    for p in lin.parameters():
        p.grad = None
    warm = compile_dynbatch(step, options=CACHED)(x)
    warm.backward()
    record = _record()
    assert record.caches.get("autograd_cache_hit") == 1, record.caches
    assert record.seconds["cpp_compile"] == 0 and not record.caches.get("fxgraph_cache_miss"), record
    assert_same_grads(warm, cold)
    assert_same_grads(tuple(p.grad for p in lin.parameters()), cold_grads)


def test_a_force_training_step_warm_from_the_cache_gives_eagers_grads(cache_dir):
    """Forces inside the compiled model (a grad with create_graph=True), the loss on energy
    and forces, backward() outside: the graph holds torch.autograd.grad and is cached too."""

    def model_and_forces(model, pos):
        energy = model(pos).sum()
        (forces,) = grad(-energy, pos, create_graph=True)
        return energy, forces

    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()

    pos = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    eager = make()
    energy, forces = model_and_forces(eager, pos)
    (energy + forces.square().sum()).backward()
    for start in ("cold", "warm"):
        _fresh()
        model = make()
        compiled = compile_dynbatch(lambda p: model_and_forces(model, p), options=CACHED)
        e, f = compiled(pos)
        (e + f.square().sum()).backward()
        assert_same_grads((e, f), (energy, forces), msg=start)
        assert_same_grads(tuple(p.grad for p in model.parameters()), tuple(p.grad for p in eager.parameters()),
                          msg=f"{start}: parameters' grads")
        caches = _record().caches
        assert caches.get("autograd_cache_hit", 0) == (start == "warm"), (start, caches)


def test_a_hessian_outside_a_warm_force_model_gives_eagers_values_at_every_size(cache_dir):
    """One saved-activations program serves every atom count, cold (the backward graph keeps
    its meta when its entry is saved) and warm (from the graph the entry kept, with the sizes
    its trace had symbolic)."""
    weight = torch.randn(3, 6, dtype=torch.float64)

    def energy_and_forces(pos):
        e = torch.tanh(pos @ weight).sum()
        return e, -grad(e, pos, create_graph=True)[0]

    for start in ("cold", "warm"):
        _fresh()
        c = compile_dynbatch(energy_and_forces, options=CACHED, fullgraph=False, dynamic=True)
        for n in (5, 7):
            pos = torch.randn(n, 3, dtype=torch.float64, requires_grad=True)
            rows = torch.eye(3 * n, dtype=torch.float64).reshape(3 * n, n, 3)
            assert_same_grads(grad(c(pos)[1], pos, rows, is_grads_batched=True)[0],
                              grad(energy_and_forces(pos)[1], pos, rows, is_grads_batched=True)[0], msg=start)
        counters = dynbatch.counters()
        assert counters.get("outside_batched_saved") == 2, (start, counters)
        assert counters.get("saved_backward_programs") == 1, (start, counters)
        assert _record().caches.get("autograd_cache_hit", 0) == (start == "warm"), (start, _record().caches)


@pytest.mark.parametrize("aot_cache", [True, "with_backward"])
def test_a_graph_no_backward_runs_through_is_cached_with_its_backward(cache_dir, aot_cache):
    """MACE's calculator: parameters frozen, positions requiring grad, the forces with
    create_graph, and no backward.  AOTAutograd writes an entry once its backward compiled,
    so by default a warm process traces such a graph again (as stock's does); with
    "with_backward" the cold call compiles the backward and writes it, the warm one loads it,
    and a backward through the warm graph gives eager's grads (NOTE [An entry needs its
    backward])."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()
    model.requires_grad_(False)

    def forces(pos):
        return -grad(model(pos).sum(), pos, create_graph=True)[0]

    pos = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    expected = forces(pos)
    for start in ("cold", "warm"):
        _fresh()
        got = compile_dynbatch(forces, options={**INDUCTOR, "dynbatch.aot_cache": aot_cache})(pos)
        assert_same_grads(got, expected, msg=start)
        hit = _record().caches.get("autograd_cache_hit", 0)
        assert hit == (start == "warm" and aot_cache == "with_backward"), (start, _record().caches)
    # the backward the warm graph loaded (or traced) is the one eager runs
    assert_same_grads(grad(got.square().sum(), pos)[0], grad(expected.square().sum(), pos)[0])


def test_the_cache_is_on_by_default_and_off_for_a_background_compile(cache_dir):
    lin = torch.nn.Linear(4, 1).double()
    for start in ("cold", "warm"):
        _fresh()
        # AOTAutograd writes the entry once the backward has compiled, at its first call.
        compile_dynbatch(lambda x: torch.tanh(lin(x)).sum(), options=INDUCTOR)(
            torch.randn(5, 4, dtype=torch.float64)).backward()
        assert _record().caches.get("autograd_cache_hit", 0) == (start == "warm"), (start, _record().caches)
    # A background compile writes its programs after AOTAutograd would have written its entry.
    _fresh()
    compiled = compile_dynbatch(lambda x: torch.tanh(lin(x)).sum() * 2, options={**INDUCTOR, "dynbatch.compile": "background"})
    until_traced_aside(lambda: compiled(torch.randn(5, 4, dtype=torch.float64)).backward())
    caches = _record().caches
    assert not any(k.startswith("autograd_cache") and v for k, v in caches.items()), caches
    assert dynbatch.counters().get("background_compiles", 0) >= 1, dynbatch.counters()
