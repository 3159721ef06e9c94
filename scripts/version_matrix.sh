#!/usr/bin/env bash
# The test suite on several torch versions, one venv each (reused if present).
#   bash scripts/version_matrix.sh                      # 2.11.0 2.12.1 2.13.0 2.14.1, the default suite
#   VERSIONS="2.11.0" TESTS="tests/test_core.py" bash scripts/version_matrix.sh
# The PyPI builds of 2.11, 2.12 and 2.14 bring CUDA libraries (a few GB) and run
# on the CPU.  Logs: $OUT_DIR/torch-<version>.log, and a summary line per version.
set -uo pipefail
cd "$(dirname "$0")/.."
VERSIONS="${VERSIONS:-2.11.0 2.12.1 2.13.0 2.14.1}"
VENV_ROOT="${VENV_ROOT:-.venvs}"
OUT_DIR="${OUT_DIR:-version-matrix}"
mkdir -p "$VENV_ROOT" "$OUT_DIR"
for v in $VERSIONS; do
  venv="$VENV_ROOT/torch-$v"
  log="$OUT_DIR/torch-$v.log"
  # the README's extras: op_db needs numpy, which torch's PyPI builds do not bring
  { [ -x "$venv/bin/python" ] || python3 -m venv "$venv"; } \
    && "$venv/bin/pip" install -q "torch==$v" -e '.[test,bench]' > "$log" 2>&1 \
    || { echo "torch $v: install failed (see $log)"; continue; }
  # shellcheck disable=SC2086
  "$venv/bin/python" -m pytest -q ${TESTS:-} >> "$log" 2>&1
  echo "torch $v: exit $? - $(grep -E '^[0-9]+ (passed|failed)|^=+ .*(passed|failed)' "$log" | tail -1)"
done
