"""The memory plan of each batched grad, from its traced backward.

With planning/chunking.py, the part of the pipeline docs/design.md calls "Memory within
a budget": not a numbered stage, but run by stage 4 (lowering/inductor.py), whose inner
compiler hands each aten graph to :meth:`Planner.observe`.

A batched backward holds B copies of every intermediate that depends on the
cotangents, so its memory grows with B.  While AOTAutograd traces the batched
graph, ``batched_grad`` brackets each batched backward with marker ops
(cotangents in, grads out).  :func:`observe` finds the nodes between the
markers in the aten graph, replays their allocations in graph order (views
and expands allocate nothing; a buffer is freed after its last use) and
keeps, for each step, the bytes alive as a sympy expression of the graph's
size symbols.  Divided by B, the largest of them is the backward's bytes per
sample: an upper bound for Inductor, which fuses many of those buffers away.
The markers are then removed, so the inner compiler never sees them.

:class:`Planner` turns the estimates and ``dynbatch.memory_budget`` /
``dynbatch.chunk_size`` into the decision the backend acts on
(NOTE [Chunked batched grads] in planning/chunking.py): which batched grads run chunk
by chunk, and how a chunk size follows from the sizes of each call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
from typing import Any, Callable, Iterator, Mapping, Sequence

import sympy
import torch
import torch.fx

from .. import _compat, fx_utils
from ..batching.markers import COTANGENT, GRAD

log = logging.getLogger("dynbatch")

# "auto" budgets this fraction of the memory free on the device when a graph
# compiles: a call may hold its inputs, outputs and the unbatched forward too.
AUTO_BUDGET_FRACTION = 0.5
# ... and on the CPU at most this much, for speed (NOTE [CPU chunks for speed]).
CPU_AUTO_BUDGET = 16 * 2**20

# NOTE [CPU chunks for speed]
# On the CPU, torch allocates with malloc.  glibc's malloc serves a block above
# its mmap threshold (adaptive, at most 32 MiB on 64-bit Linux) with fresh
# pages from the kernel and unmaps them when the block is freed, and it gives
# the top of its heap back once more than twice that threshold is free: every
# call of a large batched backward page-faults and zeroes its buffers again.
# On this project's machine that was half the time of the largest cases (the
# Hessian of a learned pair potential, N = 128: 215,000 page faults and 0.6 s
# of system time in a 1.4 s call).  Chunks of at most 16 MiB reuse the heap
# blocks the previous chunk freed (no page fault there, 0.88 s; 32 MiB chunks
# still made 98,000); the forward a chunk re-runs costs less than the faults
# did (`python -m dynbatch.bench ab dynbatch.memory_budget=None,32MiB,auto --workloads
# full_hessian --threads 1`; docs/design.md, "Memory within a budget").
# CUDA's caching allocator keeps its blocks, so there "auto" is only the fraction.
# A process started with glibc's tunables raising both thresholds
# (GLIBC_TUNABLES=glibc.malloc.mmap_threshold=...:glibc.malloc.trim_threshold=..., or
# MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_; docs/usage.md, "Memory") keeps
# freed blocks on its heap: there no call faults, unchunked is fastest (chunks cost
# 7-31 %, each re-runs the forward), and the cap rises to half the smaller threshold
# (malloc_keeps_memory_below).  dynbatch's programs now keep their large buffers
# (cpu/kept_buffers.py), so no call faults either way, and 16 MiB chunks stay the fastest:
# unchunked (a 1 GiB cap, tried) took x1.10 of their time on `full_hessian/lj` N = 100 and
# 200 and x1.00-1.03 on `pair_mlp`, at up to 23 times the peak (one Xeon core, `bench ab
# dynbatch.memory_budget=16MiB,auto`, with the chunk program's masks rebuilt: NOTE [Masks
# rebuilt in the chunk program] in planning/chunking.py).

# Several batched grads in one graph whose B-dependent memory adds up to more
# than this run one after another (each within the budget), even if together
# they fit the budget: a user's loop over chunks should peak at one chunk, as
# it does eagerly.  Below it, the chunk loop's per-call overhead is not worth it.
SEPARATE_ABOVE = 64 * 2**20

# NOTE [One dynamic graph across the budget]
# A graph whose B is static knows whether its grads fit.  Once B is symbolic
# (Dynamo's second graph), a graph that fits at its example B may meet a B that
# does not.  A guard "fits" would compile a third graph there; running the grads
# through the chunk loop from the start (one chunk while B fits) would save that
# compile, but the grad then leaves the graph on every call: measured side by
# side (bench `ab dynbatch.memory_budget=auto,256MiB`, one core, this project's
# CPU) the sweep's calls took x1.9 at B = 4 and 16, x1.3 at 64, x1.04 at 1024,
# and HVPs with K = 8 x2.2.  So the dynamic graph keeps both: its fused program
# while the sizes of a call fit (the plan's peak, evaluated on the call's sizes),
# and a chunked lowering of the same graph, made at the first call that does not
# fit (chunking.FusedWhileItFits).  That lowering runs after Dynamo installed the
# frame's guards; one that would need a new guard on the sizes is discarded and
# the fused program serves every B, with a warning naming the guard: memory over
# the budget, never a wrong value.  A guard asked with guards suppressed (FakeTensor's
# cache rebuilding a view) does not count: torch would not have installed it either,
# though the frozen ShapeEnv counts it as ignored (the bench's force-training cells
# after full_hessian's met that).

def _is_marker(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is torch.ops.dynbatch.batch_marker.default


# --- the estimate ---------------------------------------------------------------

@dataclasses.dataclass
class Estimate:
    """The B-dependent memory of one batched backward, as functions of the size symbols."""

    grad: str  # the Dynamo grad node
    batch: sympy.Expr  # B
    live: tuple[sympy.Expr, ...]  # bytes alive at each step of the backward (deduplicated)
    hints: dict[sympy.Symbol, int]  # the symbols' values in the example inputs

    def __post_init__(self):
        self.symbols = tuple(sorted({s for e in (self.batch, *self.live) for s in e.free_symbols}, key=str))
        # Evaluated at every chunked call: compiled once, not sympy's subs.
        self._evaluate = fx_utils.compile_sympy(self.symbols, [self.batch, *self.live])

    def bytes_per_sample(self, values: dict[sympy.Symbol, int] | None = None) -> int:
        values = {**self.hints, **(values or {})}
        batch, *live = self._evaluate(*(values[s] for s in self.symbols))
        return math.ceil(max(live, default=0) / max(1, batch))

    def example_batch(self) -> int:
        return int(self.batch.subs(self.hints))

    def peak(self) -> sympy.Expr:
        """The step with the most bytes alive at the example sizes."""
        return max(self.live, key=lambda e: e.subs(self.hints), default=sympy.Integer(0))


def observe(gm: torch.fx.GraphModule, fused: bool = False) -> dict[str, Estimate]:
    """Estimate every marked batched backward of ``gm``, then remove the markers.

    ``fused``: the graph goes to Inductor, which computes a pointwise op inside
    the kernel of its one pointwise consumer instead of storing it."""
    markers = [n for n in gm.graph.nodes if _is_marker(n)]
    if not markers:
        return {}
    estimates = {}
    try:
        for grad in dict.fromkeys(n.args[1] for n in markers):
            mine = [n for n in markers if n.args[1] == grad]
            cotangents = [n for n in mine if n.args[2] == COTANGENT]
            grads = [n for n in mine if n.args[2] == GRAD]
            if cotangents and grads:
                estimates[grad] = _estimate(gm.graph, grad, cotangents, grads, fused)
                estimates[grad].bytes_per_sample()  # evaluates at the example sizes
    except Exception as e:  # noqa: BLE001 - a plan we cannot make must not cost the compile
        log.warning("dynbatch: no memory plan for this graph (the budget is not applied): %s: %s",
                    type(e).__name__, e)
        estimates = {}
    finally:
        for node in markers:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
        gm.recompile()
    return estimates


def _estimate(graph: torch.fx.Graph, grad: str, cotangents, grads, fused: bool) -> Estimate:
    region = descendants(cotangents) & ancestors(grads)
    order = [n for n in graph.nodes if n in region and not _is_marker(n)]
    last_use = {}
    for i, node in enumerate(order):
        for arg in node.all_input_nodes:
            last_use[arg] = i
    live: dict[torch.fx.Node, sympy.Expr] = {}
    steps = set()
    for i, node in enumerate(order):
        live[node] = sympy.Integer(0) if fused and _fuses_into_its_user(node) else _allocated_bytes(node)
        steps.add(sympy.expand(sum(live.values(), sympy.Integer(0))))
        for arg in node.all_input_nodes:
            if last_use.get(arg) == i and arg in live:
                del live[arg]
    batch = sympy.sympify(cotangents[0].meta["val"].shape[0])
    hints = _hints([n.meta.get("val") for n in order] + [cotangents[0].meta["val"]])
    return Estimate(grad, batch, tuple(s for s in steps if s != 0), hints)


def descendants(roots) -> set[torch.fx.Node]:
    """Every node that reads, directly or not, one of ``roots`` (roots excluded)."""
    return _closure(roots, lambda node: node.users)


def ancestors(roots) -> set[torch.fx.Node]:
    """Every node one of ``roots`` reads, directly or not (roots excluded)."""
    return _closure(roots, lambda node: node.all_input_nodes)


def _closure(roots, step) -> set[torch.fx.Node]:
    seen, todo = set(), list(roots)
    while todo:
        for nxt in step(todo.pop()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def _allocated_bytes(node: torch.fx.Node) -> sympy.Expr:
    """Bytes a node's outputs allocate; views and expands share their input's storage."""
    target = node.target
    if node.op != "call_function" or _compat.is_view_op(target):
        return sympy.Integer(0)
    vals = node.meta.get("val")
    vals = vals if isinstance(vals, (tuple, list)) else (vals,)
    total = sympy.Integer(0)
    for v in vals:
        if isinstance(v, torch.Tensor):
            total += sympy.Mul(*[sympy.sympify(s) for s in v.shape]) * v.dtype.itemsize
    return total


def _fuses_into_its_user(node: torch.fx.Node) -> bool:
    """A pointwise op whose value, through views, is read by one pointwise op.  (Into a
    reduction Inductor fuses it too, unless their loop orders differ: counted, to stay an
    upper bound.)"""
    if not fx_utils.is_pointwise(node):
        return False
    users, todo = [], list(node.users)
    while todo:
        user = todo.pop()
        if _compat.is_view_op(user.target):
            todo.extend(user.users)
        else:
            users.append(user)
    return len(users) == 1 and fx_utils.is_pointwise(users[0])


def _hints(vals) -> dict[sympy.Symbol, int]:
    for v in vals:
        if isinstance(v, torch.Tensor):
            env = getattr(getattr(v, "fake_mode", None), "shape_env", None)
            if env is not None:
                return {s: int(h) for s, h in _compat.backed_hints(env).items()}
    return {}


# --- the budget and the plan ------------------------------------------------------

def auto_budget(device: torch.device) -> int:
    """AUTO_BUDGET_FRACTION of the memory free on ``device`` now; on the CPU at most
    CPU_AUTO_BUDGET, or half what malloc keeps mapped (NOTE [CPU chunks for speed])."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * AUTO_BUDGET_FRACTION)
    budget = int(available_ram() * AUTO_BUDGET_FRACTION)
    # Only the CPU allocates through malloc; other devices keep their own caches.
    return min(budget, cpu_speed_cap()) if device.type == "cpu" else budget


def cpu_speed_cap(environ: Mapping[str, str] = os.environ) -> int:
    """The most a CPU chunk may hold before malloc hands its blocks back to the kernel:
    CPU_AUTO_BUDGET under glibc's defaults, half the smaller threshold where the
    process was started with both raised."""
    kept = malloc_keeps_memory_below(environ.get("GLIBC_TUNABLES", ""),
                                     {name: environ[name] for name in _MALLOC_ALIASES if name in environ})
    return max(CPU_AUTO_BUDGET, kept // 2) if kept else CPU_AUTO_BUDGET


# glibc's older spelling of the two thresholds, one environment variable each (the
# one docs/usage.md shows for the heap); GLIBC_TUNABLES wins where both name one.
_MALLOC_ALIASES = {"MALLOC_MMAP_THRESHOLD_": "glibc.malloc.mmap_threshold",
                   "MALLOC_TRIM_THRESHOLD_": "glibc.malloc.trim_threshold"}


def malloc_keeps_memory_below(tunables: str, aliases: Mapping[str, str] | None = None) -> int | None:
    """Bytes below which glibc's malloc neither maps a block afresh nor trims its heap,
    from a GLIBC_TUNABLES string and the ``MALLOC_*_THRESHOLD_`` variables (``aliases``,
    by name); None unless both thresholds are set.  (Setting only one turns off glibc's
    adaptive thresholds and leaves the other at its 128 KiB default, which faults more,
    not less.)"""
    settings = [(_MALLOC_ALIASES[name], value) for name, value in (aliases or {}).items()]
    settings += [item.partition("=")[::2] for item in tunables.split(":")]
    values = {}
    for name, value in settings:
        if name in _MALLOC_ALIASES.values():
            try:
                values[name] = int(value, 0)  # decimal or 0x hex; anything else keeps the cap
            except ValueError:
                return None
    return min(values.values()) if len(values) == 2 else None


def available_ram() -> int:
    """Bytes of RAM this process could still get (the kernel's MemAvailable)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@dataclasses.dataclass
class GradPlan:
    """What the plan is for one batched grad; kept in ``CompileRecord.memory_plan``."""

    grad: str
    bytes_per_sample: int  # at the example sizes
    batch: int  # B at the example
    chunk_size: int | None  # at the example sizes; None: not chunked
    chunks: int
    applied: bool
    reason: str = ""  # why not chunked, or why it is


class Replan(Exception):
    """Raised from the inner compile: these grads must run chunked; lower again."""

    def __init__(self, grads: Sequence[str]):
        super().__init__(f"chunk {list(grads)}")
        self.grads = tuple(grads)


class Planner:
    """Decides, from the estimates of one graph's batched grads, which run in chunks."""

    def __init__(self, budget: int | None, chunk_size: int | None):
        self.budget = budget
        self.fixed_chunk = chunk_size
        self.estimates: dict[str, Estimate] = {}
        self.chunked: tuple[str, ...] = ()  # set by the backend once it lowers the chunked graph
        self.refused: dict[str, str] = {}  # grad -> why it cannot be chunked
        # Dynamo graph nodes whose aten ops draw random numbers (None: one of unknown
        # origin): a chunk program must not re-run them (chunking._check_rerunnable).
        self.random_nodes: set[str | None] = set()
        # (peak bytes, limit) where the unchunked graph fits at its example sizes but
        # not at every size (NOTE [One dynamic graph across the budget]).
        self.fits_while: tuple[sympy.Expr, int] | None = None

    @property
    def active(self) -> bool:
        return self.budget is not None or self.fixed_chunk is not None

    def chunk_size(self, estimate: Estimate, values: dict[sympy.Symbol, int] | None = None) -> int:
        if self.fixed_chunk is not None:
            return self.fixed_chunk
        return max(1, self.budget // max(1, estimate.bytes_per_sample(values)))

    def observe(self, gm: torch.fx.GraphModule, fused: bool = False) -> None:
        """Called by the inner compile on each aten graph: estimate, decide, maybe ask to re-lower."""
        self.random_nodes |= fx_utils.random_op_origins(gm)
        found = observe(gm, fused)
        if not self.active or not found:
            return
        first_time = not self.estimates
        self.estimates.update(found)
        if not first_time:
            return
        wanted = self._wanted(found)
        if wanted:
            raise Replan(wanted)
        self._note_fits(found)

    def _wanted(self, found: dict[str, Estimate]) -> list[str]:
        candidates = [g for g in found if g not in self.refused]
        if self.fixed_chunk is not None:
            # A symbolic B may grow past the chunk at any call: always through the chunk loop.
            return [g for g in candidates
                    if found[g].batch.free_symbols or found[g].example_batch() > self.fixed_chunk]
        totals = {g: e.bytes_per_sample() * e.example_batch() for g, e in found.items()}
        if sum(totals.values()) > self.budget:
            return candidates
        # Inductor may fuse independent batched backwards (a user's own loop over chunks)
        # into one kernel that holds them all at once: large ones run one after another.
        if len(totals) > 1 and sum(totals.values()) > SEPARATE_ABOVE:
            return candidates
        return []

    def _note_fits(self, found: dict[str, Estimate]) -> None:
        """Not chunked because it fits: where a larger size would not, say where it stops."""
        if self.fixed_chunk is not None:
            return
        total = sum((e.peak() for e in found.values()), sympy.Integer(0))
        limit = min(self.budget, SEPARATE_ABOVE) if len(found) > 1 else self.budget
        if total.free_symbols:
            self.fits_while = (total, limit)

    def grads_to_chunk(self) -> list[str]:
        """The grads a chunked lowering of this graph would chunk (as a Replan names them)."""
        return [g for g in self.estimates if g not in self.refused]

    def guard_fits(self) -> None:
        """The frame recompiles where the sizes stop fitting (when no switch can be built)."""
        if self.fits_while is not None:
            total, limit = self.fits_while
            _compat.add_shape_guard(sympy.Le(total, limit))

    def fits_checker(self, args: Sequence[Any]) -> Callable[[Sequence[Any]], bool] | None:
        """A check of real arguments shaped like ``args``: does the unchunked graph fit?
        None where a size it depends on cannot be read off the arguments."""
        total, limit = self.fits_while
        symbols = tuple(sorted(total.free_symbols, key=str))
        where = _where(symbols, args)
        if len(where) < len(symbols):
            return None
        evaluate = fx_utils.compile_sympy(symbols, [total])

        def fits(real_args: Sequence[Any]) -> bool:
            values = (_read(real_args, *where[s]) for s in symbols)
            return evaluate(*values)[0] <= limit

        return fits

    def records(self) -> list[GradPlan]:
        plans = []
        for grad, estimate in self.estimates.items():
            per_sample, batch = estimate.bytes_per_sample(), estimate.example_batch()
            if grad in self.chunked:
                chunk = self.chunk_size(estimate)
                plans.append(GradPlan(grad, per_sample, batch, chunk, math.ceil(batch / chunk), True))
            else:
                reason = self.refused.get(grad) or ("fits the budget" if self.active else "no budget")
                plans.append(GradPlan(grad, per_sample, batch, None, 1, False, reason))
        return plans


def resolve_budget(budget: int | str | None, example_inputs: Sequence[Any]) -> int | None:
    """The bytes one chunk of a batched backward may hold.  The budget is a ceiling,
    and within it the fastest chunk: on the CPU larger chunks run slower (NOTE [CPU
    chunks for speed]), so any budget is lowered to the CPU's speed cap, as "auto" is.
    None: no budget, batched grads run unchunked."""
    if budget is None:
        return None
    devices = [t.device for t in example_inputs if isinstance(t, torch.Tensor)]
    device = next((d for d in devices if d.type == "cuda"), devices[0] if devices else torch.device("cpu"))
    if budget == "auto":
        return auto_budget(device)
    return min(budget, cpu_speed_cap()) if device.type == "cpu" else budget


def binder(estimate: Estimate, args: Sequence[Any]) -> Callable[[Sequence[Any]], dict[sympy.Symbol, int]]:
    """Where each size symbol of ``estimate`` can be read off real arguments shaped like ``args``."""
    wanted = {s for e in estimate.live for s in e.free_symbols} | estimate.batch.free_symbols
    where = _where(wanted, args)

    def bind(real_args: Sequence[Any]) -> dict[sympy.Symbol, int]:
        return {s: _read(real_args, i, d) for s, (i, d) in where.items()}

    return bind


def _where(wanted, args: Sequence[Any]) -> dict[sympy.Symbol, tuple[int, int | None]]:
    """Symbol -> (argument, dim) of its first plain occurrence (dim None: a SymInt argument)."""
    where = {}
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            for d, size in enumerate(a.shape):
                expr = sympy.sympify(size)
                if isinstance(expr, sympy.Symbol) and expr in wanted and expr not in where:
                    where[expr] = (i, d)
        elif isinstance(a, torch.SymInt):
            expr = sympy.sympify(a)
            if isinstance(expr, sympy.Symbol) and expr in wanted and expr not in where:
                where[expr] = (i, None)
    return where


def _read(real_args: Sequence[Any], i: int, d: int | None) -> int:
    return int(real_args[i] if d is None else real_args[i].shape[d])


# --- a lowering after the frame's guards (NOTE [One dynamic graph across the budget]) ---

def fake_example_inputs(context: Any, example_inputs: Sequence[Any]) -> list[Any]:
    """The fake tensors AOTAutograd makes of a frame's example inputs (its fake mode
    keeps them; the real tensors' symbolic contexts give them the frame's symbols)."""
    from torch._subclasses.fake_tensor import FakeTensor

    fake_mode, contexts = context.fake_mode, context.tensor_to_context

    def fake(x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or isinstance(x, FakeTensor):
            return x
        symbolic = contexts[x] if x in contexts else None
        return fake_mode.from_tensor(x, symbolic_context=symbolic,
                                     source=getattr(symbolic, "tensor_source", None), trace=False)

    return [fake(x) for x in example_inputs]


@contextlib.contextmanager
def refusing_new_shape_guards(context: Any) -> Iterator[None]:
    """Raise after the block if it guarded on the frame's sizes.  Once Dynamo has
    installed a frame's guards its ShapeEnv is frozen: a new guard is ignored
    (counted as "ignored_backward_guard", every supported torch), so code compiled
    under it could be wrong where the guard would fail.  A guard asked while guards
    are suppressed would not have been installed either: it does not count."""
    shape_env = getattr(getattr(context, "fake_mode", None), "shape_env", None)
    if shape_env is None:
        yield
        return
    ignored, guards = shape_env.counter["ignored_backward_guard"], len(shape_env.guards)
    with _compat.ignored_shape_guards(shape_env) as named:
        yield
    if named is None:  # cannot tell a suppressed guard apart: any counts
        named = ["unnamed"] * (shape_env.counter["ignored_backward_guard"] - ignored)
    exprs = named or [str(g.expr) for g in shape_env.guards[guards:]]
    if exprs:
        raise RuntimeError("the lowering needed a new guard on the sizes, after the frame's guards were "
                           f"installed: {', '.join(exprs)}")
