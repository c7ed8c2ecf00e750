"""The body every benchmark task and job runs, and the RQ job function.

This module imports nothing but redis-py: RQ's forking ``Worker`` imports a job's module in
each work-horse (a fork that exits after one job), so a heavy import here would be paid per
job and would swamp what is measured.

The body: ``INCR {run}:done``, and the wall-clock time of the first and of the last body
(``{run}:t0`` / ``{run}:t1``), so the throughput of a drain is measured by the workers' own
side effects, from the first body to the last, without any start-up time. ``run`` is
``"<unique run key>|<number of tasks>"``. The server is in ``TASKDEDUP_BENCH_URL``.
"""

from __future__ import annotations

import os
import time

import redis

__all__ = ["ENV_URL", "effect", "rq_charge"]

ENV_URL = "TASKDEDUP_BENCH_URL"

_client: redis.Redis | None = None


def _redis() -> redis.Redis:
    """A client for this process (a new one after a fork)."""
    global _client
    if _client is None or _client.connection_pool.pid != os.getpid():  # type: ignore[attr-defined]
        _client = redis.Redis.from_url(os.environ[ENV_URL])
    return _client


def effect(run: str) -> None:
    """The side effect of one body: count it, and time the first and the last."""
    key, _, total = run.rpartition("|")
    client = _redis()
    done = int(client.incr(f"{key}:done"))
    if done == 1:
        client.set(f"{key}:t0", repr(time.time()), ex=3600)
    if done == int(total):
        client.set(f"{key}:t1", repr(time.time()), ex=3600)


def rq_charge(user_id: int, amount_cents: int, currency: str, order_id: str, run: str) -> None:
    """The RQ job: same five arguments and body as the Celery tasks."""
    effect(run)

