"""The stock ``torch.compile`` column, in a subprocess with a time limit.

Stock Dynamo with ``trace_autograd_ops=True`` fake-runs a batched grad
through the legacy vmap: on a new batch size it crashes, and it can take very
long on big graphs.  Running it in a worker process (multiprocessing
"spawn", so CUDA works there too) keeps the parent's Dynamo state clean and
lets a hung compile be killed.  The worker is reused across problems (one
torch import per run) with ``torch._dynamo.reset()`` before each problem; a
timeout kills it and the next problem starts a new one.  Crashes and
timeouts are recorded as the cell's status, never hidden.

With ``Task.interleave`` the worker keeps each case's call after its first
call and, once the cases are done, answers "time case i" requests: the parent
times this column in the same shuffled rounds as its in-process columns
(runner._time_interleaved), while it waits on the pipe.  The worker times its
own call, so the pipe's round trip is not in the figure.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import multiprocessing
import time
import warnings
from typing import Any, Callable, Iterator

from . import measure, variants, workloads

READY_TIMEOUT_S = 300.0  # importing torch in the worker; not part of any cell's limit


@dataclasses.dataclass(frozen=True)
class Task:
    """Rebuild problem ``index`` of ``workload`` and time the stock column on each case."""

    workload: str
    index: int
    tier: str
    batch_sizes: tuple[int, ...] | None
    device: str
    budget: measure.Budget
    references: tuple[Any, ...]  # numpy arrays (or None): eager_loop's result per case
    atoms: tuple[int, ...] | None = None  # workloads.build's atoms
    skips: tuple[str | None, ...] = ()  # per case: why not to run it (the parent's memory guard), or None
    interleave: bool = False  # leave steady-state timing to the parent's interleaved rounds


def worker(conn, threads: int | None = None) -> None:
    """The subprocess's main loop: one Task in, one message per case out."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    warnings.filterwarnings("ignore")
    torch._dynamo.config.trace_autograd_ops = True  # what makes this column "stock with captured grads"
    conn.send(("ready", None))
    while True:
        task = conn.recv()
        if task is None:
            return
        _run(conn, task)


def _run(conn, task: Task) -> None:
    import torch

    torch._dynamo.reset()
    device = torch.device(task.device)
    if device.type == "cuda":  # as in the parent (runner.run): full fp32, no TF32
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    try:
        problem = workloads.build(task.workload, task.tier, task.batch_sizes, device, task.atoms)[task.index]
        runner = variants.build("stock_compile", problem, device)
    except Exception as e:  # noqa: BLE001 - report it per case rather than kill the worker
        for _ in task.references:
            conn.send(("case", {"status": f"crashed: {measure.short_error(e)}"}))
        conn.send(("done", None))
        return
    skips = task.skips or (None,) * len(task.references)
    calls: dict[int, Callable[[], Any]] = {}
    for i, (case, ref, skip) in enumerate(zip(problem.cases, task.references, skips)):
        if skip:
            conn.send(("case", {"status": f"skipped: {skip}"}))
            continue
        call = functools.partial(runner.call, *runner.prepare(case))
        try:
            cell, _ = measure.measure_cell(call, device, task.budget, runner.to_torch,
                                           None if ref is None else torch.from_numpy(ref).to(device),
                                           steady=not task.interleave)
            if task.interleave:
                calls[i] = call
        except Exception as e:  # noqa: BLE001 - the crash is the finding
            cell = {"status": f"crashed: {measure.short_error(e)}"}
        conn.send(("case", cell))
    conn.send(("done", runner.compiles()))
    if task.interleave:
        _answer_timing_requests(conn, calls, measure.synchronizer(device))


def _answer_timing_requests(conn, calls: dict[int, Callable[[], Any]], sync: Callable[[], None]) -> None:
    """("time", i): run case i's call once and send its (seconds, CPU seconds); ("end", None): done."""
    while True:
        kind, i = conn.recv()
        if kind == "end":
            return
        try:
            cpu, start = time.process_time(), time.perf_counter()
            calls[i]()
            sync()
            conn.send(("timed", measure.SelfTimed(time.perf_counter() - start, time.process_time() - cpu)))
        except Exception as e:  # noqa: BLE001 - the parent records it as the cell's status
            conn.send(("timed", f"crashed: {measure.short_error(e)}"))


class StockColumn:
    """Parent side: sends tasks to the worker, enforces the per-case time limit."""

    def __init__(self, timeout_s: float, threads: int | None = None):
        self.timeout_s = timeout_s
        self.threads = threads
        self._ready = False
        self._ctx = multiprocessing.get_context("spawn")
        self._proc = None
        self._conn = None
        self._timing = False  # the worker answers timing requests until end_timing()

    def start(self, wait: bool = True) -> None:
        """Start the worker; with ``wait``, also wait for its torch import (so it overlaps nothing timed)."""
        if self._proc is None or not self._proc.is_alive():
            parent, child = self._ctx.Pipe()
            self._proc = self._ctx.Process(target=worker, args=(child, self.threads), daemon=True,
                                           name="dynbatch-bench-stock")
            self._proc.start()
            child.close()
            self._conn, self._ready = parent, False
        if wait and not self._ready:
            if not self._conn.poll(READY_TIMEOUT_S):
                self._kill()
                raise RuntimeError(f"the stock worker did not start within {READY_TIMEOUT_S:g} s")
            self._conn.recv()
            self._ready = True

    def run(self, task: Task, n_cases: int, on_case: Callable[[], None] = lambda: None):
        """Cells for each case, and graphs compiled (None if the worker died)."""
        self.start()
        self.end_timing()
        self._conn.send(task)
        self._timing = task.interleave
        cells: list[dict[str, Any]] = []
        while len(cells) < n_cases:
            message = self._receive()
            if isinstance(message, str):  # the worker timed out or died
                cells.append({"status": message})
                cells += [{"status": "skipped: an earlier case timed out or crashed the worker"}] * (
                    n_cases - len(cells))
                on_case()
                return cells, None
            cells.append(message[1])
            on_case()
        message = self._receive()
        return cells, (None if isinstance(message, str) else message[1])

    def time_call(self, case_index: int) -> "measure.SelfTimed":
        """One timed call of a case the last ``run(task)`` (with ``interleave``) kept."""
        self._conn.send(("time", case_index))
        message = self._receive()
        if isinstance(message, str) or isinstance(message[1], str):
            raise RuntimeError(message if isinstance(message, str) else message[1])
        return message[1]

    def end_timing(self) -> None:
        """Let the worker drop the calls it kept (and take the next task)."""
        if self._timing and self._conn is not None:
            self._conn.send(("end", None))
        self._timing = False

    def _receive(self):
        if not self._conn.poll(self.timeout_s):
            self._kill()
            return f"timed out after {self.timeout_s:g} s"
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            code = self._proc.exitcode if self._proc is not None else None
            self._kill()
            return f"crashed: the worker process died (exit code {code})"

    def close(self) -> None:
        if self._proc is None:
            return
        try:
            self.end_timing()
            self._conn.send(None)
            self._proc.join(timeout=10)
        except (BrokenPipeError, OSError):
            pass
        self._kill()

    def _kill(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()  # only ever our own worker, by its handle
            self._proc.join(timeout=10)
        if self._conn is not None:
            self._conn.close()
        self._proc = self._conn = None
        self._timing = False


# --- stock with the grad traced, as MACE prepares it (in-process columns) ---------------

@contextlib.contextmanager
def grad_traced_as_mace_does(prepare: Callable[[], None] | None = None) -> Iterator[None]:
    """Stock Dynamo configured as MACE configures it for torch.compile
    (``mace.tools.compile.configure_autograd_for_compile(True)``:
    ``allow_in_graph(torch.autograd.grad)`` and ``trace_autograd_ops=True``), or by
    ``prepare`` (MACE's own function, where mace-torch is installed), undone on exit.
    Global state, so an in-process column applies it around its own calls only."""
    import torch

    with _in_graph_rules_restored(torch.autograd.grad):
        if prepare is not None:
            prepare()
        else:
            torch.compiler.allow_in_graph(torch.autograd.grad)
            torch._dynamo.config.trace_autograd_ops = True
        yield


@contextlib.contextmanager
def _in_graph_rules_restored(fn: Callable) -> Iterator[None]:
    """Whatever the block does to ``fn``'s allow/disallow-in-graph state
    (``torch.compiler.allow_in_graph`` has no inverse: ``disallow_in_graph`` forces a
    graph break, which is not the default either) and to ``trace_autograd_ops``, undone
    on exit.  Dynamo's private tables: bench code, not dynbatch's."""
    import torch
    from torch._dynamo import trace_rules

    ident = id(fn)
    tables = (trace_rules._allowed_callable_ids, trace_rules._disallowed_callable_ids)
    saved = [ident in table for table in tables]
    saved_trace = torch._dynamo.config.trace_autograd_ops
    try:
        yield
    finally:
        torch._dynamo.config.trace_autograd_ops = saved_trace
        for table, held in zip(tables, saved):
            if held:
                table.add(ident)
            else:
                table.remove(ident)
