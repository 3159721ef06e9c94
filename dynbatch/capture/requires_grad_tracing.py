"""Dynamo traces ``requires_grad_()`` inside a dynbatch compile (stage 1, items 6 and 7).

Two patches of Dynamo, entered by the capture scope, the readers of what
they leave in the graph, and the leaves dynbatch's own programs take:
- on torch 2.11, ``t.requires_grad_()`` of a tensor made inside the graph is
  traced as 2.13's Dynamo does (``x.detach().requires_grad_()``, and
  ``functional.jacobian``'s own call); ``grad_pass.leaks_traced_requires_grad`` finds the
  graphs that then return such a leaf with requires_grad (the batching pass
  runs those eagerly);
- on every version, ``requires_grad_()`` of a graph input (a force model's
  ``pos.requires_grad_(True)``) marks the input's placeholder instead of
  graph-breaking; the backend and the region read the mark;
- the programs dynbatch compiles itself (the region's batched backward, chunk
  programs) make their own leaves where Dynamo traces ``requires_grad_()`` of
  an intermediate natively (torch 2.12+) and take leaves before
  (``program_input``, ``program_leaf``).
Capture-stage logic, so not in ``_compat``, and kept beside capture/grad_calls.py, which
enters it: like capture's other hooks, each patch reaches into Dynamo's own
classes (``TensorVariable``, the instruction translators' opcode tables) and
fails soft as a whole.
"""

from __future__ import annotations

import contextlib
import dataclasses
import dis
import weakref
from typing import Any, Iterator, Sequence

import torch
import torch.fx

from .. import _compat


@contextlib.contextmanager
def dynamo_traces_requires_grad_of_intermediates() -> Iterator[None]:
    """Torch 2.11: Dynamo puts ``t.requires_grad_()`` of a tensor made inside
    the graph into the graph, as 2.13's ``TensorVariable.method_requires_grad_``
    does, instead of graph-breaking.  ``x.detach().requires_grad_()`` and
    ``functional.jacobian``'s own call are then traced, and the grads that use
    the new leaf are captured with it.  2.13 also graph-breaks where such a leaf
    (or a tensor made from it) is returned with requires_grad; the backend
    checks that case itself (``grad_pass.leaks_traced_requires_grad``) and runs the graph
    eagerly.  Graph inputs keep the graph break (a metadata mutation)."""
    if _compat.DYNAMO_TRACES_REQUIRES_GRAD_:
        yield
        return
    from torch._dynamo.variables.tensor import TensorVariable

    original = TensorVariable.method_requires_grad_

    def method_requires_grad_(self, tx, requires_grad=True):
        wanted = requires_grad if requires_grad is True else requires_grad.as_python_constant()
        example = self.as_proxy().node.meta["example_value"]
        if self.source or example.requires_grad == wanted:
            return original(self, tx, requires_grad)
        # As 2.13 emits it: AOTAutograd re-traces under functorch, which refuses
        # requires_grad_() unless the call is bracketed by this flag.
        allowed = torch._C._functorch.get_inplace_requires_grad_allowed()
        torch._C._functorch.set_inplace_requires_grad_allowed(True)
        try:
            tx.output.create_node("call_function", torch._C._functorch.set_inplace_requires_grad_allowed,
                                  (True,), {})
            tx.output.create_proxy("call_method", "requires_grad_", (self.as_proxy(),), {})
            tx.output.create_node("call_function", torch._C._functorch.set_inplace_requires_grad_allowed,
                                  (allowed,), {})
        finally:
            torch._C._functorch.set_inplace_requires_grad_allowed(allowed)
        example.requires_grad_(wanted)
        self.requires_grad = wanted
        return self

    TensorVariable.method_requires_grad_ = method_requires_grad_
    try:
        yield
    finally:
        TensorVariable.method_requires_grad_ = original


REQUIRES_GRAD_AT_CALL = "dynbatch_requires_grad_at_call"  # placeholder meta: see below
# Frames whose inputs' requires_grad_() stays a graph break (code objects, weakly held).
_INPUT_REQUIRES_GRAD_REFUSED: "weakref.WeakSet[Any]" = weakref.WeakSet()


@contextlib.contextmanager
def dynamo_traces_requires_grad_of_inputs() -> Iterator[None]:
    """``x.requires_grad_()`` (or ``x.requires_grad = True``) on a graph input
    that does not require grad -- ``pos.requires_grad_(True)`` in a force
    model's forward -- is traced instead of graph-breaking: the input is marked
    (``REQUIRES_GRAD_AT_CALL`` on its placeholder) and its fake value requires
    grad from there on, so the graph differentiates w.r.t. the input itself.
    The region sets ``requires_grad`` on the real tensor before each call, as
    eager does by then; Dynamo's guards keep what they saw (the input does not
    require grad), so the next fresh input hits the same graph.  The attribute
    form becomes the method (they differ only in the method's return value)."""
    from torch._dynamo.output_graph import OutputGraph
    from torch._dynamo.symbolic_convert import InstructionTranslatorBase
    from torch._dynamo.variables.tensor import TensorVariable

    original_method = TensorVariable.method_requires_grad_
    original_store = InstructionTranslatorBase.STORE_ATTR
    original_compile_subgraph = OutputGraph.compile_subgraph

    def method_requires_grad_(self, tx, requires_grad=True):
        wanted = requires_grad if requires_grad is True else requires_grad.as_python_constant()
        node = self.as_proxy().node
        example = node.meta.get("example_value")
        root_code = tx.output.root_tx.f_code
        if not (wanted is True and self.source is not None and node.op == "placeholder"
                and isinstance(example, torch.Tensor) and not example.requires_grad
                and (example.dtype.is_floating_point or example.dtype.is_complex)
                and not _compat.functorch_transform_active() and root_code not in _INPUT_REQUIRES_GRAD_REFUSED):
            if (_compat.functorch_transform_active() and node.op != "placeholder"
                    and any(n.meta.get(REQUIRES_GRAD_AT_CALL) for n in tx.output.graph.find_nodes(op="placeholder"))):
                # A functorch wrapper of the marked input inside a transform
                # (``hessian(outer_jacobian_strategy="forward-mode")``): its fake value
                # has lost requires_grad and Dynamo's own path fails on it.  Trace the
                # frame again with the input's requires_grad_() a graph break, as stock.
                _INPUT_REQUIRES_GRAD_REFUSED.add(root_code)
                raise torch._dynamo.exc.RestartAnalysis(
                    restart_reason="dynbatch: requires_grad_() of a graph input reaches a torch.func transform")
            return original_method(self, tx, requires_grad)
        example.requires_grad_(True)
        node.meta[REQUIRES_GRAD_AT_CALL] = True
        self.requires_grad = True
        return self

    def compile_subgraph(self, *args, **kwargs):
        # Only a placeholder the backend's graph keeps carries the mark to the region,
        # which sets the real tensor's requires_grad.  Dynamo prunes a placeholder no
        # op reads (``pos.requires_grad_()`` right before a graph break, an ``.item()``
        # in a neighbour list, or in a graph with no op, which no backend sees): the
        # flag was lost and the grad after the break raised.  Trace the frame again
        # with the call a graph break, as stock does, so it runs eagerly.
        marked = [n for n in self.graph.find_nodes(op="placeholder") if n.meta.get(REQUIRES_GRAD_AT_CALL)]
        if any(not n.users for n in marked):
            _refuse(self.root_tx.f_code, "no op of the graph reads it")
        result = original_compile_subgraph(self, *args, **kwargs)
        if any(n._erased for n in marked):
            _refuse(self.root_tx.f_code, "the graph's dead code read it")
        return result

    def STORE_ATTR(self, inst):  # noqa: N802 - Dynamo's opcode handler name
        if inst.argval == "requires_grad" and len(self.stack) >= 2:
            obj, val = (v.realize() if hasattr(v, "realize") else v for v in (self.stack[-1], self.stack[-2]))
            if isinstance(obj, TensorVariable) and val.is_python_constant():
                self.popn(2)
                obj.call_method(self, "requires_grad_", [val], {})
                return None
        return original_store(self, inst)

    # Each translator class dispatches opcodes through a table built from its methods;
    # torch 2.14's TensorVariable dispatches methods through its tp_methods table.
    tables = [t for t in _dispatch_tables(InstructionTranslatorBase) if t[_STORE_ATTR] is original_store]
    methods = getattr(TensorVariable, "tp_methods", {})
    original_entry = methods.get("requires_grad_")
    TensorVariable.method_requires_grad_ = method_requires_grad_
    OutputGraph.compile_subgraph = compile_subgraph
    if original_entry is not None:
        methods["requires_grad_"] = dataclasses.replace(original_entry, handler=method_requires_grad_)
    for table in tables:
        table[_STORE_ATTR] = STORE_ATTR
    try:
        yield
    finally:
        TensorVariable.method_requires_grad_ = original_method
        OutputGraph.compile_subgraph = original_compile_subgraph
        if original_entry is not None:
            methods["requires_grad_"] = original_entry
        for table in tables:
            table[_STORE_ATTR] = original_store


_STORE_ATTR = dis.opmap["STORE_ATTR"]


def _refuse(code: Any, why: str) -> None:
    _INPUT_REQUIRES_GRAD_REFUSED.add(code)
    raise torch._dynamo.exc.RestartAnalysis(
        restart_reason=f"dynbatch: requires_grad_() of a graph input that the graph drops ({why})")


def _dispatch_tables(base: type) -> list[list]:
    classes, seen = [base], []
    while classes:
        cls = classes.pop()
        seen.append(cls)
        classes.extend(cls.__subclasses__())
    return [cls.__dict__["dispatch_table"] for cls in seen if "dispatch_table" in cls.__dict__]


def inputs_given_requires_grad(gm: Any) -> tuple[int, ...]:
    """The graph inputs whose ``requires_grad_()`` the graph traced (see above)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return tuple(i for i, n in enumerate(placeholders) if n.meta.get(REQUIRES_GRAD_AT_CALL))


def with_traced_requires_grad(gm: Any, example_inputs: Sequence[Any]) -> Sequence[Any]:
    """The backend's example inputs as the graph saw them: an input whose
    ``requires_grad_()`` was traced is its fake value (which requires grad; the
    real tensor does not yet), so AOTAutograd differentiates w.r.t. it with the
    same symbolic sizes."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if not any(n.meta.get(REQUIRES_GRAD_AT_CALL) for n in placeholders):
        return example_inputs
    return [n.meta["example_value"] if n.meta.get(REQUIRES_GRAD_AT_CALL) else a
            for n, a in zip(placeholders, example_inputs)]


# NOTE [Leaves of dynbatch's programs]
# The programs dynbatch compiles itself differentiate with respect to some of
# their inputs.  Where Dynamo traces ``requires_grad_()`` of an intermediate
# (torch 2.12+, _compat.DYNAMO_TRACES_REQUIRES_GRAD_), a program takes those
# inputs detached and makes its own leaves inside (``x.detach().requires_grad_()``):
# its compiled graph is then an inference graph, with no second autograd layer
# around it.  On torch 2.11 Dynamo would graph-break there (our backport covers
# user code, not graphs built by hand), so the caller passes leaves instead.
# One policy, two sides: the caller's (``program_input``) and the graph's (``program_leaf``).

def program_input(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the caller hands it to one of dynbatch's programs, where the program
    differentiates with respect to it (NOTE [Leaves of dynbatch's programs])."""
    return t.detach() if _compat.DYNAMO_TRACES_REQUIRES_GRAD_ else t.detach().requires_grad_()


def program_leaf(graph: torch.fx.Graph, x: torch.fx.Node) -> torch.fx.Node:
    """The leaf a program's graph differentiates with respect to, made from its input
    ``x`` (NOTE [Leaves of dynbatch's programs]): ``x`` itself where the caller passes leaves."""
    if not _compat.DYNAMO_TRACES_REQUIRES_GRAD_:
        return x
    leaf = graph.call_method("detach", (x,))
    # Later nodes read the tensor requires_grad_() changed in place, as user code does:
    # Dynamo tracks the change on that tensor, not on the method's return value.
    graph.call_method("requires_grad_", (leaf,))
    return leaf
