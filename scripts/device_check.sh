#!/usr/bin/env bash
# The CUDA checks, for one call of the device tool (a GPU machine with 16 cores).
# Logs go to $OUT/run.log, the benchmark to $OUT/bench/ (written after every
# problem, so a run stopped at its limit still returns what it measured; the
# device tool returns at most 8 files).  carry: .whl (expecttest wheel; docs/testing.md).
#   PHASES="tests" (default): the CUDA tests and the core suite (pytest-xdist), in
#       parallel with the OpInfo sweep on CUDA; then scripts/call_overhead.py
#       (OVERHEAD_TIMEOUT=0 skips it).  TESTS and OPINFO_K narrow the tests.
#   PHASES="bench": the CUDA benchmark (BENCH_ARGS added).
#   PHASES="tests bench": both, in that order.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/device-out}"; mkdir -p "$OUT"
LOG="$OUT/run.log"
section() { echo "=== $* ($(date -u +%T))" >> "$LOG"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > /tmp/install.log 2>&1 \
  || { echo "editable install failed; using PYTHONPATH" >> "$LOG"; export PYTHONPATH="${PYTHONPATH:-}:$PWD"; }
section env
{ nvidia-smi -L; nproc; python3 -c "import torch, jax; print(torch.__version__, torch.cuda.get_device_name(), 'jax', jax.__version__)"; } >> "$LOG" 2>&1
DEVICE="${DEVICE:-cuda}"
PYTEST=(python3 -m pytest -q -p no:cacheprovider -o addopts= -m "not slow")
workers() { python3 -c "import xdist" 2>/dev/null && echo "-n $1"; }  # pytest-xdist, where installed
TESTS="${TESTS:-tests/test_cuda.py tests/test_core.py tests/test_recompiles.py tests/test_bad_inputs.py
  tests/test_batching_pass.py tests/test_codegen.py tests/test_lowering_passes.py tests/test_outside.py
  tests/test_requires_grad_tracing.py tests/test_fail_soft.py}"

for phase in ${PHASES:-tests}; do
  case "$phase" in
  tests)
    # Correctness runs side by side: nothing here is timed.
    timeout "${PYTEST_TIMEOUT:-240}" "${PYTEST[@]}" $(workers "${TEST_WORKERS:-6}") $TESTS > /tmp/pytest.log 2>&1 &
    tests=$!
    DYNBATCH_OPINFO_DEVICE="$DEVICE" DYNBATCH_OPINFO_STRIDE=1 DYNBATCH_OPINFO_RECORD=/tmp/opinfo.json \
      timeout "${OPINFO_TIMEOUT:-240}" "${PYTEST[@]}" $(workers "${OPINFO_WORKERS:-8}") tests/test_opinfo.py \
      ${OPINFO_K:+-k "$OPINFO_K"} > /tmp/opinfo.log 2>&1 &
    opinfo=$!
    wait $tests; echo "pytest exit $?" >> /tmp/pytest.log
    wait $opinfo; echo "opinfo exit $?" >> /tmp/opinfo.log
    section pytest; cat /tmp/pytest.log >> "$LOG"
    section opinfo; cat /tmp/opinfo.log >> "$LOG"
    section opinfo figures; python3 scripts/opinfo_figures.py /tmp/opinfo.json* >> "$LOG" 2>&1
    tail -3 /tmp/pytest.log; tail -3 /tmp/opinfo.log; grep -E "^(FAILED|ERROR)" /tmp/pytest.log /tmp/opinfo.log | head -30
    if [ "${OVERHEAD_TIMEOUT:-90}" -gt 1 ]; then
      section call overhead
      timeout "${OVERHEAD_TIMEOUT:-90}" python3 scripts/call_overhead.py --device "$DEVICE" --batch-sizes 1,4,16 \
        >> "$LOG" 2>&1
    fi
    ;;
  bench)
    section bench
    timeout "${BENCH_TIMEOUT:-420}" python3 -m dynbatch.bench --device "$DEVICE" --out "$OUT/bench" --no-progress \
      ${BENCH_ARGS:-} >> "$LOG" 2>&1
    echo "bench exit $?" >> "$LOG"
    tail -30 "$LOG"
    ;;
  esac
done
