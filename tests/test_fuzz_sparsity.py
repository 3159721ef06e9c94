"""Fuzz: random sparse functions, their Hessians and Jacobians by colours, against eager.

A random function of positions ``x [N, 3]`` chains 1-6 steps drawn from what sparse
models do: messages along a random pair list (``x[i] - x[j]``, ``index_add``), a
gather by a random permutation, ``scatter_add`` into random targets, per-atom feature
mixing (``@ W``), elementwise activations, reductions over an atom's features, a
softmax, ``roll``/``flip`` -- and, in some, an op with no sparsity rule
(``linalg.solve`` across atoms) or a cumulative sum along the atoms.  The index tensors
are the call's arguments, so the pattern follows their values.  The property: with
``sparse=True`` the compressed Hessian (star colouring) and Jacobian (row colouring)
equal ``torch.autograd.functional``'s (float64) and dynbatch's dense rows, and they
really ran compressed (counters); with ``sparse="auto"`` a function whose pattern is
dense (the op without a rule) is computed dense, logged with that op's name.

Examples per run: ``DYNBATCH_SPARSE_FUZZ_EXAMPLES`` (default 10; derandomized).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import pytest
import torch
import torch.autograd.functional as AF
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dynbatch
from conftest import AOT_EAGER
from dynbatch.sparsity import colouring

EXAMPLES = int(os.environ.get("DYNBATCH_SPARSE_FUZZ_EXAMPLES", "10"))
pytestmark = pytest.mark.skipif(not colouring.available(), reason="no C compiler for the colouring")

# Steps whose rules keep an atom's row sparse, and two that make it dense.
SPARSE_STEPS = ("message", "gather", "scatter", "mix", "tanh", "sin", "square_norm", "softmax", "roll", "flip")
DENSE_STEPS = ("solve", "cumsum")


@dataclass
class SparseFunction:
    """A random function ``f(x, i, j, perm, target)`` of positions and index tensors."""

    steps: tuple[str, ...]
    weights: dict[int, torch.Tensor]
    width: int

    def __call__(self, x, i, j, perm, target):
        h = x
        for k, step in enumerate(self.steps):
            h = self._apply(k, step, h, i, j, perm, target)
        return h

    def _apply(self, k, step, h, i, j, perm, target):
        if step == "message":  # pair messages summed into the first atom of each pair
            d = h[i] - h[j]
            return h + torch.zeros_like(h).index_add(0, i, torch.tanh(d) * (d * d).sum(-1, keepdim=True))
        if step == "gather":
            return h[perm] * h
        if step == "scatter":
            return torch.zeros_like(h).scatter_add(0, target[:, None].expand_as(h), h) + h
        if step == "mix":  # features of one atom mix, atoms stay apart
            return h @ self.weights[k]
        if step == "tanh":
            return torch.tanh(h)
        if step == "sin":
            return torch.sin(h) + h
        if step == "square_norm":
            return h * (h * h).sum(-1, keepdim=True)
        if step == "softmax":
            return torch.softmax(h, -1) * h
        if step == "roll":
            return h.roll(1, 0) * h
        if step == "flip":
            return h + h.flip(0).sin()
        if step == "solve":  # across atoms: no sparsity rule
            return torch.linalg.solve(self.weights[k], h)
        if step == "cumsum":
            return h.cumsum(0)
        raise AssertionError(step)

    def energy(self, x, i, j, perm, target):
        return (self(x, i, j, perm, target) ** 2).sum()


@st.composite
def sparse_problems(draw, steps=SPARSE_STEPS, dense_step=False):
    """A function, positions and index tensors; ``dense_step`` puts one dense step in."""
    atoms = draw(st.integers(12, 40))
    chain = list(draw(st.lists(st.sampled_from(steps), min_size=1, max_size=5)))
    if dense_step:
        chain.insert(draw(st.integers(0, len(chain))), draw(st.sampled_from(DENSE_STEPS)))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    pairs = draw(st.integers(atoms, 3 * atoms))
    i = torch.randint(atoms, (pairs,), generator=g)
    j = torch.randint(atoms, (pairs,), generator=g)
    perm = torch.randperm(atoms, generator=g)
    target = torch.randint(atoms, (atoms,), generator=g)
    width = 3
    weights = {}
    for k, step in enumerate(chain):
        if step == "mix":
            weights[k] = torch.randn(width, width, generator=g, dtype=torch.float64) / 2
        elif step == "solve":
            weights[k] = torch.eye(atoms, dtype=torch.float64) * 3 + torch.randn(atoms, atoms, generator=g,
                                                                                dtype=torch.float64) / atoms
    x = torch.randn(atoms, width, generator=g, dtype=torch.float64)
    return SparseFunction(tuple(chain), weights, width), x, (i, j, perm, target)


def _fuzz(examples=EXAMPLES):
    return settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))


def _fresh() -> None:
    """Each example's function is new: counters, plans and its programs start afresh (its
    programs would share one code object's Dynamo cache and recompile past its limit)."""
    dynbatch.reset()
    torch._dynamo.reset()


def _assert_close(got, want, steps) -> None:
    # Entries summed in another order than eager's: round-off relative to the largest entry.
    atol = 1e-9 * max(1.0, float(want.abs().max()))
    torch.testing.assert_close(got, want, rtol=1e-9, atol=atol, msg=lambda m: f"{steps}: {m}")


@_fuzz()
@given(sparse_problems())
def test_compressed_hessian_equals_eager_and_dense(problem):
    f, x, args = problem
    _fresh()
    want = AF.hessian(lambda t: f.energy(t, *args), x)
    got = dynbatch.hessian(f.energy, x, *args, sparse=True, options=AOT_EAGER)
    _assert_close(got, want, f.steps)
    c = dynbatch.counters()
    assert c["grads_compressed"] == 1 and c["rows"] == x.numel() and 0 < c["colours"] <= x.numel(), (f.steps, c)
    _assert_close(got, dynbatch.hessian(f.energy, x, *args, sparse=False, options=AOT_EAGER), f.steps)


@_fuzz()
@given(sparse_problems())
def test_compressed_jacobian_equals_eager_and_dense(problem):
    f, x, args = problem
    _fresh()
    want = AF.jacobian(lambda t: f(t, *args), x)
    got = dynbatch.jacobian(f, x, *args, sparse=True, options=AOT_EAGER)
    _assert_close(got, want, f.steps)
    c = dynbatch.counters()
    assert c["grads_compressed"] == 1 and 0 < c["colours"] <= x.numel(), (f.steps, c)
    csr = dynbatch.jacobian(f, x, *args, sparse=True, layout=torch.sparse_csr, options=AOT_EAGER)
    _assert_close(csr.to_dense(), want.reshape(x.numel(), x.numel()), f.steps)


@_fuzz(max(EXAMPLES // 3, 2))
@given(problem=sparse_problems(dense_step=True))
def test_a_step_without_a_rule_goes_dense_logged(problem, caplog):
    f, x, args = problem
    _fresh()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dynbatch"):
        got = dynbatch.hessian(f.energy, x, *args, options=AOT_EAGER)  # sparse="auto"
    _assert_close(got, AF.hessian(lambda t: f.energy(t, *args), x), f.steps)
    c = dynbatch.counters()
    if "solve" in f.steps:  # every atom then depends on every other: dense, and the log says why
        assert c.get("grads_dense_rows") == 1 and "grads_compressed" not in c, (f.steps, c)
        assert "no sparsity rule for aten._linalg_solve_ex" in caplog.text
    else:  # a cumulative sum has its rule: dense only where its colours do not pay
        assert c.get("grads_dense_rows", 0) + c.get("grads_compressed", 0) == 1, (f.steps, c)
