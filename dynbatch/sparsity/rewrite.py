"""Batched grads over an identity, inside a compiled graph, computed by colours.

NOTE [Identity grads by colours]
``functional.jacobian(f, x, vectorize=True)`` and ``functional.hessian`` (and
``is_grads_batched`` over an eye, and ``torch.vmap`` of a grad over one, once
``grad_pass.batch_vmapped_grads`` has made it a batched grad) reach the backend as one
batched ``torch.autograd.grad`` of the flattened output w.r.t. a leaf made from an
input, with ``create_graph=False``.  That node becomes one opaque op,
``dynbatch::structured_grad``, over the function that computes the output from the leaf
(a subgraph of the captured graph, the tensors it reads from outside as arguments).  At
run time the op checks that its seeds are the identity and asks compressed.py for the
Jacobian (pattern at the call's values, colours, one batched grad per colour, exact);
other seeds take the same compiled batched grad uncompressed.  The op's inputs are
detached: a grad without ``create_graph`` returns tensors without history, as eager's.

NOTE [When colours pay, decided at the first call]
``dynbatch.sparse="auto"`` (the default) rewrites such a grad only where its seeds are
an identity (``new_zeros(n, n).diagonal().fill_(1)`` as ``functional.jacobian`` builds
it, ``torch.eye``, reshaped or not, or an input that is one), it has ``MIN_ROWS`` rows or
more, and the colours of its pattern at the first call's values are fewer than the rows
by ``compressed.MARGIN``: a small or dense Hessian keeps its batched grad fused in the
graph, where the op would only add a program and a thread.  The values are read off the
backend's example inputs (Dynamo hands it the call's real tensors); where the function
reads a tensor the graph computes (a neighbour list taken apart in the compiled
function), nothing is evaluated here, since that could run a random op or a write
twice: the op decides per call instead, as with ``True``.  Either way the choice is only
speed: each call checks its seeds and pattern again, and the values are exact.
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import logging
import operator
import os
import threading
from typing import Any, Sequence

import torch
import torch.fx

from .. import _compat
from ..records import STATS
from . import compressed

log = logging.getLogger("dynbatch")

_FUNCTIONS: dict[int, tuple[str, torch.fx.GraphModule, dict[str, Any] | None]] = {}
_KEYS = itertools.count()

# "auto" leaves a grad of fewer rows fused in its graph: the op's fixed cost per call (a
# thread, the plan's lookup, a program of its own: ~0.25 ms on one core) exceeds what
# the colours save there (a Lennard-Jones Hessian of 81 rows: 0.17 ms fused, 0.43 ms by
# colours; of 375 rows: 3.9 ms fused, 1.8 ms by colours).
MIN_ROWS = 256


@torch.library.custom_op("dynbatch::structured_grad", mutates_args=())
def structured_grad(key: int, seeds: torch.Tensor, x: torch.Tensor, captured: list[torch.Tensor]) -> torch.Tensor:
    kind, fn, options = _FUNCTIONS[key]
    # An op's kernel runs below autograd (its dispatch keys excluded, AOTAutograd's no_grad
    # around a graph without grads), and the derivative this op takes needs autograd: it
    # runs in a thread whose dispatch state is a fresh thread's.  One thread kept for it:
    # starting a thread per call cost ~0.4 ms.  A call made on that thread (a function
    # whose derivative calls another such op) takes a thread of its own.
    work = functools.partial(_structured_grad, kind, fn, options, seeds, x, captured)
    if threading.current_thread().name.startswith(_WORKER):
        return _on_new_thread(work)
    return _worker().submit(work).result()


_WORKER = "dynbatch-structured-grad"
_POOL: list[concurrent.futures.ThreadPoolExecutor] = []


def _worker() -> concurrent.futures.ThreadPoolExecutor:
    if not _POOL:
        _POOL.append(concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=_WORKER))
    return _POOL[0]


# A forked child (a DataLoader worker) has the pool but not its thread: it makes its own.
os.register_at_fork(after_in_child=_POOL.clear)


def _on_new_thread(work):
    result: dict[str, Any] = {}

    def run():
        try:
            result["out"] = work()
        except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
            result["error"] = e

    thread = threading.Thread(target=run, name=_WORKER + "-nested")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["out"]


def _structured_grad(kind, fn, options, seeds, x, captured) -> torch.Tensor:
    rows = seeds.shape[0]
    flat = seeds.reshape(rows, -1)
    if flat.shape[1] == rows and torch.equal(flat, torch.eye(rows, dtype=seeds.dtype, device=seeds.device)):
        derivative = compressed.hessian if kind == "hessian" else compressed.jacobian
        return derivative(fn, x, *captured, options=options).reshape(rows, *x.shape).clone()
    products = compressed._programs(fn, options)[kind]
    if kind == "hessian":  # the seeds are over the grad, flattened in x's order
        seeds = seeds.reshape(rows, *x.shape)
    return compressed._products(products, x, seeds, tuple(captured), None).reshape(rows, *x.shape)


@structured_grad.register_fake
def _(key, seeds, x, captured):
    return seeds.new_empty((seeds.shape[0], *x.shape))


def _as_leaf(t: torch.Tensor) -> torch.Tensor:
    # The products' program hands a leaf in (it differentiates w.r.t. it); the pattern's
    # trace hands a plain tensor, and the function's inner grads need a leaf.
    return t if t.requires_grad else t.detach().requires_grad_()


def compress_identity_grads(gm: torch.fx.GraphModule, options: dict[str, Any] | None,
                            example_inputs: Sequence[Any] | None = None) -> int:
    """Rewrite each batched grad of one output w.r.t. one leaf, without create_graph,
    into ``dynbatch::structured_grad``, in place; the number rewritten.  Given the call's
    ``example_inputs``, only where colours pay at their values (NOTE [When colours pay,
    decided at the first call])."""
    done = 0
    for node in list(gm.graph.find_nodes(op="call_function", target=torch.autograd.grad)):
        try:
            if _rewrite(gm, node, options, example_inputs):
                done += 1
        except Exception as e:  # noqa: BLE001 - a node we cannot rewrite keeps its batched grad
            log.info("dynbatch: %s kept its batched grad (%s: %s)", node, type(e).__name__, e)
    if done:
        gm.graph.lint()
        gm.recompile()
        STATS.counters["grads_structured"] += done
    return done


def _rewrite(gm: torch.fx.GraphModule, grad: torch.fx.Node, options, example_inputs) -> bool:
    kwargs = grad.kwargs
    if not kwargs.get("is_grads_batched") or kwargs.get("create_graph"):
        return False
    outputs, inputs, seeds = (tuple(a) if isinstance(a, (tuple, list)) else (a,) for a in grad.args[:3])
    if not (len(outputs) == len(inputs) == len(seeds) == 1 and all(isinstance(a, torch.fx.Node)
                                                                    for a in (*outputs, *inputs, *seeds))):
        return False
    (out,), (leaf,), (seed,) = outputs, inputs, seeds
    if not (leaf.op == "call_method" and leaf.target == "detach" and leaf.args[0].op == "placeholder"):
        return False
    if not all(u.op == "call_function" and u.target is operator.getitem and u.args[1] == 0 for u in grad.users):
        return False
    energy = _energy_of(out, leaf)
    kind = "hessian" if energy is not None else "jacobian"
    fn, captured = _function_of(gm, leaf, energy if energy is not None else out)
    if example_inputs is not None and not _colours_pay(gm, kind, fn, leaf, seed, captured, example_inputs):
        return False
    key = next(_KEYS)
    _FUNCTIONS[key] = (kind, fn, options)
    with gm.graph.inserting_before(grad):
        x = gm.graph.call_method("detach", (leaf.args[0],))
        args = [gm.graph.call_method("detach", (c,)) for c in captured]
        new = gm.graph.call_function(torch.ops.dynbatch.structured_grad.default, (key, seed, x, args))
    new.meta = dict(next(iter(grad.users)).meta)
    for user in list(grad.users):
        user.replace_all_uses_with(new)
        gm.graph.erase_node(user)
    gm.graph.erase_node(grad)
    return True


_RESHAPES = {"view", "reshape", "flatten", "view_as", "contiguous"}


def _energy_of(out: torch.fx.Node, leaf: torch.fx.Node) -> torch.fx.Node | None:
    """The scalar whose grad w.r.t. ``leaf`` ``out`` is, in x's element order (reshapes,
    a one-tensor stack, the grad's only result), or None: then ``out`` is a Jacobian's."""
    n = out
    while True:
        if n.op == "call_method" and n.target in _RESHAPES:
            n = n.args[0]
        elif n.op == "call_function" and n.target is torch.stack and len(n.args[0]) == 1:
            n = n.args[0][0]
        elif n.op == "call_function" and n.target is operator.getitem and n.args[1] == 0:
            n = n.args[0]
            break
        else:
            return None
    if not (n.op == "call_function" and n.target is torch.autograd.grad and not n.kwargs.get("is_grads_batched")):
        return None
    outputs, inputs = (tuple(a) if isinstance(a, (tuple, list)) else (a,) for a in n.args[:2])
    if len(outputs) != 1 or len(inputs) != 1:
        return None
    wrt = inputs[0]
    while wrt is not leaf and wrt.op == "call_method" and wrt.target in _RESHAPES:
        wrt = wrt.args[0]
    value = outputs[0].meta.get("example_value")
    if wrt is not leaf or not isinstance(value, torch.Tensor) or value.numel() != 1:
        return None
    return outputs[0]


def _function_of(gm: torch.fx.GraphModule, leaf: torch.fx.Node, out: torch.fx.Node):
    """The subgraph from ``leaf`` to ``out`` as a module ``f(x, *captured)``, and the nodes
    it reads from outside (none of which depends on the leaf)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    ancestors, stack = set(), [out]
    while stack:
        n = stack.pop()
        if n in ancestors:
            continue
        ancestors.add(n)
        stack.extend(n.all_input_nodes)
    descendants, stack = set(), [leaf]
    while stack:
        n = stack.pop()
        if n in descendants:
            continue
        descendants.add(n)
        stack.extend(n.users)
    body = sorted((ancestors & descendants) - {leaf}, key=order.__getitem__)
    captured = sorted({a for n in body for a in n.all_input_nodes if a not in descendants}, key=order.__getitem__)
    for c in captured:
        if not isinstance(c.meta.get("example_value"), torch.Tensor):
            raise ValueError(f"the function reads {c}, which is not a tensor")
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    env = {c: graph.placeholder(f"captured_{i}") for i, c in enumerate(captured)}
    env[leaf] = graph.call_function(_as_leaf, (x,))
    for n in body:
        env[n] = graph.node_copy(n, env.__getitem__)
    graph.output(env[out])
    return torch.fx.GraphModule(gm, graph), captured


# --- "auto": whether colours pay, at the first call's values ------------------------------

def _colours_pay(gm, kind, fn, leaf, seed, captured, example_inputs) -> bool:
    """NOTE [When colours pay, decided at the first call]."""
    values = _input_values(gm, example_inputs)
    if not _is_identity(seed, values):
        log.info("dynbatch: %s kept its batched grad: its seeds are not an identity", seed)
        return False
    seeds = seed.meta.get("example_value")
    rows = _compat.size_hint(seeds.shape[0]) if isinstance(seeds, torch.Tensor) and seeds.dim() else None  # no guard
    if rows is not None and rows < MIN_ROWS:
        log.info("dynbatch: the %s over %s kept its batched grad: %d rows", kind, leaf.args[0], rows)
        STATS.counters["grads_identity_dense"] += 1
        return False
    read = [values.get(n) for n in (leaf.args[0], *captured)]
    if any(not isinstance(v, torch.Tensor) or _compat.is_fake(v) for v in read):
        return True  # it reads what the graph computes: the op decides per call
    x, *args = read
    with _compat.real_tensors():
        plan = compressed._plan(kind, fn, x.detach(), args)
    if plan is None or plan.colours * compressed.MARGIN > plan.n_cols:
        log.info("dynbatch: the %s over %s kept its batched grad: %s%s", kind, leaf.args[0],
                 f"{plan.colours} colours for {plan.n_cols} rows" if plan else "no sparse plan",
                 f" (no sparsity rule for {', '.join(plan.no_rule)})" if plan and plan.no_rule else "")
        STATS.counters["grads_identity_dense"] += 1
        return False
    return True


def _input_values(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> dict[torch.fx.Node, Any]:
    """The graph's placeholders and attributes at the call's values."""
    values: dict[torch.fx.Node, Any] = dict(zip(gm.graph.find_nodes(op="placeholder"), example_inputs))
    for n in gm.graph.find_nodes(op="get_attr"):
        values[n] = operator.attrgetter(n.target)(gm)
    return values


def _is_identity(seed: torch.fx.Node, values: dict[torch.fx.Node, Any]) -> bool:
    """Whether the seeds are an identity: an input equal to one, ``torch.eye(n)``, or
    ``new_zeros(n, n)`` whose only write is ``diagonal().fill_(1)`` (functional.jacobian's)."""
    if seed in values:
        v = values[seed]
        if not isinstance(v, torch.Tensor) or _compat.is_fake(v) or v.dim() < 1:
            return False
        flat = v.detach().reshape(v.shape[0], -1)
        return flat.shape[0] == flat.shape[1] and torch.equal(flat, torch.eye(flat.shape[0], dtype=v.dtype,
                                                                                device=v.device))
    while seed.op == "call_method" and seed.target in _RESHAPES and seed not in values:
        seed = seed.args[0]  # an eye reshaped to the output's shape (a vmap over it)
    if seed.op == "call_function" and seed.target is torch.eye:
        return len(seed.args) == 1 or (len(seed.args) == 2 and seed.args[0] == seed.args[1])
    if not (seed.op == "call_method" and seed.target == "new_zeros" and len(seed.args) == 3
            and (seed.args[1] is seed.args[2] or isinstance(seed.args[1], int) and seed.args[1] == seed.args[2])):
        return False  # (one size node twice, where the sizes are symbolic)
    writes = [u for u in seed.users if u.op == "call_method" and u.target == "diagonal"]
    others = [u for u in seed.users if u not in writes and u.target is not torch.autograd.grad]
    return len(writes) == 1 and not others and _fills_ones(writes[0])


def _fills_ones(diagonal: torch.fx.Node) -> bool:
    offset = diagonal.args[1] if len(diagonal.args) > 1 else diagonal.kwargs.get("offset", 0)
    return offset == 0 and [(u.op, u.target, tuple(u.args[1:])) for u in diagonal.users] == [
        ("call_method", "fill_", (1,))]
