"""The background compile, ``options={"dynbatch.compile": "background"}``: a graph's first
calls run its batched aten graph with eager kernels while Inductor compiles it in a worker
process; its compiled program, loaded on a thread when it arrives, takes over at the next call.

NOTE [Background compile]
Where it hooks in.  AOTAutograd traces the batched graph (one batched backward, B symbolic):
with this option, on the thread that traces the frame aside (NOTE [Traced aside] in
capture/traced_aside.py).  For each aten graph (forward, backward) Inductor's inner
compile looks in its FX graph cache and, on a miss, calls its module global
``fx_codegen_and_compile``: lowering, codegen and the C++ build, what a first call waits for.
Inside dynbatch's inner compile only (``compiled_in_worker``), that call pickles the graph with
Inductor's own serializer (TORCHINDUCTOR_FX_COMPILE_MODE=subprocess's), sends it to a worker
and returns a ``BackgroundProgram``: the aten graph's ``forward`` on eager kernels (what the
aot_eager lowering runs) until the compiled program comes back, then that program, loaded as a
cache entry is and written to the FX graph cache (a later process's compile hits it).

Why not upstream's ``TORCHINDUCTOR_FX_COMPILE_MODE=async+subprocess``.  Its ``_AsyncFxCompile``
(torch 2.13) makes what it runs meanwhile with ``_InProcessFxCompile``: a full compile in the
user's thread (a first call of 10.2 s against 9.1 s without it, its C++ kernels built in the
user's process), then another in the worker; with the FX graph cache on, its program fails
the cache's ``set_triton_bundle``; and it is read from the environment at import, for every
backend.  Its parts (the serializer, the loader, the subprocess pool) are what this uses.

Why a process, not a thread.  Inductor's lowering, scheduling and codegen are Python (2-3 s of
the bench's force-training step's cold compile, beside 14-24 s of C++): a thread would hold the
GIL through them, over the very calls it exists to let run.  On one core, eager training steps
beside a compile in a thread stalled up to 204 ms (p99 9.3 ms, alone 1.6 ms); beside the worker,
up to 13 ms.  The worker is Inductor's ``SubprocPool``: a sidecar that starts its worker from a
fresh interpreter (never a fork of the user's); its reader thread waits on a pipe.  The thread
that traces the frame pays the pickling (0.1-0.2 s for the bench's training step); a thread
started when the program arrives loads it (Inductor's first load in a process probes the CPU's
vector instructions with gcc: a call that loaded it waited 1.3-1.6 s on the PaiNN-style
Hessian), and the first call after that runs it.  (The trace itself must be a thread's: it
reads the frame's objects.)

What the worker must get.  dynbatch's patches of Inductor (``inductor.inductor_patched``: the
scheduler fix, the extern convolutions, the routed products, the strides without sympy's
simplify) and its post-grad passes (``PostGradPasses``, with the clones that keep scatters right,
which Inductor's pickled config leaves out) are installed around the worker's compile
(``_compile_in_worker``); a pass of the user's cannot travel, so its graph compiles here.

Which cores.  The worker builds its C++ on every core the user's process may use, at a lower
priority (``WORKER_NICENESS``): the user's calls keep the cores they use, and the builds take
what they leave.  On one thread (as before) MACE's training step, on two cores, ran Inductor's
code 148.6 s after its first call, against the foreground's 94.3 s.

Same values.  Whichever of a forward and its backward runs compiled, the saved tensors must
have the strides both were traced with: layout optimisation (channels-last convolutions) is off
for these graphs, and the compiled forward never reports other strides to the backward's trace
(its ``post_compile`` runs when it is loaded).  The memory plan is the eager kernels' (unfused,
the larger): a grad it chunks compiles in the foreground, as chunk programs do.

Where it does not apply (logged at INFO): CUDA (untested), CUDA graphs, ``dynbatch.verify``,
chunked grads, the aot_eager inner compiler.  Its graphs skip AOTAutograd's cache (an entry
is written before their programs arrive).  A failed background compile
leaves the eager kernels running, with a warning.  The worker starts at the first aten graph
the FX graph cache does not hold (a warm start starts none: on a shared core its imports
would slow the first call) and stops IDLE_SECONDS after its last compile, and at
``dynbatch.reset()`` and at exit once the compiles sent to it have finished: the pool's
shutdown kills its jobs, and a C++ build killed midway would leave a half-written library in
Inductor's cache for every later process to load.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Iterator, Sequence

import torch

from .. import _compat, threads
from ..records import STATS

log = logging.getLogger("dynbatch")

# The ops whose graphs may be pickled for the worker.  Inductor's pickler takes aten's alone
# (a graph may be loaded on another machine); the worker is this machine, with this torch, and
# imports dynbatch (its ops) before it loads the graph.  Inductor's decompositions emit prims.
_PICKLED_OPS = ("torch.ops.aten.", "torch.ops.prims.", "torch.ops.dynbatch.")

# The environment Inductor's subprocess compile hands its worker (compile_fx_subproc.py):
# where the worker writes and looks up its C++ builds.
_WORKER_ENV = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


def applies(options: Any, record: Any, planner: Any, example_inputs: Sequence[Any]) -> bool:
    """Whether this graph's aten graphs compile in the background; where not, why, at INFO."""
    reason = _foreground_reason(options, record, planner, example_inputs)
    if reason is not None:
        log.info("dynbatch: this graph compiles in the foreground (dynbatch.compile='background'): %s", reason)
        return False
    return True


def _foreground_reason(options, record, planner, example_inputs) -> str | None:
    if options.inner_compiler != "inductor":
        return f"dynbatch.inner_compiler={options.inner_compiler!r} compiles no kernels"
    if record.chunk_program or planner.chunked:
        return "its batched grads run chunk by chunk, whose chunk programs compile with it"
    if options.verify:
        return "dynbatch.verify checks a graph's first call, which would run the eager kernels"
    if _inductor_option(options, "triton.cudagraphs"):
        return "CUDA graphs record the compiled program at its first calls"
    devices = {t.device.type for t in example_inputs if isinstance(t, torch.Tensor)}
    if devices - {"cpu"}:
        return f"it runs on {', '.join(sorted(devices - {'cpu'}))}: the background compile is built for the CPU's"
    for name in ("post_grad_custom_pre_pass", "post_grad_custom_post_pass"):
        if _inductor_option(options, name) is not None:
            return f"Inductor's {name} (the user's) does not travel to the worker process"
    missing = _compat.inductor_subprocess_compile_missing()
    if missing is not None:  # an internal moved: the foreground compile is the same program
        return f"Inductor's subprocess compile is not there on torch {torch.__version__} ({missing})"
    return None


def _inductor_option(options: Any, name: str) -> Any:
    if name in options.inductor_config:
        return options.inductor_config[name]
    value = _compat.inductor_config_value(name.split(".")[0])
    for part in name.split(".")[1:]:
        value = getattr(value, part)
    return value


def config_patches() -> dict[str, Any]:
    """What a background graph's Inductor config sets: no layout optimisation (NOTE
    [Background compile], "Same values")."""
    return {"layout_optimization": False}


def is_background_program(compiled: Any) -> bool:
    return isinstance(compiled, BackgroundProgram)


@contextlib.contextmanager
def compiled_in_worker(cpu_matmul: str, recompute: str,
                       on_ready: Callable[[Any], None] | None) -> Iterator[None]:
    """Around one inner compile: an FX-cache miss compiles in the worker (``on_ready``: what
    the compiled program gets when it arrives, e.g. kept CPU buffers)."""
    module = _compat.inductor_compile_fx_module()
    fx_cache = _compat.inductor_fx_graph_cache()
    original = module.fx_codegen_and_compile
    saved_save = fx_cache.__dict__["_save_graph"]
    save_graph = fx_cache._save_graph

    def fx_codegen_and_compile(gm, example_inputs, inputs_to_check, compile_region_name=None, **graph_kwargs):
        program = _start(gm, example_inputs, inputs_to_check, graph_kwargs, compile_region_name,
                         (cpu_matmul, recompute), on_ready)
        if program is None:
            return original(gm, example_inputs, inputs_to_check, compile_region_name=compile_region_name,
                            **graph_kwargs)
        return program

    def save_unless_background(key, compiled_graph, *args, **kwargs):
        if not isinstance(compiled_graph, BackgroundProgram):
            return save_graph(key, compiled_graph, *args, **kwargs)
        # Saved when the worker's program arrives, in this trace's context (whose shape env
        # gives the entry its guards), before its post_compile, as a miss saves it here.
        context = _compat.tracing_context()

        def save(compiled: Any) -> None:
            compiled._fx_graph_cache_key = key
            with _compat.in_tracing_context(context):
                save_graph(key, compiled, *args, **kwargs)

        compiled_graph.cache_writer = save
        return None

    module.fx_codegen_and_compile = fx_codegen_and_compile
    fx_cache._save_graph = staticmethod(save_unless_background)
    try:
        yield
    finally:
        module.fx_codegen_and_compile = original
        fx_cache._save_graph = saved_save


def _start(gm, example_inputs, inputs_to_check, graph_kwargs, region_name, worker_options,
           on_ready) -> BackgroundProgram | None:
    """Send one aten graph to the worker; None where Inductor cannot pickle it (then it
    compiles here, as without the option)."""
    sender = _compat.inductor_out_of_process_compile()
    try:
        with _compat.inductor_graph_pickler_ops(_PICKLED_OPS):
            serialized = sender.serialize_compile(gm, example_inputs, inputs_to_check, graph_kwargs)
        if serialized is None:
            raise TypeError("Inductor cannot pickle it")  # it logged why (a graph it cannot cache)
        pickled_input, constants = serialized
        env = {name: os.environ[name] for name in _WORKER_ENV if name in os.environ}
        future = _WORKER.submit(_compile_in_worker, pickled_input, env, _cores(), *worker_options)
    except Exception as e:  # noqa: BLE001 - the foreground compile is the same program
        log.info("dynbatch: an aten graph compiles in the foreground, not in the worker: %s: %s", type(e).__name__, e)
        return None
    STATS.count("background_compiles")

    def load(pickled_output: Any) -> Any:
        output = pickled_output.deserialize(constants)
        if region_name is not None and hasattr(output.graph, "compile_region_name"):
            output.graph.compile_region_name = region_name
        sender._postprocess(output)  # the worker's logs, warnings and metrics, replayed here
        return output.graph

    kind = "backward" if graph_kwargs.get("is_backward") else "forward"
    return BackgroundProgram(_compat.make_boxed_func(gm.forward), future, load, on_ready, kind)


# How much less the worker's process and its C++ builds count to the scheduler than the
# user's threads (nice(2)): at 10, a core both want gives the user's about 90 % of its time.
WORKER_NICENESS = 10


def _cores() -> int:
    """The cores this process may run on: the worker's C++ builds may use them all."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _compile_in_worker(pickled_input: Any, extra_env: dict, cores: int, cpu_matmul: str, recompute: str) -> Any:
    """In the worker process: Inductor's compile of one aten graph with dynbatch's patches and
    passes, as ``_lower_with_inductor`` installs them in the user's process, its C++ built on
    every core at a lower priority (NOTE [Background compile], "Which cores")."""
    from torch._inductor import config

    from . import aten_passes, inductor

    _lower_priority_once()
    passes = aten_passes.PostGradPasses(cpu_matmul, recompute_mode=recompute)
    with config.patch(post_grad_custom_pre_pass=passes, compile_threads=cores), \
            inductor.inductor_patched(cpu_matmul), _compat.inductor_graph_pickler_ops(_PICKLED_OPS):
        return _compat.inductor_compile_in_child(pickled_input, extra_env)


def _lower_priority_once() -> None:
    """In the worker, before its first compile: nice(2) applies to the calling thread and
    what it starts (Inductor's pool of C++ builders, gcc), so once, from the thread that compiles."""
    if not getattr(_lower_priority_once, "done", False):
        _lower_priority_once.done = True
        with contextlib.suppress(OSError):
            os.nice(WORKER_NICENESS)


class BackgroundProgram:
    """One aten graph's program as AOTAutograd calls it (boxed): the eager kernels, then the
    worker's compiled program, loaded on a thread when it arrives, from the first call after
    that.  Counted per call: ``background_eager_calls``, ``background_compiled_calls``."""

    # What Inductor's inner compile sets or reads on the program it hands out (OutputCode).
    _fx_graph_cache_key: str | None = None
    _fx_graph_cache_debug_lines: list[str] | None = None
    _time_taken_ns: int | None = None

    def __init__(self, eager: Callable, future: Future, load: Callable[[Any], Any],
                 on_ready: Callable[[Any], None] | None, kind: str) -> None:
        # An instance attribute: AOTAutograd wraps a backward in torch._dynamo.disable, whose
        # functools.wraps copies the instance's __dict__ (not its class's) onto the wrapper.
        self._boxed_call = True
        self._eager = eager
        self._load = load
        self._on_ready = on_ready
        self._kind = kind
        self._compiled: Callable | None = None
        self._post_compile: tuple | None = None
        # Writes the compiled program to Inductor's FX graph cache (compiled_in_worker).
        self.cache_writer: Callable[[Any], None] | None = None
        self._started = time.perf_counter()
        self._eager_calls = 0
        future.add_done_callback(self._arrived)

    def __call__(self, args: list) -> Any:
        # Read in this order: the loading thread sets _compiled first, then drops _eager.
        eager, compiled = self._eager, self._compiled
        if compiled is not None:
            STATS.count("background_compiled_calls")
            return compiled(args)
        self._eager_calls += 1
        STATS.count("background_eager_calls")
        return eager(args)

    def _arrived(self, future: Future) -> None:
        """The worker's answer (in the pool's reader thread): loaded on a thread of its own, so
        that no call waits for it (Inductor's first load in a process probes the CPU's vector
        instructions with gcc, 1.3 s on the development machine)."""
        error = None if future.cancelled() else future.exception()
        if future.cancelled() or _stopped(error):
            log.info("dynbatch: the background compile of a %s graph was stopped; it keeps running eager "
                     "kernels", self._kind)
        elif error is not None:
            log.warning("dynbatch: the background compile of a %s graph failed; it keeps running eager "
                        "kernels: %s: %s", self._kind, type(error).__name__, error)
            STATS.count("background_compile_failures")
        else:
            STATS.count("background_compiles_finished")
            output = future.result()
            _LOADING.start(lambda: self._hand_over(output), "dynbatch-background-load")
            return
        self._load = self._post_compile = None

    def _hand_over(self, output: Any) -> None:
        try:
            compiled = self._load(output)
            self._save_to_cache(compiled)
            if self._post_compile is not None:
                compiled.post_compile(*self._post_compile)
            if self._on_ready is not None:
                self._on_ready(compiled)
        except Exception as e:  # noqa: BLE001 - the eager kernels give the same values
            STATS.count("background_compile_failures")
            log.warning("dynbatch: loading the background compile of a %s graph failed; it keeps running eager "
                        "kernels: %s: %s", self._kind, type(e).__name__, e)
            return
        finally:
            self._load = self._post_compile = None
        self._compiled = compiled if getattr(compiled, "_boxed_call", False) else _boxed(compiled)
        self._eager = None
        log.info("dynbatch: Inductor's program of a %s graph took over after %d eager call(s), %.1f s",
                 self._kind, self._eager_calls, time.perf_counter() - self._started)

    def _save_to_cache(self, compiled: Any) -> None:
        save, self.cache_writer = self.cache_writer, None
        if save is None:
            return
        try:
            save(compiled)
        except Exception as e:  # noqa: BLE001 - only a cache: a later process compiles it again
            log.info("dynbatch: a background compile's program was not written to Inductor's FX graph cache: "
                     "%s: %s", type(e).__name__, e)

    # Inductor's inner compile calls these on the program it hands out.
    def post_compile(self, example_inputs: Sequence[Any], constants: Any, graph_kwargs: dict) -> None:
        """Run on the compiled program when it arrives (cudagraphs are never on here; it sets
        the trace's output strides, which no trace reads then)."""
        self._post_compile = (example_inputs, constants, graph_kwargs)

    def set_triton_bundle(self, triton_bundle: Any) -> None:
        pass  # CPU only: no Triton kernels to bundle

    def prepare_for_serialization(self) -> None:
        raise TypeError("a background program is not serialized (NOTE [Background compile])")


_LOADING = threads.Joined()  # the threads that load the worker's programs


def _stopped(error: BaseException) -> bool:
    """The errors of a compile a pool's shutdown cut short, or sent to a stopped pool (``SubprocPool``)."""
    return isinstance(error, RuntimeError) and str(error) in ("SubprocPool closed", "Attempting to use a closed pool")


def _boxed(fn: Callable) -> Callable:
    def boxed(args: list) -> Any:
        return fn(*args)

    return boxed


# Seconds the worker stays up without a compile: a forward's compile is often followed by
# its backward's, at the graph's first backward call.
IDLE_SECONDS = 10.0


class _Worker:
    """The worker of the background compiles: started by the first aten graph Inductor's FX
    cache does not hold (a warm start starts none), stopped IDLE_SECONDS after its last
    compile, at ``shutdown`` (``dynbatch.reset()``) and at exit."""

    def __init__(self) -> None:
        self._forget()

    def _forget(self) -> None:
        """A forked child's state: its parent's worker is not its own (never stop or use it)."""
        self._lock = threading.Lock()
        self._pool: Any = None
        self._pending: set[Future] = set()
        self._idle: threading.Timer | None = None

    def submit(self, fn: Callable, *args: Any) -> Future:
        with self._lock:
            if self._idle is not None:
                self._idle.cancel()
                self._idle = None
            if self._pool is None:
                self._pool = _compat.inductor_subprocess_pool()
            pool = self._pool
            future: Future = Future()
            self._pending.add(future)
        future.add_done_callback(lambda done: self._done(pool, done))
        # Sent from a thread of its own: the pipe holds 64 KiB, and until the sidecar has
        # imported torch and reads it, a graph's write waits (seconds, GIL released).
        threading.Thread(target=_send, args=(pool, fn, args, future), name="dynbatch-background-send",
                         daemon=True).start()
        return future

    def _done(self, pool: Any, future: Future) -> None:
        # Called by the pool's reader thread while it holds the pool's lock, which the pool's
        # shutdown takes: the shutdown runs in the timer's thread.
        with self._lock:
            self._pending.discard(future)
            if pool is not self._pool or self._pending:
                return  # stopped meanwhile, or more to come
            self._idle = threading.Timer(IDLE_SECONDS, self._stop_if_idle, (pool,))
            self._idle.daemon = True
            self._idle.start()

    def _stop_if_idle(self, pool: Any) -> None:
        with self._lock:
            if pool is not self._pool or self._pending:
                return
            self._pool = None
        pool.shutdown()

    def pid(self) -> int | None:
        """The sidecar process's id while the worker is up (tests look for its processes)."""
        with self._lock:
            return self._pool.process.pid if self._pool is not None else None

    def shutdown(self, timeout: float = 30.0, compiles_timeout: float = 600.0) -> None:
        """Stop the worker once the compiles sent to it have finished, and wait for it.  Its
        shutdown kills a compile in progress, and a C++ build killed midway leaves its
        half-written library in Inductor's cache, where every later compile of that kernel, in
        any process, would load it ("file too short"): the compiles finish first (their
        programs reach the cache, so the next process starts warm)."""
        with self._lock:
            pending = list(self._pending)
        if pending:
            log.info("dynbatch: waiting for %d background compile(s) to finish before stopping the worker",
                     len(pending))
            concurrent.futures.wait(pending, compiles_timeout)
        with self._lock:
            pool, self._pool = self._pool, None
            self._pending.clear()
            idle, self._idle = self._idle, None
        if idle is not None:
            idle.cancel()
            if idle is not threading.current_thread():
                idle.join(timeout)  # a timer that fired is stopping its pool
        if pool is not None:
            pool.shutdown()


def _send(pool: Any, fn: Callable, args: tuple, future: Future) -> None:
    def copy(sent: Future) -> None:
        if sent.cancelled():
            future.cancel()
        elif sent.exception() is not None:
            future.set_exception(sent.exception())
        else:
            future.set_result(sent.result())

    try:
        pool.submit(fn, *args).add_done_callback(copy)
    except Exception as e:  # noqa: BLE001 - a pool stopped meanwhile: the caller keeps its eager kernels
        future.set_exception(e)


_WORKER = _Worker()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_WORKER._forget)


def shutdown() -> None:
    """Stop the background compiles' worker process once its compiles have finished, and wait
    for their programs to load (``dynbatch.reset()``, and at exit)."""
    _WORKER.shutdown()
    _LOADING.join()
