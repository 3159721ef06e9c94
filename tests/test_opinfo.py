"""OpInfo sweep: batched vjp of every differentiable op, compiled with dynbatch.

Modelled on PyTorch's ``test/functorch/test_ops.py::test_vmapvjp``: for each
op in ``op_db`` that supports autograd in the dtype, and each sample input,

    outs = op(sample)                    # differentiable outputs only
    torch.autograd.grad(outs, diff_inputs, V, allow_unused=True, is_grads_batched=True)

is compiled with dynbatch (``inner_compiler="aot_eager"``, ``fullgraph=True``,
``on_unsupported="fallback"``) and compared, value and None-ness, with the
oracle: a stacked loop of eager per-sample ``torch.autograd.grad`` calls.
Three cotangent layouts go through one compiled program (three grad calls on
one forward): contiguous, non-contiguous (stride 2 in the last dim) and
expanded (stride 0 in the batch dim).

Outcomes of a case (``classify``):
  match        batched by dynbatch and equal to the loop
  fallback     dynbatch fell back to eager (counted, logged) and the result
               equals eager ``is_grads_batched=True``
  eager_error  the compiled call raised eager's exception (type and message)
  graph_break  Dynamo itself refused the program under fullgraph=True (and
               without fullgraph the result is eager's)
  stock_compile_fails  the compiled call raises where eager does not, and the
               op's forward alone fails the same way under stock
               torch.compile(backend="aot_eager"): a PyTorch bug
  eager_batched  see its use in ``classify``
  mismatch     anything else: a wrong value, None-ness, or a foreign error
Ops whose cases are not all ``match`` are listed in ``EXPECTED_FAILURES``
with a reason and the outcome(s) they are allowed; a ``mismatch`` is never
allowed.  ``TOLERANCES`` loosens the comparison for ops where a batched
kernel and the per-sample loop legitimately round differently.

Slices:
  default (CI)  every 6th op of op_db (``DYNBATCH_OPINFO_STRIDE``; 1 takes
                all), its first ``DYNBATCH_OPINFO_SAMPLES`` (default 1)
                sample(s), float32: one compiled program holding four batched
                grads (B=3 in the three layouts, and B=1); plus the symbolic-B
                pass (B=2, 5, 8; at most one compile after the first) on the
                first sample of every other one of those ops (every 12th).
  slow          (-m slow) the same two tests for the other ops; every sample (or the first
                ``DYNBATCH_OPINFO_SLOW_SAMPLES``), float32 and float64, B=3 and
                B=1 in all three layouts; and the symbolic-B pass on the first
                ``SYMBOLIC_SLOW_SAMPLES`` samples.
The figures (ops matched / expected failures / mismatches, and cases by
outcome) are printed in the terminal summary, under pytest-xdist merged from
every worker's outcomes; ``DYNBATCH_OPINFO_RECORD=path`` also writes every
outcome to a JSON file (one per worker, ``path.gwN``, under pytest-xdist).  ``DYNBATCH_OPINFO_DEVICE=cuda`` sweeps the ops' CUDA kernels
(float32 with TF32 off; ``EXPECTED_FAILURES`` holds for both devices).

Run:  .venv/bin/python -m pytest tests/test_opinfo.py -q
      DYNBATCH_OPINFO_SAMPLES=2 .venv/bin/python -m pytest tests/test_opinfo.py -q
      .venv/bin/python -m pytest tests/test_opinfo.py -q -m slow
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import os
from typing import Any, Callable

import pytest
import torch
import torch._dynamo
from torch.testing._internal import common_methods_invocations
from torch.testing._internal.common_methods_invocations import op_db
from torch.utils._pytree import tree_flatten, tree_unflatten

import dynbatch
from conftest import FALLBACK, OPINFO_WORKER_OUTPUT, assert_same_grads, compile_dynbatch, loop_grads, reset_all
from helpers_reliability import counters_delta, outcome

FAST_SAMPLES = int(os.environ.get("DYNBATCH_OPINFO_SAMPLES", "1"))
# The sweep's device: "cuda" runs every op's CUDA kernels (float32 with TF32 off).
DEVICE = os.environ.get("DYNBATCH_OPINFO_DEVICE", "cpu")
# The slow sweep takes every sample unless this caps it (for partial runs).
SLOW_SAMPLES = int(os.environ["DYNBATCH_OPINFO_SLOW_SAMPLES"]) if os.environ.get("DYNBATCH_OPINFO_SLOW_SAMPLES") else None


def op_key(op) -> str:
    return op.name + (f"/{op.variant_test_name}" if op.variant_test_name else "")


def _ops(dtype: torch.dtype) -> list:
    return [op for op in op_db if op.supports_autograd and dtype in op.supported_dtypes(DEVICE)]


OPS_F32 = _ops(torch.float32)
OPS_F64 = _ops(torch.float64)

# The default (CI) run takes every STRIDE-th op, in op_db's order; the others are
# the same tests behind the slow marker (-m slow), so a full run checks every op.
STRIDE = int(os.environ.get("DYNBATCH_OPINFO_STRIDE", "6"))
# The symbolic-B pass compiles three times per op: by default half as many ops.
SYMBOLIC_STRIDE = 2 * STRIDE


def _default_slice(ops: list, stride: int = STRIDE) -> list:
    return [op if i % stride == 0 else pytest.param(op, marks=pytest.mark.slow) for i, op in enumerate(ops)]

# op key -> (reason, allowed outcomes).  Found by running the sweep on torch
# 2.13 CPU; every entry says why the op is not a plain "match".  "mismatch"
# is never allowed.
_GRAPH_BREAK = frozenset({"graph_break"})
EXPECTED_FAILURES: dict[str, tuple[str, frozenset[str]]] = {
    **{key: ("Dynamo graph-breaks on .item() in the forward ('Data dependent operator', "
             "capture_scalar_outputs=False); without fullgraph the result equals eager's", _GRAPH_BREAK)
       for key in ("corrcoef", "cov")},
    "nn.functional.gaussian_nll_loss": (
        "the forward's torch.any(var < 0) check is data-dependent: Dynamo raises UserError under "
        "fullgraph=True; without fullgraph the result equals eager's", _GRAPH_BREAK),
    **{key: ("a dynamic-output-shape op in the forward (Dynamo 'Dynamic shape operator', "
             "capture_dynamic_output_shape_ops=False); without fullgraph the result equals eager's", _GRAPH_BREAK)
       for key in ("nn.functional.ctc_loss", "linalg.lstsq", "linalg.lstsq/grad_oriented")},
    **{key: ("sparse tensors: Dynamo cannot wrap them ('Attempted to wrap sparse Tensor'); without "
             "fullgraph the result equals eager's", _GRAPH_BREAK)
       for key in ("sparse.sampled_addmm", "to_sparse")},
    "nn.functional.linear_cross_entropy/chunked_none": (
        "the backward does an in-place mul_ of a batched grad into an unbatched tensor: functorch's "
        "vmap and eager's legacy vmap both reject it; dynbatch falls back and raises eager's error. "
        "Samples with a 3-d weight take a chunked path Dynamo cannot trace ('Attempted to call "
        "function marked as skipped'): Dynamo's refusal", frozenset({"eager_error", "graph_break"})),
    "nn.functional.linear_cross_entropy/chunked": (
        "samples with a 3-d weight take a chunked path Dynamo cannot trace ('Attempted to call "
        "function marked as skipped'); without fullgraph the result equals eager's", _GRAPH_BREAK),
    "combinations": (
        "r=2 over one element (an empty result): the forward alone fails under stock "
        "torch.compile(backend='aot_eager', fullgraph=True) with PendingUnbackedSymbolNotFound",
        frozenset({"stock_compile_fails"})),
    "masked_select": (
        "a mask broadcast to more elements than the input: the forward alone fails under stock "
        "torch.compile(backend='aot_eager') with a wrong runtime assertion (u0 <= input numel); "
        "and for a 0-d input under a [10, 10] mask functorch's masked_select_backward rule raises "
        "a shape error while tracing: dynbatch falls back, eager's values",
        frozenset({"stock_compile_fails", "fallback"})),
    "nn.functional.max_unpool2d/grad": (
        "samples with a channels_last input: the backward asks is_contiguous(channels_last) inside "
        "vmap, which functorch and eager's legacy vmap both reject ('NYI: querying is_contiguous "
        "inside of vmap'); dynbatch raises eager's error", frozenset({"eager_error"})),
    "as_strided_scatter": (
        "PyTorch's as_strided_scatter backward disagrees with itself: for the size-()/stride-() sample "
        "the per-sample loop gives a grad that ignores the cotangent, while eager is_grads_batched and "
        "functorch give v (functorch's own test_ops expects as_strided_scatter to fail); dynbatch equals eager "
        "is_grads_batched wherever eager returns (eager raises for the non-contiguous cotangent)",
        frozenset({"eager_batched"})),
    **{key: ("the batched backward has data-dependent sizes (unbacked SymInts, e.g. nonzero under a "
             "boolean mask or a tensor index); dynbatch falls back on purpose (capture.UNSUPPORTED), "
             "eager's values", frozenset({"fallback"}))
       for key in ("index_fill", "index_put")},
    "tensor_split": (
        "tensor indices_or_sections: lowering the batched graph hits a data-dependent size "
        "(GuardOnDataDependentSymNode); dynbatch falls back, eager's values", frozenset({"fallback"})),
}

# op key -> (rtol, atol) for float32 (float64 uses the defaults).
# layer_norm over a single element: the exact grad is 0 and rstd = 1/sqrt(eps)
# ~ 316 amplifies rounding; eager's per-sample kernel returns noise up to ~5e-4
# where dynbatch returns 0 (float64: 6e-14 vs 0).
TOLERANCES: dict[str, tuple[float, float]] = {
    "nn.functional.layer_norm": (1.3e-5, 1e-3),
    "native_layer_norm": (1.3e-5, 1e-3),
    # grad of tensor2 is -v * value * tensor1 / tensor2**2: float32 rounding of the
    # batched kernel and the loop differ by up to 1e-4 relative (float64 matches)
    "addcdiv": (2e-4, 1e-4),
    # weight grads reduce over batch and volume: the batched and per-sample kernels
    # sum in another order (float32: 1 element in a few hundred off by ~3e-5; float64 matches)
    "nn.functional.conv3d": (1e-4, 5e-5),
    "nn.functional.conv_transpose3d": (1e-4, 5e-5),
}
# On CUDA (H200, TF32 off), where cuSOLVER/cuBLAS batched and per-sample calls
# round differently: 1 element of 15-125 off by ~5e-5 (householder_product: one
# of 15 off by 1.5e-4 in the 2026-11-27 run).
CUDA_TOLERANCES: dict[str, tuple[float, float]] = {
    "linalg.householder_product": (5e-4, 5e-4),
    "matrix_exp": (1e-4, 1e-4),
}

# Ops whose samples cannot be compared with the loop at all.
SKIPS: dict[str, str] = {
    "sparse.mm/reduce": "its grads are sparse CSR tensors, which the loop oracle cannot stack "
                        "(and Dynamo cannot wrap sparse tensors)",
}

# Ops whose batched backward guards on B, so each new B compiles again (the
# symbolic pass's "specializes_B"; values stay right).  A functorch C++
# batching rule holds the batch size in an int64_t, and Dynamo then
# specialises B.  Found by recording, for each op, the C++ frame that turned a
# symbolic size into an int (torch 2.13): the rules for scatter/gather/index_*
# and the sorts, diagonal/diagonal_scatter, max_unpool, grid_sampler, cross,
# ...; and ops with no rule and no usable decomposition, which vmap runs once
# per sample (cummax/cummin, _segment_reduce, pdist, masked_scatter,
# fractional_max_pool, ...).  dynbatch's own rules (batching/batch_rules.py) free
# slice_backward, cat (split/chunk), gelu, glu, embedding, pixel_shuffle,
# convolutions, layer, batch and group norm backward, the pooling and padding
# backwards and the decomposable no-rule backwards (mish, rrelu, ...).
# Pruned to the ops that specialise in the first 3 samples (slow symbolic pass).
SPECIALIZES_B: frozenset[str] = frozenset({
    '_segment_reduce/lengths', '_segment_reduce/offsets', '_upsample_bilinear2d_aa',
    'combinations', 'cross', 'cummax', 'cummin', 'diag', 'diagonal', 'diagonal_copy',
    'diagonal_scatter', 'fft.ihfft2', 'fft.ihfftn', 'gather', 'grid_sampler_2d',
    'grid_sampler_3d', 'index_add', 'index_copy', 'index_reduce/amax', 'index_reduce/amin',
    'index_reduce/mean', 'index_reduce/prod', 'index_select', 'kthvalue', 'linalg.cross',
    'linalg.diagonal', 'linalg.eig', 'linalg.eigh', 'linalg.eigvals',
    'linalg.householder_product', 'masked.median', 'masked_scatter', 'masked_select',
    'max/reduction_with_dim', 'median', 'min/reduction_with_dim', 'mode', 'msort', 'nanmedian',
    'nanquantile', 'nn.functional.bilinear', 'nn.functional.channel_shuffle',
    'nn.functional.embedding_bag', 'nn.functional.fractional_max_pool2d',
    'nn.functional.fractional_max_pool3d', 'nn.functional.grid_sample',
    'nn.functional.max_unpool1d', 'nn.functional.max_unpool1d/grad',
    'nn.functional.max_unpool2d', 'nn.functional.max_unpool2d/grad',
    'nn.functional.max_unpool3d', 'nn.functional.max_unpool3d/grad',
    'nn.functional.multi_margin_loss', 'nn.functional.multilabel_margin_loss',
    'nn.functional.pad/circular', 'nn.functional.pdist', 'ormqr', 'put', 'quantile', 'scatter',
    'scatter_add', 'scatter_reduce/amax', 'scatter_reduce/amin', 'scatter_reduce/mean',
    'scatter_reduce/prod', 'scatter_reduce/sum', 'sort', 'take', 'take_along_dim', 'topk',
    'unfold', 'unfold_copy',
})

# (rtol, atol).  float32: 10x assert_close's rtol, since a batched kernel may
# reduce in another order than the per-sample one; float64: tight.
DEFAULT_TOL = {torch.float32: (1.3e-5, 1e-5), torch.float64: (1e-7, 1e-7)}


# --- building a case ----------------------------------------------------------

def _call_unfrozen(op: Callable, *args: Any, **kwargs: Any) -> Any:
    return op(*args, **kwargs)


@pytest.fixture(autouse=True, scope="module")
def _random_ops_without_frozen_rng():
    """OpInfo calls its random ops (dropout, bernoulli, rrelu, ...) through
    ``wrapper_set_seed``, which reseeds inside ``freeze_rng_state()``, a function
    Dynamo refuses to trace.  Its purpose, the same draws in every run, is
    served here by ``torch.manual_seed(0)`` before each eager and compiled run,
    so call the op directly: then the compiled forward is the user's program
    and must draw the eager forward's numbers (with ``aot_eager`` it does) for
    its grads to match the loop, which differentiates the eager forward."""
    mp = pytest.MonkeyPatch()
    mp.setattr(common_methods_invocations, "wrapper_set_seed", _call_unfrozen)
    yield
    mp.undo()


@pytest.fixture(autouse=True, scope="module")
def _full_fp32_on_cuda():
    """TF32 off: the loop oracle and the batched kernels must both compute in fp32."""
    # cudnn's flags through its context manager: op_db's import locks the plain setters.
    cudnn = torch.backends.cudnn
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    with cudnn.flags(enabled=cudnn.enabled, benchmark=cudnn.benchmark, deterministic=cudnn.deterministic,
                     allow_tf32=False):
        yield
    torch.backends.cuda.matmul.allow_tf32 = old


@dataclasses.dataclass
class Case:
    fn: Callable[..., tuple[torch.Tensor, ...]]  # primals -> differentiable outputs
    primals: list[torch.Tensor]


def make_case(op, sample) -> Case | None:
    """Split a SampleInput into differentiable leaves and a function of them."""
    flat, spec = tree_flatten(((sample.input, *sample.args), sample.kwargs))
    fresh: dict[int, torch.Tensor] = {}
    for leaf in flat:
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad and id(leaf) not in fresh:
            # a leaf of its own (same strides), so both runs differentiate w.r.t. it
            fresh[id(leaf)] = leaf.detach().requires_grad_()
    if not fresh:
        return None
    slots = [list(fresh).index(id(leaf)) if id(leaf) in fresh else None for leaf in flat]
    constants = [None if s is not None else leaf for s, leaf in zip(slots, flat)]
    process = sample.output_process_fn_grad

    def fn(*primals: torch.Tensor) -> tuple[torch.Tensor, ...]:
        leaves = [primals[s] if s is not None else c for s, c in zip(slots, constants)]
        args, kwargs = tree_unflatten(leaves, spec)
        out = op(*args, **kwargs)
        if process is not None:
            out = process(out)
        flat_out, _ = tree_flatten(out)
        return tuple(o for o in flat_out if isinstance(o, torch.Tensor) and o.requires_grad)

    return Case(fn, list(fresh.values()))


def cotangents(outs: tuple[torch.Tensor, ...], B: int, layout: str, gen: torch.Generator) -> list[torch.Tensor]:
    result = []
    for o in outs:
        shape = (B, *o.shape)
        if layout == "contiguous":
            v = _randn(shape, o, gen)
        elif layout == "noncontiguous":
            v = _randn((*shape, 2), o, gen)[..., 0]
        elif layout == "expanded":
            v = _randn((1, *o.shape), o, gen).expand(shape)
        else:
            raise ValueError(layout)
        result.append(v)
    return result


def _randn(shape, like: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    # Drawn on the CPU generator, so a CUDA sweep sees the CPU sweep's numbers.
    return torch.randn(shape, dtype=like.dtype, generator=gen).to(like.device)


LAYOUTS = ("contiguous", "noncontiguous", "expanded")


def batched_vjp_program(fn: Callable, n_sets: int) -> Callable:
    """The program under test: one forward, ``n_sets`` batched grads of it."""

    def program(primals: list[torch.Tensor], cot_sets: list[list[torch.Tensor]]):
        outs = fn(*primals)
        results = []
        for k in range(n_sets):
            results.append(torch.autograd.grad(
                outs, primals, cot_sets[k], retain_graph=k < n_sets - 1,
                allow_unused=True, is_grads_batched=True))
        return results

    return program


# --- running and classifying a case -----------------------------------------------

@dataclasses.dataclass
class Result:
    status: str  # match | fallback | eager_error | graph_break | mismatch | skip
    detail: str = ""


def _seeded(fn: Callable, *args: Any) -> tuple[str, Any]:
    torch.manual_seed(0)
    return outcome(fn, *args)


def _dynamo_refused(e: BaseException) -> bool:
    """Dynamo's own refusal under fullgraph=True (not a dynbatch error)."""
    return isinstance(e, (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError))


def _tol(key: str, dtype: torch.dtype) -> tuple[float, float]:
    if dtype == torch.float32 and DEVICE == "cuda" and key in CUDA_TOLERANCES:
        return CUDA_TOLERANCES[key]
    if dtype == torch.float32 and key in TOLERANCES:
        return TOLERANCES[key]
    return DEFAULT_TOL[dtype]


def _compare_sets(got, want, labels, key, rtol, atol) -> str | None:
    try:
        for label, g, e in zip(labels, got, want):
            assert_same_grads(g, e, rtol=rtol, atol=atol, msg=f"{key} {label}")
    except AssertionError as err:
        return str(err)[:2000]
    return None


def classify(case: Case, sets: tuple[tuple[int, str], ...], dtype: torch.dtype, key: str) -> Result:
    """Run one sample through dynbatch and the oracles; see the module docstring.

    ``sets``: (B, layout) of each batched grad call in the one compiled program.
    """
    reset_all()
    gen = torch.Generator().manual_seed(len(sets))
    labels = [f"B={B} {layout}" for B, layout in sets]
    torch.manual_seed(0)
    kind, outs = outcome(case.fn, *case.primals)
    if kind == "raise":
        return Result("skip", f"eager forward raises {type(outs).__name__}: {outs}")
    if not outs:
        return Result("skip", "no differentiable output")
    cot_sets = [cotangents(outs, B, layout, gen) for B, layout in sets]
    kind, expected = outcome(lambda: [loop_grads(outs, case.primals, cots) for cots in cot_sets])
    if kind == "raise":
        return Result("skip", f"the loop oracle raises {type(expected).__name__}: {_first_line(expected)}")
    program = batched_vjp_program(case.fn, len(cot_sets))
    rtol, atol = _tol(key, dtype)

    before = dynbatch.counters()
    # FALLBACK: a fallback is an outcome here (classified and allowed per op), not an error.
    kind, got = _seeded(compile_dynbatch(program, fullgraph=True, options=FALLBACK), case.primals, cot_sets)
    delta = counters_delta(before)
    e_kind, e_val = _seeded(program, case.primals, cot_sets)  # eager is_grads_batched=True

    if kind == "raise" and _dynamo_refused(got):
        # Dynamo's behaviour: then without fullgraph the user must get eager's answer.
        reason = f"{type(got).__name__}: {_first_line(got)}"
        reset_all()
        kind, got = _seeded(compile_dynbatch(program, fullgraph=False, options=FALLBACK), case.primals, cot_sets)
        if kind == "raise" or e_kind == "raise":
            if kind == "raise" and e_kind == "raise" and _same_error(got, e_val):
                return Result("graph_break", reason)
            return Result("mismatch", f"fullgraph=False: compiled {kind} {_short(got)}, eager {e_kind} {_short(e_val)}")
        err = _compare_sets(got, e_val, labels, key, rtol, atol)
        return Result("mismatch", f"fullgraph=False differs from eager: {err}") if err else Result("graph_break", reason)
    if kind == "raise":
        if e_kind == "raise" and _same_error(got, e_val):
            return Result("eager_error", f"{type(got).__name__}: {_first_line(got)}")
        if e_kind == "ok" and _stock_forward_compile_fails_alike(case, got):
            return Result("stock_compile_fails", f"{_short(got)} (the forward alone fails the same way "
                                                 "under stock backend='aot_eager')")
        return Result("mismatch", f"compiled raises {_short(got)}; eager {e_kind} {_short(e_val) if e_kind == 'raise' else ''}")
    if delta.get("fallbacks", 0):
        if e_kind == "raise":
            return Result("mismatch", f"fell back and returned, but eager raises {_short(e_val)}")
        err = _compare_sets(got, e_val, labels, key, 0, 0)
        if err:
            return Result("mismatch", f"fell back but differs from eager: {err}")
        return Result("fallback", "; ".join(dynbatch.fallback_reasons())[:300])
    if not delta.get("grads_batched", 0):
        return Result("mismatch", f"dynbatch batched nothing: counters {delta}")
    err = _compare_sets(got, expected, labels, key, rtol, atol)
    if err is None:
        return Result("match")
    # dynbatch == eager is_grads_batched (where eager returns), both differ from the loop?
    same_as_eager, eager_raises = True, []
    for k, label in enumerate(labels):
        one = batched_vjp_program(case.fn, 1)
        k_kind, k_val = _seeded(one, case.primals, [cot_sets[k]])
        if k_kind == "raise":
            eager_raises.append(f"{label}: {_short(k_val)}")
        elif _compare_sets([got[k]], k_val, (label,), key, rtol, atol) is not None:
            same_as_eager = False
    if same_as_eager and len(eager_raises) < len(labels):
        return Result("eager_batched", f"{err}\neager is_grads_batched raises for {eager_raises}")
    return Result("mismatch", err)


def _stock_forward_compile_fails_alike(case: Case, err: BaseException) -> bool:
    """Does the op's forward alone, under stock torch.compile(backend="aot_eager",
    fullgraph=True) and without any grad, raise the same kind of error?  Then the
    failure is PyTorch's (Dynamo / AOTAutograd / a meta function), not dynbatch's."""
    torch._dynamo.reset()
    try:
        kind, stock = outcome(torch.compile(lambda *p: case.fn(*p), backend="aot_eager", fullgraph=True),
                              *case.primals)
    finally:
        torch._dynamo.reset()
    return kind == "raise" and type(stock) is type(err) and _first_line(stock)[:60] == _first_line(err)[:60]


def _same_error(a: BaseException, b: BaseException) -> bool:
    return type(a) is type(b) and str(a) == str(b)


def _short(x: Any) -> str:
    return f"{type(x).__name__}: {_first_line(x)}" if isinstance(x, BaseException) else ""


def classify_symbolic(case: Case, key: str, batch_sizes=(2, 5, 8)) -> Result:
    """B = 2, 5, 8 in a row: one compile, one recompile that makes B dynamic, then none.

    ``specializes_B``: every value is right but each new B compiles again
    (something in the batched backward guards on B; see SPECIALIZES_B).
    """
    reset_all()
    program = batched_vjp_program(case.fn, 1)
    compiled = compile_dynbatch(program, fullgraph=True, options=FALLBACK)  # as in classify
    graphs = []
    for B in batch_sizes:
        gen = torch.Generator().manual_seed(B)
        torch.manual_seed(0)
        kind, outs = outcome(case.fn, *case.primals)  # afresh: some ops (batch_norm) bump saved versions
        if kind == "raise":
            return Result("skip", f"eager forward raises {_short(outs)}")
        if not outs:
            return Result("skip", "no differentiable output")
        cots = cotangents(outs, B, "contiguous", gen)
        kind, expected = outcome(loop_grads, outs, case.primals, cots)
        if kind == "raise":
            return Result("skip", f"the loop oracle raises {_short(expected)}")
        before = dynbatch.counters()
        kind, got = _seeded(compiled, case.primals, [cots])
        delta = counters_delta(before)
        if kind == "raise":
            if _dynamo_refused(got):
                return Result("graph_break", _short(got))
            e_kind, e_val = _seeded(program, case.primals, [cots])
            if e_kind == "raise" and _same_error(got, e_val):
                return Result("eager_error", _short(got))
            if e_kind == "ok" and _stock_forward_compile_fails_alike(case, got):
                return Result("stock_compile_fails", _short(got))
            return Result("mismatch", f"B={B}: raises {_short(got)}")
        if delta.get("fallbacks", 0):
            return Result("fallback", "; ".join(dynbatch.fallback_reasons())[:300])
        graphs.append(dynbatch.counters().get("graphs", 0))
        label = (f"B={B} contiguous (symbolic pass)",)
        err = _compare_sets(got, [expected], label, key, *_tol(key, torch.float32))
        if err:
            e_kind, e_val = _seeded(program, case.primals, [cots])
            if e_kind == "ok" and _compare_sets(got, e_val, label, key, *_tol(key, torch.float32)) is None:
                return Result("eager_batched", err)
            return Result("mismatch", err)
    if graphs[-1] == graphs[-2] and graphs[-1] <= 2:
        return Result("match")
    if graphs == list(range(1, len(batch_sizes) + 1)):
        return Result("specializes_B", f"one compile per B: graphs after B={batch_sizes}: {graphs}")
    return Result("mismatch", f"compiles after B={batch_sizes}: {graphs}")


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:300]


# --- the tests ------------------------------------------------------------------------

# The default slice folds B=3 (three layouts) and B=1 into one compiled program.
FAST_SETS = tuple((3, layout) for layout in LAYOUTS) + ((1, "contiguous"),)
SLOW_SETS = FAST_SETS + ((1, "noncontiguous"), (1, "expanded"))
SYMBOLIC_SLOW_SAMPLES = 3

# (test kind, op key) -> list of outcomes; summarised at the end of the session.
OUTCOMES: dict[tuple[str, str], list[Result]] = collections.defaultdict(list)


def _samples(op, dtype: torch.dtype, n: int | None) -> list:
    return list(itertools.islice(op.sample_inputs(DEVICE, dtype, requires_grad=True), n))


def _allowed(key: str, kind: str) -> frozenset[str]:
    allowed = {"match"}
    if key in EXPECTED_FAILURES:
        allowed |= EXPECTED_FAILURES[key][1]
    if key in SKIPS:
        allowed.add("skip")
    if kind.startswith("symbolic") and key in SPECIALIZES_B:
        allowed.add("specializes_B")
    return frozenset(allowed)


def _check(kind: str, key: str, results: list[Result]) -> None:
    OUTCOMES[(kind, key)].extend(results)
    allowed = _allowed(key, kind)
    bad = [r for r in results
           if r.status not in allowed and not (r.status == "skip" and r.detail in DATA_SKIPS)]
    assert not bad, (
        f"{key} ({kind}): unexpected outcome(s) {[r.status for r in bad]}; allowed {sorted(allowed)}\n"
        + "\n\n".join(r.detail for r in bad))


# Samples with nothing to differentiate: reported, not failures.
DATA_SKIPS = frozenset({"no differentiable output", "no differentiable input"})


def _run_batched(op, dtype: torch.dtype, n: int | None, sets) -> list[Result]:
    key = op_key(op)
    results = []
    for sample in _samples(op, dtype, n):
        case = make_case(op, sample)
        results.append(Result("skip", "no differentiable input") if case is None
                       else classify(case, sets, dtype, key))
    return results


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("op", _default_slice(OPS_F32), ids=op_key)
def test_batched_vjp(op):
    """First sample(s) of every op, float32, B=3 in three layouts and B=1."""
    _check("fast float32", op_key(op), _run_batched(op, torch.float32, FAST_SAMPLES, FAST_SETS))


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("op", _default_slice(OPS_F32, SYMBOLIC_STRIDE), ids=op_key)
def test_symbolic_batch(op):
    """First sample of every op: B = 2, 5, 8 compile at most twice (once where listed)."""
    key = op_key(op)
    samples = _samples(op, torch.float32, 1)
    case = make_case(op, samples[0]) if samples else None
    result = Result("skip", "no differentiable input") if case is None else classify_symbolic(case, key)
    _check("symbolic float32", key, [result])


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("op", OPS_F32, ids=op_key)
def test_batched_vjp_all_samples_float32(op):
    _check("slow float32", op_key(op), _run_batched(op, torch.float32, SLOW_SAMPLES, SLOW_SETS))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("op", OPS_F64, ids=op_key)
def test_batched_vjp_all_samples_float64(op):
    _check("slow float64", op_key(op), _run_batched(op, torch.float64, SLOW_SAMPLES, SLOW_SETS))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("op", OPS_F32, ids=op_key)
def test_symbolic_batch_more_samples(op):
    key = op_key(op)
    results = []
    for sample in _samples(op, torch.float32, SYMBOLIC_SLOW_SAMPLES):
        case = make_case(op, sample)
        results.append(Result("skip", "no differentiable input") if case is None
                       else classify_symbolic(case, key))
    _check("symbolic float32 (3 samples)", key, results)


def test_expected_failure_table_is_well_formed():
    """Every entry names a real op, gives a reason, and never allows 'mismatch'."""
    keys = {op_key(op) for op in op_db}  # every device's: some entries are CUDA's
    # The tables were recorded on torch 2.13, whose op_db has ops older ones lack.
    recorded_here = str(torch.__version__).startswith("2.13.")
    for key, (reason, allowed) in EXPECTED_FAILURES.items():
        assert key in keys or not recorded_here, key
        assert reason.strip(), key
        assert allowed and "mismatch" not in allowed and "match" not in allowed, key
        assert allowed <= {"fallback", "eager_error", "graph_break", "eager_batched", "stock_compile_fails"}, key
    for key in list(SKIPS) + list(SPECIALIZES_B) + list(TOLERANCES) + list(CUDA_TOLERANCES):
        assert key in keys or not recorded_here, key


# --- figures -------------------------------------------------------------------------

def figures(outcomes=None) -> list[str]:
    """Per test kind: ops matched / expected failures / mismatches, and cases by outcome.

    ``outcomes``: this process's (default), or the records of pytest-xdist's workers
    merged (``merge_records``; conftest.py prints those in the controller's summary)."""
    outcomes = OUTCOMES if outcomes is None else outcomes
    lines = []
    kinds = sorted({kind for kind, _ in outcomes})
    for kind in kinds:
        per_op = {key: rs for (k, key), rs in outcomes.items() if k == kind}
        cases = collections.Counter(r.status for rs in per_op.values() for r in rs)
        matched = expected = mismatched = skipped = 0
        for key, rs in per_op.items():
            statuses = {r.status for r in rs}
            allowed = _allowed(key, kind)
            if statuses - allowed - {"skip"}:
                mismatched += 1
            elif statuses <= {"match"}:
                matched += 1
            elif statuses <= {"skip"} or statuses <= {"skip", "match"} and "match" not in statuses:
                skipped += 1
            elif statuses <= {"match", "skip"}:
                matched += 1
            else:
                expected += 1
        lines.append(f"dynbatch OpInfo [{kind}]: {len(per_op)} ops: {matched} matched, "
                     f"{expected} expected failures, {mismatched} mismatches, {skipped} skipped; "
                     f"cases {dict(sorted(cases.items()))}")
        # Table entries these samples did not need (stale, or a later sample needs them).
        listed = set(EXPECTED_FAILURES) | (set(SPECIALIZES_B) if kind.startswith("symbolic") else set())
        unneeded = sorted(k for k, rs in per_op.items() if k in listed and {r.status for r in rs} <= {"match"})
        if unneeded:
            lines.append(f"    listed but all-match here ({len(unneeded)}): {', '.join(unneeded)}")
    return lines


def records(outcomes=None) -> dict[str, list[list[str]]]:
    """The outcomes as JSON-able data: ``{"kind|key": [[status, detail], ...]}``."""
    outcomes = OUTCOMES if outcomes is None else outcomes
    return {f"{k}|{key}": [[r.status, r.detail[:500]] for r in rs] for (k, key), rs in outcomes.items()}


def merge_records(many) -> dict[tuple[str, str], list[Result]]:
    """The outcomes of several ``records()`` (one per pytest-xdist worker), merged."""
    merged: dict[tuple[str, str], list[Result]] = collections.defaultdict(list)
    for one in many:
        for name, rs in one.items():
            kind, key = name.split("|", 1)
            merged[(kind, key)].extend(Result(status, detail) for status, detail in rs)
    return merged


class _FiguresPlugin:
    def pytest_terminal_summary(self, terminalreporter):
        lines = figures()
        if lines:
            terminalreporter.section("dynbatch OpInfo figures")
            for line in lines:
                terminalreporter.write_line(line)

    def pytest_sessionfinish(self, session):
        # Here, not in the summary: under pytest-xdist each worker holds its own outcomes,
        # which it hands the controller (conftest.py merges them) ...
        if not OUTCOMES:
            return
        if hasattr(session.config, "workeroutput"):
            session.config.workeroutput[OPINFO_WORKER_OUTPUT] = records()
        # ... and writes to a file of its own.
        path = os.environ.get("DYNBATCH_OPINFO_RECORD")
        if not path:
            return
        if os.environ.get("PYTEST_XDIST_WORKER"):
            path += "." + os.environ["PYTEST_XDIST_WORKER"]
        import json

        with open(path, "w") as f:
            json.dump(records(), f, indent=1)


@pytest.fixture(autouse=True, scope="module")
def _register_figures(request):
    if not request.config.pluginmanager.has_plugin("dynbatch-opinfo-figures"):
        request.config.pluginmanager.register(_FiguresPlugin(), "dynbatch-opinfo-figures")
    yield


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_regression_tensor_split_with_tensor_indices_is_batched():
    """tensor_split by a tensor of indices slices with data-dependent bounds.  The
    symbolic slice_backward rule (dynbatch/batching/batch_rules.py) branched on them in Python
    ("Could not guard on data-dependent expression u2 < 0"): fullgraph=True failed
    where functorch's own rule batched.  Such bounds now take functorch's rule."""
    (op,) = [op for op in OPS_F32 if op_key(op) == "tensor_split"]
    samples = _samples(op, torch.float32, 4)
    results = [classify(make_case(op, samples[i]), FAST_SETS, torch.float32, "tensor_split") for i in (0, 2, 3)]
    assert [r.status for r in results] == ["match"] * 3, [r.detail for r in results]
