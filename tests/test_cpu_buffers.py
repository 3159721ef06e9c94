"""Large CPU buffers kept between calls (dynbatch/cpu/kept_buffers.py, NOTE [Reused CPU buffers]):
handed out again only once no tensor uses them, and never changing a value."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
import torch

import dynbatch
from dynbatch.cpu import kept_buffers
from conftest import DEFAULTS, assert_backend_ran, assert_same_grads, compile_dynbatch, loop_grads

UNIT = kept_buffers.MIN_BYTES  # the smallest buffer kept
LARGE = (2 * UNIT // 4096, 1024)  # float32: kept
STRIDE = (1024, 1)


@pytest.fixture(autouse=True)
def nothing_kept():
    kept_buffers.release()
    yield
    kept_buffers.release()


def _large() -> torch.Tensor:
    return kept_buffers.empty_strided(LARGE, STRIDE, torch.float32)


def test_a_small_buffer_is_torchs_own():
    for size, stride in [((4, 8), (8, 1)), ((UNIT // 8192, 1024), (1024, 1)), ((), ())]:
        t = kept_buffers.empty_strided(size, stride, torch.float32)
        assert (t.shape, t.stride(), t.dtype) == (size, stride, torch.float32)
    assert kept_buffers.kept_bytes() == 0


def test_a_freed_buffer_serves_the_next_request_of_its_size():
    first = _large()
    assert (first.shape, first.stride(), first.dtype) == (LARGE, STRIDE, torch.float32)
    address = first.data_ptr()
    del first
    assert _large().data_ptr() == address
    assert kept_buffers.kept_bytes() == 2 * UNIT


def test_a_buffer_in_use_is_never_handed_out():
    held = _large()
    view = held.view(-1)[10:]  # a view alone keeps it in use
    address = held.data_ptr()
    del held
    other = _large()
    assert other.data_ptr() != address
    other.fill_(1.0)
    view.fill_(2.0)
    assert torch.all(other == 1.0) and torch.all(view == 2.0)


def test_strides_dtypes_and_a_shared_storage_size():
    rows = UNIT // 8192
    t = kept_buffers.empty_strided((rows, 1024), (1, rows), torch.float64)  # column-major, one unit
    assert (t.shape, t.stride(), t.dtype) == ((rows, 1024), (1, rows), torch.float64)
    assert kept_buffers.kept_bytes() == UNIT
    t.copy_(torch.arange(t.numel(), dtype=torch.float64).view(1024, rows).t())
    assert t[3, 5].item() == 5 * rows + 3


def _units(n: float) -> torch.Tensor:
    return kept_buffers.empty_strided((int(n * UNIT) // 4096, 1024), STRIDE, torch.float32)


@pytest.mark.parametrize("slack", [1, 2])
def test_unused_buffers_of_other_sizes_stay_within_the_slack(monkeypatch, slack):
    monkeypatch.setattr(kept_buffers, "SLACK", slack)
    two = _units(2)
    del two
    eight = _units(8)  # the 2-unit one does not fit: kept only while 2 + 8 <= slack * 8
    assert kept_buffers.kept_bytes() == (10 if slack == 2 else 8) * UNIT
    del eight
    three = _units(3)  # under half of the free 8-unit one: a buffer of its own
    assert three.data_ptr() not in {k.buffer.data_ptr() for k in kept_buffers._kept if k.nbytes() == 8 * UNIT}
    kept = kept_buffers.kept_bytes()
    assert _units(0.5).shape == (UNIT // 8192, 1024)  # small: torch's own, nothing kept for it
    assert kept_buffers.kept_bytes() == kept <= slack * 11 * UNIT


def test_beyond_the_bound_buffers_are_not_kept(monkeypatch):
    monkeypatch.setattr(kept_buffers, "MAX_KEPT_BYTES", 3 * UNIT)
    first = _large()
    second = _large()  # the first is in use and the bound is reached: torch's own
    assert kept_buffers.kept_bytes() == 2 * UNIT
    assert first.data_ptr() != second.data_ptr()


def test_release_keeps_tensors_in_use_valid():
    held = _large().fill_(3.0)
    kept_buffers.release()
    assert kept_buffers.kept_bytes() == 0
    assert torch.all(held == 3.0)
    assert _large().data_ptr() != held.data_ptr()


def test_threads_never_share_a_buffer_in_use():
    barrier = threading.Barrier(2)
    clashes = []

    def work(value: float):
        for _ in range(50):
            t = _large().fill_(value)
            barrier.wait()  # both threads hold theirs here
            if not torch.all(t == value):
                clashes.append(value)
            barrier.wait()
            del t

    threads = [threading.Thread(target=work, args=(v,)) for v in (1.0, 2.0)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not clashes


def _jacobian_rows(x, w, v):
    x = x.detach().requires_grad_()
    y = torch.tanh(x @ w) * torch.sigmoid(x @ w)
    return torch.autograd.grad(y, x, v, is_grads_batched=True)[0]


@pytest.mark.parametrize("keep", [True, False])
def test_a_compiled_programs_large_buffers_are_kept_and_its_outputs_never_overwritten(keep):
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 64, generator=gen), torch.randn(64, 64, generator=gen) / 8
    vs = [torch.randn(512, 64, 64, generator=gen) for _ in range(3)]  # 8 MiB grads
    f = compile_dynbatch(_jacobian_rows, options={**DEFAULTS, "dynbatch.keep_cpu_buffers": keep})
    outs = []
    for v in vs:
        outs.append(f(x, w, v))
        kept = kept_buffers.kept_bytes()
        assert (kept > 0) == keep
    assert kept_buffers.kept_bytes() == kept  # steady: no new buffer after the first calls
    for out, v in zip(outs, vs):  # each output held while the later calls ran
        x_ = x.detach().requires_grad_()
        y = torch.tanh(x_ @ w) * torch.sigmoid(x_ @ w)
        assert_same_grads(out, loop_grads(y, x_, v), atol=1e-5, rtol=1e-4)
    assert_backend_ran(graphs=dynbatch.counters().get("graphs", 0))
    assert dynbatch.counters().get("grads_batched", 0) >= 1


def test_a_buffer_the_caller_keeps_is_forgotten(monkeypatch):
    monkeypatch.setattr(kept_buffers, "FORGET_AFTER", 3)
    held = _large().fill_(5.0)
    for _ in range(5):  # others come and go: the held one stays in use
        other = _units(1)
        del other
    assert kept_buffers.kept_bytes() == UNIT  # only the one in turn
    assert torch.all(held == 5.0)
    del held  # torch's again: nothing kept grows
    _units(1)
    assert kept_buffers.kept_bytes() == UNIT


WRAPPER = """
class Runner:
    def __init__(self, partitions):
        self.partitions = partitions

    def call(self, args):
        arg0_1, arg1_1 = args
        s33 = arg1_1
        buf0 = empty_strided_cpu((8, 128), (128, 1), torch.float32)
        buf1 = empty_strided_cpu((1024, 1024), (1024, 1), torch.float32)
        buf2 = empty_strided_cpu((s33, 100, 100, 1), (10000, 100, 1, 10000*s33), torch.float32)
        buf3 = empty_strided_cpu((8*s33, 16), (16, 1), torch.float64)
        buf4 = empty_strided_cpu((), (), torch.float64)
        return (buf0, buf1, buf2, buf3, buf4)


runner = Runner(partitions=[])
call = runner.call
"""


def _wrapper(tmp_path):
    """A generated wrapper's module, as Inductor writes one, with its ``call``."""
    path = tmp_path / "wrapper.py"
    path.write_text(WRAPPER)
    namespace = {"__file__": str(path), "torch": torch, "empty_strided_cpu": None}
    exec(compile(WRAPPER, str(path), "exec"), namespace)
    return namespace


@pytest.mark.parametrize("s33, pooled", [
    (1, [False, True, False, False, False]),  # 40 KB and 1 KB: only the 4 MiB buffer of known size
    (104, [False, True, False, False, False]),  # 3.97 MiB and 106 KB
    (105, [False, True, True, False, False]),  # 4.005 MiB
    (32768, [False, True, True, True, False]),  # the float64 [8 * s33, 16] reaches 4 MiB
])
def test_each_allocation_site_takes_the_pool_only_where_its_size_can_be_large(tmp_path, s33, pooled):
    namespace = _wrapper(tmp_path)
    calls = []
    namespace["empty_strided_cpu"] = lambda size, stride, dtype: calls.append(("torch", size))
    code = kept_buffers.routed_function(WRAPPER, namespace["call"].__code__)
    namespace["call"].__func__.__code__ = code  # as install does
    for name in (kept_buffers._KEPT, kept_buffers._KEPT_COMPARED):
        namespace[name] = lambda size, stride, dtype: calls.append(("pool", size))
    namespace[kept_buffers._FLOOR] = kept_buffers.MIN_BYTES
    namespace["call"]((None, s33))
    assert [who == "pool" for who, _ in calls] == pooled
    assert code.co_qualname == "Runner.call"


def test_a_wrapper_that_allocates_nothing_large_is_left_as_it_is(tmp_path):
    small = WRAPPER.replace("(1024, 1024)", "(2, 2)").replace("(s33, 100, 100, 1)", "(3, 100, 100, 1)")
    small = small.replace("(8*s33, 16)", "(8, 16)")
    path = tmp_path / "small.py"
    path.write_text(small)
    namespace = {}
    exec(compile(small, str(path), "exec"), namespace)
    assert kept_buffers.routed_function(small, namespace["call"].__code__) is None


def test_a_wrapper_whose_allocations_are_known_and_small_is_not_parsed(tmp_path, monkeypatch):
    """A warm start installs every program it loads: one allocating only known, small sizes
    is left as it is from its text (MACE's training step: ~1 s of parsing at each load).
    One size not known, or not small, and the module is parsed and routed as before."""
    small = WRAPPER.replace("(1024, 1024)", "(2, 2)").replace("(s33, 100, 100, 1)", "(3, 100, 100, 1)")
    small = small.replace("(8*s33, 16)", "(8, 16)").replace("10000*s33", "30000")
    namespace = {}
    exec(compile(small, str(tmp_path / "small.py"), "exec"), namespace)
    parse = kept_buffers.ast.parse
    parsed = []
    monkeypatch.setattr(kept_buffers.ast, "parse", lambda *a, **k: parsed.append(1) or parse(*a, **k))
    assert kept_buffers.routed_function(small, namespace["call"].__code__, kept_buffers.LOW_BYTES) is None
    assert not parsed
    # 3 * 100 * 100 float32 is 117 KiB: under 128 KiB; 4 * 100 * 100 is over it.
    larger = small.replace("(3, 100, 100, 1)", "(4, 100, 100, 1)")
    exec(compile(larger, str(tmp_path / "larger.py"), "exec"), namespace)
    assert kept_buffers.routed_function(larger, namespace["call"].__code__, kept_buffers.LOW_BYTES) is not None
    assert parsed
    parsed.clear()
    exec(compile(WRAPPER, str(tmp_path / "wrapper.py"), "exec"), namespace)  # symbolic sizes
    assert kept_buffers.routed_function(WRAPPER, namespace["call"].__code__) is not None
    assert parsed


def test_an_allocation_outside_the_call_is_not_routed_silently(tmp_path):
    namespace = _wrapper(tmp_path)
    elsewhere = WRAPPER + "\ndef other():\n    return empty_strided_cpu((4, 4), (4, 1), torch.float32)\n"
    with pytest.raises(LookupError, match="outside"):
        kept_buffers.routed_function(elsewhere, namespace["call"].__code__)


def test_a_dynamic_programs_small_calls_never_reach_the_pool(monkeypatch):
    pooled = []
    for name in ("empty_strided", "kept_empty_strided"):  # bound in the wrapper's module at install
        pool = getattr(kept_buffers, name)
        monkeypatch.setattr(kept_buffers, name, lambda *a, pool=pool: pooled.append(a[0]) or pool(*a))
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 64, generator=gen), torch.randn(64, 64, generator=gen) / 8
    # aten's products: every buffer is the generated code's (dynbatch's own products take a
    # kept output through the pool's check, as any caller does)
    f = compile_dynbatch(_jacobian_rows, options={**DEFAULTS, "dynbatch.cpu_matmul": "aten"})
    for batch in (4, 8, 16, 512):  # B symbolic from the second call
        v = torch.randn(batch, 64, 64, generator=gen)
        out = f(x, w, v)
        x_ = x.detach().requires_grad_()
        assert_same_grads(out, loop_grads(torch.tanh(x_ @ w) * torch.sigmoid(x_ @ w), x_, v),
                          atol=1e-5, rtol=1e-4)
        assert bool(pooled) == (batch == 512), pooled  # 8 MiB buffers at B = 512 only
    assert kept_buffers.kept_bytes() > 0
    assert_backend_ran(graphs=2)


def _faulting_wrapper(tmp_path, monkeypatch, cost):
    """The generated wrapper installed as ``install`` does, allocating into a list, each
    call costing ``cost(call, floor)`` = (faults, seconds), as the counts read around it say."""
    namespace = _wrapper(tmp_path)
    calls = []
    namespace["empty_strided_cpu"] = lambda size, stride, dtype: calls.append(("torch", size))
    call = namespace["call"].__func__
    plain = kept_buffers.routed_function(WRAPPER, call.__code__, kept_buffers.LOW_BYTES)
    for name in (kept_buffers._KEPT, kept_buffers._KEPT_COMPARED):
        namespace[name] = lambda size, stride, dtype: calls.append(("pool", size))
    namespace[kept_buffers._FLOOR] = kept_buffers.MIN_BYTES
    watch = namespace[kept_buffers._WATCH] = kept_buffers._Watch(call, plain)
    call.__code__ = kept_buffers.routed_function(WRAPPER, call.__code__, kept_buffers.LOW_BYTES, probed=True)
    totals, last_read = [0, 0.0], [None, None]

    def counter(i):
        def read_total():  # read twice a probed call, before it and after it: the call's cost between
            if last_read[i] == watch.calls:
                totals[i] += cost(watch.calls, namespace[kept_buffers._FLOOR])[i]
            last_read[i] = watch.calls
            return totals[i]
        return read_total

    monkeypatch.setattr(kept_buffers, "_minor_faults", counter(0))
    monkeypatch.setattr(kept_buffers, "_seconds", counter(1))
    return namespace, watch, calls


def _run(namespace, calls, n, s33=20):
    """``n`` calls; the last one's allocations, pool or torch, in order."""
    for _ in range(n):
        calls.clear()
        namespace["call"]((None, s33))
    return [who for who, _ in calls]


MIN, LOW = kept_buffers.MIN_BYTES, kept_buffers.LOW_BYTES
# s33 = 20: the [20, 100, 100, 1] float32 buffer is 781 KiB, kept only from a lowered floor
KEPT_FROM_4_MIB, KEPT_FROM_128_KIB = ["torch", "pool", "torch", "torch", "torch"], ["torch", "pool", "pool", "torch", "torch"]


def test_a_program_whose_calls_fault_keeps_its_buffers_from_128_kib(tmp_path, monkeypatch):
    # From call 5 the heap faults the buffers in (slower calls) unless they are kept.
    namespace, watch, calls = _faulting_wrapper(
        tmp_path, monkeypatch, lambda call, floor: (900, 5e-3) if call >= 5 and floor == MIN else (3, 3e-3))
    before = dynbatch.counters().get(kept_buffers.FLOOR_LOWERED, 0)
    assert _run(namespace, calls, 14) == KEPT_FROM_4_MIB  # calls 8-14 counted: seven
    assert watch.trial_from is None
    _run(namespace, calls, 1)  # call 15: the eighth
    assert watch.trial_from == 16
    # The two floors in turn, low, 4 MiB, 4 MiB, low: 16-19 allocate, 20-35 counted, eight at each.
    assert [_run(namespace, calls, 1) for _ in range(4)] == [KEPT_FROM_128_KIB, KEPT_FROM_4_MIB,
                                                             KEPT_FROM_4_MIB, KEPT_FROM_128_KIB]
    _run(namespace, calls, 15)
    assert namespace["call"].__func__.__code__ is not watch.plain  # still measuring
    _run(namespace, calls, 1)
    assert namespace["call"].__func__.__code__ is watch.plain  # decided: the calls count nothing more
    assert namespace[kept_buffers._FLOOR] == LOW
    assert _run(namespace, calls, 1) == KEPT_FROM_128_KIB
    assert dynbatch.counters()[kept_buffers.FLOOR_LOWERED] == before + 1


@pytest.mark.parametrize("at_low", [(900, 5e-3), (3, 5e-3)], ids=["faults stay", "no faster"])
def test_a_floor_that_does_not_end_the_faults_and_speed_calls_up_is_left(tmp_path, monkeypatch, at_low):
    namespace, watch, calls = _faulting_wrapper(
        tmp_path, monkeypatch, lambda call, floor: (900, 5e-3) if floor == MIN else at_low)
    before = dynbatch.counters().get(kept_buffers.FLOOR_LOWERED, 0)
    _run(namespace, calls, 34)
    assert watch.trial_from == 16 and namespace["call"].__func__.__code__ is not watch.plain
    _run(namespace, calls, 1)
    assert namespace["call"].__func__.__code__ is watch.plain
    assert namespace[kept_buffers._FLOOR] == MIN
    assert _run(namespace, calls, 1) == KEPT_FROM_4_MIB
    assert dynbatch.counters().get(kept_buffers.FLOOR_LOWERED, 0) == before


def test_faults_every_second_call_are_seen_and_tried_fairly(tmp_path, monkeypatch):
    # 1,200 pages every odd call at 4 MiB: 600 a call on average; kept from 128 KiB, none.
    namespace, watch, calls = _faulting_wrapper(
        tmp_path, monkeypatch, lambda call, floor: (1200, 5e-3) if call % 2 and floor == MIN else (0, 3e-3))
    _run(namespace, calls, 35)
    assert watch.trial_from == 16 and namespace["call"].__func__.__code__ is watch.plain
    assert namespace[kept_buffers._FLOOR] == LOW


def test_rare_faults_try_no_floor(tmp_path, monkeypatch):
    namespace, watch, calls = _faulting_wrapper(  # one call in eight: 112 pages a call on average
        tmp_path, monkeypatch, lambda call, floor: (900, 5e-3) if call % 8 == 0 else (0, 3e-3))
    _run(namespace, calls, kept_buffers.PROBED_CALLS)
    assert watch.trial_from is None and namespace["call"].__func__.__code__ is watch.plain
    assert namespace[kept_buffers._FLOOR] == MIN


@pytest.mark.parametrize("faults", [0, kept_buffers.FAULTS_TO_LOWER - 1])
def test_a_program_that_faults_little_keeps_only_large_buffers(tmp_path, monkeypatch, faults):
    namespace, watch, calls = _faulting_wrapper(tmp_path, monkeypatch, lambda call, floor: (faults, 1e-3))
    _run(namespace, calls, kept_buffers.PROBED_CALLS - 1)
    assert namespace["call"].__func__.__code__ is not watch.plain
    assert _run(namespace, calls, 1) == KEPT_FROM_4_MIB
    assert namespace["call"].__func__.__code__ is watch.plain
    assert namespace[kept_buffers._FLOOR] == MIN


_FAULTING_PROCESS = """
import json, resource
import torch
import dynbatch

def rows(x, w, v):  # [512, 32, 32] grads: buffers of 2 MiB, under MIN_BYTES
    x = x.detach().requires_grad_()
    y = torch.tanh(x @ w) * torch.sigmoid(x @ w)
    return torch.autograd.grad(y, x, v, is_grads_batched=True)[0]

def rows_large(x, w, v):  # the same, a code object of its own: a program of its own
    return rows(x, w, v)

gen = torch.Generator().manual_seed(0)
x, w = torch.randn(32, 32, generator=gen), torch.randn(32, 32, generator=gen) / 8
v = torch.randn(512, 32, 32, generator=gen)
x_ = x.detach().requires_grad_()
y = torch.tanh(x_ @ w) * torch.sigmoid(x_ @ w)
loop = torch.stack([torch.autograd.grad(y, x_, g, retain_graph=True)[0] for g in v])
result = {}
for keep, fn in [(True, rows), ("large", rows_large)]:
    f = torch.compile(fn, backend="dynbatch", fullgraph=True, dynamic=False,
                      options={"dynbatch.keep_cpu_buffers": keep})
    for _ in range(40):
        out = f(x, w, v)
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    for _ in range(10):
        out = f(x, w, v)
    faults = (resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before) / 10
    result[str(keep)] = {"faults": faults, "error": (out - loop).abs().max().item(), "counters": dynbatch.counters()}
print(json.dumps(result))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="faults are counted per thread on Linux")
def test_a_program_that_faults_in_a_real_process_stops_faulting(tmp_path):
    # glibc maps every allocation from 128 KiB afresh (its threshold fixed, not raised by
    # frees) and unmaps it when freed: each call's 2 MiB buffers fault in, unless kept.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 << 10), "OMP_NUM_THREADS": "1",
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    done = subprocess.run([sys.executable, "-c", _FAULTING_PROCESS], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    adapted, large = result["True"], result["large"]
    assert adapted["error"] < 1e-4 and large["error"] < 1e-4
    assert adapted["counters"]["graphs_batched"] == 1 and large["counters"]["graphs_batched"] == 2  # the backend ran
    assert adapted["counters"].get(kept_buffers.FLOOR_LOWERED) == 1
    assert large["counters"].get(kept_buffers.FLOOR_LOWERED) == 1  # the first program's alone
    assert adapted["faults"] < kept_buffers.FAULTS_TO_LOWER / 4
    assert large["faults"] >= kept_buffers.FAULTS_TO_LOWER  # the faults the lower floor takes away
