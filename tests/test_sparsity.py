"""Sparse Hessians and Jacobians: the pattern found in the graph, the colouring, the
compressed batched grads (dynbatch/sparsity/).  Patterns are checked against eager's
dense derivatives (a superset of their nonzeros, exact where the rules are), values
against ``torch.autograd.functional`` (float64), and each compiled call by dynbatch's
counters: which path ran, how many colours, and that a repeat compiles nothing."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.autograd.functional as AF
from torch.fx.experimental.proxy_tensor import make_fx

import dynbatch
from conftest import AOT_EAGER
from dynbatch.bench import sparse_problems as sp
from dynbatch.sparsity import colouring, compressed
from dynbatch.sparsity.pattern import Pattern, jacobian_pattern

pytestmark = pytest.mark.skipif(not colouring.available(), reason="no C compiler for the colouring")


def _dense(p: Pattern) -> torch.Tensor:
    d = torch.zeros(p.m, p.n, dtype=torch.bool)
    r, c = p.to_coo()
    d[r, c] = True
    return d


def _grad_of(f):
    def g(x, *args):
        x = x.detach().requires_grad_()
        return torch.autograd.grad(f(x, *args), x)[0]
    return g


def _mlp_energy(x, w1, w2):
    # a per-atom MLP: the Hessian is block diagonal (mm, tanh, sum over the features)
    return (torch.tanh(x @ w1) @ w2).sum()


def _softplus_energy(x, w1, w2):
    # softplus_backward carries no pointwise tag: its own rule keeps the blocks
    return (torch.nn.functional.softplus(x @ w1) @ w2).sum()


def _softmax_rows(x):
    return torch.softmax(x, -1) * x.cumsum(0)


def _solve(x):
    # no rule for linalg_solve: every element depends on all (the superset)
    a = torch.eye(x.shape[0], dtype=x.dtype) * 3 + x[:, :1]
    return torch.linalg.solve(a, x).sin()


def _cases():
    torch.manual_seed(0)
    x, (i, j) = sp.lennard_jones_problem(27, cutoff=1.6)
    model, pos, (mi, mj) = sp.message_passing_problem(64)
    u, s = sp.poisson_problem(5)
    w1, w2 = torch.randn(3, 6, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    y = torch.randn(4, 5, dtype=torch.float64)
    return {  # (kind, function, args, whether the rules find the exact pattern)
        "lennard_jones_hessian": ("hessian", sp.lennard_jones, (x, i, j), True),
        "message_passing_hessian": ("hessian", model, (pos, mi, mj), False),
        "poisson_jacobian": ("jacobian", sp.poisson_residual, (u, s), True),
        "mlp_hessian": ("hessian", _mlp_energy, (x, w1, w2), True),
        "softplus_hessian": ("hessian", _softplus_energy, (x, w1, w2), True),
        "softmax_cumsum_jacobian": ("jacobian", _softmax_rows, (y,), False),
        "no_rule_jacobian": ("jacobian", _solve, (y[:, :4].clone(),), False),
    }


CASES = _cases()


@pytest.mark.parametrize("name", list(CASES))
def test_the_pattern_covers_every_nonzero_of_eagers_jacobian(name):
    kind, fn, args, exact = CASES[name]
    traced = _grad_of(fn) if kind == "hessian" else fn
    pattern = jacobian_pattern(make_fx(traced)(*args), list(args))
    eager = getattr(AF, kind)(lambda t: fn(t, *args[1:]), args[0]).reshape(pattern.m, pattern.n) != 0
    found = _dense(pattern)
    assert bool((eager <= found).all()), f"{int((eager & ~found).sum())} nonzeros missed"
    if exact:
        assert torch.equal(found, eager)
    else:
        assert found.sum() < found.numel() or name == "no_rule_jacobian"


def test_an_op_without_a_rule_depends_on_everything():
    _, fn, args, _ = CASES["no_rule_jacobian"]
    pattern = jacobian_pattern(make_fx(fn)(*args), list(args))
    assert pattern.nnz == pattern.m * pattern.n


def _bicoloured_p4(adj: torch.Tensor, colour: torch.Tensor) -> bool:
    n = adj.shape[0]
    nbrs = [adj[v].nonzero().flatten().tolist() for v in range(n)]
    for a in range(n):
        for b in nbrs[a]:
            for c in nbrs[b]:
                if c == a:
                    continue
                for d in nbrs[c]:
                    if d in (a, b):
                        continue
                    if colour[a] == colour[c] and colour[b] == colour[d]:
                        return True
    return False


@pytest.mark.parametrize("seed", range(4))
def test_star_colouring_is_proper_and_leaves_no_bicoloured_path_on_four_vertices(seed):
    gen = torch.Generator().manual_seed(seed)
    n = 40
    adj = torch.rand(n, n, generator=gen) < 0.12
    adj = (adj | adj.T) & ~torch.eye(n, dtype=torch.bool)
    rows, cols = adj.nonzero().T
    colour = colouring.star_colouring(Pattern.from_coo(rows, cols, n, n))
    assert not bool((colour[rows] == colour[cols]).any())
    assert not _bicoloured_p4(adj, colour)


def test_row_colouring_never_shares_a_colour_between_rows_sharing_a_column():
    gen = torch.Generator().manual_seed(0)
    dense = torch.rand(60, 50, generator=gen) < 0.08
    rows, cols = dense.nonzero().T
    colour = colouring.row_colouring(Pattern.from_coo(rows, cols, 60, 50))
    share = (dense.double() @ dense.double().T) > 0
    same = colour[:, None] == colour[None, :]
    assert not bool((share & same & ~torch.eye(60, dtype=torch.bool)).any())


def _counts():
    c = dynbatch.counters()
    return {k: c.get(k, 0) for k in ("graphs", "grads_compressed", "grads_dense_rows", "colours", "rows")}


def test_lennard_jones_hessian_compressed_equals_eager_and_a_repeat_compiles_nothing():
    x, (i, j) = sp.lennard_jones_problem(64, cutoff=1.6)
    want = AF.hessian(lambda t: sp.lennard_jones(t, i, j), x)
    got = dynbatch.hessian(sp.lennard_jones, x, i, j, sparse=True, options=AOT_EAGER)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-10)
    first = _counts()
    assert first["grads_compressed"] == 1 and first["grads_dense_rows"] == 0
    assert first["rows"] == x.numel() and 0 < first["colours"] < x.numel() / 2
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    again = dynbatch.hessian(sp.lennard_jones, x, i, j, sparse=True, options=AOT_EAGER)
    torch.testing.assert_close(again, want, rtol=1e-12, atol=1e-10)
    assert _counts()["graphs"] == first["graphs"]
    # the same neighbour list: the plan comes from the inputs' digest, no trace
    c = dynbatch.counters()
    assert c["sparse_traces"] == 1 and c["sparse_plans"] == 1, c
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames
    # Other pairs (as many), another colour count: B is symbolic, nothing recompiles.
    i2, j2 = i.clone(), j.clone()
    i2[::2], j2[::2] = i[0], j[0]
    got = dynbatch.hessian(sp.lennard_jones, x, i2, j2, sparse=True, options=AOT_EAGER)
    torch.testing.assert_close(got, AF.hessian(lambda t: sp.lennard_jones(t, i2, j2), x), rtol=1e-12, atol=1e-10)
    second = _counts()
    assert second["colours"] - first["colours"] not in (0, first["colours"])  # a new pattern's count
    assert second["graphs"] == first["graphs"]
    assert dynbatch.counters()["sparse_plans"] == 2


def test_the_dense_rows_and_the_compressed_ones_agree_and_csr_holds_the_same_values():
    x, (i, j) = sp.lennard_jones_problem(27, cutoff=1.6)
    dense = dynbatch.hessian(sp.lennard_jones, x, i, j, sparse=False, options=AOT_EAGER)
    assert _counts()["grads_dense_rows"] == 1
    csr = dynbatch.hessian(sp.lennard_jones, x, i, j, sparse=True, layout=torch.sparse_csr, options=AOT_EAGER)
    assert csr.layout == torch.sparse_csr and csr.shape == (81, 81)
    torch.testing.assert_close(csr.to_dense(), dense.reshape(81, 81), rtol=1e-12, atol=1e-10)


def test_message_passing_hessian_in_a_periodic_box():
    model, pos, (i, j) = sp.message_passing_problem(125)
    got = dynbatch.hessian(model, pos, i, j, sparse=True, options=AOT_EAGER)
    want = AF.hessian(lambda t: model(t, i, j), pos)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    c = _counts()
    assert c["grads_compressed"] == 1 and c["colours"] < c["rows"]


def test_poisson_jacobian_by_row_colours():
    u, s = sp.poisson_problem(12)
    got = dynbatch.jacobian(sp.poisson_residual, u, s, options=AOT_EAGER)  # "auto"
    torch.testing.assert_close(got, AF.jacobian(lambda t: sp.poisson_residual(t, s), u), rtol=1e-12, atol=1e-12)
    c = _counts()
    assert c["grads_compressed"] == 1 and c["colours"] <= 10 and c["rows"] == 144


def test_auto_stays_dense_where_colours_do_not_pay():
    y = torch.randn(4, 5, dtype=torch.float64)
    got = dynbatch.jacobian(_softmax_rows, y, options=AOT_EAGER)
    torch.testing.assert_close(got, AF.jacobian(_softmax_rows, y))
    assert _counts()["grads_dense_rows"] == 1 and _counts()["grads_compressed"] == 0


def test_an_ambiguous_colouring_goes_dense_with_a_warning(monkeypatch, caplog):
    x, (i, j) = sp.lennard_jones_problem(27, cutoff=1.6)
    monkeypatch.setattr(colouring, "star_colouring", lambda p: torch.zeros(p.n, dtype=torch.long))
    compressed.clear_caches()
    with caplog.at_level(logging.WARNING, logger="dynbatch"):
        got = dynbatch.hessian(sp.lennard_jones, x, i, j, sparse=True, options=AOT_EAGER)
    compressed.clear_caches()
    torch.testing.assert_close(got, AF.hessian(lambda t: sp.lennard_jones(t, i, j), x), rtol=1e-12, atol=1e-10)
    assert "ambiguous" in caplog.text and _counts()["grads_dense_rows"] == 1


def test_a_pattern_that_follows_the_values_is_found_again_each_call():
    """A cutoff applied inside the function (``nonzero`` of a mask): the pattern is the
    call's, recomputed when the positions move pairs in or out."""
    def cut_energy(x, i, j):
        d = x[i] - x[j]
        r2 = (d * d).sum(-1)
        near = (r2 < 1.6 ** 2).nonzero().squeeze(1)
        inv6 = 1 / r2[near] ** 3
        return (4 * (inv6 * inv6 - inv6)).sum()

    x, (i, j) = sp.lennard_jones_problem(27, cutoff=2.5)
    for pos in (x, x, x * 1.08):
        got = dynbatch.hessian(cut_energy, pos, i, j, sparse=True, options=AOT_EAGER)
        torch.testing.assert_close(got, AF.hessian(lambda t: cut_energy(t, i, j), pos), rtol=1e-12, atol=1e-10)
    assert not compressed._BY_INPUTS.get(cut_energy)  # never keyed by the inputs alone
    c = dynbatch.counters()
    # traced at every call; the same positions keep their plan, moved ones (pairs in or out) plan anew
    assert c["sparse_traces"] == 3 and c["sparse_plans"] == 2, c


def test_bad_layout_raises_as_a_user_error():
    with pytest.raises(ValueError, match="layout"):
        dynbatch.hessian(sp.lennard_jones, torch.zeros(2, 3), torch.tensor([0]), torch.tensor([1]),
                         layout=torch.sparse_coo)


def test_the_bench_table_prints_each_column_against_dense():
    from dynbatch.bench import sparse_hessian

    rows = [{"column": "dynbatch_dense", "atoms": 500, "pairs": 13411, "first_s": 8.0, "steady_s": 0.3,
             "peak_growth_mib": 30.0},
            {"column": "dynbatch_sparse", "atoms": 500, "pairs": 13411, "first_s": 9.0, "steady_s": 0.1,
             "peak_growth_mib": 20.0, "colours": 273, "max_diff_from_dense": 1e-13},
            {"column": "asdex", "atoms": 500, "error": "ModuleNotFoundError: No module named 'asdex'"}]
    text = sparse_hessian.table(rows)
    assert "| 500 (13411) | dynbatch_sparse | 9.00 | 0.100 | 0.33 | 273 | 20 | 1.0e-13 | - |" in text
    assert "failed: ModuleNotFoundError" in text


def test_writes_in_place_are_followed():
    """A buffer written in place after a view of it was taken (``index_add_``, ``mul_``): the
    trace is functionalized first, so the view's reads see the writes, and the writes keep
    their rules (unfunctionalized, each in-place op depended on everything)."""
    def energy(x, i, j):
        buf = torch.zeros_like(x)
        head = buf[:, 0]  # a view read before the writes
        d = x[i] - x[j]
        buf.index_add_(0, i, d * d)
        buf.mul_(x.sin())
        return (head * x[:, 1]).sum()  # only through the view

    x, (i, j) = sp.lennard_jones_problem(27, cutoff=1.6)
    got = dynbatch.hessian(energy, x, i, j, sparse=True, options=AOT_EAGER)
    torch.testing.assert_close(got, AF.hessian(lambda t: energy(t, i, j), x), rtol=1e-12, atol=1e-10)
    c = _counts()
    assert c["grads_compressed"] == 1 and c["colours"] < c["rows"] / 2, c


SPARSE = {**AOT_EAGER, "dynbatch.sparse": True}


class _ScaledLennardJones(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.epsilon = torch.nn.Parameter(torch.tensor(1.3, dtype=torch.float64))

    def forward(self, x, i, j):
        return self.epsilon * sp.lennard_jones(x, i, j)


def test_functional_hessian_inside_a_compiled_function_by_colours():
    """``dynbatch.sparse``: functional.hessian(vectorize=True) in one compiled graph runs as
    a star-coloured Hessian (NOTE [Identity grads by colours]), a parameter that requires
    grad read from outside; a repeat compiles nothing."""
    model = _ScaledLennardJones()
    pos, (i, j) = sp.lennard_jones_problem(64, cutoff=1.6)

    def hessian(p, i, j):
        return AF.hessian(lambda t: model(t, i, j), p, vectorize=True)

    compiled = torch.compile(hessian, backend="dynbatch", fullgraph=True, options=SPARSE)
    want = hessian(pos, i, j)
    torch.testing.assert_close(compiled(pos, i, j), want, rtol=1e-10, atol=1e-12)
    first = _counts()
    assert dynbatch.counters()["grads_structured"] == 1 and first["grads_compressed"] == 1
    assert first["colours"] < first["rows"] == pos.numel()
    torch.testing.assert_close(compiled(pos, i, j), want, rtol=1e-10, atol=1e-12)
    assert _counts()["graphs"] == first["graphs"]


def test_functional_jacobian_inside_a_compiled_function_by_colours():
    u, s = sp.poisson_problem(12)

    def jacobian(u, s):
        return AF.jacobian(lambda t: sp.poisson_residual(t, s), u, vectorize=True)

    got = torch.compile(jacobian, backend="dynbatch", fullgraph=True, options=SPARSE)(u, s)
    torch.testing.assert_close(got, jacobian(u, s), rtol=1e-12, atol=1e-12)
    c = _counts()
    assert c["grads_compressed"] == 1 and c["colours"] <= 10 and c["rows"] == 144


def _hessian_rows(x, i, j, v):
    x = x.detach().requires_grad_()
    g = torch.autograd.grad(sp.lennard_jones(x, i, j), x, create_graph=True)[0].reshape(-1)
    return torch.autograd.grad(g, x, v, is_grads_batched=True)[0]


@pytest.mark.parametrize("sparse", [True, "auto"])
def test_other_seeds_take_the_batched_grad_uncompressed(sparse):
    """Random seeds (the README's batched VJP): with True the op runs them through its
    batched grad uncompressed; "auto" leaves the grad in the graph and tries no colouring."""
    x, (i, j) = sp.lennard_jones_problem(125, cutoff=1.6)
    seeds = torch.randn(7, 375, dtype=torch.float64)
    got = torch.compile(_hessian_rows, backend="dynbatch", fullgraph=True,
                        options={**AOT_EAGER, "dynbatch.sparse": sparse})(x, i, j, seeds)
    want = torch.stack([_hessian_rows(x, i, j, v[None])[0] for v in seeds])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-10)
    c = dynbatch.counters()
    assert "grads_compressed" not in c, c
    if sparse is True:
        assert c["grads_structured"] == 1, c
    else:
        assert "grads_structured" not in c and "sparse_traces" not in c and c["grads_batched"] == 1, c


def _compiled_hessian(options):
    return torch.compile(lambda x, i, j: AF.hessian(lambda t: sp.lennard_jones(t, i, j), x, vectorize=True),
                         backend="dynbatch", fullgraph=True, options=options)


def test_auto_keeps_a_small_hessians_batched_grad_in_the_graph():
    """24 rows: fewer than the op's fixed cost pays for, so "auto" (the default) keeps the
    batched grad fused in the graph, counted."""
    x, (i, j) = sp.lennard_jones_problem(8, cutoff=1.6)
    torch.testing.assert_close(_compiled_hessian(AOT_EAGER)(x, i, j), AF.hessian(lambda t: sp.lennard_jones(t, i, j), x))
    c = dynbatch.counters()
    assert "grads_structured" not in c and c["grads_batched"] == 1 and c["grads_identity_dense"] == 1, c


def test_auto_keeps_a_dense_hessians_batched_grad_in_the_graph(caplog):
    """Every pair within reach: as many colours as rows, so the batched grad stays fused,
    logged with the colours."""
    x, (i, j) = sp.lennard_jones_problem(125, cutoff=100.0)
    with caplog.at_level(logging.INFO, logger="dynbatch"):
        got = _compiled_hessian(AOT_EAGER)(x, i, j)
    torch.testing.assert_close(got, AF.hessian(lambda t: sp.lennard_jones(t, i, j), x), rtol=1e-12, atol=1e-10)
    c = dynbatch.counters()
    assert "grads_structured" not in c and c["grads_batched"] == 1 and c["grads_identity_dense"] == 1, c
    assert "kept its batched grad: 375 colours for 375 rows" in caplog.text


def test_auto_compresses_a_sparse_hessian_inside_a_compiled_function():
    """No option: the pattern at the first call's values has few colours, so the
    identity grad runs by colours; a repeat compiles nothing; False keeps the batched grad."""
    x, (i, j) = sp.lennard_jones_problem(125, cutoff=1.6)
    want = AF.hessian(lambda t: sp.lennard_jones(t, i, j), x)
    h = _compiled_hessian(AOT_EAGER)
    torch.testing.assert_close(h(x, i, j), want, rtol=1e-12, atol=1e-10)
    first = _counts()
    assert dynbatch.counters()["grads_structured"] == 1 and first["grads_compressed"] == 1, first
    assert first["colours"] * 2 < first["rows"] == x.numel()
    torch.testing.assert_close(h(x, i, j), want, rtol=1e-12, atol=1e-10)
    assert _counts()["graphs"] == first["graphs"] and _counts()["grads_compressed"] == 2
    dynbatch.reset()
    torch._dynamo.reset()
    torch.testing.assert_close(_compiled_hessian({**AOT_EAGER, "dynbatch.sparse": False})(x, i, j), want,
                               rtol=1e-12, atol=1e-10)
    assert "grads_structured" not in dynbatch.counters() and dynbatch.counters()["grads_batched"] == 1


def test_auto_compresses_under_dynamic_shapes_across_atom_counts():
    """dynamic=True: the identity's sizes are symbols (one size node twice); the graph
    compiles once for both atom counts and each call runs by its own colours."""
    h = torch.compile(lambda x, i, j: AF.hessian(lambda t: sp.lennard_jones(t, i, j), x, vectorize=True),
                      backend="dynbatch", fullgraph=True, dynamic=True, options=AOT_EAGER)
    for atoms in (125, 216):
        x, (i, j) = sp.lennard_jones_problem(atoms, cutoff=1.6)
        torch.testing.assert_close(h(x, i, j), AF.hessian(lambda t: sp.lennard_jones(t, i, j), x),
                                   rtol=1e-12, atol=1e-10)
    c = dynbatch.counters()
    assert c["grads_structured"] == 1 and c["grads_compressed"] == 2 and c["rows"] == 3 * (125 + 216), c


def test_auto_compresses_is_grads_batched_over_torch_eye():
    x, (i, j) = sp.lennard_jones_problem(125, cutoff=1.6)

    def hessian(x, i, j):
        x = x.detach().requires_grad_()
        g = torch.autograd.grad(sp.lennard_jones(x, i, j), x, create_graph=True)[0].reshape(-1)
        return torch.autograd.grad(g, x, torch.eye(g.numel(), dtype=x.dtype), is_grads_batched=True)[0]

    got = torch.compile(hessian, backend="dynbatch", fullgraph=True, options=AOT_EAGER)(x, i, j)
    torch.testing.assert_close(got, AF.hessian(lambda t: sp.lennard_jones(t, i, j), x).reshape(375, 125, 3),
                               rtol=1e-12, atol=1e-10)
    assert _counts()["grads_compressed"] == 1


def test_auto_compresses_maces_vmap_over_an_eye():
    """MACE's Hessian idiom inside the compiled function: ``torch.vmap`` of a grad of the
    forces over an identity becomes a batched grad, then runs by (row) colours."""
    x, (i, j) = sp.lennard_jones_problem(125, cutoff=1.6)

    def hessian(x, i, j):
        x = x.detach().requires_grad_()
        forces = -torch.autograd.grad(sp.lennard_jones(x, i, j), x, create_graph=True)[0]
        eye = torch.eye(x.numel(), dtype=x.dtype).reshape(-1, *x.shape)
        return torch.vmap(lambda v: torch.autograd.grad(-forces, x, v, retain_graph=True)[0])(eye)

    got = torch.compile(hessian, backend="dynbatch", fullgraph=True, options=AOT_EAGER)(x, i, j)
    torch.testing.assert_close(got, AF.hessian(lambda t: sp.lennard_jones(t, i, j), x).reshape(375, 125, 3),
                               rtol=1e-12, atol=1e-10)
    c = _counts()
    assert c["grads_compressed"] == 1 and c["colours"] * 2 < c["rows"] == 375, c


def test_auto_decides_per_call_where_the_function_reads_what_the_graph_computes():
    """The neighbour list taken apart inside the compiled function: nothing is evaluated at
    compile time; the op finds each call's pattern (another list recolours, B symbolic)."""
    def hessian(x, pairs):
        i, j = pairs[0], pairs[1]
        return AF.hessian(lambda t: sp.lennard_jones(t, i, j), x, vectorize=True)

    compiled = torch.compile(hessian, backend="dynbatch", fullgraph=True, options=AOT_EAGER)
    x, (i, j) = sp.lennard_jones_problem(125, cutoff=1.6)
    fewer = torch.stack([i, j])[:, ::2].clone()
    for pairs in (torch.stack([i, j]), fewer):
        torch.testing.assert_close(compiled(x, pairs), hessian(x, pairs), rtol=1e-12, atol=1e-10)
    c = dynbatch.counters()
    # the second list's size recompiles the graph (as any new size would); each call colours its own
    assert c["grads_structured"] == 2 and c["grads_compressed"] == 2 and c["sparse_plans"] == 2, c


def test_a_bad_sparse_value_raises():
    with pytest.raises(ValueError, match="sparse must be"):
        dynbatch.hessian(sp.lennard_jones, torch.zeros(2, 3), torch.tensor([0]), torch.tensor([1]), sparse="yes")
    from dynbatch.options import Options

    for value in ("yes", 1, None):
        with pytest.raises(ValueError, match=r"dynbatch.sparse=.*choose one of \['auto', True, False\]"):
            Options.from_compile_args(None, {"dynbatch.sparse": value})


def test_a_rule_that_fails_goes_dense_not_raising(monkeypatch, caplog):
    from dynbatch.sparsity import pattern

    def broken(self, n, args, value):
        raise IndexError("a rule that could not read its op")

    monkeypatch.setattr(pattern._Propagation, "_reduction", broken)
    x, (i, j) = sp.lennard_jones_problem(27, cutoff=1.6)
    with caplog.at_level(logging.INFO, logger="dynbatch"):
        got = dynbatch.hessian(sp.lennard_jones, x, i, j, options=AOT_EAGER)
    torch.testing.assert_close(got, AF.hessian(lambda t: sp.lennard_jones(t, i, j), x), rtol=1e-12, atol=1e-10)
    assert "no sparse plan" in caplog.text and _counts()["grads_dense_rows"] == 1
