"""The README's example runs, so it cannot rot."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_celery_example_charges_once(redis_url: str) -> None:
    import redis

    redis.Redis.from_url(redis_url).delete("charges:ORD-789")
    env = {**os.environ, "TASKDEDUP_URL": redis_url}
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "celery_app.py")],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "charges recorded: 1" in done.stdout


@pytest.mark.slow
def test_rq_example_sends_the_email_once(redis_url: str) -> None:
    import redis

    redis.Redis.from_url(redis_url).delete("emails:42")
    env = {**os.environ, "TASKDEDUP_URL": redis_url}
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "rq_app.py")],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "e-mails sent: 1" in done.stdout


@pytest.mark.slow
def test_webhook_receiver_turns_retried_deliveries_into_one_task(redis_url: str) -> None:
    env = {**os.environ, "TASKDEDUP_URL": redis_url}
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "webhook_receiver.py")],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    deliveries = [line for line in done.stdout.splitlines() if line.startswith("delivery -> ")]
    assert len(deliveries) == 3 and all(" 202 " in line for line in deliveries)
    assert len({line.split("'job': ")[1] for line in deliveries}) == 1  # one job id
    assert "reused key with another body -> 422" in done.stdout
    assert "payments booked: 1" in done.stdout
