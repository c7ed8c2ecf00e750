"""Compact owners (``taskdedup.stores.owners``): a UUID task id stored in 23 bytes, read in
either form by every script and tool, so stores writing text and stores writing compact share
every lock (a rolling upgrade), against a real server."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import pytest
import redis
from click.testing import CliRunner

from taskdedup import ConfigurationError, Policy
from taskdedup.cli import main
from taskdedup.stores import MemoryStore, RedisStore
from taskdedup.stores.base import LockState, Outcome
from taskdedup.stores.owners import ENV, compact_owner, compact_setting, looks_compact, owner_text
from taskdedup.stores.redis import reserve_and_run
from taskdedup.testing import wait_for
from tests import rq_jobs
from tests.workers import RqWorker

TTL, LEASE = 60_000, 30_000


def key() -> str:
    return f"taskdedup:tests.owners:{uuid.uuid4().hex}"


def test_uuids_round_trip_and_other_ids_stay_as_they_are() -> None:
    for _ in range(200):
        text = str(uuid.uuid4())
        stored = compact_owner(text)
        assert len(stored) == 23 and stored[0] == "~" and looks_compact(stored)
        assert owner_text(stored) == text
    for other in ("job-1", "ABCDEF12-3456-7890-ABCD-EF1234567890", uuid.uuid4().hex,
                  "{" + str(uuid.uuid4()) + "}", "~short", "~" + "!" * 22):
        assert compact_owner(other) == other and owner_text(other) == other
    assert owner_text("~" + "A" * 21 + "B") == "~" + "A" * 21 + "B"  # not 16 bytes' padding


def test_a_task_id_of_the_compact_form_is_refused_with_a_clear_error() -> None:
    """Every reader would take it for the UUID it encodes: refused before anything is
    written, by both stores (no server is reached)."""
    looks = compact_owner(str(uuid.uuid4()))
    for store in (MemoryStore(), RedisStore(redis.Redis(port=1))):
        with pytest.raises(ValueError, match="would be read as that UUID"):
            store.reserve(key(), looks, TTL)
        with pytest.raises(ValueError, match="would be read as that UUID"):
            store.claim(key(), looks, LEASE)


def test_the_setting_reads_yes_or_no_and_refuses_anything_else(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(ENV, raising=False)
    assert compact_setting() is False
    monkeypatch.setenv(ENV, "1")
    assert compact_setting() is True and compact_setting(False) is False
    assert compact_setting("off") is False and compact_setting(" Yes ") is True
    with pytest.raises(ConfigurationError, match="TASKDEDUP_COMPACT_OWNERS"):
        compact_setting("maybe")


@pytest.fixture
def stores(redis_url: str) -> Iterator[dict[str, RedisStore]]:
    text, compact = RedisStore.from_url(redis_url), RedisStore.from_url(redis_url,
                                                                        compact_owners=True)
    yield {"text": text, "compact": compact}
    text.close()
    compact.close()


def test_a_compact_store_writes_23_byte_owners_and_every_reader_names_the_uuid(
    stores: dict[str, RedisStore], redis_client: redis.Redis, redis_url: str,
) -> None:
    lock, owner = key(), str(uuid.uuid4())
    assert stores["compact"].reserve(lock, owner, TTL).outcome is Outcome.ACQUIRED
    raw = redis_client.get(lock)
    assert raw == f"Q||{compact_owner(owner)}".encode() and len(raw) == 26
    for store in stores.values():
        info = store.get(lock)
        assert info is not None and info.owner == owner and info.state is LockState.QUEUED
    listed = CliRunner().invoke(main, ["--url", redis_url, "list", "--json"],
                                catch_exceptions=False)
    assert listed.exit_code == 0, listed.output
    assert [row["owner"] for row in json.loads(listed.stdout)] == [owner]
    assert compact_owner(owner) not in listed.stdout


@pytest.mark.parametrize("writer,actor", [("text", "compact"), ("compact", "text")])
def test_stores_writing_either_form_share_every_lock(
    stores: dict[str, RedisStore], writer: str, actor: str,
) -> None:
    """A producer of one form and a worker of the other (a rolling upgrade): the worker's
    own queued lock is its own at every step, and another id never is."""
    first, second = stores[writer], stores[actor]
    lock, owner, other = key(), str(uuid.uuid4()), str(uuid.uuid4())
    assert first.reserve(lock, owner, TTL).outcome is Outcome.ACQUIRED
    assert second.reserve(lock, owner, TTL).outcome is Outcome.ACQUIRED  # its retry
    assert second.claim(lock, owner, LEASE).outcome is Outcome.ACQUIRED
    assert first.heartbeat(lock, owner, LEASE) is Outcome.OK
    for store in (first, second):  # another call: a duplicate, named in text
        assert store.reserve(lock, other, TTL) == (Outcome.DUPLICATE, owner, LockState.RUNNING)
        assert store.claim(lock, other, LEASE) == (Outcome.DUPLICATE, owner, LockState.RUNNING)
        assert store.release(lock, other) is Outcome.NOT_OWNER
    assert second.complete(lock, owner, TTL) is Outcome.OK
    assert first.claim(lock, owner, LEASE) == (Outcome.DUPLICATE, owner, LockState.DONE)
    assert first.release(lock, owner) is Outcome.OK
    assert first.get(lock) is None


@pytest.mark.parametrize("writer,actor", [("text", "compact"), ("compact", "text")])
def test_the_fused_enqueue_reads_either_form(
    stores: dict[str, RedisStore], redis_client: redis.Redis, writer: str, actor: str,
) -> None:
    """``enqueue.lua``: a resent push of this very call (its queued lock written in the other
    form) pushes nothing again; the job hash it peeks is the text id's."""
    lock, owner, other = key(), str(uuid.uuid4()), str(uuid.uuid4())
    queue = f"owners:{uuid.uuid4().hex}"
    push = [("RPUSH", queue, "message")]
    first, _ = reserve_and_run(redis_client, lock, owner, TTL, "", False, push,
                               compact_owners=writer == "compact")
    assert first.outcome is Outcome.ACQUIRED
    again, _ = reserve_and_run(redis_client, lock, owner, TTL, "", False, push, resent=True,
                               compact_owners=actor == "compact")
    assert again.outcome is Outcome.ACQUIRED and redis_client.llen(queue) == 1
    redis_client.hset(f"owners:job:{owner}", mapping={"status": "queued"})
    dup, peeked = reserve_and_run(redis_client, lock, other, TTL, "", False, push,
                                  "owners:job:", compact_owners=actor == "compact")
    assert dup == (Outcome.DUPLICATE, owner, LockState.QUEUED)
    assert peeked == [b"status", b"queued"]  # the original's hash, found by its text id
    assert redis_client.llen(queue) == 1


def test_rq_jobs_enqueued_by_either_form_run_once_on_a_worker_of_the_other(
    redis_url: str, rc: redis.Redis,
) -> None:
    """Real ``rq worker`` processes: a compact producer and a text worker, then a text
    producer and a compact worker (``TASKDEDUP_COMPACT_OWNERS``). Each call runs once, its
    duplicates return the original job, and the lock ends done by the text id."""
    from taskdedup.rq import DedupQueue

    for producer, worker_env in ((True, "0"), (False, "1")):
        name = f"owners-{uuid.uuid4().hex[:8]}"
        queue = DedupQueue(name, connection=rc, dedup=Policy(ttl=60),
                           dedup_store=RedisStore(rc, compact_owners=producer))
        labels = [uuid.uuid4().hex[:12] for _ in range(4)]
        jobs = [queue.enqueue(rq_jobs.record, label) for label in labels for _ in range(2)]
        assert [job.id for job in jobs[::2]] == [job.id for job in jobs[1::2]]  # duplicates
        worker = RqWorker(redis_url, [name], scheduler=False,
                          env={ENV: worker_env}).start()
        try:
            for job in jobs[::2]:
                wait_for(lambda job=job: job.get_status(refresh=True) == "finished",
                         timeout=30, what=f"job {job.id} finished")
        finally:
            worker.stop()
        assert [[x.decode() for x in rc.lrange(f"effects:{label}", 0, -1)]
                for label in labels] == [["0"]] * 4
        for label, job in zip(labels, jobs[::2], strict=True):
            identity = queue.dedup.identity("tests.rq_jobs.record", Policy(ttl=60), (label,),
                                            {}, func=rq_jobs.record)
            info = queue.dedup.store.get(identity.key)
            assert info is not None and (info.state, info.owner) == (LockState.DONE, job.id)


def test_coalesce_and_its_follow_up_read_either_form(redis_url: str) -> None:
    """``coalesce.lua``/``follow_up.lua`` (SPEC §15): calls published by a compact producer
    and claimed by a text worker keep one follow-up, named by its text id; the follow-up runs
    after the original, never beside it."""
    from taskdedup.core import Deduplicator, Identity, Verdict
    from taskdedup.flow import claim, coalesce

    policy = Policy(mode="until_expired", ttl=60, lease=10, on_duplicate="coalesce")
    prefix = f"t{uuid.uuid4().hex[:8]}"
    producer = Deduplicator(RedisStore.from_url(redis_url, compact_owners=True), prefix=prefix)
    worker = Deduplicator(RedisStore.from_url(redis_url), prefix=prefix)
    identity = Identity(producer.lock_key("task", uuid.uuid4().hex))
    first, follow, later = (str(uuid.uuid4()) for _ in range(3))
    assert coalesce(producer, "t", policy, identity, first, TTL).verdict is Verdict.ACCEPTED
    assert worker.start("t", policy, identity.key, first).verdict is Verdict.ACCEPTED
    answers = [coalesce(producer, "t", policy, identity, call, TTL) for call in (follow, later)]
    assert [(a.verdict, a.existing_id) for a in answers] == [(Verdict.COALESCED, follow)] * 2
    waiting = claim(worker, "t", policy, identity.key, follow, generation=2, follow_up=True)
    assert (waiting.verdict, waiting.existing_id) == (Verdict.WAITING, first)
    worker.finish("t", policy, identity.key, first, success=True)
    assert claim(worker, "t", policy, identity.key, follow, generation=2,
                 follow_up=True).verdict is Verdict.ACCEPTED
    assert claim(producer, "t", policy, identity.key, follow, generation=2,
                 follow_up=True).verdict is Verdict.DEFERRED  # a copy, in the other form


def test_celery_calls_run_once_on_a_worker_of_the_other_form(
    redis_url: str, rc: redis.Redis,
) -> None:
    """Real Celery workers (prefork): a text producer and a compact worker, then a compact
    producer (``taskdedup_compact_owners``, its reservation inside the broker's push) and a
    text worker. Each call runs once, its duplicate is the original's id, and the lock the
    worker leaves is done in the worker's own form, named by the task id either way."""
    from taskdedup.celery import get_deduplicator
    from tests import celery_app
    from tests.workers import CeleryWorker

    app = celery_app.app
    try:
        for producer, worker_env in ((False, "1"), (True, "0")):
            queue = f"owners-{uuid.uuid4().hex[:8]}"
            app.conf.taskdedup_compact_owners = producer
            celery_app.configure(redis_url, queue)
            worker = CeleryWorker(redis_url, queue=queue, env={ENV: worker_env}).start()
            try:
                labels = [uuid.uuid4().hex[:12] for _ in range(4)]
                handles = [celery_app.record.delay(label) for label in labels]
                again = [celery_app.record.delay(label) for label in labels]
                assert [h.id for h in again] == [h.id for h in handles]
                assert [h.get(timeout=30) for h in handles] == [f"{x}:0" for x in labels]
            finally:
                worker.stop()
            assert [[x.decode() for x in rc.lrange(f"effects:{label}", 0, -1)]
                    for label in labels] == [["0"]] * 4
            store = get_deduplicator(app).store
            for label, handle in zip(labels, handles, strict=True):
                key = celery_app.lock_key(celery_app.record, label)
                written = compact_owner(handle.id) if worker_env == "1" else handle.id
                assert rc.get(key) == f"D||{written}".encode()
                info = store.get(key)
                assert info is not None and (info.state, info.owner) == (LockState.DONE,
                                                                         handle.id)
    finally:
        app.conf.taskdedup_compact_owners = None
        celery_app.configure(redis_url, "celery")
