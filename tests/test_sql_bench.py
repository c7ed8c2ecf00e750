"""The durable tier's and the outbox's benchmarks (``python -m benchmarks durable --quick``,
``python -m benchmarks outbox --quick``) run, so they cannot rot: every comparison produces
its rows, on SQLite and on a PostgreSQL each starts itself (the outbox's: the producer for
Celery and RQ, and the relay rows). Nothing here asserts a time or a ratio."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


def quick_rows(section: str, tmp_path: Path) -> list[dict[str, Any]]:
    """``python -m benchmarks <section> --quick``'s rows (from its --json file); every row has
    a time, and every row with a baseline has a ratio."""
    out = tmp_path / f"{section}.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", section, "--quick", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=240, check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows: list[dict[str, Any]] = json.loads(out.read_text())["rows"]
    assert all(r["median"] > 0 for r in rows)
    assert all(r["ratio_median"] is not None for r in rows if r["baseline"])
    return rows


def test_durable_benchmark_quick_run_reports_every_row(tmp_path: Path) -> None:
    names = {(r["section"], r["name"]) for r in quick_rows("durable", tmp_path)}
    for database in ("SQLite file", "PostgreSQL, durable commit",
                     "PostgreSQL, synchronous_commit=off"):
        for variant in ("plain transaction", "with effects", "with effects + fx.result",
                        "redelivered run (not first)"):
            assert (f"durable tier, {database}", variant) in names
        assert (f"durable tier, {database}, RQ end to end",
                "RQ job: with effects + fx.result") in names


def test_outbox_benchmark_quick_run_reports_every_row(tmp_path: Path) -> None:
    names = {(r["section"], r["name"]) for r in quick_rows("outbox", tmp_path)}
    for database in ("SQLite file", "PostgreSQL, durable commit"):
        for name in ("celery: commit, then .delay()", "celery: outbox.add + commit",
                     "rq: commit, then .enqueue()", "rq: outbox.add + commit"):
            assert (f"outbox producer, {database}", name) in names
    relay = "outbox relay, PostgreSQL, durable commit"
    assert (relay, "celery: 2 relay(s), batch 100") in names
