"""Measuring one cell: first call, steady-state time, peak memory, error.

Timing is a plain loop with ``time.perf_counter`` and a device synchronise
after every call (so a CUDA number is the latency the caller sees), one
warm-up call after the first, then as many calls as the budget allows; the
cell keeps every raw time so the report can show median and IQR.

The columns of one case are timed interleaved (``interleaved_times``): each
round runs every column, in a shuffled order, for a short block of warm
consecutive calls.  A shared machine's speed drifts by more than the gaps
being measured (identical programs timed minutes apart differed by up to
1.35x); interleaved, a drift slows every column alike and the ratios between
columns hold.  Blocks, not single calls: a call right after another column's
finds its caches (and XLA's thread pool) cold, which is not the steady state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import re
import resource
import statistics
import sys
import threading
import time
from typing import Any, Callable

import torch

from dynbatch.cpu import kept_buffers


@dataclasses.dataclass(frozen=True)
class Budget:
    """How long to time a steady-state cell."""

    # Identical programs timed interleaved with 5 calls each read up to 1.36x apart on
    # the shared 2-core machine (one slow round decides a median of 5); 9 calls hold them within a few %.
    min_time_s: float = 1.0  # keep calling until this much time has passed ...
    min_reps: int = 9  # ... and at least this many calls were timed,
    max_reps: int = 200  # but never more than this many,
    max_time_s: float = 5.0  # and stop at this time once 3 calls are in (slow cells).
    warm_up: bool = True  # one untimed call before the timed ones

    @classmethod
    def quick(cls) -> "Budget":
        return cls(min_time_s=0.02, min_reps=3, max_reps=20, max_time_s=1.0)

    @classmethod
    def single_call(cls) -> "Budget":
        """One timed call after the first, no warm-up: for calls that take minutes."""
        return cls(min_time_s=0.0, min_reps=1, max_reps=1, max_time_s=0.0, warm_up=False)


def synchronizer(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return torch.cuda.synchronize
    return lambda: None


def first_call(fn: Callable[[], Any], sync: Callable[[], None]) -> tuple[Any, float]:
    """Run once, compile included; return the result and the seconds it took."""
    start = time.perf_counter()
    result = fn()
    sync()
    return result, time.perf_counter() - start


def steady_times(fn: Callable[[], Any], sync: Callable[[], None], budget: Budget) -> list[float]:
    """Seconds per call over repeated calls, after one warm-up call (if the budget has one)."""
    if budget.warm_up:
        fn()
        sync()
    times: list[float] = []
    began = time.perf_counter()
    while len(times) < budget.max_reps:
        start = time.perf_counter()
        fn()
        sync()
        now = time.perf_counter()
        times.append(now - start)
        spent = now - began
        if spent >= budget.min_time_s and len(times) >= budget.min_reps:
            break
        if spent >= budget.max_time_s and len(times) >= 3:
            break
    return times


@dataclasses.dataclass(frozen=True)
class SelfTimed:
    """What a call that timed itself returns (the stock column, timed in its own
    process): used by ``interleaved_times`` instead of the caller's clock."""

    seconds: float
    cpu_seconds: float


def interleaved_times(calls: dict[str, Callable[[], Any]], sync: Callable[[], None], budget: Budget,
                      seed: int = 0, block_s: float = 0.05) -> dict[str, dict[str, Any]]:
    """Seconds per call of every column, timed in rounds: each round runs every
    column (shuffled) for a block of about ``block_s`` of consecutive calls, after
    one untimed call that warms the caches the other columns used (a column
    slower than a block gets one timed call and no warm-up).  So the calls are
    warm, as in a loop, and a drifting machine still slows every column alike.
    Also each column's cores_used over its own timed calls.  The budget's limits
    apply per column.  A call that returns a ``SelfTimed`` reports its own time
    (it ran in another process)."""
    order, rng = list(calls), random.Random(seed)
    times: dict[str, list[float]] = {name: [] for name in order}
    cpu = dict.fromkeys(order, 0.0)

    def timed(name: str) -> float:
        cpu_start, start = time.process_time(), time.perf_counter()
        result = calls[name]()
        sync()
        if isinstance(result, SelfTimed):
            cpu[name] += result.cpu_seconds
            return result.seconds
        cpu[name] += time.process_time() - cpu_start
        return time.perf_counter() - start

    first = {name: timed(name) for name in order}  # the warm-up call, which also sizes the blocks
    cpu = dict.fromkeys(order, 0.0)
    block = {name: max(1, int(block_s / max(first[name], 1e-9))) for name in order}

    def done(name: str) -> bool:
        reps, spent = len(times[name]), sum(times[name])
        return (reps >= budget.max_reps or (spent >= budget.min_time_s and reps >= budget.min_reps)
                or (spent >= budget.max_time_s and reps >= 3))

    while not all(map(done, order)):
        rng.shuffle(order)
        for name in order:
            if block[name] > 1:
                calls[name]()  # untimed: the other columns' calls ran since this one's last
                sync()
            for _ in range(min(block[name], max(1, budget.max_reps - len(times[name])))):
                times[name].append(timed(name))
    return {name: {"times_s": t, "cores_used": cpu[name] / sum(t) if sum(t) > 0 else float("nan")}
            for name, t in times.items()}


def median_us(times: list[float]) -> float:
    """The median of ``times`` (seconds) in microseconds."""
    return statistics.median(times) * 1e6


def fmt_us(us: float | None) -> str:
    """Microseconds as the tables show them ("–": not measured)."""
    return "–" if us is None else f"{us:.1f}"


def cores_used(cpu_before: float, wall_before: float) -> float:
    """The process's CPU time over wall time since the two readings: how many
    cores the column kept busy while it was timed (every thread of this process,
    torch's and XLA's pools included).  A one-core run should read at most ~1."""
    wall = time.perf_counter() - wall_before
    return (time.process_time() - cpu_before) / wall if wall > 0 else float("nan")


def summarize(times: list[float]) -> dict[str, float]:
    """Median and interquartile range of raw times, in seconds."""
    if len(times) >= 2:
        q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive")
    else:
        q1 = q3 = times[0]
    return {"median_s": statistics.median(times), "iqr_s": q3 - q1, "reps": len(times)}


# --- memory -----------------------------------------------------------------

CUDA_MEMORY = "torch.cuda.max_memory_allocated growth during one call"
CPU_MEMORY = ("peak of the bytes torch's CPU allocator holds during one call, from the profiler's "
              "memory events (tensors only: not Python objects, not the allocator's caches)")
RSS_MEMORY = ("peak RSS growth during one call, sampled every 0.5 ms from /proc/self/statm "
              "(approximate: the C allocator keeps memory freed by earlier calls, so this often reads 0)")


def memory_method(device: torch.device) -> str:
    return CUDA_MEMORY if device.type == "cuda" else CPU_MEMORY


def peak_memory(fn: Callable[[], Any], sync: Callable[[], None], device: torch.device,
                torch_tensors: bool = True) -> tuple[int, str]:
    """Bytes of extra memory one call needs at its peak, and how that was measured."""
    if device.type == "cuda" and torch_tensors:
        sync()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        sync()
        return max(0, torch.cuda.max_memory_allocated(device) - base), CUDA_MEMORY
    if torch_tensors:
        kept_buffers.release()  # what dynbatch's programs keep between calls, allocated again and counted
        try:
            return _profiled_peak(fn), CPU_MEMORY
        except Exception:  # noqa: BLE001 - the profiler's internals move; fall back to RSS
            pass
    if os.path.exists("/proc/self/statm"):
        with _RssSampler() as sampler:
            fn()
        return sampler.growth, RSS_MEMORY
    before = _maxrss_bytes()
    fn()
    return max(0, _maxrss_bytes() - before), "growth of ru_maxrss during one call (approximate)"


def _profiled_peak(fn: Callable[[], Any]) -> int:
    """Largest running sum of the allocations and frees the profiler records during ``fn()``."""
    from torch.profiler import ProfilerActivity, profile

    with quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


@contextlib.contextmanager
def quiet_stderr():
    """Silence file descriptor 2: the profiler's C++ side prints a line at every start and stop."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _maxrss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB, macOS bytes


class _RssSampler(contextlib.AbstractContextManager):
    """Samples this process's resident set size on a thread while a call runs."""

    _page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

    def __enter__(self):
        self._stop = threading.Event()
        self._base = self._peak = self._rss()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._peak = max(self._peak, self._rss())
        return False

    @property
    def growth(self) -> int:
        return max(0, self._peak - self._base)

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def _sample(self) -> None:
        while not self._stop.wait(0.0005):
            self._peak = max(self._peak, self._rss())


# --- errors -----------------------------------------------------------------

def max_abs_error(result: torch.Tensor, reference: torch.Tensor) -> float:
    if result.shape != reference.shape:
        raise ValueError(f"result shape {tuple(result.shape)} != reference shape {tuple(reference.shape)}")
    return (result.detach().double() - reference.detach().double()).abs().max().item()


def short_error(exc: BaseException, limit: int = 160) -> str:
    """``Type: first line`` of the real error: Dynamo wraps it, as a cause or inside its message."""
    root = exc
    while root.__cause__ is not None and root.__cause__ is not root:
        root = root.__cause__
    text = str(root)
    # Dynamo's "Dynamo failed to run FX node with fake tensors: ... got RuntimeError('...')".
    inner = re.search(r"got (\w+)\((['\"])(.*?)(?:\\n|\2\))", text, re.S)
    if inner:
        detail = f"{inner.group(1)}: {inner.group(3).strip()}"
    else:
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        # Inductor's "backend='inductor' raised:" names the error on the next line.
        detail = " ".join(lines[:2]) if lines and lines[0].endswith(":") else (lines[0] if lines else "")
    name = type(root).__name__
    text = f"{name}: {detail}" if detail and not detail.startswith(name) else (detail or name)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --- one cell -----------------------------------------------------------------

def measure_cell(
    fn: Callable[[], Any],
    device: torch.device,
    budget: Budget,
    to_torch: Callable[[Any], torch.Tensor],
    reference: torch.Tensor | None,
    torch_tensors: bool = True,
    steady: bool = True,
) -> tuple[dict[str, Any], torch.Tensor]:
    """Every figure of one (column, case) cell; returns it and the result (as torch).

    ``steady=False`` leaves the steady-state times to ``interleaved_times``."""
    sync = synchronizer(device)
    result, first = first_call(fn, sync)
    result = to_torch(result)
    cell: dict[str, Any] = {"status": "ok", "first_call_s": first}
    if steady:
        cpu_before, wall_before = time.process_time(), time.perf_counter()
        times = steady_times(fn, sync, budget)
        cell.update(summarize(times), times_s=times, cores_used=cores_used(cpu_before, wall_before),
                    timing="sequential")
    else:
        fn()  # the warm-up call steady_times would make
        sync()
    cell["peak_mem_bytes"], cell["mem_method"] = peak_memory(fn, sync, device, torch_tensors)
    cell["max_abs_err"] = max_abs_error(result, reference) if reference is not None else None
    return cell, result
