"""``python -m dynbatch.bench report`` (issue 37): the tables a markdown file shows between
markers are rewritten from a results file, and docs/benchmarks.md's are its files' own.

Every expected cell is computed from the results the test hands over, with report.py's own
formatting, never copied from a table.  Nothing here runs a benchmark, and only the one
test that draws plots needs matplotlib.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from dynbatch.bench import plots, report

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "benchmarks.md"


def _cell(ms: float) -> dict:
    return {"status": "ok", "median_s": ms / 1e3, "iqr_s": ms / 1e4, "first_call_s": ms,
            "peak_mem_bytes": ms * 2 ** 20}


def _case(label: str, batch: int, **ms: float) -> dict:
    return {"label": label, "batch": batch, "floor": {"median_s": 1e-3, "what": "a product"},
            "variants": {name: _cell(value) for name, value in ms.items()}}


def tiny_results() -> dict:
    """A run as runner.py writes it, cut down: one batched problem with two cases, one
    training case whose stock_compile cell crashed."""
    meta = {"date_utc": "2026-01-02T03:04:05+00:00", "argv": ["__main__.py", "--quick", "--threads", "1"],
            "device": "cpu", "device_name": "Test CPU", "cpu": "Test CPU", "cpu_count": 2, "torch_threads": 1,
            "cpu_affinity": [0], "torch": "2.99.0+cpu", "jax": "0.0.1", "python": "3.11.0",
            "cold_compile_cache": True, "memory_method": "a test's",
            "variants": ["eager_batched", "compiled_func", "dynbatch", "dynbatch_outside", "jax"]}
    problem = {"problem": "toy", "workload": "toy", "description": "a toy", "cases": [
        _case("B=4", 4, eager_batched=4.0, compiled_func=2.5, dynbatch=2.0, dynbatch_outside=3.0, jax=1.0),
        _case("B=16", 16, eager_batched=16.0, compiled_func=6.0, dynbatch=5.0, dynbatch_outside=5.5, jax=8.0),
    ]}
    step = {"label": "N=8", "variants": {
        "eager": _cell(3.0), "stock_compile": {"status": "crashed: RuntimeError: no double backward"},
        "dynbatch_model_in": _cell(2.0), "dynbatch_model_out": _cell(2.2), "dynbatch_step": _cell(1.0),
        "jax": _cell(0.5)}}
    return {"meta": meta, "problems": [problem],
            "training": [{"problem": "force_training/toy", "description": "a toy step", "cases": [step]}]}


def _marker(path: Path, part: str = "") -> str:
    return f"{report.BEGIN}{path}{' ' + part if part else ''} -->"


def _blocks(text: str) -> dict[str, str]:
    """Each block's body by its opening marker."""
    return {m["begin"]: m[0][len(m["begin"]):] for m in report.BLOCK.finditer(text)}


def _ms(results: dict, label: str, column: str) -> float:
    for problem in results["problems"] + results["training"]:
        for case in problem["cases"]:
            if case["label"] == label:
                return case["variants"][column]["median_s"]
    raise KeyError(label)


@pytest.fixture
def toy(tmp_path):
    """The tiny results in toy.json, and a doc with its block, another file's block and text around them."""
    results = tiny_results()
    source = tmp_path / "toy.json"
    source.write_text(json.dumps(results))
    doc = tmp_path / "doc.md"
    doc.write_text(f"# Intro, kept\n\n{_marker(source)}\nstale table\n{report.END}\n\nBetween, kept.\n\n"
                   f"{_marker(tmp_path / 'other.json')}\nanother file's block, kept\n{report.END}\n\nTail, kept.\n")
    return results, source, doc


def test_report_rewrites_the_block_from_the_results_file(toy):
    results, source, doc = toy
    assert report.main([str(source), "--doc", str(doc), "--no-plots"]) == 0
    text = doc.read_text()
    assert "stale table" not in text
    assert text.startswith("# Intro, kept\n\n") and "\n\nBetween, kept.\n\n" in text and text.endswith("Tail, kept.\n")
    blocks = _blocks(text)
    assert blocks[_marker(source.parent / "other.json")] == f"\nanother file's block, kept\n{report.END}"
    block = blocks[_marker(source)]
    meta = results["meta"]
    assert meta["device_name"] in block and meta["torch"] in block and "2026-01-02 03:04 UTC" in block
    # Each case: dynbatch's time, its ratios to eager_batched, the best other column (jax
    # included), the best torch column, and the grad outside over inside -- from the figures.
    for label in ("B=4", "B=16"):
        ours = _ms(results, label, "dynbatch")
        others = {v: _ms(results, label, v) for v in ("compiled_func", "jax")}
        best = min(others, key=others.get)
        row = (f"| toy | {label} | {report.fmt(ours, 1e3)} | "
               f"{report.fmt_ratio(ours / _ms(results, label, 'eager_batched'))} | "
               f"{report.fmt_ratio(ours / others[best])} ({best}) | "
               f"{report.fmt_ratio(ours / others['compiled_func'])} (compiled_func) | ")
        assert row in block, row
        assert f"{report.fmt_ratio(_ms(results, label, 'dynbatch_outside') / ours)} |\n" in block
    assert report.versus_sentence(results) in block
    # The training step: the whole step over JAX, and the crashed cell as a numbered note.
    step = _ms(results, "N=8", "dynbatch_step")
    assert f"{report.fmt_ratio(step / _ms(results, 'N=8', 'jax'))} |" in block
    assert "crashed [1]" in block and "1. `stock_compile`, first at force_training/toy N=8" in block
    for figure in plots.figures(results):
        assert f"](img/toy_{figure}.png)" in block


def test_report_twice_gives_the_same_file(toy):
    _, source, doc = toy
    report.main([str(source), "--doc", str(doc), "--no-plots"])
    once = doc.read_text()
    report.main([str(source), "--doc", str(doc), "--no-plots"])
    assert doc.read_text() == once


def test_a_part_shows_the_batched_or_the_training_tables_alone(toy, tmp_path):
    _, source, _ = toy
    doc = tmp_path / "parts.md"
    doc.write_text(f"{_marker(source, 'batched')}\n{report.END}\n{_marker(source, 'training')}\n{report.END}\n")
    report.main([str(source), "--doc", str(doc), "--no-plots"])
    blocks = _blocks(doc.read_text())
    batched, training = blocks[_marker(source, "batched")], blocks[_marker(source, "training")]
    assert "| toy | B=4 |" in batched and "force_training/toy" not in batched and "toy_training.png" not in batched
    assert "| force_training/toy | N=8 |" in training and "| toy |" not in training
    assert "toy_training.png" in training and "toy_speedup.png" not in training
    doc.write_text(f"{_marker(source, 'everything')}\n{report.END}\n")
    with pytest.raises(SystemExit, match="unknown part 'everything'"):
        report.main([str(source), "--doc", str(doc), "--no-plots"])


def test_a_marker_left_open_is_refused(toy, tmp_path):
    _, source, _ = toy
    doc = tmp_path / "open.md"
    text = f"{_marker(source)}\nno end here\n{_marker(tmp_path / 'other.json')}\nkept\n{report.END}\n"
    doc.write_text(text)
    with pytest.raises(SystemExit, match="has no"):
        report.main([str(source), "--doc", str(doc), "--no-plots"])
    assert doc.read_text() == text


def test_the_command_line_dispatches_report(toy):
    pytest.importorskip("tqdm")  # the benchmark's own command line imports its progress bar
    from dynbatch.bench.__main__ import main

    _, source, doc = toy
    assert main(["report", str(source), "--doc", str(doc), "--no-plots"]) == 0
    assert "| toy | B=4 |" in doc.read_text()


def test_report_draws_the_plots_its_blocks_link(toy):
    pytest.importorskip("matplotlib")
    results, source, doc = toy
    report.main([str(source), "--doc", str(doc)])
    for figure in plots.figures(results):
        path = doc.parent / "img" / f"toy_{figure}.png"
        assert f"]({path.relative_to(doc.parent)})" in doc.read_text()
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", figure


def test_a_md_results_file_is_shown_as_it_is(toy, tmp_path):
    _, source, doc = toy
    table = tmp_path / "gemm.md"
    table.write_text("<!-- generated by: python -m dynbatch.bench gemm -->\n| M | GF/s |\n|---|---|\n| 128 | 79.2 |")
    doc.write_text(f"Before.\n\n{_marker(table)}\nstale\n{report.END}\n")
    assert report.main([str(table), "--doc", str(doc), "--no-plots"]) == 0
    assert doc.read_text() == f"Before.\n\n{_marker(table)}\n{table.read_text()}\n{report.END}\n"
    doc.write_text(f"{_marker(table, 'batched')}\n{report.END}\n")
    with pytest.raises(SystemExit, match="takes no part"):
        report.main([str(table), "--doc", str(doc), "--no-plots"])
    table.write_text(f"a table that ends early\n{report.END}\n")  # would close its block at the next run
    doc.write_text(f"{_marker(table)}\n{report.END}\n")
    with pytest.raises(SystemExit, match="holds a report marker"):
        report.main([str(table), "--doc", str(doc), "--no-plots"])


def test_report_without_paths_rewrites_every_block_the_doc_names(toy, tmp_path, monkeypatch):
    _, source, doc = toy
    other = tmp_path / "other.json"  # the fixture's second block, whose file did not exist
    shutil.copy(source, other)
    monkeypatch.chdir(tmp_path)  # markers may name files from the current folder, as arguments do
    text = doc.read_text().replace(str(other), "other.json")
    doc.write_text(text)
    assert report.main(["--doc", str(doc), "--no-plots"]) == 0
    blocks = list(_blocks(doc.read_text()).values())
    assert len(blocks) == 2 and all("| toy | B=4 |" in block for block in blocks)
    assert "another file's block" not in doc.read_text()


def test_report_help_says_how_to_regenerate_the_whole_doc(capsys):
    with pytest.raises(SystemExit):
        report.main(["--help"])
    said = " ".join(capsys.readouterr().out.split())  # argparse wraps to the terminal's width
    assert "To regenerate all of docs/benchmarks.md: python -m dynbatch.bench report (no paths" in said


def _overhead_row(problem: str, column: str, whole_us: float, floor: float | None) -> dict:
    measured = column != "jax"
    return {"problem": problem, "case": "B=1", "column": column, "status": "ok", "whole_us": whole_us,
            "stack_us": 20.0 if measured else None, "program_us": whole_us - 30 if measured else None,
            "kernels_us": 10.0 if measured else None, "kernels_per_call": 2 if measured else None,
            "device": "cpu", "stack_is_frame": column == "dynbatch", "floor_over_jax": floor}


def test_the_overhead_table_keeps_a_row_per_case_beside_jax():
    """With JAX beside, the rows of the column with a floor, JAX's whole call as their last
    cell; without any floor, every row as measured."""
    rows = [_overhead_row(p, c, us, floor) for p in ("sweep", "hessian")
            for c, us, floor in (("dynbatch", 130.0, 0.46), ("dynbatch_outside", 520.0, None), ("jax", 65.0, None))]
    text = report.overhead_table({"overhead": rows})
    body = [line for line in text.splitlines() if line.startswith("| sweep") or line.startswith("| hessian")]
    assert body == [f"| {p} | B=1 | dynbatch | 130.0 | 20.0 | 100.0 | 10.0 | 2 | ×0.46 | 65.0 |" for p in ("sweep", "hessian")]
    assert "| jax whole us |" in text
    no_floor = [{**row, "floor_over_jax": None} for row in rows]
    assert sum(line.startswith("| sweep") for line in report.overhead_table({"overhead": no_floor}).splitlines()) == 3


def _outside_blocks(text: str) -> list[str]:
    """The doc's lines that no generated block holds."""
    return report.BLOCK.sub("", text).splitlines()


def test_benchmarks_md_shows_every_results_file_as_it_is(tmp_path, monkeypatch):
    """docs/benchmarks.md is what `report` (no paths: every block the doc names) makes of
    docs/results today, byte for byte; every results JSON has a block and every block its
    file; every plot a block links is committed; and the doc stays short (issue 63)."""
    monkeypatch.chdir(REPO)  # the markers name their files from the repository's root
    text = DOC.read_text()
    sources = set(report.named_sources(text))
    assert all(source.is_file() for source in sources), "a block names a results file that is not there"
    assert set(Path("docs/results").glob("*.json")) <= sources, "a results JSON without a block in docs/benchmarks.md"
    copy = tmp_path / "benchmarks.md"
    shutil.copy(DOC, copy)
    assert report.main(["--doc", str(copy), "--no-plots"]) == 0
    assert copy.read_text() == text, (
        "docs/benchmarks.md differs from docs/results: run python -m dynbatch.bench report")
    for link in re.findall(r"\]\((img/[^)]+)\)", text):
        assert (DOC.parent / link).is_file(), link
    assert len(text.splitlines()) <= 450, "docs/benchmarks.md: keep it to 450 lines (issue 63)"


def test_every_table_of_benchmarks_md_is_generated():
    """A table written by hand would drift from the runs: every `|...|` line lies in a block."""
    by_hand = [line for line in _outside_blocks(DOC.read_text()) if re.match(r"\s*\|.*\|\s*$", line)]
    assert not by_hand, f"tables outside the generated blocks of docs/benchmarks.md: {by_hand[:3]}"
