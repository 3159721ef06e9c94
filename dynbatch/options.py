"""Options of the dynbatch backend, parsed from ``torch.compile(mode=, options=)``.

Keys that start with ``dynbatch.`` are dynbatch's; every other key, and
``mode``, go to Inductor unchanged (and are validated by Inductor's rules).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping

from . import _compat

PREFIX = "dynbatch."
INNER_COMPILERS = ("inductor", "aot_eager")
ON_UNSUPPORTED = ("fallback", "error")
# The kernel of CPU products (cpu/matmul_kernels.py): "auto" measures; "aten" leaves every
# product to ATen; the others take that kernel wherever it applies (tests, comparisons).
CPU_MATMUL = ("auto", "aten", "flipped", "onednn", "openblas", "avx2", "avx512")
RECOMPUTE = ("auto", "always", "never")
COMPILE = ("foreground", "background")
KEEP_CPU_BUFFERS = (True, "large", False)
SPARSE = ("auto", True, False)
AOT_CACHE = (True, "with_backward", False)



@dataclasses.dataclass(frozen=True)
class Options:
    # Who lowers the batched graph: Inductor (C++/Triton) or AOTAutograd with
    # eager kernels, which skips codegen and suits large test sweeps.
    inner_compiler: str = "inductor"
    # What to do with a graph the pass cannot batch: run it eagerly (with a
    # logged reason) or raise dynbatch.UnsupportedGraph.
    on_unsupported: str = "fallback"
    # Keep text snapshots of each compiled graph in dynbatch.compile_records().
    record_graphs: bool = True
    # Bytes the B-dependent part of a batched backward may hold at once: an int,
    # a string such as "256MiB" or "2GB", "auto" (AUTO_BUDGET_FRACTION of the
    # memory free when the graph compiles) or None (no limit). planning/memory.py.
    memory_budget: int | str | None = "auto"
    # Fixes the number of samples per chunk instead of deriving it from the budget.
    chunk_size: int | None = None
    # The kernel of CPU products (cpu/matmul_kernels.py): "auto" (the fastest of ATen's,
    # ATen's on the transposed problem and oneDNN's, measured per shape on products
    # with a dim of 1,024 or more), "aten" (Inductor's extern mm everywhere),
    # "flipped", "onednn" (that kernel wherever it applies).
    cpu_matmul: str = "auto"
    # Run each compiled graph's first call eagerly too and compare; on a mismatch, run
    # that graph eagerly from then on, with the reason logged (lowering/verify.py).
    verify: bool = False
    # Store a large pointwise tensor read by several kernels, or recompute it in each
    # (planning/recompute.py, NOTE [Store or recompute]), and store a B-free factor a batched loop
    # would recompute per sample (NOTE [Store broadcast factors]): "auto" (a cost model
    # per device), "always" (wherever Inductor would inline the copies; factors on any
    # device), "never".
    recompute: str = "auto"
    # Keep the large CPU buffers of the compiled programs between calls, so a call does
    # not fault fresh pages in (cpu/kept_buffers.py, NOTE [Reused CPU buffers]): True (from
    # 4 MiB, and from 128 KiB in a program whose first calls fault: NOTE [Programs that
    # fault]), "large" (from 4 MiB only), False.
    keep_cpu_buffers: bool | str = True
    # Load graphs without a batched grad from AOTAutograd's cache, with the record each miss
    # wrote beside its entry (lowering/aot_cache.py, NOTE [What a cache hit must not lose]):
    # a warm process skips their trace.  A graph compiled in the background skips it.
    # "with_backward": each such graph's backward compiles with its forward, not at its first
    # call, so the entry is written even where no backward runs (NOTE [An entry needs its
    # backward]).
    aot_cache: bool | str = True
    # Where a frame is traced and compiled: "foreground" (its first call waits for both) or
    # "background" (its first calls run eagerly while a thread traces it, NOTE [Traced aside]
    # in capture/traced_aside.py, then its batched graph on eager kernels while a worker
    # process compiles it, NOTE [Background compile] in lowering/background.py).
    compile: str = "foreground"
    # Batched grads over an identity (functional.jacobian/hessian(vectorize=True)) computed
    # by colours at run time, one batched grad per colour (sparsity/rewrite.py, NOTE
    # [Identity grads by colours]): "auto" where the colours at the first call's values
    # are fewer than half the rows (NOTE [When colours pay, decided at the first call]),
    # True for every such grad, False never.
    sparse: bool | str = "auto"
    # Inductor config patches derived from mode= and non-dynbatch options=.
    inductor_config: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def known_names(cls) -> list[str]:
        return [PREFIX + f.name for f in dataclasses.fields(cls) if f.name != "inductor_config"]

    @classmethod
    def from_compile_args(cls, mode: str | None = None, options: Mapping[str, Any] | None = None) -> "Options":
        ours, inductor_options = {}, {}
        for key, value in (options or {}).items():
            if key.startswith(PREFIX):
                ours[key[len(PREFIX):]] = value
            else:
                inductor_options[key] = value
        unknown = sorted(PREFIX + k for k in ours if PREFIX + k not in cls.known_names())
        if unknown:
            raise ValueError(
                f"dynbatch: unknown option(s) {unknown}; known dynbatch options are {cls.known_names()}"
            )
        _check_choice("inner_compiler", ours.get("inner_compiler", "inductor"), INNER_COMPILERS)
        _check_choice("on_unsupported", ours.get("on_unsupported", "fallback"), ON_UNSUPPORTED)
        _check_choice("cpu_matmul", ours.get("cpu_matmul", "auto"), CPU_MATMUL)
        _check_choice("recompute", ours.get("recompute", "auto"), RECOMPUTE)
        _check_choice("compile", ours.get("compile", "foreground"), COMPILE)
        keep = ours.get("keep_cpu_buffers", True)
        if not (isinstance(keep, bool) or keep == "large"):
            raise ValueError(f"dynbatch: option {PREFIX}keep_cpu_buffers={ours['keep_cpu_buffers']!r}; "
                             f"choose one of {list(KEEP_CPU_BUFFERS)}")
        sparse = ours.get("sparse", "auto")
        if not (isinstance(sparse, bool) or sparse == "auto"):
            raise ValueError(f"dynbatch: option {PREFIX}sparse={ours['sparse']!r}; choose one of {list(SPARSE)}")
        aot_cache = ours.get("aot_cache", True)
        if not (isinstance(aot_cache, bool) or aot_cache == "with_backward"):
            raise ValueError(f"dynbatch: option {PREFIX}aot_cache={aot_cache!r}; choose one of {list(AOT_CACHE)}")
        for flag in ("record_graphs", "verify"):
            if flag in ours and not isinstance(ours[flag], bool):
                raise ValueError(f"dynbatch: option dynbatch.{flag} takes a bool")
        if "memory_budget" in ours:
            ours["memory_budget"] = parse_memory_budget(ours["memory_budget"])
        chunk = ours.get("chunk_size")
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            raise ValueError(f"dynbatch: option dynbatch.chunk_size={chunk!r}; give a positive int or None")
        inductor_config = _compat.inductor_config_patches(mode, inductor_options)
        return cls(**ours, inductor_config=inductor_config)


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"dynbatch: option {PREFIX}{name}={value!r}; choose one of {list(choices)}")


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_memory_budget(value: Any) -> int | str | None:
    """``dynbatch.memory_budget`` as bytes, "auto" or None: 1_000_000, "256MiB", "2GB", "1.5 GiB"."""
    if value is None or value == "auto":
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        if value > 0:
            return value
    elif isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", value)
        if match and match.group(2).lower() in _UNITS:
            size = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
            if size > 0:
                return size
    raise ValueError(
        f"dynbatch: option dynbatch.memory_budget={value!r}; give a positive number of bytes (int), "
        'a size such as "256MiB" or "2GB" (units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), "auto" or None'
    )
