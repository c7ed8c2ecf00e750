"""Celery integration against a real Redis and a real prefork worker subprocess."""

from __future__ import annotations

import multiprocessing
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import chain, chord, group

from taskdedup import DuplicateTaskError, IdempotencyKeyMismatch, StoreUnavailableError
from taskdedup.testing import free_port, wait_for
from tests.effects import released
from tests.workers import CeleryWorker

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def worker(redis_url: str) -> Iterator[CeleryWorker]:
    w = CeleryWorker(redis_url, queue="it-main", concurrency=2).start()
    try:
        yield w
    finally:
        w.stop()


@pytest.fixture(scope="module")
def capp(redis_url: str, worker: CeleryWorker) -> Any:
    from tests import celery_app

    celery_app.configure(redis_url, worker.queue)
    return celery_app


@pytest.fixture(scope="module")
def rc(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url)


def label() -> str:
    return uuid.uuid4().hex[:12]


def effects(rc: redis.Redis, name: str) -> list[str]:
    return [x.decode() for x in rc.lrange(f"effects:{name}", 0, -1)]


def lock_keys(rc: redis.Redis, task: str) -> list[str]:
    return [k.decode() for k in rc.scan_iter(match=f"taskdedup:{task}:*", count=1000)]


def lock_of(rc: redis.Redis, capp: Any, task: Any, *args: Any, **kwargs: Any) -> str:
    from taskdedup.celery import get_deduplicator

    return get_deduplicator(capp.app).identity(
        task.name, task._dedup_policy, args, kwargs, func=task._func()
    ).key


def final_state(rc: redis.Redis, task_id: str, timeout: float = 30) -> str:
    return wait_for(lambda: (rc.get(f"state:{task_id}") or b"").decode(), timeout=timeout,
                    what=f"task {task_id} finished")


def test_duplicate_delay_returns_the_original_and_runs_once(capp: Any, rc: redis.Redis) -> None:
    name = label()
    results = [capp.record.delay(name) for _ in range(3)]
    assert len({r.id for r in results}) == 1
    assert results[0].get(timeout=30) == f"{name}:0"
    assert final_state(rc, results[0].id) == "SUCCESS"
    assert effects(rc, name) == ["0"]
    # until_expired: kept as done for ttl, so a later duplicate still gets the original
    assert capp.record.delay(name).id == results[0].id


def test_a_batch_with_duplicates_runs_each_identity_once(capp: Any, rc: redis.Redis) -> None:
    """``taskdedup.celery.batch``: ten calls, three of them duplicates, reserved in one
    pipeline → seven messages, seven executions."""
    from taskdedup.celery import batch

    name = label()
    with batch() as done:
        for n in [1, 2, 3, 1, 4, 5, 2, 6, 7, 3]:
            capp.record.delay(name, n)
    ids = {r.id for r in done.results}
    assert len(ids) == 7
    for task_id in ids:
        assert final_state(rc, task_id) == "SUCCESS"
    assert sorted(effects(rc, name)) == [str(n) for n in range(1, 8)]


def _enqueue_same(url: str, name: str, barrier: Any, out: Any) -> None:
    import os

    os.environ["TASKDEDUP_TEST_REDIS_URL"] = url
    from tests import celery_app

    celery_app.app.conf.update(broker_url=url, result_backend=url, taskdedup_url=url,
                               task_default_queue="it-main")
    barrier.wait(timeout=30)
    out.put(celery_app.record.delay(name, 7).id)


def test_concurrent_enqueues_from_processes_give_one_id_and_one_execution(
    capp: Any, rc: redis.Redis, redis_url: str
) -> None:
    name = label()
    ctx = multiprocessing.get_context("spawn")
    barrier, out = ctx.Barrier(6), ctx.Queue()
    procs = [ctx.Process(target=_enqueue_same, args=(redis_url, name, barrier, out))
             for _ in range(6)]
    for p in procs:
        p.start()
    ids = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    assert len(set(ids)) == 1
    assert capp.app.AsyncResult(ids[0]).get(timeout=30) == f"{name}:7"
    assert effects(rc, name) == ["7"]


def test_failure_releases_the_key_so_the_same_call_runs_again(capp: Any, rc: redis.Redis) -> None:
    name = label()
    first = capp.fail_first.delay(name)
    with pytest.raises(RuntimeError):
        first.get(timeout=30)
    key = lock_of(rc, capp, capp.fail_first, name)
    wait_for(lambda: not rc.exists(key), timeout=10, what="lock released after failure")
    second = capp.fail_first.delay(name)
    assert second.id != first.id
    assert second.get(timeout=30) == name
    assert effects(rc, name) == ["1", "2"]


def _dropped_after_the_outcome(task: Any, calls: int, failing: bool) -> list[str]:
    """Make ``calls`` calls, each followed — once ``.get()`` has returned (or raised, for a
    ``failing`` first run) — by the same call again; the names whose second call was
    dropped as a duplicate of the first (it returned the first's id)."""
    dropped = []
    for n in range(calls):
        name = f"{label()}-{n}"
        first = task.delay(name)
        if failing:
            with pytest.raises(RuntimeError):
                first.get(timeout=30)
        else:
            assert first.get(timeout=30) == name
        second = task.delay(name)
        if second.id == first.id:
            dropped.append(name)
        else:
            assert second.get(timeout=30) == name
    return dropped


def test_a_call_made_once_the_result_is_seen_runs_again(capp: Any, rc: redis.Redis) -> None:
    """until_executed: once ``.get()`` has returned the result, the task has executed and its
    identity is free: the same call made right then runs (it is not dropped as a duplicate of
    a lock whose completion is still on its way). Before the fix 17 of 200 were dropped here
    (prefork), 2 of 200 on a solo pool: the completion followed the stored result."""
    assert _dropped_after_the_outcome(capp.record_until_executed, 100, failing=False) == []


def test_a_call_made_once_the_failure_is_seen_runs_again(capp: Any, rc: redis.Redis) -> None:
    """The same for a final failure: once ``.get()`` has raised, the lock is released and
    the caller's new call runs (Celery stores the FAILURE before ``task_failure``: the lock
    was released from there, after the caller could see it)."""
    assert _dropped_after_the_outcome(capp.fail_first, 60, failing=True) == []


def test_a_chain_of_one_identity_runs_each_step_in_turn(capp: Any, rc: redis.Redis) -> None:
    """A chain whose steps share an identity (until_executed): each step's lock is completed
    before Celery publishes the next step, so every step runs — none is refused as a
    duplicate of the step that has just executed. (A regression guard: it also passed with
    the completion sent from ``task_success``, after the publish.)"""
    name = label()
    res = chain(*[capp.record_until_executed.si(name, n) for n in range(3)]).apply_async()
    assert res.get(timeout=30) == name
    assert effects(rc, name) == ["0", "1", "2"]


def test_retry_runs_and_a_duplicate_during_the_countdown_is_suppressed(
    capp: Any, rc: redis.Redis
) -> None:
    name = label()
    first = capp.retry_once.apply_async((name,), {"countdown": 3})
    wait_for(lambda: final_state(rc, first.id) == "RETRY", timeout=30, what="retry requested")
    key = lock_of(rc, capp, capp.retry_once, name, countdown=3)
    assert rc.get(key).decode().startswith("Q|") and rc.get(key).decode().endswith(first.id)
    third_party = capp.retry_once.apply_async((name,), {"countdown": 3})
    assert third_party.id == first.id
    assert first.get(timeout=30) == name
    assert effects(rc, name) == ["1", "2"]
    # until_executed: released when finished (just after the result is stored)
    wait_for(lambda: released(rc, key), timeout=10, what="released after success")


def test_stats_count_a_retry_as_a_retry_not_as_an_accepted_enqueue(
    capp: Any, rc: redis.Redis
) -> None:
    """#24 stumble 7: one accepted call, one duplicate and the call's retry showed as 2
    accepted, 1 duplicate (the retry's publish re-reserves the lock for its own id)."""
    from taskdedup.celery import get_deduplicator
    from tests.effects import enqueue_figures, flush_counts

    task = capp.retry_once_counted.name

    def figures() -> tuple[int, int, int]:
        return enqueue_figures(rc, task)

    before = figures()
    name = label()
    first = capp.retry_once_counted.apply_async((name,), {"countdown": 1})
    duplicate = capp.retry_once_counted.apply_async((name,), {"countdown": 1})
    assert duplicate.id == first.id
    assert first.get(timeout=30) == name and effects(rc, name) == ["1", "2"]
    # this process's counts; the worker flushes its own every few seconds
    assert flush_counts(get_deduplicator(capp.app))
    wait_for(lambda: figures()[2] > before[2], timeout=30, what="the worker's retry counted")
    assert tuple(now - then for now, then in zip(figures(), before, strict=True)) == (1, 1, 1)


def test_while_executing_retry_releases_during_the_countdown_and_the_retry_runs(
    capp: Any, rc: redis.Redis
) -> None:
    name = label()
    first = capp.while_retry_once.delay(name)
    key = lock_of(rc, capp, capp.while_retry_once, name)
    wait_for(lambda: rc.get(key) == f"R||{first.id}".encode(), timeout=30, what="running")
    rc.set(f"go:{name}", 1)
    wait_for(lambda: not rc.exists(key), timeout=10, what="released while waiting to retry")
    assert first.get(timeout=30) == name
    assert effects(rc, name) == ["1", "2"]


def test_autoretry_runs_every_retry_then_releases_on_final_failure(
    capp: Any, rc: redis.Redis
) -> None:
    name = label()
    res = capp.autoretry_always.delay(name)
    with pytest.raises(KeyError):
        res.get(timeout=30)
    assert effects(rc, name) == ["1", "2", "3"]
    key = lock_of(rc, capp, capp.autoretry_always, name)
    wait_for(lambda: not rc.exists(key), timeout=10, what="released after final failure")


def test_until_expired_window_suppresses_then_lets_the_call_run_again(
    capp: Any, rc: redis.Redis
) -> None:
    name = label()
    first = capp.record_short_window.delay(name)
    first.get(timeout=30)
    key = lock_of(rc, capp, capp.record_short_window, name)
    wait_for(lambda: rc.get(key) == f"D||{first.id}".encode(), timeout=10, what="done")
    assert capp.record_short_window.delay(name).id == first.id
    wait_for(lambda: not rc.exists(key), timeout=10, what="window (ttl=2s) over")
    second = capp.record_short_window.delay(name)
    assert second.id != first.id
    second.get(timeout=30)
    assert effects(rc, name) == ["1", "1"]


def test_countdown_longer_than_ttl_keeps_the_reservation_until_it_runs(
    capp: Any, rc: redis.Redis
) -> None:
    name = label()
    first = capp.record_short_window.apply_async((name,), countdown=4)  # ttl is 2 s
    key = lock_of(rc, capp, capp.record_short_window, name)
    assert rc.pttl(key) > 4000
    # past the bare ttl the reservation still holds
    wait_for(lambda: 0 < rc.pttl(key) < 3500 or effects(rc, name), timeout=10)
    assert capp.record_short_window.delay(name).id == first.id
    first.get(timeout=30)
    assert effects(rc, name) == ["1"]


def test_unserializable_arguments_are_refused_with_nothing_enqueued(
    capp: Any, rc: redis.Redis
) -> None:
    queue_len = rc.llen("it-main")
    locks = len(lock_keys(rc, capp.record.name))
    with pytest.raises(TypeError, match=r"kwargs\['n'\]"):
        capp.record.apply_async(("x",), {"n": object()})
    with pytest.raises(TypeError, match=r"kwargs\['label'\]"):
        capp.record.delay(lambda: 1)
    assert rc.llen("it-main") == queue_len
    assert len(lock_keys(rc, capp.record.name)) == locks


def test_dedup_false_bypasses_gate_and_guard(capp: Any, rc: redis.Redis) -> None:
    name = label()
    a = capp.record.apply_async((name,), dedup=False)
    b = capp.record.apply_async((name,), dedup=False)
    assert a.id != b.id
    a.get(timeout=30), b.get(timeout=30)
    assert effects(rc, name) == ["0", "0"]
    assert not rc.exists(lock_of(rc, capp, capp.record, name))


def test_explicit_dedup_key_and_mismatch(capp: Any, rc: redis.Redis) -> None:
    name, key = label(), f"ORD-{label()}"
    a = capp.record.apply_async((name, 1), dedup_key=key)
    b = capp.record.apply_async((name, 1), dedup_key=key)
    assert a.id == b.id
    with pytest.raises(IdempotencyKeyMismatch) as info:
        capp.record.apply_async((name, 2), dedup_key=key)
    assert info.value.existing_id == a.id
    a.get(timeout=30)
    assert effects(rc, name) == ["1"]


def test_on_duplicate_raise_and_drop(capp: Any, rc: redis.Redis) -> None:
    name = label()
    first = capp.strict.delay(name)
    with pytest.raises(DuplicateTaskError) as info:
        capp.strict.delay(name)
    assert info.value.existing_id == first.id
    assert info.value.key.startswith("taskdedup:tests.celery_app.strict:")
    assert capp.record.apply_async((name,), dedup={"on_duplicate": "drop"}) is not None
    assert capp.record.apply_async((name,), dedup={"on_duplicate": "drop"}) is None
    first.get(timeout=30)


def test_replace_revokes_the_queued_original(capp: Any, rc: redis.Redis) -> None:
    user = int(time.time() * 1000) % 10**9
    old = capp.debounced.apply_async((user, 1), countdown=3)
    new = capp.debounced.apply_async((user, 2), countdown=1)
    assert new.id != old.id
    assert new.get(timeout=30) == 2
    wait_for(lambda: capp.app.AsyncResult(old.id).state == "REVOKED", timeout=30,
             what="replaced original revoked")
    assert effects(rc, f"debounced:{user}") == ["2"]


def test_send_task_by_name_is_guarded_at_the_worker(capp: Any, rc: redis.Redis) -> None:
    name = label()
    a = capp.app.send_task(capp.record.name, (name,), queue="it-main")
    assert a.get(timeout=30) == f"{name}:0"
    b = capp.app.send_task(capp.record.name, (name,), queue="it-main")
    assert final_state(rc, b.id) == "SKIPPED"  # skipped: the body did not run
    assert effects(rc, name) == ["0"]
    assert capp.app.AsyncResult(b.id).state != "FAILURE"


def test_chain_group_and_chord_run_and_a_duplicate_workflow_raises(
    capp: Any, rc: redis.Redis
) -> None:
    name = label()
    res = chain(capp.record.si(name, 1), capp.record.si(name, 2)).apply_async()
    assert res.get(timeout=30) == f"{name}:2"
    g = group(capp.record.si(name, i) for i in range(3, 6)).apply_async()
    assert sorted(g.get(timeout=30)) == [f"{name}:{i}" for i in range(3, 6)]
    c = chord([capp.record.si(name, i) for i in range(6, 8)], capp.collect.s(name + "-c"))()
    assert c.get(timeout=30) == name + "-c"
    assert sorted(effects(rc, name)) == [str(i) for i in range(1, 8)]
    # the same first step again, still held (until_expired): the chain would be lost → raise
    with pytest.raises(DuplicateTaskError, match="chain"):
        chain(capp.record.si(name, 1), capp.record.si(name, 99)).apply_async()
    assert "99" not in effects(rc, name)


def test_task_always_eager(capp: Any, rc: redis.Redis) -> None:
    name = label()
    capp.app.conf.task_always_eager = True
    try:
        first = capp.record.delay(name)
        second = capp.record.delay(name)
    finally:
        capp.app.conf.task_always_eager = False
    assert first.get() == f"{name}:0"
    assert second.id == first.id
    assert effects(rc, name) == ["0"]


def test_ignore_and_reject_release_the_lock(capp: Any, rc: redis.Redis) -> None:
    a, b = label(), label()
    ra = capp.ignore_me.delay(a)
    rb = capp.reject_me.delay(b)
    assert final_state(rc, ra.id) == "IGNORED"
    assert final_state(rc, rb.id) == "REJECTED"
    wait_for(lambda: not rc.exists(lock_of(rc, capp, capp.ignore_me, a)), timeout=10)
    wait_for(lambda: not rc.exists(lock_of(rc, capp, capp.reject_me, b)), timeout=10)
    assert capp.ignore_me.delay(a).id != ra.id


def test_hard_time_limit_releases_the_lock(capp: Any, rc: redis.Redis) -> None:
    name = label()
    res = capp.too_slow.delay(name)
    with pytest.raises(Exception, match=r"TimeLimitExceeded|Time limit"):
        res.get(timeout=30)
    key = lock_of(rc, capp, capp.too_slow, name)
    # released by the main process (lease is 30 s; far sooner than that)
    wait_for(lambda: not rc.exists(key), timeout=10, what="released after time limit")


def test_heartbeat_keeps_the_lock_of_a_task_longer_than_its_lease(
    capp: Any, rc: redis.Redis
) -> None:
    name = label()
    res = capp.long_running.delay(name)
    key = lock_of(rc, capp, capp.long_running, name)
    wait_for(lambda: effects(rc, name), timeout=30, what="task started")
    started = time.monotonic()
    while time.monotonic() - started < 4.5:  # three leases of 1.5 s
        assert (rc.get(key) or b"").decode() == f"R||{res.id}", "running lock lost"
        assert capp.long_running.delay(name).id == res.id
        time.sleep(0.1)
    rc.set(f"go:{name}", 1)
    assert res.get(timeout=30) == name
    wait_for(lambda: released(rc, key), timeout=10, what="released after success")


def test_revoke_of_a_queued_task_releases_its_lock(capp: Any, rc: redis.Redis) -> None:
    name = label()
    res = capp.record_until_executed.apply_async((name,), countdown=2)
    key = lock_of(rc, capp, capp.record_until_executed, name)
    assert rc.exists(key)
    res.revoke()
    wait_for(lambda: not rc.exists(key), timeout=20, what="released after revoke")
    assert effects(rc, name) == []


def test_until_executing_releases_at_start_and_while_executing_gates_only_execution(
    capp: Any, rc: redis.Redis
) -> None:
    a = label()
    first = capp.record_until_executing.delay(a)
    wait_for(lambda: effects(rc, a), timeout=30, what="started")
    second = capp.record_until_executing.delay(a)  # first has started: accepted again
    assert second.id != first.id
    rc.set(f"go:{a}", 1)
    first.get(timeout=30), second.get(timeout=30)
    assert effects(rc, a).count("start") == 2

    b = label()
    one = capp.record_while_executing.delay(b, 1)
    wait_for(lambda: effects(rc, b) == ["start1"], timeout=30, what="first started")
    two = capp.record_while_executing.delay(b, 1)  # not gated at enqueue...
    assert one.id != two.id
    assert final_state(rc, two.id) == "SKIPPED"  # ...but gated at execution
    rc.set(f"go:{b}", 1)
    one.get(timeout=30)
    assert effects(rc, b) == ["start1", "end1"]
    three = capp.record_while_executing.delay(b, 1)  # released when finished: runs
    three.get(timeout=30)
    assert effects(rc, b) == ["start1", "end1", "start1", "end1"]


def test_store_down_raises_before_enqueue_and_allow_proceeds(
    capp: Any, rc: redis.Redis, redis_url: str
) -> None:
    from celery import Celery

    from taskdedup import Policy
    from taskdedup.celery import DedupTask

    dead = f"redis://127.0.0.1:{free_port()}/0"
    app = Celery("down", broker=redis_url, set_as_current=False)
    app.conf.update(taskdedup_url=dead, task_default_queue="it-down")

    @app.task(base=DedupTask, name="down.strict")
    def strict(x: int) -> int:
        return x

    @app.task(base=DedupTask, name="down.lenient", dedup=Policy(on_store_error="allow"))
    def lenient(x: int) -> int:
        return x

    with pytest.raises(StoreUnavailableError, match=r"127\.0\.0\.1"):
        strict.delay(1)
    assert rc.llen("it-down") == 0
    lenient.delay(1)
    assert rc.llen("it-down") == 1
    rc.delete("it-down")


def test_the_worker_s_output_says_which_publish_path_the_app_took(worker: CeleryWorker) -> None:
    """The choice is made when tasks are bound, before Celery sets up the worker's logging:
    the worker says it again once its log is there (before, the INFO line went nowhere)."""
    assert "taskdedup: Celery app 'tests': " in worker.output()
