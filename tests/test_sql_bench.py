"""The durable tier's benchmark (``python -m benchmarks durable --quick``) runs, so it cannot
rot: every comparison produces its rows, on SQLite and on a PostgreSQL it starts itself.
Nothing here asserts a time or a ratio."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


def test_durable_benchmark_quick_run_reports_every_row(tmp_path: Path) -> None:
    out = tmp_path / "durable.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "durable", "--quick", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=240, check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    names = {(r["section"], r["name"]) for r in rows}
    for database in ("SQLite file", "PostgreSQL, durable commit",
                     "PostgreSQL, synchronous_commit=off"):
        for variant in ("plain transaction", "with effects", "with effects + fx.result",
                        "redelivered run (not first)"):
            assert (f"durable tier, {database}", variant) in names
        assert (f"durable tier, {database}, RQ end to end",
                "RQ job: with effects + fx.result") in names
    assert all(r["median"] > 0 for r in rows)
    assert all(r["ratio_median"] is not None for r in rows if r["baseline"])
