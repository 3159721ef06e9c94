"""Shared helpers for the reliability tests (GitHub issue 4).

Oracles, not numbers: every expected value here is computed at run time by
eager PyTorch, either as a stacked loop of per-sample ``torch.autograd.grad``
calls (``loop_grads``) or by eager ``is_grads_batched=True`` itself.

Compiling, the oracle and the grad comparison are conftest's
(``compile_dynbatch``, ``loop_grads``, ``assert_same_grads``): the dynbatch
backend with ``aot_eager`` as the inner compiler (cheap for sweeps) and
``on_unsupported="error"``, so a test about the fallback path passes
``options=FALLBACK`` and asserts the fallback.  ``DynbatchCounter``
is a counting backend: ``torch._dynamo.testing.CompileCounterWithBackend("dynbatch")``
can neither forward ``options=`` nor be recognised by dynbatch's capture
scope (dynbatch enters its scope only for a backend carrying
``_dynbatch_backend = True``), so with it ``torch.autograd.grad`` would
graph-break as under stock Dynamo.  This counter carries the marker and
forwards the options.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch._dynamo
import torch._dynamo.utils

import dynbatch
from conftest import AOT_EAGER
from dynbatch.backend import dynbatch_backend


class DynbatchCounter:
    """A dynbatch backend that counts the Dynamo graphs it compiles.

    Keeps counts only (never the graph modules), so it holds nothing alive.
    """

    _dynbatch_backend = True  # what dynbatch's capture scope looks for

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        self.options = {**AOT_EAGER, **(options or {})}  # as compile_dynbatch merges them
        self.frame_count = 0
        self.op_count = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **_: Any) -> Callable:
        self.frame_count += 1
        self.op_count += sum(1 for n in gm.graph.nodes if "call" in n.op)
        return dynbatch_backend(gm, example_inputs, options=self.options)


def graph_breaks() -> int:
    """Graph breaks Dynamo counted since the last ``reset_all``."""
    return sum(torch._dynamo.utils.counters["graph_break"].values())


def unique_graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


# --- outcomes ------------------------------------------------------------------

def outcome(fn: Callable, *args: Any, **kwargs: Any) -> tuple[str, Any]:
    """("ok", value) or ("raise", exception)."""
    try:
        return "ok", fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - the exception is the result
        return "raise", e


def assert_same_exception(actual: BaseException, expected: BaseException, msg: str = "") -> None:
    assert type(actual) is type(expected), (
        f"{msg}: raised {type(actual).__name__}: {actual}\n"
        f"eager raised {type(expected).__name__}: {expected}")
    assert str(actual) == str(expected), (
        f"{msg}: message differs\n compiled: {actual}\n eager:    {expected}")


def counters_delta(before: dict[str, int]) -> dict[str, int]:
    now = dynbatch.counters()
    keys = set(now) | set(before)
    return {k: now.get(k, 0) - before.get(k, 0) for k in keys if now.get(k, 0) != before.get(k, 0)}
