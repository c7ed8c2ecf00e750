"""``taskdedup demo``, the README's first command, runs to its table against real workers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_demo_proves_exactly_once_against_real_workers(redis_url: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    done = subprocess.run(  # piped: 80 columns, as `taskdedup demo | cat` (#24 stumble 9)
        [sys.executable, "-m", "taskdedup", "demo", "--url", redis_url],
        cwd=ROOT, capture_output=True, text=True, timeout=240, env=env,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    for column in COLUMNS:  # every column defined, each definition on one whole line
        assert any(line.startswith(f"{column}: ") for line in lines), column
    assert "  15 payment webhooks (5 orders, each delivered 3 times)" in lines
    assert "  1 redelivered copy that never went through the gate" in lines
    assert any(line.startswith("✓ RQ: each of the 7 side effects") and
               line.endswith("happened exactly once") for line in lines)
    assert any(line.startswith("✓ with taskdedup.sql.outbox the call committed with the "
                               "order") for line in lines), done.stdout
    assert "  enqueued after the commit, the same kill left 1 committed order with 0 charges" in (
        " ".join(lines)), done.stdout
    outbox_rows = [line for line in lines if line.startswith(("│ with taskdedup.sql.outbox",
                                                               "│ enqueue after the commit"))]
    assert [[c.strip() for c in row.strip("│").split("│")][1:] for row in outbox_rows] == [
        ["1", "1", "1", "yes"], ["1", "0", "0", "no"]], done.stdout
    rows = [line for line in done.stdout.splitlines() if line.startswith(("│ Celery", "│ RQ"))]
    assert len(rows) == 2
    for row in rows:  # sent, enqueued, suppressed, skipped, executed, retried, once
        cells = [c.strip() for c in row.strip("│").split("│")]
        assert cells[1:] == ["20", "8", "12", "1", "7", "1", "yes"], row
    # the demo stopped the RQ worker it started (RQ records a clean shutdown as "death")
    client = redis.Redis.from_url(redis_url)
    workers = list(client.scan_iter("rq:worker:taskdedup-demo-*"))
    assert workers and all(client.hexists(k, "death") for k in workers)

COLUMNS = ("sent", "enqueued", "suppressed", "skipped", "executed", "retried", "once")


def test_the_legend_defines_every_column_and_breaks_down_the_sends_without_wrapping(
    redis_url: str,
) -> None:
    """#24 stumble 9: the legend defined 2 of 7 columns, in a paragraph that a pipe's 80
    columns wrapped mid-phrase."""
    import re

    from rich.console import Console

    from taskdedup import demo

    demo.URL, demo._client = redis_url, None
    tally = demo.Tally(handles=["a"])
    for kind, n in ((demo.WEBHOOKS, 15), (demo.CLICKS, 2), (demo.SYNCS, 2),
                    (demo.REDELIVERY, 1)):
        for _ in range(n):
            tally.count(kind)
    console = Console(record=True, width=80, force_terminal=False)
    demo._report(console, {"Celery": tally, "RQ": tally})
    lines = console.export_text().splitlines()
    header = next(line for line in lines if "suppressed" in line)
    assert [c.strip() for c in header.strip("┃").split("┃")][1:] == list(COLUMNS)
    defined = [line for line in lines if re.match(r"[a-z]+: ", line)]
    assert [line.split(":")[0] for line in defined] == list(COLUMNS)
    assert all(len(line) > 40 for line in defined)  # whole sentences, none cut to a stub
    breakdown = lines[lines.index(defined[0]) + 1:lines.index(defined[1])]
    assert sum(int(line.split()[0]) for line in breakdown) == tally.sent == 20
    assert f"  2 {demo.SYNCS}" in breakdown


def test_demo_report_fails_when_an_effect_ran_twice(redis_url: str) -> None:
    from rich.console import Console

    from taskdedup import demo

    demo.URL, demo._client = redis_url, None
    client = redis.Redis.from_url(redis_url)
    client.delete(f"{demo.PREFIX}:effects:celery")
    for what in demo.EXPECTED:
        client.hincrby(f"{demo.PREFIX}:effects:celery", what, 1)
    console = Console(record=True, width=200)
    assert demo._report(console, {"Celery": demo.Tally(sent=1, handles=["a"])}) is True
    client.hincrby(f"{demo.PREFIX}:effects:celery", "charge ORD-101", 1)
    assert demo._report(console, {"Celery": demo.Tally(sent=1, handles=["a"])}) is False
    assert "charge ORD-101 happened 2 times" in console.export_text()


def test_demo_without_its_extra_says_which_extra_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import importlib.util

    from click.testing import CliRunner

    from taskdedup.cli import main

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "celery" else real_find_spec(name, *a))
    result = CliRunner().invoke(main, ["demo"])
    assert result.exit_code == 1
    assert "taskdedup demo needs celery: pip install 'taskdedup[demo]'" in result.output
