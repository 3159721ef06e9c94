#!/usr/bin/env bash
# One run on the CUDA machine (device tool): CUDA tests, the core suite on that
# machine's torch (2.11: the other Dynamo/AOTAutograd path), the stock-vs-dynbatch
# comparison and the CUDA benchmark. Logs go to $OUT.
#   carry: .whl (expecttest wheel, see docs/benchmarks.md)
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/install.log" 2>&1 \
  || { echo "editable install failed; using PYTHONPATH" >> "$OUT/install.log"; export PYTHONPATH="${PYTHONPATH:-}:$PWD"; }
{ nvidia-smi -L; python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"; } > "$OUT/env.log" 2>&1
timeout "${PYTEST_TIMEOUT:-330}" python3 -m pytest -q -p no:cacheprovider -o addopts="" -m "not slow" \
  tests/test_cuda.py tests/test_core.py tests/test_symbolic_batch.py tests/test_errors.py tests/test_install.py \
  tests/test_batching_pass.py tests/test_codegen.py tests/test_snapshots.py ${EXTRA_TESTS:-} 2>&1 | tee "$OUT/pytest.log" | tail -25
timeout "${STOCK_TIMEOUT:-150}" python3 scripts/stock_vs_dynbatch.py --device cuda --timeout "${STOCK_TASK_TIMEOUT:-60}" 2>&1 | tee "$OUT/stock.log"
if [ -n "${BENCH_ARGS:-}" ]; then
  timeout "${BENCH_TIMEOUT:-200}" python3 -m dynbatch.bench --device cuda --out /tmp/bench $BENCH_ARGS > "$OUT/bench.log" 2>&1
  tar czf "$OUT/bench.tgz" -C /tmp bench
  tail -40 "$OUT/bench.log"
fi
