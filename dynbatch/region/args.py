"""A region's arguments: its differentiable inputs, the rest, and masks over them.

A compiled graph's arguments split into the inputs autograd differentiates
(``Region.diff_args``) and the others; a region's programs take them as those two
lists (region/program.py), and a backward computes grads only for the inputs it
uses, a mask over the inputs (NOTE [Only the grads a backward uses] in
region/program.py).  The bottom of the region's modules: every one of them may
import this, and it imports none of them.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .. import _compat


def select(items: Sequence[Any], mask: tuple[bool, ...]) -> list[Any]:
    return [t for t, m in zip(items, mask) if m]


def spread(values: Sequence[Any], mask: tuple[bool, ...]) -> tuple[Any, ...]:
    """The inverse of ``select``: None where the mask is off."""
    it = iter(values)
    return tuple(next(it) if m else None for m in mask)


def merge(is_input: tuple[bool, ...], inputs: Sequence[Any], others: Sequence[Any]) -> list[Any]:
    """The graph's argument list from its differentiable inputs and the rest, in order."""
    args, k, j = [], 0, 0
    for input_here in is_input:
        if input_here:
            args.append(inputs[k])
            k += 1
        else:
            args.append(others[j])
            j += 1
    return args


def why_run_eagerly(args: Sequence[Any]) -> str | None:
    """Compiled kernels see neither forward-mode tangents nor legacy-vmap batch dims."""
    if _compat.forward_ad_level() >= 0 and any(
            isinstance(a, torch.Tensor) and _compat.has_tangent(a) for a in args):
        return "an input carries a forward-mode tangent, which compiled kernels drop"
    if _compat.legacy_vmap_keyed() and any(isinstance(a, torch.Tensor) and _compat.is_legacy_batched(a)
                                           for a in args):
        return "an input is batched by eager's vmap (is_grads_batched / vectorize=True)"
    return None
