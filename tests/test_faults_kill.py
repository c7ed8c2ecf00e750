"""Fault: a worker SIGKILLed mid-task, 20 bodies per framework (x TASKDEDUP_SOAK).

Two kinds of kill per framework, batched to keep the run short:

* **the whole worker** (main process and children, as when a machine or container dies):
  nobody releases the lock, so it must free itself within ``lease`` (1.5 s here); the
  message/job comes back by the framework's own mechanism — Celery: kombu redelivers the
  unacknowledged message after the broker's ``visibility_timeout`` (4 s here, acks_late);
  RQ: the test runs RQ's own abandoned-job handling (``StartedJobRegistry.cleanup``, which
  RQ's maintenance runs once the job's execution heartbeat lapsed) with a cutoff in the
  future instead of waiting minutes, and the job (``Retry(max=1)``) is retried with its id.
  While the original is dead and its lock gone, a producer retry (a *duplicate* enqueue) is
  sent for half of the identities: it is accepted (nothing holds the identity), and then
  only one of the two bodies may complete.
* **only the child running the body** (Celery pool process / RQ work-horse, as the OOM
  killer does): the worker's main process notices, releases or re-reserves the lock and the
  same task id runs again (Celery: ``reject_on_worker_lost`` requeues; RQ: ``Retry(max=1)``).

What is checked, per identity: exactly one body completed (no loss, no duplicate
execution); every killed body ran again exactly once (the at-least-once case: a body killed
mid-way re-runs, so its side effects before the kill happen twice — see
docs/reliability.md); no lock outlived ``lease`` after a whole-worker kill; at the end every
lock is ``done`` by the execution that completed, for ``ttl``.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from typing import Any

import pytest
import redis
from rq.job import Retry
from rq.registry import StartedJobRegistry

from taskdedup import Policy
from taskdedup.rq import DedupJob, DedupQueue, skipped_info
from taskdedup.testing import wait_for
from tests import fault_jobs
from tests.fault_jobs import SCALE, ends, report, start_pids, starts
from tests.workers import RqWorker

pytestmark = pytest.mark.slow

LEASE_MS = 1500
# The done locks are checked when the whole test ends: their ttl outlasts it on a loaded
# machine (a CI run's RQ test took over 60 s, and its first done lock had expired by then).
TTL_MS = 600_000
VISIBILITY = 4.0  # seconds: the broker's visibility_timeout for the killed workers
FAST_RESTORE = {"TASKDEDUP_TEST_VISIBILITY": str(VISIBILITY)}
IN_FLIGHT = 4  # bodies killed by one whole-worker kill
WHOLE_ROUNDS = 2 * SCALE  # 8 bodies
CHILD_KILLS = 12 * SCALE  # 12 bodies: 20 in all


def new_label(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:10]}"


def lock_lifetimes(rc: redis.Redis, keys: list[str], killed_at: float) -> list[int]:
    """After a kill: every lock has at most ``lease`` left, and each disappears; returns how
    long (ms) each outlived the kill (polled every 10 ms)."""
    for key in keys:
        assert rc.pttl(key) <= LEASE_MS, f"{key} holds more than the lease after the kill"
    gone: dict[str, int] = {}

    def all_gone() -> bool:
        for key in keys:
            if key not in gone and not rc.exists(key):
                gone[key] = int((time.monotonic() - killed_at) * 1000)
        return len(gone) == len(keys)

    wait_for(all_gone, timeout=LEASE_MS / 1000 + 10, interval=0.01, what="locks expired")
    return list(gone.values())


# -- Celery ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def capp(redis_url: str, rc: redis.Redis) -> Any:
    from tests import fault_celery_app

    fault_celery_app.configure(redis_url, queue="faults-kill")
    return fault_celery_app


def test_celery_sigkill_mid_task_every_task_completes_once_and_no_lock_outlives_lease(
    capp: Any, redis_url: str, rc: redis.Redis
) -> None:
    from taskdedup.celery import get_deduplicator

    queue = f"faults-kill-{uuid.uuid4().hex[:6]}"
    task = capp.work
    dedup = get_deduplicator(capp.app)

    def key_of(label: str) -> str:
        return dedup.identity(task.name, task._dedup_policy, (label, True), {},
                              func=task._func()).key

    sent: dict[str, list[str]] = {}  # label -> task ids sent (original, duplicates)
    killed: dict[str, int] = {}  # label -> bodies killed
    lifetimes: list[int] = []
    duplicates_sent = 0

    def send(label: str) -> str:
        result = task.apply_async((label, True), queue=queue)
        sent.setdefault(label, []).append(result.id)
        return str(result.id)

    def settled(labels: list[str]) -> bool:
        return all(rc.get(f"state:{tid}") in (b"SUCCESS", b"SKIPPED")
                   for label in labels for tid in sent[label])

    worker = capp.FaultCeleryWorker(redis_url, queue=queue, concurrency=IN_FLIGHT,
                                    env=FAST_RESTORE).start()
    try:
        # 1. whole-worker kills: IN_FLIGHT bodies each, redelivered after visibility_timeout
        for _ in range(WHOLE_ROUNDS):
            labels = [new_label("cw") for _ in range(IN_FLIGHT)]
            ids = {label: send(label) for label in labels}
            wait_for(lambda labels=labels: all(starts(rc, x) for x in labels), timeout=60,
                     what="all bodies started")
            keys = [key_of(label) for label in labels]
            for label, key in zip(labels, keys, strict=True):
                assert rc.get(key) == f"R||{ids[label]}".encode()
            worker.kill()
            killed_at = time.monotonic()
            for label in labels:
                killed[label] = killed.get(label, 0) + 1
            lifetimes += lock_lifetimes(rc, keys, killed_at)
            # a producer retry while the original is dead: accepted, a second message
            for label in labels[::2]:
                assert send(label) != ids[label]
                duplicates_sent += 1
            for label in labels:
                rc.set(f"go:{label}", 1)
            # kombu before 5.7 restores unacked messages on a worker's first poll and then
            # only every hundred seconds: start the new worker once every message of the
            # killed one is past its visibility timeout, so that first poll restores them.
            wait_for(lambda: not rc.zrangebyscore("unacked_index",
                                                  time.time() - VISIBILITY - 0.5, "+inf"),
                     timeout=30, what="the killed worker's messages past visibility_timeout")
            worker = capp.FaultCeleryWorker(redis_url, queue=queue, concurrency=IN_FLIGHT,
                                            env=FAST_RESTORE).start()
            wait_for(lambda labels=labels: settled(labels), timeout=90,
                     what="killed tasks redelivered and settled")

        # 2. pool-child kills: the main process requeues (reject_on_worker_lost)
        for _ in range(CHILD_KILLS // IN_FLIGHT):
            labels = [new_label("cc") for _ in range(IN_FLIGHT)]
            for label in labels:
                send(label)
            wait_for(lambda labels=labels: all(starts(rc, x) for x in labels), timeout=60,
                     what="all bodies started")
            for label in labels:
                os.kill(start_pids(rc, label)[0], signal.SIGKILL)
                killed[label] = killed.get(label, 0) + 1
                rc.set(f"go:{label}", 1)
            wait_for(lambda labels=labels: settled(labels), timeout=90,
                     what="killed tasks requeued and settled")
    finally:
        worker.stop()

    figures = account(rc, sent, killed, key_of,
                      lambda task_id: rc.get(f"state:{task_id}") == b"SKIPPED")
    report(
        "sigkill_celery",
        whole_worker_sigkills=WHOLE_ROUNDS, bodies_killed_with_the_worker=WHOLE_ROUNDS * IN_FLIGHT,
        pool_child_sigkills=CHILD_KILLS, bodies_killed=sum(killed.values()),
        duplicates_sent_during_outage=duplicates_sent,
        max_lock_lifetime_after_whole_worker_kill_ms=max(lifetimes), lease_ms=LEASE_MS,
        redelivery="kombu visibility_timeout=4s (acks_late) / reject_on_worker_lost", **figures,
    )
    assert figures["lost"] == 0 and figures["duplicate_executions"] == 0
    assert figures["completed"] == len(sent)


def account(
    rc: redis.Redis, sent: dict[str, list[str]], killed: dict[str, int], key_of: Any,
    was_skipped: Any,
) -> dict[str, int]:
    """Per identity: exactly one completed body; every other execution was a killed body or
    a duplicate skipped at claim; the lock is done by the execution that completed. Returns
    the figures."""
    lost = duplicate_executions = rerun_same_id = by_duplicate = skipped = 0
    for label, ids in sent.items():
        done, began = ends(rc, label), starts(rc, label)
        lost += not done
        duplicate_executions += max(0, len(done) - 1)
        assert len(done) == 1, f"{label}: bodies completed {done} (sent {ids})"
        assert done[0] in ids
        # the killed bodies, plus the one that completed: nothing else started
        assert len(began) == 1 + killed.get(label, 0), f"{label}: bodies started {began}"
        if killed.get(label):
            if began.count(ids[0]) == 2:
                rerun_same_id += 1  # redelivered/retried with its id, and ran again
            else:
                by_duplicate += 1  # the producer's retry ran; the redelivery was skipped
        for task_id in ids:  # every other execution found the identity held: skipped
            if task_id not in done:
                assert was_skipped(task_id), f"{label}: {task_id} neither completed nor skipped"
                skipped += 1
        # no orphan: the lock is done by the execution that completed, for ttl at most
        key = key_of(label)
        assert rc.get(key) == f"D||{done[0]}".encode()
        assert 0 < rc.pttl(key) <= TTL_MS
    return {
        "identities": len(sent), "tasks_sent": sum(len(ids) for ids in sent.values()),
        "completed": len(sent) - lost, "lost": lost, "duplicate_executions": duplicate_executions,
        "killed_bodies_rerun_with_their_id": rerun_same_id,
        "killed_identities_completed_by_the_duplicate": by_duplicate,
        "executions_skipped_at_claim": skipped,
    }


# -- RQ ----------------------------------------------------------------------------------------


def test_rq_sigkill_mid_job_every_job_completes_once_and_no_lock_outlives_lease(
    redis_url: str, rc: redis.Redis
) -> None:
    queue_name = f"faults-kill-{uuid.uuid4().hex[:6]}"
    q = DedupQueue(queue_name, connection=rc, dedup=Policy(ttl=TTL_MS / 1000,
                                                           lease=LEASE_MS / 1000))
    policy = q.dedup_policy
    assert policy is not None
    name = "tests.fault_jobs.work"

    def key_of(label: str) -> str:
        return q.dedup.identity(name, policy, (label, True), {}, func=fault_jobs.work).key

    sent: dict[str, list[str]] = {}
    killed: dict[str, int] = {}
    lifetimes: list[int] = []
    duplicates_sent = 0

    def send(label: str) -> str:
        job = q.enqueue(fault_jobs.work, label, True, retry=Retry(max=1))
        assert job is not None
        sent.setdefault(label, []).append(job.id)
        return str(job.id)

    def settled(labels: list[str]) -> bool:
        for label in labels:
            for job_id in sent[label]:
                status = rc.hget(DedupJob.key_for(job_id), "status")
                if status not in (b"finished", b"failed"):
                    return False
        return True

    workers: list[RqWorker] = []
    try:
        # 1. work-horse kills, one worker: RQ's main process fails the job, DedupWorker
        #    re-reserves the lock for the retry, RQ re-enqueues it with the same id.
        horse_worker = RqWorker(redis_url, [queue_name], scheduler=False).start()
        workers.append(horse_worker)
        for _ in range(CHILD_KILLS):
            label = new_label("rh")
            job_id = send(label)
            pid = wait_for(lambda label=label: start_pids(rc, label), timeout=30)[0]
            assert rc.get(key_of(label)) == f"R||{job_id}".encode()
            os.kill(pid, signal.SIGKILL)
            killed[label] = 1
            rc.set(f"go:{label}", 1)
            wait_for(lambda label=label: settled([label]), timeout=30, what="retried and done")
        horse_worker.stop()
        workers.remove(horse_worker)

        # 2. whole-worker kills: IN_FLIGHT workers, one job each, all killed at once
        for _ in range(WHOLE_ROUNDS):
            round_workers = [RqWorker(redis_url, [queue_name], scheduler=False).start()
                             for _ in range(IN_FLIGHT)]
            workers += round_workers
            labels = [new_label("rw") for _ in range(IN_FLIGHT)]
            ids = {label: send(label) for label in labels}
            wait_for(lambda labels=labels: all(starts(rc, x) for x in labels), timeout=60,
                     what="all bodies started")
            keys = [key_of(label) for label in labels]
            for label, key in zip(labels, keys, strict=True):
                assert rc.get(key) == f"R||{ids[label]}".encode()
            for w in round_workers:
                w.kill()
            for label in labels:  # the horses run in their own process groups
                os.kill(start_pids(rc, label)[0], signal.SIGKILL)
                killed[label] = 1
            killed_at = time.monotonic()
            lifetimes += lock_lifetimes(rc, keys, killed_at)
            for label in labels[::2]:  # a producer retry while the original is dead
                assert send(label) != ids[label]
                duplicates_sent += 1
            # RQ's abandoned-job handling, with a cutoff past the execution heartbeat
            registry = StartedJobRegistry(queue_name, connection=rc, job_class=DedupJob)
            registry.cleanup(timestamp=time.time() + 3600)
            for label in labels:
                rc.set(f"go:{label}", 1)
            fresh = RqWorker(redis_url, [queue_name], scheduler=False).start()
            workers.append(fresh)
            wait_for(lambda labels=labels: settled(labels), timeout=60,
                     what="abandoned jobs retried and settled")
            fresh.stop()
    finally:
        for w in workers:
            w.kill()
        q.empty()

    for label, ids in sent.items():  # every job finished: the body ran, or it was skipped
        for job_id in ids:
            assert rc.hget(DedupJob.key_for(job_id), "status") == b"finished", (label, job_id)
    figures = account(rc, sent, killed, key_of,
                      lambda job_id: skipped_info(DedupJob.fetch(job_id, connection=rc)))
    report(
        "sigkill_rq",
        work_horse_sigkills=CHILD_KILLS, whole_worker_sigkills=WHOLE_ROUNDS * IN_FLIGHT,
        bodies_killed=sum(killed.values()), duplicates_sent_during_outage=duplicates_sent,
        max_lock_lifetime_after_whole_worker_kill_ms=max(lifetimes), lease_ms=LEASE_MS,
        redelivery="Retry(max=1): RQ's horse-death handling / StartedJobRegistry.cleanup",
        **figures,
    )
    assert figures["lost"] == 0 and figures["duplicate_executions"] == 0
    assert figures["completed"] == len(sent)
