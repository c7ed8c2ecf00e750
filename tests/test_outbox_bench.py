"""The outbox's benchmark (``python -m benchmarks outbox --quick``) runs, so it cannot rot:
the producer comparison on SQLite and PostgreSQL for Celery and RQ, and the relay rows.
Nothing here asserts a time or a ratio."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


def test_outbox_benchmark_quick_run_reports_every_row(tmp_path: Path) -> None:
    out = tmp_path / "outbox.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "outbox", "--quick", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=240, check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    names = {(r["section"], r["name"]) for r in rows}
    for database in ("SQLite file", "PostgreSQL, durable commit"):
        for name in ("celery: commit, then .delay()", "celery: outbox.add + commit",
                     "rq: commit, then .enqueue()", "rq: outbox.add + commit"):
            assert (f"outbox producer, {database}", name) in names
    relay = "outbox relay, PostgreSQL, durable commit"
    assert (relay, "celery: 2 relay(s), batch 100") in names
    assert all(r["median"] > 0 for r in rows)
    assert all(r["ratio_median"] is not None for r in rows if r["baseline"])
