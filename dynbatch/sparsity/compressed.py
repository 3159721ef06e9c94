"""``dynbatch.hessian`` and ``dynbatch.jacobian``: one batched grad per colour, not per row.

NOTE [Compressed batched grads]
A Hessian with p colours is p Hessian-vector products, H S with S's column c the sum of
the unit vectors of colour c: one batched grad through dynbatch's compiled backward
with B = p (symbolic, so a new pattern with a new count compiles nothing), where the
dense Hessian takes B = n.  Each entry H[i, j] of the pattern is then read from
(H S)[i, colour(j)] when no other column of row i has j's colour, else from (H S)[j,
colour(i)] (symmetry; the star colouring guarantees one of them).  A Jacobian colours
its rows (a partial distance-2 colouring) and reads J[i, j] from (S^T J)[colour(i), j].
Which entries to read is checked before anything is computed: a pattern or colouring
that leaves an entry ambiguous makes the call dense, logged, never a wrong value.

A plan (pattern, colouring, what to read) is cached by what the pattern depends on.
Where the function's aten trace computes no integer tensor and reads no value into
Python, that is the inputs' shapes and integer contents: a call with the same neighbour
list costs a digest of it (1.5 ms for 62,581 pairs).  Otherwise (a cutoff's ``nonzero``,
SchNet's ``int(batch.max())``) the function is traced again at every call (40-50 ms
for a 2,000-atom pair energy) and the plan keyed by the trace's code and every integer
tensor in it, so pairs moved by the positions recolour and the same pairs do not.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from .. import _compat
from ..capture.requires_grad_tracing import program_input
from ..cpu import native_gemm
from ..records import STATS
from . import colouring
from .pattern import Pattern, jacobian_pattern

log = logging.getLogger("dynbatch")

# Compress only where the colours are fewer than the rows by this factor.
MARGIN = 2.0


@dataclass
class _Plan:
    """How to compute one derivative from p products, found once per pattern."""

    colour: torch.Tensor  # per column (Hessian) or row (Jacobian)
    colours: int
    rows: torch.Tensor  # the pattern's entries
    cols: torch.Tensor
    read_row: torch.Tensor  # entry k = products[read_colour[k], read_row[k]]
    read_colour: torch.Tensor
    crow: torch.Tensor  # the pattern as CSR, for layout=torch.sparse_csr
    n_rows: int
    n_cols: int
    out_shape: tuple[int, ...]  # the dense result's leading dims
    no_rule: tuple[str, ...] = ()  # ops the pattern met without a rule (depending on everything)

    @property
    def flat(self) -> torch.Tensor:
        return self.rows * self.n_cols + self.cols

    def on(self, device: torch.device) -> _Plan:
        """The plan's index tensors on ``device`` (found on the CPU; moved once per device)."""
        if device.type == "cpu":
            return self
        moved = self.__dict__.setdefault("_moved", {})
        if device not in moved:
            moved[device] = dataclasses.replace(self, **{
                f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)})
        return moved[device]


_PLANS: dict[tuple, _Plan | None] = {}
_PROGRAMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def clear_caches() -> None:
    """Forget every plan and products program (``dynbatch.reset()``)."""
    _PLANS.clear()
    _BY_INPUTS.clear()
    _PROGRAMS.clear()


def hessian(f: Callable[..., torch.Tensor], x: torch.Tensor, *args: Any, layout: torch.layout = torch.strided,
            sparse: bool | str = "auto", process_group: Any = None,
            options: dict[str, Any] | None = None) -> torch.Tensor:
    """The Hessian of the scalar ``f(x, *args)`` w.r.t. ``x``: as
    ``torch.autograd.functional.hessian(lambda x: f(x, *args), x)`` (shape ``x.shape * 2``)
    for ``layout=torch.strided``, or an ``[x.numel(), x.numel()]`` CSR tensor for
    ``layout=torch.sparse_csr``.  ``sparse``: "auto" compresses where the colours are
    fewer than half the rows, True always, False never (dense rows, B = x.numel()).
    ``process_group`` (a ``torch.distributed`` group, or True for the default one): each
    rank computes its share of the products, every rank gets the whole result."""
    return _derivative("hessian", f, x, args, layout, sparse, options, process_group)


def jacobian(f: Callable[..., torch.Tensor], x: torch.Tensor, *args: Any, layout: torch.layout = torch.strided,
             sparse: bool | str = "auto", process_group: Any = None,
             options: dict[str, Any] | None = None) -> torch.Tensor:
    """The Jacobian of ``f(x, *args)`` w.r.t. ``x``: as ``torch.autograd.functional.jacobian``
    (shape ``out.shape + x.shape``), or ``[out.numel(), x.numel()]`` CSR; ``sparse`` and
    ``process_group`` as for hessian."""
    return _derivative("jacobian", f, x, args, layout, sparse, options, process_group)


def _derivative(kind, f, x, args, layout, sparse, options, process_group=None) -> torch.Tensor:
    if layout not in (torch.strided, torch.sparse_csr):
        raise ValueError(f"layout must be torch.strided or torch.sparse_csr, not {layout}")
    if sparse not in (True, False, "auto"):
        raise ValueError(f'sparse must be True, False or "auto", not {sparse!r}')
    group = _group(process_group)
    x = x.detach()
    plan = _plan(kind, f, x, args) if sparse is not False else None
    if plan is not None and sparse == "auto" and plan.colours * MARGIN > plan.n_cols:
        log.info("dynbatch: %s of %s computed dense: %d colours for %d rows%s", kind, _name(f), plan.colours,
                 plan.n_cols, f" (no sparsity rule for {', '.join(plan.no_rule)})" if plan.no_rule else "")
        plan = None
    if plan is None and sparse is True:
        log.warning("dynbatch: %s of %s computed dense: no usable pattern or colouring", kind, _name(f))
    products_of = _programs(f, options)[kind]
    if plan is None:
        STATS.counters["grads_dense_rows"] += 1
        out_shape, eye = _dense_rows(kind, f, x, args)
        dense = _products(products_of, x, eye, args, group)  # [rows, n] (Jacobian: [m, n]; Hessian: [n, n])
        if layout == torch.sparse_csr:
            return dense.to_sparse_csr()
        return dense.reshape(*out_shape, *x.shape)
    STATS.counters["grads_compressed"] += 1
    STATS.counters["colours"] += plan.colours
    STATS.counters["rows"] += plan.n_rows
    plan = plan.on(x.device)
    products = _products(products_of, x, _seeds(kind, plan, x), args, group)
    values = products[plan.read_colour, plan.read_row]
    if layout == torch.sparse_csr:
        return torch.sparse_csr_tensor(plan.crow, plan.cols, values, (plan.n_rows, plan.n_cols), check_invariants=False)
    dense = values.new_empty(plan.n_rows * plan.n_cols)
    if dense.device.type == "cpu":  # fresh pages faulted 2 MiB at a time: half the time at 288 MB
        native_gemm.advise_huge_pages(dense)
    dense.zero_()[plan.flat] = values  # one flat index: a third of the time of (rows, cols)
    return dense.reshape(*plan.out_shape, *x.shape)


# --- the products: dynbatch's compiled batched grads -------------------------------------

def _group(process_group: Any) -> Any:
    if process_group is None or process_group is False:
        return None
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("process_group given, but torch.distributed is not initialised")
    return dist.group.WORLD if process_group is True else process_group


def _products(products_of, x, seeds, args, group) -> torch.Tensor:
    """One row per seed: the batched grad of them all, or, across a process group, of
    this rank's share (seeds r, r + W, ...), the ranks' shares summed into every rank."""
    if group is None:
        _compat.mark_batch_dynamic(seeds)  # B symbolic from the first compile: a colour count is a B
        return products_of(program_input(x), seeds, *args).reshape(seeds.shape[0], -1)
    import torch.distributed as dist

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    mine = torch.arange(rank, seeds.shape[0], world, device=seeds.device)
    full = x.new_zeros(seeds.shape[0], x.numel())
    if mine.numel():
        part = seeds[mine]
        _compat.mark_batch_dynamic(part)
        full[mine] = products_of(program_input(x), part, *args).reshape(mine.numel(), -1)
    STATS.counters["products_here"] += mine.numel()
    dist.all_reduce(full, group=group)
    return full


def _programs(f, options) -> dict[str, Callable]:
    # The products are batched grads over seeds: never compressed again (sparsity/rewrite.py).
    options = {**(options or {}), "dynbatch.sparse": False}
    key = tuple(sorted(options.items()))
    per_f = _PROGRAMS.setdefault(f, {}) if _weakrefable(f) else {}
    if key in per_f:
        return per_f[key]

    # The leaf as NOTE [Leaves of dynbatch's programs] has it: made inside (2.12+), or given.
    def hessian_products(x, seeds, *args):
        x = x if x.requires_grad else x.detach().requires_grad_()
        (g,) = torch.autograd.grad(f(x, *args), x, create_graph=True)
        return torch.autograd.grad(g, x, seeds, is_grads_batched=True)[0]

    def jacobian_products(x, seeds, *args):
        x = x if x.requires_grad else x.detach().requires_grad_()
        return torch.autograd.grad(f(x, *args), x, seeds, is_grads_batched=True)[0]

    compiled = {"hessian": torch.compile(hessian_products, backend="dynbatch", options=options),
                "jacobian": torch.compile(jacobian_products, backend="dynbatch", options=options)}
    per_f[key] = compiled
    return compiled


def _weakrefable(f) -> bool:
    """Whether ``f`` can key a WeakKeyDictionary (a dataclass with ``eq`` is unhashable)."""
    try:
        weakref.ref(f)
        hash(f)
    except TypeError:
        return False
    return True


def _dense_rows(kind, f, x, args) -> tuple[tuple[int, ...], torch.Tensor]:
    """The result's leading shape and the identity over it (the dense rows' seeds)."""
    if kind == "hessian":
        shape = tuple(x.shape)
    else:
        shape = tuple(f(x, *args).shape)  # with grads as the caller has them: f may take some
    numel = int(torch.Size(shape).numel())
    return shape, torch.eye(numel, dtype=x.dtype, device=x.device).reshape(numel, *shape)


def _seeds(kind, plan: _Plan, x) -> torch.Tensor:
    """S: one row per colour, 1 at the columns (Hessian) or rows (Jacobian) of that colour."""
    seeds = torch.zeros(plan.colours, plan.colour.numel(), dtype=x.dtype, device=x.device)
    seeds[plan.colour, torch.arange(plan.colour.numel(), device=x.device)] = 1
    return seeds.reshape(plan.colours, *(x.shape if kind == "hessian" else plan.out_shape))


# --- the plan: pattern, colouring, what to read -------------------------------------------

def _plan(kind, f, x, args) -> _Plan | None:
    if not colouring.available():
        return None
    # A function whose trace reads no value into Python and computes no integer tensor
    # has the same pattern wherever its inputs' shapes and integer contents are the same.
    by_inputs = _BY_INPUTS.setdefault(f, {}) if _weakrefable(f) else {}
    inputs_key = (kind, *_input_key(x, args))
    if inputs_key in by_inputs:
        return by_inputs[inputs_key]
    try:
        gm, traced_args = _trace(kind, f, x, args)
        STATS.counters["sparse_traces"] += 1
    except Exception as e:  # noqa: BLE001 - a function we cannot trace is computed dense
        log.info("dynbatch: %s of %s not traced for its pattern (%s): dense", kind, _name(f), e)
        return None
    key = (kind, gm.code, tuple((tuple(a.shape), a.dtype) for a in traced_args if isinstance(a, torch.Tensor)),
           _integer_digest(gm, traced_args))
    if key not in _PLANS:
        _PLANS[key] = _new_plan(kind, gm, traced_args, f)
        STATS.counters["sparse_plans"] += 1
    if _pattern_follows_inputs(gm):
        by_inputs[inputs_key] = _PLANS[key]
    return _PLANS[key]


_BY_INPUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

# Ops by which a trace reads a tensor's value into Python (control flow may follow it).
_READS_VALUES = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default,
                 torch.ops.aten.equal.default}


def _input_key(x, args) -> tuple:
    digest = hashlib.blake2b(digest_size=16)
    shapes = []
    for a in (x, *args):
        if isinstance(a, torch.Tensor):
            shapes.append((tuple(a.shape), a.dtype, a.device.type))
            if not (a.dtype.is_floating_point or a.dtype.is_complex):
                digest.update(a.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        else:
            shapes.append(repr(a))
    return tuple(shapes), digest.hexdigest()


def _pattern_follows_inputs(gm: torch.fx.GraphModule) -> bool:
    """No value read into Python, no integer tensor computed: the pattern is the inputs'."""
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in _READS_VALUES:
            return False
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and not (val.dtype.is_floating_point or val.dtype.is_complex):
            return False
    return True


def _trace(kind, f, x, args):
    def hessian_row_function(x, *args):
        x = x.detach().requires_grad_()
        return torch.autograd.grad(f(x, *args), x)[0]

    fn = hessian_row_function if kind == "hessian" else f
    cpu_args = [a.cpu() if isinstance(a, torch.Tensor) else a for a in (x, *args)]
    # A value read into Python (``.item()``, ``int(t.max())``) is traced as the call's: the
    # plan of such a trace is found again at every call (_pattern_follows_inputs).
    gm = make_fx(fn, _error_on_data_dependent_ops=False)(*cpu_args)
    if _writes_in_place(gm):
        # Functionalized (the grad is traced first: functorch refuses requires_grad_() under
        # functionalize): a write in place would change a tensor after nodes that read it
        # (a view taken before) were given its pattern, and the pattern would miss entries.
        gm = make_fx(torch.func.functionalize(gm, remove="mutations"), _error_on_data_dependent_ops=False)(*cpu_args)
        if _writes_in_place(gm):
            raise RuntimeError("the trace writes in place after functionalization")
    return gm, cpu_args


def _writes_in_place(gm: torch.fx.GraphModule) -> bool:
    return any(n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable
               for n in gm.graph.nodes)


def _integer_digest(gm: torch.fx.GraphModule, args: list[Any]) -> str:
    """A digest of every integer and boolean tensor the graph computes at ``args``."""
    digest = hashlib.blake2b(digest_size=16)

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n):
            value = super().run_node(n)
            if isinstance(value, torch.Tensor) and not (value.dtype.is_floating_point or value.dtype.is_complex):
                digest.update(str(tuple(value.shape)).encode())
                digest.update(value.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
            return value

    with torch.no_grad():
        Recorder(gm).run(*args)
    return digest.hexdigest()


def _new_plan(kind, gm, args, f) -> _Plan | None:
    try:
        pattern = jacobian_pattern(gm, args, wrt=0)
        if kind == "hessian":
            pattern = dataclasses.replace(_symmetric_with_diagonal(pattern), no_rule=pattern.no_rule)
            colour = colouring.star_colouring(pattern)
        else:
            colour = colouring.row_colouring(pattern)
    except Exception as e:  # noqa: BLE001 - PatternTooDense, or a rule that could not read its op: dense
        log.info("dynbatch: %s of %s: no sparse plan (%s): dense", kind, _name(f), e)
        return None
    rows, cols = pattern.to_coo()
    if kind == "jacobian":
        # S^T J: entry (i, j) is product colour(i) at column j, if no other row of i's colour has j.
        read_row, read_colour = cols, colour[rows]
        keys = read_colour * pattern.n + cols
        unique = _count(keys)[keys] == 1
    else:
        # H S: entry (i, j) is product colour(j) at row i, if no other column of row i has j's colour.
        p = int(colour.max()) + 1 if colour.numel() else 0
        counts = _count(rows * p + colour[cols], pattern.m * p)
        direct = counts[rows * p + colour[cols]] == 1
        mirrored = counts[cols * p + colour[rows]] == 1
        unique = direct | mirrored
        read_row = torch.where(direct, rows, cols)
        read_colour = torch.where(direct, colour[cols], colour[rows])
    if not bool(unique.all()):
        log.warning("dynbatch: %s of %s: the colouring leaves %d entries ambiguous: dense", kind, _name(f),
                    int((~unique).sum()))
        return None
    colours = int(colour.max()) + 1 if colour.numel() else 1
    out_shape = tuple(args[0].shape) if kind == "hessian" else tuple(_output(gm, args).shape)
    return _Plan(colour, colours, rows, cols, read_row, read_colour, pattern.crow, pattern.m, pattern.n, out_shape,
                 pattern.no_rule)


def _output(gm, args) -> torch.Tensor:
    with torch.no_grad():
        return gm(*args)


def _count(keys: torch.Tensor, size: int | None = None) -> torch.Tensor:
    return torch.bincount(keys, minlength=size or (int(keys.max()) + 1 if keys.numel() else 0))


def _symmetric_with_diagonal(pattern: Pattern) -> Pattern:
    """A Hessian's pattern: symmetric, its diagonal in (H[i, i] may be zero; it costs nothing)."""
    rows, cols = pattern.to_coo()
    diag = torch.arange(pattern.n)
    return Pattern.from_coo(torch.cat([rows, cols, diag]), torch.cat([cols, rows, diag]), pattern.n, pattern.n)


def _name(f) -> str:
    return getattr(f, "__qualname__", None) or type(f).__name__
