"""Batched grads within a memory budget (issue 9; dynbatch/planning/memory.py, dynbatch/planning/chunking.py).

* The estimate: a hand-written graph between markers, its bytes per sample
  derived here from the shapes, not copied from a run.
* Chunked grads equal the eager per-sample loop: ragged last chunk, B below
  the chunk, B = 1, several grads, Hessian rows (functional.hessian), grads
  taken outside the region; the plan says what ran, and a B sweep compiles
  no more graphs than unchunked.
* What cannot be chunked runs unchunked with the reason in the plan:
  create_graph, random ops, an inner grad upstream of the inputs.
* Memory, measured with the profiler (torch's CPU allocator): a budgeted
  Inductor call peaks within 1.25 x budget + its output, and a user's own
  loop of batched grads peaks at about one grad's memory, not all of them.
"""

from __future__ import annotations

import logging
import types

import pytest
import torch
import torch.autograd.functional as AF
from torch.fx.experimental.proxy_tensor import make_fx

import dynbatch
from dynbatch.batching import markers
from dynbatch.planning import chunking, memory
from dynbatch.cpu import kept_buffers
from dynbatch.bench.measure import _profiled_peak
from dynbatch.options import Options, parse_memory_budget
from conftest import DEFAULTS, INDUCTOR, assert_same_grads, compile_dynbatch, loop_grads

grad = torch.autograd.grad


def plans():
    return [p for r in dynbatch.compile_records() if not r.chunk_program for p in r.memory_plan]


def lj_energy(pos):
    n = pos.shape[0]
    diff = pos.unsqueeze(1) - pos.unsqueeze(0)
    r2 = (diff * diff).sum(-1) + torch.eye(n, dtype=pos.dtype)
    inv6 = r2.pow(-3)
    return (4 * (inv6 * inv6 - inv6) * torch.ones(n, n, dtype=pos.dtype).triu(1)).sum()


def lattice(n, seed=0):
    side = round(n ** (1 / 3)) + 1
    grid = torch.stack(torch.meshgrid(*[torch.arange(side)] * 3, indexing="ij"), -1).reshape(-1, 3)[:n]
    return grid.float() * 1.12 + 0.05 * torch.randn(n, 3, generator=torch.Generator().manual_seed(seed))


def hessian_rows(pos, V):
    pos = pos.detach().requires_grad_()
    g = grad(lj_energy(pos), pos, create_graph=True)[0]
    return grad(g, pos, V, is_grads_batched=True)[0]


def eager_rows(pos, V):
    pos = pos.detach().requires_grad_()
    g = grad(lj_energy(pos), pos, create_graph=True)[0]
    if len(V) > 64:  # the large cases: eager torch.func, batched (the per-sample loop takes minutes)
        return torch.func.vmap(lambda v: grad(g, pos, v, retain_graph=True)[0])(V)
    return loop_grads(g, pos, V)[0]


W = torch.randn(16, 16, generator=torch.Generator().manual_seed(1)) / 4


def jacobian(x, V):
    x = x.detach().requires_grad_()
    return grad(torch.tanh(torch.tanh(x @ W) @ W), x, V, is_grads_batched=True)[0]


def eager_jacobian(x, V):
    x = x.detach().requires_grad_()
    return loop_grads(torch.tanh(torch.tanh(x @ W) @ W), x, V)[0]


# --- options -------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    (1000, 1000), ("256MiB", 256 * 2**20), ("2GB", 2 * 10**9), ("1.5 GiB", int(1.5 * 2**30)),
    ("512", 512), ("auto", "auto"), (None, None),
])
def test_budget_values(text, expected):
    assert parse_memory_budget(text) == expected


@pytest.mark.parametrize("options", [
    {"dynbatch.memory_budget": "lots"}, {"dynbatch.memory_budget": -1}, {"dynbatch.memory_budget": 0},
    {"dynbatch.memory_budget": True}, {"dynbatch.memory_budget": "3 parsecs"},
    {"dynbatch.chunk_size": 0}, {"dynbatch.chunk_size": 2.5}, {"dynbatch.chunk_size": True},
])
def test_bad_budget_options_raise_a_clear_value_error(options):
    with pytest.raises(ValueError, match=list(options)[0].replace(".", r"\.")):
        Options.from_compile_args(None, options)


def test_auto_budget_on_the_cpu_is_the_smaller_of_a_fraction_of_the_free_memory_and_the_cpu_cap():
    budget = memory.resolve_budget("auto", [torch.zeros(1)])
    assert 0 < budget <= memory.available_ram()
    expected = min(memory.AUTO_BUDGET_FRACTION * memory.available_ram(), memory.CPU_AUTO_BUDGET)
    assert budget == pytest.approx(expected, rel=0.2)


def test_auto_budget_chunks_a_cpu_backward_above_the_cpu_cap(monkeypatch):
    # NOTE [CPU chunks for speed]: the cap, lowered so that a small case stands for a large one.
    monkeypatch.setattr(memory, "CPU_AUTO_BUDGET", 2**20)
    pos = lattice(40)
    V = torch.eye(120).view(120, 40, 3)
    f = compile_dynbatch(hessian_rows)  # memory_budget "auto", the default
    assert_same_grads(f(pos, V), eager_rows(pos, V), atol=1e-4, rtol=1e-4)
    (plan,) = plans()
    assert plan.applied and plan.chunks > 1, plan
    assert plan.chunk_size * plan.bytes_per_sample <= memory.CPU_AUTO_BUDGET
    assert plan.batch * plan.bytes_per_sample > memory.CPU_AUTO_BUDGET



def test_a_budget_is_a_ceiling_lowered_to_the_cpu_speed_cap():
    """A larger budget never chunks larger on the CPU, where larger chunks run
    slower (NOTE [CPU chunks for speed]); other devices keep it; None stays off."""
    cpu, meta = [torch.zeros(1)], [torch.zeros(1, device="meta")]
    assert memory.resolve_budget(2**30, cpu) == memory.cpu_speed_cap()
    assert memory.resolve_budget(2**10, cpu) == 2**10
    assert memory.resolve_budget(2**30, meta) == 2**30
    assert memory.resolve_budget(None, cpu) is None


def test_a_budget_above_the_cpu_cap_runs_the_defaults_plan(monkeypatch):
    monkeypatch.setattr(memory, "CPU_AUTO_BUDGET", 2**20)  # a small case stands for a large one
    pos = lattice(40)
    V = torch.eye(120).view(120, 40, 3)
    for budget in ("auto", "256MiB"):
        assert_same_grads(compile_dynbatch(hessian_rows, options={"dynbatch.memory_budget": budget})(pos, V),
                          eager_rows(pos, V), atol=1e-4, rtol=1e-4, msg=budget)
    default, large = plans()
    assert default.applied and large.applied
    assert (large.chunk_size, large.chunks) == (default.chunk_size, default.chunks)


KEEP_MEMORY = "glibc.malloc.mmap_threshold=4294967296:glibc.malloc.trim_threshold=0x100000000"


@pytest.mark.parametrize("tunables, kept", [
    ("", None),
    (KEEP_MEMORY, 2**32),
    ("glibc.malloc.trim_threshold=67108864:glibc.malloc.mmap_threshold=134217728", 2**26),
    ("glibc.malloc.mmap_threshold=4294967296", None),  # the other stays at 128 KiB
    ("glibc.malloc.tcache_count=0", None),
    ("glibc.malloc.mmap_threshold=lots:glibc.malloc.trim_threshold=4294967296", None),
])
def test_malloc_keeps_memory_below_reads_both_glibc_thresholds(tunables, kept):
    assert memory.malloc_keeps_memory_below(tunables) == kept


@pytest.mark.parametrize("tunables, aliases, kept", [
    ("", {"MALLOC_MMAP_THRESHOLD_": "1000000000", "MALLOC_TRIM_THRESHOLD_": "0x40000000"}, 10**9),
    ("", {"MALLOC_MMAP_THRESHOLD_": "1000000000"}, None),  # the other stays at 128 KiB
    ("glibc.malloc.trim_threshold=67108864", {"MALLOC_MMAP_THRESHOLD_": "1000000000"}, 2**26),
    # GLIBC_TUNABLES wins where both spellings name a threshold, as in glibc
    (KEEP_MEMORY, {"MALLOC_MMAP_THRESHOLD_": "1048576", "MALLOC_TRIM_THRESHOLD_": "1048576"}, 2**32),
])
def test_malloc_keeps_memory_below_reads_glibcs_environment_variables_too(tunables, aliases, kept):
    assert memory.malloc_keeps_memory_below(tunables, aliases) == kept


def test_cpu_speed_cap_rises_only_where_malloc_keeps_freed_memory():
    assert memory.cpu_speed_cap({}) == memory.CPU_AUTO_BUDGET
    assert memory.cpu_speed_cap({"GLIBC_TUNABLES": KEEP_MEMORY}) == 2**31
    assert memory.cpu_speed_cap({"MALLOC_MMAP_THRESHOLD_": "4294967296",
                                 "MALLOC_TRIM_THRESHOLD_": "4294967296"}) == 2**31
    # thresholds below the cap's: the cap stays (chunks of it already fit the heap)
    small = "glibc.malloc.mmap_threshold=1048576:glibc.malloc.trim_threshold=1048576"
    assert memory.cpu_speed_cap({"GLIBC_TUNABLES": small}) == memory.CPU_AUTO_BUDGET


def test_auto_budget_leaves_a_cpu_backward_unchunked_where_malloc_keeps_freed_memory(monkeypatch):
    # The same backward as above, which the lowered cap chunks: with both thresholds
    # raised in GLIBC_TUNABLES it runs in one piece, and equals the eager rows.
    monkeypatch.setattr(memory, "CPU_AUTO_BUDGET", 2**20)
    monkeypatch.setenv("GLIBC_TUNABLES", KEEP_MEMORY)
    pos = lattice(40)
    V = torch.eye(120).view(120, 40, 3)
    f = compile_dynbatch(hessian_rows)
    assert_same_grads(f(pos, V), eager_rows(pos, V), atol=1e-4, rtol=1e-4)
    (plan,) = plans()
    assert not plan.applied and plan.chunk_size is None, plan
    assert plan.batch * plan.bytes_per_sample > 2**20  # the default cap would have chunked it

# --- the estimate, on a graph written by hand ---------------------------------------

def test_estimate_replays_allocations_between_the_markers_and_removes_them():
    def backward(x, v, weight):  # v: [B, 5]; three buffers depend on v
        v = markers.batch_marker(v, "g", markers.COTANGENT)
        h = v * x  # [B, 5]
        s = h.sin()  # [B, 5]; h is freed after this
        out = s @ weight  # [B, 7]
        return markers.batch_marker(out, "g", markers.GRAD)

    args = (torch.randn(5), torch.randn(6, 5), torch.randn(5, 7))
    gm = make_fx(backward, tracing_mode="symbolic")(*args)
    (estimate,) = memory.observe(gm).values()
    assert not [n for n in gm.graph.nodes if "batch_marker" in str(n.target)]
    # Alive at each step, per sample: h; h and s; s and out (float32).
    expected = 4 * max(5, 5 + 5, 5 + 7)
    assert estimate.bytes_per_sample() == expected
    assert estimate.example_batch() == 6
    # With Inductor's fusion, h is computed inside sin's kernel: never stored.
    gm = make_fx(backward, tracing_mode="symbolic")(*args)
    (fused,) = memory.observe(gm, fused=True).values()
    assert fused.bytes_per_sample() == 4 * (5 + 7)
    # The graph still computes the same thing without its markers.
    args = (torch.randn(5), torch.randn(3, 5), torch.randn(5, 7))
    torch.testing.assert_close(gm(*args), backward(*args))


def test_estimate_follows_the_other_sizes_of_each_call():
    def backward(x, v):  # v: [B, n, n] -> [B, n]
        v = markers.batch_marker(v, "g", markers.COTANGENT)
        return markers.batch_marker((v * x).sum(-1), "g", markers.GRAD)

    x, v = torch.randn(4, 4), torch.randn(3, 4, 4)
    gm = make_fx(backward, tracing_mode="symbolic")(x, v)
    (estimate,) = memory.observe(gm).values()
    bind = memory.binder(estimate, [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"])
    for n in (4, 9):
        values = bind([torch.randn(n, n), torch.randn(2, n, n)])
        assert estimate.bytes_per_sample(values) == 4 * (n * n + n)


# --- chunked grads equal eager -----------------------------------------------------

@pytest.mark.parametrize("batches", [(13, 3, 30, 7), (2, 5)])
def test_fixed_chunks_equal_the_eager_loop_over_a_batch_sweep(batches):
    x = torch.randn(4, 16)
    f = compile_dynbatch(jacobian, options={"dynbatch.chunk_size": 4})
    for b in batches:  # ragged last chunks (13 = 4+3+3+3), B below the chunk (3, 2)
        V = torch.randn(b, 4, 16)
        assert_same_grads(f(x, V), eager_jacobian(x, V), msg=f"B={b}")
    counters = dynbatch.counters()
    assert counters["graphs"] <= 2 and not counters.get("fallbacks")
    assert counters["grads_chunked"] >= 1 and counters["chunk_programs"] == 1
    assert any(p.applied and p.chunk_size == 4 for p in plans())


def test_a_batch_that_fits_one_chunk_leaves_the_callers_cotangent_unmarked():
    """A B that fits one chunk runs the chunk program on the cotangent as given: marking
    that tensor's batch dim dynamic (for the chunk program's frame) marked the caller's own
    V, and the caller's frame failed its guards at the next call and compiled again."""
    x, big, small = torch.randn(4, 16), torch.randn(13, 4, 16), torch.randn(3, 4, 16)
    # Inductor's code hands the op the graph's input tensor itself (aot_eager's does not)
    f = compile_dynbatch(jacobian, options={**INDUCTOR, "dynbatch.chunk_size": 4})
    f(x, big)  # compiles the chunked program (13 = 4+3+3+3)
    f(x, small)  # B = 3: one chunk, and a graph for its size
    graphs = dynbatch.counters()["graphs"]
    for _ in range(2):
        assert_same_grads(f(x, small), eager_jacobian(x, small))
    assert dynbatch.counters()["graphs"] == graphs, dynbatch.counters()
    assert not hasattr(small, "_dynamo_weak_dynamic_indices") and not hasattr(small, "_dynamo_dynamic_indices")


def test_batch_of_one_and_budget_below_one_sample():
    x = torch.randn(4, 16)
    f = compile_dynbatch(jacobian, options={"dynbatch.memory_budget": 1})
    for b in (1, 5):
        V = torch.randn(b, 4, 16)
        assert_same_grads(f(x, V), eager_jacobian(x, V), msg=f"B={b}")
    chunked = [p for p in plans() if p.applied]
    assert chunked and chunked[-1].chunk_size == 1 and chunked[-1].chunks == 5


def test_hessian_rows_within_a_budget_equal_eager_and_the_plan_is_logged(caplog):
    pos = lattice(10)
    V = torch.eye(30).view(30, 10, 3)
    f = compile_dynbatch(hessian_rows, options={"dynbatch.memory_budget": "20KB"})
    with caplog.at_level(logging.INFO, logger="dynbatch"):
        out = f(pos, V)
    assert_same_grads(out, eager_rows(pos, V))
    (plan,) = plans()
    assert plan.applied and plan.batch == 30 and plan.bytes_per_sample > 0
    assert plan.chunk_size == 20_000 // plan.bytes_per_sample and plan.chunks > 1
    assert f"chunks of {plan.chunk_size}" in caplog.text and "B/sample" in caplog.text
    assert dynbatch.counters()["grads_chunked"] == 1


@pytest.mark.parametrize("chunk_size", [None, 1])
def test_hessian_rows_by_torch_vmap_within_a_budget(chunk_size):
    """MACE's spelling: ``torch.vmap(vjp, chunk_size=...)`` over the basis; the vmapped grad
    is one of dynbatch's batched grads (NOTE [Grads under torch.vmap]), so the budget chunks it."""
    def rows(pos, V):
        pos = pos.detach().requires_grad_()
        g = grad(lj_energy(pos), pos, create_graph=True)[0]
        return torch.vmap(lambda v: grad(g, pos, v, retain_graph=True)[0], chunk_size=chunk_size)(V)

    pos = lattice(10)
    V = torch.eye(30).view(30, 10, 3)
    out = compile_dynbatch(rows, options={"dynbatch.memory_budget": "20KB"})(pos, V)
    assert_same_grads(out, eager_rows(pos, V))
    (plan,) = plans()
    assert plan.applied and plan.batch == 30 and plan.chunks > 1, plan
    assert dynbatch.counters()["grads_chunked"] == 1


def test_functional_hessian_within_a_budget():
    def hess(pos):
        return AF.hessian(lj_energy, pos, vectorize=True)

    pos = lattice(6)
    out = compile_dynbatch(hess, options={"dynbatch.memory_budget": "4KB"})(pos)
    assert_same_grads(out, AF.hessian(lj_energy, pos))
    assert any(p.applied for p in plans())


@pytest.mark.parametrize("budget", ["auto", 20_000])
def test_a_b_sweep_across_the_budget_keeps_one_dynamic_graph(budget, monkeypatch):
    """NOTE [One dynamic graph across the budget]: the dynamic graph runs fused while B
    fits and chunked past it, without a third graph."""
    monkeypatch.setattr(memory, "CPU_AUTO_BUDGET", 20_000)  # "auto" on the CPU: the cap
    x = torch.randn(4, 16)
    f = compile_dynbatch(jacobian, options={"dynbatch.memory_budget": budget})
    for b in (4, 6, 300, 5, 301):
        V = torch.randn(b, 4, 16)
        assert_same_grads(f(x, V), eager_jacobian(x, V), msg=f"B={b}")
        if b == 6:
            assert not any(p.applied for p in plans()), "B = 6 fits: fused"
    first, dynamic = plans()
    assert not first.applied and dynamic.applied and dynamic.chunk_size < 300
    c = dynbatch.counters()
    assert c["graphs"] == 2 and c["grads_chunked"] == 1 and not c.get("fallbacks"), c
    dynamic_graph = [r for r in dynbatch.compile_records() if not r.chunk_program][-1]
    switch = dynamic_graph.region().compiled
    assert isinstance(switch, chunking.FusedWhileItFits) and switch.chunked is not None and switch.failed is None


def test_the_fused_program_serves_where_the_chunked_one_cannot_be_made(monkeypatch, caplog):
    def refuse(self, *args):
        raise RuntimeError("no")

    monkeypatch.setattr(chunking, "chunk_grads", lambda *a, **k: refuse(None))
    x = torch.randn(4, 16)
    f = compile_dynbatch(jacobian, options={"dynbatch.memory_budget": 20_000})
    with caplog.at_level(logging.WARNING, logger="dynbatch"):
        for b in (4, 6, 300):
            V = torch.randn(b, 4, 16)
            assert_same_grads(f(x, V), eager_jacobian(x, V), msg=f"B={b}")
    assert "could not be chunked (RuntimeError: no)" in caplog.text
    assert dynbatch.counters()["graphs"] == 2


def test_several_grads_and_a_user_loop_over_chunks():
    pos = lattice(8)
    V = torch.eye(24).view(24, 8, 3)

    def loop(pos, V):
        pos = pos.detach().requires_grad_()
        g = grad(lj_energy(pos), pos, create_graph=True)[0]
        rows = [grad(g, pos, v, retain_graph=True, is_grads_batched=True)[0] for v in V.split(10)]
        return torch.cat(rows)

    out = compile_dynbatch(loop, options={"dynbatch.memory_budget": "8KB"})(pos, V)
    assert_same_grads(out, eager_rows(pos, V))
    assert len(plans()) == 3 and all(p.applied for p in plans())


@pytest.mark.parametrize("path", ["saved", "recompute"])
def test_grads_outside_the_region_within_a_budget(path, request):
    if path == "recompute":
        request.getfixturevalue("recompute_outside")
    x = torch.randn(4, 16, requires_grad=True)
    f = compile_dynbatch(lambda x: torch.tanh(torch.tanh(x @ W) @ W), options={"dynbatch.memory_budget": 2000},
                         fullgraph=False)
    V = torch.randn(12, 4, 16)
    out = grad(f(x), x, V, is_grads_batched=True)[0]
    assert_same_grads(out, loop_grads(torch.tanh(torch.tanh(x @ W) @ W), x, V)[0])
    assert dynbatch.counters()[f"outside_batched_{'saved' if path == 'saved' else 'compiled'}"] == 1
    assert any(p.applied for p in plans())


@pytest.mark.parametrize("path", ["saved", "recompute"])
def test_a_b_sweep_of_grads_outside_the_region_across_the_budget(path, request):
    """The region's batched backward keeps the budget at every B.  From the saved
    activations: one program, B symbolic, called chunk by chunk where B does not fit.
    Recomputing: a program compiled like any graph, which across the budget keeps its
    two graphs too (NOTE [One dynamic graph across the budget])."""
    if path == "recompute":
        request.getfixturevalue("recompute_outside")
    calls = []
    if path == "saved":
        from dynbatch.region import saved_backward

        real_run = saved_backward._Program.run

        def run(self, args):
            calls.append(args[-1].shape[0])
            return real_run(self, args)

        request.getfixturevalue("monkeypatch").setattr(saved_backward._Program, "run", run)
    x = torch.randn(4, 16, requires_grad=True)
    f = compile_dynbatch(lambda x: torch.tanh(torch.tanh(x @ W) @ W), options={"dynbatch.memory_budget": 2000},
                         fullgraph=False)
    for b in (2, 3, 40, 4, 41):
        V = torch.randn(b, 4, 16)
        out = grad(f(x), x, V, is_grads_batched=True)[0]
        assert_same_grads(out, loop_grads(torch.tanh(torch.tanh(x @ W) @ W), x, V)[0], msg=f"B={b}")
    c = dynbatch.counters()
    if path == "saved":
        # the region's graph, one program for every B; 40 and 41 in even chunks
        assert c["graphs"] == 1 and c["saved_backward_programs"] == 1 and c["outside_batched_saved"] == 5, c
        # about 650 bytes a sample: 3 fit, larger B run in even chunks of 3 or 2
        assert calls[:2] == [2, 3] and set(calls[2:]) == {2, 3} and sum(calls) == 2 + 3 + 40 + 4 + 41, calls
    else:
        # the region's graph, then its batched backward's static and dynamic graphs
        assert c["graphs"] == 3 and c["outside_batched_compiled"] == 5 and c.get("grads_chunked") == 1, c


# --- what is not chunked, and why ---------------------------------------------------

def test_create_graph_batched_grad_runs_unchunked_and_stays_differentiable():
    def f(x, V):
        x = x.detach().requires_grad_()
        (j,) = grad(torch.tanh(x @ W), x, V, is_grads_batched=True, create_graph=True)
        return grad(j.pow(2).sum(), x)[0]

    x, V = torch.randn(4, 16), torch.randn(6, 4, 16)
    xe = x.clone().requires_grad_()
    (je,) = grad(torch.tanh(xe @ W), xe, V, is_grads_batched=True, create_graph=True)
    assert_same_grads(compile_dynbatch(f, options={"dynbatch.chunk_size": 2})(x, V), grad(je.pow(2).sum(), xe)[0])
    assert not any(p.applied for p in plans())


def test_random_ops_before_the_grad_are_not_rerun_per_chunk():
    def f(x, V):
        x = x.detach().requires_grad_()
        y = torch.nn.functional.dropout(torch.tanh(x @ W), 0.5) * x
        return grad(y, x, V, is_grads_batched=True)[0]

    torch.manual_seed(0)
    x, V = torch.randn(4, 16), torch.randn(9, 4, 16)
    out = compile_dynbatch(f, options={"dynbatch.chunk_size": 2})(x, V)
    assert out.shape == (9, 4, 16)
    (plan,) = plans()
    assert not plan.applied and "random" in plan.reason


@pytest.mark.parametrize("options", [{}, DEFAULTS], ids=["default", "inductor"])
def test_a_random_op_whose_node_is_named_for_its_variable_is_not_rerun(options):
    """Dynamo names a node after the variable it is assigned to (``h``); its aten ops
    name their origin by the traced call (``dropout``).  One mask for every row, as eager."""
    def f(x, V):
        x = x.detach().requires_grad_()
        h = torch.nn.functional.dropout(x, 0.5, training=True)
        return grad(torch.tanh(torch.tanh(h @ W) @ W), x, V, is_grads_batched=True)[0]

    x, v = torch.randn(4, 16), torch.randn(1, 4, 16)
    out = compile_dynbatch(f, options={**options, "dynbatch.chunk_size": 2})(x, v.expand(9, 4, 16))
    assert all(torch.equal(out[0], row) for row in out), "a mask per chunk"
    (plan,) = plans()
    assert not plan.applied and "h draws random numbers" in plan.reason, plan


def test_inner_grad_upstream_of_the_inputs_is_refused():
    def f(x0, V):
        x0 = x0.detach().requires_grad_()
        x = x0 * 2
        e = torch.tanh(x @ W).sum()
        (g0,) = grad(e, x0, create_graph=True)  # depends on x through e, taken at x0
        return grad(g0 * x, x, V, is_grads_batched=True)[0]

    x0, V = torch.randn(4, 16), torch.randn(5, 4, 16)
    xe0 = x0.clone().requires_grad_()
    xe = xe0 * 2
    (ge,) = grad(torch.tanh(xe @ W).sum(), xe0, create_graph=True)
    expected = loop_grads(ge * xe, xe, V)[0]
    assert_same_grads(compile_dynbatch(f, options={"dynbatch.chunk_size": 2})(x0, V), expected)
    (plan,) = plans()
    assert not plan.applied and "upstream" in plan.reason


# --- memory, with Inductor ------------------------------------------------------------

def _peak(fn, *args):
    fn(*args)  # warm: compile, caches
    kept_buffers.release()  # the call allocates its large buffers again: its whole peak counted
    return _profiled_peak(lambda: fn(*args))


def test_budgeted_inductor_call_peaks_within_the_budget():
    pos = lattice(60)
    V = torch.eye(180).view(180, 60, 3)
    budget = 2 * 2**20
    f = compile_dynbatch(hessian_rows, options={**DEFAULTS, "dynbatch.memory_budget": budget})
    g = compile_dynbatch(hessian_rows, options={**DEFAULTS, "dynbatch.memory_budget": None})
    budgeted, unbudgeted = _peak(f, pos, V), _peak(g, pos, V)
    assert_same_grads(f(pos, V), eager_rows(pos, V), atol=1e-4, rtol=1e-4)
    output = 180 * 60 * 3 * 4
    assert budgeted <= 1.25 * budget + output, (budgeted, unbudgeted)
    assert unbudgeted > 2 * budget  # the budget did bind


def test_a_lowering_after_the_frame_guards_may_not_add_one():
    """A late lowering's new guard would be ignored by the frozen ShapeEnv: refused."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    env = ShapeEnv()
    b = env.create_symintnode(env.create_symbol(5, source=ConstantSource("b"), dynamic_dim=DimDynamic.DYNAMIC),
                              hint=5)
    context = types.SimpleNamespace(fake_mode=types.SimpleNamespace(shape_env=env))
    env.freeze()
    with memory.refusing_new_shape_guards(context):
        assert b + 1 == b + 1  # no guard
    with pytest.raises(RuntimeError, match=f"new guard on the sizes.*installed: .*{b.node.expr}"):  # named
        with memory.refusing_new_shape_guards(context):
            bool(b > 3)
    # One asked with guards suppressed (FakeTensor's cache rebuilding a view) would not
    # have been installed either: no refusal, though the ShapeEnv's counter counts it.
    counted = env.counter["ignored_backward_guard"]
    with memory.refusing_new_shape_guards(context):
        with env.suppress_guards():
            bool(b > 4)
    assert env.counter["ignored_backward_guard"] > counted


def test_a_dynamic_graph_that_stops_fitting_peaks_within_the_budget():
    """NOTE [One dynamic graph across the budget], under Inductor: the chunked lowering
    made at the first call past the budget holds that call to it."""
    pos = lattice(60)
    V = torch.eye(180).view(180, 60, 3)
    budget = 2 * 2**20
    f = compile_dynbatch(hessian_rows, options={**DEFAULTS, "dynbatch.memory_budget": budget})
    for b in (4, 6):
        assert_same_grads(f(pos, V[:b]), eager_rows(pos, V[:b]), atol=1e-4, rtol=1e-4)
    assert not any(p.applied for p in plans())
    peak = _peak(f, pos, V)
    assert_same_grads(f(pos, V), eager_rows(pos, V), atol=1e-4, rtol=1e-4)
    assert dynbatch.counters()["graphs"] == 2 and [p.applied for p in plans()] == [False, True]
    assert peak <= 1.25 * budget + 180 * 60 * 3 * 4, peak


def test_user_loop_of_batched_grads_peaks_at_one_grad_not_all(monkeypatch):
    # Six grads of 30 rows whose backwards add up to more than memory.SEPARATE_ABOVE
    # (lowered here so that a small case stands for the large ones it is meant for).
    monkeypatch.setattr(memory, "SEPARATE_ABOVE", 2**20)
    n, rows = 60, 30
    pos = lattice(n)
    V = torch.eye(3 * n).view(3 * n, n, 3)

    def loop(pos, V):
        pos = pos.detach().requires_grad_()
        g = grad(lj_energy(pos), pos, create_graph=True)[0]
        return torch.cat([grad(g, pos, v, retain_graph=True, is_grads_batched=True)[0] for v in V.split(rows)])

    looped = compile_dynbatch(loop, options=DEFAULTS)  # the default budget
    loop_peak = _peak(looped, pos, V)
    loop_plan = plans()
    assert len(loop_plan) == 6 and all(p.applied and p.chunks == 1 for p in loop_plan)
    single = compile_dynbatch(hessian_rows, options=DEFAULTS)
    one_peak = _peak(single, pos, V[:rows])
    # Inductor reassociates the fp32 pair sums; the r^-14 terms make entries large.
    assert_same_grads(looped(pos, V), eager_rows(pos, V), atol=1e-4, rtol=1e-4)
    output = V.numel() * 4
    assert loop_peak <= 1.5 * one_peak + output, (loop_peak, one_peak)


def test_a_plan_that_cannot_be_made_costs_neither_the_compile_nor_the_markers(monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise ValueError("an expression the planner cannot evaluate")

    monkeypatch.setattr(memory, "_estimate", broken)
    x, V = torch.randn(4, 16), torch.randn(6, 4, 16)
    with caplog.at_level(logging.WARNING, logger="dynbatch"):
        out = compile_dynbatch(jacobian, options={"dynbatch.memory_budget": 1})(x, V)
    assert_same_grads(out, eager_jacobian(x, V))
    assert "no memory plan" in caplog.text and not plans()
    assert "batch_marker" not in dynbatch.compile_records()[-1].aten_graphs[0]


def _new_chunk_programs(before):
    return [p for k, p in chunking._PROGRAMS.items() if k not in before]


def _deps(program):
    return [n.name for n in program.gm.graph.find_nodes(op="placeholder") if n.name.startswith("dep_")]


def test_masks_built_from_sizes_are_rebuilt_in_the_chunk_program():
    # NOTE [Masks rebuilt in the chunk program]: lj_energy's eye and triu mask
    before = set(chunking._PROGRAMS)
    pos = lattice(8)
    V = torch.randn(24, 8, 3, generator=torch.Generator().manual_seed(2))
    out = compile_dynbatch(hessian_rows, options={"dynbatch.chunk_size": 10})(pos, V)
    assert_same_grads(out, eager_rows(pos, V), atol=1e-4, rtol=1e-4)
    (program,) = _new_chunk_programs(before)
    assert _deps(program) == []


def _energy_with(make_mask):
    def rows(pos, V):
        pos = pos.detach().requires_grad_()
        n = pos.shape[0]
        diff = pos.unsqueeze(1) - pos.unsqueeze(0)
        r2 = (diff * diff).sum(-1) + torch.eye(n)
        e = (r2.pow(-3) * make_mask(n)).sum()
        g = grad(e, pos, create_graph=True)[0]
        return grad(g, pos, V, is_grads_batched=True)[0]
    return rows


def _written_mask(n):
    mask = torch.ones(n, n)
    mask.triu_(1)  # written in place: the node the energy reads does not show it
    return mask


@pytest.mark.parametrize("make_mask, rebuilt", [
    (lambda n: torch.ones(n, n).triu(1), True),
    (_written_mask, False),
    (lambda n: torch.rand(n, n) + 1, False),  # a re-run would draw other numbers
])
def test_only_masks_without_writes_or_random_numbers_are_rebuilt(make_mask, rebuilt):
    before = set(chunking._PROGRAMS)
    pos = lattice(6)
    V = torch.randn(18, 6, 3, generator=torch.Generator().manual_seed(3))
    rows = _energy_with(make_mask)
    torch.manual_seed(0)
    out = compile_dynbatch(rows, options={"dynbatch.chunk_size": 5})(pos, V)
    (program,) = _new_chunk_programs(before)
    assert (_deps(program) == []) is rebuilt, _deps(program)
    torch.manual_seed(0)  # eager draws the same mask
    assert_same_grads(out, rows(pos, V), atol=1e-4, rtol=1e-4)


def test_chunk_loops_stay_out_of_cuda_graphs():
    # The chunk loop runs Python a CUDA graph's replay would skip: Inductor's own check
    # keeps it out of the graph's recordings, and its chunk programs record none.
    from torch._inductor.utils import get_first_incompatible_cudagraph_node

    before = set(chunking._PROGRAMS)
    pos = lattice(8)
    V = torch.randn(24, 8, 3, generator=torch.Generator().manual_seed(3))
    f = compile_dynbatch(hessian_rows, options={"dynbatch.chunk_size": 10, "triton.cudagraphs": True})
    assert_same_grads(f(pos, V), eager_rows(pos, V), atol=1e-4, rtol=1e-4)
    (program,) = _new_chunk_programs(before)
    assert program.compile.keywords["options"]["triton.cudagraphs"] is False

    gm = torch.fx.symbolic_trace(lambda x, v: torch.ops.dynbatch.chunked_grad.default(program.key, [x], [], [], [v]))
    node = get_first_incompatible_cudagraph_node(gm)
    assert node is not None and node.target is torch.ops.dynbatch.chunked_grad.default


def _write_by_aten_op(h):
    buf = torch.zeros_like(h)
    torch.ops.aten.copy_.default(buf, h * 2)  # as the aten graphs make_fx traces (NequIP's) call it
    return buf


def _write_by_method(h):
    buf = torch.zeros_like(h)
    buf.copy_(h * 2)
    return buf


def _write_to_a_view(h):
    buf = torch.zeros(h.shape[0] * h.shape[1], dtype=h.dtype)
    buf.view(h.shape)[:] = h * 2
    return buf.view(h.shape)


def _write_after_a_read(h):
    shift = torch.ones_like(h)
    y = h + shift  # the part reads it before it is written (a sum saves nothing for backward)
    shift.mul_(3)
    return y * shift


@pytest.mark.parametrize("make", [_write_by_aten_op, _write_by_method, _write_to_a_view, _write_after_a_read],
                         ids=["aten_op", "method", "view", "after_a_read"])
def test_a_write_the_grads_outputs_read_keeps_the_grad_whole(make):
    # A write in place is no edge of the graph: the chunk program's re-run of the nodes
    # between the grad's inputs and outputs missed a write to a tensor it recomputes (or read
    # a dep after a write the original read before), and the chunked grads were wrong
    # (NequIP's Hessian through its own compile path, 31-35 % off).  Such a grad is not chunked.
    torch.manual_seed(0)
    weight = torch.randn(4, 4, dtype=torch.float64)

    def rows(x, V):
        x = x.detach().requires_grad_()
        h = torch.tanh(x @ weight)
        y = torch.sin(make(h)) + h
        return grad(y, x, V, is_grads_batched=True)[0]

    x, V = torch.randn(3, 4, dtype=torch.float64), torch.randn(10, 3, 4, dtype=torch.float64)
    got = compile_dynbatch(rows, options={"dynbatch.chunk_size": 4})(x, V)
    assert_same_grads(got, rows(x, V))
    c = dynbatch.counters()
    assert c["graphs_batched"] == 1 and "grads_chunked" not in c, c
