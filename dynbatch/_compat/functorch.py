"""functorch's transforms (torch.func.vmap and its interpreter stack) and eager's legacy vmap.
No version shim: each private name below is alike on 2.11-2.14 (2.11.0-2.14.1 sources and stubs);
``torch.func`` has no public query of levels or wrappers, and legacy vmap none at all."""

from __future__ import annotations

from typing import Any

import torch


__all__ = ["below_vmap", "current_vmap_level", "decomposition_table", "functorch_has_batch_rule",
           "functorch_level", "functorch_transform_active", "functorch_vmap_module",
           "is_functorch_batched", "is_functorch_wrapped", "is_legacy_batched",
           "legacy_add_batch_dim", "legacy_remove_batch_dim", "legacy_vmap_active",
           "legacy_vmap_keyed", "legacy_vmap_level", "only_transform_is", "outside_functorch",
           "outside_legacy_vmap", "rewrap_batched", "unwrap_at"]


def functorch_transform_active() -> bool:
    return torch._C._functorch.peek_interpreter_stack() is not None


def current_vmap_level() -> int:
    from torch._C import _functorch

    return _functorch.current_level()


def functorch_level(t: torch.Tensor) -> int:
    """The vmap level of ``t``'s outermost functorch wrapper (-1: a plain tensor)."""
    return torch._C._functorch.maybe_get_level(t)


def is_functorch_wrapped(t: torch.Tensor) -> bool:
    return torch._C._functorch.is_functorch_wrapped_tensor(t)


def is_functorch_batched(t: torch.Tensor) -> bool:
    return torch._C._functorch.is_batchedtensor(t)


def unwrap_at(t: torch.Tensor, level: int) -> tuple[torch.Tensor, int | None]:
    """A tensor's (value, batch dim) at vmap ``level``, as a batching rule sees it:
    (t, None) when ``t`` is not batched at that level."""
    from torch._C import _functorch

    return _functorch._unwrap_batched(t, level)


def rewrap_batched(value: torch.Tensor, bdim: int, level: int) -> torch.Tensor:
    from torch._C import _functorch

    return _functorch._add_batch_dim(value, bdim, level)


def only_transform_is(level: int) -> bool:
    """Is the functorch transform at ``level`` the only one active (the top of a stack of one)?"""
    from torch._C import _functorch

    stack = _functorch.get_interpreter_stack()
    return stack is not None and len(stack) == 1 and stack[0].level() == level


def outside_functorch() -> Any:
    """A context without the top functorch transform: plain tensors dispatch as plain, and
    Dynamo compiles frames (it steps aside while a transform is active)."""
    from torch._functorch.pyfunctorch import temporarily_pop_interpreter_stack

    return temporarily_pop_interpreter_stack()


def below_vmap() -> Any:
    """Dispatch past functorch's batching layer (inside a batching rule)."""
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.FuncTorchBatched)
    return torch._C._ExcludeDispatchKeyGuard(keys)


def functorch_has_batch_rule(op: torch._ops.OpOverload) -> bool:
    """Does vmap batch ``op`` with a rule (C++, or one of functorch's Python
    decompositions), rather than its slow per-sample fallback?"""
    from torch._functorch.vmap import lazy_load_decompositions

    lazy_load_decompositions()  # functorch registers some rules only on first use
    return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "FuncTorchBatched")


def functorch_vmap_module() -> Any:
    """``torch._functorch.vmap``: ``vmap_impl`` (what ``torch.vmap`` calls) and its one-call branch."""
    import torch._functorch.vmap as vmap_module

    names = ("vmap_impl", "_process_batched_inputs", "_flat_vmap", "_check_out_dims_is_int_or_int_pytree")
    if not all(hasattr(vmap_module, n) for n in names):  # pragma: no cover - version guard
        raise ImportError(f"torch {torch.__version__}: torch._functorch.vmap moved")
    return vmap_module


def decomposition_table() -> dict:
    from torch._decomp import decomposition_table as table

    return table


# Legacy vmap's dispatch key, parsed once: the pybind enum lacks it, and parsing its
# name on each query costs ~3 us, four times per batched backward.
_VMAP_MODE = torch._C._parse_dispatch_key("VmapMode")


def legacy_vmap_level() -> int:
    """How deep eager's legacy vmap (``torch._vmap_internals``) is nested; 0 outside it."""
    keyed = torch._C._dispatch_tls_is_dispatch_key_included(_VMAP_MODE)
    level = torch._C._vmapmode_increment_nesting()
    torch._C._vmapmode_decrement_nesting()  # back at 0 it also turns the key off
    if keyed and level == 1:  # a device thread's key without its count (which_vmap._legacy_level_of)
        torch._C._dispatch_tls_set_dispatch_key_included(_VMAP_MODE, True)
    return level - 1


def legacy_vmap_keyed() -> bool:
    """Is legacy vmap's dispatch key on in this thread?  Where it is off, no legacy
    BatchedTensor is live (vmap unwraps its outputs as it exits; the engine's device threads
    inherit the key): one C++ call instead of a check of each tensor."""
    return torch._C._dispatch_tls_is_dispatch_key_included(_VMAP_MODE)


def legacy_vmap_active() -> bool:
    """Inside eager's legacy vmap, also on a device thread that has its key without its level."""
    return bool(legacy_vmap_level()) or legacy_vmap_keyed()


def is_legacy_batched(t: torch.Tensor) -> bool:
    return torch._C._functorch.is_legacy_batchedtensor(t)


def legacy_remove_batch_dim(t: torch.Tensor, level: int, batch_size: int, out_dim: int) -> torch.Tensor:
    """The physical tensor of legacy vmap ``level``; a tensor not batched there is expanded to ``batch_size``."""
    return torch._remove_batch_dim(t, level, batch_size, out_dim)


def legacy_add_batch_dim(t: torch.Tensor, batch_dim: int, level: int) -> torch.Tensor:
    return torch._add_batch_dim(t, batch_dim, level)


class outside_legacy_vmap:  # noqa: N801 - used as a function, like contextlib's
    """Leave eager's legacy vmap mode, levels and dispatch key, until the context exits.
    A class, not a generator: every batched grad through a compiled graph enters it."""

    def __enter__(self) -> None:
        self.depth = depth = legacy_vmap_level()
        for _ in range(depth):
            torch._C._vmapmode_decrement_nesting()
        # On a device thread the key is on with a count of 0 (which_vmap._legacy_level_of).
        self.keyed = torch._C._dispatch_tls_is_dispatch_key_included(_VMAP_MODE)
        if self.keyed:
            torch._C._dispatch_tls_set_dispatch_key_included(_VMAP_MODE, False)

    def __exit__(self, *exc: Any) -> None:
        if self.keyed:
            torch._C._dispatch_tls_set_dispatch_key_included(_VMAP_MODE, True)
        for _ in range(self.depth):
            torch._C._vmapmode_increment_nesting()
