"""A frame traced aside: with ``options={"dynbatch.compile": "background"}`` a frame's first
call runs eagerly while Dynamo traces it on another thread, so no first call waits for a trace.

NOTE [Traced aside]
Why.  The background compile (lowering/background.py) takes Inductor out of a first call, but
Dynamo's and AOTAutograd's trace stay in it: 2.6 s for the bench's small training step, 27 s
for MACE's, against eager's milliseconds.  A trace is Python in the user's process: it needs the
frame's objects, so it cannot go to a worker process the way an aten graph does.

How.  Dynamo asks ``convert_frame._compile`` (wrapped by capture/grad_calls.py) to compile a
frame that has no compiled code yet.  For a dynbatch graph with the option, ``compile_or_aside``
instead: (1) freezes what the frame can read (``_Frozen`` below), (2) starts a thread that
calls the same ``_compile`` on that copy, and (3) returns Dynamo's "run this call eagerly"
(``_compat.frame_runs_eagerly``, callees never compiled in it).  Each later call of the frame
finds no compiled code either and asks again: eagerly while the thread runs; once it has
finished, the thread's result goes back to Dynamo, which installs it as if this call had
compiled it and runs it.  The programs the trace lowered then run as the background compile
runs them: eager kernels until Inductor's code arrives from the worker.

Same values.  Dynamo reads the frame's objects while it traces and again when it builds the
guards at its end; a call running meanwhile (a training step sets every ``.grad``) would change
them between the two reads, so the graph and its guards would disagree.  The thread traces a
copy made at the first call, which nothing changes: each tensor an alias (its storage, sizes,
strides, ``requires_grad`` and ``.grad`` as they were), each module, container and plain
object a new one holding frozen copies of its attributes; functions, classes and modules are
shared.  Globals are a shallow copy (Dynamo's generated names are moved into the real ones at
the handover).  The guards are then checked against the frame's own locals before the result
is handed over; where they fail (the state changed since the first call), the frame compiles
here, as without the option.  What the copy cannot hold: an object a global names that the
calls change in place (a global list a step appends to) is read live.

What stays on the user's thread: a first call pays the copy (1 ms for the bench's step, 20 ms
for MACE's) and the thread's start; the trace waits until the first call has returned (it
would take the GIL from it), and the function of the user's code that made it (a training
step's, whose backward follows; a Hessian's around a compiled model, not the ``lambda`` that
``functional.hessian`` called: the PaiNN-style Hessian's first call took 13-19 ms beside the
trace, 4-6 ms eagerly; the bench's, 146 ms after its lambda, 34-44 ms after its function,
25 ms eagerly), for at most ENTRY_SECONDS more.  While it traces, Python's switch interval is 50 us instead of 5 ms: each
eager op gives the GIL up, and would otherwise wait up to 5 ms to get it back.  Dynamo restores the CPU
generator's state it saved when a trace began; on the thread that restore is skipped, so the
user's calls meanwhile never see their random numbers again.  Where FX's tracing flag is
process-wide (torch < 2.14), a compiled function called while the trace is inside ``make_fx``
would raise "Detected that you are using FX to symbolically trace a dynamo-optimized function":
Dynamo's ``error_on_nested_fx_trace`` is off meanwhile, on every thread (2.13 keeps a value
set in code per thread: ``_compat.nested_fx_trace_errors_set``), so that call runs eagerly.

dynbatch's own programs.  A region's programs (a vjp, a forward that returns its grads) are
frames compiled with the graph's options, traced aside the same way; a compile that is no
frame's (the batched backward of a graph's saved activations) runs on a thread through
``compile_aside``.  What their calls do meanwhile: NOTE [Outside paths aside] in
region/paths.py.

Where it does not apply (the frame compiles here, the reason at INFO): a recompile (a frame with
compiled code already), a frame called under a torch function or dispatch mode or inside a
functorch transform (thread-local state the thread would not have), and a frame whose objects
cannot be copied (a tensor subclass).  ``dynbatch.reset()`` waits for the threads.
"""

from __future__ import annotations

import contextlib
import copy
import enum
import logging
import os
import sys
import threading
import time
import types
from typing import Any, Callable, Iterator

import torch

from .. import _compat, threads
from ..records import STATS

log = logging.getLogger("dynbatch")

# While a trace runs aside: how soon an eager op gets the GIL back from it (Python's default
# is 5 ms, a stall per op).
SWITCH_INTERVAL = 5e-5
_POLL_SECONDS = 1e-3  # how often the thread looks whether the first call has returned
# How long a trace waits, once the first call has returned, for the function of the user's
# code that made it (a loop at a module's top level never returns).
ENTRY_SECONDS = 1.0

_LOCK = threading.Lock()
_ASIDE: dict[types.CodeType, "_Aside"] = {}
_ON_THREAD = threading.local()  # set on a thread that traces aside
_STOPPING = threading.Event()  # shutdown: a trace waits no longer for its first call to return
_THREADS = threads.Joined()  # the traces' and compile_aside's threads


def compile_or_aside(compile_frame: Callable[..., Any], arguments: dict[str, Any]) -> Any:
    """Dynamo's answer for this call of a frame (``arguments``: ``convert_frame._compile``'s,
    by name), or None where it compiles here (``compile_frame(**arguments)``)."""
    code = arguments["code"]
    with _LOCK:
        aside = _ASIDE.get(code)
    if aside is None:
        if arguments.get("cache_entry") is not None or arguments.get("cache_entries"):
            return _here(code, "it has compiled code already (a recompile)")
        reason = _thread_local_state()
        if reason is not None:
            return _here(code, reason)
        try:
            aside = _Aside(compile_frame, arguments)
        except Exception as e:  # noqa: BLE001 - a copy that fails: the frame compiles here, as without the option
            return _here(code, f"its objects cannot be copied for the trace ({type(e).__name__}: {e})")
        with _LOCK:
            _ASIDE[code] = aside
        aside.start()
        STATS.count("traced_aside")
    if not aside.done.is_set():
        STATS.count("aside_eager_calls")
        _compat.no_fullgraph_count_for_this_call()  # fullgraph=True: not a frame Dynamo skipped
        _compat.uncount_frame_compile(arguments.get("compile_id"))  # nor a compile
        return _compat.frame_runs_eagerly()
    with _LOCK:
        _ASIDE.pop(code, None)
    result = aside.hand_over(arguments)
    if result is not None:  # the thread's compile, numbered at the first call
        _compat.uncount_frame_compile(arguments.get("compile_id"))
    return result


def running(code: types.CodeType | None) -> bool:
    """Whether ``code``'s frame is traced aside now: its call just now ran eagerly."""
    return bool(_ASIDE) and code in _ASIDE  # (read without the lock: a dict lookup)


def on_thread() -> bool:
    """Whether this is a thread that traces aside: a compile it needs runs here."""
    return getattr(_ON_THREAD, "tracing", False)


def compile_aside(name: str, compile_now: Callable[[], None]) -> threading.Thread:
    """Run ``compile_now`` (a compile of dynbatch's own, not a frame's) on a thread, as a frame's
    trace runs: once the call that asked for it has returned (``_wait_while_running``), under
    ``_switching_often``, joined by ``shutdown``."""
    caller, calling = threading.get_ident(), [sys._getframe(1)]

    def run() -> None:
        _ON_THREAD.tracing = True
        try:
            _wait_while_running(caller, calling.pop())
            with _switching_often():
                compile_now()
        finally:
            STATS.count("compiled_aside_finished")

    thread = _THREADS.start(run, f"dynbatch-compile-aside-{name}")
    STATS.count("compiled_aside")
    return thread


def _here(code: types.CodeType, reason: str) -> None:
    log.info("dynbatch: %s is traced on the calling thread (dynbatch.compile='background'): %s",
             code.co_name, reason)
    return None


def _thread_local_state() -> str | None:
    """Why the calling thread's state would not reach the tracing thread, or None."""
    if torch._C._len_torch_function_stack():
        return "a torch function mode is active"
    if torch._C._len_torch_dispatch_stack():
        return "a dispatch mode is active"
    if torch._C._functorch.maybe_current_level() is not None:
        return "it is called inside a functorch transform"
    if torch.is_inference_mode_enabled():
        return "inference mode is on"
    return None


def shutdown() -> None:
    """Wait for the traces running aside and forget them (``dynbatch.reset()``)."""
    with _LOCK:
        _ASIDE.clear()
    _STOPPING.set()  # (shutdown may be called from within a first call)
    try:
        _THREADS.join()
    finally:
        _STOPPING.clear()


class _Aside:
    """One frame's trace on a thread of its own, and its result."""

    def __init__(self, compile_frame: Callable[..., Any], arguments: dict[str, Any]) -> None:
        frozen = _Frozen()
        frame = arguments.get("frame")
        self.code = arguments["code"]
        self.globals = dict(arguments["globals"])
        locals_ = frozen(dict(arguments["locals"]))
        closure = arguments["closure"]
        if closure:
            closure = tuple(types.CellType(frozen(c.cell_contents)) if _filled(c) else c for c in closure)
        snapshot = _FrameSnapshot(self.code, self.globals, locals_, arguments["builtins"], closure, frame)
        self.arguments = {**arguments, "globals": self.globals, "locals": locals_, "closure": closure,
                          "frame": snapshot}
        self.compile_frame = compile_frame
        self.grad_enabled = torch.is_grad_enabled()
        self.global_state = _compat.current_global_state()
        self.caller = threading.get_ident()
        self.calling_frame = _calling_frame()
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        self.seconds = 0.0

    def start(self) -> None:
        _THREADS.start(self._trace, f"dynbatch-trace-aside-{self.code.co_name}")

    def _trace(self) -> None:
        _ON_THREAD.tracing = True
        try:
            _wait_while_running(self.caller, self.calling_frame)
            self.calling_frame = None
            start = time.perf_counter()
            torch.set_grad_enabled(self.grad_enabled)
            with _switching_often(), _generator_kept(), _compat.global_state_at_frame(self.global_state), \
                    _compat.frame_compile_context(self.arguments["compile_id"]):
                if self.global_state is not None and not self.global_state.check():
                    raise RuntimeError(f"the thread's global state differs: {self.global_state.reason()}")
                self.result = self.compile_frame(**self.arguments)
            self.seconds = time.perf_counter() - start
        except BaseException as e:  # noqa: BLE001 - the frame compiles on the caller's thread instead
            self.error = e
        finally:
            self.done.set()

    def hand_over(self, arguments: dict[str, Any]) -> Any:
        """The thread's result for this call, or None where the frame compiles here."""
        if self.error is not None:
            STATS.count("aside_compiled_here")
            return _here(self.code, f"its trace aside failed ({type(self.error).__name__}: {self.error})")
        guarded = getattr(self.result, "guarded_code", None)
        if guarded is not None:
            real = arguments["globals"]
            for name, value in self.globals.items():  # Dynamo's generated names (__compiled_fn_0, ...)
                if name not in real:
                    real[name] = value
            if not guarded.guard_manager.check(arguments["locals"]):
                STATS.count("aside_guard_misses")
                STATS.count("aside_compiled_here")
                return _here(self.code, "its guards fail on this call's objects (they changed since the first call)")
        STATS.count("aside_handovers")
        log.info("dynbatch: %s was traced aside in %.1f s; its compiled code runs from this call",
                 self.code.co_name, self.seconds)
        return self.result


def _calling_frame() -> types.FrameType | None:
    """The frame that called the frame Dynamo is asking about: the first below Dynamo's
    callback (while it runs, the frame asked about is not on the stack yet)."""
    frame = sys._getframe(1)
    while frame is not None and _in_callback(frame.f_code.co_filename):
        frame = frame.f_back
    return frame


def _in_callback(filename: str) -> bool:
    return any(part in filename for part in _CALLBACK_FILES)


# Where Dynamo's frame callback runs (its wrappers' files too); torch.compile's own wrapper
# (eval_frame.py) calls the frame, and is not among them.
_CALLBACK_FILES = tuple(os.path.join(*parts) for parts in (
    ("torch", "_dynamo", "convert_frame.py"), ("torch", "_dynamo", "utils.py"), ("torch", "_utils_internal.py"),
    ("dynbatch", "capture", ""), ("contextlib.py",)))


def _wait_while_running(thread_id: int, calling: types.FrameType | None) -> None:
    """Until the caller's thread has left ``calling`` (the first call has returned) and the
    function of the user's code that made it (``_entry_frame``: a training step's, whose
    backward follows; one that calls ``functional.hessian`` around a compiled model), or
    ENTRY_SECONDS after the first: a trace beside them would slow them down."""
    entry = _entry_frame(calling)
    while calling is not None and _on_stack(thread_id, calling) and not _STOPPING.is_set():
        time.sleep(_POLL_SECONDS)
    deadline = time.monotonic() + ENTRY_SECONDS
    while entry is not None and _on_stack(thread_id, entry) and time.monotonic() < deadline \
            and not _STOPPING.is_set():
        time.sleep(_POLL_SECONDS)


def _on_stack(thread_id: int, wanted: types.FrameType) -> bool:
    frame = sys._current_frames().get(thread_id)
    while frame is not None and frame is not wanted:
        frame = frame.f_back
    return frame is not None


def _entry_frame(frame: types.FrameType | None) -> types.FrameType | None:
    """The frame of the user's code that made the call reaching ``frame``: the first at or
    below it that is not torch's or dynbatch's own, nor a function of the user's that torch
    called back (the ``lambda`` given to ``functional.hessian``: the Hessian goes on after it
    returns); the first of the user's where every one is."""
    first = None
    while frame is not None:
        if not _in_library(frame.f_code.co_filename):
            first = first or frame
            if frame.f_back is None or not _in_library(frame.f_back.f_code.co_filename):
                return frame
        frame = frame.f_back
    return first


def _in_library(filename: str) -> bool:
    return filename.startswith(_LIBRARY_DIRS) and not filename.startswith(_NOT_LIBRARY_DIRS)


# Whose frames are not the user's code: torch's and dynbatch's, but the bench's workloads are.
_LIBRARY_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, sys.modules["dynbatch"]))
_NOT_LIBRARY_DIRS = (os.path.join(os.path.dirname(sys.modules["dynbatch"].__file__), "bench") + os.sep,)


_switch_users = 0
_switch_saved: tuple[float, Callable[[], None] | None] = (0.0, None)


@contextlib.contextmanager
def _switching_often() -> Iterator[None]:
    """While any trace runs aside: Python's switch interval at SWITCH_INTERVAL, and (where FX's
    tracing flag is process-wide) a compiled function called meanwhile runs eagerly while the
    trace is inside ``make_fx``, instead of raising (``_compat.fx_tracing_flag_is_global``)."""
    global _switch_users, _switch_saved
    with _LOCK:
        if _switch_users == 0:
            interval = sys.getswitchinterval()
            sys.setswitchinterval(min(SWITCH_INTERVAL, interval))
            # On every thread: the calls that must not raise are the user's.
            undo = _compat.nested_fx_trace_errors_set(False) if _compat.fx_tracing_flag_is_global() else None
            _switch_saved = (interval, undo)
        _switch_users += 1
    try:
        yield
    finally:
        with _LOCK:
            _switch_users -= 1
            if _switch_users == 0:
                interval, undo = _switch_saved
                sys.setswitchinterval(interval)
                if undo is not None:
                    undo()


_generator_users = 0
_set_rng_state = torch.random.set_rng_state


def _set_rng_state_unless_aside(new_state: torch.Tensor) -> None:
    if getattr(_ON_THREAD, "tracing", False):
        return  # Dynamo's restore at a trace's end: the user's calls drew from it since
    _set_rng_state(new_state)


@contextlib.contextmanager
def _generator_kept() -> Iterator[None]:
    """Dynamo's restore of the CPU generator skipped on the tracing threads."""
    global _generator_users
    with _LOCK:
        if _generator_users == 0:
            torch.random.set_rng_state = _set_rng_state_unless_aside
        _generator_users += 1
    try:
        yield
    finally:
        with _LOCK:
            _generator_users -= 1
            if _generator_users == 0:
                torch.random.set_rng_state = _set_rng_state


class _FrameSnapshot:
    """What Dynamo's ``_compile`` reads of a frame (its recompile reasons, its error messages)."""

    def __init__(self, code, globals_, locals_, builtins, closure, frame) -> None:
        self.f_code, self.f_globals, self.f_locals, self.f_builtins, self.closure = \
            code, globals_, locals_, builtins, closure
        self.f_lineno = getattr(frame, "f_lineno", code.co_firstlineno)
        self.f_lasti = getattr(frame, "f_lasti", -1)


class _CannotFreeze(TypeError):
    pass


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


class _Frozen:
    """Copies of a frame's objects that later calls do not change (NOTE [Traced aside],
    "Same values"); one copy per object, so aliasing is kept."""

    _SHARED = (types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType, type,
               types.CodeType, str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device,
               torch.memory_format, torch.layout, range, slice, type(Ellipsis), enum.Enum,
               torch.fx.Graph, torch.fx.Node)  # an fx graph: code, which no call changes

    def __init__(self) -> None:
        self.memo: dict[int, Any] = {}
        self.kept: list[Any] = []  # the originals, so no id is reused while copying

    def __call__(self, value: Any) -> Any:
        if isinstance(value, self._SHARED) or callable(value) and not isinstance(value, torch.nn.Module):
            return value
        copied = self.memo.get(id(value))
        if copied is not None:
            return copied
        self.kept.append(value)
        if isinstance(value, torch.Tensor):
            return self._tensor(value)
        if isinstance(value, tuple):
            items = [self(v) for v in value]
            if type(value) is tuple:
                copied = tuple(items)
            elif hasattr(type(value), "_make"):  # a namedtuple
                copied = type(value)._make(items)
            else:
                return value  # a tuple of its own kind (e3nn's Irreps): immutable, built its own way
        elif isinstance(value, (list, dict, set, frozenset)):
            copied = self._container(value)
        elif hasattr(value, "__dict__") and not hasattr(type(value), "__slots__"):
            copied = self._object(value)
        else:
            return value  # an object of C: shared
        self.memo[id(value)] = copied
        return copied

    def _tensor(self, t: torch.Tensor) -> torch.Tensor:
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            raise _CannotFreeze(f"a {type(t).__name__}")
        alias = t.detach()
        if type(t) is torch.nn.Parameter:
            alias = torch.nn.Parameter(alias, requires_grad=t.requires_grad)
        else:
            alias.requires_grad_(t.requires_grad)
        self.memo[id(t)] = alias
        # Dynamo's marks (mark_dynamic's _dynamo_dynamic_indices, ...) live in the tensor's __dict__.
        alias.__dict__.update({k: self(v) for k, v in t.__dict__.items()})
        if t.is_leaf and t.grad is not None:
            alias.grad = self(t.grad)
        return alias

    def _container(self, value: Any) -> Any:
        copied = value.copy()  # its type, and a defaultdict's factory
        if type(copied) is not type(value):  # a subclass that copies as its base
            copied = copy.copy(value)
        self.memo[id(value)] = copied  # before the items: a container may hold itself
        if isinstance(value, dict):
            copied.clear()
            copied.update((self(k), self(v)) for k, v in value.items())
        elif isinstance(value, list):
            copied[:] = [self(v) for v in value]
        else:
            copied = type(value)(self(v) for v in value)
        if hasattr(value, "__dict__"):
            copied.__dict__.update({k: self(v) for k, v in value.__dict__.items()})
        return copied

    def _object(self, value: Any) -> Any:
        try:
            copied = object.__new__(type(value))
        except TypeError:  # made by its C base (an fx Node): shared
            self.memo[id(value)] = value
            return value
        self.memo[id(value)] = copied
        copied.__dict__.update({k: self(v) for k, v in value.__dict__.items()})
        return copied

