"""The benchmark (issue 3): a ``--quick`` run end to end, as CI's smoke test.

One run through ``dynbatch.bench.__main__.main`` into a temporary folder
(about a minute on 2 cores; the stock column runs on the sweep workload only
in quick mode), then checks on what it wrote.  Errors are judged against the
eager loop's result from the same run, never against stored numbers.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")

from dynbatch.bench import VARIANTS, WORKLOADS  # noqa: E402
from dynbatch.bench.__main__ import main, parse_args, settings_from  # noqa: E402
from dynbatch.bench.measure import short_error  # noqa: E402
from dynbatch.bench.report import Footnotes  # noqa: E402

STATUSES = ("ok", "skipped: ", "crashed: ", "timed out after ")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    assert main(["--quick", "--out", str(out), "--no-progress"]) == 0
    return out, json.loads((out / "results.json").read_text())


def test_writes_json_markdown_and_plots(quick_run):
    out, _ = quick_run
    for name in ("results.json", "results.md", "time_vs_batch.png", "compile_vs_batch.png", "speedup.png"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "time_vs_batch.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_workload_and_every_variant_per_case(quick_run):
    _, results = quick_run
    assert {p["workload"] for p in results["problems"]} == set(WORKLOADS)
    for problem in results["problems"]:
        assert problem["cases"], problem["problem"]
        for case in problem["cases"]:
            assert set(case["variants"]) == set(VARIANTS), (problem["problem"], case["label"])
            for variant, cell in case["variants"].items():
                assert cell["status"].startswith(STATUSES), (problem["problem"], variant, cell["status"])
                if cell["status"] == "ok":
                    assert cell["median_s"] > 0 and cell["first_call_s"] > 0 and cell["times_s"]
                    assert cell["iqr_s"] >= 0 and cell["peak_mem_bytes"] >= 0
            assert case["floor"]["median_s"] > 0, (problem["problem"], case["label"])


def test_dynbatch_batches_and_matches_the_eager_loop(quick_run):
    _, results = quick_run
    for problem in results["problems"]:
        assert problem["dynbatch"]["fallbacks"] == 0, problem["dynbatch"]["fallback_reasons"]
        assert problem["dynbatch"]["graphs_batched"] >= 1, problem["problem"]
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


def test_symbolic_batch_reuses_the_graph_on_the_sweep(quick_run):
    _, results = quick_run
    sweep = next(p for p in results["problems"] if p["workload"] == "sweep")
    # static first compile, one dynamic recompile, then no more whatever B is
    assert len(sweep["cases"]) >= 3
    assert sweep["graphs"]["dynbatch"] <= 2


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
    if not results["meta"]["jax"]:
        assert "jax not installed" in md


def test_quick_settings_and_flags(tmp_path):
    s = settings_from(parse_args(["--quick", "--workloads", "gelu_vjp,hessian", "--batch-sizes", "2,3"]))
    assert s.tier == "quick" and s.workloads == ("gelu_vjp", "hessian") and s.batch_sizes == (2, 3)
    assert s.stock_workloads == ("gelu_vjp",) and not s.cold_compile_cache
    assert settings_from(parse_args([])).tier == "cpu"
    with pytest.raises(SystemExit):
        parse_args(["--workloads", "nope"])
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
