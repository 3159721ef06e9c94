"""What dynbatch did: counters tests can assert on and per-compile records.

Counters are cumulative since the last :func:`reset`; records keep the text
of each graph (never the graph itself, which would hold tensors alive) and a
weak reference to the region it compiled into.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
import time
import weakref
from typing import Any, Iterator

from . import _compat

_MAX_RECORDS = 64


@dataclasses.dataclass
class CompileRecord:
    """One call of the dynbatch backend, i.e. one Dynamo graph."""

    dynamo_graph: str = ""  # the graph Dynamo captured
    batched_graph: str = ""  # after the batching pass
    aten_graphs: list[str] = dataclasses.field(default_factory=list)  # what the inner compiler received
    aten_node_counts: list[int] = dataclasses.field(default_factory=list)
    batched: tuple[str, ...] = ()
    plain: tuple[str, ...] = ()
    fallback_reason: str | None = None
    random_ops: tuple[str, ...] = ()  # aten ops that draw random numbers (no re-run for a backward)
    mutates_differentiable_input: bool = False  # an input that requires grad is written in place
    mutated_inputs: tuple[int, ...] = ()  # positions of the graph's inputs written in place
    memory_budget: int | None = None  # bytes, as resolved when the graph compiled (planning/memory.py)
    memory_plan: list = dataclasses.field(default_factory=list)  # memory.GradPlan per batched grad
    chunk_program: bool = False  # compiled as the chunk program of a chunked grad (planning/chunking.py)
    # compiled as AOTAutograd's backward graph batched over its cotangents (region/saved_backward.py)
    saved_backward: bool = False
    # Where this graph's first call went, in seconds (NOTE [Where a first call goes]):
    # "dynamo", "aot_autograd", "dynbatch", "inductor", "cpp_compile"; a backward AOTAutograd
    # compiles at its first call adds to them.  ``caches`` counts torch's cache lookups
    # ("fxgraph_cache_hit", "autograd_cache_miss", ...) made meanwhile: cold or warm.
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    caches: dict[str, int] = dataclasses.field(default_factory=dict)
    # The region.Region this graph compiled into, while Dynamo's cache keeps it (a weak
    # reference: a record never keeps a graph alive); None where the graph fell back.
    # The benchmark's overhead command reaches a region's program through it.
    region: weakref.ReferenceType[Any] | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def fell_back(self) -> bool:
        return self.fallback_reason is not None


class Stats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.counters: collections.Counter[str] = collections.Counter()
            self.fallback_reasons: collections.Counter[str] = collections.Counter()
            self.records: collections.deque[CompileRecord] = collections.deque(maxlen=_MAX_RECORDS)

    def count(self, name: str) -> None:
        with self._lock:
            self.counters[name] += 1

    def add(self, record: CompileRecord) -> None:
        _attach_to_open_span(record)
        with self._lock:
            self.records.append(record)
            if record.chunk_program or record.saved_backward:
                self.counters["chunk_programs" if record.chunk_program else "saved_backward_programs"] += 1
                return
            self.counters["graphs"] += 1
            self.counters["grads_batched"] += len(record.batched)
            self.counters["grads_plain"] += len(record.plain)
            if record.fell_back:
                self.counters["fallbacks"] += 1
                self.fallback_reasons[record.fallback_reason] += 1
            elif record.batched:
                self.counters["graphs_batched"] += 1
            chunked = sum(p.applied for p in record.memory_plan)
            if chunked:
                self.counters["grads_chunked"] += chunked

    def fell_back_later(self, record: CompileRecord, reason: str) -> None:
        """A graph compiled earlier that runs eagerly from now on (lowering/verify.py)."""
        with self._lock:
            record.fallback_reason = reason
            self.counters["fallbacks"] += 1
            self.fallback_reasons[reason] += 1
            if record.batched:
                self.counters["graphs_batched"] -= 1

    def add_chunked(self, record: CompileRecord) -> None:
        """A graph compiled earlier whose grads a later call's sizes made chunked."""
        with self._lock:
            self.counters["grads_chunked"] += sum(p.applied for p in record.memory_plan)


STATS = Stats()


# NOTE [Where a first call goes]
# A first call's seconds split by who spent them, from torch's own compile timers
# (``_compat.compile_time_totals``) and dynbatch's (``own_pass``), as differences
# over a *span*: a Dynamo frame compiled for dynbatch (capture/grad_calls.py), a
# lowering dynbatch starts itself (region/saved_backward.py), or a backward that
# AOTAutograd compiles at its first call (lowering/inductor.py).  Spans nest (a
# chunk program's frame compiles inside its graph's backend): a span keeps only
# what its children did not spend.  Inside a span,
#   cpp_compile  = Inductor's C++ compiles and its waits for compile workers,
#   inductor     = Inductor's inner compile less those and less dynbatch's aten passes,
#   dynbatch     = dynbatch's passes (the batching pass, the memory plan, the aten passes),
#   aot_autograd = the backend's time less Inductor's and dynbatch's,
#   dynamo       = the frame's time less the backend's (zero outside a frame).
# The records made while a span is the innermost open one get its seconds.

PHASES = ("dynamo", "aot_autograd", "dynbatch", "inductor", "cpp_compile")
_OWN_INSIDE_INDUCTOR = frozenset({"aten_passes"})  # run inside Inductor's inner compile
_own_seconds: collections.Counter[str] = collections.Counter()
_own_lock = threading.Lock()
_spans = threading.local()


@contextlib.contextmanager
def own_pass(name: str) -> Iterator[None]:
    """Count the seconds of one of dynbatch's own compile-time passes."""
    start = time.perf_counter()
    try:
        yield
    finally:
        with _own_lock:
            _own_seconds[name] += time.perf_counter() - start


def _totals() -> dict[str, float]:
    with _own_lock:
        own = dict(_own_seconds)
    return {**_compat.compile_time_totals(), **{f"own.{k}": v for k, v in own.items()}}


@dataclasses.dataclass
class _Span:
    frame: bool
    start: float
    totals: dict[str, float]
    caches: dict[str, int]
    records: list = dataclasses.field(default_factory=list)
    children_seconds: float = 0.0
    children_totals: collections.Counter = dataclasses.field(default_factory=collections.Counter)


@contextlib.contextmanager
def compile_span(*, frame: bool, record: CompileRecord | None = None) -> Iterator[None]:
    """Time a compile (NOTE [Where a first call goes]); ``record``: a record made before it."""
    stack = _spans.__dict__.setdefault("stack", [])
    span = _Span(frame, time.perf_counter(), _totals(), _compat.compile_cache_counts())
    if record is not None:
        span.records.append(record)
    stack.append(span)
    try:
        yield
    finally:
        stack.pop()
        seconds = time.perf_counter() - span.start
        spent = {k: v - span.totals.get(k, 0.0) for k, v in _totals().items()}
        caches = {k: v - span.caches.get(k, 0) for k, v in _compat.compile_cache_counts().items()}
        if stack:  # the parent keeps only what this span did not spend
            stack[-1].children_seconds += seconds
            stack[-1].children_totals.update(spent)
        mine = {k: v - span.children_totals.get(k, 0.0) for k, v in spent.items()}
        phases = _phases(seconds - span.children_seconds, mine, span.frame)
        for r in span.records:
            for k, v in phases.items():
                r.seconds[k] = r.seconds.get(k, 0.0) + v
            for k, v in caches.items():
                if v:
                    r.caches[k] = r.caches.get(k, 0) + v


def in_compile_span() -> bool:
    return bool(getattr(_spans, "stack", None))


def _phases(seconds: float, spent: dict[str, float], frame: bool) -> dict[str, float]:
    own = sum(v for k, v in spent.items() if k.startswith("own."))
    own_inside = sum(spent.get(f"own.{k}", 0.0) for k in _OWN_INSIDE_INDUCTOR)
    inner = spent.get("inductor", 0.0)
    # C++ that Inductor builds outside its inner compile (a wrapper loaded later) counts
    # as AOTAutograd's: no second, so the phases sum to the span's seconds.
    cpp = min(spent.get("cpp_compile", 0.0), max(inner - own_inside, 0.0))
    backend = spent.get("backend", 0.0) if frame else seconds
    # A frame's span may also hold Inductor's compile of a backward at its first call,
    # after the backend returned: that much of Inductor's time is not the backend's.
    inner_in = min(inner, backend)
    return {
        "dynamo": max(seconds - backend - (inner - inner_in), 0.0),
        "aot_autograd": max(backend - inner_in - (own - own_inside), 0.0),
        "dynbatch": own,
        "inductor": max(inner - cpp - own_inside, 0.0),
        "cpp_compile": cpp,
    }


def _attach_to_open_span(record: CompileRecord) -> None:
    stack = getattr(_spans, "stack", None)
    if stack:
        stack[-1].records.append(record)
