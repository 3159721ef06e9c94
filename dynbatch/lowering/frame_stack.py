"""Room on CPython's frame stack for a compile: NOTE [A compile on a chunk's edge].

NOTE [A compile on a chunk's edge]
CPython (3.11 on) keeps a thread's Python frames on a stack of chunks, 16 KiB at
least.  A call whose frame does not fit in the current chunk maps a new one, and its
return unmaps it (cpython gh-142183: fixed in 2026 by caching one chunk, backported as far
as 3.13; 3.11 and 3.12 keep it).  A loop of calls made at exactly that depth
pays an mmap, a munmap and a page fault per call.  Inductor's pattern matcher loops like
that: on MACE's calculator graph its joint-graph pass made 277k page faults and took
3.7 s instead of 1.6 s (1.7 s of it in the kernel).  Which depth is the wrong one
depends on every frame below, so one frame more or less, the backend's own, lands a
compile on an edge or off it: stock `torch.compile` was off it there, dynbatch on it.

``with_room`` runs a compile from a frame large enough to open a chunk of its own,
with room behind it for 33k slots: a thousand frames of 33 slots, Python's recursion
limit, meet no edge (a frame of S slots opens a chunk of the least 2048 * 2**k slots
>= S + 1000; S just over half of it leaves the other half free).  The frame is one
function's code given 31,778 local names it never binds; opening it costs about 0.2 ms
per compile, building it about 10 ms once per process.
"""

from __future__ import annotations

import functools
import threading
import types
from typing import Any, Callable, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

# Half of a 65,536-slot chunk, less CPython's MINIMUM_OVERHEAD of 1,000 slots, plus a
# margin for the code's own stack and frame header: the frame's chunk is 65,536 slots.
_LOCALS = 32_768 - 990

_inside = threading.local()


def with_room(compile_fn: F) -> F:
    """``compile_fn``, run from a frame that opens a chunk of its own (a call made inside
    another such run runs as it is: it has the room already)."""

    @functools.wraps(compile_fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if running():
            return compile_fn(*args, **kwargs)
        _inside.active = True
        try:
            return _roomy_call()(compile_fn, args, kwargs)
        finally:
            _inside.active = False

    return run  # type: ignore[return-value]


def _call(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    return fn(*args, **kwargs)


@functools.cache
def _roomy_call() -> Callable[..., Any]:
    """``_call`` with ``_LOCALS`` local names: the same bytecode, a frame of that many slots."""
    code = _call.__code__
    names = code.co_varnames + tuple(f"_unused_{i}" for i in range(_LOCALS - code.co_nlocals))
    return types.FunctionType(code.replace(co_varnames=names, co_nlocals=len(names)), {}, "roomy_call")


def running() -> bool:
    """Whether this thread is inside ``with_room``."""
    return getattr(_inside, "active", False)
