"""Small helpers over FX graphs, sympy expressions and wrapped exceptions.

Used by several stages and owned by none; none of them is a shim over torch
internals (those are ``_compat``'s), so they live here rather than there.
Questions more than one stage asks of a graph are answered here, once: is an
aten node pointwise, does it draw random numbers (both by torch's op tags).
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


def copy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm`` to rewrite: its graph copied, its attributes shared, and what
    Dynamo attached to it kept (e.g. the shape env, dynamo_flat_name_to_original_fqn)."""
    new_gm = torch.fx.GraphModule(gm, copy_graph(gm.graph), gm.__class__.__name__)
    new_gm.meta.update(getattr(gm, "meta", {}))
    return new_gm


def forget_cleared_sources(gm: torch.fx.GraphModule) -> None:
    """AOTAutograd's cache clears ``_param_name_to_source`` while it keys a graph and
    puts back what it found: None on our copies, which have none.  A second lowering
    of the graph (after memory.Replan) would then read it as Dynamo's and look for
    sources its inputs lack ("node l_x_ must have _dynamo_source attribute")."""
    if hasattr(gm, "_param_name_to_source") and gm._param_name_to_source is None:
        del gm._param_name_to_source


def is_pointwise(node: torch.fx.Node) -> bool:
    """An aten graph's elementwise op (torch's ``pointwise`` op tag)."""
    return node.op == "call_function" and torch.Tag.pointwise in getattr(node.target, "tags", ())


def draws_random_numbers(node: torch.fx.Node) -> bool:
    """An aten graph's op that draws random numbers (torch's ``nondeterministic_seeded``
    op tag): a re-run draws others, and B expanded copies draw B samples where one
    call draws one.  An attention or dropout op called with a dropout probability of 0
    (``dropout_p``, ``p``) or outside training (``train=False``) draws none: the tag is
    the op's, whatever its arguments (``scaled_dot_product_attention`` in eval mode)."""
    if node.op != "call_function" or torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ()):
        return False
    return not _drops_nothing(node)


def _drops_nothing(node: torch.fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return False
    values = {}
    for i, argument in enumerate(schema.arguments):
        if i < len(node.args):
            values[argument.name] = node.args[i]
        elif argument.name in node.kwargs:
            values[argument.name] = node.kwargs[argument.name]
        elif argument.has_default_value():
            values[argument.name] = argument.default_value
    if values.get("train") is False:
        return True
    probability = values.get("dropout_p", values.get("p"))
    return isinstance(probability, (int, float)) and not isinstance(probability, bool) and probability == 0


def random_op_origins(gm: torch.fx.GraphModule) -> set[str | None]:
    """The Dynamo graph nodes an aten graph's random ops were traced from (the last entry
    of ``source_fn_stack``, which AOTAutograd copies from the node it traces); None
    stands for a random op whose origin is not recorded."""
    origins: set[str | None] = set()
    for node in gm.graph.nodes:
        if draws_random_numbers(node):
            origins |= _origins(node)
    return origins


def traced_name(node: torch.fx.Node) -> str:
    """The name a Dynamo node had when its call was traced: the one its aten ops
    carry as their origin.  Dynamo may rename the node after the variable the
    result is assigned to (``h = dropout(x)`` is node ``h``, its origin ``dropout``)."""
    stack = node.meta.get("source_fn_stack")
    return stack[-1][0] if stack else node.name


def _origins(node: torch.fx.Node) -> set[str | None]:
    if node.meta.get("source_fn_stack"):
        return {traced_name(node)}
    # Inductor's seed op (inductor_seeds, added by its joint-graph passes) has none: it
    # feeds the ops that replaced the graph's random ops, each with its origin.
    readers = list(node.users)
    if readers and all(user.meta.get("source_fn_stack") for user in readers):
        return {traced_name(user) for user in readers}
    return {None}


def graph_output_count(gm: Any) -> int:
    """How many values a Dynamo graph returns (its output node's tuple)."""
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    result = output.args[0]
    return len(result) if isinstance(result, (tuple, list)) else 1


def outputs_may_require_grad(gm: Any) -> bool:
    """Whether a value a Dynamo graph returns required grad when it was traced
    (its example value); True where a value's is unknown."""
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    result = output.args[0]
    for value in result if isinstance(result, (tuple, list)) else (result,):
        if not isinstance(value, torch.fx.Node):
            continue  # a constant
        example = value.meta.get("example_value")
        if not isinstance(example, (torch.Tensor, int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)):
            return True
        if isinstance(example, torch.Tensor) and example.requires_grad:
            return True
    return False


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
