"""Store or recompute (planning/recompute.py): each reduction of a large, cheap pointwise tensor
computes it in its own loop where the cost model says so; values never change."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import torch.fx
from torch._inductor import config as inductor_config
from torch._inductor.utils import run_and_get_code
from torch.fx.experimental.proxy_tensor import make_fx

import dynbatch
from dynbatch import fx_utils
from dynbatch.planning import recompute
from dynbatch.bench import workloads
from dynbatch.graph_text import graph_text
from conftest import INDUCTOR, assert_backend_ran, assert_same_grads, compile_dynbatch
from snapshot import assert_snapshot

aten = torch.ops.aten


def pair_forces(pos, V):
    """The shape of a pair potential's batched backward: a [B, N, N, 3] tensor of pair
    terms from positions [N, 3] and cotangents [B, N, 3], reduced over i and over j."""
    n = pos.shape[0]
    diff = pos.unsqueeze(1) - pos.unsqueeze(0)
    inv = ((diff * diff).sum(-1) + torch.eye(n)).pow(-4).unsqueeze(-1)
    dv = V.unsqueeze(2) - V.unsqueeze(1)
    pair = dv * inv + diff * inv * 3.0
    return pair.sum(1) - pair.sum(2)


def _traced(fn, *args, mode="symbolic"):
    return make_fx(fn, tracing_mode=mode)(*args)


def _users(gm, target):
    return [n for n in gm.graph.nodes if n.target is target]


def _inputs():
    return torch.randn(6, 3), torch.randn(18, 6, 3)


def test_each_reduction_gets_its_own_copy_and_values_stay():
    pos, V = _inputs()
    gm = _traced(pair_forces, pos, V)
    before = graph_text(gm, "before")
    done = recompute.recompute_fanouts(gm.graph, "always", "cpu", limits=(100, 20))
    gm.recompile()
    assert done.count >= 1
    # no [B, N, N, 3] tensor is read by two nodes any more: each reduction has its own
    pairs = [n for n in gm.graph.nodes if fx_utils.is_pointwise(n) and n.meta["val"].dim() == 4]
    assert pairs and all(len(n.users) == 1 for n in pairs), [(n.name, len(n.users)) for n in pairs]
    torch.testing.assert_close(gm(pos, V), pair_forces(pos, V))
    assert_snapshot("recompute_pair_forces", before + graph_text(gm, "after"))


@pytest.fixture
def any_size_pays(monkeypatch):
    """The GPU cost model without its size floor, for graphs traced at test sizes."""
    monkeypatch.setitem(recompute.COSTS, "cuda", dataclasses.replace(recompute.COSTS["cuda"], min_saved_bytes=0))


def test_the_gpu_cost_model_recomputes_cheap_chains_and_stores_costly_ones():
    """HBM bytes cost ~14 flops: the Lennard-Jones pair forces (17 flops from 2.8 bytes of
    inputs per element, read twice) are recomputed, 20 transcendental ops are not; nor is
    a tensor whose store and loads would take less than a kernel launch."""
    lj = recompute.Chain([], flops=17, input_bytes=2.8, ops=47, reads=6)
    costly = dataclasses.replace(lj, flops=20 * recompute.TRANSCENDENTAL_FLOPS)
    gpu = recompute.COSTS["cuda"]
    large, small = 1500 * 500 * 500 * 3, 72 * 24 * 24 * 3  # lj_forces' [B, N, N, 3] at N = 500 and 24
    assert recompute.recompute_pays(lj, 2, 4, gpu, large)
    assert not recompute.recompute_pays(costly, 2, 4, gpu, large)
    assert not recompute.recompute_pays(lj, 2, 4, gpu, small)


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_auto_splits_the_pair_tensor_on_a_gpu_and_leaves_the_cpu_to_inductor(device, any_size_pays):
    pos, V = _inputs()
    gm = _traced(pair_forces, pos, V)
    count = recompute.recompute_fanouts(gm.graph, "auto", device, limits=(100, 20)).count
    gm.recompile()
    pairs = [n for n in gm.graph.nodes if fx_utils.is_pointwise(n) and n.meta["val"].dim() == 4]
    if device == "cuda":
        assert count >= 1 and all(len(n.users) == 1 for n in pairs)
    else:
        assert count == 0 and max(len(n.users) for n in pairs) == 2
    torch.testing.assert_close(gm(pos, V), pair_forces(pos, V))


def test_edge_terms_a_scatter_adds_are_recomputed_in_its_loop_but_its_target_is_not(any_size_pays):
    """A message-passing potential's [B, E, F] edge terms, summed and scattered to atoms
    (index_add decomposes to an accumulating index_put)."""

    def messages(h, w, src, dst):  # h [N, F], w [B, E]
        terms = w.unsqueeze(-1) * h[src] * 2.0  # [B, E, F] from [B, E] and a gather of [N, F]
        target = torch.zeros(w.shape[0], h.shape[0], h.shape[1]) + terms.sum((1, 2), keepdim=True)
        return terms.sum(1), aten.index_put(target, [None, dst], terms, True), target.sum()

    h, w = torch.randn(5, 4), torch.randn(3, 12)
    src, dst = torch.randint(0, 5, (12,)), torch.randint(0, 5, (12,))
    gm = _traced(messages, h, w, src, dst, mode="fake")
    assert recompute.recompute_fanouts(gm.graph, "auto", "cuda", limits=(100, 20)).count >= 1
    gm.recompile()
    (scatter,) = _users(gm, aten.index_put.default)
    assert len(scatter.args[2].users) == 1  # its own copy of the edge terms
    assert len(scatter.args[0].users) == 2  # the target it writes: stored
    torch.testing.assert_close(gm(h, w, src, dst), messages(h, w, src, dst))


def test_small_tensors_random_ops_outputs_and_products_are_left_stored():
    def fans_out(x, w):
        y = torch.tanh(x) * 2  # as large as its input: storing it costs no more
        noisy = torch.bernoulli(torch.sigmoid(x.unsqueeze(0).expand(4, *x.shape)))  # random: one draw
        big = noisy * x  # [4, N, N]
        return y.sum(0) + y.sum(1), big.sum((0, 1)) + big.sum((0, 2)), big, (big * 3) @ w

    args = torch.randn(5, 5), torch.randn(5, 2)
    gm = _traced(fans_out, *args, mode="fake")
    count = len(gm.graph.nodes)
    assert recompute.recompute_fanouts(gm.graph, "always", "cpu", limits=(100, 20)).count == 0
    assert len(gm.graph.nodes) == count
    assert len(_users(gm, aten.bernoulli.default)) == 1


def test_copies_over_the_limits_stay_stored():
    pos, V = _inputs()
    gm = _traced(pair_forces, pos, V)
    assert recompute.recompute_fanouts(gm.graph, "always", "cpu", limits=(1, 20)).count == 0  # an op and a load
    assert recompute.recompute_fanouts(gm.graph, "always", "cpu", limits=(100, 0)).count == 0
    assert recompute.recompute_fanouts(gm.graph, "never", "cpu", limits=(100, 20)).count == 0


# --- through dynbatch and Inductor --------------------------------------------------

def lj_hessian_rows(device="cpu", n=6):
    """Rows of a Lennard-Jones Hessian (the bench's full_hessian/lj), B = 3N."""
    (problem,) = [p for p in workloads.full_hessian("quick", None, device) if p.name == "full_hessian/lj"]
    pos = workloads._lattice(n, torch.Generator().manual_seed(0)).to(device)

    def rows(pos, V):
        pos = pos.detach().requires_grad_()
        forces = problem.f(pos)
        return torch.autograd.grad(forces, pos, V, is_grads_batched=True)[0]

    return rows, pos, workloads._hessian_basis(n, device)


def code_by_mode(fn, args, expected, modes) -> dict[str, str]:
    """Inductor's code for ``fn`` compiled by dynbatch under each ``dynbatch.recompute`` mode,
    each run once: the backend ran, one batched graph, eager's grads."""
    codes = {}
    for mode in modes:
        torch._dynamo.reset()
        dynbatch.reset()
        compiled = compile_dynbatch(fn, options={**INDUCTOR, "dynbatch.recompute": mode})
        result, code = run_and_get_code(compiled, *args)
        assert_backend_ran(graphs=1, batched=1)
        assert_same_grads(result, expected, msg=mode)
        codes[mode] = "\n".join(code)
    return codes


def pair_buffers(code: str, n=6) -> list[str]:
    """Buffers the generated code allocates with the [B, N, N, 3] shape (B = 3N)."""
    return re.findall(rf"empty_strided_c(?:pu|uda)\(\({3 * n}, {n}, {n}, 3\)", code)


@pytest.mark.parametrize("inline_limits", ["cpu", "gpu"])
def test_lennard_jones_hessian_rows_never_store_the_pair_tensor(inline_limits):
    """dynbatch.recompute="always" removes the stored [B, N, N, 3] pair forces ("never"
    keeps them); under a GPU's lower inline limits the graph's own limits are raised for
    this compile and restored after it."""
    rows, pos, V = lj_hessian_rows()
    expected = rows(pos, V)
    limits = {"cpu": {}, "gpu": {"realize_opcount_threshold": 30, "realize_acc_reads_threshold": 8}}[inline_limits]
    modes = ("never", "always") if inline_limits == "cpu" else ("always",)
    with inductor_config.patch({"fx_graph_cache": False, **limits}):
        codes = code_by_mode(rows, (pos, V), expected, modes)
        assert {k: getattr(inductor_config, k) for k in limits} == limits  # the raise ended with the compile
    if "never" in codes:
        assert pair_buffers(codes["never"])
    assert pair_buffers(codes["always"]) == []


# --- store broadcast factors (NOTE [Store broadcast factors]) ---------------------

def pair_coefficients(pos, V):
    """A pair potential's batched terms: [N, N] coefficients (a costly chain of r^2, times
    a mask) read by a [B, N, N, 3] loop."""
    n = pos.shape[0]
    diff = pos.unsqueeze(1) - pos.unsqueeze(0)
    r2 = (diff * diff).sum(-1) + torch.eye(n)
    coefficient = torch.exp(-r2) * r2.rsqrt() + r2.pow(-3)  # B-free, transcendental
    mask = (r2 < 2.0).to(pos.dtype)
    dv = V.unsqueeze(2) - V.unsqueeze(1)
    pair = dv * (coefficient * mask).unsqueeze(-1)
    return pair.sum(1) - pair.sum(2)


def _stores(gm):
    return _users(gm, torch.ops.prims.inductor_force_stride_order.default)


def test_a_costly_factor_read_broadcast_is_stored_once_and_values_stay():
    pos, V = _inputs()
    gm = _traced(pair_coefficients, pos, V)  # symbolic sizes: the stride read from the node
    before = graph_text(gm, "before")
    count = recompute.store_broadcast_factors(gm.graph, "auto", "cpu")
    gm.recompile()
    stores = _stores(gm)
    assert count == len(stores) >= 1
    for store in stores:
        factor = store.args[0]
        assert factor.meta["val"].dim() == 2  # an [N, N] factor, not a batched tensor
        # every reader of the factor reads the stored one (its strides read the factor's)
        assert all(u is store or u.target is aten.sym_stride.int for u in factor.users)
    assert any(u.target is aten.sym_stride.int for u in gm.graph.nodes)
    torch.testing.assert_close(gm(pos, V), pair_coefficients(pos, V))
    assert_snapshot("store_broadcast_factors", before + graph_text(gm, "after"))


def test_a_factor_read_a_few_times_over_a_cheap_one_or_off_the_cpu_is_left_to_inductor():
    pos = torch.randn(6, 3)
    few = _traced(pair_coefficients, pos, torch.randn(2, 6, 3), mode="fake")  # B = 2: 6 elements a factor's
    assert recompute.store_broadcast_factors(few.graph, "auto", "cpu") == 0

    def cheap(x, V):  # a factor of one op past the stored input
        return (V * (x * 2.0)).sum(0)

    gm = _traced(cheap, torch.randn(6, 6), torch.randn(32, 6, 6), mode="fake")
    assert recompute.store_broadcast_factors(gm.graph, "always", "cpu") == 0
    for mode, device, stored in (("auto", "cuda", False), ("never", "cpu", False), ("always", "cuda", True)):
        gm = _traced(pair_coefficients, *_inputs(), mode="fake")
        assert (recompute.store_broadcast_factors(gm.graph, mode, device) > 0) == stored, (mode, device)


def factor_buffers(code: str, n=6) -> list[str]:
    """Buffers the generated code allocates with a pair factor's [N, N] shape."""
    return re.findall(rf"empty_strided_cpu\(\({n}, {n}\), \({n}, 1\), torch.float32\)", code)


def test_lennard_jones_hessian_rows_store_their_pair_coefficients():
    """Inside dynbatch and Inductor: the B-free coefficients of the Lennard-Jones Hessian
    rows are buffers of their own under "auto" (none past r^2 under "never"); the same grads."""
    rows, pos, V = lj_hessian_rows()
    with inductor_config.patch({"fx_graph_cache": False}):
        codes = code_by_mode(rows, (pos, V), rows(pos, V), ("never", "auto"))
    assert len(factor_buffers(codes["auto"])) > len(factor_buffers(codes["never"]))
