#!/usr/bin/env bash
# The CUDA checks, for one call of the device tool (a GPU machine with 16 cores).
# Logs go to $OUT.  carry: .whl (expecttest wheel; docs/testing.md says how).
#   PHASES="tests" (default): the CUDA tests and the core suite (pytest-xdist), in
#       parallel with the OpInfo sweep on CUDA; then the sweep workload of the bench
#       and scripts/call_overhead.py.
#   PHASES="bench": the full CUDA benchmark (BENCH_ARGS added), its results in $OUT.
#   PHASES="tests bench": both, in that order.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/device-out}"; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/install.log" 2>&1 \
  || { echo "editable install failed; using PYTHONPATH" >> "$OUT/install.log"; export PYTHONPATH="${PYTHONPATH:-}:$PWD"; }
{ nvidia-smi -L; nproc; python3 -c "import torch, jax; print(torch.__version__, torch.cuda.get_device_name(), 'jax', jax.__version__)"; } > "$OUT/env.log" 2>&1
DEVICE="${DEVICE:-cuda}"
PYTEST=(python3 -m pytest -q -p no:cacheprovider -o addopts= -m "not slow")
workers() { python3 -c "import xdist" 2>/dev/null && echo "-n $1"; }  # pytest-xdist, where installed
TESTS="${TESTS:-tests/test_cuda.py tests/test_core.py tests/test_symbolic_batch.py tests/test_errors.py
  tests/test_batching_pass.py tests/test_codegen.py tests/test_lowering_passes.py tests/test_outside.py}"

for phase in ${PHASES:-tests}; do
  case "$phase" in
  tests)
    # Correctness runs side by side: nothing here is timed.
    timeout "${PYTEST_TIMEOUT:-240}" "${PYTEST[@]}" $(workers "${TEST_WORKERS:-6}") $TESTS > "$OUT/pytest.log" 2>&1 &
    tests=$!
    DYNBATCH_OPINFO_DEVICE="$DEVICE" DYNBATCH_OPINFO_RECORD=/tmp/opinfo.json \
      timeout "${OPINFO_TIMEOUT:-240}" "${PYTEST[@]}" $(workers "${OPINFO_WORKERS:-8}") tests/test_opinfo.py \
      ${OPINFO_K:+-k "$OPINFO_K"} > "$OUT/opinfo.log" 2>&1 &
    opinfo=$!
    wait $tests; echo "pytest exit $?" >> "$OUT/pytest.log"
    wait $opinfo; echo "opinfo exit $?" >> "$OUT/opinfo.log"
    python3 scripts/opinfo_figures.py /tmp/opinfo.json* > "$OUT/opinfo_figures.log" 2>&1
    tail -4 "$OUT/pytest.log"; tail -3 "$OUT/opinfo.log"; cat "$OUT/opinfo_figures.log" | head -20
    grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -30
    timeout "${OVERHEAD_TIMEOUT:-90}" python3 scripts/call_overhead.py --device "$DEVICE" --batch-sizes 1,4,16 \
      > "$OUT/overhead.log" 2>&1; grep "^|" "$OUT/overhead.log"
    ;;
  bench)
    timeout "${BENCH_TIMEOUT:-420}" python3 -m dynbatch.bench --device "$DEVICE" --out /tmp/bench --no-progress \
      ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
    echo "bench exit $?" >> "$OUT/bench.log"
    tar czf "$OUT/bench.tgz" -C /tmp bench
    tail -30 "$OUT/bench.log"
    ;;
  esac
done
