"""CUDA: the batched backward through Inductor's Triton backend, with TF32 off."""

from __future__ import annotations

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import dynbatch
from conftest import assert_backend_ran, assert_same_grads, loop_grads

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(autouse=True)
def no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def make_mlp(width=64):
    g = torch.Generator().manual_seed(0)
    Ws = [(torch.randn(width, width, generator=g) / width ** 0.5).cuda() for _ in range(3)]

    def vjp(x, V):
        y = x
        for W in Ws:
            y = torch.tanh(y @ W)
        return torch.autograd.grad(y, x, V, is_grads_batched=True)

    return vjp


def test_triton_kernels_and_eager_parity():
    vjp = make_mlp()
    compiled = torch.compile(vjp, backend="dynbatch", fullgraph=True)
    x, V = torch.randn(8, 64, device="cuda", requires_grad=True), torch.randn(16, 8, 64, device="cuda")
    result, code = run_and_get_code(compiled, x, V)
    assert_same_grads(result, vjp(x, V), atol=1e-5, rtol=1e-4)
    assert "triton" in "\n".join(code)
    assert_backend_ran(graphs=1, batched=1)


def test_batch_sweep_on_cuda_compiles_at_most_two_graphs():
    vjp = make_mlp()
    compiled = torch.compile(vjp, backend="dynbatch", fullgraph=True)
    x = torch.randn(8, 64, device="cuda", requires_grad=True)
    for B in (2, 3, 5, 8, 13, 32, 64, 100, 128):
        V = torch.randn(B, 8, 64, device="cuda")
        assert_same_grads(compiled(x, V), vjp(x, V), atol=1e-5, rtol=1e-4)
    c = dynbatch.counters()
    assert c["graphs"] == c["graphs_batched"] <= 2, c


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hessian_rows_and_loop_oracle_on_cuda(dtype):
    W = (torch.randn(32, 32) / 6).to("cuda", dtype)

    def hess_rows(x, V):
        (g,) = torch.autograd.grad(torch.tanh(x @ W).pow(2).sum(), x, create_graph=True)
        return torch.autograd.grad(g, x, V, is_grads_batched=True)

    x = torch.randn(2, 32, device="cuda", dtype=dtype, requires_grad=True)
    V = torch.eye(64, device="cuda", dtype=dtype).reshape(64, 2, 32)
    got = torch.compile(hess_rows, backend="dynbatch", fullgraph=True)(x, V)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    assert_same_grads(got, hess_rows(x, V), **tol)
    xl = x.detach().requires_grad_()
    (g,) = torch.autograd.grad(torch.tanh(xl @ W).pow(2).sum(), xl, create_graph=True)
    assert_same_grads(got, loop_grads(g, xl, V), **tol)


def test_error_is_eagers_on_cuda():
    vjp = make_mlp()
    x, V = torch.randn(8, 64, device="cuda", requires_grad=True), torch.randn(4, 8, 63, device="cuda")
    with pytest.raises(RuntimeError) as eager:
        vjp(x, V)
    with pytest.raises(RuntimeError) as ours:
        torch.compile(vjp, backend="dynbatch")(x, V)
    assert str(ours.value) == str(eager.value)


def _conv_norm_net():
    g = torch.Generator().manual_seed(0)
    w1 = (torch.randn(8, 3, 3, 3, generator=g) / 5).cuda().requires_grad_()
    w2 = (torch.randn(8, 8, 3, 3, generator=g) / 8).cuda().requires_grad_()
    gamma = torch.rand(8, generator=g).add(0.5).cuda().requires_grad_()
    ln_w = torch.rand(8, generator=g).add(0.5).cuda().requires_grad_()
    params = [w1, w2, gamma, ln_w]

    def net(x):
        h = torch.nn.functional.conv2d(x, w1, padding=1)
        h = torch.nn.functional.batch_norm(h, None, None, gamma, None, training=True).tanh()
        h = torch.nn.functional.conv_transpose2d(h, w2.transpose(0, 1), groups=1)
        return torch.nn.functional.layer_norm(h.mean((2, 3)), (8,), ln_w)

    return net, params


def test_conv_and_norm_rules_on_cuda_keep_b_symbolic():
    """dynbatch's convolution and norm rules (batching/batch_rules.py) on cuDNN: values
    equal the loop, one graph for every B >= 2 (on CPU, float32 convolutions add
    PyTorch's B*N >= 16 oneDNN guard; CUDA has none).  Passed on an H200 (torch 2.11)."""
    net, params = _conv_norm_net()
    x = torch.randn(2, 3, 8, 8, device="cuda")

    def f(*args):
        *ps, V = args
        return torch.autograd.grad(net(x), ps, V, is_grads_batched=True)

    compiled = torch.compile(f, backend="dynbatch", fullgraph=True)
    for B in (2, 3, 5, 9):
        V = torch.randn(B, 2, 8, device="cuda")
        assert_same_grads(compiled(*params, V), loop_grads(net(x), params, [V]), atol=1e-4, rtol=1e-4)
    c = dynbatch.counters()
    assert c["graphs"] <= 2 and not c.get("fallbacks"), c


# --- cuDNN batch norm (batch_rules.cudnn_batch_norm_backward) ---------------------

def _cudnn_bn_case(dtype=torch.float32):
    """Batch norm with weight and bias on a 4-d CUDA input: autograd records
    cuDNN's op, so the batched backward calls cudnn_batch_norm_backward."""
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*shape, generator=g, dtype=dtype).cuda().requires_grad_()
               for shape in ((4, 3, 2, 2), (3,), (3,)))

    def layer(x, w, b):
        return torch.nn.functional.batch_norm(x, None, None, w, b, training=True)

    if "Cudnn" not in layer(x, w, b).grad_fn.name():
        pytest.skip(reason=f"batch norm did not take cuDNN here ({layer(x, w, b).grad_fn.name()})")
    return layer, [x, w, b]


def _second(gs, primals):
    return torch.autograd.grad(sum((g * g.sin()).sum() for g in gs), primals,
                               allow_unused=True, materialize_grads=True)


def _cudnn_bn_second_order(layer, primals):
    def f(x, w, b, V):
        gs = torch.autograd.grad(layer(x, w, b), (x, w, b), V, create_graph=True, is_grads_batched=True)
        return _second(gs, (x, w, b))

    compiled = torch.compile(f, backend="dynbatch", fullgraph=True)
    y = layer(*primals)
    V = torch.randn(4, *y.shape, dtype=y.dtype, device="cuda")
    return compiled(*primals, V), _second(loop_grads(y, primals, [V], create_graph=True), primals)


def test_cudnn_batch_norm_backward_keeps_b_symbolic():
    layer, primals = _cudnn_bn_case()

    def f(x, w, b, V):
        return torch.autograd.grad(layer(x, w, b), (x, w, b), V, is_grads_batched=True)

    compiled = torch.compile(f, backend="dynbatch", fullgraph=True)
    for B in (2, 3, 5, 9):
        y = layer(*primals)
        V = torch.randn(B, *y.shape, dtype=y.dtype, device="cuda")
        assert_same_grads(compiled(*primals, V), loop_grads(y, primals, [V]), atol=1e-4, rtol=1e-4, msg=f"B={B}")
    c = dynbatch.counters()
    assert c["graphs"] <= 2 and c["grads_batched"] >= 1 and not c.get("fallbacks"), c


def test_cudnn_batch_norm_second_derivative_matches_the_loop():
    """Batched grads with create_graph=True through cuDNN's batch norm, then a
    grad of them: with dynbatch's rule, the loop's values."""
    got, expected = _cudnn_bn_second_order(*_cudnn_bn_case())
    assert_same_grads(got, expected, atol=1e-4, rtol=1e-4)
    assert dynbatch.counters()["grads_batched"] == 1 and not dynbatch.counters().get("fallbacks"), dynbatch.counters()


def _without_rules(monkeypatch, *names):
    from dynbatch.batching import batch_rules

    ours = batch_rules.all_rules()
    monkeypatch.setattr(batch_rules, "all_rules", lambda: {k: v for k, v in ours.items() if k not in names})


def test_the_second_derivative_test_fails_on_functorchs_rules(monkeypatch):
    """The test above fails with functorch's rules in place of dynbatch's: the
    reason the rules exist (as native_batch_norm_backward's on the CPU)."""
    _without_rules(monkeypatch, "cudnn_batch_norm_backward", "miopen_batch_norm_backward",
                   "native_batch_norm_backward")
    got, expected = _cudnn_bn_second_order(*_cudnn_bn_case())
    with pytest.raises(AssertionError):
        assert_same_grads(got, expected, atol=1e-4, rtol=1e-4)


def test_functorchs_cudnn_rule_defers_to_the_native_rule(monkeypatch):
    """functorch batches cudnn_batch_norm_backward by calling
    native_batch_norm_backward (seen on torch 2.11, H200), so its values are
    right once dynbatch's native rule is in place; dynbatch's own cuDNN rule
    makes that explicit rather than relying on it."""
    _without_rules(monkeypatch, "cudnn_batch_norm_backward", "miopen_batch_norm_backward")
    got, expected = _cudnn_bn_second_order(*_cudnn_bn_case())
    assert_same_grads(got, expected, atol=1e-4, rtol=1e-4)


# --- the CNN Jacobian (bench workload cnn_jacobian) ---------------------------------

def test_functional_jacobian_of_a_cnn_on_cuda():
    """functional.jacobian(vectorize=True) of a 2-conv CNN: crashed once on torch
    2.11 + CUDA ("Cannot access data pointer of Tensor that doesn't have storage")."""
    from dynbatch.bench import variants, workloads

    (problem,) = workloads.build("cnn_jacobian", "quick", None, torch.device("cuda"), None)
    case = problem.cases[0]
    got = variants.build("dynbatch", problem, torch.device("cuda")).call(case.x, case.cotangents)
    expected = variants.build("eager_loop", problem, torch.device("cuda")).call(case.x, case.cotangents)
    assert_same_grads(got, expected, atol=1e-5, rtol=1e-4)
    c = dynbatch.counters()
    assert c["grads_batched"] >= 1 and not c.get("fallbacks"), c


# --- CUDA graphs: mode="reduce-overhead" ------------------------------------------

def _cuda_graphs_recorded() -> int:
    from torch._inductor import cudagraph_trees

    manager = cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
    return 0 if manager is None else sum(len(nodes) for nodes in manager.roots.values())


def test_reduce_overhead_replays_cuda_graphs_with_b_symbolic():
    """mode="reduce-overhead": Inductor's CUDA graph trees replay dynbatch's
    batched backward; a new B records a new CUDA graph of the same compiled
    (B-symbolic) code, not a recompile."""
    from torch._dynamo.utils import counters

    vjp = make_mlp()
    compiled = torch.compile(vjp, backend="dynbatch", mode="reduce-overhead", fullgraph=True)
    x = torch.randn(8, 64, device="cuda", requires_grad=True)
    skips = counters["inductor"]["cudagraph_skips"]
    for B in (2, 3, 5, 8, 13, 3, 8):
        V = torch.randn(B, 8, 64, device="cuda")
        for _ in range(3):  # warm-up, record, replay
            torch.compiler.cudagraph_mark_step_begin()
            got = compiled(x, V)[0].clone()
        assert_same_grads((got,), vjp(x, V), atol=1e-5, rtol=1e-4, msg=f"B={B}")
    c = dynbatch.counters()
    assert c["graphs"] == c["graphs_batched"] <= 2, c
    assert counters["inductor"]["cudagraph_skips"] == skips, dict(counters["inductor"])
    assert _cuda_graphs_recorded() >= 1


# --- the snapshot programs (tests/test_snapshots.py) on CUDA ------------------------

def _snapshot_programs():
    import test_snapshots

    return test_snapshots


@pytest.mark.parametrize("name", ["mlp_jacobian", "multi_output_allow_unused", "hessian_rows",
                                  "functional_jacobian", "attention_block", "fallback_bad_cotangent"])
def test_snapshot_programs_on_cuda(name, monkeypatch):
    """Each snapshot program with its weights and inputs on the GPU: eager's values
    (or eager's error), B symbolic after the second size, Triton kernels."""
    snapshots = _snapshot_programs()
    for weight in ("W1", "W2", "W3", "Wq", "Wk", "Wv"):
        monkeypatch.setattr(snapshots, weight, getattr(snapshots, weight).cuda())
    fn, make_inputs = snapshots.PROGRAMS[name]
    compiled = torch.compile(fn, backend="dynbatch", fullgraph=True)
    codes = []
    for B in (3, 5, 8):
        args = [None if a is None else a.cuda() for a in make_inputs(B)]
        if name.startswith("fallback"):
            with pytest.raises(RuntimeError) as eager:
                fn(*args)
            with pytest.raises(RuntimeError) as ours:
                compiled(*args)
            assert str(ours.value) == str(eager.value)
            continue
        # run_and_get_code resets Dynamo: only the first call, or every B would compile anew
        got, code = run_and_get_code(compiled, *args) if B == 3 else (compiled(*args), [])
        codes += code
        assert_same_grads(got, fn(*args), atol=1e-5, rtol=1e-4, msg=f"B={B}")
    c = dynbatch.counters()
    if name.startswith("fallback"):
        assert c.get("fallbacks"), c
    else:
        assert not c.get("fallbacks") and c["grads_batched"] >= 1 and c["graphs_batched"] <= 2, c
        assert "triton" in "\n".join(codes)


# --- the CUDA attention backwards (batch_rules.fold_attention_backward) --------

_SDPA_BACKENDS = {  # backend: (dtype it takes, with a float mask, forward op autograd records)
    "FLASH_ATTENTION": (torch.bfloat16, False, "_scaled_dot_product_flash_attention"),
    "EFFICIENT_ATTENTION": (torch.float32, True, "_scaled_dot_product_efficient_attention"),
    "CUDNN_ATTENTION": (torch.bfloat16, False, "_scaled_dot_product_cudnn_attention"),
}


@pytest.mark.parametrize("backend", list(_SDPA_BACKENDS))
def test_cuda_attention_backwards_match_the_loop_with_one_graph_for_every_B(backend):
    """No functorch rule: vmap looped per sample and read B as an int (a graph
    per B).  dynbatch folds B into the attention batch."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils._python_dispatch import TorchDispatchMode

    dtype, masked, forward_op = _SDPA_BACKENDS[backend]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 64, generator=g).to("cuda", dtype).requires_grad_() for _ in range(3))
    mask = torch.randn(1, 1, 16, 16, generator=g).to("cuda", dtype) if masked else None

    def layer(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def f(q, k, v, V):
        return torch.autograd.grad(layer(q, k, v), (q, k, v), V, is_grads_batched=True)

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.add(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    seen: set = set()
    with sdpa_kernel([getattr(SDPBackend, backend)]):
        try:
            with Ops():
                layer(q, k, v)
        except RuntimeError as e:
            pytest.skip(reason=f"{backend} does not run here: {e}")
        assert forward_op in seen, seen
        compiled = torch.compile(f, backend="dynbatch", fullgraph=True)
        tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
        for B in (2, 3, 5, 8):
            V = torch.randn(B, 2, 4, 16, 64, device="cuda", dtype=dtype)
            assert_same_grads(compiled(q, k, v, V), loop_grads(layer(q, k, v), (q, k, v), [V]),
                              msg=f"B={B}", **tol)
    c = dynbatch.counters()
    assert c["graphs_batched"] <= 2 and not c.get("fallbacks"), c


# --- grads taken outside a compiled model (region/edge.py) -------------------------

def _force_step(model, pos, f_ref, inside):
    """One force-matching step (tests/test_force_training.py) on pos's device."""
    model.zero_grad()
    pos = pos.clone()
    if inside:
        energy, forces = model(pos)
    else:
        energy = model(pos.requires_grad_())
        forces = -torch.autograd.grad(energy, pos, create_graph=True)[0]
    ((energy - 0.5) ** 2 + ((forces - f_ref) ** 2).mean()).backward()
    return tuple(p.grad.clone() for p in model.parameters()) + (pos.grad,)


@pytest.mark.parametrize("inside", [False, True], ids=["forces_outside", "forces_in_forward"])
def test_force_training_through_a_compiled_model_on_cuda(inside):
    import test_force_training as ft

    eager, twin = (m.cuda() for m in ft.models(ft.ForcesInForward if inside else ft.PairPotential))
    compiled = torch.compile(twin, backend="dynbatch", fullgraph=True)
    for step, n in enumerate((6, 6, 6, 9)):
        pos = ft.positions(n, seed=step).cuda()
        f_ref = torch.randn(n, 3, dtype=pos.dtype, device="cuda")
        assert_same_grads(_force_step(compiled, pos, f_ref, inside), _force_step(eager, pos, f_ref, inside),
                          msg=f"step {step}")
    c = dynbatch.counters()
    assert c.get("outside_eager", 0) == 0 and not c.get("fallbacks"), c
    if inside:
        assert c.get("graphs") == 2 and c.get("outside_plain", 0) == 4, c
    else:
        assert c.get("outside_vjp_compiled", 0) == 0 and c.get("outside_grads_at_forward", 0) >= 2, c


def test_batched_jacobian_of_a_compiled_module_on_cuda():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8)).cuda().double()
    compiled = torch.compile(model, backend="dynbatch")
    x = torch.randn(4, 16, device="cuda", dtype=torch.float64, requires_grad=True)
    for B in (2, 3, 5, 9):
        V = torch.randn(B, 4, 8, device="cuda", dtype=torch.float64)
        got = torch.autograd.grad(compiled(x), x, V, is_grads_batched=True)
        assert_same_grads(got, loop_grads(model(x), x, [V]), msg=f"B={B}")
    c = dynbatch.counters()
    # AOTAutograd's backward batched over the saved activations: one program, B symbolic
    assert c.get("outside_batched_saved") == 4 and c.get("saved_backward_programs") == 1, c
    assert not c.get("outside_eager"), c


@pytest.mark.parametrize("inside", [False, True], ids=["forces_outside", "forces_in_forward"])
def test_reduce_overhead_outside_a_compiled_model_replays_cuda_graphs(inside):
    """mode="reduce-overhead" on the paths around a compiled model: a batched Jacobian
    (is_grads_batched outside it, B symbolic) and a force-training step, each call a new
    step; values equal eager's and no CUDA graph was skipped."""
    import test_force_training as ft
    from torch._dynamo.utils import counters

    skips = counters["inductor"]["cudagraph_skips"]
    eager, twin = (m.cuda() for m in ft.models(ft.ForcesInForward if inside else ft.PairPotential))
    compiled = torch.compile(twin, backend="dynbatch", mode="reduce-overhead")
    for step, n in enumerate((6, 6, 6, 6)):
        pos = ft.positions(n, seed=step).cuda()
        f_ref = torch.randn(n, 3, dtype=pos.dtype, device="cuda")
        torch.compiler.cudagraph_mark_step_begin()
        assert_same_grads(_force_step(compiled, pos, f_ref, inside), _force_step(eager, pos, f_ref, inside),
                          msg=f"step {step}")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8)).cuda()
    jacobian_of = torch.compile(model, backend="dynbatch", mode="reduce-overhead")
    x = torch.randn(4, 16, device="cuda", requires_grad=True)
    for B in (2, 3, 5, 9, 9, 9):
        V = torch.randn(B, 4, 8, device="cuda")
        torch.compiler.cudagraph_mark_step_begin()
        got = tuple(g.clone() for g in torch.autograd.grad(jacobian_of(x), x, V, is_grads_batched=True))
        assert_same_grads(got, loop_grads(model(x), x, [V]), atol=1e-5, rtol=1e-4, msg=f"B={B}")
    c = dynbatch.counters()
    assert not c.get("outside_eager") and not c.get("fallbacks"), c
    assert counters["inductor"]["cudagraph_skips"] == skips, dict(counters["inductor"])
    assert _cuda_graphs_recorded() >= 1


def test_no_device_sync_in_a_steady_call_of_any_path():
    """torch.cuda.set_sync_debug_mode("error") over the steady calls (after the compiles)
    of the batched grad inside a compiled function, outside a compiled model, and a
    force-training step through a compiled model: none waits for the device."""
    import test_force_training as ft

    vjp = make_mlp()
    inside = torch.compile(vjp, backend="dynbatch", fullgraph=True)
    x, V = torch.randn(8, 64, device="cuda", requires_grad=True), torch.randn(16, 8, 64, device="cuda")
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8)).cuda()
    outside = torch.compile(model, backend="dynbatch")
    V8 = torch.randn(16, 8, 8, device="cuda")
    _, twin = (m.cuda() for m in ft.models(ft.PairPotential))
    stepped = torch.compile(twin, backend="dynbatch", fullgraph=True)
    pos, f_ref = ft.positions(6, seed=0).cuda(), torch.randn(6, 3, device="cuda", dtype=torch.float64)
    calls = {
        "inside": lambda: inside(x, V),
        "outside": lambda: torch.autograd.grad(outside(x), x, V8, is_grads_batched=True),
        "force training": lambda: _force_step(stepped, pos, f_ref, inside=False),
    }
    for call in calls.values():  # compiles, and the forces learnt at forward time
        for _ in range(3):
            call()
    torch.cuda.synchronize()
    for name, call in calls.items():
        torch.cuda.set_sync_debug_mode("error")
        try:
            call()
        except RuntimeError as e:
            raise AssertionError(f"{name}: a steady call synchronised with the device: {e}") from e
        finally:
            torch.cuda.set_sync_debug_mode(0)


# --- the memory budget with CUDA's free memory --------------------------------

def _lj_hessian_rows(pos, V):
    n = pos.shape[0]
    pos = pos.detach().requires_grad_()
    diff = pos.unsqueeze(1) - pos.unsqueeze(0)
    r2 = (diff * diff).sum(-1) + torch.eye(n, dtype=pos.dtype, device=pos.device)
    inv6 = r2.pow(-3)
    energy = (4 * (inv6 * inv6 - inv6) * torch.ones(n, n, dtype=pos.dtype, device=pos.device).triu(1)).sum()
    (g,) = torch.autograd.grad(energy, pos, create_graph=True)
    return torch.autograd.grad(g, pos, V, is_grads_batched=True)[0]


def _cuda_peak_growth(fn, *args):
    fn(*args)  # warm: compile, caches
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn(*args)
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() - start


def test_memory_budget_bounds_the_cuda_peak_and_auto_reads_free_memory():
    from test_memory_budget import lattice

    from dynbatch.planning import memory

    free, _ = torch.cuda.mem_get_info()
    assert 0 < memory.auto_budget(torch.device("cuda")) <= free
    pos = lattice(60).cuda()
    V = torch.eye(180, device="cuda").view(180, 60, 3)
    budget = 2 * 2**20
    # Inductor's own store of the [B, N, N, 3] pair forces makes the unbudgeted peak pass
    # the budget; recompute="auto" stores none of it on CUDA (2.7 MB unbudgeted on an H200).
    budgeted = torch.compile(_lj_hessian_rows, backend="dynbatch", fullgraph=True,
                             options={"dynbatch.memory_budget": budget, "dynbatch.recompute": "never"})
    unbudgeted = torch.compile(_lj_hessian_rows, backend="dynbatch", fullgraph=True,
                               options={"dynbatch.memory_budget": None, "dynbatch.recompute": "never"})
    got, peak = _cuda_peak_growth(budgeted, pos, V)
    want, peak_unbudgeted = _cuda_peak_growth(unbudgeted, pos, V)
    assert_same_grads(got, want, atol=1e-3, rtol=1e-4)
    output = 180 * 60 * 3 * 4
    assert peak <= 1.25 * budget + output, (peak, peak_unbudgeted)
    assert peak_unbudgeted > 2 * budget, (peak, peak_unbudgeted)  # the budget did bind


@pytest.mark.parametrize("cudagraphs", [False, True], ids=["default", "reduce-overhead"])
def test_a_b_sweep_across_the_budget_keeps_one_dynamic_graph_on_cuda(cudagraphs):
    """NOTE [One dynamic graph across the budget]: fused while B fits, the chunked
    lowering made at the first B past the budget holds that call to it."""
    from test_memory_budget import lattice

    pos = lattice(60).cuda()
    V = torch.eye(180, device="cuda").view(180, 60, 3)
    budget = 2 * 2**20
    # torch.compile takes mode or options, not both: reduce-overhead is its Inductor option.
    f = torch.compile(_lj_hessian_rows, backend="dynbatch", fullgraph=True,
                      options={"dynbatch.memory_budget": budget, "triton.cudagraphs": cudagraphs})
    for b in (4, 6):
        assert_same_grads(f(pos, V[:b]), _lj_hessian_rows(pos, V[:b]), atol=1e-3, rtol=1e-4)
    got, peak = _cuda_peak_growth(f, pos, V)
    assert_same_grads(got, _lj_hessian_rows(pos, V), atol=1e-3, rtol=1e-4)
    c = dynbatch.counters()
    assert c["graphs"] == 2 and c.get("grads_chunked") == 1 and not c.get("fallbacks"), c
    assert peak <= 1.25 * budget + 180 * 60 * 3 * 4, peak


def test_lennard_jones_pair_forces_are_recomputed_not_stored():
    """On a GPU the store-or-recompute cost model (planning/recompute.py) gives each reduction of
    the [B, N, N, 3] pair forces its own copy: no such buffer is allocated ("never":
    Inductor's own choice, one is).  N = 60: the pair tensor's store and loads (23 MB)
    pass the model's size floor."""
    from test_recompute import lj_hessian_rows, pair_buffers

    n = 60
    rows, pos, V = lj_hessian_rows("cuda", n)
    expected = rows(pos, V)
    codes = {}
    for mode in ("never", "auto"):
        torch._dynamo.reset()
        dynbatch.reset()
        compiled = torch.compile(rows, backend="dynbatch", fullgraph=True, options={"dynbatch.recompute": mode})
        result, code = run_and_get_code(compiled, pos, V)
        assert_backend_ran(graphs=1, batched=1)
        assert_same_grads(result, expected, atol=1e-4, rtol=1e-4)
        codes[mode] = "\n".join(code)
    assert pair_buffers(codes["never"], n)
    assert pair_buffers(codes["auto"], n) == []



def test_sparse_hessian_on_the_gpu_equals_eager():
    """dynbatch.hessian with x on the GPU: the plan is found on the CPU, its index tensors
    move to the device once, the products run in Triton; dense and CSR equal eager's."""
    from dynbatch.bench import sparse_problems as sp

    x, (i, j) = sp.lennard_jones_problem(64, cutoff=1.6)
    x, i, j = x.cuda(), i.cuda(), j.cuda()
    want = torch.autograd.functional.hessian(lambda t: sp.lennard_jones(t, i, j), x)
    torch.testing.assert_close(dynbatch.hessian(sp.lennard_jones, x, i, j, sparse=True), want,
                               rtol=1e-10, atol=1e-8)
    csr = dynbatch.hessian(sp.lennard_jones, x, i, j, sparse=True, layout=torch.sparse_csr)
    torch.testing.assert_close(csr.to_dense(), want.reshape(192, 192), rtol=1e-10, atol=1e-8)
    assert dynbatch.counters()["grads_compressed"] == 2
