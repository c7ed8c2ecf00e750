"""The README's example runs, so it cannot rot."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_example(name: str, redis_url: str) -> str:
    """Run ``examples/<name>`` against the session's Redis; its stdout (it must exit 0). Its
    workers inherit ``PYTHONFAULTHANDLER``: one stopped with SIGABRT prints its stack."""
    try:
        done = subprocess.run(
            [sys.executable, str(ROOT / "examples" / name)],
            env={**os.environ, "TASKDEDUP_URL": redis_url, "PYTHONFAULTHANDLER": "1"},
            capture_output=True, text=True, timeout=120,
        )
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"{name} still running after 120 s:\n{_text(exc.stdout)}"
                             f"{_text(exc.stderr)}") from exc
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _text(output: str | bytes | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


@pytest.mark.slow
def test_celery_example_charges_once(redis_url: str) -> None:
    import redis

    redis.Redis.from_url(redis_url).delete("charges:ORD-789")
    stdout = run_example("celery_app.py", redis_url)
    assert "charges recorded: 1" in stdout


@pytest.mark.slow
def test_rq_example_sends_the_email_once(redis_url: str) -> None:
    import redis

    redis.Redis.from_url(redis_url).delete("emails:42")
    stdout = run_example("rq_app.py", redis_url)
    assert "e-mails sent: 1" in stdout


@pytest.mark.slow
def test_webhook_receiver_turns_retried_deliveries_into_one_task(redis_url: str) -> None:
    stdout = run_example("webhook_receiver.py", redis_url)
    deliveries = [line for line in stdout.splitlines() if line.startswith("delivery -> ")]
    assert len(deliveries) == 3 and all(" 202 " in line for line in deliveries)
    assert len({line.split("'job': ")[1] for line in deliveries}) == 1  # one job id
    assert "reused key with another body -> 422" in stdout
    assert "payments booked: 1" in stdout
