"""Batching rules dynbatch swaps into functorch while a dynbatch compile traces
(put in place by stage 1, capture: docs/design.md, "Stage 1 — capture", item 3).
Each is the math only (NOTE [Batch rules are the math]).

NOTE [Symbolic batch rules]
functorch's C++ batching rule for ``aten.slice_backward`` (and the one for
``slice_scatter``) builds the batched sizes with ``grad.size(0)``, not
``grad.sym_size(0)``.  Under a symbolic batch size that reads B as a plain
int, so Dynamo adds the guard ``B == <example value>`` and every new B
recompiles.  Any batched backward through a slice hits it, e.g. the Hessian
of a loss in a flat parameter vector sliced with ``w[:k]``.  For ``step == 1``
slice_backward is a zero pad, whose batching rule keeps B symbolic; other
steps keep the old rule (right, only specialising).  ``cat`` does the same
when it expands an unbatched operand to B, which every backward through
``split``/``chunk`` does (batched grads of the used pieces, zeros for the
rest); ``cat`` below expands with the symbolic B.

NOTE [Backward ops without a batching rule]
A few backward ops have no functorch batching rule at all (on torch 2.13:
``rrelu_with_noise_backward``, ``mish_backward``, ``soft_margin_loss_backward``,
``unfold_backward``, ``batch_norm_backward``, ...).  vmap then runs its slow
fallback, a per-sample loop: the very unrolling dynbatch exists to remove (a
graph that grows with B, and B read as an int).  ``torch._decomp`` writes each
of them in ops that do have rules, so dynbatch makes the decomposition their
batching rule, as functorch itself does for ``mse_loss_backward`` and a few
others (``lazy_load_decompositions``).  The set is found at run time, so an op
that gains a functorch rule in a later torch keeps it; for the same reason
the decomposition is used for first-order backwards only (see
``_per_sample_unless_first_order``).

The overrides are registered only for the length of a dynbatch compile (the
capture scope), so code outside dynbatch sees functorch unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Any, Callable, Iterator, Sequence

import torch

from .. import _compat, fail_soft


aten = torch.ops.aten

# NOTE [Batch rules are the math]
# Each rule below is its op's FuncTorchBatched kernel: functorch calls it with the
# op's arguments as vmap holds them.  As in JAX's batching.py, where a rule maps
# (vals, dims) to (out, dim), ``batch_rule`` does the plumbing once: it unwraps
# each tensor argument (also in a list) at the current vmap level, batch dim moved
# to the front; runs the op itself where nothing is batched at this level; else
# calls the rule below vmap with a ``Batch`` (B, and which arguments carry it, the
# part of JAX's ``dims`` a rule asks about) and the unwrapped arguments, and
# rewraps what it returns batched along dim 0 (None stays None).  A rule that
# returns PER_SAMPLE gets vmap's slow fallback instead: the op once per sample.
# Rules whose plumbing differs say why where they do it themselves.

PER_SAMPLE = object()  # a rule's answer: run the op once per sample (vmap's fallback)


class Batch:
    """What a rule knows of the vmap level it runs at: ``size`` (B) and which of the
    arguments it was given carry the batch."""

    def __init__(self, size: torch.SymInt | int, args: Sequence) -> None:
        self.size = size
        self._args = args  # as the kernel received them (wrapped)
        self._batched: dict[int, tuple[torch.Tensor, bool]] = {}  # id -> (the value, kept alive; batched?)

    def batched(self, *values: Any) -> bool:
        """Does any of these arguments carry the batch?  (None and non-tensors do not.)"""
        return any(isinstance(v, torch.Tensor) and self._batched[id(v)][1] for v in values)

    def expanded(self, value: Any) -> Any:
        """An argument as [B, ...]: itself if batched, else expanded to B (a stride-0
        view); a list element by element; None and non-tensors as they are."""
        if isinstance(value, list):
            return [self.expanded(v) for v in value]
        if not isinstance(value, torch.Tensor) or self.batched(value):
            return value
        return self._take(value.expand(self.size, *value.shape), True)

    @property
    def records_for_double_backward(self) -> bool:
        """Will autograd record this call (create_graph=True)?"""
        return _records_for_double_backward(self._args)

    def _take(self, value: torch.Tensor, batched: bool) -> torch.Tensor:
        # The same tensor as a batched argument's value and as an unbatched argument
        # (a vmapped function that also reads what it maps over): an alias tells them apart.
        if self._batched.get(id(value), (None, batched))[1] != batched:
            value = aten.alias(value)
        self._batched[id(value)] = (value, batched)
        return value


def batch_rule(op: torch._ops.OpOverload | str | Callable, *, expand: bool = False) -> Callable:
    """Make ``rule(batch, *args, **kwargs)``, the math of a batching rule, the kernel
    functorch calls (NOTE [Batch rules are the math]).  ``op`` (an OpOverload or a
    callable, or the name of an aten op, looked up when called) is what runs where
    nothing is batched, and once per sample where the rule returns PER_SAMPLE.
    ``expand``: the rule gets every tensor as [B, ...], the unbatched ones expanded
    (functorch's layout for ops that broadcast).  Keyword arguments pass as they are."""

    def decorate(rule: Callable) -> Callable:
        @functools.wraps(rule)
        def kernel(*args, **kwargs):
            level = _compat.current_vmap_level()
            batch, values = _unwrap(args, level, expand)
            target = getattr(aten, op).default if isinstance(op, str) else op
            with _compat.below_vmap():
                if batch is None:
                    return target(*values, **kwargs)
                out = rule(batch, *values, **kwargs)
                if out is PER_SAMPLE:
                    out = _each_sample(target, batch, values, kwargs)
            return _rewrap(out, level)

        return kernel

    return decorate


def _unwrap(args: Sequence, level: int, expand: bool = False) -> tuple[Batch | None, list]:
    """A kernel's arguments at vmap ``level``: each tensor (also in a list) its value
    there, batch dim moved to the front, and with ``expand`` the unbatched ones
    expanded to B.  No Batch, and the plain values, when nothing is batched at this level."""
    pairs = [[_at(e, level) for e in a] if _holds_tensors(a) else _at(a, level) for a in args]
    sizes = [v.size(bdim) for a in pairs for v, bdim in (a if isinstance(a, list) else [a]) if bdim is not None]
    if not sizes:
        return None, [[v for v, _ in a] if isinstance(a, list) else a[0] for a in pairs]
    batch = Batch(sizes[0], args)

    def take(pair):
        value, bdim = pair
        if not isinstance(value, torch.Tensor):
            return value
        value = batch._take(value if bdim is None else _to_front(value, bdim), bdim is not None)
        return batch.expanded(value) if expand else value

    return batch, [[take(p) for p in a] if isinstance(a, list) else take(a) for a in pairs]


def _at(x: Any, level: int) -> tuple[Any, int | None]:
    return _compat.unwrap_at(x, level) if isinstance(x, torch.Tensor) else (x, None)


def _holds_tensors(x: Any) -> bool:
    return isinstance(x, (list, tuple)) and any(isinstance(e, torch.Tensor) for e in x)


def _to_front(t: torch.Tensor, bdim: int) -> torch.Tensor:
    return t if bdim == 0 else t.movedim(bdim, 0)  # no identity permute in the graph


def _rewrap(out: torch.Tensor | Sequence, level: int) -> torch.Tensor | tuple:
    """A rule's result, batched along dim 0: a tensor, or a tuple of them (None stays None)."""
    if isinstance(out, torch.Tensor):
        return _compat.rewrap_batched(out, 0, level)
    return tuple(None if g is None else _compat.rewrap_batched(g, 0, level) for g in out)


def _each_sample(op: Callable, batch: Batch, args: Sequence, kwargs: dict):
    """``op`` once per sample, stacked (None results stay None)."""
    args = [batch.expanded(a) if isinstance(a, torch.Tensor) else a for a in args]
    samples = [op(*[a[i] if isinstance(a, torch.Tensor) else a for a in args], **kwargs)
               for i in range(batch.size)]
    single = not isinstance(samples[0], tuple)
    outs = tuple(None if column[0] is None else torch.stack(column)
                 for column in ([samples] if single else zip(*samples)))
    return outs[0] if single else outs


def _batch_dim_first(args: Sequence) -> tuple[list, torch.SymInt | int | None, int]:
    """For the rules that do their own plumbing: (operands, B, level), every tensor
    [B, ...] (B None, and the operands the plain values, when nothing is batched)."""
    level = _compat.current_vmap_level()
    batch, values = _unwrap(args, level, expand=True)
    return values, None if batch is None else batch.size, level


def _any_batched(tensors: Sequence, level: int) -> bool:
    return any(t is not None and _compat.unwrap_at(t, level)[1] is not None for t in tensors)


def slice_backward(grad: torch.Tensor, input_sizes: Sequence, dim: int, start, end, step):
    # Own plumbing: none.  It runs at the vmap level, where functorch's rules batch
    # its ops (a zero pad) with B symbolic; only the fallback below unwraps.
    rank = len(input_sizes)
    dim = dim % rank
    if _data_dependent(start) or _data_dependent(end):
        # e.g. tensor_split with tensor indices: `start < 0` below cannot be decided.
        return _functorch_rule(grad, input_sizes, dim, start, end, step)
    size = input_sizes[dim]
    # The forward's slice bounds as autograd saved them: may be negative or 2**63-1.
    start = start + size if start < 0 else start
    end = end + size if end < 0 else end
    start = min(max(start, 0), size)
    end = min(max(end, start), size)
    if step != 1:
        return grad.new_zeros(input_sizes).slice_scatter(grad, dim, start, end, step)
    return torch.constant_pad_nd(grad, [0, 0] * (rank - 1 - dim) + [start, size - end], 0.0)


def _data_dependent(x) -> bool:
    return isinstance(x, torch.SymInt) and _compat.has_unbacked_symbols(x)


@batch_rule("slice_backward")
def _functorch_rule(batch: Batch, grad: torch.Tensor, input_sizes: Sequence, dim: int, start, end, step):
    """What functorch's C++ rule does (batch dim to the front, one unbatched
    slice_backward), reading B as a SymInt; no Python branching on the bounds."""
    return aten.slice_backward(grad, [batch.size, *input_sizes], dim + 1, start, end, step)


@batch_rule("cat", expand=True)
def cat(batch: Batch, tensors: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """functorch's cat rule with the batch size kept symbolic.

    The C++ rule expands each unbatched operand to the batch size read as an
    int; the backward of split/chunk cats batched grads with unbatched zeros,
    so every batched backward through a split guarded on B.
    """
    # cat skips 1-d empty operands whatever the others' shape (legacy behaviour)
    kept = [t for t in tensors if not (t.dim() == 2 and t.size(1) == 0)] or tensors[:1]
    return aten.cat.default(kept, dim % (kept[0].dim() - 1) + 1)


def fold_batch_into_dim0(op: torch._ops.OpOverload) -> Callable:
    """Rule for an op that treats dim 0 of its tensors as independent samples
    (pooling and padding backwards): fold B into that dim, run once, unfold.

    What functorch's ``EXISTING_BDIM_ALL`` rules do, with B symbolic: theirs
    reshape with B read as an int.  A logical input without a sample dim
    ([C, H, W]) becomes [B*C, H, W], still valid: channels are independent too.
    """

    @batch_rule(op, expand=True)
    def rule(batch: Batch, *args):
        # dense: adaptive_max_pool3d_backward (CPU, torch 2.13) segfaults on a
        # stride-0 self/indices, which a flattened expand of a size-1 dim is
        out = op(*[a.flatten(0, 1).contiguous() if isinstance(a, torch.Tensor) else a for a in args])
        return out.unflatten(0, (batch.size, -1))

    return rule


@batch_rule("gelu_backward", expand=True)
def gelu_backward(batch: Batch, grad_output: torch.Tensor, self: torch.Tensor, *,
                  approximate: str = "none") -> torch.Tensor:
    """functorch's rule for this pointwise op reads B as an int (tanh_backward's
    does not).  Same layout as functorch's: the unbatched operand expanded to
    [B, ...], which aten_passes.sink_expands later undoes for the derivative factor.
    (Autograd passes both operands with one shape; the op does not broadcast.)"""
    return aten.gelu_backward.default(grad_output, self, approximate=approximate)


def _inductor_fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return torch.ops.prims.fma.default(a, b, c)


@batch_rule(_inductor_fma)
def fma(batch: Batch, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Inductor's ``prims.fma`` (its ``_softmax_backward_data`` decomposition, so
    AOTAutograd's backward graphs of softmax, which the saved activations' path vmaps)
    has no functorch rule: the per-sample fallback would unroll B.  It broadcasts like
    ``a * b + c``: each operand gets the batch dim in front, the unbatched ones a 1
    there, and 1s after it up to the widest operand's rank."""
    rank = max(t.dim() - batch.batched(t) for t in (a, b, c))

    def aligned(t: torch.Tensor) -> torch.Tensor:
        front = t.shape[:1] if batch.batched(t) else (1,)
        rest = t.shape[1:] if batch.batched(t) else t.shape
        return t.reshape(*front, *(1,) * (rank - len(rest)), *rest)

    return _inductor_fma(aligned(a), aligned(b), aligned(c))


def _convert_element_type(a: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.ops.prims.convert_element_type.default(a, dtype)


@batch_rule(_convert_element_type)
def convert_element_type(batch: Batch, a: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``prims.convert_element_type``, a dtype cast that Inductor's decompositions put in
    AOTAutograd's backward graphs (of ``_to_copy``: a float32 model with float64 steps, as
    NequIP's), has no functorch rule: the per-sample fallback unrolled B, and with B
    symbolic raised "Cannot call sizes() on tensor with symbolic sizes".  Elementwise: the
    batched value casts as it is."""
    return _convert_element_type(a, dtype)


@batch_rule("_unsafe_masked_index")
def unsafe_masked_index(batch: Batch, self: torch.Tensor, mask: torch.Tensor, indices: list, fill) -> torch.Tensor:
    """``_unsafe_masked_index``, ``masked_fill(~mask)`` of ``_unsafe_index``: Inductor's
    decomposition of ``slice_scatter`` (a slice's backward) puts it in AOTAutograd's backward
    graphs.  It has no functorch rule and its kernel read a BatchedTensor's sizes, which
    raised under a symbolic B ("Cannot call sizes() on tensor with symbolic sizes").  With
    only ``self`` batched, B moves behind the indexed dims, where the op keeps dims it does
    not index, and the mask broadcasts over it; else once per sample."""
    if batch.batched(mask, *indices):
        return PER_SAMPLE
    out = aten._unsafe_masked_index.default(self.movedim(0, -1), mask.unsqueeze(-1), indices, fill)
    return out.movedim(-1, 0)


@batch_rule("_cdist_backward", expand=True)
def cdist_backward(batch: Batch, grad: torch.Tensor, x1: torch.Tensor, x2: torch.Tensor, p: float,
                   cdist: torch.Tensor):
    """functorch's rule returns wrong values when the grad alone is batched (torch
    2.13: off by up to 200 against a loop of ``autograd.grad`` for every p but 0
    with inputs that have batch dims, and for p=1 without).  torch.cdist calls
    the op with at most one batch dim ([batch, P, M]), so B is folded into it
    (the meta function mis-broadcasts two); the kernel wants dense inputs."""
    # x1 and x2 may come with different batch dims (cdist broadcasts them)
    dims = tuple(torch.broadcast_shapes(*(t.shape[1:-2] for t in (grad, x1, x2, cdist))))

    def folded(t: torch.Tensor) -> torch.Tensor:
        t = t[(slice(None),) + (None,) * (len(dims) + 3 - t.dim())]  # [B, 1.., *t's batch, r, c]
        return t.expand(batch.size, *dims, *t.shape[-2:]).flatten(0, len(dims)).contiguous()

    g, a, b, d = (folded(t) for t in (grad, x1, x2, cdist))
    return aten._cdist_backward.default(g, a, b, p, d).unflatten(0, (batch.size, *dims))


@batch_rule("roll")
def roll(batch: Batch, self: torch.Tensor, shifts, dims=()) -> torch.Tensor:
    """functorch's rule rolls a 0-d sample across the batch (torch 2.13: the batched
    grad of ``torch.roll`` of a 0-d tensor is the cotangents rotated, not equal to
    them).  Without ``dims`` roll works on each sample flattened."""
    if len(dims) == 0:
        flat = self.flatten(1) if self.dim() > 1 else self[:, None]  # [B, numel of a sample]
        return flat.roll(shifts, 1).reshape(self.shape)
    rank = max(self.dim() - 1, 1)
    return aten.roll.default(self, shifts, [d % rank + 1 for d in dims])


@batch_rule("mm")
def mm(batch: Batch, self: torch.Tensor, mat2: torch.Tensor) -> torch.Tensor:
    """a @ g[b] for every sample, with only the right operand batched: a linear
    layer's weight grad x.T @ g, attention's p.T @ g.  functorch's rule hands it to
    ATen's matmul, which computes it transposed, (g.mT @ a.T).T as one tall mm, and
    copies g transposed in and the result transposed out.  One bmm over a stride-0
    ``a`` needs neither copy (and is what torch.func's traced matmul gives).  A
    batched left operand folds B into its rows (one mm, functorch's rule) where that
    is a view; where it would copy -- each sample transposed, attention's g_s.mT @ q --
    one bmm over a stride-0 ``mat2`` reads it in place (the copy cost as much as the
    mm: [64, 64, 64] transposed, 137 us of 317).  Both batched is a bmm."""
    if not batch.batched(mat2):
        if batch.batched(self) and not _rows_fold(self):
            return torch.bmm(self, batch.expanded(mat2))
        return torch.matmul(self, mat2)
    return torch.bmm(batch.expanded(self), mat2)


def _rows_fold(t: torch.Tensor) -> bool:
    """Is [B, M, K] viewable as [B * M, K] (known without a guard)?"""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return statically_known_true(t.stride(0) == t.stride(1) * t.shape[1])


# Coupled with inductor._CONVOLUTIONS_AS_EXTERN_WHEN_B_SIZES_THE_WEIGHT: the two rules
# below put B in a weight's sizes or the groups, which Inductor's lowering would read
# as ints (B specialised again), so stage 4 lowers those convolutions as extern calls.

@batch_rule("convolution")
def convolution(batch: Batch, input, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    """functorch's rule (JAX's) reads B as an int; the double backward of a
    convolution calls it with batched operands.  A batched input alone is
    folded into N; anything else is B convolutions run as one with B times the
    groups (``_fold_into_groups``)."""
    args = (stride, padding, dilation, transposed, output_padding)
    if not batch.batched(weight, bias):
        out = aten.convolution.default(input.flatten(0, 1), weight, bias, *args, groups)
        return out.unflatten(0, input.shape[:2])
    x, w, b = (batch.expanded(t) for t in (input, weight, bias))
    x, w = _fold_into_groups(x, w)
    out = aten.convolution.default(x, w, None if b is None else b.flatten(), *args, groups * batch.size)
    return _batch_out_of_channels(out, batch.size)


def _batch_into_channels(t: torch.Tensor) -> torch.Tensor:
    """[B, N, C, ...] -> [N, (B C), ...]: B independent problems as more channels."""
    return t.movedim(0, 1).flatten(1, 2)


def _batch_out_of_channels(t: torch.Tensor, B) -> torch.Tensor:
    """[N, (B C), ...] -> [B, N, C, ...], copied dense: a batched tensor whose
    per-sample strides involve B has symbolic strides, and C++ code that reads
    ``sizes()`` of it (``_convolution_double_backward`` does) raises under a
    symbolic B."""
    return t.unflatten(1, (B, -1)).movedim(1, 0).contiguous()


def _fold_into_groups(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, N, C, ...] and [B, *weight] as one convolution with B times the
    groups: channels [N, (B C), ...] and weight [(B dim0), ...], since dim 0
    is the grouped dim of a weight, transposed or not."""
    return _batch_into_channels(x), w.flatten(0, 1)


@batch_rule("convolution_backward")
def convolution_backward(batch: Batch, grad_output, input, weight, bias_sizes, stride, padding, dilation,
                         transposed, output_padding, groups, output_mask):
    """functorch's rule reads B as an int in every branch, so any batched
    backward through a convolution recompiled for each new B.  Same layouts as
    functorch's, with B symbolic: see ``_conv_backward_cotangent_batched`` and
    ``_conv_backward_folded_into_groups``."""
    args = (stride, padding, dilation, transposed, output_padding, groups)
    if not batch.batched(input, weight):
        # the first-order case: only the cotangents carry B
        return _conv_backward_cotangent_batched(grad_output, input, weight, args, output_mask)
    # a double backward: input or weight batched too
    go, x, w = (batch.expanded(t) for t in (grad_output, input, weight))
    return _conv_backward_folded_into_groups(go, x, w, args, output_mask)


def _conv_backward(go, x, w, args, mask):
    return torch.ops.aten.convolution_backward.default(go, x, w, None, *args, mask)


def _dummy(t: torch.Tensor, shape) -> torch.Tensor:
    """A stand-in for an operand whose values the masked-out grad would need:
    the backward reads only its shape (functorch's ``make_dummy``)."""
    return t.new_empty(()).expand(shape)


def _bias_grad(go: torch.Tensor, mask) -> torch.Tensor | None:
    # [B, N, C, *spatial] -> [B, C]
    return go.sum([1, *range(3, go.dim())]) if mask[2] else None


def _conv_backward_cotangent_batched(go, x, w, args, mask):
    """go [B, N, O, ...]; x, w unbatched.  The input grad is linear in go and
    independent per sample: fold B into N.  The weight grad sums over N, so
    B goes into the output channels, per group: [N, (G B O/G), ...] against
    a weight with B times the output channels (groups unchanged)."""
    B, N = go.shape[:2]
    transposed, groups = args[3], args[5]
    grad_input = grad_weight = None
    if mask[0]:
        grad_input = _conv_backward(go.flatten(0, 1), _dummy(x, (B * N, *x.shape[1:])), w, args,
                                    [True, False, False])[0].unflatten(0, (B, N))
    if mask[1]:
        go_ = go.unflatten(2, (groups, -1)).movedim(0, 2).flatten(1, 3)  # [N, G*B*O/G, ...]
        if transposed:  # weight [I, O/G, ...]
            dummy = _dummy(w, (w.shape[0], B * w.shape[1], *w.shape[2:]))
            grad_weight = _conv_backward(go_, x, dummy, args, [False, True, False])[1]
            grad_weight = _batch_out_of_channels(grad_weight, B)  # [I, (B O/G), ...] -> [B, I, O/G, ...]
        else:  # weight [O, I/G, ...]
            dummy = _dummy(w, (B * w.shape[0], *w.shape[1:]))
            grad_weight = _conv_backward(go_, x, dummy, args, [False, True, False])[1]
            grad_weight = grad_weight.unflatten(0, (groups, B, -1)).transpose(0, 1).flatten(1, 2)
    return grad_input, grad_weight, _bias_grad(go, mask)


def _conv_backward_folded_into_groups(go, x, w, args, mask):
    """All three operands [B, ...]: one backward with B times the groups."""
    B = go.shape[0]
    x_, w_ = _fold_into_groups(x, w)
    grad_input, grad_weight, _ = _conv_backward(
        _batch_into_channels(go), x_, w_, (*args[:5], args[5] * B), [mask[0], mask[1], False])
    if grad_input is not None:
        grad_input = _batch_out_of_channels(grad_input, B)
    if grad_weight is not None:
        grad_weight = grad_weight.unflatten(0, (B, -1))
    return grad_input, grad_weight, _bias_grad(go, mask)


@batch_rule("native_layer_norm_backward")
def native_layer_norm_backward(batch: Batch, grad_out, input, normalized_shape, mean, rstd, weight, bias,
                               output_mask):
    """functorch's rule reads B as an int, and under create_graph its weight
    grad, ``sum(grad_out * (input - mean) * rstd)`` in plain ops, has a wrong
    double backward: autograd does not differentiate the saved mean and rstd,
    so the weight grad's derivative by the input misses them (torch 2.13: off
    by up to 6 against the loop).  Here the input grad is the op itself on B
    folded into the rows (its own derivative formula is exact), and a weight
    or bias grad that autograd records is computed per sample by the op."""
    if batch.batched(input, mean, rstd, weight, bias) or (
        batch.records_for_double_backward and (output_mask[1] or output_mask[2])
    ):
        return PER_SAMPLE
    op = aten.native_layer_norm_backward.default
    go = grad_out.to(input.dtype)
    B, rows = go.shape[0], list(range(1, go.dim() - len(normalized_shape)))  # dims summed for weight and bias

    def sum_rows(t: torch.Tensor) -> torch.Tensor:
        return t.sum(rows) if rows else t  # sum over [] would sum everything

    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:
        g = (go if weight is None else go * weight).contiguous()  # as functorch's rule passes it
        x, m, r = (t.expand(B, *t.shape).contiguous() for t in (input, mean, rstd))
        grad_input = op(g, x, normalized_shape, m, r, None, None, [True, False, False])[0]
    if output_mask[1] and weight is not None:
        grad_weight = sum_rows(go * ((input - mean) * rstd))
    if output_mask[2] and bias is not None:
        grad_bias = sum_rows(go)
    return grad_input, grad_weight, grad_bias


@batch_rule("native_batch_norm_backward")
def native_batch_norm_backward(batch: Batch, grad_out, input, weight, running_mean, running_var, save_mean,
                               save_invstd, train, eps, output_mask):
    """functorch's rule reads B as an int, and under create_graph its weight
    grad has the same wrong double backward as layer norm's (torch 2.13: off by
    up to 8; instance norm too, which calls this op).  Channels are independent
    in batch norm, so B goes into them: [N, (B C), ...] with the per-channel
    vectors repeated, one call of the op, whose derivative formula is exact."""
    per_channel = (weight, running_mean, running_var, save_mean, save_invstd)
    if not batch.batched(grad_out) or batch.batched(input, *per_channel):
        return PER_SAMPLE  # a double backward with batched input or stats
    B, N, C = grad_out.shape[:3]
    x = input.unsqueeze(1).expand(N, B, *input.shape[1:]).flatten(1, 2)
    per_channel = [None if v is None else v.repeat(B) for v in per_channel]  # empty save stats stay empty
    go = _batch_into_channels(grad_out).contiguous()
    grad_input, grad_weight, grad_bias = aten.native_batch_norm_backward.default(
        go, x, *per_channel, train, eps, output_mask)
    if grad_input is not None:
        grad_input = _batch_out_of_channels(grad_input, B)
    grad_weight, grad_bias = (None if g is None else g.unflatten(0, (B, C)) for g in (grad_weight, grad_bias))
    return grad_input, grad_weight, grad_bias


def cudnn_batch_norm_backward(input, grad_output, weight, running_mean, running_var, save_mean, save_var,
                              epsilon, reserveSpace=None):
    """cuDNN's batch norm backward (CUDA's training path when weight and bias are
    given), and MIOpen's (ROCm) without ``reserveSpace``.  Both are
    ``native_batch_norm_backward`` in training mode (their ``save_var`` is the
    inverse std, as torch._decomp writes them), which at this vmap level
    dispatches to the rule above: B symbolic, an exact double backward.
    functorch's rule calls the native op too (torch 2.11, seen on an H200), so
    today this pins that routing: a functorch rule of its own for the cuDNN op
    would bring back the native rule's faults (tests/test_cuda.py)."""
    # Own plumbing: none.  It calls the native op at the vmap level, whose rule batches it.
    return aten.native_batch_norm_backward.default(
        grad_output, input, weight, running_mean, running_var, save_mean, save_var, True, epsilon,
        [True, True, True])


@batch_rule("native_group_norm_backward")
def native_group_norm_backward(batch: Batch, grad_out, input, mean, rstd, weight, N, C, HxW, group,
                               output_mask):
    """functorch's rule reads B as an int.  Autograd calls this op for first
    order only (under create_graph group norm differentiates a composite), so
    the rule is functorch's with B symbolic: the input grad is the op on B
    folded into N, the weight and bias grads plain sums per sample."""
    if (not batch.batched(grad_out) or batch.records_for_double_backward
            or batch.batched(input, mean, rstd, weight)):
        return PER_SAMPLE
    op = aten.native_group_norm_backward.default
    go = grad_out.to(input.dtype)
    B = go.shape[0]
    samples_and_space = [1, *range(3, go.dim())]  # [B, N, C, *spatial]: summed for weight and bias
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:
        x, m, r = (t.expand(B, *t.shape).flatten(0, 1).contiguous() for t in (input, mean, rstd))
        # dense: the CPU kernel misreads a strided grad_out (torch 2.13)
        grad_input = op(go.flatten(0, 1).contiguous(), x, m, r, weight, B * N, C, HxW, group,
                        [True, False, False])[0].unflatten(0, (B, N))
    if output_mask[1] and weight is not None:
        x = input.reshape(N, group, C // group * HxW)  # not -1: N may be 0
        normalized = ((x - mean[..., None]) * rstd[..., None]).reshape(input.shape)
        grad_weight = (go * normalized).sum(samples_and_space)
    if output_mask[2]:
        grad_bias = go.sum(samples_and_space)
    return grad_input, grad_weight, grad_bias


def sdpa_flash_cpu_backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *,
                            attn_mask=None, scale=None):
    """The CPU backward of scaled_dot_product_attention has no functorch rule, so
    vmap loops per sample (B read as an int: one graph per B).  Every operand is
    [N, H, L, ...] per sample, N independent attention problems, so B folds into
    N: one call on [B*N, ...].  With dropout the per-sample loop stays (the
    op's random stream is per call)."""
    # Own plumbing: the mask (a keyword argument) is expanded per sample at the vmap
    # level, to its logical [N, H, L, S], before B is folded in.
    op = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    level = _compat.current_vmap_level()

    def call(go, q, k, v, o, lse, mask):
        return op(go, q, k, v, o, lse, dropout_p, is_causal, attn_mask=mask, scale=scale)

    args = (grad_out, query, key, value, out, logsumexp, attn_mask)
    if dropout_p != 0 or not _any_batched(args, level):
        return _per_sample(call, *args)
    if attn_mask is not None:
        # one [N, H, L, S] mask per sample before folding: a broadcast mask's
        # leading dims would not broadcast against B*N
        N, H, L, S = query.shape[0], query.shape[1], query.shape[2], key.shape[2]
        attn_mask = attn_mask.expand(N, H, L, S)
    operands, B, level = _batch_dim_first((grad_out, query, key, value, out, logsumexp, attn_mask))
    with _compat.below_vmap():
        # dense, as fold_batch_into_dim0 does: an expanded operand folds to stride 0
        grads = call(*[a if a is None else a.flatten(0, 1).contiguous() for a in operands])
    return _rewrap([g.unflatten(0, (B, -1)) for g in grads], level)


# The CUDA attention backwards, none with a functorch rule: their per-sample
# tensor arguments (dim 0 is the attention batch N) and their bias argument.
# Other tensor arguments (philox seed and offset, cumulative sequence lengths)
# are per call, not per sample.
_ATTENTION_BACKWARDS = {
    "_scaled_dot_product_flash_attention_backward":
        (("grad_out", "query", "key", "value", "out", "logsumexp"), None),
    "_scaled_dot_product_efficient_attention_backward":
        (("grad_out_", "query", "key", "value", "out", "logsumexp"), "attn_bias"),
    "_efficient_attention_backward":
        (("grad_out_", "query", "key", "value", "out", "logsumexp"), "bias"),
    "_scaled_dot_product_cudnn_attention_backward":
        (("grad_out", "query", "key", "value", "out", "logsumexp"), "attn_bias"),
}


def fold_attention_backward(op: torch._ops.OpOverload, per_sample: Sequence[str], bias: str | None) -> Callable:
    """Rule for a CUDA attention backward, as sdpa_flash_cpu_backward is for
    the CPU one: B folds into the attention batch N, one call on [B*N, ...].
    With dropout, or a per-call argument batched, the per-sample loop stays."""
    schema = _compat.op_schema(op)
    names = [a.name for a in schema.arguments]
    folded = [names.index(n) for n in per_sample]
    bias_at = None if bias is None else names.index(bias)
    bmhk = schema.name == "aten::_efficient_attention_backward"  # [N, L, H, E]; the rest [N, H, L, E]

    # Own plumbing: the arguments folded and kept are chosen by name from the schema,
    # and an unneeded grad_bias stays unbatched.
    def rule(*args, **kwargs):
        level = _compat.current_vmap_level()
        args = list(args)
        kept = [i for i, a in enumerate(args)
                if isinstance(a, torch.Tensor) and i not in folded and i != bias_at]
        dropout = args[names.index("dropout_p")] if "dropout_p" in names else 0.0
        at = folded + ([bias_at] if bias_at is not None and args[bias_at] is not None else [])
        if dropout != 0 or _any_batched([args[i] for i in kept], level) or not _any_batched([args[i] for i in at], level):
            return _per_sample(op, *args, **kwargs)
        if len(at) > len(folded):
            # a broadcast bias's leading dims would not broadcast against B*N
            q, k = args[names.index("query")], args[names.index("key")]
            N, H, L, S = ((q.shape[0], q.shape[2], q.shape[1], k.shape[1]) if bmhk
                          else (q.shape[0], q.shape[1], q.shape[2], k.shape[2]))
            args[bias_at] = args[bias_at].expand(N, H, L, S)
        operands, B, _ = _batch_dim_first([args[i] for i in at])
        with _compat.below_vmap():
            for i, t in zip(at, operands):
                args[i] = _aligned(t.flatten(0, 1)) if i == bias_at else t.flatten(0, 1).contiguous()
            grads = op(*args, **kwargs)
        # grad_bias (4th) is a placeholder when no bias needs a grad: left unbatched
        biased = len(at) > len(folded)
        return tuple(g if g is None or (i == 3 and not (biased and g.dim() == 4))
                     else _compat.rewrap_batched(g.unflatten(0, (B, -1)), 0, level)
                     for i, g in enumerate(grads))

    return rule


def _aligned(bias: torch.Tensor) -> torch.Tensor:
    """A bias the memory-efficient kernels take: rows 16-element aligned, as
    sdpa's own mask preprocessing pads them (a stride-0 view stays one)."""
    S = bias.shape[-1]
    if bias.stride(-1) == 1 and bias.stride(-2) % 16 == 0:
        return bias
    return torch.nn.functional.pad(bias, (0, -S % 16))[..., :S]


# (grad_output, self, ...) -> grad_input, dim 0 of every tensor a sample dim.
_SAMPLEWISE_BACKWARDS = (
    "avg_pool2d_backward", "avg_pool3d_backward",
    "_adaptive_avg_pool2d_backward", "_adaptive_avg_pool3d_backward",
    "reflection_pad1d_backward", "reflection_pad2d_backward", "reflection_pad3d_backward",
    "replication_pad1d_backward", "replication_pad2d_backward", "replication_pad3d_backward",
    # ... and indices, per sample and channel
    "max_pool2d_with_indices_backward", "max_pool3d_with_indices_backward",
    "adaptive_max_pool2d_backward", "adaptive_max_pool3d_backward",
)


# Ops whose functorch rule reads B as an int, while their torch._decomp
# decomposition batches with B symbolic (each checked by the OpInfo symbolic
# pass) and differentiates like the op under create_graph: all its tensor
# inputs are differentiable ones (glu and binary_cross_entropy are tested in
# tests/test_lowering_passes.py; the rest are linear in them).  Inductor
# decomposes them the same way anyway.  Not the norm
# backwards: their decompositions take the forward's mean/rstd as inputs, which
# autograd does not differentiate, so a double backward through them is wrong.
# Not diagonal_backward or diagonal_scatter: their decompositions end in
# prims.copy_to, which AOTAutograd cannot functionalise; nor linalg_cross,
# whose decomposition still specialises.
_DECOMPOSED_INSTEAD = (
    "embedding_dense_backward", "glu_backward", "binary_cross_entropy_backward",
    "select_scatter", "slice_scatter", "pixel_shuffle", "pixel_unshuffle", "col2im",
)


def _per_sample_unless_first_order(op: torch._ops.OpOverload, decomposition: Callable) -> Callable:
    """The decomposition for a first-order backward; under create_graph, where
    autograd records this op for a double backward, vmap's own per-sample loop.

    A decomposition found at run time may take inputs autograd does not
    differentiate (batch_norm_backward: the saved mean and invstd), so its
    double backward could be wrong; the loop is what functorch did anyway.
    """

    # Own plumbing: none.  The decomposition runs at the vmap level, where functorch's
    # rules batch its ops.
    def rule(*args, **kwargs):
        if _records_for_double_backward(args):
            return _per_sample(op, *args, **kwargs)
        return decomposition(*args, **kwargs)

    return rule


def _records_for_double_backward(args: Sequence) -> bool:
    """Will autograd record this call (create_graph=True)?"""
    return torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)


def _per_sample(op: Callable, *args, **kwargs):
    """The op once per sample, stacked: vmap's slow fallback (B read as an int,
    a graph that grows with B), kept where only the op itself differentiates right."""
    return batch_rule(op)(lambda batch, *args, **kwargs: PER_SAMPLE)(*args, **kwargs)


@functools.cache
def decomposed_rules() -> dict[torch._ops.OpOverload, Callable]:
    """Ops batched through torch._decomp's decomposition: backward ops vmap would
    loop over (NOTE [Backward ops without a batching rule]) and _DECOMPOSED_INSTEAD."""
    table = _compat.decomposition_table()
    instead = [op for op in map(_aten_op, _DECOMPOSED_INSTEAD) if op is not None and op in table]
    rules = {op: table[op] for op in instead}
    for op, decomposition in table.items():
        if (
            isinstance(op, torch._ops.OpOverload)
            and op.namespace == "aten"
            and "backward" in _compat.op_schema(op).name
            and not op.is_view
            and not any(a.alias_info is not None and a.alias_info.is_write for a in _compat.op_schema(op).arguments)
            and not _compat.functorch_has_batch_rule(op)
        ):
            rules[op] = _per_sample_unless_first_order(op, decomposition)
    return rules


def _aten_op(name: str) -> torch._ops.OpOverload | None:
    """``aten::name.default``, or None (and the rule off, with a warning) where this torch lacks it."""
    try:
        return getattr(torch.ops.aten, name).default
    except AttributeError as e:
        fail_soft.hook_failed(f"the batching rule for aten::{name}", e)
        return None


def _attention_backwards() -> dict:
    return {op: _ATTENTION_BACKWARDS[name] for name in _ATTENTION_BACKWARDS
            if (op := _aten_op(name)) is not None}


@functools.cache
def all_rules() -> dict:
    samplewise = {op for op in map(_aten_op, _SAMPLEWISE_BACKWARDS) if op is not None}
    return {
        "slice_backward": slice_backward,
        "cat": cat,
        "gelu_backward": gelu_backward,
        "_cdist_backward": cdist_backward,
        "_unsafe_masked_index": unsafe_masked_index,
        "roll": roll,
        "mm": mm,
        "convolution": convolution,
        "convolution_backward": convolution_backward,
        "native_layer_norm_backward": native_layer_norm_backward,
        "native_batch_norm_backward": native_batch_norm_backward,
        "cudnn_batch_norm_backward": cudnn_batch_norm_backward,
        "miopen_batch_norm_backward": cudnn_batch_norm_backward,
        "native_group_norm_backward": native_group_norm_backward,
        "_scaled_dot_product_flash_attention_for_cpu_backward": sdpa_flash_cpu_backward,
        **{op: fold_attention_backward(op, *spec) for op, spec in _attention_backwards().items()},
        **{op: fold_batch_into_dim0(op) for op in samplewise},
        **decomposed_rules(),
    }


def prims_rules() -> dict:
    """Rules for ops of the ``prims`` namespace that backward graphs hold (Inductor's
    decompositions make them; its prims are defined once ``inductor_prims`` is imported)."""
    import torch._inductor.inductor_prims  # noqa: F401, PLC0415 - defines prims.fma

    return {"fma": fma, "convert_element_type": convert_element_type}


@contextlib.contextmanager
def symbolic_batch_rules() -> Iterator[None]:
    """Our rules in place of functorch's (or of its per-sample fallback), until the context exits."""
    with override_kernels("aten", all_rules(), "FuncTorchBatched"), \
            override_kernels("prims", prims_rules(), "FuncTorchBatched"):
        yield


@contextlib.contextmanager
def override_kernels(namespace: str, kernels: dict[Any, Callable], dispatch_key: str) -> Iterator[None]:
    """Register each ``op -> fn`` as the op's kernel for ``dispatch_key``; restore on exit.

    ``op`` is an OpOverload or an op name in ``namespace``.
    """
    lib = torch.library.Library(namespace, "IMPL")
    failed = []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Overriding a previously registered kernel" is the point
            for op, fn in kernels.items():
                try:
                    if isinstance(op, str) and not hasattr(getattr(torch.ops, namespace), op):
                        # The dispatcher would take an impl for a name it does not know, silently.
                        raise AttributeError(f"no operator {namespace}::{op}")
                    lib.impl(op, fn, dispatch_key)
                except Exception as e:  # noqa: BLE001 - an op gone from this torch keeps functorch's rule
                    failed.append((op, e))
        for op, e in failed:  # outside the block above, which silences warnings
            fail_soft.hook_failed(f"the batching rule for {namespace}::{op}", e)
        yield
    finally:
        _compat.drop_library(lib)  # the C++ kernels are in effect again
