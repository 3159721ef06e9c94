"""A torch bug around threads: FakeTensorMode's CUDA guard on a CUDA build without a GPU.

Not a shim over an API but a workaround with state of its own (a lock, a flag, a
thread parked for the life of the process), so it lives apart from ``_compat``.
``grad_calls.capture_scope`` calls it before every compile; only the first call
does anything.  If the private function it calls has moved, the workaround is
off with a warning (``fail_soft``) and only threaded compiles are at risk.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch

from .. import fail_soft

_FAKE_CUDA_GUARD_PINNED = False
_FAKE_CUDA_GUARD_LOCK = threading.Lock()


def fake_cuda_guard_outlives_threads() -> None:
    """Work around a use-after-free in torch's FakeTensorMode (seen on 2.11.0,
    not on 2.14.1) on a CUDA build of torch where no GPU is usable.

    The first ``FakeTensorMode.__enter__`` of a process calls
    ``c10::impl::ensureCUDADeviceGuardSet``, which stores a pointer to a
    *thread_local* no-op CUDA guard in c10's global device-guard registry.
    When that thread exits, the pointer dangles and the next compile from
    another thread segfaults.  Making that first call from a thread that lives
    as long as the process (the main thread, or a parked daemon thread) keeps
    the guard alive; later calls find it set and do nothing.  Every compile
    traces with fake tensors, so this is called once, before the first one."""
    global _FAKE_CUDA_GUARD_PINNED
    with _FAKE_CUDA_GUARD_LOCK:
        if _FAKE_CUDA_GUARD_PINNED:
            return
        _FAKE_CUDA_GUARD_PINNED = True
        ensure = getattr(torch._C, "_ensureCUDADeviceGuardSet", None)
        # The same condition as FakeTensorMode.avoid_device_init on a CUDA build.
        if ensure is None or torch.version.cuda is None or torch.cuda.is_available():
            return
        try:
            call_on_a_lasting_thread(ensure)
        except Exception as e:  # noqa: BLE001 - only threaded compiles are at risk
            fail_soft.hook_failed("keeping FakeTensorMode's CUDA guard alive across threads", e)


def call_on_a_lasting_thread(fn: Callable[[], Any]) -> None:
    """Run ``fn`` on a thread that outlives every other: this one if it is the
    main thread, else a daemon thread parked for the life of the process."""
    if threading.current_thread() is threading.main_thread():
        fn()
        return
    done = threading.Event()

    def run_then_park() -> None:
        try:
            fn()
        finally:
            done.set()
        threading.Event().wait()  # keep this thread's thread_locals alive

    threading.Thread(target=run_then_park, name="dynbatch-fake-cuda-guard", daemon=True).start()
    done.wait()
