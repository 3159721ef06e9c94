"""``python -m dynbatch.bench overhead``: where a small batched grad's time goes.

    python -m dynbatch.bench overhead --threads 1                     # the sweep, B = 1, 4, 16
    python -m dynbatch.bench overhead --device cuda --batch-sizes 1,4,16
    python -m dynbatch.bench overhead --workloads hessian,attention --variants dynbatch,jax

Per case of each problem, the columns (the benchmark's, built by variants.py) are
first called in the benchmark's order, so the graphs timed are the ones the
benchmark times; then, in one process and interleaved (measure.interleaved_times):

- ``whole``: the column's call;
- ``stack`` (columns compiled by dynbatch): the same call with every region's
  program replaced by one that returns its last result at once
  (``Region.program_replaced``): Dynamo's frame, its guards, the bytecode
  around the graph and dynbatch's region, what a call of any torch.compile
  backend pays before its program runs; where the programs return tensors that
  require grad (``dynbatch_outside``), each whole call less its programs' time
  (NOTE [A stack under differentiable outputs]);
- ``program`` (the same columns): the regions' compiled programs (AOTAutograd's
  and Inductor's wrappers and the kernels), timed inside the whole calls; for
  ``dynbatch_outside``, every Inductor program the call runs, the batched
  backward's included;
- ``kernels``: on CUDA, the device time of the kernels a call launches and their
  count (torch's profiler, the median over a few calls); on the CPU, the matrix
  products a call runs (the outermost ``mm``, ``bmm``, ``addmm`` and oneDNN
  linear calls the profiler records, which Inductor's program calls out to),
  each replayed alone and warm by the fastest torch kernel for its shapes (ATen's
  with either operand layout, or oneDNN's linear): stack + products is the time
  the call would take if everything else in its program (pointwise kernels,
  allocations, Inductor's wrapper) took none.  JAX's calls are outside torch's
  profiler.

Medians in microseconds; the timers around a program add well under a
microsecond to its whole call.  On a shared CPU use ``--threads 1`` (docs/benchmarks.md).

Beside a ``jax`` column, each compiled CPU column's stack + products is put over JAX's call
(NOTE [What a call costs at the least]).  With ``dynbatch_outside`` among the columns, a
second table splits each of its calls by phase, beside ``dynbatch``'s (outside_phases.py):
the compiled model's forward, torch's grad machinery, dynbatch's backward and the programs
it runs.  ``--out FILE.json`` keeps both tables for ``report`` (parts ``overhead`` and
``outside``).

``--workloads force_training`` splits a training step instead (training.py's columns,
timed interleaved per case): ``whole``, the step; ``programs``, the time inside every
compiled Inductor program the step runs (forward and backward, timed inside the call:
kernels, products and Inductor's wrapper); ``rest``, the difference (Dynamo's frames,
AOTAutograd's runtime, dynbatch's region, the autograd engine, the loss in eager ops);
and both as multiples of the compiled step's.  A column's programs against the step's
are what compiling only the model costs with every call around them free.  On CUDA
``programs`` is host time (the kernels run asynchronously; ``whole`` synchronises).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

import dynbatch

from dynbatch.cpu import matmul_kernels

from . import cli, measure, runner, training, variants
from .measure import fmt_us, median_us
from .outside_phases import PHASE_HEADER, OutsideSplit, phase_summary, phase_text
from .workloads import WORKLOADS

# The default columns: the compiled ones a small call is compared across.
COLUMNS = ("compiled_func", "dynbatch", "dynbatch_cudagraphs", "jax")
# The CPU's kernel figure: matrix products, by the names the profiler records.
PRODUCTS = frozenset({"aten::mm", "aten::bmm", "aten::addmm", "mkldnn::_linear_pointwise"})
PROFILED_CALLS = 10  # CUDA: calls profiled for the kernels' figure
REPLAY_BUDGET = measure.Budget(min_time_s=0.05, min_reps=20, max_reps=300)  # CPU: a product replayed alone


def parse_args(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="dynbatch-bench overhead",
        description="Per-call overhead of the benchmark's columns: each call's time beside the time of "
                    "Dynamo's frame, guards and dynbatch's region without the program, the compiled "
                    "program's, and the kernels'.")
    cli.add_problem_flags(parser, [*WORKLOADS, *training.WORKLOADS], default_workloads=("sweep",))
    parser.add_argument("--variants", type=lambda t: cli.names(t, [v for v in variants.VARIANTS
                                                                  if v != "stock_compile"], "variant(s)"),
                        default=None, help=f"comma list of columns, default {','.join(COLUMNS)} "
                                           f"(less {','.join(variants.CUDA_ONLY)} on the CPU)")
    parser.add_argument("--out", type=Path, default=None,
                        help="also write dynbatch_outside's phases and the run's provenance to this JSON file "
                             "(python -m dynbatch.bench report shows it as a table: part 'outside')")
    parser.add_argument("--top", type=int, default=0,
                        help="after each case, each column's N costliest kernels in one profiled call "
                             "(CUDA: by device time; CPU: ops by their own CPU time)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    cli.use_threads(args)
    device = cli.device(args)
    columns = args.variants or tuple(c for c in COLUMNS if device.type == "cuda" or c not in variants.CUDA_ONLY)
    if device.type == "cuda":
        # Full fp32 matmuls, as the benchmark runs them.
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    warnings.filterwarnings("ignore")  # legacy vmap's per-op "performance drop" warnings
    dynbatch.register()
    kernels = "kernels" if device.type == "cuda" else "products"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"torch {torch.__version__} on {name}, {torch.get_num_threads()} threads; medians in us")
    batched = [w for w in args.workloads if w not in training.WORKLOADS]
    if batched:
        print("| " + " | ".join(header(kernels)) + " |")
        print("|" + "---|" * len(header(kernels)), flush=True)
        rows: list[dict[str, Any]] = []
        phases: list[dict[str, Any]] = []
        meta = {**runner.machine_meta(device), "cold_compile_cache": runner.compile_cache_empty(),
                "timing": "interleaved", "budget": vars(cli.budget(args))}
        for problem in cli.problems(argparse.Namespace(**{**vars(args), "workloads": batched})):
            for row in measure_problem(problem, columns, device, cli.budget(args), args.top, phases):
                print("| " + " | ".join(row_text(row)) + " |", flush=True)
                if "top" not in row:
                    rows.append(row)
        for line in floor_summary(rows):  # NOTE [What a call costs at the least]
            print(line)
        if phases:  # NOTE [An outside call, phase by phase]
            print()
            print("| " + " | ".join(PHASE_HEADER) + " |")
            print("|" + "---|" * len(PHASE_HEADER))
            for row in phases:
                print("| " + " | ".join(phase_text(row)) + " |", flush=True)
            for line in phase_summary(phases):
                print(line)
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"meta": meta, "problems": [], "overhead": rows,
                                            "outside_phases": phases}, indent=1, default=str) + "\n")
            print(f"json: {args.out}")
    for name in (w for w in args.workloads if w in training.WORKLOADS):
        print("| problem | case | column | whole us | programs us | rest us | programs / step's | whole / step's |")
        print("|---|---|---|---|---|---|---|---|", flush=True)
        for problem in training.WORKLOADS[name](cli.tier(args), device, args.atoms):
            for row in measure_training_problem(problem, device, cli.budget(args)):
                print("| " + " | ".join(row) + " |", flush=True)
    return 0


TRAINING_COLUMNS = ("eager", *training.DYNBATCH_COLUMNS, "stock_energy_only")


def _stock_energy_only(problem, device: torch.device) -> Callable[..., Any]:
    """A reference for ``rest``: stock ``torch.compile(model)`` (Inductor) in a step whose
    loss has the energy term only (stock cannot take the forces' double backward), so its
    ``rest`` is what any compiled model's forward and backward cost around their programs."""
    model = problem.make_model()
    compiled = torch.compile(model)
    params = list(model.parameters())

    def call(pos, *rest):
        *graph, e_ref, _ = rest
        for p in params:
            p.grad = None
        ((compiled(pos.detach().requires_grad_(), *graph) - e_ref) ** 2).backward()
        return torch.cat([p.grad.reshape(-1) for p in params])

    return call


def measure_training_problem(problem, device: torch.device, budget: measure.Budget) -> Iterator[list[str]]:
    """Per case, a row per training column: the step, and the share of it inside compiled programs."""
    torch._dynamo.reset()
    sync = measure.synchronizer(device)
    timer = ProgramTimer()
    for case in problem.cases:
        calls: dict[str, Callable[[], Any]] = {}
        for column in TRAINING_COLUMNS:
            args = (*case.inputs, case.e_ref, case.f_ref)
            if column == "stock_energy_only":
                call = functools.partial(_stock_energy_only(problem, device), *args)
            else:
                runner = training.build(column, problem, device, name=f"{column}/{case.label}")
                call = functools.partial(runner.call, *runner.prepare(case))
            call()  # compile, and the second step's path (grads at forward time)
            call()
            sync()
            calls[column] = timer.timed(column, call, sync)
        with timer.installed():
            timed = measure.interleaved_times(calls, sync, budget)
        whole = {c: median_us(timed[c]["times_s"]) for c in calls}
        # Medians of each call's own split: a median of wholes less a median of programs
        # can go negative on a noisy machine.
        programs = {c: median_us([p for _, p in timer.calls[c]]) if timer.calls.get(c) else None for c in calls}
        rest = {c: median_us([w - p for w, p in timer.calls[c]]) if timer.calls.get(c) else None for c in calls}
        step, step_programs = whole["dynbatch_step"], programs["dynbatch_step"]
        for column in calls:
            p = programs[column]
            yield [problem.name, case.label, column, fmt_us(whole[column]), fmt_us(p), fmt_us(rest[column]),
                   "–" if p is None or not step_programs else f"×{p / step_programs:.2f}",
                   f"×{whole[column] / step:.2f}"]
        timer.calls.clear()


class ProgramTimer:
    """Each call's seconds, whole and inside Inductor's compiled programs
    (``CompiledFxGraph.__call__``: the generated wrapper, its kernels and products), by
    column, while installed."""

    def __init__(self) -> None:
        self.calls: dict[str, list[tuple[float, float]]] = {}  # (whole, in programs) per call
        self._in_call: float | None = None

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        from torch._inductor.output_code import CompiledFxGraph

        real = CompiledFxGraph.__call__

        def timed_call(graph, inputs):
            if self._in_call is None:
                return real(graph, inputs)
            start = time.perf_counter()
            try:
                return real(graph, inputs)
            finally:
                self._in_call += time.perf_counter() - start

        CompiledFxGraph.__call__ = timed_call
        try:
            yield
        finally:
            CompiledFxGraph.__call__ = real

    def timed(self, column: str, call: Callable[[], Any], sync: Callable[[], None]) -> Callable[[], Any]:
        """``call``, its programs' seconds recorded under ``column`` (none: not compiled)."""
        def run():
            self._in_call = 0.0
            start = time.perf_counter()
            try:
                result = call()
                sync()
            finally:
                whole, spent, self._in_call = time.perf_counter() - start, self._in_call, None
            if spent:
                self.calls.setdefault(column, []).append((whole, spent))
            return result

        return run


def measure_problem(problem, columns, device: torch.device, budget: measure.Budget,
                    top: int = 0, phases: list[dict[str, Any]] | None = None) -> Iterator[list[str]]:
    """One row of figures per case and column (as text), the columns timed interleaved per
    case; with ``top``, then a row per column's costliest kernel (``top_kernels``); with
    ``phases``, a row per case of ``dynbatch_outside`` appended to it (``OutsideSplit``)."""
    torch._dynamo.reset()  # the columns' programs share code objects across problems
    sync = measure.synchronizer(device)
    built: dict[str, tuple[variants.Runner, list[tuple], Programs]] = {}
    skipped: dict[str, str] = {}
    for column in columns:
        dynbatch.reset()  # the compile records from here on are this column's
        try:
            runner = variants.build(column, problem, device)
            inputs = [runner.prepare(case) for case in problem.cases]
            for args in inputs:  # every case once, in order: the benchmark's graphs
                runner.call(*args)
                sync()
        except variants.VariantUnavailable as e:
            skipped[column] = f"skipped: {e}"
            continue
        except Exception as e:  # noqa: BLE001 - a crashing column is a row, not the end
            skipped[column] = f"crashed: {measure.short_error(e)}"
            continue
        regions = [r.region() for r in dynbatch.compile_records() if r.region is not None and not r.chunk_program]
        built[column] = (runner, inputs, Programs([r for r in regions if r is not None]))
    split = OutsideSplit() if phases is not None and OUTSIDE in built else None
    with contextlib.ExitStack() as installed:
        for _, _, programs in built.values():
            installed.enter_context(programs.installed())
        if split is not None:  # its timers wrap the programs' (NOTE [An outside call, phase by phase])
            installed.enter_context(split.installed())
        for i, case in enumerate(problem.cases):
            calls: dict[str, Callable[[], Any]] = {}
            for column, (runner, inputs, programs) in built.items():
                calls[column] = programs.whole(functools.partial(runner.call, *inputs[i]))
                if split is not None and column == OUTSIDE:
                    calls[column] = split.whole(calls[column])
                if programs.regions:
                    calls[column]()  # this case's results, for its stack calls
                    sync()
                    if not programs.differentiable:
                        calls[f"{column} stack"] = programs.stack(functools.partial(runner.call, *inputs[i]))
            timed = measure.interleaved_times(calls, sync, budget) if calls else {}
            case_rows = []
            for column in columns:
                row = {"problem": problem.name, "case": case.label, "column": column}
                if column in skipped:
                    case_rows.append({**row, "status": skipped[column]})
                    continue
                runner, _, programs = built[column]
                spent, rest = programs.split()
                # Only a stack timed with its programs replaced is a frame alone (a floor's part).
                frame_alone = f"{column} stack" in timed
                if frame_alone:
                    stack = median_us(timed[f"{column} stack"]["times_s"])
                else:  # NOTE [A stack under differentiable outputs]
                    stack = median_us(rest) if programs.regions else None
                kernel_s, launched = (kernels_per_call(calls[column], sync, device) if runner.torch_tensors
                                      else (None, None))
                case_rows.append({**row, "status": "ok", "whole_us": median_us(timed[column]["times_s"]),
                                  "stack_us": stack, "program_us": median_us(spent) if programs.regions else None,
                                  "kernels_us": None if kernel_s is None else kernel_s * 1e6,
                                  "kernels_per_call": launched, "device": device.type,
                                  "stack_is_frame": frame_alone})
                programs.clear()
            yield from with_floors(case_rows)
            if split is not None:
                inside = median_us(timed["dynbatch"]["times_s"]) if "dynbatch" in timed else None
                phases.append(split.row(problem.name, case.label, inside))
                split.calls.clear()
            for column in (c for c in columns if top and c in built and built[c][0].torch_tensors):
                for kernel, us, count in top_kernels(calls[column], sync, device, top):
                    yield {"problem": problem.name, "case": case.label, "column": f"{column}: {kernel}",
                           "top": True, "kernels_us": us, "kernels_per_call": count}


OUTSIDE = "dynbatch_outside"


# NOTE [What a call costs at the least]
# On the CPU, ``stack`` (Dynamo's frame, its guards, the region and AOTAutograd's wrappers,
# with no program) plus ``products`` (the call's matrix products, each replayed alone by
# the fastest torch kernel for its shapes) is what the call would take if everything else
# its program does -- pointwise kernels, allocations, Inductor's wrapper -- took no time:
# torch's own floor for that graph.  Beside a JAX column that ran the same case, ``floor /
# jax`` says whether any program Inductor could write would reach JAX's call: at 1 or more,
# the products and the frame alone take as long as JAX's whole call.  Drawn only where the
# stack was timed with the programs replaced (not under differentiable outputs, whose
# "stack" holds the backward's plumbing too), and not on CUDA, where ``kernels`` is device
# time that overlaps the host's stack.
JAX = "jax"


def header(kernels: str = "products") -> tuple[str, ...]:
    return ("problem", "case", "column", "whole us", "stack us", "program us", f"{kernels} us",
            f"{kernels}/call", "stack + products / jax")


def with_floors(case_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One case's rows, each compiled CPU column's with its floor over JAX's call where
    JAX ran beside (NOTE [What a call costs at the least])."""
    jax = next((r["whole_us"] for r in case_rows if r["column"] == JAX and r["status"] == "ok"), None)
    for row in case_rows:
        floor = _floor_us(row)
        row["floor_over_jax"] = None if floor is None or not jax else floor / jax
    return case_rows


def _floor_us(row: dict[str, Any]) -> float | None:
    if row.get("device") != "cpu" or not row.get("stack_is_frame") or row.get("kernels_us") is None:
        return None
    return row["stack_us"] + row["kernels_us"]


def row_text(row: dict[str, Any]) -> list[str]:
    """A row of the per-call table as printed (and as ``report`` shows ``--out``'s rows)."""
    first = [row["problem"], row["case"], row["column"]]
    if row.get("top"):
        return [*first, "", "", "", fmt_us(row["kernels_us"]), str(row["kernels_per_call"]), ""]
    if row["status"] != "ok":
        return [*first, row["status"], "", "", "", "", ""]
    launched, floor = row["kernels_per_call"], row.get("floor_over_jax")
    return [*first, *(fmt_us(row[k]) for k in ("whole_us", "stack_us", "program_us", "kernels_us")),
            "–" if launched is None else str(launched), "–" if floor is None else f"×{floor:.2f}"]


NEAR_FLOOR = 0.8  # a floor this close to JAX's call leaves the rest of the program no room


def floor_summary(rows: list[dict[str, Any]]) -> list[str]:
    """Per compiled column beside JAX: the cases whose floor alone takes most of JAX's call."""
    lines = []
    for column in dict.fromkeys(r["column"] for r in rows if r.get("floor_over_jax") is not None):
        floors = [r for r in rows if r["column"] == column and r.get("floor_over_jax") is not None]
        near = [r for r in floors if r["floor_over_jax"] >= NEAR_FLOOR]
        listed = "".join(f"; {r['problem']} {r['case']} ×{r['floor_over_jax']:.2f}" for r in near)
        lines.append(f"{column}: stack + products alone take {NEAR_FLOOR:g} of JAX's whole call or more in "
                     f"{len(near)} of {len(floors)} cases{listed} (NOTE [What a call costs at the least] in "
                     "dynbatch/bench/overhead.py).")
    return lines


# NOTE [A stack under differentiable outputs]
# A region whose outputs require grad (``dynbatch_outside``: the caller differentiates
# them after the call) cannot return a precomputed result: autograd's graph of that
# result belongs to an earlier call, and the caller's grad finds its inputs unused.
# There the stack is measured per whole call instead: the call's seconds less its
# programs' seconds (median over calls), the same split without a second kind of call.
# Such a call also runs programs that are not its regions': the batched backward the
# caller's grad reaches (from the saved activations, or the recompute path's program),
# so there "program" is the time in every outermost Inductor program the call runs
# (``CompiledFxGraph.__call__``), and the stack is what is left: Dynamo's frame,
# AOTAutograd's wrappers, the autograd engine, legacy vmap and dynbatch's plumbing.

class Programs:
    """The compiled programs of one column's regions while it is measured: each runs
    the real program, timed (``whole`` calls), or returns that program's last result
    at once (``stack`` calls)."""

    def __init__(self, regions: list) -> None:
        self.regions = regions
        self.precomputed = False
        self.differentiable = False  # a program returned a tensor that requires grad
        self.spent: list[float] = []  # seconds in the programs, per whole call
        self.wholes: list[float] = []  # seconds of each whole call, beside spent
        self.in_inductor: list[float] = []  # seconds in outermost Inductor programs, per whole call
        self.inductor_runs: list[int] = []  # how many ran, per whole call
        self._in_call = 0.0
        self._in_inductor = 0.0
        self._runs = 0
        self._timing = False  # inside one of this column's whole calls
        self._depth = 0  # Inductor programs running (a chunked program calls others)
        self._results: dict[int, Any] = {}

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        from torch._inductor.output_code import CompiledFxGraph

        real = CompiledFxGraph.__call__

        def timed_call(graph, inputs):
            if not self._timing or self._depth:
                return real(graph, inputs)
            self._depth += 1
            self._runs += 1
            start = time.perf_counter()
            try:
                return real(graph, inputs)
            finally:
                self._in_inductor += time.perf_counter() - start
                self._depth -= 1

        CompiledFxGraph.__call__ = timed_call
        try:
            with contextlib.ExitStack() as stack:
                for region in self.regions:
                    stack.enter_context(region.program_replaced(self._program(region.compiled, id(region))))
                yield
        finally:
            CompiledFxGraph.__call__ = real

    def split(self) -> tuple[list[float], list[float]]:
        """Per whole call: (seconds in programs, seconds in the stack) (NOTE [A stack under
        differentiable outputs] for what each holds where the outputs require grad)."""
        spent = self.in_inductor if self.differentiable else self.spent
        return spent, [w - p for w, p in zip(self.wholes, spent)]

    def clear(self) -> None:
        self.spent.clear()
        self.wholes.clear()
        self.in_inductor.clear()
        self.inductor_runs.clear()

    def _program(self, real: Callable[..., Any], key: int) -> Callable[..., Any]:
        def program(*args):
            if self.precomputed:
                return self._results[key]
            start = time.perf_counter()
            result = real(*args)
            self._in_call += time.perf_counter() - start
            self._results[key] = result
            self.differentiable = self.differentiable or any(
                isinstance(r, torch.Tensor) and r.requires_grad for r in result)
            return result

        return program

    def whole(self, call: Callable[[], Any]) -> Callable[[], Any]:
        def run():
            self.precomputed, self._in_call, self._in_inductor, self._runs = False, 0.0, 0.0, 0
            self._timing = True
            start = time.perf_counter()
            try:
                result = call()
            finally:
                self._timing = False
            if self.regions:
                self.wholes.append(time.perf_counter() - start)
                self.spent.append(self._in_call)
                self.in_inductor.append(self._in_inductor)
                self.inductor_runs.append(self._runs)
            return result

        return run

    def stack(self, call: Callable[[], Any]) -> Callable[[], Any]:
        def run():
            self.precomputed = True
            return call()

        return run


def kernels_per_call(call: Callable[[], Any], sync: Callable[[], None], device: torch.device) -> tuple[float, int]:
    """(seconds, count) per call: on CUDA of the kernels launched, the median over calls
    profiled one by one; on the CPU of the matrix products, each replayed alone by the
    fastest torch kernel for its shapes (``fastest_product_s``)."""
    from torch.profiler import ProfilerActivity, profile

    if device.type != "cuda":
        products = recorded_products(call)
        return sum(fastest_product_s(op, shapes) for op, shapes in products), len(products)
    seconds, counts = [], []
    for _ in range(PROFILED_CALLS):
        sync()
        with measure.quiet_stderr(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            call()
            sync()
        events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        seconds.append(sum(e.device_time for e in events) / 1e6)
        counts.append(len(events))
    return statistics.median(seconds), int(statistics.median(counts))


def top_kernels(call: Callable[[], Any], sync: Callable[[], None], device: torch.device,
                n: int) -> list[tuple[str, float, int]]:
    """(name, us, launches) of the ``n`` costliest kernels of one warm call, by name: on
    CUDA by device time, on the CPU by each op's own CPU time.  Where two columns run
    the same graph at different speeds, this says which kernel differs."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync()
    with measure.quiet_stderr(), profile(activities=activities) as prof:
        call()
        sync()
    totals: dict[str, list[float]] = {}
    for e in prof.events():
        on_device = e.device_type == torch.autograd.DeviceType.CUDA
        if on_device != (device.type == "cuda"):
            continue
        spent = e.device_time if on_device else e.self_cpu_time_total
        entry = totals.setdefault(e.name, [0.0, 0])
        entry[0], entry[1] = entry[0] + spent, entry[1] + 1
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])[:n]
    return [(name[:90], us, count) for name, (us, count) in ranked]


def recorded_products(call: Callable[[], Any]) -> list[tuple[str, tuple]]:
    """(op, input shapes) of every matrix product one call runs, outermost only."""
    from torch.profiler import ProfilerActivity, profile

    with measure.quiet_stderr(), profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        call()
    return [(e.name, tuple(tuple(s) for s in e.input_shapes)) for e in prof.events()
            if e.name in PRODUCTS and not (e.cpu_parent is not None and e.cpu_parent.name in PRODUCTS)]


@functools.cache
def fastest_product_s(op: str, shapes: tuple) -> float:
    """Seconds of one float32 CPU product of these shapes by the fastest torch kernel for it,
    warm: ATen's with either layout of the second operand, or oneDNN's linear."""
    if op == "aten::bmm":
        (b, m, k), (_, _, n) = shapes[:2]
        x, y = torch.randn(b, m, k), torch.randn(b, k, n)
        y_t = y.mT.contiguous().mT
        kernels = [lambda: torch.bmm(x, y), lambda: torch.bmm(x, y_t)]
    else:
        if op == "aten::addmm":
            shapes = shapes[1:]
        (m, k), n = shapes[0], shapes[1][0] if op == "mkldnn::_linear_pointwise" else shapes[1][1]
        a, w = torch.randn(m, k), torch.randn(n, k)
        w_t = w.t().contiguous()
        kernels = [lambda: torch.mm(a, w_t), *(
            lambda kernel=kernel: kernel(a, w.t()) for name, kernel in matmul_kernels.KERNELS.items()
            if matmul_kernels.available(name))]
    return min(statistics.median(measure.steady_times(kernel, lambda: None, REPLAY_BUDGET)) for kernel in kernels)
