"""The structured problems of ``bench sparse_hessian`` (and the suite's sparsity tests).

Each energy or residual is plain torch, as users write it; the index tensors (neighbour
lists) are built outside it and passed in, fixed for the call.
"""

from __future__ import annotations

import torch


def jittered_lattice(n: int, density: float = 0.8, jitter: float = 0.05, seed: int = 0):
    """``n`` atoms on a simple cubic lattice at ``density``, jittered; the box side."""
    gen = torch.Generator().manual_seed(seed)
    side = round(n ** (1 / 3) + 0.4999)
    spacing = (1 / density) ** (1 / 3)
    grid = torch.stack(torch.meshgrid(*[torch.arange(side)] * 3, indexing="ij"), -1).reshape(-1, 3)[:n]
    pos = grid.double() * spacing + jitter * torch.randn(n, 3, generator=gen, dtype=torch.float64)
    return pos, side * spacing


def neighbour_pairs(pos: torch.Tensor, cutoff: float, box: float | None = None, chunk: int = 2048):
    """The pairs i < j within ``cutoff`` (minimum image in a periodic ``box``)."""
    firsts, seconds = [], []
    for start in range(0, pos.shape[0], chunk):
        d = pos[start:start + chunk, None, :] - pos[None, :, :]
        if box is not None:
            d = d - box * torch.round(d / box)
        near = (d.norm(dim=-1) < cutoff).nonzero()
        i, j = near[:, 0] + start, near[:, 1]
        keep = i < j
        firsts.append(i[keep])
        seconds.append(j[keep])
    return torch.cat(firsts), torch.cat(seconds)


def lennard_jones(pos: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    """The Lennard-Jones energy (sigma = epsilon = 1) over a neighbour list."""
    d = pos[i] - pos[j]
    inv6 = 1 / (d * d).sum(-1) ** 3
    return (4 * (inv6 * inv6 - inv6)).sum()


def lennard_jones_problem(n: int, cutoff: float = 2.8):
    pos, _ = jittered_lattice(n)
    return pos, neighbour_pairs(pos, cutoff)


class MessagePassingEnergy(torch.nn.Module):
    """Two interactions of ``index_add`` messages over a periodic neighbour list (float64)."""

    def __init__(self, width: int = 8, box: float = 1.0, cutoff: float = 1.3, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.box, self.cutoff = box, cutoff
        self.embed = torch.nn.Parameter(torch.randn(width, generator=gen, dtype=torch.float64))
        self.filters = torch.nn.ParameterList(
            [torch.nn.Parameter(0.3 * torch.randn(4, width, generator=gen, dtype=torch.float64)) for _ in range(2)])
        self.readout = torch.nn.Parameter(torch.randn(width, generator=gen, dtype=torch.float64) / width)

    def forward(self, pos: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        d = pos[i] - pos[j]
        d = d - self.box * torch.round(d / self.box)
        r = (d * d).sum(-1).sqrt()
        smooth = (1 - (r / self.cutoff) ** 2) ** 2  # to zero at the cutoff
        basis = torch.stack([torch.exp(-((r - c) ** 2) * 4) for c in (0.8, 1.0, 1.2, 1.4)], -1) * smooth[:, None]
        h = self.embed.expand(pos.shape[0], -1)
        for w in self.filters:
            m = torch.tanh(basis @ w)
            h = h + torch.zeros_like(h).index_add(0, i, m * h[j]).index_add(0, j, m * h[i])
        return (torch.tanh(h) @ self.readout).sum()


def message_passing_problem(n: int, cutoff: float = 1.3):
    pos, box = jittered_lattice(n)
    model = MessagePassingEnergy(box=box, cutoff=cutoff)
    return model, pos, neighbour_pairs(pos, cutoff, box)


def poisson_residual(u: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """A nonlinear 2-D Poisson residual, 5-point stencil, zero Dirichlet boundary."""
    p = torch.nn.functional.pad(u, (1, 1, 1, 1))
    lap = p[:-2, 1:-1] + p[2:, 1:-1] + p[1:-1, :-2] + p[1:-1, 2:] - 4 * u
    return lap - u ** 3 - source


def poisson_problem(side: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(side, side, generator=gen, dtype=torch.float64),
            torch.rand(side, side, generator=gen, dtype=torch.float64))
