"""The plumbing: how each benchmark column batches a problem's backward.

A problem (problem.py) says what to differentiate; this module turns it into
one callable per column, ``(x, V) -> [B, *x.shape]`` (or ``post`` of that).
The same three programs serve several columns, so the columns differ only in
who runs the program: eager PyTorch, stock Inductor, dynbatch, or JAX.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import types
from typing import Any, Callable

import torch

from .problem import Case, Problem

VARIANTS = ("eager_loop", "eager_batched", "eager_vmap", "eager_vmap_chunked", "stock_compile", "compiled_func",
            "dynbatch", "dynbatch_budget", "dynbatch_cudagraphs", "dynbatch_outside", "dynbatch_outside_vmap",
            "dynbatch_outside_cudagraphs", "jax")
CUDA_ONLY = ("dynbatch_cudagraphs", "dynbatch_outside_cudagraphs")  # left out of the default columns on the CPU
REFERENCE = "eager_batched"  # every ratio in the report is over this column
TRUTH = "eager_loop"  # errors are measured against this column
COMPILED = ("stock_compile", "compiled_func", "dynbatch", "dynbatch_budget", "dynbatch_cudagraphs",
            "dynbatch_outside", "dynbatch_outside_vmap", "dynbatch_outside_cudagraphs", "jax")

# eager_vmap_chunked: torch.func.vmap(..., chunk_size=VMAP_CHUNK) runs this many samples at a time.
VMAP_CHUNK = 32
# dynbatch_budget: the dynbatch.memory_budget option it compiles with, a tight one
# (the batched backward's B-dependent tensors must fit in it, chunked if need be).
TIGHT_BUDGET = 256 * 2 ** 20

DESCRIPTIONS = {
    "eager_loop": "loop of torch.autograd.grad(..., retain_graph=True) over the B cotangents, stacked",
    "eager_batched": "eager torch.autograd.grad(..., is_grads_batched=True) (legacy vmap); the reference for ratios",
    "eager_vmap": "torch.func.vmap over torch.func.vjp, eager",
    "eager_vmap_chunked": f"torch.func.vmap(..., chunk_size={VMAP_CHUNK}) over torch.func.vjp, eager: "
                          f"{VMAP_CHUNK} samples at a time",
    "stock_compile": "stock torch.compile (Inductor) of the is_grads_batched code with "
                     "torch._dynamo.config.trace_autograd_ops=True, in a subprocess with a time limit",
    "compiled_func": "torch.compile (Inductor) of the torch.func vmap/vjp code",
    "dynbatch": 'torch.compile(backend="dynbatch") of the is_grads_batched code',
    "dynbatch_budget": 'torch.compile(backend="dynbatch", options={"dynbatch.memory_budget": '
                       f"{TIGHT_BUDGET}}}) of the is_grads_batched code: a tight budget of "
                       f"{TIGHT_BUDGET / 2 ** 20:g} MiB for the batched backward's B-dependent tensors",
    "dynbatch_cudagraphs": 'torch.compile(backend="dynbatch", mode="reduce-overhead") of the '
                           "is_grads_batched code: replayed as CUDA graphs (CUDA only)",
    "dynbatch_outside": 'torch.compile(backend="dynbatch") of f alone, as an nn.Module whose weights are '
                        "parameters that require grad; the is_grads_batched grad taken outside it, in eager code "
                        "(the region's compiled batched backward)",
    "dynbatch_outside_vmap": "dynbatch_outside with MACE's idiom for the grad outside: torch.vmap over "
                             "torch.autograd.grad(y, x, v, retain_graph=True)",
    "dynbatch_outside_cudagraphs": 'dynbatch_outside with mode="reduce-overhead": the model\'s forward and the '
                                   "region's compiled batched backward replayed as CUDA graphs (CUDA only)",
    "jax": 'JAX jit(vmap(vjp)), jax_default_matmul_precision="highest" to match torch fp32',
}


class VariantUnavailable(RuntimeError):
    """This column cannot run here (e.g. JAX is not installed); the report says why."""


@dataclasses.dataclass
class Runner:
    """One column, ready to run a problem's cases."""

    variant: str
    call: Callable[..., Any]  # call(*prepare(case)) -> result, finished (synchronised by the caller)
    prepare: Callable[[Case], tuple]  # the case's inputs in this runner's framework
    to_torch: Callable[[Any], torch.Tensor]  # the result as a torch tensor, to compare
    compiles: Callable[[], int | None] = lambda: None  # graphs compiled since this runner was built
    note: str = ""
    torch_tensors: bool = True  # its memory lives in torch's allocators (not JAX's)


# --- the three programs -------------------------------------------------------

def _finish(problem: Problem, grads):
    return problem.post(grads) if problem.post is not None else grads


def loop_program(problem: Problem) -> Callable:
    def eager_loop(x, cotangents):
        x = x.detach().requires_grad_()
        y = problem.f(x)
        rows = [torch.autograd.grad(y, x, v, retain_graph=True)[0] for v in cotangents]
        return _finish(problem, torch.stack(rows))

    return eager_loop


def batched_program(problem: Problem) -> Callable:
    if problem.batched_api is not None:
        def batched_api(x, cotangents):
            return _finish(problem, problem.batched_api(x, cotangents))

        return batched_api

    def batched(x, cotangents):
        x = x.detach().requires_grad_()
        y = problem.f(x)
        return _finish(problem, torch.autograd.grad(y, x, cotangents, is_grads_batched=True)[0])

    return batched


def outside_program(problem: Problem, mode: str | None = None, *, vmapped: bool = False) -> Callable:
    """The compiled-model pattern: only ``f`` is compiled; the batched grad is
    eager code around it (dynbatch/region/edge.py batches that backward): ``is_grads_batched``,
    or (``vmapped``) ``torch.vmap`` over a vjp, as MACE takes its Hessian."""
    if problem.batched_api is not None:
        raise VariantUnavailable(f"{problem.name} differentiates through an API that calls f itself")
    compiled_f = torch.compile(with_own_forward(as_module(problem.f)), backend="dynbatch", mode=mode)

    def outside(x, cotangents):
        x = x.detach().requires_grad_()
        y = compiled_f(x)
        if vmapped:
            return _finish(problem, torch.vmap(lambda v: torch.autograd.grad(y, x, v, retain_graph=True)[0])(cotangents))
        return _finish(problem, torch.autograd.grad(y, x, cotangents, is_grads_batched=True)[0])

    return outside


def as_module(f: Callable) -> torch.nn.Module:
    """``f`` as users write a model: the floating-point tensors it closes over (its
    weights, in its closure or its helpers') become parameters that require grad."""
    params: list[torch.nn.Parameter] = []
    lifted: dict[int, Any] = {}

    def lift(value):
        if id(value) in lifted:
            return lifted[id(value)]
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            new = torch.nn.Parameter(value.detach().clone())
            params.append(new)
        elif isinstance(value, (list, tuple)):
            new = type(value)(lift(v) for v in value)
        elif isinstance(value, types.FunctionType) and value.__closure__:
            cells = tuple(types.CellType(lift(c.cell_contents)) for c in value.__closure__)
            new = types.FunctionType(value.__code__, value.__globals__, value.__name__, value.__defaults__, cells)
        else:
            new = value
        lifted[id(value)] = new
        return new

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.f = lift(f)
            self.weights = torch.nn.ParameterList(params)

        def forward(self, x):
            return self.f(x)

    return Model()


def vmap_program(problem: Problem, chunk_size: int | None = None) -> Callable:
    def vmapped(x, cotangents):
        _, vjp_fn = torch.func.vjp(problem.func_f, x)
        return _finish(problem, torch.func.vmap(vjp_fn, chunk_size=chunk_size)(cotangents)[0])

    return vmapped


def samples_held(variant: str, batch: int) -> int:
    """How many of a case's B samples a column's backward holds at once, by its design
    (dynbatch's columns: all B, bounded in bytes by memory_budget)."""
    if variant == "eager_loop":
        return 1
    if variant == "eager_vmap_chunked":
        return min(batch, VMAP_CHUNK)
    return batch


def memory_budget(variant: str, device: torch.device) -> int | None:
    """The bytes dynbatch's plan lets a column's batched backwards hold (None: no bound)."""
    import dynbatch.planning.memory

    if variant in ("dynbatch", "dynbatch_outside", "dynbatch_outside_vmap", "dynbatch_outside_cudagraphs"):
        return dynbatch.planning.memory.resolve_budget("auto", [torch.zeros(1, device=device)])
    if variant == "dynbatch_budget":
        return dynbatch.options.parse_memory_budget(TIGHT_BUDGET)
    return None


def chunked(fn: Callable, chunk: int | None, concat: Callable) -> Callable:
    """Call ``fn`` on ``chunk`` cotangents at a time; the last chunk may be smaller."""
    if not chunk:
        return fn

    def run(x, cotangents):
        return concat([fn(x, cotangents[i:i + chunk]) for i in range(0, cotangents.shape[0], chunk)])

    return run


# --- building a column --------------------------------------------------------

def _graph_counter() -> Callable[[], int]:
    """Graphs Dynamo compiled (any backend) since this call."""
    from torch._dynamo.utils import counters

    start = counters["stats"]["unique_graphs"]
    return lambda: counters["stats"]["unique_graphs"] - start


def _torch_runner(variant: str, problem: Problem, program: Callable, compiled: bool = False) -> Runner:
    if problem.chunk and problem.post is not None:
        raise ValueError(f"{problem.name}: chunk and post together are not supported")
    return Runner(
        variant=variant,
        call=chunked(program, problem.chunk, torch.cat),
        prepare=lambda case: (case.x, case.cotangents),
        to_torch=lambda r: r,
        compiles=_graph_counter() if compiled else (lambda: None),
    )


def build(variant: str, problem: Problem, device: torch.device) -> Runner:
    """The runner of one column for one problem (compiled lazily, on first call)."""
    if variant == "eager_loop":
        return _torch_runner(variant, problem, loop_program(problem))
    if variant == "eager_batched":
        return _torch_runner(variant, problem, batched_program(problem))
    if variant == "eager_vmap":
        return _torch_runner(variant, problem, vmap_program(problem))
    if variant == "eager_vmap_chunked":
        return _torch_runner(variant, problem, vmap_program(problem, chunk_size=VMAP_CHUNK))
    if variant == "stock_compile":
        # Only ever built in the stock subprocess (stock.py), which sets
        # torch._dynamo.config.trace_autograd_ops=True for its whole process.
        return _torch_runner(variant, problem, torch.compile(with_own_code(batched_program(problem))),
                             compiled=True)
    if variant == "compiled_func":
        return _torch_runner(variant, problem, torch.compile(with_own_code(vmap_program(problem))),
                             compiled=True)
    if variant == "dynbatch":
        return dynbatch_runner(variant, problem)
    if variant == "dynbatch_budget":
        return dynbatch_runner(variant, problem, {"dynbatch.memory_budget": TIGHT_BUDGET})
    if variant == "dynbatch_cudagraphs":
        return _cudagraphs_runner(problem, device)
    if variant == "dynbatch_outside":
        return _torch_runner(variant, problem, outside_program(problem), compiled=True)
    if variant == "dynbatch_outside_vmap":
        return _torch_runner(variant, problem, outside_program(problem, vmapped=True), compiled=True)
    if variant == "dynbatch_outside_cudagraphs":
        if device.type != "cuda":
            raise VariantUnavailable("CUDA graphs need --device cuda")
        return replayed_steps(_torch_runner(variant, problem, outside_program(problem, "reduce-overhead"),
                                            compiled=True))
    if variant == "jax":
        return _jax_runner(problem, device)
    raise KeyError(f"unknown variant {variant!r}; choose from {VARIANTS}")


def dynbatch_runner(variant: str, problem: Problem, options: dict[str, Any] | None = None) -> Runner:
    """``torch.compile(backend="dynbatch", options=options)`` of the batched program, with a
    code object of its own (NOTE [A code object per compiled column])."""
    program = with_own_code(batched_program(problem))
    return _torch_runner(variant, problem, torch.compile(program, backend="dynbatch", options=options),
                         compiled=True)


_OWN_CODE = itertools.count()


# NOTE [A code object per compiled column]
# Dynamo keeps its cache, its recompile limit and its record of which sizes changed
# (automatic dynamic) per code object.  Two columns that compile the same function (or
# two instances of one model class) share them: the second column's compile is a
# recompile of the first's frame (MACE: "[0/1] ... guard failure: ___check_type_id"),
# a call may check the other column's guards before its own, and one column's second
# size makes the other's graphs dynamic.  So every compiled column compiles a
# function, or a module's forward, with a code object of its own.

def with_own_code(fn: Callable) -> Callable:
    """``fn`` with a code object of its own (a new name): NOTE [A code object per compiled column]."""
    own = types.FunctionType(fn.__code__.replace(co_name=f"{fn.__name__}_{next(_OWN_CODE)}"),
                             fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    own.__kwdefaults__ = fn.__kwdefaults__
    return own


def with_own_forward(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` as an instance of a subclass whose forward has a code object of its own
    (NOTE [A code object per compiled column])."""
    cls = type(module)
    module.__class__ = type(cls.__name__, (cls,), {"forward": with_own_code(cls.forward)})
    return module


def _cudagraphs_runner(problem: Problem, device: torch.device) -> Runner:
    if device.type != "cuda":
        raise VariantUnavailable("CUDA graphs need --device cuda")
    compiled = torch.compile(with_own_code(batched_program(problem)), backend="dynbatch", mode="reduce-overhead")
    return replayed_steps(_torch_runner("dynbatch_cudagraphs", problem, compiled, compiled=True))


def replayed_steps(runner: Runner) -> Runner:
    """A CUDA-graph column's calls, each a new step of the loop: the last call's outputs
    may be overwritten, so the result compared with the reference is a copy."""
    call, to_torch = runner.call, runner.to_torch

    def replay(*args):
        torch.compiler.cudagraph_mark_step_begin()
        return call(*args)

    return dataclasses.replace(runner, call=replay, to_torch=lambda r: to_torch(r).clone())


def _jax_runner(problem: Problem, device: torch.device) -> Runner:
    # JAX would otherwise take 75% of the GPU up front, starving torch in this process.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    try:
        import jax
        import jax.numpy as jnp
        import numpy as np
    except ImportError as e:
        raise VariantUnavailable(f"jax not installed ({e.name}); pip install 'dynbatch[jax]'") from None
    if problem.jax_f is None:
        raise VariantUnavailable(f"{problem.name} has no JAX version")
    platform = "gpu" if device.type == "cuda" else "cpu"
    try:
        jax_device = _jax_devices(jax, platform, one_core=platform == "cpu" and torch.get_num_threads() == 1)[0]
    except RuntimeError as e:
        raise VariantUnavailable(f"jax has no {platform} device: {e}") from None
    jax.config.update("jax_default_matmul_precision", "highest")
    with jax.default_device(jax_device):
        f = problem.jax_f()
    post = problem.post

    @jax.jit
    def vjps(x, cotangents):
        _, vjp_fn = jax.vjp(f, x)
        grads = jax.vmap(vjp_fn)(cotangents)[0]
        return post(grads) if post is not None else grads

    run = chunked(vjps, problem.chunk, jnp.concatenate)

    def to_jax(t: torch.Tensor):
        return jax.device_put(t.detach().cpu().numpy(), jax_device)

    return Runner(
        variant="jax",
        call=lambda x, v: run(x, v).block_until_ready(),
        prepare=lambda case: (to_jax(case.x), to_jax(case.cotangents)),
        to_torch=lambda r: torch.from_numpy(np.asarray(r)).to(device),
        compiles=lambda: vjps._cache_size(),
        note=f"jax {jax.__version__} on {jax_device}",
        torch_tensors=False,
    )


def _jax_devices(jax, platform: str, one_core: bool):
    """``jax.devices(platform)``; with ``one_core``, XLA's CPU thread pool gets one core.

    XLA sizes its pool from the cores it may run on and ignores torch's thread
    count.  Its pool threads are created when the CPU client starts, here, and
    inherit this thread's affinity; the caller's affinity is restored after.
    """
    if not one_core or not hasattr(os, "sched_setaffinity"):
        return jax.devices(platform)
    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(saved)})
    try:
        return jax.devices(platform)
    finally:
        os.sched_setaffinity(0, saved)
