"""NOTE [A compile on a chunk's edge] in dynbatch/lowering/frame_stack.py: a loop of calls
made inside ``with_room`` never maps a frame-stack chunk per call, and dynbatch's compiles,
the backward compiled at its first call included, run inside it."""

from __future__ import annotations

import resource
import sys

import pytest
import torch

from conftest import INDUCTOR, assert_backend_ran, assert_same_grads, compile_dynbatch
from dynbatch.lowering import frame_stack

CALLS = 200


def _leaf():
    # Forty slots more than _faults_at's frame: in every chunk, some depth leaves _faults_at
    # room but not the leaf, and each of its calls then opens a chunk.
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = a8 = a9 = b0 = b1 = b2 = b3 = b4 = b5 = b6 = b7 = b8 = b9 = 0  # noqa: F841
    c0 = c1 = c2 = c3 = c4 = c5 = c6 = c7 = c8 = c9 = d0 = d1 = d2 = d3 = d4 = d5 = d6 = d7 = d8 = d9 = 0  # noqa: F841


def _faults_at(depth: int) -> int:
    """Page faults of CALLS calls of the leaf made ``depth`` frames below this one."""
    if depth:
        return _faults_at(depth - 1)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(CALLS):
        _leaf()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def _depths_on_an_edge() -> list[int]:
    """Of 400 depths (over two 16 KiB chunks of _faults_at frames), those where every other
    call of the leaf or more faults."""
    return [depth for depth in range(400) if _faults_at(depth) >= CALLS // 2]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts page faults as Linux does")
def test_a_loop_of_calls_on_a_chunks_edge_faults_at_every_call_but_not_inside_with_room():
    if sys.version_info < (3, 13):  # never fixed there (later 3.13 and 3.14 cache a chunk)
        assert _depths_on_an_edge(), "the interpreter no longer maps a chunk per call at an edge"
    assert frame_stack.with_room(_depths_on_an_edge)() == []


def test_dynbatchs_compiles_run_inside_with_room_the_lazy_backward_too():
    seen = []

    def users_pass(graph):
        seen.append(frame_stack.running())

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
    x = torch.randn(5, 3, dtype=torch.float64)
    compiled = compile_dynbatch(model, options={**INDUCTOR, "post_grad_custom_pre_pass": users_pass})

    compiled(x).sum().backward()
    grads = [p.grad for p in model.parameters()]
    model.zero_grad()
    model(x).sum().backward()

    assert_backend_ran(graphs=1)
    assert_same_grads(grads, [p.grad for p in model.parameters()])
    assert seen == [True, True], seen  # the forward, and the backward compiled at its first call
    assert not frame_stack.running()
