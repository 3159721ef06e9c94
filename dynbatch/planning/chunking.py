"""Batched grads run chunk by chunk within a memory budget.

With planning/memory.py, the part of the pipeline docs/design.md calls "Memory within
a budget": not a numbered stage.  When the plan asks for chunks (memory.Replan,
raised from stage 4's inner compiler), the backend rewrites the batched graph
here and lowers it again.

NOTE [Chunked batched grads]
Chunks written into the graph do not bound memory under Inductor: the chunks
are independent loops of the same shape, and its CPU backend fuses them into
one kernel whose buffers, every chunk's, are allocated before it runs (a
user's loop of 9 batched grads of 100 cotangents peaks as one grad of 900;
``vmap(chunk_size=)`` under torch.compile likewise).  So a grad the plan
chunks (planning/memory.py) leaves the graph: its node becomes one opaque op,
``dynbatch::chunked_grad``, which AOTAutograd traces through its fake
implementation and Inductor calls as an extern kernel.  At run time the op
loops over chunks of the cotangents, and each chunk calls a *chunk program*:
the part of the captured graph between the grad's inputs and its outputs,
re-run on fresh leaves, then the batched grad of the chunk.  The program is
compiled by dynbatch itself (without a budget) with the chunk's batch dim
symbolic, so one compiled program serves every chunk, the ragged last one
included, and its intermediates are freed when each call returns.  Chunks
are split evenly (sizes differ by at most one), and the chunk size follows
from the budget and the sizes of each call (memory.Estimate).

The price is one re-run of the forward part per chunk; the grad's results
are written into one preallocated output.  A grad is not chunked (and the
plan says why) where a re-run would not reproduce the original: random ops,
in-place writes, grad-mode or autocast changes in the graph, a write before the
grad to memory the re-run recomputes (``_check_no_write_reaches``), or an inner grad
taken with respect to a tensor upstream of the batched grad's inputs; nor
where its results must stay differentiable (``create_graph=True``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import logging
import math
import operator
import threading
from typing import Any, Callable, Sequence

import torch
import torch.fx

from .. import _compat, fx_utils
from . import memory
from ..capture import requires_grad_tracing
from ..batching.batched_grad import batched_grad

log = logging.getLogger("dynbatch")

_GRAD_SIGNATURE = inspect.signature(batched_grad)
_PROGRAMS: dict[str, "ChunkProgram"] = {}  # key -> program; keys are content hashes (see _key)
_COMPILED: dict[str, Callable] = {}  # program code and options -> its compiled function, shared by graphs

# Targets whose effect is on global state, not on their arguments: re-running a
# slice of the graph without them would run it under another mode.
_GLOBAL_STATE_WORDS = ("set_grad_enabled", "autocast", "_functorch", "vmap", "inference_mode")


@dataclasses.dataclass
class ChunkProgram:
    key: str
    gm: torch.fx.GraphModule  # the chunk program, compiled at its first run
    used: tuple[bool, ...]  # which of the grad's inputs get a grad (not None)
    dep_requires_grad: tuple[bool, ...]  # deps to pass as fresh leaves that require grad
    estimate: memory.Estimate | None
    planner: memory.Planner
    bind: Callable[[Sequence[Any]], dict] | None
    compile: Callable[[torch.fx.GraphModule], Callable]
    compile_key: str  # what, besides its code, the compiled program depends on
    fn: Callable[..., Any] | None = None

    def compiled(self) -> Callable[..., Any]:
        if self.fn is None:
            # Code FX generates while Dynamo compiles is marked for Dynamo to skip
            # (convert_frame's guard against compiling its own output): generate it anew.
            self.gm.recompile()
            # The static and the dynamic graph of one function cut the same program:
            # one compiled program (and Dynamo's guards in it) serves both.
            constants = any(n.op == "get_attr" for n in self.gm.graph.nodes)
            shared = f"{self.gm.code}|{self.compile_key}|{id(self.gm) if constants else ''}"
            if shared not in _COMPILED:
                _COMPILED[shared] = self.compile(self.gm)
            self.fn = _COMPILED[shared]
        return self.fn

    def chunk_size(self, args: Sequence[Any]) -> int:
        if self.planner.fixed_chunk is not None or self.estimate is None:
            return self.planner.fixed_chunk or 1
        return self.planner.chunk_size(self.estimate, self.bind(args))

    def run(self, inputs, deps, ints, cotangents) -> list[torch.Tensor]:
        batch = cotangents[0].shape[0]
        size = max(1, min(batch, self.chunk_size([*inputs, *deps, *ints, *cotangents])))
        chunks = math.ceil(batch / size) if batch else 0
        with torch.enable_grad():
            leaf = requires_grad_tracing.program_input
            leaves = [leaf(x) for x in inputs]
            deps = [leaf(d) if rg else d.detach() for d, rg in zip(deps, self.dep_requires_grad)]
            if chunks == 1:  # B fits: the program's grads as they are, no copy
                # Aliases are marked, not the tensors given: a cotangent may be the caller's
                # own (a graph input passed through), and a mark on it failed the caller's
                # frame's guards at its next call, which compiled the frame again.
                cotangents = [c.view_as(c) for c in cotangents]
                for c in cotangents:
                    _compat.mark_batch_dynamic(c)
                grads = self.compiled()(*leaves, *deps, *ints, *cotangents)
                return [_owned(g, (*inputs, *deps, *cotangents)) for g in grads]
            outs = [x.new_empty((batch, *x.shape)) for x, used in zip(inputs, self.used) if used]
            start = 0
            for k in range(chunks):
                n = batch // chunks + (k < batch % chunks)
                pieces = [c.narrow(0, start, n) for c in cotangents]
                for p in pieces:
                    _compat.mark_batch_dynamic(p)
                grads = self.compiled()(*leaves, *deps, *ints, *pieces)
                for out, g in zip(outs, grads):
                    out.narrow(0, start, n).copy_(g)
                del grads
                start += n
        return outs

    def fake(self, inputs, cotangents) -> list[torch.Tensor]:
        batch = cotangents[0].shape[0]
        return [x.new_empty((batch, *x.shape)) for x, used in zip(inputs, self.used) if used]


def _owned(grad: torch.Tensor, args: Sequence[torch.Tensor]) -> torch.Tensor:
    """A custom op's output, as its fake promises: dense, and no alias of an argument
    (the grad of an identity is its cotangent)."""
    storage = grad.untyped_storage().data_ptr()
    if any(storage == a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)):
        return grad.clone(memory_format=torch.contiguous_format)
    return grad.contiguous()


# cudagraph_unsafe: its loop runs Python (guards, a chunk count that depends on B, a
# program compiled at its first run), which a CUDA graph's replay would skip; Inductor
# runs it between the graph's CUDA-graph partitions instead of recording it.
@torch.library.custom_op("dynbatch::chunked_grad", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def chunked_grad(key: str, inputs: list[torch.Tensor], deps: list[torch.Tensor], ints: list[int],
                 cotangents: list[torch.Tensor]) -> list[torch.Tensor]:
    """One batched grad run chunk by chunk through its compiled chunk program."""
    return _run(_PROGRAMS[key], inputs, deps, ints, cotangents)


# Runs inside a compiled graph, perhaps under an active Dynamo frame: plumbing, not
# user code to trace; the chunk program it calls is compiled on its own.
@_compat.dynamo_skip_frame
def _run(program: ChunkProgram, *args: Any) -> list[torch.Tensor]:
    with _compat.outside_custom_op():
        return program.run(*args)


@chunked_grad.register_fake
def _(key, inputs, deps, ints, cotangents):
    return _PROGRAMS[key].fake(inputs, cotangents)


# --- the rewrite ----------------------------------------------------------------

class Refused(Exception):
    """This grad cannot be chunked; the message says why."""


def chunk_grads(
    original: torch.fx.GraphModule,
    batched: torch.fx.GraphModule,
    names: Sequence[str],
    planner: memory.Planner,
    compile_program: Callable[[torch.fx.GraphModule], Callable],
) -> tuple[torch.fx.GraphModule, dict[str, str]]:
    """A copy of ``batched`` whose grads ``names`` call ``dynbatch::chunked_grad``; and the refused ones.

    Chunk programs are cut from ``original`` (Dynamo's graph, with
    ``torch.autograd.grad`` nodes): dynbatch compiles them as it compiles any
    captured graph.
    """
    refused: dict[str, str] = {}
    new_gm = fx_utils.copy_graph_module(batched)
    by_name = {n.name: n for n in original.graph.nodes}
    new_by_name = {n.name: n for n in new_gm.graph.nodes}
    for name in names:
        try:
            global_state = _global_state_nodes_before(by_name[name])
            if global_state:
                raise Refused(f"the graph changes global state ({global_state[0]}); a re-run of part of it "
                              "would run in another mode")
            program, args = _cut_program(original, by_name[name], planner, compile_program)
            _replace(new_gm.graph, new_by_name[name], program, args, new_by_name)
        except Refused as why:
            refused[name] = str(why)
            log.info("dynbatch: %s runs unchunked: %s", name, why)
    new_gm.graph.eliminate_dead_code(is_impure_node=_has_effects)
    new_gm.recompile()
    return new_gm, refused


class FusedWhileItFits:
    """A dynamic graph's compiled program that keeps its batched grads fused while
    a call's sizes fit the budget, and runs a chunked lowering of the same graph,
    made at the first call that does not fit (NOTE [One dynamic graph across the
    budget] in planning/memory.py).  ``lower_chunked`` returns that program, or raises
    where it cannot be made safely; the fused program then serves every call."""

    def __init__(self, fused: Callable, fits: Callable[[Sequence[Any]], bool],
                 lower_chunked: Callable[[], Callable]) -> None:
        self.fused, self.fits, self._lower_chunked = fused, fits, lower_chunked
        self.chunked: Callable | None = None
        self.failed: str | None = None  # why there is no chunked program, once that is known
        self._lock = threading.Lock()  # one lowering, whichever thread first needs it

    def __call__(self, *args: Any) -> Any:
        if self.fits(args):
            return self.fused(*args)
        if self.chunked is None and self.failed is None:
            self._lower_once()
        return (self.chunked or self.fused)(*args)

    def _lower_once(self) -> None:
        with self._lock:
            if self.chunked is not None or self.failed is not None:
                return
            try:
                self.chunked = self._lower_chunked()
            except Exception as e:  # noqa: BLE001 - the fused program is right at every size
                self.failed = f"{type(e).__name__}: {e}"
                log.warning("dynbatch: a call's batched grads exceed the memory budget and could not be "
                            "chunked (%s); running them unchunked", self.failed)


def _has_effects(node: torch.fx.Node) -> bool:
    """What dead-code elimination must keep in a Dynamo graph: besides FX's impure nodes,
    in-place methods (``x.requires_grad_()`` is read through ``x``) and global-state calls."""
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    return (node.is_impure() or (node.op == "call_method" and name.endswith("_"))
            or (node.op == "call_function" and name.startswith("set_")))


def _global_state_nodes_before(grad: torch.fx.Node) -> list[str]:
    """Global-state calls a re-run of the grad's part could run under: those before it
    (one after it changes nothing the part computes)."""
    found = []
    for node in grad.graph.nodes:
        if node is grad:
            break
        if node.op == "call_function":
            name = getattr(node.target, "__name__", str(node.target))
            if any(w in name for w in _GLOBAL_STATE_WORDS):
                found.append(name)
    return found


def _bound(node: torch.fx.Node) -> dict[str, Any]:
    bound = _GRAD_SIGNATURE.bind(*node.args, **node.kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _nodes(x: Any) -> list:
    if isinstance(x, torch.fx.Node):
        return [x]
    if isinstance(x, (list, tuple)):
        return list(x)
    if x is None:
        return []
    raise Refused(f"unexpected argument {x!r}")


def _val(node: torch.fx.Node) -> Any:
    return node.meta.get("example_value", node.meta.get("val"))


def _cut_program(original, node, planner, compile_program) -> tuple[ChunkProgram, dict[str, list]]:
    args = _bound(node)
    if args["create_graph"]:
        raise Refused("create_graph=True: the grads must stay differentiable")
    outputs, inputs = _nodes(args["outputs"]), _nodes(args["inputs"])
    cotangents = _nodes(args["grad_outputs"])[: len(outputs)]
    if not all(isinstance(a, torch.fx.Node) for a in (*outputs, *inputs)):
        raise Refused("outputs and inputs must be tensors of the graph")
    if not cotangents or any(not isinstance(c, torch.fx.Node) for c in cotangents):
        raise Refused("every output needs a batched grad_output")
    result = _val(node)
    used = tuple(g is not None for g in result)
    if args["materialize_grads"] and not all(used):
        raise Refused("materialize_grads with unused inputs")
    users = list(node.users)
    if any(u.target is not operator.getitem for u in users):
        raise Refused("its result is used other than by indexing")
    if any(not used[u.args[1]] for u in users):
        raise Refused(f"{users[0].name} reads a grad that is None")

    # The part of the graph a re-run needs: every node on a path from an input to an output.
    after_inputs = memory.descendants(inputs)
    before_outputs = memory.ancestors(outputs) | set(outputs)
    part = [n for n in original.graph.nodes if n in after_inputs and n in before_outputs]
    if not set(outputs) <= set(part):
        raise Refused("an output does not depend on the inputs")
    upstream = memory.ancestors(inputs)
    if None in planner.random_nodes:
        raise Refused("the graph draws random numbers in an op whose node is not known; a re-run could draw others")
    for n in part:
        _check_rerunnable(n, upstream, planner.random_nodes)
    in_part = set(part) | set(inputs)
    deps, ints, pulled = [], [], []
    _collect_deps(part, in_part, deps, ints, pulled, planner.random_nodes)
    _check_no_write_reaches(original, node, part, in_part | set(pulled), deps)
    body = [n for n in original.graph.nodes if n in set(part) | set(pulled)]

    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    dep_requires_grad = tuple(bool(getattr(_val(d), "requires_grad", False)) for d in deps)
    leaf = requires_grad_tracing.program_leaf
    for i, n in enumerate(inputs):
        env[n] = leaf(graph, graph.placeholder(f"input_{i}"))
    for i, (n, rg) in enumerate(zip(deps, dep_requires_grad)):
        env[n] = leaf(graph, graph.placeholder(f"dep_{i}")) if rg else graph.placeholder(f"dep_{i}")
    for i, n in enumerate(ints):
        env[n] = graph.placeholder(f"int_{i}")
    cot_args = [graph.placeholder(f"cotangent_{i}") for i in range(len(cotangents))]
    for n in body:
        env[n] = graph.node_copy(n, lambda a: env[a])
    kwargs = {k: v for k, v in args.items() if k not in ("outputs", "inputs", "grad_outputs")}
    kwargs.update(is_grads_batched=True, retain_graph=False)
    grad = graph.call_function(torch.autograd.grad, ([env[o] for o in outputs], [env[i] for i in inputs],
                                                     cot_args), kwargs)
    graph.output(tuple(graph.call_function(operator.getitem, (grad, i))
                       for i, u in enumerate(used) if u))
    # A fresh root holding only what the program reads: Dynamo's own graph module
    # is not one Dynamo would trace again.
    attributes = {n.target: fx_utils.fetch_attr(original, n.target) for n in body if n.op == "get_attr"}
    program_gm = torch.fx.GraphModule(attributes, graph, "ChunkProgram")

    estimate = planner.estimates.get(node.name)
    op_args = [*inputs, *deps, *ints, *cotangents]
    bind = memory.binder(estimate, [_val(a) for a in op_args]) if estimate is not None else None
    key = _key(program_gm, planner)
    if key not in _PROGRAMS:
        _PROGRAMS[key] = ChunkProgram(
            key, program_gm, used, dep_requires_grad, estimate, planner, bind, compile_program,
            repr(getattr(compile_program, "keywords", compile_program)))
    return _PROGRAMS[key], {"inputs": inputs, "deps": deps, "ints": ints, "cotangents": cotangents}


def _key(program_gm: torch.fx.GraphModule, planner: memory.Planner) -> str:
    # A content hash: a compiled graph that names it (e.g. from a cache) always means this program.
    text = f"{program_gm.code}|{planner.budget}|{planner.fixed_chunk}|{id(planner)}"
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _check_rerunnable(n: torch.fx.Node, upstream: set, random_nodes: set) -> None:
    """Raise Refused where re-running ``n`` would not give what the original run did.
    ``random_nodes``: the Dynamo nodes whose aten ops draw random numbers (memory.Planner)."""
    target = n.target
    name = target if isinstance(target, str) else getattr(target, "__name__", str(target))
    if _writes_in_place(n):
        raise Refused(f"{n.name} writes in place ({name})")
    if _draws_random_numbers(n, random_nodes):
        raise Refused(f"{n.name} draws random numbers ({name}); a re-run would draw others")
    if n.op == "call_function" and target is torch.autograd.grad:
        for x in _nodes(_bound(n)["inputs"]):
            if x in upstream:
                raise Refused(f"{n.name} differentiates with respect to {x.name}, upstream of the batched "
                              "grad's inputs")


def _check_no_write_reaches(original: torch.fx.GraphModule, grad: torch.fx.Node, part: Sequence[torch.fx.Node],
                            recomputed: set, deps: Sequence[torch.fx.Node]) -> None:
    """Raise Refused where a node before the grad writes in place to memory the re-run reads
    otherwise than the original did.  A write is no edge of the graph: a tensor the chunk
    program recomputes (``recomputed``: the part and what it pulls) would miss a write to it,
    or to a view of it, and a dep written after a part node read it would be read after the
    write.  (A dep written before is passed as it is then: the re-run reads what the original
    read.)  Storages tell views apart from other tensors, on the fake values."""
    storage = _compat.storage_of
    recomputed_storage = {s for s in map(storage, map(_val, recomputed)) if s is not None}
    dep_storage = {s: d for d in deps if (s := storage(_val(d))) is not None}
    order = {n: i for i, n in enumerate(original.graph.nodes)}
    first_read = {d: min((order[u] for u in d.users if u in part), default=None) for d in deps}
    for n in original.graph.nodes:
        if n is grad:
            return
        if not _writes_in_place(n) or not n.args or not isinstance(n.args[0], torch.fx.Node):
            continue
        written = storage(_val(n.args[0]))
        dep = dep_storage.get(written)
        if written in recomputed_storage or (dep is not None and first_read[dep] is not None
                                             and first_read[dep] < order[n]):
            name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
            raise Refused(f"{n.name} writes in place ({name}) to {n.args[0].name}, which a re-run would read "
                          "without the write")


def _collect_deps(part, in_part: set, deps: list, ints: list, pulled: list, random_nodes: set) -> None:
    """Values the part reads from the rest of the graph: tensors and ints are passed in;
    tensors built from no tensor input (NOTE [Masks rebuilt in the chunk program]) and
    other values (shapes, tuples) are recomputed from their own inputs."""
    todo = [a for n in part for a in n.all_input_nodes]
    seen = set()
    while todo:
        a = todo.pop()
        if a in in_part or a in seen:
            continue
        seen.add(a)
        v = _val(a)
        if isinstance(v, torch.Tensor) and not _built_from_no_tensor(a, random_nodes):
            deps.append(a)
        elif isinstance(v, (int, torch.SymInt)) and not isinstance(v, bool) and a.op == "placeholder":
            ints.append(a)
        elif a.op in ("call_function", "call_method"):
            pulled.append(a)
            todo.extend(a.all_input_nodes)
        else:
            raise Refused(f"it reads {a.name} ({type(v).__name__}), which a chunk program cannot take")
    order = {n: i for i, n in enumerate(part[0].graph.nodes)} if part else {}
    deps.sort(key=order.get)
    ints.sort(key=order.get)


# NOTE [Masks rebuilt in the chunk program]
# A tensor the graph builds from sizes alone (a pair potential's torch.eye and
# ones(n, n).triu(1) mask) is rebuilt by the chunk program, not passed in: Inductor then
# folds it into its kernels as index arithmetic, where a buffer passed in is read at every
# element.  Passed in, the Lennard-Jones Hessian's chunk program ran x1.4 the unchunked
# graph's time at the same batch (N = 100, one Xeon core, 16 MiB chunks: 29.5 against
# 20.5 ms); rebuilt, 20.8 ms.  Only where nothing in the chain draws random numbers (a
# re-run would draw others) or is written in place (a write the chain's nodes do not show).

def _built_from_no_tensor(node: torch.fx.Node, random_nodes) -> bool:
    """Whether ``node`` is computed from constants and int sizes only, without random
    numbers or in-place writes: a chunk program can rebuild it."""
    for n in (node, *memory.ancestors([node])):
        if n.op == "placeholder" and isinstance(_val(n), torch.Tensor):
            return False
        if n.op in ("get_attr", "output") or _draws_random_numbers(n, random_nodes):
            return False
        if any(_writes_in_place(m) for m in (n, *n.users)):
            return False
    return True


def _writes_in_place(n: torch.fx.Node) -> bool:
    """A Dynamo node that writes a tensor in place: ``x.add_(...)`` (not ``requires_grad_``),
    ``x[i] = v``, or an op whose schema writes an argument (``aten.copy_``,
    ``aten.scatter_add_``: the aten graphs ``make_fx`` traces, as NequIP compiles, call them
    as functions).  A write is no edge of the graph: a re-run of the nodes between the grad's
    inputs and outputs would miss the writes outside them (wrong grads, chunked)."""
    if n.op == "call_method":
        return n.target.endswith("_") and n.target != "requires_grad_"
    if n.op != "call_function":
        return False
    if n.target is operator.setitem:
        return True
    schema = getattr(n.target, "_schema", None)
    return bool(schema is not None and schema.is_mutable)


def _draws_random_numbers(n: torch.fx.Node, random_nodes: set) -> bool:
    """``random_nodes``: the Dynamo nodes whose aten ops draw random numbers (memory.Planner)."""
    return n.name in random_nodes or fx_utils.traced_name(n) in random_nodes


def _replace(graph: torch.fx.Graph, node: torch.fx.Node, program: ChunkProgram, args: dict, by_name) -> None:
    def here(nodes):
        return [by_name[n.name] for n in nodes]

    with graph.inserting_before(node):
        # The op has no autograd formula; its results, like the grad's, do not require grad.
        inputs, deps, cotangents = ([graph.call_method("detach", (x,)) for x in here(args[k])]
                                    for k in ("inputs", "deps", "cotangents"))
        op = graph.call_function(torch.ops.dynbatch.chunked_grad.default,
                                 (program.key, inputs, deps, here(args["ints"]), cotangents))
    positions = [i for i, u in enumerate(program.used) if u]
    for user in list(node.users):
        user.args = (op, positions.index(user.args[1]))
    graph.erase_node(node)
