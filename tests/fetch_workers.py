"""Real workers of ``tests.fetch_app`` for the reliable-fetch tests (SPEC §17), and what the
tests read back: which bodies ran, what is held where."""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterable
from typing import Any

import redis

from taskdedup import processing
from taskdedup.celery import get_deduplicator
from taskdedup.stores.base import LockState
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


def clear_processing(rc: redis.Redis) -> None:
    """Forget every processing list and owner on the server, before a module starts its own
    workers: what a module run earlier on this server left (a test's fake live owner, with
    its 30 s lease) would count as held here (seen in CI when the modules' order changed)."""
    keys = list(rc.scan_iter(match=f"{PREFIX}:fetch:*", count=1000))
    if keys:
        rc.delete(*keys)


def held(rc: redis.Redis) -> int:
    """Messages in every processing list."""
    return sum(holder.held for holder in processing.holders(rc, PREFIX))


def unacked(rc: redis.Redis) -> int:
    """Messages in kombu's unacked hash (kombu's own fetch)."""
    return int(rc.hlen("unacked"))


def ran(rc: redis.Redis, label: str) -> int:
    """How many times ``label``'s body ran."""
    return int(rc.llen(f"fetch:ran:{label}"))


def lose_an_ack_and_stop(fapp: Any, rc: redis.Redis, worker: FetchWorker, queue: str,
                         by_name: bool) -> tuple[str, str]:
    """Have ``worker`` (prefork -c 2) run a gated call whose message is never acked
    (``tests.fetch_app.AckLost``, as Celery's closing pool leaves one) beside a 6 s task,
    warm-stop it (the stop waits for that task), and wait until the call's tombstone (its
    3 s lease) lapsed: a message put back now would run again. ``by_name``: sent with
    ``send_task`` (no lock key in its header). The two labels: ``(gated, slow)``."""
    task = fapp.gated_ack_lost
    dedup = get_deduplicator(fapp.app)
    slow = f"slow-{uuid.uuid4().hex[:8]}"
    fapp.work.apply_async((slow, 6.0), queue=queue)
    wait_for(lambda: ran(rc, slow) == 1, timeout=20, what="the slow task started")
    label = f"g-{uuid.uuid4().hex[:8]}"
    handle = (fapp.app.send_task(task.name, (label,), queue=queue) if by_name
              else task.apply_async((label,), queue=queue))
    key = dedup.identity(task.name, task._dedup_policy, (label,), {}, func=task._func()).key

    def finished() -> bool:
        info = dedup.store.get(key)
        return info is not None and info.state is LockState.FINISHED and info.owner == handle.id

    wait_for(finished, timeout=20, interval=0.05, what="the gated body finished")
    # the main process records the lost ack once the pool returned the result, after the
    # child wrote the tombstone: wait for it rather than read it at once (CI, 2026-12-07)
    wait_for(lambda: handle.id.encode() in rc.lrange("fetch:ack-lost", 0, -1),
             timeout=10, interval=0.05, what="the message was left unacked")
    worker.warm_stop()
    # by the time a restarted worker could take a message put back, the tombstone is gone
    wait_for(lambda: dedup.store.get(key) is None, timeout=10, what="the tombstone lapsed")
    return label, slow
