"""What dynbatch did: counters tests can assert on and per-compile records.

Counters are cumulative since the last :func:`reset`; records keep the text
of each graph (never the graph itself, which would hold tensors alive) and a
weak reference to the region it compiled into.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import weakref
from typing import Any

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
