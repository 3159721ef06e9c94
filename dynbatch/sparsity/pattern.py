"""The Jacobian pattern of an aten graph's output w.r.t. one input, with the call's values.

NOTE [Patterns follow the data]
A tensor's pattern says, for each of its elements (row-major), which elements of the
input ``x`` its value depends on: a CSR matrix of booleans, rows = elements, columns =
x's elements.  The graph runs on the call's real values beside the patterns, so an
index tensor (a neighbour list, a ``nonzero`` of a cutoff mask) moves rows as the data
says: ``x[i] - x[j]`` depends on rows i and j, an ``index_add`` by a neighbour list
sums rows into their atoms.  Integer and boolean tensors depend on nothing (their
derivative is zero), ``detach`` on what it detaches (a value computed from x still
depends on x).  Four kinds of rule: elementwise (the broadcast inputs' rows),
data movement (the op applied to element ids), reductions (rows summed into the reduced
element) and the products and scatters that mix both.  Any other op makes each output
element depend on everything its inputs depend on: a superset, never a miss, so the
values decompressed from it are always exact.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch.utils._pytree import tree_flatten, tree_map

aten = torch.ops.aten

# A pattern larger than this (entries) is not worth its memory: the caller goes dense.
MAX_ENTRIES = 60_000_000


class PatternTooDense(RuntimeError):
    """The pattern would exceed MAX_ENTRIES: a dense result is the cheaper one."""


@dataclass
class Pattern:
    """Rows (a tensor's elements, flattened) of column indices (x's elements), CSR."""

    crow: torch.Tensor  # int64 [m + 1]
    col: torch.Tensor  # int64 [nnz], sorted and unique within each row
    n: int
    no_rule: tuple[str, ...] = ()  # the ops met without a rule (jacobian_pattern's result only)

    @property
    def m(self) -> int:
        return self.crow.numel() - 1

    @property
    def nnz(self) -> int:
        return self.col.numel()

    @staticmethod
    def identity(n: int) -> Pattern:
        ids = torch.arange(n)
        return Pattern(torch.arange(n + 1), ids, n)

    @staticmethod
    def empty(m: int, n: int) -> Pattern:
        return Pattern(torch.zeros(m + 1, dtype=torch.long), torch.zeros(0, dtype=torch.long), n)

    @staticmethod
    def from_coo(rows: torch.Tensor, cols: torch.Tensor, m: int, n: int) -> Pattern:
        """Deduplicated, each row's columns sorted."""
        if rows.numel() > MAX_ENTRIES:
            raise PatternTooDense(f"{rows.numel()} entries before deduplication")
        key = torch.unique(rows * n + cols)  # sorted: by row, then column
        counts = torch.bincount(key // n, minlength=m)
        return Pattern(torch.cat([counts.new_zeros(1), counts.cumsum(0)]), key % n, n)

    def rows(self) -> torch.Tensor:
        """The row of each entry."""
        return torch.repeat_interleave(torch.arange(self.m), self.crow.diff())

    def pull(self, src: torch.Tensor) -> Pattern:
        """Row k becomes row ``src[k]`` (-1: an empty row): data movement."""
        src = src.reshape(-1)
        valid = src >= 0
        safe = src.clamp(min=0)
        counts = torch.where(valid, self.crow[safe + 1] - self.crow[safe], 0)
        crow = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
        total = int(crow[-1])
        if total > MAX_ENTRIES:
            raise PatternTooDense(f"{total} entries")
        starts = torch.repeat_interleave(self.crow[safe] - crow[:-1], counts)
        return Pattern(crow, self.col[starts + torch.arange(total)], self.n)

    def push(self, dst: torch.Tensor, m: int) -> Pattern:
        """Row ``dst[j]`` gathers row j (-1: dropped): a reduction into m rows."""
        dst = dst.reshape(-1)
        rows = dst[self.rows()]
        keep = rows >= 0
        return Pattern.from_coo(rows[keep], self.col[keep], m, self.n)

    @staticmethod
    def union(patterns: list[Pattern]) -> Pattern:
        if len(patterns) == 1:
            return patterns[0]
        m, n = patterns[0].m, patterns[0].n
        return Pattern.from_coo(torch.cat([p.rows() for p in patterns]), torch.cat([p.col for p in patterns]), m, n)

    def to_coo(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rows(), self.col


# --- the rules' op lists --------------------------------------------------------------

# Ops whose tensor argument gives only a shape, dtype or device.
_METADATA_ONLY = {
    aten.new_zeros.default, aten.new_ones.default, aten.new_empty.default, aten.new_full.default,
    aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default, aten.full_like.default,
    aten.rand_like.default, aten.randn_like.default, aten.new_empty_strided.default,
    aten.sym_size.int, aten.sym_numel.default, aten.sym_stride.int,
}

# Elementwise beyond the ``pointwise`` tag: casts and copies.
_ELEMENTWISE = {
    aten._to_copy.default, aten.detach.default, aten.alias.default, aten.lift_fresh_copy.default,
    aten.copy.default, aten.masked_fill.Tensor, aten.masked_fill.Scalar, aten.where.self,
    aten.clone.default, aten.to.dtype, aten.fill.Scalar,
    # activations' backward kernels, elementwise but untagged
    aten.softplus_backward.default, aten.elu_backward.default, aten.hardtanh_backward.default,
    aten.leaky_relu_backward.default, aten.log_sigmoid_backward.default, aten.mish_backward.default,
    aten.hardswish_backward.default, aten.hardsigmoid_backward.default,
    aten.softshrink_backward.default, aten.hardshrink_backward.default, aten.rrelu_with_noise_backward.default,
}

# Data movement: applied to element ids, the output says which element each came from.
_MOVES = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.permute.default,
    aten.transpose.int, aten.t.default, aten.expand.default, aten.unsqueeze.default,
    aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.select.int, aten.slice.Tensor,
    aten.index_select.default, aten.gather.default, aten.index.Tensor, aten.narrow.default,
    aten.flip.default, aten.roll.default, aten.repeat.default, aten.cat.default, aten.stack.default,
    aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int, aten.chunk.default,
    aten.diagonal.default, aten.movedim.int, aten.unfold.default, aten.view_as.default,
    aten.expand_as.default, aten.contiguous.default, aten.as_strided.default,
}

# Placements into zeros: applied to ids + 1 as floats, a zero is an element from nowhere.
_PLACEMENTS = {
    aten.select_backward.default, aten.slice_backward.default, aten.diagonal_backward.default,
    aten.select_scatter.default, aten.slice_scatter.default, aten.diagonal_scatter.default,
    aten.constant_pad_nd.default, aten.as_strided_scatter.default,
}

# Reductions over dims (args: self, dim, keepdim); the ``.default`` forms reduce everything.
_REDUCTIONS = {
    aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default, aten.prod.dim_int,
    aten.linalg_vector_norm.default, aten.logsumexp.default, aten.var.correction, aten.std.correction,
    aten.max.dim, aten.min.dim, aten.norm.ScalarOpt_dim,
}
_FULL_REDUCTIONS = {aten.sum.default, aten.mean.default, aten.prod.default, aten.max.default,
                    aten.min.default, aten.norm.Scalar}

# Each element depends on its whole slice along ``dim`` (args: ..., dim after the tensors).
_ALONG_DIM = {aten._softmax.default: 1, aten._log_softmax.default: 1,
              aten._softmax_backward_data.default: 2, aten._log_softmax_backward_data.default: 2,
              aten.cumsum.default: 1, aten.cumprod.default: 1}


def _is_float(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.dtype.is_floating_point or t.dtype.is_complex)


def _ids(t: torch.Tensor, offset: int = 0) -> torch.Tensor:
    return torch.arange(offset, offset + t.numel()).view(t.shape)


class _Propagation(torch.fx.Interpreter):
    """Runs the graph on real values and, beside each float tensor, its pattern."""

    def __init__(self, gm: torch.fx.GraphModule, wrt: int, n: int) -> None:
        super().__init__(gm)
        self.wrt, self.n = wrt, n
        self.patterns: dict[torch.fx.Node, Any] = {}
        self.no_rule: set[str] = set()
        self._placeholder = 0
        last_use: dict[torch.fx.Node, torch.fx.Node] = {}
        for node in gm.graph.nodes:
            for inp in node.all_input_nodes:
                last_use[inp] = node
        self._frees: dict[torch.fx.Node, list[torch.fx.Node]] = {}
        for inp, user in last_use.items():
            self._frees.setdefault(user, []).append(inp)

    def run_node(self, n: torch.fx.Node) -> Any:
        value = super().run_node(n)
        if n.op == "placeholder":
            self.patterns[n] = Pattern.identity(self.n) if self._placeholder == self.wrt else None
            self._placeholder += 1
        elif n.op == "call_function":
            self.patterns[n] = self._rule(n, value)
        elif n.op == "output":
            self.patterns[n] = tree_map(lambda a: self.patterns.get(a) if isinstance(a, torch.fx.Node) else None,
                                        n.args[0])
        else:
            self.patterns[n] = None
        for dead in self._frees.get(n, ()):
            if n.op != "output":
                self.patterns.pop(dead, None)
        return value

    # -- the rules ----------------------------------------------------------------------

    def _arg_patterns(self, n: torch.fx.Node) -> tuple[list[Any], list[Any]]:
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        pats = [self.patterns.get(a) for a in n.all_input_nodes]
        return [args, kwargs], pats

    def _rule(self, n: torch.fx.Node, value: Any) -> Any:
        if n.target is operator.getitem:
            src = self.patterns.get(n.args[0])
            return src[n.args[1]] if isinstance(src, (tuple, list)) else None
        (args, kwargs), pats = self._arg_patterns(n)
        if all(p is None for p in pats) or n.target in _METADATA_ONLY:
            return None
        outs, _ = tree_flatten(value)
        if not any(_is_float(o) for o in outs):
            return None
        op = n.target
        if op in _MOVES:
            return self._moves(n, args, kwargs, value, placements=False)
        if op in _PLACEMENTS:
            return self._moves(n, args, kwargs, value, placements=True)
        if isinstance(op, torch._ops.OpOverload) and (torch.Tag.pointwise in op.tags or op in _ELEMENTWISE):
            return self._elementwise(n, args, kwargs, value)
        if op in _REDUCTIONS or op in _FULL_REDUCTIONS:
            return self._reduction(n, args, value)
        if op in _ALONG_DIM:
            return self._along_dim(n, args, value)
        if op in (aten.mm.default, aten.bmm.default, aten.addmm.default, aten.baddbmm.default):
            return self._product(n, args, value)
        if op in (aten.index_add.default, aten.index_copy.default):
            return self._index_add(n, args, value)
        if op in (aten.index_put.default, aten._unsafe_index_put.default):
            return self._index_put(n, args, value)
        if op in (aten.scatter_add.default, aten.scatter.src, aten.scatter_reduce.two, aten.scatter.value):
            return self._scatter(n, args, value)
        return self._everything(n, value)

    def _pattern_of(self, a: Any) -> Pattern | None:
        return self.patterns.get(a) if isinstance(a, torch.fx.Node) else None

    def _everything(self, n: torch.fx.Node, value: Any) -> Any:
        """No rule: every output element depends on all its inputs depend on."""
        self.no_rule.add(str(n.target))
        cols = torch.unique(torch.cat([p.col for p in (self.patterns.get(a) for a in n.all_input_nodes)
                                       if isinstance(p, Pattern)] or [torch.zeros(0, dtype=torch.long)]))

        def full(o):
            if not _is_float(o):
                return None
            if o.numel() * cols.numel() > MAX_ENTRIES:
                raise PatternTooDense(f"{n.target} has no rule: {o.numel()} x {cols.numel()} entries")
            crow = torch.arange(o.numel() + 1) * cols.numel()
            return Pattern(crow, cols.repeat(o.numel()), self.n)

        return tree_map(full, value) if isinstance(value, (tuple, list)) else full(value)

    def _elementwise(self, n, args, kwargs, value) -> Pattern:
        parts = []
        for a, v in zip(*_tensor_args(n, args, kwargs)):
            p = self._pattern_of(a)
            if p is not None and p.nnz:
                parts.append(p.pull(_ids(v).expand(value.shape)))
        return Pattern.union(parts) if parts else None

    def _moves(self, n, args, kwargs, value, placements: bool) -> Any:
        """The op on the float inputs' element ids (offset one input after the other)."""
        stacked, offset, parts = {}, 0, []

        def to_ids(v):
            nonlocal offset
            if not _is_float(v) or id(v) in stacked:
                return stacked.get(id(v), v)
            ids = _ids(v, offset)
            offset += v.numel()
            stacked[id(v)] = (ids + 1).double() if placements else ids
            return stacked[id(v)]

        nodes, values = _tensor_args(n, args, kwargs)
        for a, v in zip(nodes, values):
            if _is_float(v) and id(v) not in stacked:
                to_ids(v)
                p = self._pattern_of(a)
                parts.append(p if p is not None else Pattern.empty(v.numel(), self.n))
        ids_args = tree_map(lambda v: stacked.get(id(v), v) if isinstance(v, torch.Tensor) else v, args)
        if n.target is aten.constant_pad_nd.default:
            ids_args = [ids_args[0], ids_args[1], 0.0]
        moved = n.target(*ids_args, **kwargs)
        table = _stack(parts, self.n)

        def pull(ids):
            src = ids.reshape(-1)
            src = (src.long() - 1) if placements else src
            return table.pull(src)

        return tree_map(pull, moved) if isinstance(moved, (tuple, list)) else pull(moved)

    def _reduction(self, n, args, value) -> Any:
        x = args[0]
        p = self._pattern_of(n.args[0])
        if p is None:
            return None
        if n.target in _FULL_REDUCTIONS or (len(args) > 1 and args[1] in (None, [])):
            reduced = p.push(torch.zeros(x.numel(), dtype=torch.long), 1)
            return reduced if not isinstance(value, tuple) else (reduced, None)
        dims = args[1] if isinstance(args[1], (list, tuple)) else [args[1]]
        if n.target is aten.linalg_vector_norm.default or n.target is aten.norm.ScalarOpt_dim:
            dims = args[2] if len(args) > 2 and args[2] is not None else list(range(x.dim()))
            dims = dims if isinstance(dims, (list, tuple)) else [dims]
        dst = _reduced_index(x.shape, dims)
        reduced = p.push(dst, int(dst.max()) + 1 if dst.numel() else 0)
        return (reduced, None) if isinstance(value, tuple) else reduced

    def _along_dim(self, n, args, value) -> Pattern:
        dim = args[_ALONG_DIM[n.target]]
        parts = []
        for a, v in zip(n.args[:_ALONG_DIM[n.target]], args[:_ALONG_DIM[n.target]]):
            p = self._pattern_of(a)
            if p is not None and _is_float(v):
                dst = _reduced_index(v.shape, [dim])
                parts.append(p.push(dst, int(dst.max()) + 1).pull(dst))
        return Pattern.union(parts)

    def _product(self, n, args, value) -> Pattern:
        """``a @ b`` (batched or with a bias): out[.., i, j] depends on a's row i and b's column j."""
        bias = None
        if n.target in (aten.addmm.default, aten.baddbmm.default):
            bias, args, nodes = args[0], args[1:3], n.args[1:3]
        else:
            args, nodes = args[:2], n.args[:2]
        (a, b), (pa, pb) = args, [self._pattern_of(x) for x in nodes]
        out = _ids(value)
        batch = out.shape[:-2]
        rows_out = (out // out.shape[-1])  # (batch, i) of each output element
        cols_out = (out // (out.shape[-1] * out.shape[-2])) * out.shape[-1] + out % out.shape[-1]  # (batch, j)
        parts = []
        if pa is not None and pa.nnz:
            row_of_a = _ids(a) // a.shape[-1]  # (batch, i)
            parts.append(pa.push(row_of_a, int(batch.numel() * a.shape[-2])).pull(rows_out))
        if pb is not None and pb.nnz:
            bi = _ids(b)
            col_of_b = (bi // (b.shape[-1] * b.shape[-2])) * b.shape[-1] + bi % b.shape[-1]
            parts.append(pb.push(col_of_b, int(batch.numel() * b.shape[-1])).pull(cols_out))
        if bias is not None and self._pattern_of(n.args[0]) is not None:
            parts.append(self._pattern_of(n.args[0]).pull(_ids(bias).expand(value.shape)))
        return Pattern.union(parts) if parts else None

    def _with_self(self, n, value, parts) -> Pattern | None:
        p = self._pattern_of(n.args[0])
        if p is not None:
            parts.append(p)
        parts = [q for q in parts if q is not None]
        return Pattern.union(parts) if parts else None

    def _index_add(self, n, args, value) -> Pattern | None:
        dim, index = args[1], args[2]
        ps = self._pattern_of(n.args[3])
        parts = []
        if ps is not None:
            target = _ids(value).index_select(dim, index)
            parts.append(ps.push(target, value.numel()))
        return self._with_self(n, value, parts)

    def _index_put(self, n, args, value) -> Pattern | None:
        indices, values = args[1], args[2]
        pv = self._pattern_of(n.args[2])
        parts = []
        if pv is not None:
            target = _ids(value)[tuple(indices)]
            parts.append(pv.pull(_ids(values).expand(target.shape)).push(target, value.numel()))
        return self._with_self(n, value, parts)

    def _scatter(self, n, args, value) -> Pattern | None:
        dim, index = args[1], args[2]
        parts = []
        if n.target is not aten.scatter.value:
            src, ps = args[3], self._pattern_of(n.args[3])
            if ps is not None:
                target = _ids(value).gather(dim, index)
                used = _ids(src)[tuple(slice(0, s) for s in index.shape)]
                parts.append(ps.pull(used).push(target, value.numel()))
        return self._with_self(n, value, parts)


def _tensor_args(n: torch.fx.Node, args, kwargs) -> tuple[list[Any], list[Any]]:
    """The node's tensor arguments (flattened, lists included), with their values."""
    nodes, _ = tree_flatten((n.args, n.kwargs))
    values, _ = tree_flatten((args, kwargs))
    pairs = [(a, v) for a, v in zip(nodes, values) if isinstance(v, torch.Tensor)]
    return [a for a, _ in pairs], [v for _, v in pairs]


def _stack(parts: list[Pattern], n: int) -> Pattern:
    if len(parts) == 1:
        return parts[0]
    crows, offset = [parts[0].crow[:1]], 0
    for p in parts:
        crows.append(p.crow[1:] + offset)
        offset += p.nnz
    return Pattern(torch.cat(crows), torch.cat([p.col for p in parts]), n)


def _reduced_index(shape: torch.Size, dims) -> torch.Tensor:
    """For each element of a tensor of ``shape``, the index of the element it reduces into."""
    ndim = len(shape)
    dims = {d % ndim for d in dims} if ndim else set()
    kept = [1 if d in dims else s for d, s in enumerate(shape)]
    return torch.arange(max(1, int(torch.Size(kept).numel()))).view(kept).expand(shape)


def jacobian_pattern(gm: torch.fx.GraphModule, args: list[Any], wrt: int = 0) -> Pattern:
    """The pattern of the graph's (single, float) output w.r.t. its input ``wrt``, at ``args``."""
    n = args[wrt].numel()
    prop = _Propagation(gm, wrt, n)
    (value,) = tree_flatten(prop.run(*args))[0]
    output = next(iter(reversed(gm.graph.nodes)))
    (pattern,) = tree_flatten(prop.patterns[output], is_leaf=lambda p: p is None or isinstance(p, Pattern))[0]
    pattern = pattern if pattern is not None else Pattern.empty(value.numel(), n)
    return dataclasses.replace(pattern, no_rule=tuple(sorted(prop.no_rule)))
