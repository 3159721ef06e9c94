"""The benchmark (issue 3): a ``--quick`` run end to end, as CI's smoke test.

One run through ``dynbatch.bench.__main__.main`` into a temporary folder
(about two minutes on one core: one tiny case per workload, the compiled columns
but dynbatch on the sweep only), then checks on what it wrote.  Errors are judged against the
eager loop's result from the same run, never against stored numbers.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")

from dynbatch.bench import VARIANTS, WORKLOADS, cells, peak, plots, runner, training, variants, workloads  # noqa: E402
from dynbatch.bench.__main__ import QUICK_EVERY_WORKLOAD, main, parse_args, settings_from  # noqa: E402
from dynbatch.bench.measure import memory_method, short_error  # noqa: E402
from dynbatch.bench.problem import BatchedMemory  # noqa: E402
from dynbatch.bench.report import Footnotes  # noqa: E402

STATUSES = ("ok", "skipped: ", "crashed: ", "timed out after ")
# What --quick draws: plots.py's every figure.
FIGURES = ("time_vs_batch", "compile_vs_batch", "memory_vs_batch", "speedup", "training")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    assert main(["--quick", "--out", str(out), "--no-progress"]) == 0
    return out, json.loads((out / "results.json").read_text())


@pytest.mark.slow  # the quick run of every workload and column: a sweep (minutes, cold Inductor)
def test_writes_json_markdown_and_every_plot(quick_run):
    out, _ = quick_run
    for name in ("results.json", "results.md"):
        assert (out / name).stat().st_size > 0, name
    assert sorted(path.stem for path in out.glob("*.png")) == sorted(FIGURES)
    for name in FIGURES:
        assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


def test_quick_runs_one_small_case_per_workload():
    """What --quick covers, without running it: every workload (the sweep's three B, where
    recompiles show); each column on some workload; each plot that results so shaped draw."""
    args = parse_args(["--quick"])
    s = settings_from(args)
    assert s.workloads == (*WORKLOADS, *training.WORKLOADS)
    cpu = torch.device("cpu")
    cases = {name: [c.label for p in workloads.build(name, s.tier, None, cpu) for c in p.cases] for name in WORKLOADS}
    assert cases.pop("sweep") == ["B=2", "B=3", "B=5"]
    assert all(len(labels) == 1 for labels in cases.values()), cases
    assert [(p.name, len(p.cases)) for p in training.force_training(s.tier, cpu)] == [("force_training/pair", 1)]
    # every column runs: on every workload, or on the sweep alone
    assert set(s.column_workloads) | set(QUICK_EVERY_WORKLOAD) == set(s.variants)
    assert all(s.runs(v, "sweep") for v in s.variants) and set(s.column_workloads.values()) == {("sweep",)}
    # a problem and a training step: every figure
    case = {"label": "B=2", "batch": 2, "variants": {"dynbatch": {"status": "ok", "median_s": 1.0}}}
    shaped = {"meta": {"device_name": "cpu", "variants": ["dynbatch"]},
              "problems": [{"workload": "sweep", "problem": "sweep", "cases": [case]}],
              "training": [{"problem": "force_training/pair", "cases": []}]}
    assert sorted(plots.figures(shaped)) == sorted(FIGURES)


@pytest.mark.slow  # the quick run of every workload and column: a sweep (minutes, cold Inductor)
def test_every_workload_and_every_variant_per_case(quick_run):
    _, results = quick_run
    assert {p["workload"] for p in results["problems"]} == set(WORKLOADS)
    assert {p["workload"] for p in results["training"]} == set(training.WORKLOADS)
    # each column ran somewhere (jax where installed)
    ran = {v for _, case in cells.rows(results) for v, cell in case["variants"].items() if cell["status"] == "ok"}
    assert ran == set(VARIANTS) - set(variants.CUDA_ONLY) - (set() if results["meta"]["jax"] else {"jax"})
    for problem in results["problems"]:
        assert problem["cases"], problem["problem"]
        for case in problem["cases"]:
            # the CPU's default columns: all but the CUDA-only ones
            assert set(case["variants"]) == set(VARIANTS) - set(variants.CUDA_ONLY), (problem["problem"], case["label"])
            for variant, cell in case["variants"].items():
                assert cell["status"].startswith(STATUSES), (problem["problem"], variant, cell["status"])
                if cell["status"] == "ok":
                    assert cell["median_s"] > 0 and cell["first_call_s"] > 0 and cell["times_s"]
                    assert cell["iqr_s"] >= 0 and cell["peak_mem_bytes"] >= 0
                    assert cell["cores_used"] > 0, (problem["problem"], variant, cell)
                    # every column timed in the same rounds, stock_compile's in its own process
                    assert cell["timing"] == "interleaved", (problem["problem"], variant, cell["timing"])
            assert case["floor"]["median_s"] > 0, (problem["problem"], case["label"])
            assert case["floor"]["timing"] == "interleaved"
    # the stock column's first batch size compiles and runs (later ones crash): timed over the pipe
    stock = [case["variants"]["stock_compile"] for problem in results["problems"] for case in problem["cases"]]
    assert any(cell["status"] == "ok" for cell in stock), [cell["status"] for cell in stock]


@pytest.mark.slow  # the quick run of every workload and column: a sweep (minutes, cold Inductor)
def test_force_training_columns_match_eager_and_stock_compile_refuses(quick_run):
    out, results = quick_run
    problems = results["training"]
    assert [p["problem"] for p in problems] == ["force_training/pair"]
    for problem in problems:
        for case in problem["cases"]:
            cells = case["variants"]
            on_cpu = {c for c in training.COLUMNS if not c.endswith(training.CUDAGRAPHS)}  # CUDA graphs: CUDA only
            assert set(cells) == on_cpu, (problem["problem"], set(cells))
            # the double backward stock torch.compile cannot do, recorded as its error
            assert "double backward" in cells["stock_compile"]["status"], cells["stock_compile"]["status"]
            scale = case["reference_max_abs"]
            for column in ("dynbatch_model_in", "dynbatch_model_out", "dynbatch_step"):
                cell = cells[column]
                assert cell["status"] == "ok", (problem["problem"], column, cell["status"])
                assert cell["timing"] == "interleaved" and cell["cores_used"] > 0
                # float32 parameter grads of a second-order loss, against eager's
                assert cell["max_abs_err"] <= 1e-4 * max(1.0, scale), (problem["problem"], column, cell)
        # one graph per case at most: the model's graph, its vjp, the forward with forces
        assert problem["graphs"]["dynbatch_model_in"] <= len(problem["cases"]), problem["graphs"]
    assert (out / "training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "## Training with forces (force_training)" in (out / "results.md").read_text()


@pytest.mark.slow  # the quick run of every workload and column: a sweep (minutes, cold Inductor)
def test_dynbatch_batches_and_matches_the_eager_loop(quick_run):
    _, results = quick_run
    for problem in results["problems"]:
        # dynbatch_budget: the sweep's (--quick runs it there only)
        for column in ("dynbatch", "dynbatch_budget")[:1 + (problem["workload"] == "sweep")]:
            assert problem[column]["fallbacks"] == 0, problem[column]["fallback_reasons"]
            assert problem[column]["graphs_batched"] >= 1, (problem["problem"], column)
        for case in problem["cases"]:
            where = (problem["problem"], case["label"])
            loop, ours = case["variants"]["eager_loop"], case["variants"]["dynbatch"]
            assert loop["status"] == "ok" and ours["status"] == "ok", where
            # float32 rounding grows with the size of the values; the eager
            # columns' own distance from the loop shows what rounding alone gives.
            eager_spread = max(case["variants"][v].get("max_abs_err") or 0.0
                               for v in ("eager_batched", "eager_vmap"))
            tolerance = max(1e-5 * max(case["reference_max_abs"], 1.0), 10 * eager_spread)
            assert ours["max_abs_err"] <= tolerance, (where, ours["max_abs_err"], tolerance)
            # The tight-budget configuration computes the same thing, chunked or not.
            budget = case["variants"]["dynbatch_budget"]
            if problem["workload"] == "sweep":
                assert budget["status"] == "ok", (where, budget["status"])
                assert budget["max_abs_err"] <= tolerance, (where, budget["max_abs_err"], tolerance)


@pytest.mark.slow  # the quick run of every workload and column: a sweep (minutes, cold Inductor)
def test_chunked_vmap_matches_the_eager_loop(quick_run):
    _, results = quick_run
    for problem in results["problems"]:
        for case in problem["cases"]:
            cell = case["variants"]["eager_vmap_chunked"]
            assert cell["status"] == "ok", (problem["problem"], case["label"], cell["status"])
            assert cell["max_abs_err"] <= 1e-5 * max(case["reference_max_abs"], 1.0), (problem["problem"], case)


@pytest.mark.slow  # the quick run of every workload and column: a sweep (minutes, cold Inductor)
def test_full_hessian_runs_unchunked(quick_run):
    _, results = quick_run
    (problem,) = [p for p in results["problems"] if p["workload"] == "full_hessian"]
    assert problem["problem"] == "full_hessian/lj" and problem["chunk"] is None  # one batched grad, the whole basis
    (case,) = problem["cases"]
    assert case["batch"] == 3 * int(case["label"].removeprefix("N="))
    for variant in QUICK_EVERY_WORKLOAD:
        cell = case["variants"][variant]
        assert cell["status"] == "ok" and cell["peak_mem_bytes"] > 0, (variant, cell)
    assert case["variants"]["compiled_func"]["status"] == "skipped: this run times compiled_func on sweep only"


@pytest.mark.slow  # the quick run of every workload and column: a sweep (minutes, cold Inductor)
def test_symbolic_batch_reuses_the_graph_on_the_sweep(quick_run):
    _, results = quick_run
    sweep = next(p for p in results["problems"] if p["workload"] == "sweep")
    # static first compile, one dynamic recompile, then no more whatever B is
    assert len(sweep["cases"]) >= 3
    assert sweep["graphs"]["dynbatch"] <= 2


@pytest.mark.slow  # the quick run of every workload and column: a sweep (minutes, cold Inductor)
def test_markdown_shows_ratios_and_notes(quick_run):
    out, results = quick_run
    md = (out / "results.md").read_text()
    for heading in ("Summary: dynbatch per case", "Steady-state time", "First call", "Peak memory",
                    "Graphs compiled", "Max abs error"):
        assert heading in md
    assert "dynbatch / eager_batched" in md and "dynbatch / best other" in md and "dynbatch / floor" in md
    assert "/ best torch column" in md
    for problem in results["problems"]:
        assert f"| {problem['problem']} |" in md
    # the memory table has every column, the new ones included
    memory = md.split("## Peak memory", 1)[1].split("\n## ", 1)[0]
    for variant in results["meta"]["variants"]:
        assert f"{variant} MiB" in memory, variant
    # dynbatch's own configurations are never "the best other column"
    assert "(dynbatch_budget)" not in md and "(dynbatch_outside)" not in md and "(dynbatch_cudagraphs)" not in md
    if not results["meta"]["jax"]:
        assert "jax not installed" in md


def test_quick_settings_and_flags(tmp_path):
    s = settings_from(parse_args(["--quick", "--workloads", "gelu_vjp,hessian", "--batch-sizes", "2,3"]))
    assert s.tier == "quick" and s.workloads == ("gelu_vjp", "hessian") and s.batch_sizes == (2, 3)
    assert not s.cold_compile_cache and s.atoms is None
    # no sweep: the compiled columns but dynbatch run on the first workload
    assert s.column_workloads == {v: ("gelu_vjp",) for v in s.variants if v not in QUICK_EVERY_WORKLOAD}
    assert s.runs("stock_compile", "gelu_vjp") and not s.runs("jax", "hessian") and s.runs("dynbatch", "hessian")
    assert settings_from(parse_args([])).tier == "cpu" and settings_from(parse_args([])).column_workloads == {}
    assert settings_from(parse_args([])).variants == tuple(v for v in VARIANTS if v not in variants.CUDA_ONLY)
    s = settings_from(parse_args(["--quick", "--stock-workloads", "hessian,sweep"]))
    assert s.column_workloads["stock_compile"] == ("hessian", "sweep") and s.column_workloads["jax"] == ("sweep",)
    # the reference column runs wherever dynbatch does
    s = settings_from(parse_args(["--quick", "--variants", "compiled_func,dynbatch"]))
    assert s.reference == "compiled_func" and s.column_workloads == {}
    with pytest.raises(variants.VariantUnavailable, match="CUDA"):
        variants.build("dynbatch_cudagraphs", workloads.build("sweep", "quick", None, torch.device("cpu"), None)[0],
                       torch.device("cpu"))
    # A run that leaves the loop out reads its errors against the first column it runs.
    assert settings_from(parse_args([])).reference == "eager_loop"
    assert settings_from(parse_args(["--variants", "jax,dynbatch,eager_vmap"])).reference == "eager_vmap"
    s = settings_from(parse_args(["--workloads", "full_hessian", "--atoms", "100,200"]))
    assert s.workloads == ("full_hessian",) and s.atoms == (100, 200) and s.tier == "cpu"
    with pytest.raises(SystemExit):
        parse_args(["--workloads", "nope"])
    with pytest.raises(SystemExit):
        parse_args(["--atoms", "1"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="cuda"):
            settings_from(parse_args(["--device", "cuda"]))


def test_short_error_digs_out_the_real_error():
    inner = RuntimeError("Cannot call storage_offset() on tensor\nException raised from ...")
    try:
        raise ValueError("wrapper") from inner
    except ValueError as e:
        assert short_error(e) == "RuntimeError: Cannot call storage_offset() on tensor"
    wrapped = RuntimeError("Dynamo failed: got RuntimeError('Cannot call sizes()\\nException raised')")
    assert short_error(wrapped) == "RuntimeError: Cannot call sizes()"


def test_footnotes_number_each_message_once():
    notes = Footnotes()
    assert notes.cell("stock_compile", "a B=2", "crashed: X") == "crashed [1]"
    assert notes.cell("stock_compile", "b B=3", "crashed: X") == "crashed [1]"
    assert notes.cell("jax", "a B=2", "skipped: no jax") == "skipped [2]"
    assert "first at a B=2" in notes.markdown()


def test_atoms_set_the_atom_counts():
    problems = workloads.build("full_hessian", "quick", None, "cpu", atoms=[3, 5])
    assert [p.name for p in problems] == ["full_hessian/lj", "full_hessian/pair_mlp"]
    for problem in problems:
        assert [(c.label, c.batch, tuple(c.cotangents.shape)) for c in problem.cases] == [
            ("N=3", 9, (9, 3, 3)), ("N=5", 15, (15, 5, 3))]
    # --atoms leaves the other workloads alone
    assert workloads.build("sweep", "quick", None, "cpu", atoms=[3]) [0].cases[0].label == "B=2"


@pytest.mark.parametrize("index", [0, 1], ids=["lj", "pair_mlp"])
def test_full_hessian_is_the_hessian(index):
    """The one batched grad is the Hessian: equal to torch.func's (another autograd path), symmetric."""
    problem = workloads.build("full_hessian", "quick", None, "cpu", atoms=[5])[index]
    case = problem.cases[0]
    rows = case.batch
    batched = variants.batched_program(problem)(case.x, case.cotangents).reshape(rows, rows)
    by_func = torch.func.jacrev(problem.f_func)(case.x).reshape(rows, rows)
    torch.testing.assert_close(batched, by_func, rtol=1e-4, atol=1e-4 * by_func.abs().max().item())
    torch.testing.assert_close(batched, batched.T, rtol=1e-4, atol=1e-4 * batched.abs().max().item())
    assert batched.abs().max() > 0
    chunked = variants.vmap_program(problem, chunk_size=2)(case.x, case.cotangents).reshape(rows, rows)
    torch.testing.assert_close(chunked, batched, rtol=1e-4, atol=1e-4 * batched.abs().max().item())


def test_full_hessian_jax_dialect_matches():
    jax = pytest.importorskip("jax")
    import numpy as np

    jax.config.update("jax_default_matmul_precision", "highest")
    for problem in workloads.build("full_hessian", "quick", None, "cpu", atoms=[5]):
        case = problem.cases[0]
        rows = case.batch
        expected = variants.batched_program(problem)(case.x, case.cotangents).reshape(rows, rows)
        got = np.array(jax.jacrev(problem.jax_f())(case.x.numpy())).reshape(rows, rows)
        torch.testing.assert_close(torch.from_numpy(got), expected, rtol=1e-4,
                                   atol=1e-4 * expected.abs().max().item())


def test_memory_guard_skips_what_does_not_fit():
    cpu = torch.device("cpu")
    available, _ = runner.available_memory(cpu)
    if available is None:
        pytest.skip(reason="no MemAvailable here (not Linux)")
    case = workloads.build("full_hessian", "quick", None, "cpu", atoms=[100])[0].cases[0]  # B = 300
    huge = dataclasses.replace(case, batched_memory=BatchedMemory(eager=10 * available, compiled=5 * available))
    reason = runner.memory_guard("eager_batched", huge, cpu, [])
    assert reason and reason.startswith("needs about") and "B=300" in reason
    assert runner.memory_guard("compiled_func", huge, cpu, [])  # compiled: 5x available, still too much
    # dynbatch's columns hold at most their budget (dynbatch's plan chunks the rest)
    assert runner.memory_guard("dynbatch", huge, cpu, []) is None
    assert runner.memory_guard("dynbatch_budget", huge, cpu, []) is None
    # the loop holds one sample of 300, the chunked vmap VMAP_CHUNK of them
    assert runner.memory_guard("eager_loop", huge, cpu, []) is None
    assert variants.samples_held("eager_vmap_chunked", 300) == variants.VMAP_CHUNK
    # a column's own measured peak on a smaller case, scaled, replaces the estimate
    small = dataclasses.replace(huge, batch=30, batched_memory=BatchedMemory(eager=available, compiled=available // 2))
    measured = {"status": "ok", "peak_mem_bytes": 2 ** 20, "mem_method": memory_method(cpu)}
    assert runner.memory_guard("compiled_func", huge, cpu, [(small, measured)]) is None
    grown = dict(measured, peak_mem_bytes=available)
    assert "peak at" in runner.memory_guard("compiled_func", huge, cpu, [(small, grown)])
    assert runner.memory_guard("eager_batched", case, cpu, []) is None  # the real estimate fits


def test_interleaved_times_runs_warm_blocks_in_rounds_and_reads_each_columns_cores():
    import itertools
    import time

    from dynbatch.bench.measure import Budget, interleaved_times

    seen = []

    def spin():
        seen.append("spin")
        end = time.perf_counter() + 0.004
        while time.perf_counter() < end:
            pass

    def sleep():
        seen.append("sleep")
        time.sleep(0.002)

    timed = interleaved_times({"spin": spin, "sleep": sleep}, lambda: None,
                              Budget(min_time_s=0.1, min_reps=6, max_reps=400), block_s=0.02)
    assert len(timed["spin"]["times_s"]) >= 6 and len(timed["sleep"]["times_s"]) >= 6
    # consecutive blocks of each column, several rounds of both
    runs = [(name, len(list(group))) for name, group in itertools.groupby(seen)]
    assert len(runs) >= 4, runs
    # a block is ~20 ms (+1 warm-up call); a shuffle may join a column's blocks of two rounds
    assert all(length <= 2 * (0.02 / 0.002 + 1) for _, length in runs), runs
    assert min(timed["spin"]["times_s"]) >= 0.004 and min(timed["sleep"]["times_s"]) >= 0.002
    # each column's CPU time is its own: the spinner near one core (less on a loaded
    # machine), the sleeper near none
    assert timed["spin"]["cores_used"] > 4 * timed["sleep"]["cores_used"] and timed["sleep"]["cores_used"] < 0.5


def test_versus_best_other_is_the_geometric_mean_of_per_case_ratios():
    from dynbatch.bench import report

    def case(label, **ms):
        return {"label": label, "variants": {k: {"status": "ok", "median_s": v / 1e3} for k, v in ms.items()}}

    results = {"meta": {}, "problems": [{"problem": "p", "cases": [
        case("a", dynbatch=2.0, jax=1.0, compiled_func=4.0, dynbatch_budget=0.1),  # x2 (jax); budget is ours
        case("b", dynbatch=1.0, jax=8.0, compiled_func=2.0),  # x0.5 (compiled_func)
        case("c", eager_loop=1.0),  # dynbatch did not run: not counted
    ]}]}
    v = report.versus_best_other(results)
    assert v["cases"] == 2 and abs(v["geomean"] - 1.0) < 1e-12
    assert v["above_1_1"] == [("p a", 2.0, "jax")]
    torch_only = report.versus_best_other(results, exclude=("jax",))
    assert abs(torch_only["geomean"] - (0.5 * 0.5) ** 0.5) < 1e-12 and torch_only["above_1_1"] == []
    assert "×1.00 over 2 cases; 1 above ×1.1: p a ×2.00 (jax)" in report.versus_sentence(results)


def test_cores_used_reads_one_busy_thread_as_about_one_core():
    import time

    from dynbatch.bench.measure import cores_used

    cpu, wall = time.process_time(), time.perf_counter()
    while time.perf_counter() - wall < 0.3:
        pass
    # at most one core (plus timer slack); under load the spin may get less
    assert 0.1 < cores_used(cpu, wall) <= 1.2


@pytest.mark.skipif(not hasattr(__import__("os"), "sched_setaffinity"), reason="no CPU affinity here (Linux only)")
def test_pinning_holds_threads_started_later():
    import os
    import threading

    from dynbatch.bench.__main__ import pin_to_cores

    saved = os.sched_getaffinity(0)
    try:
        cores = pin_to_cores(1)
        seen = []
        t = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
        t.start()
        t.join()
        assert cores == [min(saved)] and seen == [{min(saved)}]
    finally:
        os.sched_setaffinity(0, saved)


# --- the other commands: python -m dynbatch.bench overhead | ab | gemm, --single-call -----

def _table(printed: str) -> list[dict[str, str]]:
    """The rows of the markdown table a command printed, by column name."""
    lines = [line for line in printed.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    return [dict(zip(header, (cell.strip() for cell in line.strip("|").split("|")))) for line in lines[2:]]


def _number(cell: str) -> float:
    return float(cell.removeprefix("×"))


def test_overhead_splits_a_dynbatch_call(capsys, tmp_path):
    out = tmp_path / "outside.json"
    assert main(["overhead", "--quick", "--workloads", "sweep", "--batch-sizes", "2,3",
                 "--variants", "eager_batched,dynbatch,dynbatch_outside", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    rows, phases = _table(printed.split("\n\n")[0]), _table(printed.split("\n\n")[1])
    # dynbatch_outside: its program's outputs require grad, so its stack is each call less
    # its programs (NOTE [A stack under differentiable outputs]); it crashed before
    assert [(r["case"], r["column"]) for r in rows] == [
        (case, column) for case in ("B=2", "B=3") for column in ("eager_batched", "dynbatch", "dynbatch_outside")]
    for row in rows:
        assert _number(row["whole us"]) > 0, row
        # the sweep's MLP runs at least its 3 forward products, eager or compiled
        assert _number(row["products us"]) > 0 and int(row["products/call"]) >= 3, row
        if row["column"] != "eager_batched":
            # Dynamo's frame and guards and the region without the program; the program alone
            assert _number(row["stack us"]) > 0 and _number(row["program us"]) > 0, row
        else:  # no dynbatch region to look inside
            assert row["stack us"] == row["program us"] == "–", row
    # NOTE [An outside call, phase by phase]: one row per case, each phase a part of the call
    assert [r["case"] for r in phases] == ["B=2", "B=3"], phases
    for row, inside in zip(phases, (r for r in rows if r["column"] == "dynbatch")):
        whole = _number(row["whole us"])
        parts = [_number(row[f"{name} us"]) for name in
                 ("forward", "torch's grad", "dynbatch's backward", "backward programs")]
        assert all(0 < part < whole for part in parts), row
        # medians of each call's phases: their sum is near the median of the wholes
        assert abs(sum(parts) - whole) < 0.25 * whole, row
        assert row["inside us"] == inside["whole us"], (row, inside)
        assert _number(row["whole / inside"]) == pytest.approx(whole / _number(inside["whole us"]), rel=0.01)
        # the call were dynbatch's plumbing free: the whole less dynbatch's backward
        assert _number(row["less dynbatch's backward / inside"]) == pytest.approx(
            (whole - _number(row["dynbatch's backward us"])) / _number(inside["whole us"]), rel=0.01)
    # the differentiable outputs' stack holds the backward's plumbing: no floor is drawn for it
    assert all(r["stack + products / jax"] == "–" for r in rows), rows
    assert "Over 2 cases, whole / inside: geometric mean" in printed.split("\n\n")[1]
    # --out: the same rows, which `report` shows as the doc's table (part "outside")
    doc = tmp_path / "doc.md"
    doc.write_text(f"<!-- generated by python -m dynbatch.bench report: {out} outside -->\n<!-- end generated -->\n")
    assert main(["report", str(out), "--doc", str(doc), "--no-plots"]) == 0
    shown = doc.read_text()
    table = [line for line in printed.split("\n\n")[1].splitlines() if line.startswith("| sweep |")]
    assert len(table) == 2 and all(line in shown for line in table), (table, shown)
    assert f"torch {torch.__version__}" in shown and "`dynbatch_outside`'s calls by phase" in shown


def test_overhead_floor_is_stack_plus_products_over_jaxs_call():
    # NOTE [What a call costs at the least]: pure arithmetic on rows, no JAX needed
    from dynbatch.bench import overhead

    def row(column, **figures):
        return {"problem": "p", "case": "B=1", "column": column, "status": "ok", "device": "cpu",
                "whole_us": None, "stack_us": None, "program_us": None, "kernels_us": None,
                "kernels_per_call": None, "stack_is_frame": False, **figures}

    rows = overhead.with_floors([
        row("dynbatch", whole_us=80.0, stack_us=20.0, program_us=55.0, kernels_us=30.0, kernels_per_call=6,
            stack_is_frame=True),
        row("dynbatch_outside", whole_us=400.0, stack_us=300.0, program_us=90.0, kernels_us=30.0,
            kernels_per_call=6),  # a stack under differentiable outputs: not a frame alone
        row("jax", whole_us=40.0)])
    assert rows[0]["floor_over_jax"] == pytest.approx((20.0 + 30.0) / 40.0)
    assert rows[1]["floor_over_jax"] is None and rows[2]["floor_over_jax"] is None
    assert overhead.row_text(rows[0])[-1] == "×1.25" and overhead.row_text(rows[1])[-1] == "–"
    assert overhead.floor_summary(rows) == [
        "dynbatch: stack + products alone take 0.8 of JAX's whole call or more in 1 of 1 cases; p B=1 ×1.25 "
        "(NOTE [What a call costs at the least] in dynbatch/bench/overhead.py)."]
    # no JAX beside, or on CUDA (device time overlaps the host's): no floor
    assert overhead.with_floors([dict(rows[0])])[0]["floor_over_jax"] is None
    cuda = overhead.with_floors([{**rows[0], "device": "cuda"}, rows[2]])
    assert cuda[0]["floor_over_jax"] is None


def test_outside_phase_summary_counts_the_large_cases():
    from dynbatch.bench import outside_phases

    def phase(inside, whole, ours):
        return {"problem": "p", "case": str(inside), "whole_us": whole, "forward_us": 1.0, "torch_us": 1.0,
                "dynbatch_us": ours, "programs_us": 1.0, "inside_us": inside}

    rows = [phase(100.0, 400.0, 100.0), phase(2000.0, 2600.0, 300.0), phase(4000.0, 4400.0, 100.0)]
    assert outside_phases.phase_ratios(rows[1]) == pytest.approx((1.3, 1.15))
    geomean = (4.0 * 1.3 * 1.1) ** (1 / 3)
    less = (3.0 * 1.15 * 1.075) ** (1 / 3)
    assert outside_phases.phase_summary(rows) == [
        f"Over 3 cases, whole / inside: geometric mean ×{geomean:.2f}; less dynbatch's backward: ×{less:.2f}. "
        "Of the 2 cases whose inside call takes 1 ms or more, over ×1.2: 1, and 0 less dynbatch's backward."]


def test_overhead_top_lists_each_columns_costliest_kernels(capsys):
    assert main(["overhead", "--quick", "--workloads", "sweep", "--batch-sizes", "3",
                 "--variants", "eager_batched,dynbatch", "--top", "2"]) == 0
    rows = _table(capsys.readouterr().out)
    assert [r["column"] for r in rows[:2]] == ["eager_batched", "dynbatch"]
    top = rows[2:]
    assert [r["column"].split(": ")[0] for r in top] == ["eager_batched"] * 2 + ["dynbatch"] * 2, top
    spent = [_number(r["products us"]) for r in top]
    assert all(us > 0 for us in spent) and spent[0] >= spent[1] and spent[2] >= spent[3], top


@pytest.mark.slow  # Inductor compiles five columns per case: minutes on 2 cores with a cold cache
def test_overhead_splits_a_training_step_into_programs_and_the_rest(capsys):
    assert main(["overhead", "--quick", "--workloads", "force_training", "--atoms", "8"]) == 0
    rows = _table(capsys.readouterr().out)
    columns = ["eager", *training.DYNBATCH_COLUMNS, "stock_energy_only"]
    assert [r["column"] for r in rows] == columns * 2, rows  # pair, then message passing
    for row in rows:
        assert _number(row["whole us"]) > 0, row
        if row["column"] == "eager":  # nothing compiled to look inside
            assert row["programs us"] == row["rest us"] == row["programs / step's"] == "–", row
            continue
        # every compiled column runs Inductor programs, and Python around them
        assert _number(row["programs us"]) > 0 and _number(row["rest us"]) > 0, row
        if row["column"] == "dynbatch_step":
            assert row["programs / step's"] == row["whole / step's"] == "×1.00", row


def test_ab_runs_each_setting_on_the_same_cells(capsys, tmp_path):
    out = tmp_path / "ab.json"
    assert main(["ab", "dynbatch.memory_budget=None,256", "--option", "dynbatch.inner_compiler=aot_eager",
                 "--quick", "--workloads", "sweep", "--batch-sizes", "2,3", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    rows = _table(printed)
    none, tight = "dynbatch.memory_budget=None", "dynbatch.memory_budget=256"
    assert [(r["case"], r["column"]) for r in rows] == [("B=2", none), ("B=2", tight), ("B=3", none), ("B=3", tight)]
    for row in rows:
        assert _number(row["median ms"]) > 0 and _number(row["first call s"]) > 0, row
        assert int(row["faults"]) >= 0 and _number(row["peak MiB"]) >= 0, row
        assert _number(row["max abs diff"]) <= 1e-5, row  # the same grads, chunked or not
    assert rows[0]["/ first"] == "×1.00" and _number(rows[1]["/ first"]) > 0
    # the first call of each column compiles; a 256-byte budget runs the grad in chunks
    assert rows[0]["graphs compiled"] == "unchunked" and "chunks of" in rows[1]["graphs compiled"]
    assert all(0 < _number(r["cores"]) for r in rows)

    # --out: the same rows, which `report` shows as the doc's table (part "ab")
    doc = tmp_path / "doc.md"
    doc.write_text(f"<!-- generated by python -m dynbatch.bench report: {out} ab -->\n<!-- end generated -->\n")
    assert main(["report", str(out), "--doc", str(doc), "--no-plots"]) == 0
    shown = doc.read_text()
    table = [line for line in printed.splitlines() if line.startswith("| sweep |")]
    assert len(table) == 4 and all(line in shown for line in table)
    assert "`dynbatch.memory_budget` A/B (every column also dynbatch.inner_compiler='aot_eager')" in shown
    assert f"torch {torch.__version__}" in shown and json.loads(out.read_text())["meta"]["setting"] == \
        "dynbatch.memory_budget"


def test_ab_times_a_force_training_column_per_setting(capsys):
    assert main(["ab", "dynbatch.cpu_matmul=aten,flipped", "--option", "dynbatch.inner_compiler=aot_eager",
                 "--quick", "--workloads", "force_training", "--column", "dynbatch_model_out"]) == 0
    rows = _table(capsys.readouterr().out)
    assert {r["problem"] for r in rows} == {"force_training/pair"}  # the quick tier's one model
    assert [r["column"] for r in rows] == ["dynbatch.cpu_matmul=aten", "dynbatch.cpu_matmul=flipped"]
    for row in rows:
        assert _number(row["median ms"]) > 0, row
        assert _number(row["max abs diff"]) <= 1e-3, row  # the same parameter grads either way


def test_cuda_graph_columns_compile_with_reduce_overhead_and_mark_each_step(monkeypatch):
    """Their plumbing, on the CPU (where Inductor compiles the mode as the default one):
    every dynbatch column of force_training again, compiled with mode="reduce-overhead",
    each call a new step, the same parameter grads as eager; the batched-grad ones are
    CUDA only."""
    cpu = torch.device("cpu")
    problem = training.force_training("quick", cpu)[0]
    case = problem.cases[0]
    eager = training.build("eager", problem, cpu)
    expected = eager.call(*eager.prepare(case))
    modes, steps = [], []
    real_compile, real_mark = torch.compile, torch.compiler.cudagraph_mark_step_begin
    def compile_(*args, **kwargs):
        modes.append(kwargs.get("mode") or ("reduce-overhead" if kwargs["options"].get("triton.cudagraphs") else None))
        return real_compile(*args, **kwargs)

    monkeypatch.setattr(torch, "compile", compile_)
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: (steps.append(1), real_mark())[1])
    columns = [c for c in training.COLUMNS if c.endswith(training.CUDAGRAPHS)]
    assert columns == [f"{c}_cudagraphs" for c in training.DYNBATCH_COLUMNS]
    for column in columns:
        runner = training.build(column, problem, cpu, options={"dynbatch.inner_compiler": "aot_eager"})
        for _ in range(2):
            torch.testing.assert_close(runner.call(*runner.prepare(case)), expected, atol=1e-4, rtol=1e-4)
    assert modes == ["reduce-overhead"] * len(columns) and len(steps) == 2 * len(columns)
    for variant in variants.CUDA_ONLY:
        with pytest.raises(variants.VariantUnavailable, match="CUDA graphs need --device cuda"):
            variants.build(variant, workloads.build("sweep", "quick", [2], "cpu")[0], cpu)


def test_ab_reads_option_values_as_python_does():
    from dynbatch.bench import ab

    assert ab.setting("dynbatch.memory_budget=None,32MiB,1024") == (
        "dynbatch.memory_budget", [("None", None), ("32MiB", "32MiB"), ("1024", 1024)])
    assert ab.option("cpp_wrapper=True") == ("cpp_wrapper", True)
    for bad in (["dynbatch.cpu_matmul"], ["dynbatch.cpu_matmul=aten", "--option", "a=1,2"]):
        with pytest.raises(SystemExit):
            ab.parse_args(bad)


def test_gemm_times_every_kernel(capsys, tmp_path):
    from dynbatch.cpu import matmul_kernels

    out = tmp_path / "gemm.md"
    assert main(["gemm", "--quick", "--m", "8,64", "--kn", "16", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    rows = _table(printed)
    written = out.read_text()  # the printed table, under the command that made it
    assert "python -m dynbatch.bench gemm --quick --m 8,64 --kn 16" in written and printed.strip() in written
    assert "\nallocator: " in written
    assert [(r["M"], r["K"], r["N"]) for r in rows] == [("8", "16", "16"), ("64", "16", "16")]
    kernels = [k for k in matmul_kernels.KERNELS if matmul_kernels.available(k)]
    for row in rows:
        assert all(_number(row[f"{k} GF/s"]) > 0 for k in ["torch", *kernels]), row
        if "onednn" in kernels:
            assert _number(row["onednn / aten time"]) > 0, row
        if peak.core_peak_gflops():  # each row's fastest kernel as a fraction of its FMA loop
            assert _number(row["FMA loop GF/s"]) > 0, row
            fraction, fastest = row["dynbatch's best / peak"].split()
            assert fastest.strip("()") in kernels, row
            # tiny quick shapes: both times are mostly the call, not the FLOPs
            assert 0 < float(fraction) < 3 and 0 < float(row["its fastest run / peak"]) < 3, row


def test_gemm_names_the_allocator_settings(monkeypatch):
    """Whether a large output is fresh pages at every call depends on them: every table says."""
    from dynbatch.bench import gemm

    for name in gemm.ALLOCATOR_ENV:
        monkeypatch.delenv(name, raising=False)
    assert gemm.allocator().startswith("glibc's defaults")
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "1000000000")
    assert gemm.allocator() == "set by the environment: MALLOC_MMAP_THRESHOLD_=1000000000"


def test_gemm_takes_k_and_n_apart_and_row_major_operands(capsys):
    assert main(["gemm", "--quick", "--m", "8", "--k", "16,32", "--n", "8", "--layout", "rr"]) == 0
    rows = _table(capsys.readouterr().out)
    assert [(r["M"], r["K"], r["N"]) for r in rows] == [("8", "16", "8"), ("8", "32", "8")]
    with pytest.raises(SystemExit):
        main(["gemm", "--quick", "--k", "16"])  # --k without --n


def test_core_peak_is_measured_where_the_cpu_has_fma():
    if peak.isa() is None:
        pytest.skip(reason="no AVX2 FMA")
    # a core of 1-6 GHz with one to two FMA units on 8-16 lanes: 16-384 GFLOP/s
    assert 8 < peak.core_peak_gflops() < 400


def test_single_call_times_one_steady_call_per_cell(tmp_path):
    s = settings_from(parse_args(["--single-call", "--workloads", "full_hessian", "--atoms", "1000"]))
    assert not s.interleave and s.budget.max_reps == 1 and not s.budget.warm_up and s.reference == "eager_loop"
    assert main(["--single-call", "--quick", "--workloads", "sweep", "--batch-sizes", "2,3",
                 "--variants", "dynbatch,eager_batched", "--out", str(tmp_path), "--no-progress"]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    # without eager_loop, errors are against the first column to run
    assert results["meta"]["error_reference"] == "eager_batched" and results["meta"]["timing"] == "sequential"
    for case in results["problems"][0]["cases"]:
        for variant, cell in case["variants"].items():
            assert cell["status"] == "ok" and cell["reps"] == len(cell["times_s"]) == 1, (variant, cell)
            assert cell["median_s"] > 0 and cell["first_call_s"] > 0 and cell["timing"] == "sequential"
        assert case["variants"]["eager_batched"]["max_abs_err"] == 0.0
        assert case["variants"]["dynbatch"]["max_abs_err"] <= 1e-5 * max(case["reference_max_abs"], 1.0)
    assert "## Max abs error against eager_batched" in (tmp_path / "results.md").read_text()


def test_overhead_counts_the_batched_backward_of_an_outside_call_as_program_time():
    """A grad taken outside the compiled model runs two Inductor programs, the model's
    forward and the batched backward its grad reaches: both are "program", neither is
    counted twice, and the stack is the rest of the call (NOTE [A stack under
    differentiable outputs])."""
    import dynbatch
    from dynbatch.bench import overhead

    torch._dynamo.reset()
    dynbatch.reset()
    problem = WORKLOADS["sweep"]("quick", [3], torch.device("cpu"))[0]
    runner = variants.build("dynbatch_outside", problem, torch.device("cpu"))
    args = runner.prepare(problem.cases[0])
    expected = runner.call(*args)
    programs = overhead.Programs([r.region() for r in dynbatch.compile_records() if r.region is not None])
    assert programs.regions
    with programs.installed():
        call = programs.whole(lambda: runner.call(*args))
        for _ in range(3):
            torch.testing.assert_close(call(), expected)
    assert programs.differentiable and programs.inductor_runs == [2, 2, 2]
    spent, rest = programs.split()
    assert spent == programs.in_inductor and all(s > 0 for s in spent)
    assert all(abs(s + r - w) < 1e-9 for s, r, w in zip(spent, rest, programs.wholes))
    assert all(r > 0 for r in rest)


def test_a_region_runs_the_program_it_is_given():
    """The overhead command's hook: a compile record's region, and its program replaced."""
    import dynbatch

    def f(x):
        return torch.sin(x) * 2

    compiled = torch.compile(f, backend="dynbatch", options={"dynbatch.inner_compiler": "aot_eager"})
    x = torch.randn(3, requires_grad=True)
    compiled(x)
    (record,) = dynbatch.compile_records()
    region = record.region()
    real, seen = region.compiled, []

    def spy(*args):
        seen.append(len(args))
        return real(*args)

    with region.program_replaced(spy):
        y = compiled(x)  # x requires grad: the region's differentiable path
    assert seen and region.compiled is real
    torch.testing.assert_close(y, f(x))
    (grad,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(grad, 2 * torch.cos(x))


def test_mace_without_mace_torch_says_so_in_every_cell(tmp_path, monkeypatch):
    """Without mace-torch (forced here, so the check is cheap where it is installed), every
    cell of the mace workload says it is not installed; the run and its report go on.
    The real run: tests/models/test_mace.py::test_bench_workload."""
    from dynbatch.bench import mace_workload

    def missing():
        raise variants.VariantUnavailable(mace_workload.NOT_INSTALLED)

    monkeypatch.setattr(mace_workload, "_import_mace", missing)
    assert "mace" not in settings_from(parse_args([])).workloads  # minutes of compiles: run when named
    assert main(["--quick", "--workloads", "mace", "--out", str(tmp_path), "--no-progress"]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert [p["problem"] for p in results["mace"]] == ["mace/training_step", "mace/inference_forces",
                                                       "mace/calculator_forces", "mace/hessian"]
    for problem in results["mace"]:
        cells = problem["cases"][0]["variants"]
        assert set(cells) == set(mace_workload.COLUMNS), cells
        assert all(c["status"] == "skipped: mace-torch is not installed (pip install -e '.[models]')"
                   for c in cells.values()), cells
    assert "## A real model (mace)" in (tmp_path / "results.md").read_text()
