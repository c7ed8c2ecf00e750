"""Real workers of ``tests.fetch_app`` for the reliable-fetch tests (SPEC §17), and what the
tests read back: which bodies ran, what is held where."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterable

import redis

from taskdedup import processing
from taskdedup.testing import wait_for
from tests.workers import ROOT, CeleryWorker

PREFIX = "taskdedup"  # tests.fetch_app's (the default)


class FetchWorker(CeleryWorker):
    """``celery -A tests.fetch_app worker``: the reliable fetch, or kombu's (``fetch``)."""

    app_module = "tests.fetch_app"
    # A prefork pool process whose last task ends after Celery's warm shutdown stopped reading
    # results waits up to 30 s for the main process to count that result (billiard 4.3's
    # _ensure_messages_consumed: 300 x 0.1 s) before it exits; seen here, under load, in 2
    # of ~50 runs of the warm-shutdown test. A shutdown slower than that is still reported,
    # with every process's stacks (_stuck).
    stop_timeout = 45.0

    def __init__(self, redis_url: str, *, queue: str, fetch: str = "reliable",
                 pool: str = "solo", concurrency: int = 1, lease: float = 3.0,
                 env: dict[str, str] | None = None) -> None:
        super().__init__(redis_url, queue=queue, concurrency=concurrency, pool=pool, env={
            "TASKDEDUP_TEST_FETCH": fetch, "TASKDEDUP_TEST_FETCH_LEASE": str(lease),
            **(env or {})})
        self.fetch = fetch

    def launch(self) -> FetchWorker:
        """Start without waiting (see :func:`start_all`)."""
        env = {**os.environ, **self.environment(), **self.extra_env}
        self.log_start = self.log.stat().st_size
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen(
                self.command(), cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )
        return self

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid


def start_all(workers: Iterable[FetchWorker], timeout: float = 90.0) -> list[FetchWorker]:
    """Start workers side by side (their start-ups overlap) and wait until each is ready."""
    started = [worker.launch() for worker in workers]
    for worker in started:
        wait_for(worker._started, timeout=timeout, what=f"{worker.kind} ready")
    return started


def held(rc: redis.Redis) -> int:
    """Messages in every processing list."""
    return sum(holder.held for holder in processing.holders(rc, PREFIX))


def unacked(rc: redis.Redis) -> int:
    """Messages in kombu's unacked hash (kombu's own fetch)."""
    return int(rc.hlen("unacked"))


def ran(rc: redis.Redis, label: str) -> int:
    """How many times ``label``'s body ran."""
    return int(rc.llen(f"fetch:ran:{label}"))
