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
retained as the caller's backward retains its graph:
NOTE [Inner graph's lifetime] in region/paths.py).  Once a call has shown
the inner graph is one AOTAutograd node over the graph's arguments, later calls
return that node's outputs instead, its backward routed to the same paths
(NOTE [AOTAutograd's node in the caller's graph] in region/direct.py).  The
backward picks a path by what it receives (paths.backward):

- plain grads: AOTAutograd's compiled backward (the inner graph);
- batched grads from eager's ``is_grads_batched`` (the legacy vmap): the
  batch dim is unwrapped, and AOTAutograd's backward graph, vmapped over the
  cotangents, runs once on the activations its forward saved (B symbolic; NOTE
  [Batched grads from the saved activations] in region/saved_backward.py); where
  that is not exact, a dynbatch-compiled batched backward of the same program
  (recompute the forward, one vmapped backward, B symbolic);
- ``create_graph=True`` with plain grads: the program's vjp, itself a program
  compiled by dynbatch (recompute the forward, then the grad with
  ``create_graph=True``, in one graph), whose result is differentiable through
  the same machinery: any order runs compiled (NOTE [Compiled create_graph] in
  region/program.py);
- batched grads from a ``torch.func.vmap`` that is the only transform active: the
  same two paths, with the vmap popped for the call (MACE's Hessian idiom);
- batched grads from a ``torch.func.vmap`` under another transform, and ``create_graph=True`` where the
  compiled vjp does not apply (batched or dual grads, a functorch transform
  active, a vjp that failed to compile): the program is re-run eagerly on the
  saved inputs and differentiated with eager's autograd (correct to any order;
  logged);
- a graph that draws random numbers cannot be re-run (a recompute redraws
  them): batched grads loop over the inner graph per sample, and
  ``create_graph=True`` raises an error that says so.

Every path computes grads only for the inputs this backward call uses
(NOTE [Only the grads a backward uses] in region/program.py); a region asked
for the grads of a one-element output with ``create_graph=True`` computes them
in its forward from then on (NOTE [Forces at forward time] in
region/create_graph.py).

Regions whose graph mutates an input that requires grad keep AOTAutograd's
own autograd (it rebases the input's history, which a detached alias cannot);
there, only the plain path exists and the others raise.

The modules of the region, each importing only those below it:

    region/edge.py               a region's calls (this module)
    region/direct.py        AOTAutograd's node in the caller's graph, its backward routed
    region/program.py       programs, and the autograd node their calls go through
    region/paths.py      the path a backward takes; the plain and batched paths
    region/saved_backward.py  batched grads from AOTAutograd's saved activations
    region/create_graph.py  create_graph=True: grads at forward time, compiled vjp, eager
    region/aot_node.py      AOTAutograd's node: found, its backward called directly, routed
    region/which_vmap.py      which vmap batches the grads a backward receives
    region/args.py          a region's differentiable inputs and the rest; masks over them
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.fx

from .. import _compat, fx_utils
from ..batching import grad_pass
from . import direct
from ..capture import requires_grad_tracing
from ..records import STATS
from .args import merge, why_run_eagerly
from .which_vmap import batching_of
from .create_graph import with_grads_of
from .program import CALLER_ALIASES, Program, graph_program

log = logging.getLogger("dynbatch")

# Counter name (dynbatch.counters()): calls that ran the captured graph eagerly (forward-mode
# tangents, batched inputs).  The backward's paths count theirs in region/paths.py and
# region/create_graph.py.
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
        options: Any = None,
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
        others_at = [i for i, input_here in enumerate(is_input) if not input_here]
        self.program = Program(
            graph_program(self.gm, is_input), recompile, "region",
            compiled=lambda inputs, others: self.compiled(*merge(is_input, inputs, others)),
            random_ops=tuple(random_ops), region=self, written=tuple(others_at.index(i) for i in self.mutated),
            options=options, recompute_batched=_why_batched_grads_recompute(self.gm),
            creates_graph=any(grad_pass.creates_graph(node) for node in self.gm.graph.nodes))
        # The forward that also returns the grads a create_graph backward asked for
        # (NOTE [Forces at forward time] in region/create_graph.py); None until one has.
        self.with_grads: Program | None = None
        self._with_grads_programs: dict[tuple, Program] = {}
        # AOTAutograd's node in the caller's graph (NOTE [AOTAutograd's node in the
        # caller's graph]): learnt on the first call through the program's node.
        self.direct: direct.Direct | None = None
        self.direct_learnt = False
        self._logged: set[str] = set()

    def __call__(self, *args: Any) -> Any:
        for i in self.sets_requires_grad:
            args[i].requires_grad_(True)
        if CALLER_ALIASES.active:
            # A program's own call (_ProgramFunction.forward): it differentiates the result.
            CALLER_ALIASES.active = False
            return self.compiled(*args)
        reason = why_run_eagerly(args)
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
                self.with_grads.failed, self.with_grads = f"{type(e).__name__}: {e}", None
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

    def learn_grads_at_forward(self, out_grads, needed) -> Program | None:
        """At a create_graph backward that one output of one element received: compute
        those grads in the forward from now on (NOTE [Forces at forward time] in
        region/create_graph.py).  The program for them, or None where none applies; one per
        output and set of grads, kept, so that learning them again compiles nothing."""
        if len(out_grads) != 1 or out_grads[0][1].numel() != 1:
            return None
        (index, _), = out_grads
        key = (index, needed)
        program = self._with_grads_programs.get(key)
        if program is not None and program.failed:
            return None
        if program is None:
            program = self._with_grads_programs[key] = Program(
                with_grads_of(self.program.python, index, needed), self.program.recompile, "forward_with_grads",
                linear=(index, needed, self.n_outputs), written=self.program.written, options=self.program.options,
                recompute_batched=self.program.recompute_batched, creates_graph=True)
        program.missed = False
        self.with_grads = program
        return program

    def learn_direct(self, outs: Sequence[Any], diff: Sequence[int], leaves: Sequence[torch.Tensor],
                     others: Sequence[Any]) -> None:
        """After the first call through the program's node: return AOTAutograd's outputs
        from now on where its node alone made them from the graph's arguments
        (NOTE [AOTAutograd's node in the caller's graph] in region/direct.py)."""
        self.direct_learnt = True
        self.direct = direct.learn(self, outs, diff, leaves, others)

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
# The recomputing batched path, the vjp and the eager paths recompute the forward
# from the call's arguments.  A graph that writes an input in place (a BatchNorm's running
# statistics in training mode) would write it again on every recompute -- the
# statistics updated twice per step -- and a graph that reads what it writes
# would recompute from the written value.  So a region whose graph writes
# inputs (AOTAutograd's metadata, at compile time) copies those inputs before
# each call, and its recomputes take the copies: they read what the forward
# read, and write only to the copies.  The forward itself writes the real
# inputs once, as eager does.  The copies are saved for backward (by the
# program's node, or with their versions on AOTAutograd's node), and a
# recompute writes what it takes: a compiled vjp that wrote the copies bumped
# their versions, and the next backward through the same node -- a second
# derivative whose cotangent depends on the outputs, a retained graph -- raised
# autograd's "modified by an inplace operation".  So each recompute takes fresh
# copies of the ones the graph writes (``Program.written``), and a vjp's node
# saves the unwritten copies for its own recomputes: what is saved is never
# written, and every order of derivative reads what the forward read.

def _why_batched_grads_recompute(gm: torch.fx.GraphModule) -> str | None:
    """Why a batched backward from outside must recompute the graph rather than run
    AOTAutograd's backward over its saved activations, or None.  A grad inside that eagerly
    frees the graph it consumed (NOTE [A grad that consumes returned tensors] in capture/grad_calls.py):
    eager's backward through that graph raises, and so does the recompute (its eager re-run);
    the saved activations, kept by the retained graph, would answer."""
    if any(grad_pass.frees_its_graph(node) for node in gm.graph.nodes):
        return "a grad inside it frees the graph it differentiates, as eager's would"
    return None


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
