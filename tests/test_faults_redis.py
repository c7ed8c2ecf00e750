"""Faults of the lock store: Redis restarted under a steady enqueue load, and Redis down.

The lock store is a server of its own (``RedisServer`` on a free port) so the test can
SIGKILL it and start it again on the same port; the brokers (Celery's and RQ's queues) stay
on the session's Redis. Producers keep enqueueing distinct identities through Celery and RQ,
with ``on_store_error="raise"`` and ``"allow"``, while the lock store is killed and restarted
``RESTARTS`` times; real workers run the tasks meanwhile.

Expected (SPEC §4 ``on_store_error``, §8): no producer crashes; while the store is down,
``raise`` refuses with ``StoreUnavailableError`` and enqueues nothing, ``allow`` enqueues
without dedup and counts a ``store_error``; after each restart new enqueues succeed with no
manual step; every accepted task runs exactly once (the worker puts back what it cannot claim).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis

from taskdedup import Event, Policy, StoreUnavailableError
from taskdedup.core import Deduplicator, Identity, Verdict
from taskdedup.rq import DedupQueue
from taskdedup.stores import RedisStore
from taskdedup.testing import RedisServer, free_port, wait_for
from tests import fault_jobs
from tests.fault_jobs import SCALE, ends, report, starts
from tests.workers import RqWorker

pytestmark = pytest.mark.slow

RESTARTS = 5 * SCALE


@dataclass
class Producer:
    """Enqueues a new identity in a loop and classifies every outcome."""

    name: str
    enqueue: Callable[[str], Any]
    store_errors: Callable[[], int]
    """This producer's count of ``store_error`` events (Deduplicator.counters)."""
    accepted: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    unguarded: list[str] = field(default_factory=list)
    other: list[str] = field(default_factory=list)
    seen: Counter[str] = field(default_factory=Counter)

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            label = f"{self.name}-{uuid.uuid4().hex[:10]}"
            before = self.store_errors()
            try:
                handle = self.enqueue(label)
            except StoreUnavailableError:
                self.refused.append(label)
                self.seen["refused"] += 1
            except Exception as exc:  # a crash of the caller: must never happen
                self.other.append(f"{type(exc).__name__}: {exc}")
            else:
                assert handle is not None
                if self.store_errors() > before:
                    self.unguarded.append(label)
                    self.seen["unguarded"] += 1
                else:
                    self.accepted.append(label)
                    self.seen["accepted"] += 1
            stop.wait(0.01)  # a steady load, not a flood: about 50 enqueues/s per producer


def test_redis_restarted_under_load_callers_follow_on_store_error_and_nothing_is_lost(
    redis_url: str, rc: redis.Redis
) -> None:
    from tests import fault_celery_app as capp

    lock_server = RedisServer().start()
    lock_url = lock_server.url
    tag = uuid.uuid4().hex[:6]
    celery_queue, rq_queue = f"faults-restart-{tag}", f"faults-restart-{tag}"
    capp.configure(redis_url, lock_url=lock_url, queue=celery_queue)
    from taskdedup.celery import get_deduplicator

    cdedup = get_deduplicator(capp.app)
    # A Store instance gives each queue a Deduplicator (and counters) of its own.
    q_raise = DedupQueue(rq_queue, connection=rc, dedup_store=RedisStore.from_url(lock_url),
                         dedup=Policy(ttl=60, lease=1.5))
    q_allow = DedupQueue(rq_queue, connection=rc, dedup_store=RedisStore.from_url(lock_url),
                         dedup=Policy(ttl=60, lease=1.5, on_store_error="allow"))
    work, work_allow = capp.work, capp.work_allow
    producers = [
        Producer("c-raise", lambda x: work.apply_async((x,), queue=celery_queue),
                 lambda: cdedup.counters.get(Event.STORE_ERROR, work.name)),
        Producer("r-raise", lambda x: q_raise.enqueue(fault_jobs.work, x),
                 lambda: q_raise.dedup.counters.get(Event.STORE_ERROR)),
        Producer("c-allow", lambda x: work_allow.apply_async((x,), queue=celery_queue),
                 lambda: cdedup.counters.get(Event.STORE_ERROR, work_allow.name)),
        Producer("r-allow", lambda x: q_allow.enqueue(fault_jobs.work, x),
                 lambda: q_allow.dedup.counters.get(Event.STORE_ERROR)),
    ]
    worker_env = {"TASKDEDUP_TEST_LOCK_URL": lock_url, "TASKDEDUP_URL": lock_url}
    cworker = capp.FaultCeleryWorker(redis_url, queue=celery_queue, concurrency=2,
                                     env=worker_env)
    rworker = RqWorker(redis_url, [rq_queue], scheduler=False, env=worker_env,
                       worker_class="tests.rq_jobs.FastStoreRetryWorker")
    stop = threading.Event()
    threads = [threading.Thread(target=p.run, args=(stop,), daemon=True) for p in producers]
    recoveries: list[int] = []
    try:
        cworker.start()
        rworker.start()
        for thread in threads:
            thread.start()
        for _ in range(RESTARTS):
            marks = {p.name: sum(p.seen.values()) for p in producers}
            wait_for(lambda m=marks: all(sum(p.seen.values()) >= m[p.name] + 5
                                         for p in producers),
                     timeout=30, what="steady load before the restart")
            seen = {p.name: Counter(p.seen) for p in producers}
            lock_server.kill()
            wait_for(lambda s=seen: all(
                p.seen["refused"] + p.seen["unguarded"]
                > s[p.name]["refused"] + s[p.name]["unguarded"] for p in producers),
                timeout=30, what="every producer met the outage")
            seen = {p.name: Counter(p.seen) for p in producers}
            lock_server.start()
            started_at = time.monotonic()
            wait_for(lambda s=seen: all(p.seen["accepted"] > s[p.name]["accepted"]
                                        for p in producers),
                     timeout=30, what="enqueues succeed again after the restart")
            recoveries.append(int((time.monotonic() - started_at) * 1000))
        stop.set()
        for thread in threads:
            thread.join(timeout=30)

        for p in producers:
            assert p.other == [], f"{p.name}: the caller crashed: {p.other[:3]}"
        raise_side = [p for p in producers if p.name.endswith("raise")]
        allow_side = [p for p in producers if p.name.endswith("allow")]
        assert all(p.refused and not p.unguarded for p in raise_side)
        assert all(p.unguarded and not p.refused for p in allow_side)
        for p in allow_side:  # every fail-open enqueue was counted, and only those
            assert p.store_errors() == len(p.unguarded)

        ran = [x for p in producers for x in p.accepted + p.unguarded]
        wait_for(lambda: all(ends(rc, x) for x in ran), timeout=120,
                 what="every enqueued task ran")
        refused = [x for p in producers for x in p.refused]
        lost = sum(not ends(rc, x) for x in ran)
        twice = sum(len(ends(rc, x)) > 1 for x in ran)
        assert lost == 0 and twice == 0
        assert all(len(starts(rc, x)) == 1 for x in ran)
        # refused means nothing was enqueued: the queues drained, no refused body ever ran
        wait_for(lambda: rc.llen(celery_queue) == 0 and q_raise.count == 0, timeout=30)
        assert not any(starts(rc, x) for x in refused)
        put_back = (cworker.output().count("store unavailable before")
                    + rworker.output().count("store unavailable before"))
    finally:
        stop.set()
        cworker.stop()
        rworker.stop()
        lock_server.cleanup()
        q_raise.empty()

    per = {p.name: dict(p.seen) for p in producers}
    report(
        "redis_restart_under_load",
        restarts=RESTARTS, enqueue_attempts=sum(sum(p.seen.values()) for p in producers),
        per_producer=per, refused_store_unavailable=len(refused),
        enqueued_unguarded_counted=sum(len(p.unguarded) for p in allow_side),
        caller_crashes=0, tasks_enqueued=len(ran), completed=len(ran) - lost, lost=lost,
        duplicate_executions=twice, worker_put_backs_while_down=put_back,
        max_recovery_after_restart_ms=max(recoveries),
    )


def test_locks_survive_a_redis_restart_with_appendfsync_always() -> None:
    """With AOF (``appendfsync always``) a SIGKILLed lock store comes back with its locks:
    a duplicate sent after the restart is still suppressed, and the owner finishes."""
    server = RedisServer(extra_args=["--appendonly", "yes", "--appendfsync", "always"]).start()
    try:
        dedup = Deduplicator(RedisStore.from_url(server.url))
        policy = Policy(ttl=60, lease=10)
        keys = [Identity(f"taskdedup:aof:{n}") for n in range(20)]
        for n, identity in enumerate(keys):
            assert dedup.gate("aof", policy, identity, f"orig-{n}").verdict is Verdict.ACCEPTED
        server.kill()
        server.start()
        duplicates = [dedup.gate("aof", policy, identity, f"dup-{n}")
                      for n, identity in enumerate(keys)]
        assert all(d.verdict is Verdict.DUPLICATE and d.existing_id == f"orig-{n}"
                   for n, d in enumerate(duplicates))
        for n, identity in enumerate(keys):
            assert dedup.start("aof", policy, identity.key, f"orig-{n}").verdict is Verdict.ACCEPTED
            dedup.finish("aof", policy, identity.key, f"orig-{n}", success=True)
        assert dedup.counters.get(Event.COMPLETED) == len(keys)
    finally:
        server.cleanup()
    report("redis_restart_with_aof", restarts=1, locks=len(keys), locks_after_restart=len(keys),
           duplicates_suppressed_after_restart=len(keys))


def test_redis_down_raise_refuses_before_enqueueing_and_allow_enqueues_and_counts(
    redis_url: str, rc: redis.Redis
) -> None:
    """No lock store at all (a closed port), N enqueues per framework and policy."""
    from tests import fault_celery_app as capp

    n = 20 * SCALE
    dead = f"redis://127.0.0.1:{free_port()}/0"
    tag = uuid.uuid4().hex[:6]
    celery_queue, rq_queue = f"faults-down-{tag}", f"faults-down-{tag}"
    capp.configure(redis_url, lock_url=dead, queue=celery_queue)
    from taskdedup.celery import get_deduplicator

    cdedup = get_deduplicator(capp.app)
    q_raise = DedupQueue(rq_queue, connection=rc, dedup_store=RedisStore.from_url(dead),
                         dedup=Policy(ttl=60))
    q_allow = DedupQueue(rq_queue, connection=rc, dedup_store=RedisStore.from_url(dead),
                         dedup=Policy(ttl=60, on_store_error="allow"))
    figures: dict[str, Any] = {}
    try:
        messages: list[str] = []
        for i in range(n):
            with pytest.raises(StoreUnavailableError, match="is Redis running"):
                capp.work.apply_async((f"down-{tag}-{i}",), queue=celery_queue)
        assert rc.llen(celery_queue) == 0  # refused before anything was published
        figures["celery_raise"] = {"attempts": n, "refused": n, "published": 0}
        for i in range(n):
            result = capp.work_allow.apply_async((f"down-allow-{tag}-{i}",), queue=celery_queue)
            messages.append(result.id)
        assert rc.llen(celery_queue) == n
        assert cdedup.counters.get(Event.STORE_ERROR) == 2 * n
        assert cdedup.counters.get(Event.STORE_ERROR, capp.work_allow.name) == n
        figures["celery_allow"] = {"attempts": n, "published": n, "store_errors_counted": n}

        for i in range(n):
            with pytest.raises(StoreUnavailableError, match="is Redis running"):
                q_raise.enqueue(fault_jobs.work, f"down-{tag}-{i}")
        assert q_raise.count == 0
        figures["rq_raise"] = {"attempts": n, "refused": n, "enqueued": 0}
        jobs = [q_allow.enqueue(fault_jobs.work, f"down-allow-{tag}-{i}") for i in range(n)]
        assert all(job is not None for job in jobs) and q_allow.count == n
        assert q_allow.dedup.counters.get(Event.STORE_ERROR) == n
        assert q_raise.dedup.counters.get(Event.STORE_ERROR) == n
        figures["rq_allow"] = {"attempts": n, "enqueued": n, "store_errors_counted": n}
    finally:
        rc.delete(celery_queue)
        q_raise.empty()
    report("redis_down", **figures,
           worker_side="covered by test_celery_faults / test_rq_faults store-down tests")
