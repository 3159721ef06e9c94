"""The edge of the compiled region: what a grad taken *outside* a dynbatch graph gets.

Not a numbered stage (docs/design.md, "The edge of the region"): the backend
hands Dynamo each compiled graph inside a ``Region``.

AOTAutograd's compiled backward is first-order and unbatched.  Called with
``create_graph=True`` it returns grads that depend on nothing when none of its
saved tensors requires grad, and ``functional.hessian`` reads that as zeros;
called with batched grad_outputs (``is_grads_batched``, ``jacobian(vectorize=True)``,
``vmap`` over a vjp) its Inductor kernels receive BatchedTensors ("Cannot access
data pointer of Tensor that doesn't have storage"); and a region called with
forward-mode dual tensors drops their tangents.  See NOTE [Region backward].

NOTE [Region backward]
A dynbatch graph that autograd can differentiate is a ``Program``: a function
of its differentiable inputs (and the rest), compiled.  Each call goes through
``_ProgramFunction``: its forward runs the compiled code on detached aliases of
the differentiable inputs with grad enabled, so AOTAutograd's own backward
hangs off those aliases (the "inner graph", kept alive by saved tensors and
retained as the caller's backward retains its graph: NOTE [Inner graph's lifetime]).  Once
a call has shown the inner graph is one AOTAutograd node over the graph's
arguments, later calls return that node's outputs instead, its backward routed
to the same paths (NOTE [AOTAutograd's node in the caller's graph]).  The
backward picks a path by what it receives:

- plain grads: AOTAutograd's compiled backward (the inner graph);
- batched grads from eager's ``is_grads_batched`` (the legacy vmap): the
  batch dim is unwrapped, and a dynbatch-compiled batched backward of the same
  program (recompute the forward, one vmapped backward, B symbolic) runs once;
- ``create_graph=True`` with plain grads: the program's vjp, itself a program
  compiled by dynbatch (recompute the forward, then the grad with
  ``create_graph=True``, in one graph), whose result is differentiable through
  the same machinery: any order runs compiled (NOTE [Compiled create_graph]);
- batched grads from ``torch.func.vmap``, and ``create_graph=True`` where the
  compiled vjp does not apply (batched or dual grads, a functorch transform
  active, a vjp that failed to compile): the program is re-run eagerly on the
  saved inputs and differentiated with eager's autograd (correct to any order;
  logged);
- a graph that draws random numbers cannot be re-run (a recompute redraws
  them): batched grads loop over the inner graph per sample, and
  ``create_graph=True`` raises an error that says so.

Every path computes grads only for the inputs this backward call uses
(NOTE [Only the grads a backward uses]); a region asked for the grads of a
one-element output with ``create_graph=True`` computes them in its forward from
then on (NOTE [Forces at forward time]).

Regions whose graph mutates an input that requires grad keep AOTAutograd's
own autograd (it rebases the input's history, which a detached alias cannot);
there, only the plain path exists and the others raise.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import types
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.fx

from . import _compat, fx_utils, region_aot_node, requires_grad_tracing
from .region_batching import batching_of
from .records import STATS

log = logging.getLogger("dynbatch")

# Counter names (dynbatch.counters()): which path a backward from outside took.
PLAIN, BATCHED, VJP, EAGER, LOOP = (
    "outside_plain", "outside_batched_compiled", "outside_vjp_compiled", "outside_eager", "outside_per_sample")
# ... a create_graph backward answered by the grads computed at forward time
FORWARD_GRADS = "outside_grads_at_forward"
# ... and calls that ran the captured graph eagerly (forward-mode tangents, batched inputs).
EAGER_CALL = "eager_calls"


class Region:
    """One compiled Dynamo graph as seen from outside: call it, differentiate it."""

    def __init__(
        self,
        gm: torch.fx.GraphModule,
        compiled: Callable[..., Any],
        example_inputs: Sequence[Any],
        *,
        recompile: Callable[[Callable], Callable],
        random_ops: Sequence[str] = (),
        mutates_differentiable_input: bool = False,
        mutated_inputs: Sequence[int] = (),
    ) -> None:
        # Dynamo's graph: re-run eagerly, or traced again for a compiled backward.
        self.gm = _compat.realized_graph_module(gm)
        self.compiled = compiled
        # Inputs the graph calls requires_grad_() on: set on the real tensors at each call.
        self.sets_requires_grad = requires_grad_tracing.inputs_given_requires_grad(self.gm)
        self.diff_args = tuple(
            i for i, a in enumerate(example_inputs)
            if isinstance(a, torch.Tensor) and (a.requires_grad or i in self.sets_requires_grad)
            and torch.is_grad_enabled()
        )
        self.is_input = tuple(i in self.diff_args for i in range(len(example_inputs)))
        self.n_outputs = fx_utils.graph_output_count(self.gm)
        # NOTE [Outputs that need no grad]
        self.outputs_need_grad = bool(self.diff_args) and fx_utils.outputs_may_require_grad(self.gm)
        self.mutates_differentiable_input = mutates_differentiable_input
        # Other inputs the graph writes in place: NOTE [Recomputes see the inputs as they were].
        self.mutated = tuple(i for i in mutated_inputs if i < len(example_inputs) and not self.is_input[i]
                             and isinstance(example_inputs[i], torch.Tensor))
        is_input = self.is_input
        self.program = Program(
            _graph_program(self.gm, is_input), recompile, "region",
            compiled=lambda inputs, others: self.compiled(*_merge(is_input, inputs, others)),
            random_ops=tuple(random_ops), region=self)
        # The forward that also returns the grads a create_graph backward asked for
        # (NOTE [Forces at forward time]); None until one has.
        self.with_grads: Program | None = None
        # AOTAutograd's node in the caller's graph (NOTE [AOTAutograd's node in the
        # caller's graph]): learnt on the first call through the program's node.
        self.direct: _Direct | None = None
        self.direct_learnt = False
        self._logged: set[str] = set()

    def __call__(self, *args: Any) -> Any:
        for i in self.sets_requires_grad:
            args[i].requires_grad_(True)
        if _CALLER_ALIASES.active:
            # A program's own call (_ProgramFunction.forward): it differentiates the result.
            _CALLER_ALIASES.active = False
            return self.compiled(*args)
        reason = _why_run_eagerly(args)
        if reason is not None:
            self._log_once(reason, "dynbatch: running a compiled graph eagerly: %s", reason)
            STATS.count(EAGER_CALL)
            return self.gm(*args)
        if not self.outputs_need_grad:
            return self._compiled_without_grad(args)
        if self.mutates_differentiable_input:
            return _first_order_only(self, self.compiled(*args))
        if self.with_grads is not None and self.with_grads.missed:
            self.with_grads = None
        before = self._as_they_are(args)
        if self.direct is not None and self.with_grads is None and not _compat.functorch_transform_active():
            outs = self.direct(args, before)
            if outs is not None:
                return outs
            log.warning("dynbatch: a compiled graph's outputs no longer come from one AOTAutograd node; "
                        "its calls go through dynbatch's node again")
            self.direct = None
            if before is not None:  # undo that call's writes: the program's forward writes them once
                with torch.no_grad():
                    for i in self.mutated:
                        args[i].copy_(before[i])
        inputs = [args[i] for i in self.diff_args]
        others = [a for i, a in enumerate(args) if not self.is_input[i]]
        saved = None if before is None else [a for i, a in enumerate(before) if not self.is_input[i]]
        if self.with_grads is not None:
            try:
                return self.with_grads(inputs, others, saved)[:self.n_outputs]
            except Exception as e:  # noqa: BLE001 - the plain forward below is always right
                log.warning("dynbatch: compiling a forward that returns its grads failed, running the "
                            "graph alone: %s: %s", type(e).__name__, e)
                self.with_grads = None
        return self.program(inputs, others, saved)

    def _as_they_are(self, args: Sequence[Any]) -> list[Any] | None:
        """The arguments as a recompute must see them (NOTE [Recomputes see the inputs as
        they were]): a copy of each one this call will write in place; None if none."""
        if not self.mutated:
            return None
        before = list(args)
        for i in self.mutated:
            before[i] = args[i].clone()
        return before

    def _compiled_without_grad(self, args: Sequence[Any]) -> Any:
        outs = self.compiled(*args)
        if any(isinstance(o, torch.Tensor) and o.requires_grad for o in outs):
            # The trace said otherwise: never again, and this call's outputs keep the
            # plain backward AOTAutograd gave them (anything else raises, clearly).
            log.warning("dynbatch: a compiled graph returned a tensor that requires grad where its trace "
                        "said none would; its later calls differentiate as usual")
            self.outputs_need_grad = True
            return _first_order_only(self, outs)
        return outs

    @contextlib.contextmanager
    def program_replaced(self, program: Callable[..., Any]) -> Iterator[None]:
        """Inside the block, every path of this region runs ``program(*args)`` (the
        graph's arguments, in order) where it would run its compiled program, which
        stays ``self.compiled`` for the replacement to wrap.  For measurement only:
        ``python -m dynbatch.bench overhead`` times the program with a timer around
        it, and Dynamo's frame, its guards and this region alone with a program that
        returns a precomputed result.  Reach a region through its compile record
        (``dynbatch.compile_records()[i].region()``)."""
        real, self.compiled = self.compiled, program
        try:
            yield
        finally:
            self.compiled = real

    def learn_grads_at_forward(self, out_grads, needed) -> None:
        """After a create_graph backward that one output of one element received:
        compute those grads in the forward from now on (NOTE [Forces at forward time])."""
        if len(out_grads) != 1 or out_grads[0][1].numel() != 1:
            return
        (index, _), = out_grads
        self.with_grads = Program(_with_grads_of(self.program.python, index, needed), self.program.recompile,
                                  "forward_with_grads", linear=(index, needed, self.n_outputs))

    def learn_direct(self, outs: Sequence[Any], diff: Sequence[int], leaves: Sequence[torch.Tensor],
                     others: Sequence[Any]) -> None:
        """After the first call through the program's node: return AOTAutograd's outputs
        from now on where its node alone made them from the graph's arguments
        (NOTE [AOTAutograd's node in the caller's graph])."""
        self.direct_learnt = True
        if self.program.random_ops or not diff:
            return  # batched grads loop per sample over the inner graph (the program's node)
        node = region_aot_node.aot_backward_node([outs[k] for k in diff])
        if node is None:
            return
        args = _merge(self.is_input, leaves, others)
        tensor_args = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        edges = [edge for edge, _ in node.next_functions]
        if len(node.needs_input_grad) != len(args) or len(edges) != len(tensor_args):
            return
        for edge, i in zip(edges, tensor_args):
            if (edge is not None) != self.is_input[i] or (
                    edge is not None and region_aot_node.accumulated_tensor(edge) is not args[i]):
                return
        forward_cls = region_aot_node.route_backward(node, _routed_backward)
        if forward_cls is None:
            return
        self.direct = _Direct(self, forward_cls, {k: outs[k].output_nr for k in diff},
                              [tensor_args.index(i) for i in self.diff_args])

    def _log_once(self, key: str, msg: str, *args: Any) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.info(msg, *args)


# NOTE [Outputs that need no grad]
# A graph whose inputs require grad but whose outputs do not -- a compiled
# training step (loss.backward() inside, the loss returned detached), a batched
# grad computed without create_graph -- has nothing a backward from outside
# could reach, so its calls skip the program's autograd node (detached aliases,
# saved tensors, the views of leaves: about a fifth of a small step).  Dynamo
# guards the inputs' requires_grad and the grad mode, so the outputs' requires_grad
# in the trace holds at every call of this graph; a call that contradicts it
# warns, and its outputs keep AOTAutograd's first-order backward.

# NOTE [Recomputes see the inputs as they were]
# The batched, vjp and eager paths recompute the forward from the call's
# arguments.  A graph that writes an input in place (a BatchNorm's running
# statistics in training mode) would write it again on every recompute -- the
# statistics updated twice per step -- and a graph that reads what it writes
# would recompute from the written value.  So a region whose graph writes
# inputs (AOTAutograd's metadata, at compile time) copies those inputs before
# each call, and its recomputes take the copies: they read what the forward
# read, and write only to the copies.  The forward itself writes the real
# inputs once, as eager does.

# NOTE [Compiled create_graph]
# A backward with create_graph=True must return grads that autograd can
# differentiate again.  AOTAutograd's compiled backward is first-order, so a
# program answers with another program: ``vjp(inputs + cotangents, others)``,
# which recomputes the forward and takes the grad with create_graph=True,
# compiled by dynbatch as one graph.  It runs through ``_ProgramFunction`` like
# any program, so its result is differentiable in turn: a plain backward runs
# the vjp's own compiled (AOTAutograd) backward, another create_graph=True
# backward compiles the vjp of the vjp, so every order runs compiled.  A batched
# backward is the same construction with ``is_grads_batched=True``.

class Program:
    """``python(inputs, others) -> outputs``, differentiable w.r.t. ``inputs``;
    ``compiled`` is the same function compiled (by dynbatch, on first use)."""

    def __init__(self, python: Callable, recompile: Callable[[Callable], Callable], name: str, *,
                 compiled: Callable | None = None, random_ops: tuple[str, ...] = (), region: Region | None = None,
                 linear: tuple[int, tuple[bool, ...], int] | None = None) -> None:
        self.python, self.name, self.recompile = python, name, recompile
        self._compiled = compiled
        self.random_ops = random_ops
        self.region = region  # the region whose own graph this is, if any
        # (output, inputs, first grad): the outputs from "first grad" on are that
        # output's grads w.r.t. those inputs for a cotangent of ones.
        self.linear = linear
        self.missed = False  # a backward did not use those grads
        self.failed: str | None = None  # why compiling it failed, if it did
        self._vjps: dict[tuple, Program] = {}

    @property
    def compiled(self) -> Callable:
        if self._compiled is None:
            self._compiled = self.recompile(_own_code(self.python, self.name))
        return self._compiled

    def vjp(self, receives: tuple[bool, ...], needed: tuple[bool, ...], *, batched: bool = False) -> Program:
        """The program of this one's vjp: cotangents for the outputs in ``receives``,
        grads for the inputs in ``needed``; batched (``is_grads_batched``, the
        cotangents [B, ...]) or differentiable (``create_graph``)."""
        key = (receives, needed, batched)
        if key not in self._vjps:
            self._vjps[key] = Program(_vjp_of(self.python, receives, needed, batched), self.recompile,
                                      "batched_backward" if batched else "vjp")
        return self._vjps[key]

    def __call__(self, inputs: Sequence[torch.Tensor], others: Sequence[Any],
                 saved_others: Sequence[Any] | None = None) -> tuple:
        """``saved_others``: what a recompute takes for ``others`` (NOTE [Recomputes see the
        inputs as they were]); ``others`` themselves by default."""
        return _ProgramFunction.apply(self, len(inputs), saved_others, *inputs, *others)

    def refuse_rerun_if_random(self) -> None:
        if self.random_ops:
            raise RuntimeError(
                "dynbatch: this compiled graph draws random numbers "
                f"({', '.join(self.random_ops)}), so its backward cannot be re-run to give a "
                "differentiable (create_graph=True) or vmapped gradient; compute this grad "
                "outside torch.compile, or make the random op deterministic (e.g. eval mode)")

    def eager_backward(self, inputs, others, out_grads, needed, *, create_graph: bool):
        """Re-run the program eagerly and differentiate it: eager's answer."""
        self.refuse_rerun_if_random()
        # Differentiating w.r.t. the saved inputs themselves stops at them; no
        # detached copy (requires_grad_() is refused under torch.func transforms).
        with torch.enable_grad():
            outs = self.python(inputs, others)
            grads = torch.autograd.grad([outs[k] for k, _ in out_grads], _select(inputs, needed),
                                        [g for _, g in out_grads], create_graph=create_graph, allow_unused=True)
        return _spread(grads, needed)

    def compiled_backward(self, inputs, others, out_grads, needed, *, batched: bool):
        """A compiled vjp (differentiable) or batched backward; None where it failed to compile."""
        receives = tuple(any(k == i for i, _ in out_grads) for k in range(_max_out(out_grads)))
        vjp = self.vjp(receives, needed, batched=batched)
        if vjp.failed:
            return None
        cotangents = [g for _, g in out_grads]
        try:
            if not batched:
                return _spread(vjp([*inputs, *cotangents], others), needed)
            # NOTE [Leaves of dynbatch's programs] in requires_grad_tracing.py
            leaf = requires_grad_tracing.program_input
            with torch.enable_grad():
                return _spread(vjp.compiled([*(leaf(t) for t in inputs), *cotangents], list(others)), needed)
        except Exception as e:  # noqa: BLE001 - the eager path is always right
            vjp.failed = f"{type(e).__name__}: {e}"
            log.warning("dynbatch: compiling the %s of a compiled graph failed, using an eager backward "
                        "instead: %s", vjp.name, vjp.failed)
            return None


def _max_out(out_grads) -> int:
    return max(i for i, _ in out_grads) + 1


def _graph_program(gm: torch.fx.GraphModule, is_input: tuple[bool, ...]) -> Callable:
    def region(inputs, others):
        return tuple(gm(*_merge(is_input, inputs, others)))

    return region


def _vjp_of(program: Callable, receives: tuple[bool, ...], needed: tuple[bool, ...], batched: bool) -> Callable:
    """The closure holds masks of bools, which Dynamo keeps as constants (closure
    ints that differ between calls become SymInts, which it mis-traced in ``in``
    tests and indexing)."""
    def vjp(tensors, others):
        inputs, cotangents = tensors[:len(needed)], tensors[len(needed):]
        # Batched: inputs arrive detached (NOTE [Leaves of dynbatch's programs]); only the needed
        # ones require grad.
        if batched:
            inputs = [t.detach().requires_grad_() if n and not t.requires_grad else t for t, n in zip(inputs, needed)]
        outs = program(inputs, others)
        # An output that depends on none of the needed inputs has nothing to give them.
        pairs = [(o, c) for o, c in zip(_select(outs, receives), cotangents) if o.requires_grad]
        if not pairs:
            return (None,) * sum(needed)
        return torch.autograd.grad([o for o, _ in pairs], _select(inputs, needed), [c for _, c in pairs],
                                   is_grads_batched=batched, create_graph=not batched, allow_unused=True)

    return vjp


def _with_grads_of(program: Callable, index: int, needed: tuple[bool, ...]) -> Callable:
    def forward_with_grads(inputs, others):
        outs = program(inputs, others)
        grads = torch.autograd.grad(outs[index], _select(inputs, needed), torch.ones_like(outs[index]),
                                    create_graph=True, allow_unused=True)
        return (*outs, *grads)

    return forward_with_grads


def _own_code(fn: Callable, name: str) -> Callable:
    """``fn`` with a code object of its own: Dynamo caches compiled code (and
    counts recompiles) per code object, so programs -- and regions -- neither
    share a cache nor make each other's closure values symbolic."""
    _own_code.made += 1
    _own_code.names.add(f"{name}_{_own_code.made}")
    return types.FunctionType(fn.__code__.replace(co_name=f"{name}_{_own_code.made}"), fn.__globals__,
                              closure=fn.__closure__)


_own_code.made = 0
_own_code.names = set()  # what Dynamo may compile of dynbatch's code: these programs only


# NOTE [Only the grads a backward uses]
# A region's differentiable inputs are often a model's parameters as well as
# its data; a Jacobian w.r.t. the data must not compute B batched grads of
# every weight.  Autograd knows which nodes the running backward will execute
# (torch._C._will_engine_execute_node on the edges out of our node).  For a
# leaf that torch.autograd.grad captures it refuses to answer, and that refusal
# means the grad is wanted (_compat.engine_will_execute), so leaves need no
# stand-in.  Compiled backwards are cached per set of needed inputs.

def _needed(ctx, edges: Sequence[int]) -> tuple[bool, ...]:
    """Which of the node's edges (one per tensor argument of its forward) this
    backward call will use."""
    nodes = [node for node, _ in ctx.next_functions]
    return tuple(nodes[e] is not None and _compat.engine_will_execute(nodes[e]) for e in edges)


def _select(items: Sequence[Any], mask: tuple[bool, ...]) -> list[Any]:
    return [t for t, m in zip(items, mask) if m]


def _spread(values: Sequence[Any], mask: tuple[bool, ...]) -> tuple[Any, ...]:
    """The inverse of ``_select``: None where the mask is off."""
    it = iter(values)
    return tuple(next(it) if m else None for m in mask)


def _merge(is_input: tuple[bool, ...], inputs: Sequence[Any], others: Sequence[Any]) -> list[Any]:
    """The graph's argument list from its differentiable inputs and the rest, in order."""
    args, k, j = [], 0, 0
    for input_here in is_input:
        if input_here:
            args.append(inputs[k])
            k += 1
        else:
            args.append(others[j])
            j += 1
    return args


def _why_run_eagerly(args: Sequence[Any]) -> str | None:
    """Compiled kernels see neither forward-mode tangents nor legacy-vmap batch dims."""
    if _compat.forward_ad_level() >= 0 and any(
            isinstance(a, torch.Tensor) and _compat.has_tangent(a) for a in args):
        return "an input carries a forward-mode tangent, which compiled kernels drop"
    if any(isinstance(a, torch.Tensor) and _compat.is_legacy_batched(a) for a in args):
        return "an input is batched by eager's vmap (is_grads_batched / vectorize=True)"
    return None


class _CallerAliases(threading.local):
    """Set while ``_ProgramFunction`` calls a program compiled by Dynamo: the
    region Dynamo hands the call to returns the compiled outputs as they are,
    since the program's own node differentiates them (one autograd layer, not two)."""

    active = False


_CALLER_ALIASES = _CallerAliases()


class _ProgramFunction(torch.autograd.Function):
    """A program's outputs, differentiable w.r.t. the caller's tensors.

    Dynamo refuses a grad w.r.t. an input whose history lies outside the frame,
    and AOTAutograd's outputs must not reach the caller's graph directly (their
    backward is first-order and unbatched), so the program runs on leaves that
    alias the inputs; the backward picks a path (NOTE [Region backward]).
    """

    @staticmethod
    def forward(ctx, program, n_inputs, saved_others, *args):  # type: ignore[override]
        inputs, others = args[:n_inputs], list(args[n_inputs:])
        leaves = [t.detach().requires_grad_(t.requires_grad) for t in inputs]
        _CALLER_ALIASES.active = program.region is None
        try:
            with torch.enable_grad():
                outs = tuple(program.compiled(leaves, others))
        finally:
            _CALLER_ALIASES.active = False
        diff = tuple(k for k, o in enumerate(outs) if isinstance(o, torch.Tensor) and o.requires_grad)
        if program.region is not None and not program.region.direct_learnt:
            program.region.learn_direct(outs, diff, leaves, others)
        ctx.program, ctx.diff, ctx.n = program, diff, n_inputs
        ctx.other_tensors = [k for k, a in enumerate(others) if isinstance(a, torch.Tensor)]
        ctx.others = [None if isinstance(a, torch.Tensor) else a for a in others]
        if saved_others is not None:
            others = list(saved_others)
        ctx.set_materialize_grads(False)
        result = tuple(o.detach() if k in diff else o for k, o in enumerate(outs))
        ctx.mark_non_differentiable(*(o for k, o in enumerate(result)
                                      if isinstance(o, torch.Tensor) and k not in diff))
        # Saved, not kept on ctx: autograd frees them (and with them the inner graph)
        # when this node is released, and checks them for in-place changes.  The
        # grads computed at forward time are saved as outputs: a create_graph
        # backward returns them scaled, with this node as their history.
        ctx.first_grad = program.linear[2] if program.linear else len(outs)
        ctx.save_for_backward(*inputs, *leaves, *(outs[k] for k in diff),
                              *(others[k] for k in ctx.other_tensors), *result[ctx.first_grad:])
        return result

    @staticmethod
    @_compat.dynamo_disable
    def backward(ctx, *grads):
        saved, n, program = ctx.saved_tensors, ctx.n, ctx.program
        inputs, leaves = saved[:n], saved[n:2 * n]
        rest = saved[2 * n:]
        inner = dict(zip(ctx.diff, rest[:len(ctx.diff)]))
        rest = rest[len(ctx.diff):]
        others = list(ctx.others)
        for k, t in zip(ctx.other_tensors, rest):
            others[k] = t
        forward_grads = rest[len(ctx.other_tensors):]
        out_grads = [(k, grads[k]) for k in ctx.diff if grads[k] is not None]
        if torch.is_grad_enabled() or batching_of([g for _, g in out_grads]) is not None:
            needed = _needed(ctx, range(n))
        else:
            # A plain backward runs AOTAutograd's one compiled backward, which computes
            # every grad anyway, and the engine drops those it does not want: no need to
            # ask it (_will_engine_execute_node walks the graph, a few us per edge).
            needed = tuple(node is not None for node, _ in ctx.next_functions[:n])
        if not out_grads or not any(needed):
            return (None, None, None, *(None,) * len(ctx.others))
        grads_in = _backward(program, inputs, leaves, others, inner, out_grads, needed, forward_grads,
                             ctx.first_grad)
        return (None, None, None, *grads_in, *(None,) * len(ctx.others))


# NOTE [Inner graph's lifetime]
# The plain path runs AOTAutograd's backward of the inner graph, a graph of its
# own, so it has its own retain_graph.  Retaining it always (freed with this
# node) is correct but slow: AOTAutograd keeps its saved tensors through its
# compiled backward, and a small call pays for it (about 90 us of a 1 ms force
# training step).  So the inner graph keeps what the caller's backward keeps:
# freed now unless the caller passed retain_graph=True (or create_graph=True),
# in which case this node survives too and a second backward finds both.

def _backward(program, inputs, leaves, others, inner, out_grads, needed, forward_grads, first_grad):
    """Pick the path for one backward call (NOTE [Region backward])."""
    cotangents = [g for _, g in out_grads]
    batching = batching_of(cotangents)
    if program.linear is not None:
        grads = _grads_from_forward(program, out_grads, needed, batching, forward_grads)
        if grads is not None:
            return grads
        # Asked for other grads, or a plain backward that left them unused.
        program.missed = program.missed or torch.is_grad_enabled() or all(k < first_grad for k, _ in out_grads)
    if torch.is_grad_enabled():
        return _create_graph_backward(program, inputs, others, out_grads, needed, batching)

    def inner_backward(grads, again: bool = False):
        # The inner graph keeps what the caller's graph keeps (NOTE [Inner graph's lifetime]);
        # ``again``: this backward runs it once more (per-sample grads).
        keep = again or _compat.backward_keeps_graph()
        with _compat.donated_buffers_off() if keep else contextlib.nullcontext():
            if not again:
                direct = _aot_backward_called_directly(inner, [k for k, _ in out_grads], grads, leaves, needed)
                if direct is not None:
                    return direct
            return _spread(torch.autograd.grad([inner[k] for k, _ in out_grads], _select(leaves, needed), grads,
                                               retain_graph=keep, allow_unused=True), needed)

    if batching is None:
        STATS.count(PLAIN)
        return inner_backward(cotangents)
    if program.random_ops and batching.kind != "nested":
        STATS.count(LOOP)
        return _per_sample(batching, out_grads, inner_backward)
    if batching.kind == "legacy":
        with batching.unwrapped(out_grads) as (physical, _, rewrap):
            grads = program.compiled_backward(inputs, others, physical, needed, batched=True)
        if grads is not None:
            STATS.count(BATCHED)
            return rewrap(grads)
    _log_once(program, "batched", "dynbatch: batched grads through a compiled graph (%s vmap): "
              "re-running it eagerly for the backward", batching.kind)
    STATS.count(EAGER)
    return program.eager_backward(inputs, others, out_grads, needed, create_graph=False)


# NOTE [AOTAutograd's backward, called directly]
# Where the inner graph is one AOTAutograd node whose inputs are the leaves
# themselves (a region's usual shape), the plain path calls that node's
# backward itself instead of starting a nested engine over the graph: the
# nested torch.autograd.grad (its Python, a graph task, the capture of each
# leaf) cost about 5 % of a small force-training step.  The node is asked as
# the engine would ask it (zeros for outputs without a grad) and frees its saved
# tensors as the engine would let it (it reads the running backward's
# retain_graph).  Any other shape -- a view or another node between a leaf and
# the compiled function -- takes the engine.

def _aot_backward_called_directly(inner, outputs, grads, leaves, needed) -> tuple | None:
    """The plain backward of the inner graph by AOTAutograd's node alone, or None
    where the graph is not that one node over the leaves."""
    node = region_aot_node.aot_backward_node(list(inner.values()))
    if node is None:
        return None
    position = {id(leaf): i for i, leaf in enumerate(leaves)}
    # The node's edges, in order, are those of its forward's arguments that require
    # grad (its other arguments, SymInts included, get no edge): the leaf of each.
    wanted = [i for i, w in enumerate(node.needs_input_grad) if w]
    edges = [edge for edge, _ in node.next_functions if edge is not None]
    targets = [position.get(id(region_aot_node.accumulated_tensor(edge))) for edge in edges]
    if len(edges) != len(wanted) or None in targets:
        return None
    by_output: dict[int, torch.Tensor] = {}
    for k, g in zip(outputs, grads):
        nr = inner[k].output_nr
        by_output[nr] = g if nr not in by_output else by_output[nr] + g
    node_grads = region_aot_node.call_backward_node(node, by_output)
    result: list[torch.Tensor | None] = [None] * len(leaves)
    for i, target in zip(wanted, targets):
        g = node_grads[i]
        if g is not None and needed[target]:
            result[target] = g if result[target] is None else result[target] + g
    return tuple(result)


# NOTE [AOTAutograd's node in the caller's graph]
# A region whose inner graph is one AOTAutograd node over the graph's own
# arguments -- a model's usual shape -- needs no node of its own for a plain
# backward: AOTAutograd's compiled backward is the answer.  Its own node in
# front (_ProgramFunction: detached aliases, saved tensors, a Python backward
# that calls AOTAutograd's) cost about a tenth of a small force-training step
# (docs/benchmarks.md).  So once
# the first call has shown that shape, the region returns AOTAutograd's outputs
# as they are, as stock torch.compile does, and the backward of the node's class
# (one class per compiled graph) is routed: a plain backward runs AOTAutograd's
# own; a create_graph or batched one, which AOTAutograd refuses or cannot batch,
# takes dynbatch's paths (NOTE [Region backward]) on the call's arguments.  Those
# are kept on the node with their versions, so an in-place change raises as
# autograd's saved tensors would.  Graphs that draw random numbers keep the
# program's node: their batched grads loop per sample over the inner graph.

class _Direct:
    """A region's calls that return AOTAutograd's outputs, and their routed backward."""

    def __init__(self, region: Region, forward_cls: type, output_nrs: dict[int, int],
                 diff_edges: list[int]) -> None:
        self.region = region
        self.forward_cls = forward_cls  # AOTAutograd's CompiledFunction of this graph
        self.output_nrs = tuple(output_nrs.items())  # (graph output, the node's output) that need grad
        self.first = next(iter(output_nrs))
        self.diff_edges = diff_edges  # the node's edge of each differentiable input

    def __call__(self, args: Sequence[Any], before: Sequence[Any] | None) -> tuple | None:
        """``before``: the arguments as a recompute must see them (None: ``args``)."""
        outs = self.region.compiled(*args)
        node = outs[self.first].grad_fn
        if node is None or getattr(type(node), "_forward_cls", None) is not self.forward_cls:
            return None
        kept = args if before is None else before
        node._dynbatch_call = (self, kept, tuple(a._version if isinstance(a, torch.Tensor) else None
                                                 for a in kept))
        return outs

    @_compat.dynamo_disable
    def backward(self, ctx, args, versions, grads, batching) -> tuple:
        """A create_graph or batched backward, by dynbatch's paths; one grad per argument."""
        for a, version in zip(args, versions):
            if version is not None and a._version != version:
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified by an "
                    f"inplace operation: [{a.type()} {list(a.shape)}] is at version {a._version}; "
                    f"expected version {version} instead (an input of a dynbatch-compiled graph)")
        region = self.region
        edges = ctx.next_functions
        needed = tuple(edges[e][0] is not None and _compat.engine_will_execute(edges[e][0])
                       for e in self.diff_edges)
        out_grads = [(k, grads[nr]) for k, nr in self.output_nrs if grads[nr] is not None]
        result: list[Any] = [None] * len(args)
        if out_grads and any(needed):
            inputs = [args[i] for i in region.diff_args]
            others = [a for i, a in enumerate(args) if not region.is_input[i]]
            grads_in = _backward(region.program, inputs, None, others, None, out_grads, needed, (),
                                 region.n_outputs)
            for i, g in zip(region.diff_args, grads_in):
                result[i] = g
        return tuple(result)


def _routed_backward(original: Callable) -> Callable:
    """The backward of a routed AOTAutograd class: its own for plain grads and for
    nodes a _Direct did not make (a program's inner graph), dynbatch's otherwise.
    Kept from Dynamo as every entry from the engine is: a grad call that graph-broke runs
    the engine with Dynamo's frame hook on, which then traced this plumbing."""
    @_compat.dynamo_disable
    def backward(ctx, *args):
        call = getattr(ctx, "_dynbatch_call", None)
        if call is not None:
            # torch 2.13 on hands this class's grads over as one list (boxed_grads_call).
            grads = args[0] if len(args) == 1 and isinstance(args[0], list) else args
            batching = batching_of([g for g in grads if g is not None])
            if batching is not None or torch.is_grad_enabled():
                direct, call_args, versions = call
                return direct.backward(ctx, call_args, versions, grads, batching)
            STATS.count(PLAIN)
            if not _compat.backward_keeps_graph():
                ctx._dynbatch_call = None  # the graph is freed: let the arguments go with it
        return original(ctx, *args)

    return backward


def _create_graph_backward(program, inputs, others, out_grads, needed, batching):
    """``create_graph=True``: the compiled vjp where it applies, else the eager re-run."""
    program.refuse_rerun_if_random()
    reason = _why_vjp_runs_eagerly(batching, inputs, out_grads)
    if reason is None:
        grads = program.compiled_backward(inputs, others, out_grads, needed, batched=False)
        if grads is not None:
            STATS.count(VJP)
            if program.region is not None:
                program.region.learn_grads_at_forward(out_grads, needed)
            return grads
        reason = "its compiled vjp failed"
    _log_once(program, f"create_graph: {reason}", "dynbatch: create_graph=True through a compiled graph: "
              "re-running it eagerly for a differentiable backward (%s)", reason)
    STATS.count(EAGER)
    return program.eager_backward(inputs, others, out_grads, needed, create_graph=True)


def _why_vjp_runs_eagerly(batching, inputs, out_grads) -> str | None:
    """A compiled vjp sees plain tensors only (as a region's forward does)."""
    if batching is not None:
        return f"the grads are batched ({batching.kind} vmap)"
    if _compat.functorch_transform_active():
        return "a torch.func transform is active"
    return _why_run_eagerly([*inputs, *(g for _, g in out_grads)])


def _log_once(program, key, msg, *args) -> None:
    if program.region is not None:
        program.region._log_once(key, msg, *args)
    else:
        log.debug(msg, *args)


# NOTE [Forces at forward time]
# Force-field training takes F = -dE/dpos with create_graph=True outside the
# compiled model, then differentiates a loss of E and F.  Answering with the
# compiled vjp costs the forward twice and two compiled backwards (the model's,
# for E, and the vjp's, for F).  A vjp is linear in its cotangent, so for an
# output of one element it is that cotangent times the vjp of ones.  Once a
# create_graph backward has asked a region for the grads of such an output, the
# region's later forwards run one program that returns the outputs and those
# grads (for a cotangent of ones), and the create_graph backward returns them
# scaled: they are outputs of the same autograd node as E, so the loss's
# backward reaches that node once, with grads for E and F together, and runs
# one compiled backward -- the structure of the whole step compiled.  A
# backward that does not match (another output, other inputs, or a plain
# backward that leaves the grads unused) takes the general paths, and the
# region stops computing grads at forward time until asked again.

def _grads_from_forward(program, out_grads, needed, batching, forward_grads):
    """The create_graph backward from the grads computed at forward time, or None."""
    index, computed, _ = program.linear
    if (not torch.is_grad_enabled() or len(out_grads) != 1 or out_grads[0][0] != index
            or any(n and not c for n, c in zip(needed, computed))):
        return None
    if _why_vjp_runs_eagerly(batching, (), out_grads) is not None:
        return None
    STATS.count(FORWARD_GRADS)
    scale = out_grads[0][1].reshape(())
    return tuple(g * scale if n and g is not None else None
                 for n, g in zip(needed, _spread(forward_grads, computed)))


def _per_sample(batching, out_grads, grad_fn):
    with batching.unwrapped(out_grads) as (physical, batch_size, rewrap):
        # Eager's vmap refuses B = 0 before any backward runs, so there is a sample.
        per_sample = [grad_fn([g[b] for _, g in physical], again=b < batch_size - 1) for b in range(batch_size)]
        grads = tuple(None if first is None else torch.stack([s[k] for s in per_sample])
                      for k, first in enumerate(per_sample[0]))
    return rewrap(grads)


def _first_order_only(region: Region, outs: Any) -> Any:
    """Outputs of a graph that mutates a differentiable input: AOTAutograd's autograd,
    behind a check that refuses what it would answer wrongly."""
    outs = tuple(outs)
    diff = [i for i, o in enumerate(outs) if isinstance(o, torch.Tensor) and o.requires_grad]
    if not diff:
        return outs
    checked = _FirstOrderOnly.apply(*(outs[i] for i in diff))
    result = list(outs)
    for i, o in zip(diff, checked):
        result[i] = o
    return tuple(result)


class _FirstOrderOnly(torch.autograd.Function):
    @staticmethod
    def forward(ctx, *outs):  # type: ignore[override]
        return tuple(o.view_as(o) for o in outs)

    @staticmethod
    @_compat.dynamo_disable
    def backward(ctx, *grads):
        if torch.is_grad_enabled() or batching_of([g for g in grads if g is not None]):
            raise RuntimeError(
                "dynbatch: this compiled graph mutates an input that requires grad in place, so "
                "its backward is first-order and unbatched only; create_graph=True or batched "
                "grad_outputs need the mutation outside torch.compile")
        return grads
