"""Memory and threads (issue 4, item 6).

* 1,000 calls of a compiled batched grad: after call 10 neither Python
  allocations (tracemalloc) nor the process RSS grow beyond a small
  tolerance.
* Tensors passed to a compiled call, and the grads it returns, are freed once
  the caller drops them (weakrefs die): the compiled function, dynbatch's
  records and Dynamo's caches keep no reference.
* Same-shape calls do not grow Dynamo's cache entries or dynbatch's records.
* Four threads calling one compiled function at once get the right grads,
  whether the function was compiled beforehand or they race to compile it
  (racing, Dynamo compiles once per thread that missed its cache: up to four
  graphs, as with any backend).
"""

from __future__ import annotations

import gc
import os
import threading
import tracemalloc
import weakref

import pytest
import torch

import dynbatch
from conftest import assert_same_grads, compile_dynbatch, loop_grads

W = torch.randn(16, 16, generator=torch.Generator().manual_seed(0)) / 4


def jacobian_program(x, V):
    x = x.detach().requires_grad_()
    y = torch.tanh(torch.tanh(x @ W) @ W)
    return torch.autograd.grad(y, x, V, is_grads_batched=True)


def leaf_program(x, V):
    return torch.autograd.grad(torch.sin(x @ W), x, V, is_grads_batched=True)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="RSS is read from /proc (Linux only)")
def test_thousand_calls_do_not_grow_memory():
    compiled = compile_dynbatch(jacobian_program)
    x, V = torch.randn(4, 16), torch.randn(8, 4, 16)
    expected = jacobian_program(x, V)
    for _ in range(10):
        compiled(x, V)
    gc.collect()
    tracemalloc.start()
    try:
        base_py = tracemalloc.get_traced_memory()[0]
        base_rss = _rss_bytes()
        for i in range(990):
            out = compiled(x, V)
            if i == 494:
                mid_py = tracemalloc.get_traced_memory()[0]
        del out
        gc.collect()
        end_py = tracemalloc.get_traced_memory()[0]
        end_rss = _rss_bytes()
    finally:
        tracemalloc.stop()
    assert_same_grads(compiled(x, V), expected)
    growth_py, growth_rss = end_py - base_py, end_rss - base_rss
    print(f"\ndynbatch memory: 990 calls after warm-up: python {growth_py / 1024:.1f} KiB "
          f"(halfway {(mid_py - base_py) / 1024:.1f} KiB), rss {growth_rss / 2**20:.2f} MiB")
    # A one-off ~40 KiB appears in the first calls traced (caches warming); a
    # leak would keep growing, so the second half must add (almost) nothing.
    assert growth_py < 128 * 1024, f"tracemalloc grew {growth_py} bytes over 990 calls"
    assert end_py - mid_py < 16 * 1024, f"tracemalloc grew {end_py - mid_py} bytes over the last 495 calls"
    assert growth_rss < 16 * 2**20, f"RSS grew {growth_rss} bytes over 990 calls"
    assert dynbatch.counters()["graphs"] == 1


@pytest.mark.parametrize("program", [jacobian_program, leaf_program], ids=["detached_inside", "leaf_input"])
def test_inputs_and_grads_are_freed_after_del(program):
    compiled = compile_dynbatch(program)
    compiled(torch.randn(4, 16, requires_grad=True), torch.randn(3, 4, 16))  # compile first
    x = torch.randn(4, 16, requires_grad=True)
    V = torch.randn(3, 4, 16)
    (g,) = compiled(x, V)
    refs = [weakref.ref(t) for t in (x, V, g)]
    del x, V, g
    gc.collect()
    assert [r() is None for r in refs] == [True, True, True], "a compiled call kept a tensor alive"


def _graph_modules() -> list[torch.fx.GraphModule]:
    # type() rather than isinstance(): gc also lists weak proxies, whose
    # isinstance() raises ReferenceError once their object is gone.
    return [o for o in gc.get_objects() if issubclass(type(o), torch.fx.GraphModule)]


def test_graph_modules_are_freed_after_reset():
    """compile_records() keep text only; once Dynamo's cache is reset and the
    compiled function dropped, the graphs of this compile are freed."""
    gc.collect()
    before = {id(gm) for gm in _graph_modules()}
    compiled = compile_dynbatch(jacobian_program)
    compiled(torch.randn(4, 16), torch.randn(3, 4, 16))
    assert all(isinstance(r.dynamo_graph, str) for r in dynbatch.compile_records())
    held = [weakref.ref(gm) for gm in _graph_modules() if id(gm) not in before]
    assert held, "the compile made graph modules"
    del compiled
    torch._dynamo.reset()
    gc.collect()
    alive = [r() for r in held if r() is not None]
    assert not alive, f"{len(alive)} of {len(held)} graph modules survive reset"


def test_cache_does_not_grow_on_same_shape_calls():
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    compiled = compile_dynbatch(jacobian_program)
    x = torch.randn(4, 16)
    compiled(x, torch.randn(5, 4, 16))
    entries = len(_debug_get_cache_entry_list(jacobian_program.__code__))
    records = len(dynbatch.compile_records())
    for seed in range(50):
        compiled(torch.randn(4, 16), torch.randn(5, 4, 16, generator=torch.Generator().manual_seed(seed)))
    assert len(_debug_get_cache_entry_list(jacobian_program.__code__)) == entries == 1
    assert len(dynbatch.compile_records()) == records == 1
    assert dynbatch.counters()["graphs"] == 1


def _thread_inputs(k: int):
    g = torch.Generator().manual_seed(100 + k)
    return torch.randn(4, 16, generator=g), torch.randn(5 + k % 2, 4, 16, generator=g)


def _expected(x, V):
    x = x.detach().requires_grad_()
    y = torch.tanh(torch.tanh(x @ W) @ W)
    return loop_grads((y,), (x,), (V,))


# torch < 2.14 keeps FX's "symbolic tracing now" flag in a module global, not
# per thread (2.14 made it thread-local).  While one thread compiles (AOTAutograd
# traces with make_fx), another thread's call of an already compiled function
# sees the flag and Dynamo raises before any backend code runs.  Any backend
# meets this; a caller on those versions retries.  Seen on 2.11 under pytest.
FX_TRACING_FLAG_IS_GLOBAL = not hasattr(torch.fx._symbolic_trace, "_is_fx_tracing_tls")
NESTED_FX_TRACE = "using FX to symbolically trace a dynamo-optimized function"


def _call_past_fx_flag_race(compiled, x, V):
    while True:
        try:
            return compiled(x, V)
        except RuntimeError as e:
            if not (FX_TRACING_FLAG_IS_GLOBAL and NESTED_FX_TRACE in str(e)):
                raise


@pytest.fixture
def dynamo_state_restored():
    """torch 2.11 keeps two pieces of Dynamo's state process-wide that each compiled
    call sets on entry and restores on exit, so threads entering and leaving in an
    interleaved order can leave them changed (a torch race, any backend; 2.12 on keeps
    the first per context and has no second):

    - config overrides: ``torch.compile(dynamic=True)`` sets
      ``assume_static_by_default=False``; left False, every later compile in the
      process makes its ints symbolic;
    - the eval-frame override: a ``fullgraph=True`` call sets it to SKIP; left SKIP,
      every later compiled call runs what it calls after a graph break without
      Dynamo (no graph for it: a later test asserting one failed, 2.11 only)."""
    config = torch._dynamo.config
    saved = config.get_config_copy()
    eval_frame = torch._C._dynamo.eval_frame
    override = getattr(eval_frame, "set_eval_frame_override", None)  # torch 2.11 only
    if override is not None:
        saved_override = override(eval_frame._EvalFrameOverride.NONE)
        override(saved_override)
    yield
    for key, value in saved.items():
        if getattr(config, key) != value:
            setattr(config, key, value)
    if override is not None:
        override(saved_override)


@pytest.mark.usefixtures("dynamo_state_restored")
@pytest.mark.parametrize("warm", [True, False], ids=["compiled_first", "racing_to_compile"])
def test_four_threads_get_correct_grads(warm):
    compiled = compile_dynbatch(jacobian_program, dynamic=True)
    if warm:
        compiled(*_thread_inputs(99))
    results: dict[int, list] = {k: [] for k in range(4)}
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def worker(k: int) -> None:
        try:
            start.wait()
            for i in range(25):
                x, V = _thread_inputs(k + 4 * i)
                results[k].append((x, V, _call_past_fx_flag_race(compiled, x, V)))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors, errors
    assert all(len(r) == 25 for r in results.values())
    for k, runs in results.items():
        for x, V, got in runs:
            assert_same_grads(got, _expected(x, V), msg=f"thread {k}")
    c = dynbatch.counters()
    assert not c.get("fallbacks"), c
    # Compiled first: B=5 and B=6 share the dynamic=True graph.  Racing: Dynamo
    # itself compiles once per thread that missed the cache while another
    # thread was compiling ("Unexpected recompilation" in TORCH_LOGS=recompiles;
    # stock backends do the same), so up to one graph per thread.
    assert c["graphs"] == 1 if warm else c["graphs"] <= 4, c


# --- torch's FakeTensorMode guard on a CUDA build without a GPU --------------

def test_lasting_thread_is_main_or_a_parked_daemon():
    from dynbatch.capture import fake_cuda_guard

    ran_on: list[threading.Thread] = []
    fake_cuda_guard.call_on_a_lasting_thread(lambda: ran_on.append(threading.current_thread()))
    worker = threading.Thread(target=fake_cuda_guard.call_on_a_lasting_thread,
                              args=(lambda: ran_on.append(threading.current_thread()),))
    worker.start()
    worker.join()
    assert ran_on[0] is threading.main_thread()
    assert ran_on[1] is not worker and ran_on[1].daemon and ran_on[1].is_alive()


def test_fake_cuda_guard_is_set_once_from_a_lasting_thread(monkeypatch):
    """Where torch would store a thread_local guard (a CUDA build, no GPU), the
    first compile sets it from a thread that outlives the compiling one."""
    from dynbatch.capture import fake_cuda_guard

    calls: list[threading.Thread] = []
    monkeypatch.setattr(fake_cuda_guard, "_FAKE_CUDA_GUARD_PINNED", False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch._C, "_ensureCUDADeviceGuardSet",
                        lambda: calls.append(threading.current_thread()), raising=False)
    for _ in range(2):
        t = threading.Thread(target=fake_cuda_guard.fake_cuda_guard_outlives_threads)
        t.start()
        t.join()
        assert not t.is_alive()
    assert len(calls) == 1 and calls[0].is_alive()


FAKE_MODE_FROM_EXITED_THREADS = """
import threading, torch
from torch._subclasses.fake_tensor import FakeTensorMode
from dynbatch.capture import fake_cuda_guard

def enter():
    with FakeTensorMode():
        torch.empty(3) + 1

first = threading.Thread(target=fake_cuda_guard.fake_cuda_guard_outlives_threads)
first.start(); first.join()
for _ in range(20):  # each thread exits before the next enters
    t = threading.Thread(target=enter); t.start(); t.join()
    [bytearray(64) for _ in range(10000)]  # reuse freed memory
print("ok")
"""


@pytest.mark.skipif(torch.version.cuda is None or torch.cuda.is_available(),
                    reason="torch's thread_local fake CUDA guard is used only by a CUDA build without a usable GPU")
def test_fake_mode_entered_from_threads_that_exit():
    """On torch 2.11's PyPI build without a GPU, this script segfaulted
    without dynbatch's workaround (the guard of an exited thread)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", FAKE_MODE_FROM_EXITED_THREADS],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", (done.returncode, done.stderr[-2000:])
