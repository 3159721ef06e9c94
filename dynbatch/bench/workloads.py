"""The benchmark's workloads: the functions differentiated, their sizes and floors.

Each workload is a builder ``(tier, batch_sizes, device) -> [Problem]`` (those in
``ATOM_WORKLOADS`` also take ``atoms=``, the atom counts that replace the tier's).  It
says what is computed (torch, torch.func and JAX dialects of the same
function), never how a variant batches it: that is variants.py.  Inputs come
from fixed seeds, so a subprocess that rebuilds a problem (the stock
``torch.compile`` column) gets the very same tensors.

Tiers: ``quick`` (the CI smoke test: one tiny case per workload, the sweep's three B
excepted; ``--atoms`` or ``--batch-sizes`` bring back what they size), ``cpu`` (seconds per
workload on 2 cores), ``cuda`` (large enough to fill a GPU).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

from .problem import BatchedMemory, Case, Problem, conv_input_grad_floor, mm_floor

TIERS = ("quick", "cpu", "cuda")

# --- helpers ----------------------------------------------------------------


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(gen: torch.Generator, *shape: int, scale: float = 1.0, device=None) -> torch.Tensor:
    # Drawn on the CPU so every device (and the stock subprocess) sees the same numbers.
    return (torch.randn(*shape, generator=gen) * scale).to(device)


def _basis(width: int, rows: int, device) -> torch.Tensor:
    """``V[j] = e_j`` on every one of ``rows`` rows: the full per-row Jacobian."""
    return torch.eye(width, device=device)[:, None, :].expand(width, rows, width).contiguous()


def _numpy(t: torch.Tensor):
    return t.detach().cpu().numpy()


def _tanh_mlp(weights: Sequence[torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    def f(x):
        for w in weights:
            x = torch.tanh(x @ w)
        return x

    return f


def _jax_tanh_mlp(weights: Sequence[torch.Tensor]):
    def build():
        import jax.numpy as jnp

        ws = [jnp.asarray(_numpy(w)) for w in weights]

        def f(x):
            for w in ws:
                x = jnp.tanh(x @ w)
            return x

        return f

    return build


# --- 1. mlp_jacobian ----------------------------------------------------------

_MLP = {"quick": ([16], 4), "cpu": ([128, 512], 8), "cuda": ([128, 512, 1024], 256)}


def mlp_jacobian(tier: str, batch_sizes, device) -> list[Problem]:
    """Full per-row Jacobian of a 3-layer tanh MLP (V = eye, so B = width)."""
    widths, rows = _MLP[tier]
    problems = []
    for d in widths:
        gen = _gen(100 + d)
        weights = [_randn(gen, d, d, scale=d ** -0.5, device=device) for _ in range(3)]
        x = _randn(gen, rows, d, device=device)
        floor = mm_floor([(d * rows, d, d)] * 3, f"3 x [B*N, d] @ [d, d], B=d={d}, N={rows}")
        problems.append(Problem(
            workload="mlp_jacobian", name=f"mlp_jacobian/w{d}",
            description=f"Jacobian of a 3-layer tanh MLP of width {d} on N={rows} rows, V = eye (B = {d})",
            f=_tanh_mlp(weights),
            cases=[Case(f"B={d}", d, x, _basis(d, rows, device), floor)],
            jax_f=_jax_tanh_mlp(weights),
        ))
    return problems


# --- 2. gelu_vjp --------------------------------------------------------------

_GELU = {"quick": (8, 16, 4, [4]), "cpu": (64, 256, 64, [16, 64]), "cuda": (256, 1024, 1024, [32, 128])}


def gelu_vjp(tier: str, batch_sizes, device) -> list[Problem]:
    """VJPs of a GELU MLP on a batch of N inputs with B random cotangents."""
    d, h, rows, default_bs = _GELU[tier]
    gen = _gen(2)
    w1 = _randn(gen, d, h, scale=d ** -0.5, device=device)
    w2 = _randn(gen, h, h, scale=h ** -0.5, device=device)
    w3 = _randn(gen, h, d, scale=h ** -0.5, device=device)
    b1, b2 = _randn(gen, h, scale=0.1, device=device), _randn(gen, h, scale=0.1, device=device)
    x = _randn(gen, rows, d, device=device)
    gelu = torch.nn.functional.gelu

    def f(x):
        return gelu(gelu(x @ w1 + b1) @ w2 + b2) @ w3

    def jax_f():
        import jax
        import jax.numpy as jnp

        j1, j2, j3, c1, c2 = (jnp.asarray(_numpy(t)) for t in (w1, w2, w3, b1, b2))

        def fj(x):
            act = lambda z: jax.nn.gelu(z, approximate=False)  # torch's default is the erf form
            return act(act(x @ j1 + c1) @ j2 + c2) @ j3

        return fj

    cases = []
    for b in batch_sizes or default_bs:
        floor = mm_floor([(b * rows, d, h), (b * rows, h, h), (b * rows, h, d)],
                         f"[B*N, d] @ [d, h], [B*N, h] @ [h, h], [B*N, h] @ [h, d]; N={rows}, d={d}, h={h}")
        cases.append(Case(f"B={b}", b, x, _randn(_gen(20 + b), b, rows, d, device=device), floor))
    return [Problem(
        workload="gelu_vjp", name="gelu_vjp",
        description=f"VJPs of a 2-hidden-layer GELU MLP (d={d}, h={h}) on N={rows} inputs, B random cotangents",
        f=f, cases=cases, jax_f=jax_f,
    )]


# --- 3. attention -------------------------------------------------------------

_ATTN = {"quick": (8, 8, [4]), "cpu": (64, 64, [16, 64]), "cuda": (512, 256, [32, 128])}


def attention(tier: str, batch_sizes, device) -> list[Problem]:
    """Softmax attention plus residual and layer norm, B random cotangents."""
    s, d, default_bs = _ATTN[tier]
    gen = _gen(3)
    wq, wk, wv, wo = (_randn(gen, d, d, scale=d ** -0.5, device=device) for _ in range(4))
    gamma = 1 + _randn(gen, d, scale=0.1, device=device)
    beta = _randn(gen, d, scale=0.1, device=device)
    x = _randn(gen, s, d, device=device)
    scale = d ** -0.5

    def f(x):
        scores = (x @ wq) @ (x @ wk).transpose(-1, -2) * scale
        out = torch.softmax(scores, dim=-1) @ (x @ wv) @ wo
        return torch.nn.functional.layer_norm(x + out, (d,), gamma, beta, eps=1e-5)

    def jax_f():
        import jax
        import jax.numpy as jnp

        jq, jk, jv, jo, jg, jb = (jnp.asarray(_numpy(t)) for t in (wq, wk, wv, wo, gamma, beta))

        def fj(x):
            out = jax.nn.softmax((x @ jq) @ (x @ jk).T * scale, axis=-1) @ (x @ jv) @ jo
            h = x + out
            mean = h.mean(-1, keepdims=True)
            var = ((h - mean) ** 2).mean(-1, keepdims=True)
            return (h - mean) / jnp.sqrt(var + 1e-5) * jg + jb

        return fj

    cases = []
    for b in batch_sizes or default_bs:
        # Per cotangent: g@Wo^T, g@v^T, a^T@g, g_s@k, g_s^T@q, and the three
        # projections back to x; the shared a^T and weights batch over B.
        shapes = [(b * s, d, d)] * 4 + [(b * s, d, s), (s, s, b * d), (b * s, s, d), (b * s, s, d)]
        floor = mm_floor(shapes, f"4 x [B*S, d] @ [d, d] + 4 attention products of B*S*S*d; S={s}, d={d}")
        cases.append(Case(f"B={b}", b, x, _randn(_gen(30 + b), b, s, d, device=device), floor))
    return [Problem(
        workload="attention", name="attention",
        description=f"single-head softmax attention + residual + layer norm, S={s}, d={d}, B random cotangents",
        f=f, cases=cases, jax_f=jax_f,
    )]


# --- 4. pinn ------------------------------------------------------------------

_PINN = {"quick": (16, 8, 4), "cpu": (2048, 32, 16), "cuda": (65536, 128, 32)}


def _pinn_net(w0, w1, w2):
    def u(pts):
        return torch.tanh(torch.sin(pts @ w0) @ w1) @ w2

    def build_jax():
        import jax.numpy as jnp

        j0, j1, j2 = (jnp.asarray(_numpy(t)) for t in (w0, w1, w2))
        return lambda pts: jnp.tanh(jnp.sin(pts @ j0) @ j1) @ j2

    return u, build_jax


def pinn(tier: str, batch_sizes, device) -> list[Problem]:
    """A sin/tanh network over P collocation points: its Jacobian, and its Laplacian."""
    p, h, m = _PINN[tier]
    gen = _gen(4)
    pts = _randn(gen, p, 3, device=device)
    w0 = _randn(gen, 3, h, device=device)
    w1 = _randn(gen, h, h, scale=h ** -0.5, device=device)
    w2 = _randn(gen, h, m, scale=h ** -0.5, device=device)
    u, u_jax = _pinn_net(w0, w1, w2)
    jac_floor = mm_floor([(m * p, m, h), (m * p, h, h), (m * p, h, 3)],
                         f"[B*P, m] @ [m, h], [B*P, h] @ [h, h], [B*P, h] @ [h, 3]; P={p}, h={h}")
    jacobian = Problem(
        workload="pinn", name="pinn/jacobian",
        description=f"Jacobian of a sin/tanh network R^3 -> R^{m} over P={p} points (V = eye, B = {m})",
        f=u, cases=[Case(f"B={m}", m, pts, _basis(m, p, device), jac_floor)], jax_f=u_jax,
    )

    # The Laplacian: grad of the scalar field with create_graph, then one
    # batched grad over the 3 coordinate directions; post takes the trace.
    v0, v1, v2 = w0, w1, w2[:, :1]
    scalar, scalar_jax = _pinn_net(v0, v1, v2)

    def grad_u(pts):
        pts_ = pts if pts.requires_grad else pts.detach().requires_grad_()
        return torch.autograd.grad(scalar(pts_).sum(), pts_, create_graph=True)[0]

    def grad_u_func(pts):
        return torch.func.grad(lambda q: scalar(q).sum())(pts)

    def grad_u_jax():
        import jax

        s = scalar_jax()
        return jax.grad(lambda q: s(q).sum())

    lap_floor = mm_floor([(3 * p, 3, h), (3 * p, h, h), (3 * p, h, h), (3 * p, h, 3)],
                         f"one tangent and one backward pass, batched: [B*P, 3] @ [3, h], 2 x [B*P, h] @ [h, h], "
                         f"[B*P, h] @ [h, 3]; B=3, P={p}, h={h}")
    laplacian = Problem(
        workload="pinn", name="pinn/laplacian",
        description=f"Laplacian of a sin/tanh scalar field over P={p} points: create_graph grad, then a batched "
                    "grad over the 3 directions (B = 3), trace taken in the timed region",
        f=grad_u, f_func=grad_u_func,
        cases=[Case("B=3", 3, pts, _basis(3, p, device), lap_floor)],
        post=lambda g: g.diagonal(0, 0, 2).sum(-1),
        jax_f=grad_u_jax,
    )
    # The Jacobian of an MLP is mlp_jacobian's too: the quick tier keeps the Laplacian alone.
    return [laplacian] if tier == "quick" else [jacobian, laplacian]


# --- 5. hessian ---------------------------------------------------------------

# The quick tier: the rows alone (--batch-sizes adds HVPs).
_HESS = {"quick": (32, 4, 4, []), "cpu": (256, 16, 16, [8, 32, 128]), "cuda": (4096, 32, 64, [8, 32, 128])}


def hessian(tier: str, batch_sizes, device) -> list[Problem]:
    """Hessian rows (V = eye) and HVPs with K probes of a regression loss in a flat parameter vector."""
    n, d, h, default_ks = _HESS[tier]
    gen = _gen(5)
    data = _randn(gen, n, d, device=device)
    target = _randn(gen, n, device=device)
    size = d * h + h
    w = _randn(gen, size, scale=d ** -0.5, device=device)

    def loss(w):
        return ((torch.tanh(data @ w[: d * h].view(d, h)) @ w[d * h:] - target) ** 2).mean()

    def grad_loss(w):
        w_ = w if w.requires_grad else w.detach().requires_grad_()
        return torch.autograd.grad(loss(w_), w_, create_graph=True)[0]

    def jax_f():
        import jax
        import jax.numpy as jnp

        jd, jt = jnp.asarray(_numpy(data)), jnp.asarray(_numpy(target))
        return jax.grad(lambda w: ((jnp.tanh(jd @ w[: d * h].reshape(d, h)) @ w[d * h:] - jt) ** 2).mean())

    def floor(b):
        # Per probe: the tangent of X @ W1 and the product back onto W1.
        return mm_floor([(n, d, b * h), (d, n, b * h)], f"[n, d] @ [d, B*h] and [d, n] @ [n, B*h]; n={n}, d={d}, h={h}")

    cases = [Case(f"rows B={size}", size, w, torch.eye(size, device=device), floor(size))]
    for k in batch_sizes or default_ks:
        cases.append(Case(f"hvp K={k}", k, w, _randn(_gen(50 + k), k, size, device=device), floor(k)))
    return [Problem(
        workload="hessian", name="hessian",
        description=f"Hessian of a tanh-regression loss (n={n}, d={d}, h={h}) in a flat vector of {size} "
                    "parameters: all rows (V = eye), then HVPs with K random probes",
        f=grad_loss, f_func=torch.func.grad(loss), cases=cases, jax_f=jax_f,
    )]


# --- 6. lj_forces -------------------------------------------------------------
# The pair-potential helpers are shared with full_hessian (section 9).

_LJ = {"quick": ([4], 5), "cpu": ([24, 100], 32), "cuda": ([24, 100, 500], 128)}


def _lattice(n: int, gen: torch.Generator) -> torch.Tensor:
    """n atoms on a jittered cubic lattice, spacing near the LJ minimum (no overlaps)."""
    side = math.ceil(n ** (1 / 3))
    grid = torch.stack(torch.meshgrid(*[torch.arange(side)] * 3, indexing="ij"), -1).reshape(-1, 3)[:n]
    return grid.float() * 1.12 + 0.05 * torch.randn(n, 3, generator=gen)


def _pair_r2(pos: torch.Tensor) -> torch.Tensor:
    """Squared pair distances ``[N, N]``; + eye keeps the diagonal finite (its terms are masked off)."""
    n = pos.shape[0]
    diff = pos.unsqueeze(1) - pos.unsqueeze(0)
    return (diff * diff).sum(-1) + torch.eye(n, dtype=pos.dtype, device=pos.device)


def _sum_pairs(terms: torch.Tensor) -> torch.Tensor:
    """Sum of ``terms[i, j]`` over i < j: the triu mask drops the diagonal and the double count."""
    n = terms.shape[0]
    return (terms * torch.ones(n, n, dtype=terms.dtype, device=terms.device).triu(1)).sum()


def _lj_energy(pos: torch.Tensor) -> torch.Tensor:
    """Lennard-Jones energy (epsilon = sigma = 1) of the atoms at ``pos`` ``[N, 3]``."""
    inv6 = _pair_r2(pos).pow(-3)
    return _sum_pairs(4 * (inv6 * inv6 - inv6))


def _jax_pair_r2(pos):
    import jax.numpy as jnp

    diff = pos[:, None, :] - pos[None, :, :]
    return (diff * diff).sum(-1) + jnp.eye(pos.shape[0], dtype=pos.dtype)


def _jax_sum_pairs(terms):
    import jax.numpy as jnp

    return (terms * jnp.triu(jnp.ones(terms.shape[:2], terms.dtype), 1)).sum()


def _jax_lj_energy(pos):
    inv6 = _jax_pair_r2(pos) ** -3
    return _jax_sum_pairs(4 * (inv6 * inv6 - inv6))


def _forces_graph(energy: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """``pos -> dE/dpos`` with ``create_graph=True``: the function whose batched VJPs are Hessian rows."""

    def forces_graph(pos):
        pos_ = pos if pos.requires_grad else pos.detach().requires_grad_()
        return torch.autograd.grad(energy(pos_), pos_, create_graph=True)[0]

    return forces_graph


def _jax_forces(jax_energy_builder: Callable[[], Callable]):
    """The JAX dialect of :func:`_forces_graph`: ``jax.grad`` of the energy."""

    def build():
        import jax

        return jax.grad(jax_energy_builder())

    return build


def _hessian_basis(n: int, device) -> torch.Tensor:
    """The 3N basis cotangents, ``V[k] = e_k`` shaped like the forces: ``[3N, N, 3]``."""
    return torch.eye(3 * n, device=device).view(3 * n, n, 3)


def lj_forces(tier: str, batch_sizes, device, atoms=None) -> list[Problem]:
    """Pairwise Lennard-Jones energy: forces by plain grad, the Hessian by batched grad in chunks."""
    sizes, chunk = _LJ[tier]
    sizes = atoms or sizes
    cases = []
    for n in sizes:
        pos = _lattice(n, _gen(60 + n)).to(device)
        rows = 3 * n
        # The same multiply-adds as the batched backward's pair terms, done as one
        # dense product with an assembled Hessian: a floor the elementwise pair
        # formulation cannot reach (docs/benchmarks.md).
        floor = mm_floor([(rows, rows, min(chunk, rows - i)) for i in range(0, rows, chunk)],
                         f"an assembled Hessian times the basis, chunk by chunk: [3N, 3N] @ [3N, C], C<={chunk}")
        cases.append(Case(f"N={n}", rows, pos, _hessian_basis(n, device), floor))
    return [Problem(
        workload="lj_forces", name="lj_forces",
        description=f"Lennard-Jones energy over N atoms; forces by create_graph grad, the Hessian by batched "
                    f"grad over the 3N basis in chunks of {chunk} (the last chunk ragged)",
        f=_forces_graph(_lj_energy), f_func=torch.func.grad(_lj_energy), cases=cases, chunk=chunk,
        jax_f=_jax_forces(lambda: _jax_lj_energy),
    )]


# --- 7. cnn_jacobian ----------------------------------------------------------

_CNN = {"quick": (8, 4, 4), "cpu": (32, 16, 32), "cuda": (64, 32, 128)}


def cnn_jacobian(tier: str, batch_sizes, device) -> list[Problem]:
    """``torch.autograd.functional.jacobian(f, x, vectorize=True)`` of a small CNN."""
    hw, c, m = _CNN[tier]
    gen = _gen(7)
    k1 = _randn(gen, c, 3, 3, 3, scale=(27) ** -0.5, device=device)
    k2 = _randn(gen, c, c, 3, 3, scale=(9 * c) ** -0.5, device=device)
    feat = c * (hw // 2) ** 2
    head = _randn(gen, feat, m, scale=feat ** -0.5, device=device)
    x = _randn(gen, 3, hw, hw, device=device)
    conv = torch.nn.functional.conv2d

    def f(img):
        z = torch.tanh(conv(img, k1, padding=1))
        z = torch.tanh(conv(z, k2, stride=2, padding=1))
        return z.flatten() @ head

    def jacobian_api(img, _cotangents):
        return torch.autograd.functional.jacobian(f, img, vectorize=True)

    def jax_f():
        import jax
        import jax.numpy as jnp

        j1, j2, jh = (jnp.asarray(_numpy(t)) for t in (k1, k2, head))

        def jconv(z, k, stride):
            return jax.lax.conv_general_dilated(
                z[None], k, (stride, stride), [(1, 1), (1, 1)], dimension_numbers=("NCHW", "OIHW", "NCHW"))[0]

        return lambda img: jnp.tanh(jconv(jnp.tanh(jconv(img, j1, 1)), j2, 2)).reshape(-1) @ jh

    half = hw // 2
    floor = conv_input_grad_floor(
        [((m, c, half, half), (c, c, 3, 3), dict(stride=2, padding=1, output_padding=1)),
         ((m, c, hw, hw), (c, 3, 3, 3), dict(padding=1))],
        [(m, m, feat)],
        f"the input-gradient convolutions of both layers and [B, m] @ [m, {feat}], batched over B={m}",
    )
    return [Problem(
        workload="cnn_jacobian", name="cnn_jacobian",
        description=f"torch.autograd.functional.jacobian(vectorize=True) of a 2-conv CNN on a 3x{hw}x{hw} "
                    f"image with {m} outputs (B = {m})",
        f=f, cases=[Case(f"B={m}", m, x, torch.eye(m, device=device), floor)],
        batched_api=jacobian_api, jax_f=jax_f,
    )]


# --- 8. sweep -----------------------------------------------------------------

_SWEEP = {"quick": (16, 4, [2, 3, 5]), "cpu": (128, 8, [1, 4, 16, 64, 256, 1024]),
          "cuda": (512, 256, [1, 4, 16, 64, 256, 1024])}


def sweep(tier: str, batch_sizes, device) -> list[Problem]:
    """The mlp_jacobian network with B random cotangents, B swept: time and compiles vs B."""
    d, rows, default_bs = _SWEEP[tier]
    gen = _gen(8)
    weights = [_randn(gen, d, d, scale=d ** -0.5, device=device) for _ in range(3)]
    x = _randn(gen, rows, d, device=device)
    cases = [
        Case(f"B={b}", b, x, _randn(_gen(80 + b), b, rows, d, device=device),
             mm_floor([(b * rows, d, d)] * 3, f"3 x [B*N, d] @ [d, d]; N={rows}, d={d}"))
        for b in batch_sizes or default_bs
    ]
    return [Problem(
        workload="sweep", name="sweep",
        description=f"batch-size sweep on the 3-layer tanh MLP (width {d}, N={rows}) with B random cotangents",
        f=_tanh_mlp(weights), cases=cases, jax_f=_jax_tanh_mlp(weights),
    )]


# --- 9. full_hessian ----------------------------------------------------------
# The whole Hessian in ONE batched grad over the 3N basis (B = 3N): the batched
# backward holds B copies of the [N, N] pair tensors at once, B * N^2 grows as N^3,
# and the largest sizes need more memory than the machine has unless the backward
# is chunked.  Each case carries an estimate of that unchunked peak
# (Case.batched_memory); the runner skips a column whose share does not fit.

# Atom counts per tier: (Lennard-Jones, learned pair potential); none: that energy is left
# out (the quick tier: one energy runs the workload; --atoms sizes both).
# On 2 CPU cores the eager columns take seconds per call from N = 200 (LJ) and
# N = 128 (pair_mlp), and the eager loop minutes at N = 1000: larger N on the
# CPU with --atoms.  On a GPU the eager loop's 3N backward passes take seconds per
# call from N = 1000: the CUDA tier stops below, to fit one device session.
_FULL_HESS = {"quick": ([4], []), "cpu": ([50, 100, 200], [32, 64, 128]),
              "cuda": ([200, 500], [100, 200])}
# Peak memory of an unchunked batched backward in 4-byte floats per sample and atom
# pair, (eager, compiled): peak_mem_bytes / (B * N^2 * 4) measured on the CPU at
# N = 16..100, the largest over the eager columns (eager_batched, eager_vmap) and
# over the compiled ones (compiled_func, dynbatch), rounded up: Lennard-Jones
# 15.1 and 4.1, the learned potential 68.4 and 33.2.
_LJ_FLOATS_PER_PAIR = (16, 5)
_PAIR_MLP_FLOATS_PER_PAIR = (72, 40)
_RBF, _HIDDEN = 8, 16  # the learned potential: 8 Gaussian radial features -> 16 tanh units -> 1


def _pair_mlp_params(gen: torch.Generator, device) -> tuple[torch.Tensor, ...]:
    """Weights of a small pair potential, as if trained: RBF centres over the lattice's first shells."""
    centres = torch.linspace(0.8, 4.0, _RBF).to(device)
    w1 = _randn(gen, _RBF, _HIDDEN, scale=_RBF ** -0.5, device=device)
    b1 = _randn(gen, _HIDDEN, scale=0.1, device=device)
    w2 = _randn(gen, _HIDDEN, scale=_HIDDEN ** -0.5, device=device)
    return centres, w1, b1, w2


_RBF_GAMMA = 4.0  # Gaussian width: exp(-gamma (r - c)^2), centres 0.46 apart


def _pair_mlp_energy(params: tuple[torch.Tensor, ...]) -> Callable[[torch.Tensor], torch.Tensor]:
    """A learned pair potential: E = sum_{i<j} MLP(rbf(r_ij)), a tanh MLP 8 -> 16 -> 1 per pair."""
    centres, w1, b1, w2 = params

    def energy(pos):
        r = _pair_r2(pos).sqrt()
        rbf = torch.exp(-_RBF_GAMMA * (r.unsqueeze(-1) - centres) ** 2)  # [N, N, 8]
        return _sum_pairs(torch.tanh(rbf @ w1 + b1) @ w2)  # [N, N, 16] -> [N, N]

    return energy


def _jax_pair_mlp_energy(params: tuple[torch.Tensor, ...]):
    def build():
        import jax.numpy as jnp

        centres, w1, b1, w2 = (jnp.asarray(_numpy(t)) for t in params)

        def energy(pos):
            r = jnp.sqrt(_jax_pair_r2(pos))
            rbf = jnp.exp(-_RBF_GAMMA * (r[..., None] - centres) ** 2)
            return _jax_sum_pairs(jnp.tanh(rbf @ w1 + b1) @ w2)

        return energy

    return build


def full_hessian(tier: str, batch_sizes, device, atoms=None) -> list[Problem]:
    """The full 3N x 3N Hessian of two pair energies, each in one batched grad (B = 3N, no chunks)."""
    lj_sizes, mlp_sizes = _FULL_HESS[tier]
    params = _pair_mlp_params(_gen(90), device)
    energies = [
        ("lj", "Lennard-Jones", _lj_energy, lambda: _jax_lj_energy, atoms or lj_sizes, _LJ_FLOATS_PER_PAIR),
        ("pair_mlp", f"a learned pair potential (r_ij -> {_RBF} Gaussian radial features -> tanh MLP "
                     f"{_RBF} -> {_HIDDEN} -> 1, summed over i<j)",
         _pair_mlp_energy(params), _jax_pair_mlp_energy(params), atoms or mlp_sizes, _PAIR_MLP_FLOATS_PER_PAIR),
    ]
    problems = []
    for key, what, energy, jax_energy, sizes, floats_per_pair in energies:
        if not sizes:
            continue
        cases = []
        for n in sizes:
            rows = 3 * n
            floor = mm_floor([(rows, rows, rows)], "an assembled Hessian times the full basis: [3N, 3N] @ [3N, 3N]")
            memory = BatchedMemory(*(rows * n * n * 4 * floats for floats in floats_per_pair))
            cases.append(Case(f"N={n}", rows, _lattice(n, _gen(900 + n)).to(device), _hessian_basis(n, device),
                              floor, batched_memory=memory))
        problems.append(Problem(
            workload="full_hessian", name=f"full_hessian/{key}",
            description=f"the full Hessian of {what} over N atoms: forces by create_graph grad, then ONE "
                        "batched grad over the whole 3N basis (B = 3N, unchunked)",
            f=_forces_graph(energy), f_func=torch.func.grad(energy), cases=cases,
            jax_f=_jax_forces(jax_energy),
        ))
    return problems


WORKLOADS: dict[str, Callable[..., list[Problem]]] = {
    "mlp_jacobian": mlp_jacobian,
    "gelu_vjp": gelu_vjp,
    "attention": attention,
    "pinn": pinn,
    "hessian": hessian,
    "lj_forces": lj_forces,
    "cnn_jacobian": cnn_jacobian,
    "sweep": sweep,
    "full_hessian": full_hessian,
}
# Workloads sized by an atom count N (B = 3N), which --atoms replaces.
ATOM_WORKLOADS = ("lj_forces", "full_hessian")


def build(workload: str, tier: str, batch_sizes: Sequence[int] | None, device,
          atoms: Sequence[int] | None = None) -> list[Problem]:
    """The problems of one workload; ``atoms`` replaces the tier's atom counts of ATOM_WORKLOADS."""
    if workload not in WORKLOADS:
        raise KeyError(f"unknown workload {workload!r}; choose from {sorted(WORKLOADS)}")
    if tier not in TIERS:
        raise KeyError(f"unknown size tier {tier!r}; choose from {TIERS}")
    extra = {"atoms": list(atoms)} if atoms and workload in ATOM_WORKLOADS else {}
    return WORKLOADS[workload](tier, list(batch_sizes) if batch_sizes else None, torch.device(device), **extra)
