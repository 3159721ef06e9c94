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
workload's gain against small losses on many, so the floor stays.  Memory: a buffer the program freed stays kept for the next call while
everything kept stays within SLACK (2) times the most the kept buffers in use ever held
at once, the largest unused going first beyond it (a call's peak rose 15-50 % where
buffers are kept); a buffer still in use FORGET_AFTER large allocations after it was
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
import threading
import types
from typing import Any, Sequence

import torch

from . import _compat

# Buffers from this size on are kept (smaller ones glibc's heap serves without faults).
MIN_BYTES = 4 << 20
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
    if size and max(size[0] * stride[0], size[-1] * stride[-1]) >= _CANDIDATE_ELEMENTS:
        nbytes = _storage_bytes(size, stride, dtype.itemsize)
        if nbytes >= MIN_BYTES:
            with _lock:  # the view made before another thread can see the buffer unused
                buffer = _take(nbytes)
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


def install(compiled: Any) -> bool:
    """Route a compiled Inductor program's allocations that may be large here, each site
    decided apart (``routed_function``); False where none may be (or its wrapper is C++:
    then it allocates as before).  Raises where its generated code is not as expected."""
    call = _compat.inductor_wrapper_function(compiled)
    if call is None or "empty_strided_cpu" not in call.__globals__:
        return False
    with open(call.__code__.co_filename) as f:
        routed = routed_function(f.read(), call.__code__)
    if routed is None:
        return False
    call.__globals__[_KEPT] = empty_strided
    call.__code__ = routed  # the same function object: every reference to it sees the change
    return True


_KEPT = "_dynbatch_empty_strided"  # the name routed sites call, bound in the wrapper's module
_ALLOCATE = "empty_strided_cpu"  # Inductor's


def routed_function(source: str, code: types.CodeType) -> types.CodeType | None:
    """``code``'s function, compiled again from the generated ``source`` with each of its
    allocations that may be large calling the pool: one of a known size from MIN_BYTES,
    one of a symbolic size where its sizes at the call reach it (a comparison in the
    generated code: a dynamic program's small buffers pay nothing).  None where no
    allocation may be large."""
    tree = ast.parse(source, code.co_filename)
    path = _definition(tree, code)
    if path is None:
        raise LookupError(f"{code.co_name} (line {code.co_firstlineno}) not found in {code.co_filename}")
    *classes, function = path
    if _allocation_sites(tree) != _allocation_sites(function):
        raise LookupError(f"{code.co_filename} allocates outside {code.co_name}")
    router = _RouteAllocations()
    function = router.visit(copy.deepcopy(function))
    if not router.routed:
        return None
    for cls in reversed(classes):  # nested as it was: the same qualified name, the same cells
        cls = copy.copy(cls)
        cls.body, cls.bases, cls.keywords, cls.decorator_list = [function], [], [], []
        function = cls
    module = compile(ast.fix_missing_locations(ast.Module([function], [])), code.co_filename, "exec")
    return _code_named(module, code.co_name, code.co_firstlineno)


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
    (a known size), ``(pool if s0 * s1 >= n else empty_strided_cpu)(...)`` where its size is
    symbolic, unchanged where it is known and small."""

    def __init__(self) -> None:
        self.routed = 0

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        if not (isinstance(node.func, ast.Name) and node.func.id == _ALLOCATE):
            return node
        large = _large_when(node)
        if large is False:
            return node
        self.routed += 1
        kept = ast.copy_location(ast.Name(_KEPT, ast.Load()), node.func)
        if large is not True:
            kept = ast.copy_location(ast.IfExp(large, kept, node.func), node.func)
        return ast.copy_location(ast.Call(kept, node.args, node.keywords), node)


def _large_when(node: ast.Call) -> bool | ast.expr:
    """Whether an allocation holds MIN_BYTES: True, False, or the test of its symbolic sizes
    (their product, the static ones folded).  An allocation not written as Inductor writes
    them goes to the pool, which checks."""
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
        return known >= MIN_BYTES
    product = functools.reduce(lambda a, b: ast.BinOp(a, ast.Mult(), b), symbolic)
    return ast.Compare(product, [ast.GtE()], [ast.Constant(-(-MIN_BYTES // known))])
