"""``bench first_call``: cold then warm first calls per column, in fresh processes."""

from __future__ import annotations

import pytest

from dynbatch.bench import first_call
from dynbatch.records import PHASES


def test_the_table_gives_each_start_its_ratio_to_stock_and_every_phase():
    rows = [{"model": "pair N=8", "column": first_call.STOCK, "start": s, "seconds": t,
             "phases": dict.fromkeys(PHASES, 0.5), "caches": {"fxgraph_cache_hit": 1}}
            for s, t in (("cold", 10.0), ("warm", 2.0))]
    rows += [{"model": "pair N=8", "column": "dynbatch_step", "start": s, "seconds": t,
              "phases": dict.fromkeys(PHASES, 0.25), "caches": {}} for s, t in (("cold", 5.0), ("warm", 3.0))]
    rows.append({"model": "pair N=8", "column": "dynbatch_model_in", "start": "cold", "error": "boom"})
    lines = first_call._table(rows).splitlines()
    assert all(p in lines[0] for p in PHASES)
    assert "| pair N=8 | dynbatch_step | cold | 5.0 | 0.50 |" in lines[4]
    assert "| pair N=8 | dynbatch_step | warm | 3.0 | 1.50 |" in lines[5]
    assert "failed: boom" in lines[6]


@pytest.mark.slow  # two fresh processes, one cold Inductor compile of a training step
def test_a_warm_start_compiles_no_cpp_and_hits_inductors_cache(tmp_path):
    cold = first_call._run("dynbatch_step", "pair", 8, str(tmp_path), threads=1)
    warm = first_call._run("dynbatch_step", "pair", 8, str(tmp_path), threads=1)
    assert "error" not in cold and "error" not in warm, (cold, warm)
    assert cold["phases"]["cpp_compile"] > 0 and cold["dynbatch_graphs"] >= 1, cold
    assert warm["phases"]["cpp_compile"] == 0 and warm["caches"].get("autograd_cache_hit"), warm
    assert warm["seconds"] < cold["seconds"], (cold, warm)
    for run in (cold, warm):  # nothing counted twice: the phases fit in the call
        assert sum(run["phases"].values()) <= 1.02 * run["seconds"], run


def test_the_hessian_table_gives_ratios_to_eager_with_and_without_torch_compile():
    rows = [{"model": "message_passing N=8", "column": c, "start": "cold", "seconds": t, "call": call,
             "phases": dict.fromkeys(PHASES, 0.0), "caches": {}, "max_diff": 0.0}
            for c, t, call in (("eager", 0.02, 0.02), ("dynbatch+background", 0.2, 0.03))]
    lines = first_call._table(rows, first_call.REFERENCE["hessian"]).splitlines()
    assert "/ eager" in lines[0] and "call / eager's" in lines[0]
    assert "| message_passing N=8 | dynbatch+background | cold | 0.2 | 10.00 | 0.030 | 1.50 |" in lines[3], lines[3]


def test_a_hessian_around_the_model_run_eagerly_at_its_first_call_equals_eagers(tmp_path):
    """The columns that run the first call without a compile (fresh processes): eager's own,
    and stock's stance "eager_then_compile"; each compared with eager's Hessian."""
    for column in ("eager", "stock_eager_then_compile"):
        row = first_call._run(column, "message_passing", 8, str(tmp_path), threads=1, call="hessian")
        assert "error" not in row, row
        assert row["max_diff"] == 0.0 and 0 < row["call"] <= row["seconds"], row
