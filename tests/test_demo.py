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
    done = subprocess.run(
        [sys.executable, "-m", "taskdedup", "demo", "--url", redis_url],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
        env={**os.environ, "COLUMNS": "120"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith(("│ Celery", "│ RQ"))]
    assert len(rows) == 2
    for row in rows:  # sent, enqueued, suppressed, skipped, executed, retried, once
        cells = [c.strip() for c in row.strip("│").split("│")]
        assert cells[1:] == ["20", "8", "12", "1", "7", "1", "yes"], row
    # the demo stopped the RQ worker it started (RQ records a clean shutdown as "death")
    client = redis.Redis.from_url(redis_url)
    workers = list(client.scan_iter("rq:worker:taskdedup-demo-*"))
    assert workers and all(client.hexists(k, "death") for k in workers)

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
