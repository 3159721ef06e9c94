"""Which vmap batches the grads a region's backward receives, and how to step outside it.

A backward taken from outside a compiled region (region/edge.py) may receive grads
batched by eager's legacy vmap (``is_grads_batched``, ``vectorize=True``) or by
``torch.func.vmap``.  ``batching_of`` tells them apart and ``Batching`` turns
them into physical [B, ...] tensors and back.  Kept beside region/edge.py, which is
long enough without it; the vmap internals it reads are ``_compat``'s.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .. import _compat


class Batching:
    """How a set of grads is batched: by eager's legacy vmap or by torch.func."""

    def __init__(self, kind: str, level: int, physical: dict[int, tuple] | None = None) -> None:
        self.kind, self.level = kind, level
        # id(grad) -> (grad, its physical tensor): legacy unwraps batching_of already made.
        self._physical = physical or {}

    def unwrapped(self, out_grads: list[tuple[int, torch.Tensor]], leave_vmap: bool = False) -> "_Unwrapped":
        """A context that yields (``[(i, physical [B, ...] grad)]``, B, rewrap) outside this
        vmap level.

        Grads not batched at this level are expanded to B.  ``rewrap`` turns
        physical [B, ...] results (or None) back into batched tensors.  Legacy vmap is
        always left for the block; torch.func's only with ``leave_vmap`` (where
        ``compiled_outside`` holds), so that compiled programs run on the physical grads.
        """
        physical = [(i, self._unwrap(g)) for i, g in out_grads]
        batched = [self._is_batched(g) for _, g in out_grads]
        batch_size = next(p.shape[0] for (_, p), b in zip(physical, batched) if b)
        if not all(batched):
            physical = [(i, p if b else p.expand(batch_size, *p.shape)) for (i, p), b in zip(physical, batched)]
        return _Unwrapped(self, physical, batch_size, leave_vmap)

    def compiled_outside(self) -> bool:
        """Can the batched grads run compiled, outside this vmap?  Legacy vmap: yes.
        torch.func's: where its vmap is the only transform active (MACE's Hessian,
        ``torch.vmap`` over a vjp); beneath another, the region's inputs are wrapped too."""
        return self.kind == "legacy" or (self.kind == "functorch" and _compat.only_transform_is(self.level))

    def _is_batched(self, g: torch.Tensor) -> bool:
        if self.kind == "legacy":
            return _compat.is_legacy_batched(g)
        return _compat.functorch_level(g) == self.level

    def _unwrap(self, g: torch.Tensor) -> torch.Tensor:
        if not self._is_batched(g):
            return g
        if self.kind == "legacy":
            known = self._physical.get(id(g))
            if known is not None and known[0] is g:
                return known[1]
            # A batched tensor's own batch size is used; the size argument is for unbatched ones.
            return _compat.legacy_remove_batch_dim(g, self.level, 0, 0)
        value, bdim = _compat.unwrap_at(g, self.level)
        return value.movedim(bdim, 0)

    def _rewrap(self, grads: tuple) -> tuple:
        add = _compat.legacy_add_batch_dim if self.kind == "legacy" else _compat.rewrap_batched
        return tuple(None if g is None else add(g, 0, self.level) for g in grads)


class _Unwrapped:
    """``Batching.unwrapped``'s context: a class, not a generator (every batched grad
    through a compiled graph enters it).  Legacy vmap's dispatch key rejects random ops
    (Inductor draws some while it compiles) in every tensor op, batched or not: left
    for the block."""

    def __init__(self, batching: Batching, physical: list, batch_size: int, leave_vmap: bool) -> None:
        self.batching, self.physical, self.batch_size = batching, physical, batch_size
        self.outside = (_compat.outside_legacy_vmap() if batching.kind == "legacy"
                        else _compat.outside_functorch() if leave_vmap else None)

    def __enter__(self) -> tuple[list, int, Callable[[tuple], tuple]]:
        if self.outside is not None:
            self.outside.__enter__()
        return self.physical, self.batch_size, self.batching._rewrap

    def __exit__(self, *exc: Any) -> None:
        if self.outside is not None:
            self.outside.__exit__(*exc)


def batching_of(grads: list[torch.Tensor]) -> Batching | None:
    """The vmap that batches these grads, or None for plain tensors.  One batch
    level is unwrapped; anything deeper is "nested", for paths (an eager
    re-run) that take any batching as it comes."""
    legacy = [g for g in grads if _compat.is_legacy_batched(g)]
    if legacy:
        level = _compat.legacy_vmap_level() or _legacy_level_of(legacy[0])
        if not level:
            return Batching("nested", -1)
        # One level deep when no grad is still batched under it; the unwrapped tensors are
        # the physical grads, kept for Batching.unwrapped.
        physical = {id(g): (g, _compat.legacy_remove_batch_dim(g, level, 0, 0)) for g in legacy}
        if any(_compat.is_legacy_batched(p) for _, p in physical.values()):
            return Batching("nested", -1)
        return Batching("legacy", level, physical)
    wrapped = [g for g in grads if _compat.is_functorch_wrapped(g)]
    if not wrapped:
        return None
    levels = {_compat.functorch_level(g) for g in wrapped}
    if len(levels) == 1 and all(_compat.is_functorch_batched(g) for g in wrapped):
        return Batching("functorch", levels.pop())
    return Batching("nested", -1)


def _legacy_level_of(t: torch.Tensor, most: int = 64) -> int:
    """The first legacy vmap level that batches ``t`` (0: none up to ``most``).

    For a backward on one of autograd's device threads (CUDA): the engine carries
    the caller's dispatch keys there, vmap's among them, but not vmap's level
    count, so ``legacy_vmap_level()`` reads 0.  ``_remove_batch_dim`` of a level
    the tensor lacks expands to the given size instead, which tells them apart."""
    for level in range(1, most + 1):
        if (_compat.legacy_remove_batch_dim(t, level, 0, 0).shape[0]
                == _compat.legacy_remove_batch_dim(t, level, 1, 0).shape[0]):
            return level
    return 0
