"""Running the benchmark: every column on every case of every problem, one process.

Order inside a problem: the floor, then the columns in ``VARIANTS`` order,
``eager_loop`` first (the reference every error is measured against); the
stock column runs in its subprocess while this process waits, so the two
never share the CPU.  ``torch._dynamo.reset()`` runs before each
problem: the columns' programs share code objects across problems, and
Dynamo's cache (and its recompile limit) is per code object.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import gc
import os
import platform
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch
from tqdm import tqdm

import dynbatch

from . import mace_workload, measure, stock, training, variants, workloads


@dataclasses.dataclass(frozen=True)
class Settings:
    device: torch.device
    tier: str
    workloads: tuple[str, ...]
    variants: tuple[str, ...]
    batch_sizes: tuple[int, ...] | None
    budget: measure.Budget
    stock_timeout_s: float
    cold_compile_cache: bool = True
    progress: bool = True
    threads: int | None = None  # torch intra-op threads, here and in the stock worker; None: torch's default
    # column -> the workloads it runs on (a column not named runs on every one); its
    # other cells say "skipped".
    column_workloads: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    # Start the stock worker in the background (its import then overlaps the first timings).
    overlap_stock_start: bool = False
    atoms: tuple[int, ...] | None = None  # replaces the tier's atom counts of workloads.ATOM_WORKLOADS
    # Time a case's in-process columns and its floor interleaved, after every column's
    # first call (measure.interleaved_times); False: each column alone, as it runs.
    interleave: bool = True
    # The column every error is measured against (--single-call: the first to run, where
    # eager_loop does not).
    reference: str = variants.TRUTH

    def runs(self, column: str, workload: str) -> bool:
        chosen = self.column_workloads.get(column)
        return chosen is None or workload in chosen


def run(settings: Settings, on_problem: Callable[[dict[str, Any]], None] = lambda results: None) -> dict[str, Any]:
    """Measure everything; return the results as plain JSON-able data.

    ``on_problem(results)`` runs after each problem, so a long run can save what it has.
    """
    warnings.filterwarnings("ignore")  # legacy vmap's per-op "performance drop" warnings
    if settings.threads:
        torch.set_num_threads(settings.threads)
    if settings.device.type == "cuda":
        # Full fp32 matmuls and convolutions, as the CPU and JAX's "highest" precision compute.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    with _compile_caches(settings.cold_compile_cache):
        dynbatch.register()
        results = {"meta": _meta(settings), "problems": []}
        stock_column = (stock.StockColumn(settings.stock_timeout_s, settings.threads)
                        if "stock_compile" in settings.variants
                        and any(w in workloads.WORKLOADS and settings.runs("stock_compile", w)
                                for w in settings.workloads) else None)
        bar = tqdm(total=0, unit="cell", disable=not settings.progress, dynamic_ncols=True, file=sys.stderr)
        try:
            if stock_column is not None:
                bar.set_description("starting the stock-compile worker")
                stock_column.start(wait=not settings.overlap_stock_start)
            for i, name in enumerate(settings.workloads):
                if name in training.WORKLOADS:  # columns of its own: a training step, not a batched grad
                    results.setdefault("training", []).extend(training.run(name, settings, bar))
                    on_problem(results)
                    continue
                if name in mace_workload.WORKLOADS:  # a real model's calls, columns of its own
                    results.setdefault("mace", []).extend(mace_workload.run(name, settings, bar))
                    on_problem(results)
                    continue
                problems = workloads.build(name, settings.tier, settings.batch_sizes, settings.device,
                                           settings.atoms)
                bar.total += sum(len(p.cases) * (len(settings.variants) + 1) for p in problems)
                bar.refresh()
                for index, problem in enumerate(problems):
                    prefix = f"[{i + 1}/{len(settings.workloads)}] {problem.name}"
                    results["problems"].append(_run_problem(problem, index, settings, stock_column, bar, prefix))
                    on_problem(results)
                big = any(_is_big(p) for p in problems)
                del problems
                _free_memory(settings.device, big)
            results["meta"]["loadavg_at_end"] = _loadavg()
        finally:
            bar.close()
            if stock_column is not None:
                stock_column.close()
    return results


def _run_problem(problem, index: int, settings: Settings, stock_column, bar, prefix: str) -> dict[str, Any]:
    torch._dynamo.reset()
    device = settings.device
    cases = [{"label": c.label, "batch": c.batch, "variants": {}} for c in problem.cases]
    out = {"workload": problem.workload, "problem": problem.name, "description": problem.description,
           "chunk": problem.chunk, "cases": cases, "graphs": {}, "notes": {}}

    # case -> column -> its call, kept for the interleaved timing after all columns ran once
    calls: list[dict[str, Callable[[], Any]]] = [{} for _ in cases]
    bar.set_description(f"{prefix}: floor")
    for case, record, case_calls in zip(problem.cases, cases, calls):
        record["floor"] = _time_floor(case.floor, device, settings.budget, case_calls if settings.interleave else None)
        bar.update(1)

    references: list[torch.Tensor | None] = [None] * len(cases)
    for variant in [v for v in variants.VARIANTS if v in settings.variants]:
        bar.set_description(f"{prefix}: {variant}")
        if not settings.runs(variant, problem.workload):
            chosen = ", ".join(settings.column_workloads[variant])
            for record in cases:
                record["variants"][variant] = {"status": f"skipped: this run times {variant} on {chosen} only"}
            bar.update(len(cases))
            continue
        if variant == "stock_compile":
            _run_stock(problem, index, settings, stock_column, references, out, bar, calls)
            continue
        _run_column(variant, problem, settings, references, out, bar, calls)
    if settings.interleave:
        bar.set_description(f"{prefix}: interleaved timing")
        try:
            for record, case_calls in zip(cases, calls):
                _time_interleaved(record, case_calls, settings)
        finally:
            if stock_column is not None:
                stock_column.end_timing()
    return out


def _time_interleaved(record: dict[str, Any], case_calls: dict[str, Callable[[], Any]], settings: Settings) -> None:
    """Steady-state times of one case's columns and floor, in shuffled rounds; a case
    whose interleaved rounds fail times each column alone, as ``interleave=False`` would."""
    sync = measure.synchronizer(settings.device)
    try:
        timed = measure.interleaved_times(case_calls, sync, settings.budget)
        how = "interleaved"
    except Exception:  # noqa: BLE001 - a column that fails on repeated calls: time the rest alone
        timed, how = {}, "sequential"
        for name, call in case_calls.items():
            try:
                cpu, wall = time.process_time(), time.perf_counter()
                times = measure.steady_times(call, sync, settings.budget)
                timed[name] = {"times_s": times, "cores_used": measure.cores_used(cpu, wall)}
            except Exception as e:  # noqa: BLE001
                timed[name] = {"error": f"crashed: {measure.short_error(e)}"}
    for name, figures in timed.items():
        cell = record["floor"] if name == FLOOR else record["variants"][name]
        if "error" in figures:
            cell["status"] = figures["error"]
            continue
        cell.update(measure.summarize(figures["times_s"]), **figures, timing=how)


def _run_column(variant, problem, settings: Settings, references, out, bar, calls) -> None:
    """One in-process column over all cases of a problem."""
    # Each compiled column starts from empty Inductor caches: dynbatch and
    # compiled_func often generate identical kernels, and the second would
    # otherwise find the first's and report a compile it never paid for.
    fresh = settings.cold_compile_cache and variant in (
        "compiled_func", "dynbatch", "dynbatch_budget", "dynbatch_cudagraphs", "dynbatch_outside",
        "dynbatch_outside_vmap", "dynbatch_outside_cudagraphs")
    with _fresh_inductor_cache() if fresh else contextlib.nullcontext():
        _run_column_cases(variant, problem, settings, references, out, bar, calls)


def _run_column_cases(variant, problem, settings: Settings, references, out, bar, calls) -> None:
    """First call, memory and error of every case; the steady times too unless interleaved
    (then each case's call is left in ``calls`` for _time_interleaved)."""
    device, cases = settings.device, out["cases"]
    before = dynbatch.counters()
    try:
        runner = variants.build(variant, problem, device)
    except variants.VariantUnavailable as e:
        for record in cases:
            record["variants"][variant] = {"status": f"skipped: {e}"}
        bar.update(len(cases))
        return
    earlier: list[tuple[Any, dict[str, Any]]] = []  # (case, cell) of this column, for the memory guard
    for i, (case, record) in enumerate(zip(problem.cases, cases)):
        too_big = memory_guard(variant, case, device, earlier)
        if too_big:
            record["variants"][variant] = {"status": f"skipped: {too_big}"}
            bar.update(1)
            continue
        args, result = runner.prepare(case), None
        call = functools.partial(runner.call, *args)
        try:
            cell, result = measure.measure_cell(call, device, settings.budget, runner.to_torch, references[i],
                                                runner.torch_tensors, steady=not settings.interleave)
            if variant == settings.reference:
                references[i], cell["max_abs_err"] = result, 0.0
                # The scale errors are read against: float32 error grows with it.
                record["reference_max_abs"] = result.detach().abs().max().item()
        except Exception as e:  # noqa: BLE001 - a crashing column is a result, not a reason to stop
            cell = {"status": f"crashed: {measure.short_error(e)}"}
        record["variants"][variant] = cell
        if settings.interleave and cell["status"] == "ok":
            calls[i][variant] = call
        earlier.append((case, cell))
        del args, result, call
        bar.update(1)
    out["graphs"][variant] = runner.compiles()
    if runner.note:
        out["notes"][variant] = runner.note
    if variant in ("dynbatch", "dynbatch_budget", "dynbatch_cudagraphs"):
        out[variant] = _dynbatch_delta(before)
    del runner
    _free_memory(device, _is_big(problem))


def _run_stock(problem, index: int, settings: Settings, stock_column, references, out, bar, calls) -> None:
    task = stock.Task(
        workload=problem.workload, index=index, tier=settings.tier,
        batch_sizes=settings.batch_sizes, device=str(settings.device), budget=settings.budget,
        references=tuple(None if r is None else r.detach().cpu().numpy() for r in references),
        atoms=settings.atoms,
        skips=tuple(memory_guard("stock_compile", case, settings.device, []) for case in problem.cases),
        interleave=settings.interleave,
    )
    cells, graphs = stock_column.run(task, len(out["cases"]), on_case=lambda: bar.update(1))
    for i, (record, cell) in enumerate(zip(out["cases"], cells)):
        record["variants"]["stock_compile"] = cell
        if settings.interleave and cell["status"] == "ok":
            calls[i]["stock_compile"] = functools.partial(stock_column.time_call, i)
    out["graphs"]["stock_compile"] = graphs


# --- the memory guard -------------------------------------------------------------
# A case that carries an estimate (Case.batched_memory) can need more memory than
# the machine has: full_hessian's batched backward holds B = 3N copies of N x N pair
# tensors.  Such a cell is skipped, with the figures in its status, rather than
# started: on the CPU the kernel's OOM killer would end the whole run, on CUDA the
# allocator's failure would leave the device fragmented for the next columns.

# Run a cell only if what it needs fits in this share of the memory available
# (the rest: other processes, allocator slack, the estimate's error).
MEMORY_HEADROOM = 0.8


def memory_guard(variant: str, case, device: torch.device, earlier) -> str | None:
    """Why ``variant`` must not run ``case`` (None: it fits).

    What the column needs: scaled from its own measured peak on an earlier case
    of the problem when there is one (``earlier``: (case, cell) pairs), else the
    case's estimate for the samples the column holds at once
    (variants.samples_held); either way it grows with (samples held) x N^2.
    dynbatch's columns need at most 1.25 x their memory budget, which its plan
    keeps (tests/test_memory_budget.py).
    """
    if case.batched_memory is None:
        return None
    compiled = variant in variants.COMPILED
    held = variants.samples_held(variant, case.batch)

    def estimate(c) -> float:
        return c.batched_memory.bytes(compiled) * variants.samples_held(variant, c.batch) / c.batch

    method = measure.memory_method(device)
    need, how = estimate(case), f"estimated for {held} of its B={case.batch} samples at once"
    for before, cell in reversed(earlier):
        peak = cell.get("peak_mem_bytes") or 0
        if before.batched_memory is not None and cell.get("mem_method") == method and peak > 0:
            need = peak * estimate(case) / estimate(before)
            how = f"its {_gib(peak)} peak at {before.label}, scaled with samples held x N^2"
            break
    budget = variants.memory_budget(variant, device)
    if budget is not None and need > 1.25 * budget:
        # dynbatch's plan keeps its batched backwards within the budget (tests/test_memory_budget.py)
        need, how = 1.25 * budget, f"1.25 x its {_gib(budget)} memory budget"
    available, where = available_memory(device)
    if available is None or need <= MEMORY_HEADROOM * available:
        return None
    return f"needs about {_gib(need)} ({how}); {_gib(available)} available ({where})"


def available_memory(device: torch.device) -> tuple[int | None, str]:
    """Bytes this process could still allocate on ``device``, and where that figure comes from."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return free + cached, "cudaMemGetInfo free + torch's cached blocks"
    return dynbatch.planning.memory.available_ram(), "MemAvailable in /proc/meminfo"


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2 ** 30:.3g} GiB" if nbytes >= 2 ** 30 else f"{nbytes / 2 ** 20:.3g} MiB"


FLOOR = "floor"  # the floor's key among a case's interleaved calls


def _time_floor(floor, device: torch.device, budget: measure.Budget,
                interleaved: dict[str, Callable[[], Any]] | None = None) -> dict[str, Any]:
    """The floor's times now, or its call left in ``interleaved`` to be timed with the columns."""
    try:
        thunk = floor.make(device)
        if interleaved is not None:
            interleaved[FLOOR] = thunk
            return {"what": floor.what}
        times = measure.steady_times(thunk, measure.synchronizer(device), budget)
        return {"what": floor.what, **measure.summarize(times), "times_s": times}
    except Exception as e:  # noqa: BLE001
        return {"what": floor.what, "status": f"crashed: {measure.short_error(e)}"}


def _dynbatch_delta(before: dict[str, int]) -> dict[str, Any]:
    after = dynbatch.counters()
    keys = set(after) | set(before) | {"graphs", "graphs_batched", "fallbacks"}
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in sorted(keys)}
    records = dynbatch.compile_records()[-delta.get("graphs", 0):] if delta.get("graphs") else []
    delta["fallback_reasons"] = [r.fallback_reason for r in records if r.fell_back]
    delta["aten_node_counts"] = [list(r.aten_node_counts) for r in records]
    return delta


def _free_memory(device: torch.device, big: bool = True) -> None:
    """Collect what the last column left in reference cycles before the next one runs.

    A full collection takes ~0.3 s once Dynamo and Inductor are loaded: done after
    problems whose tensors are big enough to matter, and always on CUDA (where
    ``empty_cache`` then returns the blocks), not after the tiny ones (--quick).
    """
    if big or device.type == "cuda":
        gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _is_big(problem) -> bool:
    """Inputs of 1 MiB or more, or a case whose batched backward is estimated at 64 MiB or more."""
    inputs = sum(c.x.numel() * c.x.element_size() + c.cotangents.numel() * c.cotangents.element_size()
                 for c in problem.cases)
    return inputs >= 2 ** 20 or any(c.batched_memory is not None and c.batched_memory.eager >= 2 ** 26
                                    for c in problem.cases)


def _fresh_inductor_cache():
    """torch's own "empty caches, in memory and on disk" context (private; torch 2.11+ name)."""
    from torch._inductor.utils import fresh_cache

    return fresh_cache()


@contextlib.contextmanager
def _compile_caches(cold: bool) -> Iterator[None]:
    """Point Inductor's and Triton's on-disk caches at an empty folder, so first calls compile for real."""
    if not cold:
        yield
        return
    keys = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
    saved = {k: os.environ.get(k) for k in keys}
    folder = tempfile.mkdtemp(prefix="dynbatch-bench-cache-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(folder, "inductor")
    os.environ["TRITON_CACHE_DIR"] = os.path.join(folder, "triton")
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(folder, ignore_errors=True)


def machine_meta(device: torch.device) -> dict[str, Any]:
    """When, where and with what a run measured: what every results file's provenance reads."""
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "dynbatch": dynbatch.__version__,
        "jax": _jax_version(),
        "platform": platform.platform(),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cpu_affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name(),
        # Other processes share the cores: the 1-minute load average says how much.
        "loadavg_at_start": _loadavg(),
    }


def compile_cache_empty() -> bool:
    """No compiled code in Inductor's cache folder yet: a run's first calls compile from scratch."""
    from dynbatch import _compat

    folder = Path(_compat.inductor_cache_dir())
    return not folder.is_dir() or not any(folder.iterdir())


def _meta(settings: Settings) -> dict[str, Any]:
    device = settings.device
    return {
        **machine_meta(device),
        "tier": settings.tier,
        "workloads": list(settings.workloads),
        "variants": list(settings.variants),
        "batch_sizes": list(settings.batch_sizes) if settings.batch_sizes else None,
        "atoms": list(settings.atoms) if settings.atoms else None,
        "memory_headroom": MEMORY_HEADROOM,
        "memory_available_at_start": available_memory(device)[0],
        "budget": dataclasses.asdict(settings.budget),
        "stock_timeout_s": settings.stock_timeout_s,
        "column_workloads": {column: list(chosen) for column, chosen in settings.column_workloads.items()},
        "cold_compile_cache": settings.cold_compile_cache,
        "timing": "interleaved" if settings.interleave else "sequential",
        "error_reference": settings.reference,
        "dtype": "float32 (TF32 off on CUDA)",
        "memory_method": measure.memory_method(device),
        "variant_descriptions": dict(variants.DESCRIPTIONS),
    }


def _loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def _jax_version() -> str | None:
    try:
        import importlib.metadata

        return importlib.metadata.version("jax")
    except Exception:  # noqa: BLE001 - not installed
        return None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"
