#!/usr/bin/env bash
# The CUDA checks, for the device tool (a GPU machine with 16 cores), one phase
# per call so each fits its 10-minute limit.  Logs go to $OUT/run.log, the
# benchmark to $OUT/bench/ (written after every problem, so a run stopped at its
# limit still returns what it measured; the device tool returns at most 8 files).
# carry: .whl (the wheels the machine lacks: `bash scripts/device_wheels.sh` here fetches
# expecttest and MACE's stack for its Python 3.12; docs/testing.md).
#   PHASES="bench" (default): the CUDA benchmark, WORKLOADS (default every one, the
#       newest first) and VARIANTS (default the columns that can be the best other:
#       eager_loop, eager_vmap_chunked and stock_compile, never the fastest on CUDA, are
#       left out to fit; errors are then read against eager_batched); BENCH_ARGS
#       replaces all of it.  Every workload takes about 11 minutes on an H200, so a
#       full run is two calls on one lease (docs/benchmarks.md, "CUDA results").
#       Measured 2026-11-28: tests 90 s, ab 77 s, sweep ~100 s, force_training with
#       its CUDA-graph columns 225 s (it alone overran a 185 s BENCH_TIMEOUT); 2026-11-30:
#       tests 60 s, full_hessian,lj_forces,hessian 300 s.  With the machine's start, a lease of
#       15 minutes holds about 11 minutes of commands.  cuda.json's oldest rows (2026-11-27)
#       and the missing attention are the next card's call:
#         PHASES=bench BENCH_TIMEOUT=420 WORKLOADS=attention,mlp_jacobian,gelu_vjp,pinn,cnn_jacobian
#       then, where JAX still leads by 1.5-2x (`full_hessian/lj` N = 500: 8.88 against 4.45 ms),
#       which kernels cost: PHASES=profile PROFILE_TIMEOUT=150
#         PROFILE_ARGS="--workloads full_hessian --atoms 500 --variants compiled_func,dynbatch"
#       MACE on CUDA (never run there yet; its stack travels in .whl, and the same wheels
#       import MACE and pass tests/models/test_mace.py under Python 3.12 and torch 2.11 on
#       this CPU): PHASES=bench BENCH_TIMEOUT=420 BENCH_ARGS="--min-time 0.1 --workloads mace"
#       (the three calls, columns eager, stock_mace_prep and dynbatch, empty compile caches).
#   PHASES="tests": tests/test_cuda.py (TESTS narrows or widens it), in parallel
#       with the OpInfo sweep on CUDA (OPINFO_K narrows it; its figures, merged over
#       pytest-xdist's workers, end its log); OVERHEAD_TIMEOUT>0 then runs
#       `python -m dynbatch.bench overhead` (OVERHEAD_ARGS replaces its arguments, e.g.
#       "--workloads hessian,sweep --variants compiled_func,dynbatch,dynbatch_outside", or
#       "--workloads force_training" for a training step's programs and the rest).
#   PHASES="ab": `python -m dynbatch.bench ab` on CUDA, AB_SETTING (default
#       dynbatch.recompute=never,auto,always: store or recompute, and "always" stores
#       the B-free factors "auto" stores on the CPU only, docs/design.md) over
#       AB_WORKLOADS (default full_hessian,lj_forces,hessian), AB_TIMEOUT (default 420) s.
#   PHASES="profile": `python -m dynbatch.bench overhead --top 8` on CUDA, each column's
#       costliest kernels beside its stack and program times (PROFILE_ARGS, default the
#       `hessian` rows, where dynbatch's kernels took 8.35 ms and the same kernels replayed
#       as CUDA graphs 4.88), PROFILE_TIMEOUT (default 240) s.
#   PHASES="bench tests": both, in that order.
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
TESTS="${TESTS:-tests/test_cuda.py}"
# --warm-cache: columns that generate the same kernels share them (first calls then
# under-report compile time; the steady times are unaffected).
WORKLOADS="${WORKLOADS:-force_training,full_hessian,sweep,attention,hessian,lj_forces,mlp_jacobian,gelu_vjp,pinn,cnn_jacobian}"
VARIANTS="${VARIANTS:-eager_batched,eager_vmap,compiled_func,dynbatch,dynbatch_cudagraphs,dynbatch_outside,dynbatch_outside_cudagraphs,jax}"
BENCH_ARGS="${BENCH_ARGS:---min-time 0.1 --warm-cache --workloads $WORKLOADS --variants $VARIANTS}"

for phase in ${PHASES:-bench}; do
  case "$phase" in
  tests)
    # Correctness runs side by side: nothing here is timed.
    timeout "${PYTEST_TIMEOUT:-240}" "${PYTEST[@]}" $(workers "${TEST_WORKERS:-4}") $TESTS > /tmp/pytest.log 2>&1 &
    tests=$!
    DYNBATCH_OPINFO_DEVICE="$DEVICE" DYNBATCH_OPINFO_STRIDE=1 \
      timeout "${OPINFO_TIMEOUT:-240}" "${PYTEST[@]}" $(workers "${OPINFO_WORKERS:-10}") tests/test_opinfo.py \
      ${OPINFO_K:+-k "$OPINFO_K"} > /tmp/opinfo.log 2>&1 &
    opinfo=$!
    wait $tests; echo "pytest exit $?" >> /tmp/pytest.log
    wait $opinfo; echo "opinfo exit $?" >> /tmp/opinfo.log
    section pytest; cat /tmp/pytest.log >> "$LOG"
    section opinfo; cat /tmp/opinfo.log >> "$LOG"
    tail -3 /tmp/pytest.log; tail -3 /tmp/opinfo.log; grep -E "^(FAILED|ERROR)" /tmp/pytest.log /tmp/opinfo.log | head -30
    if [ "${OVERHEAD_TIMEOUT:-0}" -gt 1 ]; then
      section call overhead
      # shellcheck disable=SC2086 - OVERHEAD_ARGS is a list of words
      timeout "$OVERHEAD_TIMEOUT" python3 -m dynbatch.bench overhead --device "$DEVICE" \
        ${OVERHEAD_ARGS:---batch-sizes 1,4,16} >> "$LOG" 2>&1
    fi
    ;;
  ab)
    section "ab ${AB_SETTING:-dynbatch.recompute=never,auto,always}"
    timeout "${AB_TIMEOUT:-420}" python3 -m dynbatch.bench ab "${AB_SETTING:-dynbatch.recompute=never,auto,always}" \
      --device "$DEVICE" --min-time 0.1 --workloads "${AB_WORKLOADS:-full_hessian,lj_forces,hessian}" >> "$LOG" 2>&1
    echo "ab exit $?" >> "$LOG"
    tail -40 "$LOG"
    ;;
  profile)
    section profile
    # shellcheck disable=SC2086 - PROFILE_ARGS is a list of words
    timeout "${PROFILE_TIMEOUT:-240}" python3 -m dynbatch.bench overhead --device "$DEVICE" --top 8 \
      ${PROFILE_ARGS:---workloads hessian --batch-sizes 8 --variants compiled_func,dynbatch,dynbatch_cudagraphs} \
      >> "$LOG" 2>&1
    echo "profile exit $?" >> "$LOG"
    tail -40 "$LOG"
    ;;
  bench)
    section bench
    # shellcheck disable=SC2086 - BENCH_ARGS is a list of words
    timeout "${BENCH_TIMEOUT:-420}" python3 -m dynbatch.bench --device "$DEVICE" --out "$OUT/bench" --no-progress \
      $BENCH_ARGS >> "$LOG" 2>&1
    echo "bench exit $?" >> "$LOG"
    tail -40 "$LOG"
    ;;
  esac
done
