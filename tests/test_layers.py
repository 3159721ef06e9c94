"""The package layout shows the pipeline: each stage imports only the stages below it.

docs/design.md, "The packages", has the order and why.  A module may import its own
package and those below; an import upward (even inside a function) is a cycle in the
design waiting to become one in Python, and fails here.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "dynbatch"

# Bottom to top.  The root's shared modules are the floor; the backend, the public
# package and the bench join everything and sit on top.
LAYERS = (
    ("shared", {"_compat", "fail_soft", "fx_utils", "graph_text", "options", "records", "threads"}),
    ("cpu", {"cpu"}),
    ("batching", {"batching"}),
    ("capture", {"capture"}),
    ("planning", {"planning"}),
    ("lowering", {"lowering"}),
    ("region", {"region"}),
    ("sparsity", {"sparsity"}),  # calls torch.compile(backend="dynbatch"), imports none of it
    ("entry", {"backend", "__init__", "bench"}),
)
LEVEL = {name: level for level, (_, names) in enumerate(LAYERS) for name in names}


def _unit(parts: tuple[str, ...]) -> str:
    """The layer unit of a module path inside dynbatch: its package, or the root module."""
    return parts[0].removesuffix(".py")


def _imported_units(path: pathlib.Path) -> set[tuple[str, int]]:
    """Every dynbatch unit a module imports, at any depth of its code, with the line."""
    here = path.relative_to(ROOT).parts[:-1]  # the module's package, as parts
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[:len(here) - (node.level - 1)] if node.level > 1 else here
                target = (*base, *(node.module.split(".") if node.module else ()))
            elif node.module and node.module.split(".")[0] == "dynbatch":
                target = tuple(node.module.split(".")[1:])
            else:
                continue
            targets = [target] if target else [(alias.name,) for alias in node.names]
        elif isinstance(node, ast.Import):
            targets = [tuple(a.name.split(".")[1:]) for a in node.names if a.name.split(".")[0] == "dynbatch"]
            targets = [t for t in targets if t]
        else:
            continue
        found.update((_unit(t), node.lineno) for t in targets)
    return found


def _modules() -> list[pathlib.Path]:
    return sorted(p for p in ROOT.rglob("*.py"))


def test_every_module_is_in_a_layer():
    units = {_unit(p.relative_to(ROOT).parts) for p in _modules()}
    assert units <= set(LEVEL), f"put {sorted(units - set(LEVEL))} in a layer of tests/test_layers.py"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_go_only_downward(path):
    mine = _unit(path.relative_to(ROOT).parts)
    upward = [f"line {line}: {unit} ({LAYERS[LEVEL[unit]][0]})"
              for unit, line in sorted(_imported_units(path)) if LEVEL.get(unit, -1) > LEVEL[mine]]
    assert not upward, f"{path.relative_to(ROOT)} ({LAYERS[LEVEL[mine]][0]}) imports upward: {upward}"
