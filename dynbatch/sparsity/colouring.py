"""Colourings of a pattern: columns (or rows) that one product can carry together.

NOTE [Why a colouring of our own]
A Hessian's columns i and j can share a product H s when no row reads both, or, since
H is symmetric, when every entry can still be read from one side: a star colouring
(Gebremedhin, Manne & Pothen, SIAM Review 2005), about half the colours of the plain
column colouring on a neighbour-list Hessian.  The package index has no star colouring
(networkx's greedy colouring is distance-1, ColPack has no Python wheel), and the greedy
algorithms are O(n d^2) loops that Python runs a hundred times slower than C: so both
greedy colourings are 80 lines of C here (``csrc/colour.c``), built on first use with
the compiler Inductor uses, as dynbatch's GEMM is, and called through ctypes.  Each
colouring is tried in two vertex orders (as given, largest degree first) and the one
with fewer colours kept.  Whatever the colouring, compressed.py checks that every entry
decompresses from exactly one product before it trusts it.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
from pathlib import Path

import torch

from .. import _compat
from ..cpu import native_gemm
from .pattern import Pattern

log = logging.getLogger("dynbatch")

SOURCE = Path(__file__).with_name("csrc") / "colour.c"


@functools.cache
def _library() -> ctypes.CDLL | None:
    cc = native_gemm.compiler()
    if cc is None:
        log.info("dynbatch: no C compiler found: sparse derivatives are not available")
        return None
    out_dir = Path(_compat.inductor_cache_dir()) / "dynbatch"
    try:
        target = native_gemm.build_library(SOURCE, [cc, "-O2", "-shared", "-fPIC"], out_dir, "colour")
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.CalledProcessError) as e:
        log.info("dynbatch: the colouring did not build (%s): sparse derivatives are not available",
                 str(getattr(e, "stderr", "") or e)[-500:])
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.dynbatch_star_colouring.argtypes = [i64, p, p, p, p]
    lib.dynbatch_row_colouring.argtypes = [i64, i64, p, p, p, p, p, p]
    lib.dynbatch_star_colouring.restype = lib.dynbatch_row_colouring.restype = i64
    return lib


def available() -> bool:
    return _library() is not None


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def _orders(degree: torch.Tensor) -> list[torch.Tensor]:
    return [torch.arange(degree.numel()), torch.argsort(degree, descending=True, stable=True)]


def symmetric_adjacency(pattern: Pattern) -> Pattern:
    """The pattern made symmetric, its diagonal dropped: the star colouring's graph."""
    rows, cols = pattern.to_coo()
    off = rows != cols
    rows, cols = rows[off], cols[off]
    return Pattern.from_coo(torch.cat([rows, cols]), torch.cat([cols, rows]), pattern.n, pattern.n)


def star_colouring(pattern: Pattern) -> torch.Tensor:
    """One colour per column of a square pattern (int64, 0..p-1), a star colouring."""
    lib = _library()
    if lib is None:
        raise RuntimeError("no C compiler: the colouring could not be built")
    adj = symmetric_adjacency(pattern)
    crow, col = adj.crow.contiguous(), adj.col.contiguous()
    best = None
    for order in _orders(crow.diff()):
        colour = torch.empty(adj.n, dtype=torch.long)
        if lib.dynbatch_star_colouring(adj.n, _ptr(crow), _ptr(col), _ptr(order.contiguous()), _ptr(colour)) < 0:
            raise MemoryError("the star colouring ran out of memory")
        if best is None or colour.max() < best.max():
            best = colour
    return best


def row_colouring(pattern: Pattern) -> torch.Tensor:
    """One colour per row: rows that share a column differ (a partial distance-2 colouring)."""
    lib = _library()
    if lib is None:
        raise RuntimeError("no C compiler: the colouring could not be built")
    rows, cols = pattern.to_coo()
    by_col = Pattern.from_coo(cols, rows, pattern.n, pattern.m)
    crow, col = pattern.crow.contiguous(), pattern.col.contiguous()
    ccrow, ccol = by_col.crow.contiguous(), by_col.col.contiguous()
    best = None
    for order in _orders(crow.diff()):
        colour = torch.empty(pattern.m, dtype=torch.long)
        if lib.dynbatch_row_colouring(pattern.m, pattern.n, _ptr(crow), _ptr(col), _ptr(ccrow), _ptr(ccol),
                                      _ptr(order.contiguous()), _ptr(colour)) < 0:
            raise MemoryError("the row colouring ran out of memory")
        if best is None or colour.max() < best.max():
            best = colour
    return best
