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


def _outbox_runs(orders: int, relayed: int, ledger_rows: int) -> list[demo.OutboxRun]:
    return [demo.OutboxRun(demo.OUTBOX_VARIANTS[0], orders, relayed, ledger_rows),
            demo.OutboxRun(demo.OUTBOX_VARIANTS[1], 1, 0, 0)]


def test_outbox_step_passes_when_the_relay_published_the_committed_call_once() -> None:
    console = Console(record=True, width=200)
    assert demo._report_outbox(console, _outbox_runs(1, 1, 1)) is True
    text = console.export_text()
    assert "the relay published it, and the charge was booked once" in text
    assert "the same kill left 1 committed order with 0 charges" in text


def test_outbox_step_fails_on_a_lost_or_doubled_charge() -> None:
    console = Console(record=True, width=200)
    assert demo._report_outbox(console, _outbox_runs(1, 0, 0)) is False  # lost
    assert demo._report_outbox(console, _outbox_runs(1, 1, 2)) is False  # booked twice
    assert demo._report_outbox(console, _outbox_runs(0, 1, 1)) is False  # order rolled back
    assert "with taskdedup.sql.outbox: 1 orders, 1 published by the relay, 2 ledger rows" in (
        console.export_text())
