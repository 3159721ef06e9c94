"""Large CPU buffers kept between a compiled program's calls (lowering's runtime side).

NOTE [Reused CPU buffers]
A batched backward's intermediates are large ([B, N, N, 3] pair tensors, [B, N, N, 16]
hidden features of a learned pair potential) and new at every call.  glibc maps an
allocation over its mmap threshold afresh each time and gives the top of its heap back
to the system once enough of it is free, so the kernels that first write such a buffer
fault it in a 4 KiB page at a time, each page zeroed by the system: 19,000-62,000 faults a
call of the learned pair potential's Hessian at N = 100-128.  A process-wide malloc
setting (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``) is the user's to make, not
a library's; so dynbatch keeps the large buffers of its own programs between calls, as
CUDA's caching allocator keeps device memory.  Inductor's generated code for a dynbatch
graph allocates its large buffers through ``empty_strided`` below, which hands out a kept
buffer that no tensor uses any more (its storage's use count is back to the kept tensor's
own), the smallest that holds the request with at most half of it to spare (MIN_FILL), or
allocates one and keeps it.  A buffer a caller still holds (an output, a view of one) is
never handed out again until it is released.  Each allocation site is decided apart
(``install``: the wrapper's function compiled again from its generated source): a known
size from MIN_BYTES calls the pool, a symbolic one calls it where the call's sizes reach
MIN_BYTES (a comparison in the generated code), the rest keep torch's own call.  Sending
every allocation to the pool's Python check cost ~0.5 us each: HVPs of K = 4-16 (~0.1 ms
a call, B symbolic) took x1.05-1.10.  One core of the Xeon,
`bench ab dynbatch.keep_cpu_buffers=False,True`: `full_hessian/lj` N = 100 x0.72-0.82,
`full_hessian/pair_mlp` N = 64-128 x0.76-0.83; where glibc's heap already served the
buffers without faults x0.98-1.03.  Buffers under MIN_BYTES (4 MiB) stay torch's: from
1 MiB, programs whose buffers the heap served paid the kept path (`attention` B = 64
x1.06).  Measured again once a request asked only the kept buffers of its size (15 to 6 us
an allocation with 20 kept), each workload's column alone on one Xeon core: from 1 MiB,
`lj_forces` N = 100 (its [32, 100, 100, 3] pair tensors, 3.8 MB, from a heap glibc trims
between calls: 2,000-6,500 faults a call) ran x0.55-0.57, but `sweep` B = 256 x1.04-1.07,
HVPs of K = 128 x1.03-1.05, `gelu_vjp` B = 16 x1.02-1.04 (from 256 KiB up to x1.15): one
workload's gain against small losses on many, so the floor stays 4 MiB for every program
and falls to 128 KiB only for one whose calls fault (NOTE [Programs that fault]).
Memory: a buffer the program freed stays kept for the next call while everything kept
stays within SLACK (2) times the most the kept buffers in use ever held at once, the
largest unused going first beyond it (a call's peak rose 15-50 % where buffers are
kept); a buffer still in use FORGET_AFTER large allocations after it was
handed out is the caller's (outputs kept in a list) and is no longer kept; all of it
stays within MAX_KEPT_BYTES, beyond which a buffer is torch's own, used once.
``release()`` frees what is kept, and ``dynbatch.keep_cpu_buffers=False`` compiles
programs that allocate as before.  The benchmark and the memory tests measure a call's
peak after ``release()``, so it counts every buffer the call allocates.
"""

from __future__ import annotations

import ast
import bisect
import copy
import dataclasses
import functools
import itertools
import math
import re
import statistics
import threading
import time
import types
from typing import Any, Sequence

import torch

from .. import _compat
from ..records import STATS

try:
    import resource
except ImportError:  # not on Windows
    resource = None

# Buffers from this size on are kept (smaller ones glibc's heap mostly serves without faults).
MIN_BYTES = 4 << 20
# ... and from this size on in a program whose calls fault (NOTE [Programs that fault]):
# glibc's default mmap threshold, below which its heap serves a request.
LOW_BYTES = 128 << 10
# A program whose counted calls fault this many pages in (1 MiB) a call on average is
# tried at LOW_BYTES: the floor stays there if its calls then fault FEWER pages (their
# total: some are not the program's buffers, a convolution's output from ATen) and run
# FASTER (their median time).
FAULTS_TO_LOWER = 256
FEWER = 0.75
FASTER = 0.97
# Each call from FIRST_PROBED (the first ones grow the heap) counts its faults, until the
# last WINDOW of them reach FAULTS_TO_LOWER on average or PROBED_CALLS calls have run;
# then the next calls take the two floors in turn, WINDOW at each counted after two at
# each.
FIRST_PROBED = 8
WINDOW = 8
PROBED_CALLS = 64
# What the kept buffers may hold in all, free or in use (a buffer beyond it is not kept).
MAX_KEPT_BYTES = 2 << 30
# A kept buffer serves a request of at least this share of its size (no large waste).
MIN_FILL = 0.5
# All that is kept stays within this many times the most the kept buffers in use ever held.
SLACK = 2
# A buffer still in use this many large allocations after it was handed out is the
# caller's (an output kept in a list): no longer kept, it goes back to malloc when freed.
FORGET_AFTER = 256

_lock = threading.RLock()  # a dispatch mode over the allocation must not deadlock it

@dataclasses.dataclass(eq=False)  # compared by identity: its buffer is a tensor
class _Kept:
    buffer: torch.Tensor  # flat uint8
    storage: int  # its storage's address
    # The storage's use count while ``buffer`` alone holds it (the count includes the
    # storage's Python object, once made): a higher count is a tensor still using it.
    unused_count: int
    taken: int  # the allocation that last handed it out

    def unused(self) -> bool:
        return _compat.storage_use_count(self.storage) == self.unused_count

    def nbytes(self) -> int:
        return self.buffer.numel()


_kept: list[_Kept] = []
_peak_in_use = 0  # the most the kept buffers in use held at once, over the process
_allocations = 0  # large allocations so far
_next_forget = 0  # the allocation at which buffers in use too long are next forgotten


def _storage_bytes(size: Sequence[int], stride: Sequence[int], itemsize: int) -> int:
    if any(s == 0 for s in size):
        return 0
    return (1 + sum((s - 1) * st for s, st in zip(size, stride))) * itemsize


_torch_empty_strided = _compat.inductor_empty_strided_cpu()
_CANDIDATE_ELEMENTS = MIN_BYTES // 16  # half of MIN_BYTES at 8 bytes an element: no smaller buffer is kept


def empty_strided(size: Sequence[int], stride: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty_strided(size, stride, dtype=dtype)`` on the CPU, in a kept buffer where
    it is large (NOTE [Reused CPU buffers])."""
    # Every buffer of a program comes here: a small one must cost little more than torch's
    # own call (the extent of the outermost dim, row- or column-major, says it is small).
    if (size and max(size[0] * stride[0], size[-1] * stride[-1]) >= _CANDIDATE_ELEMENTS
            and _storage_bytes(size, stride, dtype.itemsize) >= MIN_BYTES):
        return kept_empty_strided(size, stride, dtype)
    return _torch_empty_strided(size, stride, dtype)


def kept_empty_strided(size: Sequence[int], stride: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """``empty_strided`` for a site whose size the generated code already compared with
    its program's floor (``routed_function``): kept whatever its size."""
    with _lock:  # the view made before another thread can see the buffer unused
        buffer = _take(_storage_bytes(size, stride, dtype.itemsize))
        if buffer is not None:
            return buffer.view(dtype).as_strided(size, stride)
    return _torch_empty_strided(size, stride, dtype)


def _take(nbytes: int) -> torch.Tensor | None:
    """The smallest kept buffer no tensor uses that holds ``nbytes`` without much waste;
    else a new one, kept if the bound allows (None where it does not).  Under ``_lock``."""
    global _kept, _peak_in_use, _allocations, _next_forget
    _allocations += 1
    # A buffer is asked whether a tensor still uses it only where the answer matters: the
    # few of the requested size (``_kept`` is sorted by size); every one only where a
    # buffer is made, and every FORGET_AFTER / 4 allocations, to forget those in use too long.
    if _allocations >= _next_forget:
        _kept = [k for k in _kept if _allocations - k.taken <= FORGET_AFTER or k.unused()]
        _next_forget = _allocations + max(1, FORGET_AFTER // 4)
    start = bisect.bisect_left(_kept, nbytes, key=_Kept.nbytes)
    for k in itertools.takewhile(lambda k: MIN_FILL * k.nbytes() <= nbytes, itertools.islice(_kept, start, None)):
        if k.unused():
            k.taken = _allocations
            return k.buffer
    unused = [k for k in _kept if k.unused()]
    kept = kept_bytes()
    _peak_in_use = max(_peak_in_use, kept - sum(k.nbytes() for k in unused) + nbytes)
    # Unused buffers of other sizes stay for the next call while all that is kept stays
    # within SLACK times the most the programs ever used at once; beyond it the largest
    # go, so a call peaks near where Inductor's plan does.
    for k in sorted(unused, key=_Kept.nbytes, reverse=True):
        if kept + nbytes <= SLACK * _peak_in_use:
            break
        _kept.remove(k)
        kept -= k.nbytes()
    if kept + nbytes > MAX_KEPT_BYTES:
        return None
    buffer = torch.empty((nbytes + 63) // 64 * 64, dtype=torch.uint8)  # a whole number of any dtype
    storage = _compat.storage_address(buffer)
    bisect.insort(_kept, _Kept(buffer, storage, _compat.storage_use_count(storage), _allocations), key=_Kept.nbytes)
    return buffer


def kept_bytes() -> int:
    """Bytes the kept buffers hold (in use or not)."""
    return sum(k.nbytes() for k in _kept)


def release() -> None:
    """Stop keeping every buffer (those in use live on with their tensors)."""
    global _peak_in_use, _next_forget
    with _lock:
        _kept.clear()
        _peak_in_use = _next_forget = 0


def install(compiled: Any, adapt: bool = True) -> bool:
    """Route a compiled Inductor program's allocations that may be large here, each site
    decided apart (``routed_function``); False where none may be (or its wrapper is C++:
    then it allocates as before).  ``adapt``: its floor falls to LOW_BYTES where its calls
    fault (NOTE [Programs that fault]); else it stays MIN_BYTES.  Raises where its
    generated code is not as expected."""
    call = _compat.inductor_wrapper_function(compiled)
    if call is None or _ALLOCATE not in call.__globals__:
        return False
    with open(call.__code__.co_filename) as f:
        source = f.read()
    adapt = adapt and _THIS_THREAD is not None
    plain = routed_function(source, call.__code__, LOW_BYTES if adapt else MIN_BYTES)
    if plain is None:
        return False
    namespace = call.__globals__
    namespace.update({_KEPT: empty_strided, _KEPT_COMPARED: kept_empty_strided, _FLOOR: MIN_BYTES})
    if adapt:
        namespace[_WATCH] = _Watch(call, plain)
        call.__code__ = routed_function(source, call.__code__, LOW_BYTES, probed=True)
    else:
        call.__code__ = plain  # the same function object: every reference to it sees the change
    return True


_KEPT = "_dynbatch_empty_strided"  # the names routed sites call and compare with, bound in the wrapper's module
_KEPT_COMPARED = "_dynbatch_kept_empty_strided"
_FLOOR = "_dynbatch_floor"
_WATCH, _PROBE = "_dynbatch_watch", "_dynbatch_probe"
_ALLOCATE = "empty_strided_cpu"  # Inductor's
FLOOR_LOWERED = "cpu_buffers_from_128KiB"  # dynbatch.counters(): programs whose floor fell


# NOTE [Programs that fault]
# Whether glibc's heap serves a buffer under MIN_BYTES without faults depends on the
# process: on its dynamic mmap threshold, which an earlier large free raised or not, and
# on what it trims from the top of the heap between calls.  `full_hessian/pair_mlp` N = 32
# (3 MiB [96, 32, 32, 8] features) faulted 870-1,500 pages a call and took 4.0-4.8 ms where
# the same program kept from 128 KiB took 2.9 (no faults); `lj_forces` N = 100 (3.8 MB
# pair tensors) faulted 250-6,500 a call depending on what ran before it.  Keeping every
# buffer from 128 KiB costs the programs the heap serves well (the pool's check in Python
# per allocation, buffers no longer the heap's just-freed ones): `sweep` B = 256 x1.04-1.07.
# The regime can start after a few calls: pair_mlp N = 32 faulted 0-9 pages at calls 2-3,
# 384-1,216 at calls 4-11 and 1,504 at every call from 19 on.  A program's early calls
# get faster anyway (caches, the heap settling): a floor tried after them looked better
# than it was (`pinn/laplacian`, lowered so in one of two runs, ran x1.10).  And faults
# can come every second call (`cnn_jacobian`: 0 and 992 in turn, once one of its two
# programs kept its buffers): counting every second call missed them.  So each program
# measures: each call from its eighth counts the thread's minor faults (getrusage); where
# the last eight fault FAULTS_TO_LOWER pages on average, its next calls take the two
# floors in turn (low, 4 MiB, 4 MiB, low, ...: as the benchmark interleaves its columns,
# and no pattern of every second call favours one), each call counting its faults and
# time; after eight of each (not the first two at each, which allocate) the floor stays
# LOW_BYTES only where its calls faulted FEWER pages and ran FASTER (median times):
# `cnn_jacobian`'s convolution outputs, ATen's, fault at either floor (266 against 503
# pages a call, 3.2 against 3.6 ms).  Then, or after PROBED_CALLS calls without faults,
# the program's code is swapped for one without the count.  A dynamic program decides at
# the sizes of its first calls, and a program whose faults start after its 64th call
# keeps the 4 MiB floor.

class _Watch:
    """The faults and times of a program's calls, and its floor (NOTE [Programs that fault])."""

    def __init__(self, call: types.FunctionType, plain: types.CodeType) -> None:
        self.call, self.plain = call, plain
        self.calls = 0
        self.faults: list[int] = []  # the last WINDOW counted calls' faults
        self.trial_from: int | None = None  # the first call of the trial of the floors
        self.trial: dict[int, list[tuple[int, float]]] = {LOW_BYTES: [], MIN_BYTES: []}

    def begin(self) -> tuple[int, float] | None:
        """The thread's faults so far and the time where this call is counted, else None;
        in the trial, the floor of this call."""
        self.calls += 1
        if self.trial_from is not None:
            turn = self.calls - self.trial_from
            # low, 4 MiB, 4 MiB, low, ...: a pattern of faults every second call hits both
            self.call.__globals__[_FLOOR] = LOW_BYTES if turn % 4 in (0, 3) else MIN_BYTES
            counted = turn >= 4  # the first turns allocate what the low floor then keeps
        elif self.calls >= PROBED_CALLS:
            self._decide(MIN_BYTES)
            counted = False
        else:
            counted = self.calls >= FIRST_PROBED
        return (_minor_faults(), _seconds()) if counted else None

    def end(self, start: tuple[int, float] | None) -> None:
        if start is None:
            return
        probe = (_minor_faults() - start[0], _seconds() - start[1])
        with _lock:
            if self.call.__code__ is self.plain:  # another thread decided
                return
            if self.trial_from is None:
                self.faults = [*self.faults, probe[0]][-WINDOW:]
                if len(self.faults) == WINDOW and sum(self.faults) >= WINDOW * FAULTS_TO_LOWER:
                    self.trial_from = self.calls + 1
                return
            self.trial[self.call.__globals__[_FLOOR]].append(probe)
            if min(map(len, self.trial.values())) < WINDOW:
                return
            low, high = self.trial[LOW_BYTES], self.trial[MIN_BYTES]
            fewer = sum(p[0] for p in low) <= FEWER * sum(p[0] for p in high)
            faster = statistics.median(p[1] for p in low) <= FASTER * statistics.median(p[1] for p in high)
            # The floor stays low only where that took the faults away and made calls faster.
            self._decide(LOW_BYTES if fewer and faster else MIN_BYTES)

    def _decide(self, floor: int) -> None:
        if floor < MIN_BYTES:
            STATS.count(FLOOR_LOWERED)
        self.call.__globals__[_FLOOR] = floor
        self.call.__code__ = self.plain  # the calls from now on count nothing


def _minor_faults() -> int:
    return resource.getrusage(_THIS_THREAD).ru_minflt


_seconds = time.perf_counter


# The calling thread's faults alone (Linux); elsewhere programs keep MIN_BYTES.
_THIS_THREAD = getattr(resource, "RUSAGE_THREAD", None) if resource is not None else None


def routed_function(source: str, code: types.CodeType, lowest: int = MIN_BYTES,
                    probed: bool = False) -> types.CodeType | None:
    """``code``'s function, compiled again from the generated ``source`` with each of its
    allocations that may be large calling the pool: one of a known size from MIN_BYTES;
    one whose size may reach ``lowest`` (from LOW_BYTES: NOTE [Programs that fault]) where
    it reaches the floor bound in the module (a comparison in the generated code: a
    dynamic program's small buffers pay nothing).  ``probed``: the body also counts the
    call's faults for the module's ``_Watch``.  None where no allocation may be large."""
    if _every_allocation_known_under(source, lowest):
        return None
    tree = ast.parse(source, code.co_filename)  # this call's own: transformed in place
    path = _definition(tree, code)
    if path is None:
        raise LookupError(f"{code.co_name} (line {code.co_firstlineno}) not found in {code.co_filename}")
    *classes, function = path
    if _allocation_sites(tree) != _allocation_sites(function):
        raise LookupError(f"{code.co_filename} allocates outside {code.co_name}")
    router = _RouteAllocations(lowest)
    function = router.visit(function)
    if not router.routed:
        return None
    if probed:
        function.body = _probed(function.body)
    for cls in reversed(classes):  # nested as it was: the same qualified name, the same cells
        cls = copy.copy(cls)
        cls.body, cls.bases, cls.keywords, cls.decorator_list = [function], [], [], []
        function = cls
    module = compile(ast.fix_missing_locations(ast.Module([function], [])), code.co_filename, "exec")
    return _code_named(module, code.co_name, code.co_firstlineno)


# An allocation as Inductor writes one with every size known: its bytes read from the text.
_KNOWN_ALLOCATION = re.compile(_ALLOCATE + r"\(\(([0-9, ]*)\), \([0-9, ]*\), torch\.(\w+)\)")


def _every_allocation_known_under(source: str, lowest: int) -> bool:
    """Whether each allocation in a generated module has known sizes under ``lowest``: then
    none is routed, and the module is not parsed.  A load from Inductor's cache installs
    each program again, and parsing MACE's training step (two modules of 0.5-0.8 MB) took
    ~1 s of a 6 s warm start.  Anything written otherwise takes the parse."""
    known = _KNOWN_ALLOCATION.findall(source)
    if len(known) != source.count(_ALLOCATE + "("):
        return False
    for sizes, dtype in known:
        itemsize = getattr(getattr(torch, dtype, None), "itemsize", None)
        if not isinstance(itemsize, int):
            return False
        if itemsize * math.prod(int(n) for n in sizes.split(",") if n.strip()) >= lowest:
            return False
    return True


def _probed(body: list[ast.stmt]) -> list[ast.stmt]:
    """``body`` between ``_dynbatch_probe = _dynbatch_watch.begin()`` and, however it
    ends, ``_dynbatch_watch.end(_dynbatch_probe)``."""
    begin, end = (ast.parse(f"{_PROBE} = {_WATCH}.begin()").body,
                  ast.parse(f"{_WATCH}.end({_PROBE})").body)
    for node in begin + end:
        ast.copy_location(node, body[0])
        for child in ast.walk(node):
            ast.copy_location(child, body[0])
    return [*begin, ast.copy_location(ast.Try(body, [], [], end), body[0])]


def _definition(tree: ast.Module, code: types.CodeType) -> list[ast.AST] | None:
    """The classes around ``code``'s definition, and the definition."""
    todo = [([], node) for node in tree.body]
    while todo:
        outer, node = todo.pop()
        if isinstance(node, ast.FunctionDef) and (node.name, node.lineno) == (code.co_name, code.co_firstlineno):
            return [*outer, node]
        if isinstance(node, ast.ClassDef):
            todo.extend(([*outer, node], child) for child in node.body)
    return None


def _allocation_sites(tree: ast.AST) -> int:
    return sum(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == _ALLOCATE
               for n in ast.walk(tree))


def _code_named(code: types.CodeType, name: str, line: int) -> types.CodeType | None:
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            if (const.co_name, const.co_firstlineno) == (name, line):
                return const
            found = _code_named(const, name, line)
            if found is not None:
                return found
    return None


class _RouteAllocations(ast.NodeTransformer):
    """``empty_strided_cpu(size, stride, dtype)`` -> the pool's call where it is large
    (a known size from MIN_BYTES), ``(pool if 4 * s0 * s1 >= floor else empty_strided_cpu)(...)``
    where its size may reach ``lowest`` (a known one, or symbolic), unchanged where it
    is known and under ``lowest``."""

    def __init__(self, lowest: int) -> None:
        self.lowest = lowest
        self.routed = 0

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        if not (isinstance(node.func, ast.Name) and node.func.id == _ALLOCATE):
            return node
        large = _large_when(node, self.lowest)
        if large is False:
            return node
        self.routed += 1
        if large is True:
            kept = ast.copy_location(ast.Name(_KEPT, ast.Load()), node.func)
        else:
            kept = ast.IfExp(large, ast.Name(_KEPT_COMPARED, ast.Load()), node.func)
            kept = ast.copy_location(kept, node.func)
        return ast.copy_location(ast.Call(kept, node.args, node.keywords), node)


def _large_when(node: ast.Call, lowest: int) -> bool | ast.expr:
    """Whether an allocation is kept: True (a known size from MIN_BYTES, or one not
    written as Inductor writes them: the pool checks), False (a known size under
    ``lowest``), or the test of its bytes against the module's floor (a known size
    between the two, or a symbolic one: their product, the static sizes folded)."""
    if len(node.args) != 3 or node.keywords or not isinstance(node.args[0], ast.Tuple):
        return True
    dtype = node.args[2]
    itemsize = getattr(getattr(torch, dtype.attr, None), "itemsize", None) if isinstance(dtype, ast.Attribute) else None
    if not isinstance(itemsize, int):
        return True
    known, symbolic = itemsize, []
    for size in node.args[0].elts:
        if isinstance(size, ast.Constant) and isinstance(size.value, int):
            known *= size.value
        else:
            symbolic.append(copy.deepcopy(size))
    if not symbolic or known == 0:
        if known >= MIN_BYTES or known < lowest:
            return known >= MIN_BYTES
    product = functools.reduce(lambda a, b: ast.BinOp(a, ast.Mult(), b), symbolic, ast.Constant(known))
    return ast.Compare(product, [ast.GtE()], [ast.Name(_FLOOR, ast.Load())])
