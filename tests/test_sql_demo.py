"""The demo's durable-tier step judges what it saw: one ledger row and the first run's stored
result, or a failure (the whole demo, with its real workers, is tests/test_demo.py)."""

from __future__ import annotations

import json

from rich.console import Console

from taskdedup import demo


def _runs(durable_rows: int, returned_attempt: int) -> list[demo.DurableRun]:
    stored = json.dumps({"charged": 5000, "attempt": returned_attempt})
    return [demo.DurableRun(demo.DURABLE_VARIANTS[0], 2, durable_rows, stored),
            demo.DurableRun(demo.DURABLE_VARIANTS[1], 2, 2, json.dumps(
                {"charged": 5000, "attempt": 2}))]


def test_durable_step_passes_on_one_row_and_the_stored_result() -> None:
    console = Console(record=True, width=200)
    assert demo._report_durable(console, _runs(1, 1)) is True
    text = console.export_text()
    assert "one ledger row, and it returned the first run's stored result" in text
    assert "booked the charge 2 times" in text


def test_durable_step_fails_on_a_second_row_or_a_recomputed_result() -> None:
    console = Console(record=True, width=200)
    assert demo._report_durable(console, _runs(2, 1)) is False
    assert demo._report_durable(console, _runs(1, 2)) is False
    assert "with taskdedup.sql: 2 ledger rows" in console.export_text()
