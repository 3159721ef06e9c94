"""Failing soft: a hook into torch internals that cannot be installed turns one feature off.

Every hook dynbatch puts into torch is one feature.  When a hook cannot be
installed (an attribute moved, a signature changed, an op overload is gone),
that feature is off for this process, with one warning naming it, and
compiles go on without it: stock Dynamo's behaviour (a graph break, an eager
grad) or functorch's own batching rule.  Never a crash of every compile.

Kept apart from ``_compat``: this is dynbatch's policy for a hook that failed,
used by the shims there and by the stages that install hooks, not a shim itself.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Iterator

import torch

HOOK_FAILURES: dict[str, str] = {}  # feature -> why it is off
_WARNED: set[str] = set()


def warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def hook_failed(feature: str, error: BaseException | str) -> None:
    """Record that ``feature`` is off, and say so once."""
    reason = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    HOOK_FAILURES.setdefault(feature, reason)
    warn_once("hook:" + feature, f"dynbatch: {feature} is off on torch {torch.__version__} "
                                 f"({reason}); compiles go on without it")


@contextlib.contextmanager
def soft(feature: str, make_context: Callable[[], Any]) -> Iterator[None]:
    """Enter ``make_context()`` if it can be entered; otherwise ``hook_failed``
    and run the block without it.  Errors raised by the block itself pass."""
    stack = contextlib.ExitStack()
    if feature not in HOOK_FAILURES:
        try:
            stack.enter_context(make_context())
        except Exception as e:  # noqa: BLE001 - a moved internal turns one feature off
            hook_failed(feature, e)
    with stack:
        yield
