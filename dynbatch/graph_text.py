"""A stable text form of FX graphs, for snapshots and for people.

``print(gm)`` holds file paths, memory addresses and Dynamo's run-dependent
symbol names (``s33``); this prints one line per node with its dtype and
shape, and renames size symbols to ``s0, s1, ...`` in order of appearance so
the same program gives the same text on every run and machine.
"""

from __future__ import annotations

import re
import types
from typing import Any

import torch
import torch.fx

_DTYPE = {
    torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32", torch.float64: "f64",
    torch.complex64: "c64", torch.complex128: "c128", torch.int64: "i64", torch.int32: "i32",
    torch.int8: "i8", torch.uint8: "ui8", torch.bool: "b8",
}
_SYMBOL = re.compile(r"\b([su])(\d+)\b")


def graph_text(gm: torch.fx.GraphModule | torch.fx.Graph, title: str = "graph") -> str:
    graph = gm.graph if isinstance(gm, torch.fx.GraphModule) else gm
    lines = [f"{title}:"]
    for node in graph.nodes:
        lines.append("  " + _node_line(node))
    return canonical_symbols("\n".join(lines) + "\n")


def count_nodes(gm: torch.fx.GraphModule) -> int:
    return len(gm.graph.nodes)


def canonical_symbols(text: str) -> str:
    """Rename size symbols by first appearance: ``s33 ... s7`` becomes ``s0 ... s1``."""
    names: dict[str, str] = {}

    def rename(m: re.Match) -> str:
        return names.setdefault(m.group(0), f"{m.group(1)}{len([k for k in names if k[0] == m.group(1)])}")

    return _SYMBOL.sub(rename, text)


def _node_line(node: torch.fx.Node) -> str:
    meta = _meta_text(node.meta.get("val", node.meta.get("example_value")))
    typed = f"%{node.name}: {meta}" if meta else f"%{node.name}"
    if node.op == "placeholder":
        return f"{typed} = input"
    if node.op == "output":
        return f"return {_arg_text(node.args[0])}"
    if node.op == "get_attr":
        return f"{typed} = self.{node.target}"
    args = [_arg_text(a) for a in node.args]
    args += [f"{k}={_arg_text(v)}" for k, v in node.kwargs.items()]
    return f"{typed} = {_target_text(node)}({', '.join(args)})"


def _target_text(node: torch.fx.Node) -> str:
    t = node.target
    if node.op == "call_method":
        return f".{t}"
    if node.op == "call_module":
        return f"self.{t}"
    if isinstance(t, (torch._ops.OpOverload, torch._ops.OpOverloadPacket, torch._ops.HigherOrderOperator)):
        return str(t) if not isinstance(t, torch._ops.HigherOrderOperator) else f"hop.{t.name()}"
    module = getattr(t, "__module__", None) or ""
    if isinstance(t, types.BuiltinFunctionType):
        # pybind11 qualnames carry ABI tags; torch.tanh's qualname names a private class.
        name = t.__name__
        module = module or ("torch" if getattr(torch, name, None) is t else "")
    else:
        name = getattr(t, "__qualname__", None) or getattr(t, "__name__", None) or repr(t)
    if module in ("_operator", "operator"):
        module = "operator"
    return f"{module}.{name}" if module else name


def _arg_text(a: Any) -> str:
    if isinstance(a, torch.fx.Node):
        return f"%{a.name}"
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_arg_text(x) for x in a)
        return f"[{inner}]" if isinstance(a, list) else f"({inner}{',' if len(a) == 1 else ''})"
    if isinstance(a, dict):
        return "{" + ", ".join(f"{k!r}: {_arg_text(v)}" for k, v in a.items()) + "}"
    if isinstance(a, torch.dtype):
        return str(a)
    if isinstance(a, torch.device):
        return f"device({a.type!r})"
    if isinstance(a, float):
        return repr(round(a, 6))
    return repr(a)


def _meta_text(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"{_DTYPE.get(v.dtype, str(v.dtype))}[{', '.join(str(s) for s in v.shape)}]"
    if isinstance(v, torch.SymInt):
        return f"sym({v})"
    if isinstance(v, (list, tuple)):
        parts = [_meta_text(x) or "-" for x in v]
        return f"({', '.join(parts)})" if any(p != "-" for p in parts) else ""
    return ""
