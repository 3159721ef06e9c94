"""Small helpers over FX graphs, sympy expressions and wrapped exceptions.

Used by several stages and owned by none; none of them is a shim over torch
internals (those are ``_compat``'s), so they live here rather than there.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx

from . import _compat


def copy_graph(graph: torch.fx.Graph) -> torch.fx.Graph:
    """A copy of ``graph`` that generates code as it does (Dynamo's pytree in/out handling)."""
    new = _compat.empty_graph_like(graph)
    new.output(new.graph_copy(graph, {}))
    return new


def graph_output_count(gm: Any) -> int:
    """How many values a Dynamo graph returns (its output node's tuple)."""
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    result = output.args[0]
    return len(result) if isinstance(result, (tuple, list)) else 1


def fetch_attr(module: torch.nn.Module, target: str) -> Any:
    value = module
    for atom in target.split("."):
        value = getattr(value, atom)
    return value


def compile_sympy(symbols: tuple, exprs: list) -> Callable[..., tuple]:
    """One Python function evaluating ``exprs`` (which may use torch's sympy functions,
    FloorDiv, ModularIndexing, ...) at integer values of ``symbols``, printed as Dynamo prints guards."""
    printer = _compat.guard_printer()
    body = ", ".join(printer.doprint(e) for e in exprs)
    return eval(f"lambda {', '.join(map(str, symbols))}: ({body},)", {"math": __import__("math")})  # noqa: S307


def find_cause(e: BaseException, kind: type) -> Any:
    """``e`` or the exception it wraps (Inductor and AOTAutograd wrap errors raised in inner compilers)."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, kind):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__ or getattr(e, "inner_exception", None)
    return None
