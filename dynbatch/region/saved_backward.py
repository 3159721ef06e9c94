"""A legacy-batched backward from AOTAutograd's saved activations: its backward graph under vmap.

A grad taken outside a compiled region with batched grad_outputs (eager's
``is_grads_batched``, ``jacobian(vectorize=True)``) reaches AOTAutograd's node,
whose forward saved what its backward graph reads.  ``batched_grads`` answers it
with that graph vmapped over the cotangents, compiled once per set of grads with a
symbolic batch size (NOTE [Batched grads from the saved activations]).  Where the
node is not one it reads exactly, it returns None and region/paths.py takes the
recompute path (the program's compiled batched backward), with the reason logged.

Region logic that reaches torch internals itself: AOTAutograd's ``CompiledFunction``
metadata (``metadata``, ``maybe_subclass_metadata``; as region/aot_node.py reads it),
and a ``FakeTensorMode`` over a ``ShapeEnv`` of its own, whose guards each compiled
program checks.  The backward graph and what the forward saved come through ``_compat``.
"""

from __future__ import annotations

import logging
import operator
import sys
import threading
import weakref
from typing import Any, Callable, Sequence

import sympy
import torch
import torch.fx

from .. import _compat, fail_soft, records
from ..batching import batch_rules, markers
from ..capture import traced_aside
from ..lowering import aot_cache, inductor
from ..planning import memory
from ..records import STATS, CompileRecord
from .aot_node import AotCall

log = logging.getLogger("dynbatch")

# Counter name (dynbatch.counters()): legacy-batched backwards answered from the saved activations.
SAVED = "outside_batched_saved"
# Programs compiled per backward graph and set of grads (they differ by the sizes their guards
# accept: a dynamic region's sizes, a first B of 1) before the recompute path takes over.
MAX_PROGRAMS = 8
# The memory plan's name of the one batched backward in a program (markers.mark).
_PLAN_NAME = "saved_activations_backward"
# Why a call gets no grads from here yet: with dynbatch.compile='background', the program its
# arguments need compiles on a thread (NOTE [Outside paths aside] in region/paths.py).
COMPILING_ASIDE = "its program compiles aside (dynbatch.compile='background')"


# NOTE [Batched grads from the saved activations]
# A compiled model's outputs come from one AOTAutograd node, whose forward saved
# what its backward graph reads (activations, SymInts).  A backward with batched
# cotangents is that graph vmapped over the cotangents alone: in_dims None for what
# was saved, 0 for the tangents.  No forward is recomputed and no second Dynamo frame
# runs per call, which the recompute path does (the program's batched backward: x1.3 of
# the same grad taken inside a compiled function, +0.3-0.45 ms on small calls).
#
# The graph is the one AOTAutograd keeps for its lazy backward compile, traced with the
# forward whether or not its own backward has compiled since.  Its arguments are assembled
# as AOTAutograd's _backward_prologue assembles them (runtime_wrappers.py, torch 2.13):
# the saved SymInts, the saved tensors, then one tangent per output that survives into the
# backward (not an alias, needs grad), restrided to the layout the graph was traced with.
# The common case only: a node whose metadata shows anything else the prologue or the
# epilogue would do -- tensor subclasses, an input that needs grad written in place,
# outputs that alias, intermediate bases, effect tokens, functionalized random numbers,
# opaque objects, compiled autograd's state, a tangent traced in a memory format other
# than contiguous -- a region whose graph holds a grad that eagerly frees the graph it
# differentiates (edge._why_batched_grads_recompute: eager raises there, and so does the
# recompute) -- or a call with autocast on, or with deterministic algorithms turned on since
# the compile, goes to the recompute path (the reason logged once per region).  A region
# that takes create_graph grads itself (forces in a force field's forward) has a double
# backward for its backward graph, vmapped the same way on the CPU (NOTE [One path per
# request] in region/paths.py).  (Inductor spent
# over 17 minutes on that program for MACE's Hessian rows, in sympy's simplify of its C++
# strides, until inductor.inductor_strides_without_full_simplify.)
#
# A program is compiled per set of needed grads (NOTE [Only the grads a backward uses]:
# the graph's other outputs are dead code, eliminated), for a B that is symbolic from the
# first call: fakes in a ShapeEnv of this program's own, B dynamic and every other size as
# dynamic as it is in AOTAutograd's graph (a size static there is the same at every call
# of this node's class: the region's guards hold it).  Whatever the lowering guarded
# (2 <= B, a dynamic region's sizes) is checked before each call, as is a size that the
# ShapeEnv specialised (a first B of 1); a call the guards refuse compiles another program,
# up to MAX_PROGRAMS.  Where the memory budget asks, B runs in chunks (planning/memory.py's estimate,
# made while the program compiles), and one program serves every chunk.

def batched_grads(program: Any, call: AotCall | None, out_grads: Sequence[tuple[int, torch.Tensor]],
                  needed: tuple[bool, ...], batch_size: int) -> tuple | str | None:
    """The grads of ``program``'s needed inputs (physical [B, ...], None where not needed)
    for the physical cotangents ``out_grads``, from what ``call``'s forward saved; None
    where the recompute path must answer (NOTE [Batched grads from the saved activations]);
    COMPILING_ASIDE where they will come from here once their program has compiled."""
    if program.options is None:
        return None  # compiled with options this module does not know
    grads = _from_saved_activations(program, call, out_grads, needed, batch_size)
    if isinstance(grads, tuple) or grads is COMPILING_ASIDE:
        return grads
    program.log_once(f"saved backward: {grads}", "dynbatch: batched grads through a compiled graph "
                     "recompute its forward (not from its saved activations: %s)", grads)
    return None


def _from_saved_activations(program, call, out_grads, needed, batch_size) -> tuple | str:
    """``batched_grads``, or why the saved activations cannot give them."""
    if program.recompute_batched is not None:
        return program.recompute_batched
    if call is None:
        return "its outputs do not come from one AOTAutograd node"
    backward = _saved_backward_of(call.node)
    if isinstance(backward, str):
        return backward
    reason = _refused_now(call.node)
    if reason is not None:
        return reason
    by_nr: dict[int, torch.Tensor] = {}  # the node's outputs' grads
    for k, g in out_grads:
        nr = call.output_nr[k]
        by_nr[nr] = g if nr not in by_nr else by_nr[nr] + g
    wanted = tuple(a is not None and needed[a] for a in call.input_at)
    grads = backward.grads(call.node, by_nr, wanted, batch_size, program.options)
    if isinstance(grads, str):
        return grads
    result: list[torch.Tensor | None] = [None] * len(needed)  # by the program's inputs
    for a, g in zip(call.input_at, grads):
        if g is not None:
            result[a] = g if result[a] is None else result[a] + g
    return tuple(result)


def _refused_now(node: Any) -> str | None:
    """What this call's state would make AOTAutograd's backward do otherwise."""
    if torch._C._is_any_autocast_enabled():
        return "autocast is on"
    if _compat.functorch_transform_active():
        return "a torch.func transform is active"
    if getattr(type(node)._forward_cls.metadata, "deterministic", None) is False \
            and torch.are_deterministic_algorithms_enabled():
        return "deterministic algorithms were turned on after the graph compiled"
    if getattr(node, "_compiled_autograd_backward_state", None) is not None:
        return "compiled autograd's backward state"
    return None


_BACKWARDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # CompiledFunction class -> its own


def _saved_backward_of(node: Any) -> SavedBackward | str:
    """The batched backward of the node's class (one per compiled graph), or why there is none."""
    forward_cls = getattr(type(node), "_forward_cls", None)
    if forward_cls is None:
        return "not AOTAutograd's node"
    found = _BACKWARDS.get(forward_cls)
    if found is None:
        found = _BACKWARDS[forward_cls] = _read_backward(forward_cls)
    return found


# AOTAutograd's kinds of output whose tangent its backward graph takes (_backward_prologue).
_OWN_OUTPUTS = ("non_alias", "unsafe_view_alias", "custom_function_view")


def _read_backward(forward_cls: type) -> SavedBackward | str:
    """AOTAutograd's backward graph of ``forward_cls`` and the layout of its arguments, or
    why it cannot be called as this module calls it."""
    # A class a cache hit made has the graph its entry kept (NOTE [The backward graph of a hit]).
    graph = _compat.aot_backward_graph(forward_cls)
    if graph is None:
        graph = aot_cache.backward_graph(forward_cls)
    meta = getattr(forward_cls, "metadata", None)
    if graph is None or meta is None:
        return "AOTAutograd kept no backward graph"
    reason = _unsupported(forward_cls, meta)
    if reason is not None:
        return reason
    # The node's outputs are the mutated inputs, then the graph's outputs: each survivor's number.
    survivors = [meta.num_mutated_inp_runtime_indices + i for i, info in enumerate(meta.output_info)
                 if info.output_type.name in _OWN_OUTPUTS and issubclass(info.raw_type, torch.Tensor)
                 and getattr(info, "requires_grad_for_backward", info.requires_grad)]
    placeholders = list(graph.graph.find_nodes(op="placeholder"))
    tangents = placeholders[len(placeholders) - len(survivors):] if survivors else []
    if not all(p.name.startswith("tangents") for p in tangents) or any(
            p.name.startswith("tangents") for p in placeholders[:len(placeholders) - len(survivors)]):
        return "its backward graph takes other tangents than the outputs that need grad"
    metas = list(getattr(meta, "subclass_tangent_meta", None) or [None] * len(survivors))
    layouts = [_traced_layout(m) for m in metas]
    if len(layouts) != len(survivors) or any(isinstance(x, str) for x in layouts):
        return next((x for x in layouts if isinstance(x, str)), "its tangents' metadata does not match")
    return SavedBackward(graph, len(placeholders) - len(survivors), survivors, layouts)


def _unsupported(forward_cls: type, meta: Any) -> str | None:
    """What AOTAutograd's prologue or epilogue would do beyond taking tensors as they are."""
    aliases = [i for i in meta.output_info if i.requires_grad and i.output_type.name not in _OWN_OUTPUTS]
    checks = [
        (getattr(forward_cls, "maybe_subclass_metadata", None) is not None, "tensor subclasses"),
        (any(i.mutates_data and i.requires_grad for i in meta.input_info), "it writes an input that needs grad"),
        (bool(aliases) or getattr(meta, "num_intermediate_bases", 0) > 0, "an output that needs grad is an alias"),
        (getattr(meta, "num_backward_tokens", 0) > 0, "effect tokens"),
        (getattr(meta, "is_rng_op_functionalized", False) or getattr(meta, "num_graphsafe_rng_states", 0) > 0,
         "random numbers"),
        (bool(getattr(meta, "indices_of_inputs_that_requires_grad_with_mutations_in_bw", ())),
         "its backward writes its inputs"),
    ]
    return next((why for failed, why in checks if failed), None)


def _traced_layout(tangent_meta: Any) -> tuple | None | str:
    """The per-sample strides the backward graph was traced with for one tangent: None for
    contiguous (also where AOTAutograd records none: it made tangents contiguous), or
    (size, stride) of a static output's own layout; a str where it cannot be matched."""
    layout = getattr(tangent_meta, "memory_format", None)
    if layout is None:
        return None
    if layout.memory_format is not None:
        return None if layout.memory_format == torch.contiguous_format else "a tangent traced in another memory format"
    size, stride = tuple(layout.size), tuple(layout.stride)
    return None if stride == _contiguous_strides(size) else (size, stride)


def _contiguous_strides(size: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for s in reversed(size):
        strides.append(step)
        step *= max(s, 1)
    return tuple(reversed(strides))


class SavedBackward:
    """AOTAutograd's backward graph of one CompiledFunction class, batched over its
    tangents: the programs compiled of it, by the grads they compute."""

    def __init__(self, graph: torch.fx.GraphModule, n_saved: int, tangent_nrs: list[int],
                 layouts: list[tuple | None]) -> None:
        self.graph = graph
        self.n_saved = n_saved  # SymInts and tensors, before the tangents
        self.tangent_nrs = tangent_nrs  # the node's output each tangent is the grad of
        self.layouts = layouts  # per tangent: _traced_layout
        self.programs: dict[tuple[bool, ...], list[_Program]] = {}
        self.failed: dict[tuple[bool, ...], str] = {}
        self._aside: set[tuple[bool, ...]] = set()  # the sets of grads whose program compiles aside
        self._lock = threading.RLock()  # held through a compile here, taken again to keep its program

    def grads(self, node: Any, by_nr: dict[int, torch.Tensor], wanted: tuple[bool, ...], batch_size: int,
              options: Any) -> tuple | str:
        """One grad per argument of the node's forward (None where not wanted), or why not."""
        if not any(wanted):
            return (None,) * len(wanted)
        symints, tensors, opaque = _compat.aot_saved_for_backward(node)
        if opaque or len(symints) + len(tensors) != self.n_saved:
            return "its forward saved opaque objects" if opaque else "its saved values do not match its graph"
        tangents = [self._tangent(node, by_nr.get(nr), nr, layout, batch_size)
                    for nr, layout in zip(self.tangent_nrs, self.layouts)]
        saved = [*symints, *tensors]  # read under no_grad by the program: no detach needed
        args = [*saved, *tangents]
        first = self._program(wanted, args, options)
        if isinstance(first, str):
            return first
        chunk = first.chunk(saved, tangents)
        if chunk >= batch_size:
            return self._run(first, args)
        # Even chunks (sizes differ by at most one), each through the program its sizes pass.
        n = -(-batch_size // chunk)
        sizes = [batch_size // n + (i < batch_size % n) for i in range(n)]
        starts = [sum(sizes[:i]) for i in range(n)]
        parts = []
        for start, size in zip(starts, sizes):
            args = [*saved, *(t[start:start + size] for t in tangents)]
            program = self._program(wanted, args, options)
            part = program if isinstance(program, str) else self._run(program, args)
            if isinstance(part, str):
                return part
            parts.append(part)
        return tuple(None if p[0] is None else torch.cat(p) for p in zip(*parts))

    @staticmethod
    def _run(program: _Program, args: list[Any]) -> tuple | str:
        """The program's grads, or why it failed: it computes without side effects, so the
        recompute path may answer the same call (a failure is a bug here, never the user's)."""
        try:
            return program.run(args)
        except Exception as e:  # noqa: BLE001 - the recompute path is always right
            log.warning("dynbatch: the batched backward of a compiled graph's saved activations failed, "
                        "recomputing its forward instead: %s: %s", type(e).__name__, e)
            return f"running it failed: {type(e).__name__}: {e}"

    def _program(self, wanted: tuple[bool, ...], args: list[Any], options: Any) -> _Program | str:
        """The compiled program whose guards accept ``args``; compiled now if none does."""
        programs = self.programs.setdefault(wanted, [])
        found = next((p for p in programs if p.accepts(args)), None)
        if found is not None:
            return found
        with self._lock:
            if wanted in self.failed:
                return self.failed[wanted]
            if len(programs) >= MAX_PROGRAMS:
                return f"{MAX_PROGRAMS} programs compiled for other sizes"
            if options.compile == "background" and not traced_aside.on_thread():
                if wanted not in self._aside:
                    self._aside.add(wanted)
                    traced_aside.compile_aside(_PLAN_NAME, lambda: self._compile(wanted, args, options))
                return COMPILING_ASIDE
            return self._compile(wanted, args, options)

    def _compile(self, wanted: tuple[bool, ...], args: list[Any], options: Any) -> _Program | str:
        """Compile the program for ``args`` (here, under the lock, or on a thread aside)."""
        try:
            program = _Program(self.graph, self.n_saved, wanted, args, options)
        except Exception as e:  # noqa: BLE001 - the recompute path is always right
            reason = f"compiling it failed: {type(e).__name__}: {e}"
            log.warning("dynbatch: compiling the batched backward of a compiled graph's saved activations "
                        "failed, recomputing its forward instead: %s: %s", type(e).__name__, e)
            with self._lock:
                self.failed[wanted] = reason
                self._aside.discard(wanted)
            return reason
        with self._lock:
            self.programs[wanted].append(program)
            self._aside.discard(wanted)
        return program

    @staticmethod
    def _tangent(node: Any, grad: torch.Tensor | None, nr: int, layout: tuple | None, batch_size: int) -> torch.Tensor:
        """The physical [B, ...] tangent of output ``nr``, each sample in the traced layout."""
        if grad is None:  # the engine's zeros, as it materialises an output's missing grad
            meta = node._input_metadata[nr]
            grad = torch.zeros((batch_size, *meta.shape), dtype=meta.dtype, device=meta.device)
        if layout is None:
            return grad.contiguous()
        size, stride = layout
        span = 1 + sum((s - 1) * st for s, st in zip(size, stride)) if all(size) else 0
        if grad.stride() == (span, *stride):
            return grad
        restrided = torch.empty_strided((batch_size, *size), (span, *stride), dtype=grad.dtype, device=grad.device)
        return restrided.copy_(grad)


class _Program:
    """One compiled batched backward: the graph's grads for one set of inputs, B symbolic."""

    def __init__(self, graph: torch.fx.GraphModule, n_saved: int, wanted: tuple[bool, ...], args: list[Any],
                 options: Any) -> None:
        grads_graph, self.present = _graph_of_grads(graph, wanted)
        placeholders = list(graph.graph.find_nodes(op="placeholder"))
        mode = _fake_mode()
        fakes, self.pinned = _fakes(mode, placeholders, args, n_saved)
        module = _batched_module(grads_graph, n_saved, len(args) - n_saved, sum(self.present))
        record = CompileRecord(saved_backward=True)
        budget = memory.resolve_budget(options.memory_budget, args)
        self.planner = memory.Planner(budget, options.chunk_size)
        # Estimates only (a budget nothing exceeds): the chunks are this module's loop.
        collecting = memory.Planner(sys.maxsize if self.planner.active else None, None)
        with _compat.in_tracing_context(_tracing_context(mode)), torch.no_grad(), \
                records.compile_span(frame=False, record=record), \
                fail_soft.soft("dynbatch's batching rules", batch_rules.symbolic_batch_rules):
            self.compiled = inductor.lower(module, fakes, options, record, collecting)
        self.sizes_pass = _guards(mode, fakes)
        self.estimate = collecting.estimates.get(_PLAN_NAME)
        self.bind = memory.binder(self.estimate, fakes) if self.estimate is not None else None
        # A static region's estimate is a constant number of bytes per sample: its chunk too.
        self.same_chunk = self._chunk_at_every_size()
        record.memory_budget, record.memory_plan = budget, self._plan()
        STATS.add(record)

    def _plan(self) -> list[memory.GradPlan]:
        """The memory plan at the first call's B, for the compile record (each call chunks by its own)."""
        if self.estimate is None:
            return []
        per_sample, batch = self.estimate.bytes_per_sample(), self.estimate.example_batch()
        chunk = self.planner.chunk_size(self.estimate) if self.planner.active else batch
        if chunk >= batch:
            return [memory.GradPlan(_PLAN_NAME, per_sample, batch, None, 1, False,
                                    "fits the budget" if self.planner.active else "no budget")]
        return [memory.GradPlan(_PLAN_NAME, per_sample, batch, chunk, -(-batch // chunk), True)]

    def accepts(self, args: Sequence[Any]) -> bool:
        for i, d, value in self.pinned:
            if (args[i] if d is None else args[i].shape[d]) != value:
                return False
        return self.sizes_pass(args)

    def chunk(self, saved: list[Any], tangents: list[torch.Tensor]) -> int:
        """The samples one call may take within the memory budget."""
        if self.same_chunk is not None:
            return self.same_chunk
        return self.planner.chunk_size(self.estimate, self.bind([*saved, *tangents]))

    def _chunk_at_every_size(self) -> int | None:
        """The chunk, where it is the same at every size: no budget, or bytes per sample
        that depend on no size (every estimate is B times a number)."""
        if self.estimate is None or not self.planner.active:
            return sys.maxsize
        batch = self.estimate.batch
        if any(sympy.simplify(e / batch).free_symbols for e in self.estimate.live):
            return None
        return self.planner.chunk_size(self.estimate)

    def run(self, args: list[Any]) -> tuple:
        if torch.is_grad_enabled():
            with torch.no_grad():
                grads = self.compiled(*args)
        else:  # the engine's usual backward: entering no_grad would cost ~2 us for nothing
            grads = self.compiled(*args)
        it = iter(grads)
        return tuple(next(it) if p else None for p in self.present)


def _graph_of_grads(graph: torch.fx.GraphModule, wanted: tuple[bool, ...]) -> tuple[torch.fx.GraphModule, tuple]:
    """A copy of the backward graph that returns only the wanted grads, and which of the
    wanted ones it returns (the graph's None: no grad).  The rest is dead code."""
    copied = torch.fx.Graph()
    outs = copied.graph_copy(graph.graph, {})
    if len(outs) != len(wanted):
        raise RuntimeError(f"the backward graph returns {len(outs)} grads for {len(wanted)} arguments")
    present = tuple(w and isinstance(o, torch.fx.Node) for o, w in zip(outs, wanted))
    copied.output(tuple(o for o, p in zip(outs, present) if p))
    copied.eliminate_dead_code()
    _views_as_reshapes(copied)
    return torch.fx.GraphModule(graph, copied), present  # constants: the original's attributes


def _views_as_reshapes(graph: torch.fx.Graph) -> None:
    """Every ``view`` of the backward graph a ``reshape``.  Traced unbatched, a view merges
    dims that are contiguous; under vmap the same tensor may hold B between them (a batched
    broadcast puts it there), and the view raised "Cannot view a tensor ... as ..." (NequIP's
    Hessian then recomputed).  AOTAutograd's backward graphs are functional, so a copy where
    the view cannot be one changes no value."""
    aten = torch.ops.aten
    for node in graph.nodes:
        if node.op == "call_function" and node.target in (aten.view.default, aten._unsafe_view.default):
            node.target = aten.reshape.default


def _batched_module(grads: torch.fx.GraphModule, n_saved: int, n_tangents: int, n_grads: int) -> torch.fx.GraphModule:
    """A graph of one call: ``grads`` under vmap over the tangents, bracketed for the memory plan."""
    in_dims = (None,) * n_saved + (0,) * n_tangents

    def saved_activations_backward(*args):
        tangents = markers.mark(args[n_saved:], markers.COTANGENT, create_graph=False)
        out = torch.vmap(grads, in_dims=in_dims)(*args[:n_saved], *tangents)
        return markers.mark(tuple(out), markers.GRAD, create_graph=False)

    graph = torch.fx.Graph()
    args = [graph.placeholder(f"t{i}") for i in range(n_saved + n_tangents)]
    call = graph.call_function(saved_activations_backward, tuple(args))
    call.meta[_compat.GRAD_NODE_META] = _PLAN_NAME
    graph.output(tuple(graph.call_function(operator.getitem, (call, k)) for k in range(n_grads)))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _fake_mode() -> Any:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    return FakeTensorMode(shape_env=ShapeEnv())


def _tracing_context(mode: Any) -> Any:
    from torch._guards import TracingContext

    return TracingContext(mode)


def _fakes(mode: Any, placeholders: list[torch.fx.Node], args: list[Any], n_saved: int) -> tuple[list, list]:
    """Fakes of ``args``: B (a tangent's dim 0) dynamic, every other size as dynamic as
    AOTAutograd's trace has it; and (argument, dim or None, value) of each size asked
    dynamic that the ShapeEnv specialised (0 and 1 are), which the program must check."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext

    fakes, pinned = [], []
    for i, (placeholder, arg) in enumerate(zip(placeholders, args)):
        traced = _traced_symbolic(placeholder)
        if isinstance(arg, torch.Tensor):
            batched = i >= n_saved
            # A size the trace does not describe is taken dynamic.
            dynamic = [batched] * batched + [traced[d] if isinstance(traced, tuple) and d < len(traced) else True
                                             for d in range(arg.dim() - batched)]
            context = StatelessSymbolicContext(
                dynamic_sizes=[DimDynamic.DYNAMIC if x else DimDynamic.STATIC for x in dynamic],
                constraint_sizes=[None] * arg.dim())
            fake = mode.from_tensor(arg, symbolic_context=context)
            pinned += [(i, d, arg.shape[d]) for d, x in enumerate(dynamic) if x and isinstance(fake.shape[d], int)]
        elif isinstance(arg, int) and traced is True:
            fake = mode.shape_env.create_unspecified_symint_and_symbol(arg, ConstantSource(f"t{i}"),
                                                                       DimDynamic.DYNAMIC)
            if isinstance(fake, int):
                pinned.append((i, None, arg))
        else:
            fake = arg
            if isinstance(arg, int):
                pinned.append((i, None, arg))
        fakes.append(fake)
    return fakes, pinned


def _traced_symbolic(placeholder: torch.fx.Node) -> tuple[bool, ...] | bool | None:
    """Which sizes of a placeholder were symbolic in AOTAutograd's trace: per dim for a
    tensor, a bool for an int, None where the trace says nothing."""
    if aot_cache.SYMBOLIC_DIMS in placeholder.meta:  # a graph a cache hit brought back
        return placeholder.meta[aot_cache.SYMBOLIC_DIMS]
    return aot_cache.symbolic_dims(placeholder.meta.get("val"))


def _guards(mode: Any, fakes: list[Any]) -> Callable[[Sequence[Any]], bool]:
    """Whether real arguments pass what the compile guarded on the fakes' sizes (compiled once)."""
    from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

    code = mode.shape_env.produce_guards_expression(fakes)
    if not code:
        return lambda args: True
    compiled = compile(code, "<dynbatch: guards of a saved-activations backward>", "eval")
    names = [f"t{i}" for i in range(len(fakes))]
    return lambda args: eval(compiled, SYMPY_INTERP, {"L": dict(zip(names, args))})  # noqa: S307
