"""Where a first call goes: each compile record splits its seconds by who spent them.

NOTE [Where a first call goes] in dynbatch/records.py.  The phases must add up to
the first call's wall time (nothing counted twice), a cold compile must show
Inductor's C++ compile, a warm one (Inductor's cache filled by an earlier compile)
its cache hits and almost no C++, and a backward AOTAutograd compiles at its first
call must add to the forward's record.
"""

from __future__ import annotations

import time

import pytest
import torch

import dynbatch
from conftest import AOT_EAGER, INDUCTOR, assert_backend_ran, assert_same_grads, compile_dynbatch
from dynbatch.records import PHASES

W = torch.randn(6, 6, dtype=torch.float64)


def jacobian_rows(x):
    x = x.detach().requires_grad_()
    y = torch.tanh(x @ W)
    V = torch.eye(6, dtype=x.dtype).expand(x.shape[0], 6, 6).transpose(0, 1)
    return torch.autograd.grad(y, x, V, is_grads_batched=True)[0]


def _first_call(fn, *args, options):
    compiled = compile_dynbatch(fn, options=options)
    start = time.perf_counter()
    out = compiled(*args)
    return out, time.perf_counter() - start


def _record():
    (record,) = dynbatch.compile_records()
    assert set(record.seconds) == set(PHASES), record.seconds
    assert all(v >= 0 for v in record.seconds.values()), record.seconds
    return record


@pytest.fixture
def empty_inductor_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))


def test_a_cold_then_warm_first_call_split_by_phase(empty_inductor_cache):
    x = torch.randn(4, 6, dtype=torch.float64)
    out, wall = _first_call(jacobian_rows, x, options=INDUCTOR)
    assert_same_grads(out, jacobian_rows(x))
    assert_backend_ran(batched=1)
    cold = _record()
    # The call's own run is part of the wall time, not of a phase: the sum is a little less.
    assert 0.5 * wall < sum(cold.seconds.values()) <= wall, (cold.seconds, wall)
    assert cold.seconds["cpp_compile"] > 0 and cold.seconds["dynamo"] > 0, cold.seconds
    assert cold.caches.get("fxgraph_cache_miss", 0) >= 1, cold.caches

    torch._dynamo.reset()
    dynbatch.reset()
    out, wall = _first_call(jacobian_rows, x, options=INDUCTOR)
    assert_same_grads(out, jacobian_rows(x))
    warm = _record()
    assert warm.caches.get("fxgraph_cache_hit", 0) >= 1 and not warm.caches.get("fxgraph_cache_miss"), warm.caches
    assert warm.seconds["cpp_compile"] < cold.seconds["cpp_compile"], (warm.seconds, cold.seconds)


def test_a_backward_compiled_at_its_first_call_adds_to_its_record(empty_inductor_cache):
    lin = torch.nn.Linear(6, 1).double()
    x = torch.randn(4, 6, dtype=torch.float64)
    out, _ = _first_call(lambda x: torch.tanh(lin(x)).sum(), x, options=INDUCTOR)
    before = dict(_record().seconds)
    out.backward()
    after = _record().seconds
    assert sum(after.values()) > sum(before.values()), (before, after)
    assert after["inductor"] + after["cpp_compile"] > before["inductor"] + before["cpp_compile"], (before, after)


def test_aot_eager_spends_nothing_in_inductor():
    x = torch.randn(4, 6, dtype=torch.float64)
    _first_call(jacobian_rows, x, options=AOT_EAGER)
    record = _record()
    assert record.seconds["inductor"] == record.seconds["cpp_compile"] == 0, record.seconds
    assert record.seconds["aot_autograd"] > 0 and record.seconds["dynbatch"] > 0, record.seconds
