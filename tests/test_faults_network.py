"""Fault: the connection to the lock store is cut in the middle of a call.

A :class:`tests.proxy.Proxy` sits between the clients and Redis. Three kinds of cut:

* the **reply is lost** (``cut_next_reply``): Redis ran the script, the client sees the
  connection drop. Every transition is idempotent for its owner, so a client that retries
  (``redis.Redis(host=..., port=...)`` retries 10 times by default in redis-py 8) gets the
  right answer: a reserve retried by the same owner is accepted, never a duplicate of itself.
  A client made from a URL (``redis.Redis.from_url``, and so ``RedisStore.from_url``, Celery's
  ``taskdedup_url``, RQ's ``--url``) does **not** retry: the caller gets
  ``StoreUnavailableError`` although the reservation was written — a *phantom* reservation
  held by an id that was never sent, until ``ttl``.
* the **request is cut half-way** (``cut_after(n, "up")``): Redis never runs a partial
  command; nothing is written.
* **every connection is cut** (``cut``) or lost replies are injected repeatedly while real
  Celery and RQ workers run, end to end.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from taskdedup import Policy, StoreUnavailableError
from taskdedup.rq import DedupQueue
from taskdedup.stores import LockResult, LockState, Outcome, RedisStore
from taskdedup.stores.memory import parse_value
from taskdedup.testing import wait_for
from tests import fault_jobs
from tests.fault_jobs import SCALE, ends, report, starts
from tests.proxy import Proxy
from tests.workers import RqWorker

LONG = 600_000
ACQUIRED = LockResult(Outcome.ACQUIRED)
REPEAT = 10 * SCALE


@pytest.fixture
def proxy(redis_url: str) -> Iterator[Proxy]:
    host, port = redis_url.split("://", 1)[1].split("/", 1)[0].rsplit(":", 1)
    with Proxy((host, int(port))) as p:
        yield p


def retrying_store(proxy: Proxy) -> RedisStore:
    """A client that retries connection errors, as redis-py's defaults do from 6.0 on (5.x
    retries nothing unless told): the lost reply is sent again."""
    from redis.backoff import ExponentialBackoff
    from redis.retry import Retry

    client = redis.Redis(host="127.0.0.1", port=proxy.port,
                         retry=Retry(ExponentialBackoff(cap=0.5, base=0.01), 10),
                         retry_on_error=[redis.ConnectionError, redis.TimeoutError])
    return warm(RedisStore(client))


def warm(store: RedisStore) -> RedisStore:
    """Connect and load every script, so a cut hits the transition itself (not the
    handshake, nor a NOSCRIPT reply that would make the first attempt a no-op)."""
    key = f"taskdedup:warm:{uuid.uuid4().hex}"
    store.reserve(key, "w", LONG)
    store.replace(key, "w", LONG)
    store.claim(key, "w", LONG)
    store.heartbeat(key, "w", LONG)
    store.complete(key, "w", LONG)
    store.release(key, "w")
    store.get(key)
    return store


def lock(rc: redis.Redis, key: str) -> tuple[LockState, str, str] | None:
    return parse_value(rc.get(key))


# Each step: (name, call on the store for owner "A", the answer, the lock afterwards).
Step = tuple[str, Callable[[RedisStore, str], Any], Any, Any]
LIFECYCLE: list[Step] = [
    ("reserve", lambda s, k: s.reserve(k, "A", LONG), ACQUIRED, (LockState.QUEUED, "", "A")),
    ("reserve-again", lambda s, k: s.reserve(k, "A", LONG), ACQUIRED,
     (LockState.QUEUED, "", "A")),
    # The claim ran and its reply was lost: redis-py's retry finds the lock RUNNING by A, which
    # is what a concurrent copy of A's message finds too (SPEC §5). The integration puts that
    # execution off until the lease lapses (never beside another run, never lost).
    ("claim", lambda s, k: s.claim(k, "A", LONG),
     LockResult(Outcome.DUPLICATE, "A", LockState.RUNNING), (LockState.RUNNING, "", "A")),
    ("heartbeat", lambda s, k: s.heartbeat(k, "A", LONG), Outcome.OK,
     (LockState.RUNNING, "", "A")),
    ("complete", lambda s, k: s.complete(k, "A", LONG), Outcome.OK, (LockState.DONE, "", "A")),
]


def test_a_lost_reply_retried_by_the_client_gives_the_owner_the_right_answer(
    rc: redis.Redis, proxy: Proxy
) -> None:
    """Reserve, claim, heartbeat and complete whose reply was lost are retried by redis-py
    and answered for the same owner (a retried claim as a copy of a running one: put off);
    another owner still gets DUPLICATE."""
    store = retrying_store(proxy)
    cuts = 0
    for _ in range(REPEAT):
        key = f"taskdedup:net:{uuid.uuid4().hex}"
        for name, call, answer, after in LIFECYCLE:
            proxy.cut_next_reply()
            assert call(store, key) == answer, name
            assert not proxy.armed()  # the reply was cut, the call was retried
            cuts += 1
            assert lock(rc, key) == after, name
            assert store.reserve(key, "B", LONG).outcome is Outcome.DUPLICATE
    report("lost_reply_with_retrying_client", replies_cut=cuts,
           transitions=[s[0] for s in LIFECYCLE], wrong_answers=0)


def test_a_lost_release_reply_retried_deletes_the_lock_but_answers_not_owner(
    rc: redis.Redis, proxy: Proxy
) -> None:
    """release is idempotent in effect, not in its answer: the retry finds the lock already
    gone (NOT_OWNER). The lock is deleted either way; Deduplicator.finish then reports a
    spurious ``lease_lost`` event for a final failure (cosmetic, documented)."""
    store = retrying_store(proxy)
    for _ in range(REPEAT):
        key = f"taskdedup:net:{uuid.uuid4().hex}"
        assert store.claim(key, "A", LONG) == ACQUIRED
        proxy.cut_next_reply()
        assert store.release(key, "A") is Outcome.NOT_OWNER
        assert not proxy.armed()
        assert rc.get(key) is None


def test_a_request_cut_half_way_is_never_executed(rc: redis.Redis, proxy: Proxy) -> None:
    """Redis runs no partial command: a reserve cut after half its bytes writes nothing; the
    client's retry writes it once."""
    plain = warm(RedisStore.from_url(proxy.url))  # no retries: the cut surfaces
    retrying = retrying_store(proxy)
    for n in range(REPEAT):
        key = f"taskdedup:net:{uuid.uuid4().hex}"
        proxy.cut_after(20 + n, "up")  # inside the EVALSHA request
        with pytest.raises(StoreUnavailableError):
            plain.reserve(key, "A", LONG)
        assert rc.get(key) is None  # nothing written
        proxy.cut_after(20 + n, "up")
        assert retrying.reserve(key, "A", LONG) == ACQUIRED
        assert lock(rc, key) == (LockState.QUEUED, "", "A")


def test_a_lost_reserve_reply_without_retry_leaves_a_phantom_bounded_by_ttl(
    rc: redis.Redis, proxy: Proxy
) -> None:
    """A URL-made client does not retry: the caller gets StoreUnavailableError (nothing is
    enqueued) though the reservation was written. It is an orphan bounded by ``ttl``."""
    store = warm(RedisStore.from_url(proxy.url))
    key = f"taskdedup:net:{uuid.uuid4().hex}"
    proxy.cut_next_reply()
    with pytest.raises(StoreUnavailableError, match="unreachable"):
        store.reserve(key, "never-sent", 5_000)
    assert lock(rc, key) == (LockState.QUEUED, "", "never-sent")
    assert 0 < rc.pttl(key) <= 5_000
    # the same owner retrying is accepted (it is its own reservation)
    assert store.reserve(key, "never-sent", 5_000) == ACQUIRED


def test_rq_retry_after_a_lost_reserve_reply_heals_the_phantom_and_is_enqueued(
    rc: redis.Redis, proxy: Proxy
) -> None:
    """RQ: the producer's retry finds the phantom reservation, sees that its job does not
    exist and takes the identity over (DedupQueue heal_grace): the retry is enqueued."""
    queue = f"faults-net-{uuid.uuid4().hex[:6]}"
    q = DedupQueue(queue, connection=rc, dedup_store=RedisStore.from_url(proxy.url),
                   dedup=Policy(ttl=60))
    q.heal_grace = 0.2
    label = uuid.uuid4().hex[:10]
    try:
        warm(q.dedup.store)  # type: ignore[arg-type]
        proxy.cut_next_reply()
        with pytest.raises(StoreUnavailableError):
            q.enqueue(fault_jobs.work, label)
        assert q.count == 0
        job = q.enqueue(fault_jobs.work, label)
        assert job is not None and q.count == 1 and job.id in q.job_ids
    finally:
        q.empty()


def test_celery_retry_after_a_lost_reserve_reply_is_published(
    redis_url: str, rc: redis.Redis, proxy: Proxy
) -> None:
    from tests import fault_celery_app as capp

    queue = f"faults-net-{uuid.uuid4().hex[:6]}"
    capp.configure(redis_url, lock_url=proxy.url, queue=queue)
    from taskdedup.celery import get_deduplicator

    label = uuid.uuid4().hex[:10]
    try:
        warm(get_deduplicator(capp.app).store)  # type: ignore[arg-type]
        proxy.cut_next_reply()
        with pytest.raises(StoreUnavailableError):  # on_store_error="raise": nothing sent
            capp.work.apply_async((label,), queue=queue)
        assert rc.llen(queue) == 0
        retry = capp.work.apply_async((label,), queue=queue)  # the caller tries again
        assert rc.llen(queue) == 1, (
            f"the retry was answered with {retry.id}, a task that was never sent"
        )
    finally:
        rc.delete(queue)
        capp.configure(redis_url, queue="faults")


@pytest.mark.parametrize("publish_retry", [True, False], ids=["celery-retries", "no-retry"])
def test_celery_fused_publish_whose_reply_is_lost_leaves_one_message_and_the_retry_gets_it(
    redis_url: str, proxy: Proxy, publish_retry: bool
) -> None:
    """With the broker on the lock Redis and ``taskdedup.celery:RedisTransport``, reserve and
    push are one script: a lost reply leaves the message queued *with* its reservation. With
    Celery's ``task_publish_retry`` (the default) kombu sends the script again, which
    recognises its own push: no error, one message. Without it the caller gets kombu's
    ``OperationalError``, as a plain publish would, and the caller's retry is answered with
    that message's id — no phantom, no second message either way."""
    import json

    from celery import Celery
    from kombu.exceptions import OperationalError

    from taskdedup.celery import DedupTask

    app = Celery("faults-fused", broker=proxy.url)
    queue = f"faults-fused-{uuid.uuid4().hex[:6]}"
    app.conf.update(broker_transport="taskdedup.celery:RedisTransport", task_default_queue=queue,
                    task_ignore_result=True, taskdedup_stats=False,
                    task_publish_retry=publish_retry)

    @app.task(base=DedupTask, dedup=Policy(ttl=60), name="tests.faults_fused.charge")
    def charge(order: str) -> str:
        return order

    rc = redis.Redis.from_url(redis_url)
    try:
        charge.apply_async((f"{queue}-warm-up",))  # connects and loads the script
        lost = 0
        for n in range(REPEAT):
            # Every retry below is a duplicate; keep the task off the check-first path (a
            # separate reserve, which a high duplicate rate chooses) so the push is fused.
            charge._dedup_duplicate_rate = 0.0
            proxy.cut_next_reply()
            if publish_retry:
                first = charge.apply_async((f"{queue}-order-{n}",))
            else:
                with pytest.raises(OperationalError):
                    charge.apply_async((f"{queue}-order-{n}",))
            lost += 1
            retry = charge.apply_async((f"{queue}-order-{n}",))
            queued = [json.loads(m)["headers"]["id"] for m in rc.lrange(queue, 0, -1)]
            assert queued.count(retry.id) == 1  # the retry got the message that was pushed
            if publish_retry:
                assert first.id == retry.id
            assert len(queued) == n + 2  # warm-up + one message per order, never two
        report(f"lost_reply_celery_fused_publish_{'retry' if publish_retry else 'no_retry'}",
               replies_cut=lost, messages=len(queued) - 1, duplicates=0, phantoms=0)
    finally:
        rc.delete(queue)
        rc.close()
        app.close()


@pytest.mark.parametrize("client_retries", [0, 3], ids=["no-client-retry", "client-retry"])
def test_rq_one_round_trip_enqueue_whose_reply_is_lost_leaves_one_job_and_the_retry_gets_it(
    rc: redis.Redis, proxy: Proxy, client_retries: int
) -> None:
    """With the locks in the queue's Redis, reserve + job write + push are one script. A lost
    reply leaves the job queued *with* its reservation. Without client retries the caller
    gets StoreUnavailableError and its own retry is answered with that job; with redis-py's
    retries the script is sent again and recognises its own job: either way one job."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    # redis-py < 6 retries only the errors listed in retry_on_error: name them, as later
    # releases do by default.
    client = redis.Redis(host="127.0.0.1", port=proxy.port,
                         retry=Retry(NoBackoff(), client_retries),
                         retry_on_error=[redis.ConnectionError, redis.TimeoutError])
    run = uuid.uuid4().hex[:6]
    q = DedupQueue(f"faults-rq-fused-{run}", connection=client, dedup=Policy(ttl=60))
    try:
        q.enqueue(fault_jobs.work, f"warm-up-{run}")  # connects, loads the script
        for n in range(REPEAT):
            proxy.cut_next_reply()
            if client_retries:
                job = q.enqueue(fault_jobs.work, f"order-{run}-{n}")
                assert job is not None
            else:
                with pytest.raises(StoreUnavailableError):
                    q.enqueue(fault_jobs.work, f"order-{run}-{n}")
                job = q.enqueue(fault_jobs.work, f"order-{run}-{n}")  # the caller tries again
                assert job is not None
            ids = [i.decode() for i in rc.lrange(q.key, 0, -1)]
            assert ids.count(job.id) == 1  # the retry got the job that was queued
            assert len(ids) == n + 2  # warm-up + one job per order, never two
        report(f"lost_reply_rq_fused_enqueue_{client_retries}_client_retries",
               replies_cut=REPEAT, jobs=REPEAT, duplicates=0, phantoms=0)
    finally:
        rc.delete(q.key)
        client.close()


# -- end to end --------------------------------------------------------------------------------


@pytest.mark.slow
def test_connections_cut_while_real_workers_run_lose_no_task_and_orphan_no_lock(
    redis_url: str, rc: redis.Redis, proxy: Proxy
) -> None:
    """Producers (Celery and RQ) and workers all reach the lock store through the proxy,
    which alternately cuts every connection and drops the next reply, at random moments
    while tasks are enqueued and run. Every enqueue either succeeds or raises
    StoreUnavailableError; every enqueued task runs exactly once; at the end no lock is
    running or queued except phantom reservations of refused enqueues, each bounded by ttl."""
    from tests import fault_celery_app as capp

    n_tasks = 40 * SCALE
    tag = uuid.uuid4().hex[:6]
    queue = f"faults-cut-{tag}"
    capp.configure(redis_url, lock_url=proxy.url, queue=queue)
    q = DedupQueue(queue, connection=rc, dedup_store=RedisStore.from_url(proxy.url),
                   dedup=Policy(ttl=60, lease=1.5))
    env = {"TASKDEDUP_TEST_LOCK_URL": proxy.url, "TASKDEDUP_URL": proxy.url}
    cworker = capp.FaultCeleryWorker(redis_url, queue=queue, concurrency=2, env=env)
    rworker = RqWorker(redis_url, [queue], scheduler=False, env=env,
                       worker_class="tests.rq_jobs.FastStoreRetryWorker")
    rnd = random.Random(4)
    enqueued: list[str] = []
    refused: list[str] = []
    idle_cuts = reply_cuts = 0
    try:
        cworker.start()
        rworker.start()
        for i in range(n_tasks):
            for kind in ("c", "r"):
                label = f"{kind}-{tag}-{i}"
                if rnd.random() < 0.5:
                    proxy.cut_next_reply()
                    reply_cuts += 1
                try:
                    if kind == "c":
                        capp.work.apply_async((label,), queue=queue)
                    else:
                        q.enqueue(fault_jobs.work, label)
                except StoreUnavailableError:
                    refused.append(label)
                else:
                    enqueued.append(label)
            if i % 4 == 0:
                idle_cuts += proxy.cut()
        proxy.disarm()  # the drain runs uncut
        wait_for(lambda: all(ends(rc, x) for x in enqueued), timeout=120,
                 what="every enqueued task ran")
        lost = sum(not ends(rc, x) for x in enqueued)
        twice = sum(len(ends(rc, x)) > 1 for x in enqueued)
        assert lost == 0 and twice == 0
        assert all(len(starts(rc, x)) == 1 for x in enqueued)
        assert not any(starts(rc, x) for x in refused)
        logs = cworker.output() + rworker.output()
        put_back = logs.count("store unavailable before")
        complete_failed = logs.count("could not complete")
    finally:
        cworker.stop()
        rworker.stop()
        q.empty()
        capp.configure(redis_url, queue="faults")

    # No orphan: once the lease has run out, an enqueued task's lock is done by the
    # execution that completed (or gone, if its complete call was cut and never reached
    # Redis: the running lock expired within lease);
    # a refused enqueue left nothing, or a phantom reservation that expires within ttl.
    from taskdedup.celery import get_deduplicator

    cdedup = get_deduplicator(capp.app)
    rpolicy = q.dedup_policy
    assert rpolicy is not None

    def key_of(label: str) -> str:
        if label.startswith("c-"):
            task = capp.work
            return cdedup.identity(task.name, task._dedup_policy, (label,), {},
                                   func=task._func()).key
        return q.dedup.identity("tests.fault_jobs.work", rpolicy, (label,), {},
                                func=fault_jobs.work).key

    keys = {label: key_of(label) for label in enqueued + refused}
    wait_for(lambda: all((lock(rc, k) or (LockState.DONE,))[0] is not LockState.RUNNING
                         for k in keys.values()),
             timeout=10, what="no running lock left once the lease ran out")
    done_locks = expired_after_cut = phantoms = 0
    for label in enqueued:
        held = lock(rc, keys[label])
        if held is None:
            expired_after_cut += 1
        else:
            assert held[0] is LockState.DONE and held[2] == ends(rc, label)[0], (label, held)
            done_locks += 1
    # a completed task without its done lock is one whose complete call itself was cut
    assert expired_after_cut <= complete_failed
    for label in refused:
        held = lock(rc, keys[label])
        if held is not None:
            assert held[0] is LockState.QUEUED, (label, held)
            assert 0 < rc.pttl(keys[label]) <= 60_000
            phantoms += 1
    report(
        "connection_cut_end_to_end",
        tasks_attempted=2 * n_tasks, enqueued=len(enqueued), refused_store_unavailable=len(refused),
        replies_cut_armed=reply_cuts, cuts_fired=proxy.cuts, idle_connection_cuts=idle_cuts,
        completed=len(enqueued) - lost, lost=lost, duplicate_executions=twice,
        worker_put_backs=put_back, locks_done=done_locks,
        complete_calls_cut=complete_failed,
        locks_gone_because_complete_was_cut=expired_after_cut,
        phantom_reservations_left_by_refused_enqueues=phantoms, phantom_bound_ms=60_000,
        running_locks_left=0,
    )
