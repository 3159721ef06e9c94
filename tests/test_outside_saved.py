"""Batched grads outside a compiled model from AOTAutograd's saved activations
(NOTE [Batched grads from the saved activations] in dynbatch/region/saved_backward.py).

A user compiles the model and takes ``is_grads_batched`` grads or
``jacobian(vectorize=True)`` outside it: AOTAutograd's backward graph runs under
vmap over the cotangents, on what the forward saved (counted
``outside_batched_saved``), compiled once per set of needed grads with B symbolic
(``saved_backward_programs``), and no forward is recomputed.  Where that is not
exact the recompute path answers (``outside_batched_compiled``).  Every value is
compared with eager PyTorch on the same model.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.autograd.functional as AF

import dynbatch
from conftest import INDUCTOR, assert_same_grads, compile_dynbatch, loop_grads

grad = torch.autograd.grad


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.GELU(),
                               torch.nn.Linear(8, 3)).double()


def x64(*shape, requires_grad=False):
    torch.manual_seed(1)
    return torch.randn(*shape, dtype=torch.float64, requires_grad=requires_grad)


def counts() -> dict[str, int]:
    return dynbatch.counters()


def saved_programs() -> list:
    return [r for r in dynbatch.compile_records() if r.saved_backward]


def test_jacobian_of_a_module_runs_its_backward_graph_over_the_saved_activations():
    model = mlp()
    m = compile_dynbatch(model, fullgraph=False)
    x = x64(2, 4)
    for _ in range(2):  # the first call through dynbatch's node, the second through AOTAutograd's
        assert_same_grads(AF.jacobian(m, x, vectorize=True), AF.jacobian(model, x, vectorize=True))
    c = counts()
    # One Dynamo graph (the model's): no second frame that recomputes the forward.
    assert c["graphs"] == 1 and c["outside_batched_saved"] == 2 and c["saved_backward_programs"] == 1, c
    assert "outside_batched_compiled" not in c and "outside_eager" not in c, c
    # The program is AOTAutograd's backward under vmap: the forward's products are not in it.
    (program,) = saved_programs()
    assert program.aten_graphs[-1].count("aten.tanh.default") == 0, program.aten_graphs[-1]


@pytest.mark.parametrize("options", [INDUCTOR, None], ids=["inductor", "aot_eager"])
def test_batch_sizes_share_one_program(options):
    model = mlp()
    m = compile_dynbatch(model, options=options, fullgraph=False)
    x = x64(5, 4, requires_grad=True)
    for B in (3, 7, 2, 16):
        V = torch.randn(B, 5, 3, dtype=torch.float64)
        assert_same_grads(grad(m(x), x, V, is_grads_batched=True)[0],
                          grad(model(x), x, V, is_grads_batched=True)[0], msg=f"B={B}")
    c = counts()
    # B is symbolic from the first call: one program for every B, and no Dynamo recompile.
    assert c["graphs"] == 1 and c["saved_backward_programs"] == 1 and c["outside_batched_saved"] == 4, c
    (program,) = saved_programs()
    assert "f64[s0, 5, 3] = input" in program.aten_graphs[-1], program.aten_graphs[-1]


def test_a_first_batch_of_one_compiles_for_it_then_for_every_other():
    model = mlp()
    m = compile_dynbatch(model, fullgraph=False)
    x = x64(5, 4, requires_grad=True)
    for B in (1, 4, 9, 1):
        V = torch.randn(B, 5, 3, dtype=torch.float64)
        assert_same_grads(grad(m(x), x, V, is_grads_batched=True)[0],
                          grad(model(x), x, V, is_grads_batched=True)[0], msg=f"B={B}")
    c = counts()
    assert c["saved_backward_programs"] == 2 and c["outside_batched_saved"] == 4, c


def test_each_set_of_needed_grads_computes_those_alone():
    # NOTE [Only the grads a backward uses]: the backward graph's other grads are dead code.
    model = mlp()
    m = compile_dynbatch(model, fullgraph=False)
    x = x64(5, 4, requires_grad=True)
    weights = [model[0].weight, model[4].bias]
    V = torch.randn(6, 5, 3, dtype=torch.float64)
    for wrt in ([x], weights, [x, *weights], [x], list(model.parameters())):
        assert_same_grads(grad(m(x), wrt, V, is_grads_batched=True), grad(model(x), wrt, V, is_grads_batched=True),
                          msg=f"{len(wrt)} inputs")
    c = counts()
    assert c["graphs"] == 1 and c["outside_batched_saved"] == 5 and c["saved_backward_programs"] == 4, c
    returned = [p.aten_graphs[-1].splitlines()[-1].count("%") for p in saved_programs()]
    assert returned == [1, 2, 3, 6], returned


def test_a_graph_retained_answers_again_and_then_is_freed():
    model = mlp()
    m = compile_dynbatch(model, fullgraph=False)
    x = x64(5, 4, requires_grad=True)
    m(x)  # the later calls put AOTAutograd's node in the caller's graph
    out, want = m(x), model(x)
    V1, V2 = torch.randn(3, 5, 3, dtype=torch.float64), torch.randn(4, 5, 3, dtype=torch.float64)
    assert_same_grads(grad(out, x, V1, is_grads_batched=True, retain_graph=True)[0],
                      grad(want, x, V1, is_grads_batched=True, retain_graph=True)[0])
    assert_same_grads(grad(out, x, V2, is_grads_batched=True)[0], grad(want, x, V2, is_grads_batched=True)[0])
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        grad(out, x, V1, is_grads_batched=True)
    assert counts()["outside_batched_saved"] == 2, counts()


def test_an_input_changed_in_place_after_the_forward_raises_as_eager():
    model = mlp()
    m = compile_dynbatch(model, fullgraph=False)
    x = x64(5, 4, requires_grad=True)
    m(x)
    out = m(x)
    with torch.no_grad():
        model[0].weight.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        grad(out, x, torch.randn(3, 5, 3, dtype=torch.float64), is_grads_batched=True)


def test_an_output_in_its_own_layout_gets_tangents_in_that_layout():
    # The output's strides are the transpose's (static shapes: AOTAutograd traced its
    # backward with tangents in the output's own layout), and a model with weights.
    torch.manual_seed(0)
    w = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)

    def f(x):
        return (x @ w).t() * 2

    x = x64(5, 4, requires_grad=True)
    c = compile_dynbatch(f, fullgraph=False)
    assert not c(x).is_contiguous()
    V = torch.randn(7, 6, 5, dtype=torch.float64)
    for _ in range(2):
        assert_same_grads(grad(c(x), [x, w], V, is_grads_batched=True), grad(f(x), [x, w], V, is_grads_batched=True))
    assert counts()["outside_batched_saved"] == 2, counts()


def test_a_graph_that_writes_running_statistics_writes_them_once():
    # No recompute: the running statistics of a BatchNorm in training mode are what eager's are.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.Tanh(),
                                torch.nn.Linear(6, 3)).double()
    twin = copy.deepcopy(model)
    m = compile_dynbatch(twin, fullgraph=False)
    x = x64(5, 4, requires_grad=True)
    V = torch.randn(4, 5, 3, dtype=torch.float64)
    for _ in range(3):
        assert_same_grads(grad(m(x), x, V, is_grads_batched=True)[0], grad(model(x), x, V, is_grads_batched=True)[0])
        assert_same_grads(tuple(twin.buffers()), tuple(model.buffers()))
    assert counts()["outside_batched_saved"] == 3, counts()


def test_a_memory_budget_runs_the_program_in_chunks():
    model = mlp()
    m = compile_dynbatch(model, options={"dynbatch.memory_budget": 4096}, fullgraph=False)
    x = x64(5, 4, requires_grad=True)
    V = torch.randn(40, 5, 3, dtype=torch.float64)
    assert_same_grads(grad(m(x), x, V, is_grads_batched=True)[0], grad(model(x), x, V, is_grads_batched=True)[0])
    (program,) = saved_programs()
    (plan,) = program.memory_plan
    assert plan.applied and plan.chunks > 1 and plan.chunk_size * plan.bytes_per_sample <= 4096, plan
    assert counts()["saved_backward_programs"] == 1, counts()


# --- where the recompute path answers -------------------------------------------------

def test_an_output_that_aliases_an_input_recomputes(caplog):
    # AOTAutograd regenerates an output that is a view of an input outside its node: the
    # outputs are not one node's, whose saved activations would answer.  The recompute
    # path answers, with the reason logged.
    model = mlp()

    def f(x):
        return model(x), x.t()

    c = compile_dynbatch(f, fullgraph=False)
    x = x64(5, 4, requires_grad=True)
    V = (torch.randn(3, 5, 3, dtype=torch.float64), torch.randn(3, 4, 5, dtype=torch.float64))
    with caplog.at_level(logging.INFO, logger="dynbatch"):
        for _ in range(2):
            assert_same_grads(grad(c(x), x, V, is_grads_batched=True)[0], grad(f(x), x, V, is_grads_batched=True)[0])
    c = counts()
    assert c["outside_batched_compiled"] == 2 and "outside_batched_saved" not in c, c
    assert "not from its saved activations: its outputs do not come from one AOTAutograd node" in caplog.text


def test_deterministic_algorithms_turned_on_after_the_compile_recompute(caplog):
    # AOTAutograd refuses its backward then; the recompute compiles under the new setting.
    model = mlp()
    m = compile_dynbatch(model, fullgraph=False)
    x = x64(5, 4, requires_grad=True)
    m(x)
    out = m(x)
    V = torch.randn(3, 5, 3, dtype=torch.float64)
    torch.use_deterministic_algorithms(True)
    try:
        with caplog.at_level(logging.INFO, logger="dynbatch"):
            got = grad(out, x, V, is_grads_batched=True)[0]
    finally:
        torch.use_deterministic_algorithms(False)
    assert_same_grads(got, grad(model(x), x, V, is_grads_batched=True)[0])
    assert counts()["outside_batched_compiled"] == 1 and "outside_batched_saved" not in counts(), counts()
    assert "deterministic algorithms" in caplog.text, caplog.text


def test_random_ops_loop_per_sample_over_the_compiled_backward():
    # Dropout's mask is the forward's: the per-sample loop over AOTAutograd's own backward.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 3)).double()
    m = compile_dynbatch(model, fullgraph=False)
    x = x64(5, 4, requires_grad=True)
    out = m(x)
    V = torch.randn(3, 5, 3, dtype=torch.float64)
    got = grad(out, x, V, is_grads_batched=True, retain_graph=True)[0]
    assert_same_grads(got, loop_grads(out, x, V)[0])
    c = counts()
    assert c["outside_per_sample"] == 1 and "outside_batched_saved" not in c, c


def test_a_graph_a_grad_inside_freed_recomputes_and_raises_as_eager():
    # NOTE [A grad that consumes returned tensors]: the grad inside is traced retaining y's
    # graph, so the saved activations would answer; eager's second backward raises.
    def f(x, V):
        y = torch.exp(x)
        first = grad(y, x, V, is_grads_batched=True)
        return first, grad(y, x, V, is_grads_batched=True)

    x, V = x64(3, requires_grad=True), torch.randn(4, 3, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        f(x, V)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        compile_dynbatch(f, fullgraph=False)(x, V)
    assert counts()["graphs"] == 1 and "outside_batched_saved" not in counts(), counts()


def test_forces_in_the_forward_take_the_saved_activations_from_the_first_call():
    # A force field that returns its forces (create_graph=True inside): AOTAutograd's
    # backward graph is a double backward, vmapped over the cotangents from the first call
    # on; no call switches path and a repeat compiles nothing (NOTE [One path per request]).
    model = mlp()

    def energy_and_forces(pos):
        pos = pos.detach().requires_grad_() if not pos.requires_grad else pos
        e = model(pos).pow(2).sum()
        return e, -grad(e, pos, create_graph=True)[0]

    c = compile_dynbatch(energy_and_forces, fullgraph=False)
    pos = x64(5, 4, requires_grad=True)
    for call, batch in enumerate((6, 6, 3, 6)):
        V = torch.randn(batch, 5, 4, dtype=torch.float64)
        got = grad(c(pos)[1], pos, V, is_grads_batched=True)[0]
        assert_same_grads(got, grad(energy_and_forces(pos)[1], pos, V, is_grads_batched=True)[0])
        if call == 0:
            first = counts()
    c_now = counts()
    assert c_now["outside_batched_saved"] == 4 and "outside_batched_compiled" not in c_now, c_now
    assert c_now["saved_backward_programs"] == first["saved_backward_programs"] == 1, c_now
    assert c_now["graphs"] == first["graphs"], (first, c_now)


def test_softmax_backward_stays_one_program_across_batch_sizes():
    # AOTAutograd's backward graph of softmax holds Inductor's prims.fma, which has no
    # functorch rule: its per-sample fallback would read B as an int (a program per B,
    # then the recompute path).  batch_rules.fma keeps one program, B symbolic.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Softmax(dim=-1), torch.nn.Linear(6, 3)).double()
    m = compile_dynbatch(model, fullgraph=False)
    x = x64(5, 4, requires_grad=True)
    for b in (3, 7, 11):
        V = torch.randn(b, 5, 3, dtype=torch.float64)
        assert_same_grads(grad(m(x), x, V, is_grads_batched=True)[0], grad(model(x), x, V, is_grads_batched=True)[0])
    c = counts()
    assert c["outside_batched_saved"] == 3 and c["saved_backward_programs"] == 1, c
    assert "outside_batched_compiled" not in c, c


def _float64_steps(pos, weight):
    r = (pos.to(torch.float64) ** 2).sum(-1, keepdim=True).sqrt().to(torch.float32)
    return torch.tanh(r * weight[:3].sum(0)).sum()


def _slices(pos, weight):
    h = torch.tanh(pos @ weight)
    return (h[:, 1:4].sin() * h[:, :3]).sum()


@pytest.mark.parametrize("energy", [_float64_steps, _slices], ids=["float64_steps", "slices"])
def test_a_force_model_through_inductors_decompositions_stays_one_program_across_sizes(energy):
    # Inductor's decompositions put ops without a functorch rule in AOTAutograd's backward
    # graphs: prims.convert_element_type (a float32 model with float64 steps) and
    # _unsafe_masked_index (slice_scatter, a slice's backward).  The per-sample fallback made a
    # program per B, and under a symbolic B it raised "Cannot call sizes() on tensor with
    # symbolic sizes", sending NequIP's Hessians to the recompute path.  dynbatch's rules keep
    # one program over atom counts and B.  Inductor: aot_eager keeps aten._to_copy and
    # slice_backward.
    torch.manual_seed(0)
    weight = torch.randn(3, 6)

    def energy_and_forces(pos):
        e = energy(pos, weight)
        return e, -grad(e, pos, create_graph=True)[0]

    c = compile_dynbatch(energy_and_forces, options=INDUCTOR, fullgraph=False, dynamic=True)
    for n in (5, 7):
        pos = torch.randn(n, 3, requires_grad=True)
        rows = torch.eye(3 * n).reshape(3 * n, n, 3)
        assert_same_grads(grad(c(pos)[1], pos, rows, is_grads_batched=True)[0],
                          grad(energy_and_forces(pos)[1], pos, rows, is_grads_batched=True)[0])
    now = counts()
    assert now["outside_batched_saved"] == 2 and now["saved_backward_programs"] == 1, now
    assert now["graphs"] == 1 and "outside_batched_compiled" not in now, now


class AttentionBlock(torch.nn.Module):
    """One head of self-attention and a residual MLP, as the benchmark's attention case."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 2 * d), torch.nn.GELU(), torch.nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        h = x + torch.softmax(q @ k.mT / q.shape[-1] ** 0.5, dim=-1) @ v
        return h + self.mlp(h)


@pytest.mark.parametrize("api", ["is_grads_batched", "vmap"])
@pytest.mark.parametrize("make", [mlp, lambda: AttentionBlock().double()], ids=["mlp", "attention"])
def test_batched_vjps_of_a_compiled_module_take_one_program(make, api):
    # The outside cases of the benchmark: a batched VJP of a compiled module, by eager's
    # is_grads_batched or torch.vmap over a vjp, runs the saved activations' program from the
    # first call; later calls (another B) compile nothing (NOTE [One path per request]).
    torch.manual_seed(0)
    model = make()
    m = compile_dynbatch(model, fullgraph=False)
    x = x64(6, 4 if isinstance(model, torch.nn.Sequential) else 8, requires_grad=True)

    def vjps(f, V):
        out = f(x)
        if api == "vmap":
            return torch.vmap(lambda v: grad(out, x, v, retain_graph=True)[0])(V)
        return grad(out, x, V, is_grads_batched=True)[0]

    for call, batch in enumerate((5, 9, 5)):
        V = torch.randn(batch, *model(x).shape, dtype=torch.float64)
        assert_same_grads(vjps(m, V), vjps(model, V), msg=f"call {call}")
        if call == 0:
            first = {k: v for k, v in counts().items() if not k.startswith("outside_")}
    c = counts()
    assert c["outside_batched_saved"] == 3 and "outside_batched_compiled" not in c and "outside_eager" not in c, c
    assert {k: v for k, v in c.items() if not k.startswith("outside_")} == first, (first, c)


def test_the_saved_programs_views_are_reshapes_that_survive_b_inside_a_tensor():
    # AOTAutograd traces a view where the unbatched tensor is contiguous; under vmap a
    # tensor may hold B between the dims the view merges (NequIP's Hessian: [B, 8, 4, 3]
    # strides (3, 288, 72, 1)), and the view raised, sending it to the recompute path.  The
    # saved program's graph reshapes instead (saved_backward._views_as_reshapes).
    from dynbatch.region import saved_backward

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(torch.ops.aten.view.default, (x, [8, 12])))
    fn = torch.fx.GraphModule(torch.nn.Module(), graph)
    b_inside = torch.randn(8, 4, 5, 3)  # B = 5 between the merged dims, as vmap may hold it
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        torch.vmap(fn, in_dims=2)(b_inside)
    saved_backward._views_as_reshapes(graph)
    fn.recompile()
    torch.testing.assert_close(torch.vmap(fn, in_dims=2)(b_inside), b_inside.movedim(2, 0).reshape(5, 8, 12))
