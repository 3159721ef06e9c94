"""File snapshots in expected/, with expecttest's accept convention.

expecttest only has inline snapshots; graphs are long, so they live in files.
``EXPECTTEST_ACCEPT=1`` rewrites them; otherwise a missing or stale snapshot
fails with a diff.
"""

from __future__ import annotations

import difflib
import os
import pathlib

EXPECTED_DIR = pathlib.Path(__file__).resolve().parent.parent / "expected"


def accepting() -> bool:
    return os.environ.get("EXPECTTEST_ACCEPT", "0") not in ("", "0")


def assert_snapshot(name: str, actual: str) -> None:
    path = EXPECTED_DIR / f"{name}.txt"
    if accepting():
        EXPECTED_DIR.mkdir(exist_ok=True)
        path.write_text(actual)
        return
    if not path.exists():
        raise AssertionError(
            f"snapshot {path.name} is missing; run with EXPECTTEST_ACCEPT=1 to create it and review the diff"
        )
    expected = path.read_text()
    if expected != actual:
        diff = "".join(difflib.unified_diff(
            expected.splitlines(keepends=True), actual.splitlines(keepends=True),
            fromfile=f"expected/{path.name}", tofile="actual"))
        raise AssertionError(
            f"snapshot {path.name} is stale (EXPECTTEST_ACCEPT=1 rewrites it):\n{diff}"
        )
