"""The OpInfo sweep's figures from ``DYNBATCH_OPINFO_RECORD`` files, merged
(a pytest-xdist run writes one per worker, which its terminal summary cannot see).

    python scripts/opinfo_figures.py /tmp/opinfo.json*
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import test_opinfo  # noqa: E402

if __name__ == "__main__":
    merged = test_opinfo.load_records(sys.argv[1:])
    for line in test_opinfo.figures(merged):
        print(line)
    for (kind, key), rs in sorted(merged.items()):
        bad = {r.status for r in rs} - test_opinfo._allowed(key, kind) - {"skip"}
        if bad:
            print(f"MISMATCH {kind} {key}: " + " | ".join(r.detail[:300] for r in rs if r.status in bad))
