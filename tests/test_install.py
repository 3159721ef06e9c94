"""Registration by entry point, and no lasting change to Dynamo for other backends."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys
import textwrap

import pytest
import torch

import dynbatch
from dynbatch import _compat

PROGRAM = textwrap.dedent("""
    import sys, torch
    def f(x, V):
        return torch.autograd.grad(x.sin(), x, V, is_grads_batched=True)[0]
    x, V = torch.randn(3, requires_grad=True), torch.randn(4, 3)
    out = torch.compile(f, backend="dynbatch", fullgraph=True,
                        options={"dynbatch.inner_compiler": "aot_eager"})(x, V)
    torch.testing.assert_close(out, f(x, V))
    import dynbatch
    assert dynbatch.counters()["graphs_batched"] == 1, dynbatch.counters()
    print("ok")
""")


def test_backend_works_in_a_fresh_process_without_importing_dynbatch():
    proc = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("ok")


def test_dynbatch_is_listed_by_dynamo():
    assert "dynbatch" in torch._dynamo.list_backends()


def grad_program(x):
    return torch.autograd.grad(x.sin().sum(), x)[0]


# The next two tests call torch.compile(backend="dynbatch") as a user does, not conftest's
# compile_dynbatch: they are about the name's registration and Dynamo's state around it.

def test_other_backends_still_see_stock_dynamo():
    # A dynbatch compile first, so its scope has been entered and left.
    torch.compile(grad_program, backend="dynbatch", options={"dynbatch.inner_compiler": "aot_eager"})(torch.randn(3, requires_grad=True))
    assert torch._dynamo.config.trace_autograd_ops is False
    torch._dynamo.reset()
    # Under another backend, autograd.grad graph-breaks exactly as in stock torch.
    explanation = torch._dynamo.explain(grad_program)(torch.randn(3, requires_grad=True))
    assert any("trace_autograd_ops" in str(b.reason) for b in explanation.break_reasons)


def test_capture_hook_survives_dynamo_reset():
    torch._dynamo.reset()
    out = torch.compile(grad_program, backend="dynbatch", fullgraph=True,
                        options={"dynbatch.inner_compiler": "aot_eager"})(torch.ones(3, requires_grad=True))
    torch.testing.assert_close(out, torch.ones(3).cos())
    assert dynbatch.counters()["graphs"] == 1


def test_version_is_supported():
    """Below the minimum (pyproject.toml's, _compat's) fail.  A torch newer than the tested
    range is allowed on purpose (no upper bound; dynbatch warns at the first compile,
    test_fail_soft): skip with the reason rather than fail."""
    pyproject = (pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert re.search(r'"torch>=([0-9.]+)"', pyproject).group(1) == _compat.MIN_TORCH
    assert _compat.TORCH_VERSION >= _compat.MIN_TORCH, f"torch {_compat.TORCH_VERSION} is below {_compat.MIN_TORCH}"
    if not _compat.torch_is_supported():
        pytest.skip(reason=f"torch {_compat.TORCH_VERSION} is untested (tested: {_compat.MIN_TORCH} up to, not "
                           f"including, {_compat.MAX_TORCH}); supported, with a warning at the first compile")


def test_register_after_the_entry_point_loaded_is_a_no_op():
    """torch 2.14 keeps the entry point in ``_BACKENDS`` after loading it; a second
    registration of the name raised "duplicate name: dynbatch" there."""
    from torch._dynamo.backends.registry import lookup_backend

    loaded = lookup_backend("dynbatch")  # loads the entry point (or finds it loaded)
    dynbatch.register()
    dynbatch.register()
    assert lookup_backend("dynbatch") is loaded


def test_the_readme_example_runs_as_written_and_prints_what_it_says():
    """The README's first Python block, in a fresh process: it runs, and prints the
    counters its last comment shows (a newcomer copies it as it is)."""
    readme = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    example = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    promised = re.search(r"print\(dynbatch\.counters\(\)\)\s*#\s*(\{.*\})", example).group(1)
    proc = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == promised
