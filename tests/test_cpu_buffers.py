"""Large CPU buffers kept between calls (dynbatch/cpu_buffers.py, NOTE [Reused CPU buffers]):
handed out again only once no tensor uses them, and never changing a value."""

from __future__ import annotations

import threading

import pytest
import torch

import dynbatch
from dynbatch import cpu_buffers
from conftest import DEFAULTS, assert_backend_ran, assert_same_grads, compile_dynbatch, loop_grads

UNIT = cpu_buffers.MIN_BYTES  # the smallest buffer kept
LARGE = (2 * UNIT // 4096, 1024)  # float32: kept
STRIDE = (1024, 1)


@pytest.fixture(autouse=True)
def nothing_kept():
    cpu_buffers.release()
    yield
    cpu_buffers.release()


def _large() -> torch.Tensor:
    return cpu_buffers.empty_strided(LARGE, STRIDE, torch.float32)


def test_a_small_buffer_is_torchs_own():
    for size, stride in [((4, 8), (8, 1)), ((UNIT // 8192, 1024), (1024, 1)), ((), ())]:
        t = cpu_buffers.empty_strided(size, stride, torch.float32)
        assert (t.shape, t.stride(), t.dtype) == (size, stride, torch.float32)
    assert cpu_buffers.kept_bytes() == 0


def test_a_freed_buffer_serves_the_next_request_of_its_size():
    first = _large()
    assert (first.shape, first.stride(), first.dtype) == (LARGE, STRIDE, torch.float32)
    address = first.data_ptr()
    del first
    assert _large().data_ptr() == address
    assert cpu_buffers.kept_bytes() == 2 * UNIT


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
    t = cpu_buffers.empty_strided((rows, 1024), (1, rows), torch.float64)  # column-major, one unit
    assert (t.shape, t.stride(), t.dtype) == ((rows, 1024), (1, rows), torch.float64)
    assert cpu_buffers.kept_bytes() == UNIT
    t.copy_(torch.arange(t.numel(), dtype=torch.float64).view(1024, rows).t())
    assert t[3, 5].item() == 5 * rows + 3


def _units(n: float) -> torch.Tensor:
    return cpu_buffers.empty_strided((int(n * UNIT) // 4096, 1024), STRIDE, torch.float32)


@pytest.mark.parametrize("slack", [1, 2])
def test_unused_buffers_of_other_sizes_stay_within_the_slack(monkeypatch, slack):
    monkeypatch.setattr(cpu_buffers, "SLACK", slack)
    two = _units(2)
    del two
    eight = _units(8)  # the 2-unit one does not fit: kept only while 2 + 8 <= slack * 8
    assert cpu_buffers.kept_bytes() == (10 if slack == 2 else 8) * UNIT
    del eight
    three = _units(3)  # under half of the free 8-unit one: a buffer of its own
    assert three.data_ptr() not in {k.buffer.data_ptr() for k in cpu_buffers._kept if k.nbytes() == 8 * UNIT}
    kept = cpu_buffers.kept_bytes()
    assert _units(0.5).shape == (UNIT // 8192, 1024)  # small: torch's own, nothing kept for it
    assert cpu_buffers.kept_bytes() == kept <= slack * 11 * UNIT


def test_beyond_the_bound_buffers_are_not_kept(monkeypatch):
    monkeypatch.setattr(cpu_buffers, "MAX_KEPT_BYTES", 3 * UNIT)
    first = _large()
    second = _large()  # the first is in use and the bound is reached: torch's own
    assert cpu_buffers.kept_bytes() == 2 * UNIT
    assert first.data_ptr() != second.data_ptr()


def test_release_keeps_tensors_in_use_valid():
    held = _large().fill_(3.0)
    cpu_buffers.release()
    assert cpu_buffers.kept_bytes() == 0
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
        kept = cpu_buffers.kept_bytes()
        assert (kept > 0) == keep
    assert cpu_buffers.kept_bytes() == kept  # steady: no new buffer after the first calls
    for out, v in zip(outs, vs):  # each output held while the later calls ran
        x_ = x.detach().requires_grad_()
        y = torch.tanh(x_ @ w) * torch.sigmoid(x_ @ w)
        assert_same_grads(out, loop_grads(y, x_, v), atol=1e-5, rtol=1e-4)
    assert_backend_ran(graphs=dynbatch.counters().get("graphs", 0))
    assert dynbatch.counters().get("grads_batched", 0) >= 1


def test_a_buffer_the_caller_keeps_is_forgotten(monkeypatch):
    monkeypatch.setattr(cpu_buffers, "FORGET_AFTER", 3)
    held = _large().fill_(5.0)
    for _ in range(5):  # others come and go: the held one stays in use
        other = _units(1)
        del other
    assert cpu_buffers.kept_bytes() == UNIT  # only the one in turn
    assert torch.all(held == 5.0)
    del held  # torch's again: nothing kept grows
    _units(1)
    assert cpu_buffers.kept_bytes() == UNIT


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
    code = cpu_buffers.routed_function(WRAPPER, namespace["call"].__code__)
    namespace["call"].__func__.__code__ = code  # as install does
    namespace[cpu_buffers._KEPT] = lambda size, stride, dtype: calls.append(("pool", size))
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
    assert cpu_buffers.routed_function(small, namespace["call"].__code__) is None


def test_an_allocation_outside_the_call_is_not_routed_silently(tmp_path):
    namespace = _wrapper(tmp_path)
    elsewhere = WRAPPER + "\ndef other():\n    return empty_strided_cpu((4, 4), (4, 1), torch.float32)\n"
    with pytest.raises(LookupError, match="outside"):
        cpu_buffers.routed_function(elsewhere, namespace["call"].__code__)


def test_a_dynamic_programs_small_calls_never_reach_the_pool(monkeypatch):
    pooled = []
    pool = cpu_buffers.empty_strided
    monkeypatch.setattr(cpu_buffers, "empty_strided", lambda *a: pooled.append(a[0]) or pool(*a))
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
    assert cpu_buffers.kept_bytes() > 0
    assert_backend_ran(graphs=2)
