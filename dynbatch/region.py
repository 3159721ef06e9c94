"""The edge of the compiled region: what a grad taken *outside* a dynbatch graph gets.

AOTAutograd's compiled backward is first-order and unbatched.  Called with
``create_graph=True`` it returns grads that depend on nothing when none of its
saved tensors requires grad, and ``functional.hessian`` reads that as zeros;
called with batched grad_outputs (``is_grads_batched``, ``jacobian(vectorize=True)``,
``vmap`` over a vjp) its Inductor kernels receive BatchedTensors ("Cannot access
data pointer of Tensor that doesn't have storage"); and a region called with
forward-mode dual tensors drops their tangents.  See NOTE [Region backward].

NOTE [Region backward]
Each dynbatch graph that autograd can differentiate is called through
``_RegionFunction``: its forward runs the compiled graph on detached aliases of
the differentiable inputs with grad enabled, so AOTAutograd's own backward
hangs off those aliases (the "inner graph", kept alive by saved tensors, so
``retain_graph`` works and is freed with the outer node).  Its backward picks a
path by what it receives:

- plain grads: AOTAutograd's compiled backward (the inner graph);
- batched grads from eager's ``is_grads_batched`` (the legacy vmap): the
  batch dim is unwrapped, and a dynbatch-compiled batched backward of the same
  graph (recompute the forward, one vmapped backward, B symbolic) runs once;
- ``create_graph=True``, or batched grads from ``torch.func.vmap``: the
  captured Dynamo graph is re-run eagerly on the saved inputs and
  differentiated with eager's autograd (correct to any order; logged);
- a graph that draws random numbers cannot be re-run (a recompute redraws
  them): batched grads loop over the inner graph per sample, and
  ``create_graph=True`` raises an error that says so.

Regions whose graph mutates an input that requires grad keep AOTAutograd's
own autograd (it rebases the input's history, which a detached alias cannot);
there, only the plain path exists and the others raise.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import torch
import torch.fx

from . import _compat
from .records import STATS

log = logging.getLogger("dynbatch")

# Counter names (dynbatch.counters()): which path a backward from outside took.
PLAIN, BATCHED, EAGER, LOOP = (
    "outside_plain", "outside_batched_compiled", "outside_eager", "outside_per_sample")
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
    ) -> None:
        # Dynamo's graph: re-run eagerly, or traced again for a batched backward.
        self.gm = _compat.realized_graph_module(gm)
        self.compiled = compiled
        self.diff_args = tuple(
            i for i, a in enumerate(example_inputs)
            if isinstance(a, torch.Tensor) and a.requires_grad and torch.is_grad_enabled()
        )
        self.is_input = tuple(i in self.diff_args for i in range(len(example_inputs)))
        self.n_outputs = _compat.graph_output_count(self.gm)
        self.random_ops = tuple(random_ops)
        self.mutates_differentiable_input = mutates_differentiable_input
        self._recompile = recompile  # fn -> dynbatch-compiled fn, with this graph's options
        self._batched_backwards: dict[tuple[int, ...], Callable] = {}
        self._batched_failed: dict[tuple[int, ...], str] = {}
        self._logged: set[str] = set()

    def __call__(self, *args: Any) -> Any:
        reason = _why_run_eagerly(args)
        if reason is not None:
            self._log_once(reason, "dynbatch: running a compiled graph eagerly: %s", reason)
            STATS.count(EAGER_CALL)
            return self.gm(*args)
        if not self.diff_args:
            return self.compiled(*args)
        if self.mutates_differentiable_input:
            return _first_order_only(self, self.compiled(*args))
        return _RegionFunction.apply(self, *args)

    # --- the backward paths (NOTE [Region backward]) ---------------------------------

    def recompute_backward(self, inputs, others, out_grads, *, create_graph: bool):
        """Re-run the captured graph eagerly and differentiate it: eager's answer."""
        if self.random_ops:
            raise RuntimeError(
                "dynbatch: this compiled graph draws random numbers "
                f"({', '.join(self.random_ops)}), so its backward cannot be re-run to give a "
                "differentiable (create_graph=True) or vmapped gradient; compute this grad "
                "outside torch.compile, or make the random op deterministic (e.g. eval mode)")
        # Differentiating w.r.t. the saved inputs themselves stops at them; no
        # detached copy (requires_grad_() is refused under torch.func transforms).
        with torch.enable_grad():
            outs = self.gm(*_merge(self.is_input, inputs, others))
            pairs = [(outs[i], g) for i, g in out_grads]
            return torch.autograd.grad([o for o, _ in pairs], inputs, [g for _, g in pairs],
                                       create_graph=create_graph, allow_unused=True)

    def batched_backward(self, inputs, others, out_grads):
        """One dynbatch-compiled batched backward of this graph; physical [B, ...] grads."""
        key = tuple(i for i, _ in out_grads)
        fn = self._batched_backwards.get(key)
        if fn is None:
            receives = tuple(i in key for i in range(self.n_outputs))
            fn = self._batched_backwards[key] = self._recompile(
                _batched_backward_of(self.gm, self.is_input, receives))
        # Detached inputs that do not require grad make the batched backward an
        # inference graph (no second autograd layer around it) where Dynamo can
        # trace requires_grad_() inside it (torch 2.12+).
        leaf = (lambda t: t.detach()) if _compat.DYNAMO_TRACES_REQUIRES_GRAD_ else (
            lambda t: t.detach().requires_grad_())
        with torch.enable_grad():
            return fn([leaf(t) for t in inputs], list(others), [g for _, g in out_grads])

    def _log_once(self, key: str, msg: str, *args: Any) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.info(msg, *args)


def _batched_backward_of(gm: torch.fx.GraphModule, is_input: tuple[bool, ...], receives: tuple[bool, ...]):
    """The function dynbatch compiles for a batched backward of ``gm``.

    Dynamo caches compiled code per code object: each region gets a code
    object of its own, so regions neither share a cache (and its recompile
    limit) nor make each other's closure values symbolic.  The closure holds
    masks of bools, which Dynamo keeps as constants in any case (closure ints
    that differ between calls become SymInts, which it mis-traced in ``in``
    tests and indexing).
    """
    def batched_backward(inputs, others, cotangents):
        inputs = [t if t.requires_grad else t.detach().requires_grad_() for t in inputs]
        outs = gm(*_merge(is_input, inputs, others))
        return torch.autograd.grad([o for o, r in zip(outs, receives) if r], inputs, cotangents,
                                   is_grads_batched=True, allow_unused=True)

    _batched_backward_of.made += 1
    batched_backward.__code__ = batched_backward.__code__.replace(
        co_name=f"batched_backward_{_batched_backward_of.made}")
    return batched_backward


_batched_backward_of.made = 0


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
    if _compat.legacy_vmap_level() > 0 and any(
            isinstance(a, torch.Tensor) and _compat.is_legacy_batched(a) for a in args):
        return "an input is batched by eager's vmap (is_grads_batched / vectorize=True)"
    return None


class _RegionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, region: Region, *args: Any) -> tuple[Any, ...]:  # type: ignore[override]
        inner_args = list(args)
        for i in region.diff_args:
            inner_args[i] = args[i].detach().requires_grad_()
        with torch.enable_grad():
            outs = tuple(region.compiled(*inner_args))
        diff_outs = tuple(i for i, o in enumerate(outs) if isinstance(o, torch.Tensor) and o.requires_grad)
        others = [a for i, a in enumerate(args) if i not in region.diff_args]
        ctx.region, ctx.n_args, ctx.diff_outs = region, len(args), diff_outs
        ctx.n_diff = len(region.diff_args)
        ctx.other_tensor_idx = [k for k, a in enumerate(others) if isinstance(a, torch.Tensor)]
        ctx.others = [None if isinstance(a, torch.Tensor) else a for a in others]
        # Saved, not kept on ctx: autograd frees them (and with them the inner graph)
        # when this node is released, and checks them for in-place changes.
        ctx.save_for_backward(
            *(args[i] for i in region.diff_args),
            *(inner_args[i] for i in region.diff_args),
            *(outs[i] for i in diff_outs),
            *(others[k] for k in ctx.other_tensor_idx),
        )
        ctx.set_materialize_grads(False)
        result = tuple(o.detach() if i in diff_outs else o for i, o in enumerate(outs))
        ctx.mark_non_differentiable(*(o for i, o in enumerate(result)
                                      if isinstance(o, torch.Tensor) and i not in diff_outs))
        return result

    @staticmethod
    @_compat.dynamo_disable
    def backward(ctx, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        region, n = ctx.region, ctx.n_diff
        saved = ctx.saved_tensors
        originals, aliases = saved[:n], saved[n:2 * n]
        inner_outs = saved[2 * n:2 * n + len(ctx.diff_outs)]
        others = list(ctx.others)
        for k, t in zip(ctx.other_tensor_idx, saved[2 * n + len(ctx.diff_outs):]):
            others[k] = t
        out_grads = [(i, grads[i]) for i in ctx.diff_outs if grads[i] is not None]
        if not out_grads:
            return (None,) * (1 + ctx.n_args)
        input_grads = _dispatch_backward(region, originals, aliases, others, inner_outs,
                                         ctx.diff_outs, out_grads)
        result: list[torch.Tensor | None] = [None] * ctx.n_args
        for i, g in zip(region.diff_args, input_grads):
            result[i] = g
        return (None, *result)


def _dispatch_backward(region, originals, aliases, others, inner_outs, diff_outs, out_grads):
    """Pick the path for one backward call (NOTE [Region backward])."""
    inner = dict(zip(diff_outs, inner_outs))
    batching = _compat.batching_of([g for _, g in out_grads])
    if torch.is_grad_enabled():
        region._log_once("create_graph", "dynbatch: create_graph=True through a compiled graph: "
                         "re-running it eagerly for a differentiable backward")
        STATS.count(EAGER)
        return region.recompute_backward(originals, others, out_grads, create_graph=True)
    def inner_backward(grads):
        # retain_graph=True: the user's retain_graph is unknown here, so the inner graph
        # is freed with this node instead.  AOTAutograd checks its *global* donated_buffer
        # config when a backward retains the graph; dynbatch compiled this graph with
        # donated buffers off (lowering.py), so the check does not apply to it.
        with _compat.aot_config_patch(donated_buffer=False):
            return torch.autograd.grad([inner[i] for i, _ in out_grads], aliases, grads,
                                       retain_graph=True, allow_unused=True)

    if batching is None:
        STATS.count(PLAIN)
        return inner_backward([g for _, g in out_grads])
    if region.random_ops and batching.kind != "nested":
        STATS.count(LOOP)
        return _per_sample(batching, out_grads, inner_backward)
    if batching.kind == "legacy":
        key = tuple(i for i, _ in out_grads)
        if key not in region._batched_failed:
            try:
                with batching.unwrapped(out_grads) as (physical, _, rewrap):
                    grads = region.batched_backward(originals, others, physical)
                STATS.count(BATCHED)
                return rewrap(grads)
            except Exception as e:  # noqa: BLE001 - the eager path below is always right
                region._batched_failed[key] = f"{type(e).__name__}: {e}"
                log.warning("dynbatch: compiling the batched backward of a compiled graph failed, "
                            "using an eager backward instead: %s", region._batched_failed[key])
    region._log_once("batched", "dynbatch: batched grads through a compiled graph (%s vmap): "
                     "re-running it eagerly for the backward", batching.kind)
    STATS.count(EAGER)
    return region.recompute_backward(originals, others, out_grads, create_graph=False)


def _per_sample(batching, out_grads, grad_fn):
    with batching.unwrapped(out_grads) as (physical, batch_size, rewrap):
        # Eager's vmap refuses B = 0 before any backward runs, so there is a sample.
        per_sample = [grad_fn([g[b] for _, g in physical]) for b in range(batch_size)]
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
        if torch.is_grad_enabled() or _compat.batching_of([g for g in grads if g is not None]):
            raise RuntimeError(
                "dynbatch: this compiled graph mutates an input that requires grad in place, so "
                "its backward is first-order and unbatched only; create_graph=True or batched "
                "grad_outputs need the mutation outside torch.compile")
        return grads

