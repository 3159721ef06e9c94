#!/usr/bin/env bash
# The wheels the device tool's GPU machine lacks, fetched here into .whl/ (ignored by git),
# which scripts/device_check.sh installs first (carry: .whl).  That machine has no network
# and Python 3.12 (docs/testing.md, "CUDA"); its image already holds torch, numpy, scipy,
# h5py, matplotlib, pandas, torchmetrics, opt-einsum(-fx), pyyaml and tqdm.
#   bash scripts/device_wheels.sh          # expecttest (the snapshot tests) and MACE's stack
#   MACE=0 bash scripts/device_wheels.sh   # expecttest only
# MACE's stack: mace-torch and the requirements the image lacks, pinned to the versions
# tests/models/test_mace.py runs here (e3nn==0.4.4 is mace-torch's own pin, carried in case
# the image's differs).  About 6 MiB with expecttest; a call carries at most 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
DEST=.whl
mkdir -p "$DEST"
# The device README's platform list: pip matches a manylinux tag exactly.
PLATFORMS=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
           --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
# (grep: this host's pip config names local indexes that may be absent, a warning per package)
quiet() { "$@" 2> >(grep -v "is ignored: it is neither" >&2); }
fetch() { quiet "$PYTHON" -m pip download -q --no-deps --only-binary=:all: "${PLATFORMS[@]}" -d "$DEST" "$@"; }

fetch expecttest==0.3.0
if [ "${MACE:-1}" != 0 ]; then
  fetch mace-torch==0.3.16 e3nn==0.4.4 ase==3.29.0 matscipy==1.3.1 lmdb==3.0.0 orjson==3.13.0 torch-ema==0.3 \
        prettytable==3.18.0 wcwidth==0.9.4 ConfigArgParse==1.9.0 GitPython==3.2.1 gitdb==4.0.12 smmap==5.0.3
  # python-hostlist publishes no wheel: built here (pure Python).
  quiet "$PYTHON" -m pip wheel -q --no-deps -w "$DEST" python-hostlist==2.3.0
fi
du -sh "$DEST"
