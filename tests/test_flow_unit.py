"""Unit tests of coalesce and debounce over a real Redis (SPEC §15, issue #22 parts 2-3):
policy validation, the publish's one Lua call (:func:`taskdedup.flow.coalesce`,
:func:`taskdedup.flow.debounce`) and the worker's claim by generation
(:func:`taskdedup.flow.claim`), the records beside the lock (no argument value in Redis), and
the counters they produce. Framework-free."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
import redis

from taskdedup import (
    ConfigurationError,
    Debounce,
    Deduplicator,
    Event,
    MemoryStore,
    Policy,
    RedisStore,
)
from taskdedup.core import Identity, Verdict
from taskdedup.flow import (
    claim,
    coalesce,
    debounce,
    debounce_key,
    follow_up_key,
    superseded_of,
    superseded_value,
)
from taskdedup.stores.base import LockState

COALESCE = Policy(mode="until_expired", ttl=60, lease=10, on_duplicate="coalesce")


@pytest.fixture
def dedup(redis_url: str) -> Iterator[Deduplicator]:
    client = redis.Redis.from_url(redis_url)
    yield Deduplicator(RedisStore(client), prefix=f"t{uuid.uuid4().hex[:8]}")
    client.close()


def ident(dedup: Deduplicator) -> Identity:
    return Identity(dedup.lock_key("task", uuid.uuid4().hex))


# -- declaration -----------------------------------------------------------------------------


def test_debounce_fields_and_dict_form() -> None:
    policy = Policy(debounce={"wait": 2, "max_wait": 5})
    assert policy.debounce == Debounce(2, 5)
    assert policy.debounce.wait_ms == 2000 and policy.debounce.max_wait_ms == 5000
    assert Debounce(1).max_wait_ms == 0


@pytest.mark.parametrize("bad", [
    {"on_duplicate": "coalesce", "mode": "until_executing"},
    {"on_duplicate": "coalesce", "window": {"capacity": 1000, "error_rate": 0.01}},
    {"debounce": {"wait": 2, "max_wait": 1}},
    {"debounce": {"wait": 0}},
    {"debounce": {"wait": 1, "later": 2}},
    {"debounce": 5},
    {"debounce": Debounce(1), "mode": "until_executing"},
    {"debounce": Debounce(1), "on_duplicate": "drop"},
    {"debounce": Debounce(1), "mode": "while_executing", "on_busy": "wait"},
])
def test_bad_combinations_are_refused_at_declaration(bad: dict[str, object]) -> None:
    with pytest.raises(ConfigurationError):
        Policy(**bad)  # type: ignore[arg-type]


def test_a_memory_store_is_refused_clearly() -> None:
    dedup = Deduplicator(MemoryStore())
    with pytest.raises(ConfigurationError, match="RedisStore"):
        coalesce(dedup, "t", COALESCE, Identity("taskdedup:t:" + "0" * 32), "a", 1000)


# -- coalesce ----------------------------------------------------------------------------------


def test_duplicate_of_a_queued_call_is_a_plain_duplicate(dedup: Deduplicator) -> None:
    identity = ident(dedup)
    assert coalesce(dedup, "t", COALESCE, identity, "a", 60_000).verdict is Verdict.ACCEPTED
    second = coalesce(dedup, "t", COALESCE, identity, "b", 60_000)
    assert (second.verdict, second.existing_id, second.state) == (
        Verdict.DUPLICATE, "a", LockState.QUEUED)
    assert dedup.counters.get(Event.DUPLICATE, "t") == 1


def test_duplicates_of_a_running_call_share_one_follow_up(dedup: Deduplicator) -> None:
    identity = ident(dedup)
    key = identity.key
    coalesce(dedup, "t", COALESCE, identity, "a", 60_000)
    assert dedup.start("t", COALESCE, key, "a").verdict is Verdict.ACCEPTED
    answers = [coalesce(dedup, "t", COALESCE, identity, f"c{i}", 60_000) for i in range(3)]
    assert [a.verdict for a in answers] == [Verdict.COALESCED] * 3
    assert {a.existing_id for a in answers} == {"c0"}  # the first duplicate's id, for all
    assert [a.generation for a in answers] == [1, 2, 3]
    record = dedup.store.client.get(follow_up_key(dedup, key))  # type: ignore[attr-defined]
    assert record == b"3|c0"  # a generation and an id: no argument value
    # older messages of the follow-up are superseded; the newest waits for the running call
    for gen in (1, 2):
        assert claim(dedup, "t", COALESCE, key, "c0", generation=gen,
                     follow_up=True).verdict is Verdict.SUPERSEDED
    waiting = claim(dedup, "t", COALESCE, key, "c0", generation=3, follow_up=True)
    assert (waiting.verdict, waiting.existing_id) == (Verdict.WAITING, "a")
    # the running call succeeds (until_expired: done for ttl): the follow-up still runs
    dedup.finish("t", COALESCE, key, "a", success=True)
    assert claim(dedup, "t", COALESCE, key, "c0", generation=3,
                 follow_up=True).verdict is Verdict.ACCEPTED
    # a copy of the follow-up's message while it runs is deferred, an old one superseded
    assert claim(dedup, "t", COALESCE, key, "c0", generation=3,
                 follow_up=True).verdict is Verdict.DEFERRED
    assert claim(dedup, "t", COALESCE, key, "c0", generation=2,
                 follow_up=True).verdict is Verdict.DEFERRED
    # a new duplicate while the follow-up runs starts the next follow-up (one waiting at most)
    nxt = coalesce(dedup, "t", COALESCE, identity, "d", 60_000)
    assert (nxt.verdict, nxt.existing_id, nxt.generation) == (Verdict.COALESCED, "d", 4)
    dedup.finish("t", COALESCE, key, "c0", success=True)
    # a late copy of the follow-up that ran: finished (ends without a new outcome)
    assert claim(dedup, "t", COALESCE, key, "c0", generation=3,
                 follow_up=True).verdict is Verdict.FINISHED
    assert claim(dedup, "t", COALESCE, key, "c0", generation=1,
                 follow_up=True).verdict is Verdict.FINISHED


def test_coalesced_and_superseded_are_counted(dedup: Deduplicator) -> None:
    seen: list[tuple[str, str | None]] = []
    dedup.events.add(lambda event: seen.append((event.event.value, event.detail)))
    identity = ident(dedup)
    coalesce(dedup, "t", COALESCE, identity, "a", 60_000)
    dedup.start("t", COALESCE, identity.key, "a")
    coalesce(dedup, "t", COALESCE, identity, "b", 60_000)
    assert ("duplicate", "coalesced") in seen
    policy = Policy(debounce=Debounce(5))
    debounce(dedup, "t", policy, identity.key)
    debounce(dedup, "t", policy, identity.key)
    claim(dedup, "t", policy, identity.key, "x", generation=1, follow_up=False)
    assert ("skipped", "superseded") in seen


# -- debounce ----------------------------------------------------------------------------------


def test_each_call_gets_the_next_generation_and_wait(dedup: Deduplicator) -> None:
    policy = Policy(debounce=Debounce(2))
    key = ident(dedup).key
    answers = [debounce(dedup, "t", policy, key) for _ in range(3)]
    assert [g for g, _ in answers] == [1, 2, 3]
    assert all(delay == 2.0 for _, delay in answers)
    record = dedup.store.client.get(debounce_key(dedup, key))  # type: ignore[attr-defined]
    gen, start = record.split(b"|")
    assert gen == b"3" and start.isdigit()  # a generation and the burst's start: no argument


def test_only_the_last_call_of_a_burst_runs_and_the_window_does_not_stop_the_next(
    dedup: Deduplicator,
) -> None:
    policy = Policy(mode="until_expired", ttl=600, debounce=Debounce(1))
    key = ident(dedup).key
    for _ in range(3):
        debounce(dedup, "t", policy, key)
    assert claim(dedup, "t", policy, key, "a", generation=1,
                 follow_up=False).verdict is Verdict.SUPERSEDED
    assert claim(dedup, "t", policy, key, "c", generation=3,
                 follow_up=False).verdict is Verdict.ACCEPTED
    # a copy of the winner's message: deferred while it runs, finished after
    assert claim(dedup, "t", policy, key, "c", generation=3,
                 follow_up=False).verdict is Verdict.DEFERRED
    # an earlier call still due while the winner runs: superseded, never run
    assert claim(dedup, "t", policy, key, "b", generation=2,
                 follow_up=False).verdict is Verdict.SUPERSEDED
    # the next burst's call while the winner runs: it waits for it
    gen, _ = debounce(dedup, "t", policy, key)
    assert claim(dedup, "t", policy, key, "d", generation=gen,
                 follow_up=False).verdict is Verdict.WAITING
    dedup.finish("t", policy, key, "c", success=True)  # done for ttl=600
    assert claim(dedup, "t", policy, key, "c", generation=3,
                 follow_up=False).verdict is Verdict.FINISHED
    assert claim(dedup, "t", policy, key, "d", generation=gen,
                 follow_up=False).verdict is Verdict.ACCEPTED


def test_max_wait_shortens_the_countdown_from_the_bursts_first_call(
    dedup: Deduplicator,
) -> None:
    policy = Policy(debounce=Debounce(1.0, max_wait=1.5))
    key = ident(dedup).key
    _, first = debounce(dedup, "t", policy, key)
    assert first == 1.0
    time.sleep(0.8)
    gen, later = debounce(dedup, "t", policy, key)
    assert 0.5 < later <= 0.75  # what is left of max_wait, not a whole wait
    time.sleep(0.8)
    _, past = debounce(dedup, "t", policy, key)
    assert past == 0.0  # past max_wait: due at once
    # the burst's run claims: the next call starts a new burst, a whole wait again
    assert claim(dedup, "t", policy, key, "z", generation=gen + 1,
                 follow_up=False).verdict is Verdict.ACCEPTED
    _, fresh = debounce(dedup, "t", policy, key)
    assert fresh == 1.0


def test_superseded_result_is_recognisable() -> None:
    value = superseded_value(4)
    assert superseded_of(value) == {"generation": 4}
    assert next(iter(value)) == "SKIPPED"
    assert superseded_of({"taskdedup": "skipped duplicate"}) is None


# -- what the integrations carry ---------------------------------------------------------------


def test_celery_refuses_coalesce_or_debounce_given_per_call() -> None:
    """The worker claims a follow-up or a debounced call by the declared policy: a per-call
    dedup= may not add or drop them (it would be claimed as a plain call)."""
    from celery import Celery

    from taskdedup.celery import DedupTask

    app = Celery("flow-unit", broker="memory://", set_as_current=False)
    app.conf.taskdedup_store = MemoryStore()

    @app.task(base=DedupTask, dedup=Policy(mode="until_executed"), shared=False)
    def plain(x: int) -> int:
        return x

    @app.task(base=DedupTask, dedup=COALESCE, shared=False)
    def folded(x: int) -> int:
        return x

    with pytest.raises(ConfigurationError, match="declare them on the task"):
        plain.apply_async((1,), dedup={"on_duplicate": "coalesce"})
    with pytest.raises(ConfigurationError, match="declare them on the task"):
        folded.apply_async((1,), dedup={"on_duplicate": "return"})


def test_rq_meta_carries_coalesce_and_debounce_to_the_worker(redis_url: str) -> None:
    from rq.job import Job

    from taskdedup.rq.meta import META_KEY, guard_of, meta_entry
    from tests import flow_jobs

    client = redis.Redis.from_url(redis_url)
    try:
        for policy in (COALESCE, Policy(debounce=Debounce(2, max_wait=9)),
                       Policy(mode="while_executing", debounce={"wait": 0.5})):
            entry = meta_entry("tests.flow_jobs.run", "taskdedup:x:" + "0" * 32, policy)
            job = Job.create(flow_jobs.run, ("a", 1), connection=client,
                             meta={META_KEY: entry})
            guard = guard_of(job)
            assert guard is not None
            assert guard.policy.on_duplicate is policy.on_duplicate
            assert guard.policy.debounce == policy.debounce
    finally:
        client.close()


def test_a_synchronous_rq_queue_runs_a_debounced_or_coalesced_call_at_once(
    rc: redis.Redis,
) -> None:
    """is_async=False runs the job in the caller's process: no countdown, no follow-up, and
    no Redis record needed (a MemoryStore does)."""
    from taskdedup.rq import DedupQueue
    from tests import flow_jobs

    for policy in (Policy(include=["label"], debounce=Debounce(30)),
                   Policy(mode="until_executed", include=["label"], on_duplicate="coalesce")):
        q = DedupQueue(f"sync-{uuid.uuid4().hex[:8]}", connection=rc, is_async=False,
                       dedup=policy, dedup_store=MemoryStore())
        job = q.enqueue(flow_jobs.run, uuid.uuid4().hex, 7)
        assert job is not None and job.get_status() == "finished"
        assert job.return_value() == 7


def test_celery_eager_runs_a_debounced_or_coalesced_call_at_once() -> None:
    """task_always_eager runs the call in the caller's process: no countdown, no follow-up
    (and no Redis record: a MemoryStore does)."""
    from celery import Celery

    from taskdedup.celery import DedupTask

    app = Celery("flow-eager", broker="memory://", set_as_current=False)
    app.conf.update(task_always_eager=True, taskdedup_store=MemoryStore())

    @app.task(base=DedupTask, dedup=Policy(debounce=Debounce(30)), shared=False)
    def bounced(x: int) -> int:
        return x

    @app.task(base=DedupTask, dedup=COALESCE, shared=False)
    def folded(x: int) -> int:
        return x

    assert bounced.delay(3).get() == 3
    assert folded.delay(4).get() == 4


def test_the_scripts_run_on_fakeredis_lua() -> None:
    """The testing recipe without a server (fakeredis[lua]) runs the flow scripts too."""
    fakeredis = pytest.importorskip("fakeredis")
    dedup = Deduplicator(RedisStore(fakeredis.FakeRedis()))
    key = ident(dedup).key
    policy = Policy(debounce=Debounce(1))
    assert [debounce(dedup, "t", policy, key)[0] for _ in range(2)] == [1, 2]
    assert claim(dedup, "t", policy, key, "a", generation=1,
                 follow_up=False).verdict is Verdict.SUPERSEDED
    assert claim(dedup, "t", policy, key, "b", generation=2,
                 follow_up=False).verdict is Verdict.ACCEPTED


def test_celery_coalesce_publishes_in_one_round_trip_unless_it_becomes_a_follow_up(
    redis_url: str, rc: redis.Redis, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a Redis broker holding the locks the coalesce gate rides in the push: a first call
    and a duplicate of a queued one cost one round trip each (as on_duplicate='return'); a
    call folded into a follow-up pushes nothing in that script and is published again under
    the follow-up's id (two). No worker: the test plays the running original."""
    from celery import Celery

    from benchmarks.harness import RoundTripCounter
    from taskdedup.celery import DedupTask, get_deduplicator
    from taskdedup.celery.config import fuses

    monkeypatch.delenv("TASKDEDUP_URL", raising=False)
    queue = f"flow-unit-{uuid.uuid4().hex[:8]}"
    app = Celery("flow-fused", broker=redis_url, set_as_current=False)
    app.conf.update(task_default_queue=queue, task_ignore_result=True)

    @app.task(base=DedupTask, dedup=Policy(mode="until_executed", lease=10, include=["label"],
                                           on_duplicate="coalesce"),
              shared=False, name="flow.unit.folded")
    def folded(label: str, n: int) -> int:
        return n

    assert fuses(app)
    name = uuid.uuid4().hex
    folded.apply_async((f"warm-{name}", 0))  # connections, scripts
    with RoundTripCounter() as first:
        original = folded.delay(name, 0)
    with RoundTripCounter() as queued:
        again = folded.delay(name, 1)
    assert again.id == original.id
    assert (first.round_trips, queued.round_trips) == (1, 1), (first.commands,
                                                               queued.commands)
    dedup = get_deduplicator(app)
    policy = folded._dedup_policy
    assert policy is not None
    key = dedup.identity(folded.name, policy, (name, 0), {}, func=folded.run).key
    assert dedup.start(folded.name, policy, key, original.id).verdict is Verdict.ACCEPTED
    with RoundTripCounter() as joined:
        follow = folded.delay(name, 2)
    assert follow.id != original.id and joined.round_trips == 2, joined.commands
    assert rc.get(follow_up_key(dedup, key)) == f"1|{follow.id}".encode()
    assert folded.delay(name, 3).id == follow.id
    assert rc.get(follow_up_key(dedup, key)) == f"2|{follow.id}".encode()
    assert rc.llen(queue) == 4  # warm, original, and the follow-up's two messages
    dedup.finish(folded.name, policy, key, original.id, success=True)  # its heartbeat stops
    rc.delete(queue)


def test_rq_coalesce_enqueues_in_one_round_trip_unless_it_becomes_a_follow_up(
    rc: redis.Redis,
) -> None:
    """The same on a DedupQueue whose locks live in its own Redis (the fused enqueue)."""
    from rq import Queue

    from benchmarks.harness import RoundTripCounter
    from taskdedup.rq import DedupQueue
    from tests import flow_jobs

    queue_name = f"flow-unit-{uuid.uuid4().hex[:8]}"
    q = DedupQueue(queue_name, connection=rc, dedup=Policy(
        mode="until_executed", lease=10, include=["label"], on_duplicate="coalesce"))
    name = uuid.uuid4().hex
    q.enqueue(flow_jobs.run, f"warm-{name}", 0)  # the fused path's check, scripts
    with RoundTripCounter() as first:
        original = q.enqueue(flow_jobs.run, name, 0)
    with RoundTripCounter() as queued:
        again = q.enqueue(flow_jobs.run, name, 1)
    assert original is not None and again is not None and again.id == original.id
    assert (first.round_trips, queued.round_trips) == (1, 1), (first.commands,
                                                               queued.commands)
    key = q.dedup.identity("tests.flow_jobs.run", q.dedup_policy, (name, 0),  # type: ignore[arg-type]
                           {}, func=flow_jobs.run).key
    assert q.dedup.start("tests.flow_jobs.run", q.dedup_policy, key,  # type: ignore[arg-type]
                         original.id).verdict is Verdict.ACCEPTED
    with RoundTripCounter() as joined:
        follow = q.enqueue(flow_jobs.run, name, 2)
    assert follow is not None and follow.id != original.id
    plain = Queue(queue_name, connection=rc)
    plain.enqueue(flow_jobs.run, "warm", 0)
    with RoundTripCounter() as rq_own:
        plain.enqueue(flow_jobs.run, "plain", 0)
    # the script's answer, then RQ's own enqueue of the follow-up's job
    assert joined.round_trips == 1 + rq_own.round_trips, joined.commands
    latest = q.enqueue(flow_jobs.run, name, 3)
    assert latest is not None and latest.id == follow.id
    assert latest.args == (name, 3)  # the follow-up's data: the latest call's arguments
    rc.delete(q.key)


def test_prometheus_and_stats_count_coalesced_and_superseded(dedup: Deduplicator) -> None:
    """What the flow produces reaches the Prometheus listener and the stats fields."""
    pytest.importorskip("prometheus_client")
    from prometheus_client import CollectorRegistry

    from taskdedup.metrics import attach
    from taskdedup.stats import event_fields

    registry = CollectorRegistry()
    attach(dedup, registry)
    fields: list[tuple[str, int]] = []
    dedup.events.add(lambda event: fields.extend(event_fields(event)))
    identity = ident(dedup)
    coalesce(dedup, "t", COALESCE, identity, "a", 60_000)
    dedup.start("t", COALESCE, identity.key, "a")
    coalesce(dedup, "t", COALESCE, identity, "b", 60_000)
    policy = Policy(debounce=Debounce(5))
    for _ in range(2):
        debounce(dedup, "t", policy, identity.key)
    claim(dedup, "t", policy, identity.key, "x", generation=1, follow_up=False)

    def answered(answer: str) -> float | None:
        return registry.get_sample_value("taskdedup_second_calls_total",
                                         {"task": "t", "answer": answer})

    assert answered("coalesced") == 1.0 and answered("superseded") == 1.0
    assert ("duplicate:coalesced", 1) in fields and ("skipped:superseded", 1) in fields


# -- a publish that fails takes its generation back ---------------------------------------------


def test_undo_takes_back_only_the_generation_still_current(dedup: Deduplicator) -> None:
    from taskdedup.flow import undo

    key = ident(dedup).key
    policy = Policy(debounce=Debounce(5))
    record = debounce_key(dedup, key)
    client = dedup.store.client  # type: ignore[attr-defined]
    debounce(dedup, "t", policy, key)
    debounce(dedup, "t", policy, key)
    undo(dedup, "t", record, 2)  # the second call's publish failed: the first is current again
    assert client.get(record).startswith(b"1|")
    assert claim(dedup, "t", policy, key, "a", generation=1,
                 follow_up=False).verdict is Verdict.ACCEPTED
    debounce(dedup, "t", policy, key)  # 2
    debounce(dedup, "t", policy, key)  # 3
    undo(dedup, "t", record, 2)  # moved on since: nothing taken back
    assert client.get(record).startswith(b"3|")
    # coalesce: a failed creator leaves no follow-up waiting; a failed joiner hands back
    identity = ident(dedup)
    follow = follow_up_key(dedup, identity.key)
    coalesce(dedup, "t", COALESCE, identity, "a", 60_000)
    dedup.start("t", COALESCE, identity.key, "a")
    coalesce(dedup, "t", COALESCE, identity, "f", 60_000)
    coalesce(dedup, "t", COALESCE, identity, "g", 60_000)
    undo(dedup, "t", follow, 2)
    assert client.get(follow) == b"1|f"
    undo(dedup, "t", follow, 1, created=True)
    assert client.get(follow) is None
    again = coalesce(dedup, "t", COALESCE, identity, "h", 60_000)
    assert (again.existing_id, again.generation) == ("h", 1)


def test_a_celery_publish_that_fails_takes_its_generation_back(
    redis_url: str, rc: redis.Redis, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The broker refuses the debounced call's message: the caller gets the error, and the
    burst's earlier call is current again (it runs instead of being superseded by nothing)."""
    from celery import Celery
    from celery.app.task import Task

    from taskdedup.celery import DedupTask, get_deduplicator

    app = Celery("flow-undo", broker=redis_url, set_as_current=False)
    app.conf.update(task_default_queue=f"flow-unit-{uuid.uuid4().hex[:8]}",
                    task_ignore_result=True)

    @app.task(base=DedupTask, dedup=Policy(include=["label"], debounce=Debounce(30)),
              shared=False, name="flow.unit.bounced")
    def bounced(label: str, n: int) -> int:
        return n

    name = uuid.uuid4().hex
    bounced.delay(name, 0)
    dedup = get_deduplicator(app)
    policy = bounced._dedup_policy
    assert policy is not None
    key = dedup.identity(bounced.name, policy, (name, 0), {}, func=bounced.run).key

    def refuse(*_args: object, **_kwargs: object) -> None:
        raise ConnectionError("the broker refused it")

    monkeypatch.setattr(Task, "apply_async", refuse)
    with pytest.raises(ConnectionError):
        bounced.delay(name, 1)
    assert rc.get(debounce_key(dedup, key)).startswith(b"1|")
    rc.delete(app.conf.task_default_queue)
