"""Fuzz: random compiled regions differentiated from outside, against eager.

The random programs of test_fuzz.py (1-12 ops, 1-3 inputs with odd strides,
1-3 outputs, some inputs unused, an output may be an input) are compiled with
dynbatch as a whole -- the region -- and differentiated *outside* it by one of
the APIs users reach for (``API``): plain and retained grads, batched grads,
``create_graph`` and a second derivative of the result (w.r.t. every input, or
w.r.t. the first while the others, like parameters, also require grad), two
force-training steps (``create_graph`` grads of an energy, then a loss's
``backward()``), batched grads with ``create_graph``, batched grads of the first
input alone, ``functional.jacobian/hessian`` with and without
``vectorize``, and torch.func's ``jacrev``/``vmap``-over-vjp.  The same API
applied to the eager program is the oracle.  The property: the same values and
the same Nones, and the region's backward really ran (dynbatch's ``outside_*``
counters moved), so a silently eager result cannot pass.

Examples per run: ``DYNBATCH_OUTSIDE_FUZZ_EXAMPLES`` (default 30; derandomized).
"""

from __future__ import annotations

import os

import torch
import torch.autograd.functional as AF
from hypothesis import HealthCheck, given, settings

import dynbatch
from conftest import FALLBACK, assert_same_grads, compile_dynbatch, reset_all
from test_fuzz import Program, programs

EXAMPLES = int(os.environ.get("DYNBATCH_OUTSIDE_FUZZ_EXAMPLES", "30"))
grad = torch.autograd.grad


def _weights(outs, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(o.shape, generator=g, dtype=o.dtype) for o in outs]


def _energy(fn, ws):
    """A scalar of the outputs, for Hessians and second derivatives."""
    return lambda *xs: sum((o * w).sum() for o, w in zip(fn(*xs), ws))


def api_plain_retained(fn, xs, p):
    outs = fn(*xs)
    vs = [v[0] for v in p.cotangents(outs)]
    first = grad(outs, xs, vs, retain_graph=True, allow_unused=True)
    return first, grad(outs, xs, vs, allow_unused=True)


def api_batched(fn, xs, p):
    outs = fn(*xs)
    return grad(outs, xs, p.cotangents(outs), is_grads_batched=True, allow_unused=True)


def api_create_graph_second_order(fn, xs, p):
    outs = fn(*xs)
    vs = [v[0] for v in p.cotangents(outs)]
    first = grad(outs, xs, vs, create_graph=True, allow_unused=True)
    used = [g for g in first if g is not None and g.requires_grad]
    second = grad(sum((g * g).sum() for g in used), xs, allow_unused=True) if used else ()
    return first, second


def api_batched_create_graph(fn, xs, p):
    outs = fn(*xs)
    first = grad(outs, xs, p.cotangents(outs), is_grads_batched=True, create_graph=True, allow_unused=True)
    used = [g for g in first if g is not None and g.requires_grad]
    second = grad(sum((g * g).sum() for g in used), xs, allow_unused=True) if used else ()
    return first, second


def api_create_graph_wrt_first(fn, xs, p):
    # The other inputs require grad but are not asked for, as a model's parameters
    # are in a force call: only the first input's grads may be computed, and the
    # second derivative reaches every input through them.
    outs = fn(*xs)
    vs = [v[0] for v in p.cotangents(outs)]
    (first,) = grad(outs, xs[0], vs, create_graph=True, allow_unused=True)
    if first is None or not first.requires_grad:
        return (first,), ()
    return (first,), grad((first * first).sum(), xs, allow_unused=True)


def api_batched_wrt_first(fn, xs, p):
    outs = fn(*xs)
    return grad(outs, xs[0], p.cotangents(outs), is_grads_batched=True, allow_unused=True)


def api_force_training(fn, xs, p):
    # Two steps of E, F = -dE/dx0 (create_graph), loss(E, F).backward(): the second
    # step takes the grads the region computed in its forward.
    ws = _weights(fn(*xs), p.seed)
    energy = _energy(fn, ws)
    steps = []
    for _ in range(2):
        for x in xs:
            x.grad = None
        e = energy(*xs)
        (f,) = grad(e, xs[0], create_graph=True, allow_unused=True, materialize_grads=True)
        loss = e + (f * f).sum()
        if loss.requires_grad:
            loss.backward()
        steps.append(tuple(x.grad for x in xs))
    return steps


def api_jacobian(vectorize):
    def run(fn, xs, p):
        return AF.jacobian(fn, tuple(xs), vectorize=vectorize)
    return run


def api_hessian(vectorize):
    def run(fn, xs, p):
        ws = _weights(fn(*xs), p.seed)
        return AF.hessian(_energy(fn, ws), tuple(xs), vectorize=vectorize)
    return run


def api_jacrev(fn, xs, p):
    return torch.func.jacrev(fn, argnums=tuple(range(len(xs))))(*[x.detach() for x in xs])


def api_vmap_vjp(fn, xs, p):
    outs = fn(*xs)
    return torch.func.vmap(lambda *vs: grad(outs, xs, vs, retain_graph=True, allow_unused=True,
                                            materialize_grads=True))(*p.cotangents(outs))


API = {
    "plain_retained": api_plain_retained,
    "batched": api_batched,
    "create_graph_second_order": api_create_graph_second_order,
    "batched_create_graph": api_batched_create_graph,
    "jacobian": api_jacobian(False),
    "jacobian_vectorize": api_jacobian(True),
    "hessian": api_hessian(False),
    "hessian_vectorize": api_hessian(True),
    "jacrev": api_jacrev,
    "vmap_vjp": api_vmap_vjp,
    "create_graph_wrt_first": api_create_graph_wrt_first,
    "batched_wrt_first": api_batched_wrt_first,
    "force_training": api_force_training,
}
# torch.func runs compiled functions eagerly (Dynamo steps aside under functorch
# transforms), so the region's backward is not reached: nothing to count there.
NO_REGION_BACKWARD = {"jacrev"}
WRT_FIRST = {"create_graph_wrt_first", "batched_wrt_first"}
# Eager's batched grads through the region: AOTAutograd's backward batched over the saved
# activations must serve (the compiled recompute is its fallback, not the plan).
COMPILED_BATCHED = {"batched", "jacobian_vectorize", "batched_wrt_first"}
# create_graph=True with plain grads: a compiled vjp (or the grads computed at forward time).
COMPILED_CREATE_GRAPH = {"create_graph_second_order", "create_graph_wrt_first", "force_training", "hessian"}

STATS = {"examples": 0, "calls": 0, **{name: 0 for name in API}}


def check(p: Program, api: str) -> None:
    reset_all()
    fn = p.function()
    # Under torch.func, Dynamo runs the frame eagerly, which fullgraph=True forbids.
    # FALLBACK: that no graph fell back is asserted below, from the counters.
    compiled = compile_dynbatch(fn, fullgraph=api not in NO_REGION_BACKWARD, options=FALLBACK)
    want = API[api](fn, p.make_inputs(), p)
    got = API[api](compiled, p.make_inputs(), p)
    tol = {"rtol": 1e-7, "atol": 1e-7} if p.dtype == "float64" else {"rtol": 1e-3, "atol": 1e-4}
    flat_got, spec_got = torch.utils._pytree.tree_flatten(got)
    flat_want, spec_want = torch.utils._pytree.tree_flatten(want)
    assert spec_got == spec_want, f"{api} {p!r}: structure {spec_got} vs eager {spec_want}"
    assert_same_grads(tuple(flat_got), tuple(flat_want), msg=f"{api} {p!r}", **tol)
    counts = dynbatch.counters()
    assert not counts.get("fallbacks"), counts
    # Grads w.r.t. the first input alone: where no output depends on it, autograd
    # (rightly) never runs the region's backward.
    reaches_region = api not in WRT_FIRST or torch.utils._pytree.tree_leaves(want)[:1] != [None]
    if api not in NO_REGION_BACKWARD and reaches_region:
        assert counts.get("graphs", 0) >= 1, counts
        assert any(k.startswith("outside_") for k in counts), (api, counts)
    if api in COMPILED_BATCHED and reaches_region:
        # the batched backward compiled; the eager path is a fallback, not the plan
        assert counts.get("outside_batched_saved") and not counts.get("outside_eager"), (api, counts)
    if api in COMPILED_CREATE_GRAPH and (counts.get("outside_vjp_compiled") or counts.get("outside_eager")):
        assert not counts.get("outside_eager"), (api, counts)
    STATS["examples"] += 1
    STATS[api] += 1


@settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(programs())
def _fuzz(p: Program) -> None:
    # The API goes round-robin, so every one gets its share of programs (a drawn
    # one is skewed by derandomized search).  float64 keeps the comparison about
    # correctness, not float32 rounding through second derivatives.
    api = sorted(API)[STATS["calls"] % len(API)]
    STATS["calls"] += 1
    check(Program(**{**p.__dict__, "dtype": "float64"}), api)


def test_fuzz_regions_differentiated_from_outside_match_eager():
    for key in STATS:
        STATS[key] = 0
    _fuzz()
    print(f"\noutside fuzz: {STATS['examples']} examples, 0 wrong values; per API: "
          + ", ".join(f"{k} {v}" for k, v in STATS.items() if k in API))
    assert STATS["examples"] >= EXAMPLES * 0.9
