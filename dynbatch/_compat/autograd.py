"""Autograd and the dispatcher: the engine, functional's helpers, forward AD, op schemas, storages.
No version shim: each private name below is alike on 2.11-2.14 (2.11.0-2.14.1 sources and stubs,
the engine's message in libtorch_python too), with no public replacement."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.autograd import forward_ad as _forward_ad


__all__ = ["backward_keeps_graph", "drop_library", "engine_will_execute",
           "engine_will_execute_each", "forward_ad_level", "functional_as_tuple",
           "functional_forward_jacobian", "functional_standard_basis",
           "functional_tuple_postprocess", "has_tangent", "is_view_op", "is_zero_tensor",
           "op_schema", "outside_custom_op", "shapes_for_message", "storage_of",
           "tensor_or_tensors_to_tuple"]


def tensor_or_tensors_to_tuple(tensors: Any, length: int) -> tuple:
    """How ``torch.autograd.grad`` normalises ``grad_outputs``."""
    return torch.autograd._tensor_or_tensors_to_tuple(tensors, length)


def shapes_for_message(output: Any, first_grad: Any, is_grads_batched: bool) -> tuple:
    """The (output, grad) shapes eager prints in its mismatch message, by eager's own helper
    (a batched message shows ``grad.shape[2:]``: users compare our text with eager's)."""
    return torch.autograd._calculate_shape(output, first_grad, is_grads_batched)


def functional_forward_jacobian() -> Callable | None:
    """``torch.autograd.functional._jacfwd`` (on 2.11-2.14), which dynbatch traces as vmap over jvp."""
    return getattr(torch.autograd.functional, "_jacfwd", None)


def functional_as_tuple(*args: Any) -> Any:
    return torch.autograd.functional._as_tuple(*args)


def functional_standard_basis(*args: Any) -> Any:
    return torch.autograd.functional._construct_standard_basis_for(*args)


def functional_tuple_postprocess(*args: Any) -> Any:
    return torch.autograd.functional._tuple_postprocess(*args)


def forward_ad_level() -> int:
    """The innermost active ``torch.autograd.forward_ad.dual_level`` (-1: none)."""
    return _forward_ad._current_level


def has_tangent(t: torch.Tensor) -> bool:
    return _forward_ad.unpack_dual(t).tangent is not None


def backward_keeps_graph() -> bool:
    """Does the running backward keep its graph (``retain_graph``/``create_graph``)?"""
    return torch._C._autograd._get_current_graph_task_keep_graph()


def engine_will_execute(node: Any) -> bool:
    """Will the running backward execute ``node``, or capture what reaches it?  Autograd
    refuses to answer only for a leaf's accumulator that ``torch.autograd.grad`` captures
    (``topological_nr() == 0 && captures_`` in ``_will_engine_execute_node``, since torch
    1.13), so the refusal is itself the answer: that leaf's grad is wanted."""
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError as e:
        if "leaf node was passed to _will_engine_execute_node" in str(e):
            return True
        raise


def engine_will_execute_each(nodes: Sequence[Any]) -> tuple[bool, ...]:
    """``engine_will_execute`` of each of the running node's next nodes (None: no edge).

    A captured leaf's answer is an exception, which costs 30-50 us (a C++ error
    with its backtrace), a tenth of a small call.  The node asking runs, so
    autograd wants at least one of its edges: where every other edge is not
    wanted, the last one's answer is yes without asking.  Leaves go last, and of
    them the data last of all: a Jacobian or the forces are taken w.r.t. the
    data, the parameters' grads by ``backward()``, where no answer raises."""
    edges = [k for k, n in enumerate(nodes) if n is not None]
    if len(edges) == 1:  # the only edge: wanted, unasked
        return tuple(n is not None for n in nodes)
    # Three lists, not a sort by key: this runs on every batched or create_graph backward.
    inner, parameters, data = [], [], []
    for k, n in enumerate(nodes):
        if n is None:
            continue
        if type(n).__name__ != "AccumulateGrad":
            inner.append(k)
        elif isinstance(n.variable, torch.nn.Parameter):
            parameters.append(k)
        else:
            data.append(k)
    order = inner + parameters + data
    answers = [False] * len(nodes)
    last = len(order) - 1
    for position, k in enumerate(order):
        answers[k] = True if position == last and not any(answers) else engine_will_execute(nodes[k])
    return tuple(answers)


def storage_of(t: Any) -> Any:
    """A hashable handle of a tensor's storage (fake ones too, as AOTAutograd's aliasing
    analysis reads them), or None for anything else."""
    if not isinstance(t, torch.Tensor):
        return None
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.untyped_storage())


def is_zero_tensor(t: torch.Tensor) -> bool:
    """A ZeroTensor: autograd's grad known to be zero, with no storage of its own."""
    return t._is_zerotensor()


def op_schema(op: torch._ops.OpOverload) -> Any:
    """An op overload's ``FunctionSchema`` (its private ``_schema``): name and arguments."""
    return op._schema


def is_view_op(target: Any) -> bool:
    return isinstance(target, torch._ops.OpOverload) and target.is_view


def drop_library(lib: torch.library.Library) -> None:
    """Unregister every kernel ``lib`` registered: the ones it overrode are in effect again."""
    lib._destroy()


# The dispatcher's thread-local key sets of plain user code (read when dynbatch loads).
_USER_DISPATCH_KEYS = (torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set())


@contextlib.contextmanager
def outside_custom_op() -> Iterator[None]:
    """Inside a custom op's kernel, as if called from user code: a kernel runs with every key
    above the backend excluded (no autograd, no functorch), and no dispatch mode that
    AOTAutograd's runtime set for its checks stays active (under one, Dynamo would not compile)."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch._C._ForceDispatchKeyGuard(*_USER_DISPATCH_KEYS):
        yield
