"""A region's program: its graph as a function of the differentiable inputs and the rest.

``Program(python)`` is ``python(inputs, others) -> outputs``, compiled by dynbatch on
first use; a region's own program is its graph, others are built from it (a vjp, a
batched backward, a forward that also returns grads).  Each call goes through one
autograd node, ``_ProgramFunction``, whose backward is paths.backward
(NOTE [Region backward] in region/edge.py).  A program's backward recomputes its
forward (NOTE [Compiled create_graph]), for the inputs that backward uses only
(NOTE [Only the grads a backward uses]).
"""

from __future__ import annotations

import logging
import threading
import types
from typing import Any, Callable, Sequence

import torch

from .. import _compat
from . import paths
from ..capture import autograd_functions, requires_grad_tracing, traced_aside
from .args import merge, select, spread
from .which_vmap import batching_of

log = logging.getLogger("dynbatch")


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
                 compiled: Callable | None = None, random_ops: tuple[str, ...] = (), region: Any = None,
                 linear: tuple[int, tuple[bool, ...], int] | None = None, written: tuple[int, ...] = (),
                 options: Any = None, recompute_batched: str | None = None, creates_graph: bool = False) -> None:
        self.python, self.name, self.recompile = python, name, recompile
        # The options.Options its graphs compile with (None: unknown): its batched backward from the
        # saved activations compiles with them too (region/saved_backward.py) ...
        self.options = options
        # ... unless this says why its batched backwards must recompute it (then its vjps' too).
        self.recompute_batched = recompute_batched
        # The graph takes create_graph grads itself: off the CPU, its legacy-batched backwards
        # recompute it (NOTE [One path per request] in region/paths.py).
        self.creates_graph = creates_graph
        self._compiled = compiled
        self._code: types.CodeType | None = None  # what Dynamo compiles of it, once asked
        self.random_ops = random_ops
        # Positions in ``others`` that the program writes in place (a BatchNorm's running
        # statistics): a recompute writes fresh copies (NOTE [Recomputes see the inputs as
        # they were] in region/edge.py).
        self.written = written
        self.region = region  # the region.Region whose own graph this is, if any
        # (output, inputs, first grad): the outputs from "first grad" on are that
        # output's grads w.r.t. those inputs for a cotangent of ones.
        self.linear = linear
        # Per input: no grad among those outputs depends on it (region/create_graph.py); None
        # until read.
        self.grads_ignore: tuple[bool, ...] | None = None
        self.missed = False  # a backward did not use those grads
        self.failed: str | None = None  # why compiling it failed, if it did
        self._vjps: dict[tuple, Program] = {}

    @property
    def compiled(self) -> Callable:
        if self._compiled is None:
            own = _own_code(self.python, self.name)
            self._code = own.__code__
            self._compiled = self.recompile(own)
        return self._compiled

    def traced_aside(self) -> bool:
        """Whether its compile is traced aside now (NOTE [Traced aside] in capture/traced_aside.py):
        a call just now ran it eagerly."""
        return traced_aside.running(self._code)

    def vjp(self, receives: tuple[bool, ...], needed: tuple[bool, ...], *, batched: bool = False) -> Program:
        """The program of this one's vjp: cotangents for the outputs in ``receives``,
        grads for the inputs in ``needed``; batched (``is_grads_batched``, the
        cotangents [B, ...]) or differentiable (``create_graph``)."""
        key = (receives, needed, batched)
        if key not in self._vjps:
            self._vjps[key] = Program(_vjp_of(self.python, receives, needed, batched), self.recompile,
                                      "batched_backward" if batched else "vjp", written=self.written,
                                      options=self.options, recompute_batched=self.recompute_batched,
                                      creates_graph=self.creates_graph)
        return self._vjps[key]

    def __call__(self, inputs: Sequence[torch.Tensor], others: Sequence[Any],
                 saved_others: Sequence[Any] | None = None) -> tuple:
        """``saved_others``: what a recompute takes for ``others`` (NOTE [Recomputes see the
        inputs as they were] in region/edge.py); ``others`` themselves by default."""
        return _ProgramFunction.apply(self, len(inputs), saved_others, *inputs, *others)

    def refuse_rerun_if_random(self) -> None:
        if self.random_ops:
            raise RuntimeError(
                "dynbatch: this compiled graph draws random numbers "
                f"({', '.join(self.random_ops)}), so its backward cannot be re-run to give a "
                "differentiable (create_graph=True) or vmapped gradient; compute this grad "
                "outside torch.compile, or make the random op deterministic (e.g. eval mode)")

    def _for_a_recompute(self, others: Sequence[Any]) -> list[Any]:
        """``others`` as a recompute takes them: a fresh copy of each one the program writes,
        so that the tensors a node saved for its backward are never written (NOTE [Recomputes
        see the inputs as they were] in region/edge.py)."""
        return [o.clone() if k in self.written else o for k, o in enumerate(others)]

    def log_once(self, key: str, msg: str, *args: Any) -> None:
        """Once per region at INFO where this is a region's own program, else at DEBUG."""
        if self.region is not None:
            self.region._log_once(key, msg, *args)
        else:
            log.debug(msg, *args)

    def eager_backward(self, inputs, others, out_grads, needed, *, create_graph: bool):
        """Re-run the program eagerly and differentiate it: eager's answer."""
        self.refuse_rerun_if_random()
        # Differentiating w.r.t. the saved inputs themselves stops at them; no
        # detached copy (requires_grad_() is refused under torch.func transforms).
        with torch.enable_grad():
            outs = self.python(inputs, self._for_a_recompute(others))
            grads = torch.autograd.grad([outs[k] for k, _ in out_grads], select(inputs, needed),
                                        [g for _, g in out_grads], create_graph=create_graph, allow_unused=True)
        return spread(grads, needed)

    def compiled_backward(self, inputs, others, out_grads, needed, *, batched: bool):
        """A compiled vjp (differentiable) or batched backward; None where it failed to compile."""
        receives = tuple(any(k == i for i, _ in out_grads) for k in range(_max_out(out_grads)))
        vjp = self.vjp(receives, needed, batched=batched)
        if vjp.failed:
            return None
        cotangents = [g for _, g in out_grads]
        try:
            if not batched:
                # The vjp's own recomputes take ``others`` as they are: never written.
                return spread(vjp([*inputs, *cotangents], self._for_a_recompute(others), others), needed)
            # NOTE [Leaves of dynbatch's programs] in capture/requires_grad_tracing.py
            leaf = requires_grad_tracing.program_input
            with torch.enable_grad():
                return spread(vjp.compiled([*(leaf(t) for t in inputs), *cotangents],
                                           self._for_a_recompute(others)), needed)
        except Exception as e:  # noqa: BLE001 - the eager path is always right
            vjp.failed = f"{type(e).__name__}: {e}"
            log.warning("dynbatch: compiling the %s of a compiled graph failed, using an eager backward "
                        "instead: %s", vjp.name, vjp.failed)
            return None


def _max_out(out_grads) -> int:
    return max(i for i, _ in out_grads) + 1


def graph_program(gm: torch.fx.GraphModule, is_input: tuple[bool, ...]) -> Callable:
    # Dynamo traces it again for the programs built from it (NOTE [Functions differentiate
    # as in eager] in capture/autograd_functions.py).
    gm = autograd_functions.with_functions_applied(gm)

    def region(inputs, others):
        return tuple(gm(*merge(is_input, inputs, others)))

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
        pairs = [(o, c) for o, c in zip(select(outs, receives), cotangents) if o.requires_grad]
        if not pairs:
            return (None,) * sum(needed)
        return torch.autograd.grad([o for o, _ in pairs], select(inputs, needed), [c for _, c in pairs],
                                   is_grads_batched=batched, create_graph=not batched, allow_unused=True)

    return vjp


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
# stand-in; the node's last edge needs no asking where no other is wanted
# (_compat.engine_will_execute_each).  Compiled backwards are cached per set of
# needed inputs.

def _needed(ctx, edges: Sequence[int]) -> tuple[bool, ...]:
    """Which of the node's edges (one per tensor argument of its forward) this
    backward call will use."""
    wanted = _compat.engine_will_execute_each([node for node, _ in ctx.next_functions])
    return tuple(wanted[e] for e in edges)


class _CallerAliases(threading.local):
    """Set while ``_ProgramFunction`` calls a program compiled by Dynamo: the
    region Dynamo hands the call to returns the compiled outputs as they are,
    since the program's own node differentiates them (one autograd layer, not two)."""

    active = False


CALLER_ALIASES = _CallerAliases()


class _ProgramFunction(torch.autograd.Function):
    """A program's outputs, differentiable w.r.t. the caller's tensors.

    Dynamo refuses a grad w.r.t. an input whose history lies outside the frame,
    and AOTAutograd's outputs must not reach the caller's graph directly (their
    backward is first-order and unbatched), so the program runs on leaves that
    alias the inputs; the backward picks a path (NOTE [Region backward] in region/edge.py).
    """

    @staticmethod
    def forward(ctx, program, n_inputs, saved_others, *args):  # type: ignore[override]
        inputs, others = args[:n_inputs], list(args[n_inputs:])
        leaves = [t.detach().requires_grad_(t.requires_grad) for t in inputs]
        CALLER_ALIASES.active = program.region is None
        try:
            with torch.enable_grad():
                outs = tuple(program.compiled(leaves, others))
        finally:
            CALLER_ALIASES.active = False
        diff = tuple(k for k, o in enumerate(outs) if isinstance(o, torch.Tensor) and o.requires_grad)
        ctx.ran_eagerly = program.traced_aside()
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
            return (None, None, None, *(None,) * (n + len(ctx.others)))
        grads_in = paths.backward(program, inputs, leaves, others, inner, out_grads, needed,
                                  forward_grads, ctx.first_grad, ran_eagerly=ctx.ran_eagerly)
        if program.grads_ignore is not None and all(k >= ctx.first_grad for k, _ in out_grads):
            # Eager's None, where AOTAutograd's backward gives zeros (_inputs_the_grads_ignore).
            grads_in = tuple(None if ignored else g for g, ignored in zip(grads_in, program.grads_ignore))
        return (None, None, None, *grads_in, *(None,) * len(ctx.others))
