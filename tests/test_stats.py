"""taskdedup.stats: in-process counting, HINCRBY flushes per task, failure and fork behaviour,
against the real Redis server of the session (flushes are triggered directly, never slept for).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest
import redis

from taskdedup import ConfigurationError, DedupEvent, Deduplicator, Event, MemoryStore, Policy
from taskdedup.stats import (
    GATE_BUCKETS_MS,
    StatsRecorder,
    TaskStats,
    attach,
    flush_all,
    hand_over,
    held_interval,
    hold_threads,
    read_stats,
    release_threads,
    stats_key,
    take_over,
)
from taskdedup.stores import RedisStore
from taskdedup.testing import RedisServer, free_port, wait_for

NEVER = 3600.0  # an interval that never elapses during a test: flushes are explicit


def ev(event: Event, task: str = "app.a", detail: str | None = None,
       seconds: float | None = None) -> DedupEvent:
    return DedupEvent(event, task, f"taskdedup:{task}:{'0' * 32}", "id-1", None, detail, seconds)


def fields(client: redis.Redis, task: str, prefix: str = "taskdedup") -> dict[str, int]:
    raw = client.hgetall(stats_key(prefix, task))
    return {k.decode(): int(v) for k, v in raw.items()}


@pytest.fixture
def recorder(redis_client: redis.Redis) -> Iterator[StatsRecorder]:
    rec = StatsRecorder(redis_client, interval=NEVER)
    yield rec
    rec.close(flush=False)


def test_flush_writes_hincrby_deltas_and_clears_them(
    redis_client: redis.Redis, recorder: StatsRecorder
) -> None:
    recorder(ev(Event.RESERVED))
    recorder(ev(Event.RESERVED))
    recorder(ev(Event.DUPLICATE))
    assert redis_client.exists(stats_key("taskdedup", "app.a")) == 0  # nothing on the hot path

    assert recorder.flush() is True
    assert fields(redis_client, "app.a") == {"reserved": 2, "duplicate": 1}
    assert recorder.pending() == {}

    recorder(ev(Event.RESERVED))
    assert recorder.flush() is True
    assert fields(redis_client, "app.a") == {"reserved": 3, "duplicate": 1}  # a delta, added
    assert recorder.flush() is True  # nothing pending: nothing sent, still fine
    assert fields(redis_client, "app.a") == {"reserved": 3, "duplicate": 1}


def test_each_task_has_its_own_hash_and_no_index_key(
    redis_client: redis.Redis, recorder: StatsRecorder
) -> None:
    recorder(ev(Event.RESERVED, "app.a"))
    recorder(ev(Event.RESERVED, "app.b"))
    recorder(ev(Event.SKIPPED, "app.b", detail="R"))
    recorder.flush()

    keys = sorted(k.decode() for k in redis_client.scan_iter(match="taskdedup:stats:*"))
    assert keys == ["taskdedup:stats:app.a", "taskdedup:stats:app.b"]
    assert {redis_client.type(k) for k in keys} == {b"hash"}
    assert fields(redis_client, "app.a") == {"reserved": 1}
    assert fields(redis_client, "app.b") == {"reserved": 1, "skipped": 1, "skipped:running": 1}


def test_event_details_become_fields_beside_the_event(
    redis_client: redis.Redis, recorder: StatsRecorder
) -> None:
    recorder(ev(Event.RELEASED, detail="failed"))
    recorder(ev(Event.RELEASED, detail="revoked"))
    recorder(ev(Event.DUPLICATE, detail="replaced"))
    recorder(ev(Event.STORE_ERROR, detail="release:failed"))
    recorder(ev(Event.RELEASED, detail="Not A Word {x}"))  # not recorded as its own field
    recorder.flush()

    assert fields(redis_client, "app.a") == {
        "released": 3, "released:failed": 1, "released:revoked": 1,
        "duplicate": 1, "duplicate:replaced": 1,
        "store_error": 1, "store_error:release:failed": 1,
    }


def test_gate_latency_is_aggregated_as_count_sum_and_cumulative_buckets(
    redis_client: redis.Redis, recorder: StatsRecorder
) -> None:
    recorder(ev(Event.RESERVED, seconds=0.0004))
    recorder(ev(Event.DUPLICATE, seconds=0.003))
    recorder(ev(Event.RESERVED, seconds=0.2))
    recorder(ev(Event.CLAIMED))  # not a gate: no latency
    recorder.flush()

    got = fields(redis_client, "app.a")
    assert got["gate:count"] == 3
    assert got["gate:sum_us"] == 400 + 3000 + 200_000
    assert GATE_BUCKETS_MS == (1, 5, 25, 100, 1000)
    assert [got.get(f"gate:le_{b}ms", 0) for b in GATE_BUCKETS_MS] == [1, 2, 2, 2, 3]
    stats = read_stats(redis_client)["app.a"]
    assert stats.gate_avg_ms == pytest.approx(203.4 / 3)


def test_events_kept_between_flushes_are_counted_exactly_across_batches(
    redis_client: redis.Redis, recorder: StatsRecorder
) -> None:
    """The hot path keeps events and counts them in batches (every few hundred, and at a
    flush): what reaches Redis is what the events say, whatever batch each fell in."""
    total = 700  # more than two batches
    for i in range(total):
        recorder(ev(Event.RESERVED, task=f"app.{i % 2}", seconds=0.0005 if i % 3 else 0.01))
        recorder(ev(Event.SKIPPED, task="app.0", detail="running"))
    assert recorder.pending()["app.0"]["skipped:running"] == total  # a copy, counted so far
    recorder.flush()

    got = fields(redis_client, "app.1")
    slow = sum(1 for i in range(1, total, 2) if i % 3 == 0)
    assert got["reserved"] == got["gate:count"] == total // 2
    assert got["gate:sum_us"] == slow * 10_000 + (total // 2 - slow) * 500
    assert [got.get(f"gate:le_{b}ms", 0) for b in GATE_BUCKETS_MS] == [
        total // 2 - slow, total // 2 - slow, total // 2, total // 2, total // 2]
    assert fields(redis_client, "app.0")["skipped"] == total
    assert recorder.pending() == {}


def test_failed_flush_keeps_the_deltas_logs_a_warning_and_writes_them_later(
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = RedisServer(port=free_port()).start()
    try:
        client = redis.Redis.from_url(server.url, socket_connect_timeout=2, socket_timeout=2)
        rec = StatsRecorder(client, interval=NEVER, prefix="p")
        rec(ev(Event.RESERVED))
        rec(ev(Event.RESERVED, seconds=0.001))
        server.stop()  # the port is closed now

        with caplog.at_level(logging.WARNING, logger="taskdedup"):
            assert rec.flush() is False  # never raises
        assert rec.pending()["app.a"]["reserved"] == 2
        # this thread's: a heartbeat thread of an earlier test in this process may warn too
        warnings = [r for r in caplog.records
                    if r.levelno == logging.WARNING and r.thread == threading.get_ident()]
        assert len(warnings) == 1
        assert "could not flush stats" in warnings[0].getMessage()
        assert "keeping" in warnings[0].getMessage()

        rec(ev(Event.DUPLICATE))  # counted meanwhile: added to what was kept
        server.start()
        assert rec.flush() is True
        assert fields(client, "app.a", prefix="p") == {
            "reserved": 2, "duplicate": 1, "gate:count": 1, "gate:sum_us": 1000,
            "gate:le_1ms": 1, "gate:le_5ms": 1, "gate:le_25ms": 1, "gate:le_100ms": 1,
            "gate:le_1000ms": 1,
        }
        assert rec.pending() == {}
        rec.close(flush=False)
        client.close()
    finally:
        server.cleanup()


def test_background_thread_flushes_without_an_explicit_call(redis_client: redis.Redis) -> None:
    rec = StatsRecorder(redis_client, interval=0.05)
    try:
        rec(ev(Event.COMPLETED, "app.t"))
        wait_for(lambda: fields(redis_client, "app.t") == {"completed": 1}, timeout=10,
                 what="the stats thread to flush")
    finally:
        rec.close(flush=False)


def test_attach_records_a_deduplicators_events_without_argument_values(
    redis_client: redis.Redis,
) -> None:
    dedup = Deduplicator(RedisStore(redis_client))
    rec = attach(dedup, interval=NEVER)
    assert rec is not None
    assert attach(dedup) is rec  # idempotent: events are never counted twice
    policy = Policy()
    secret = "secret-4242"
    first = dedup.identity("app.charge", policy, (secret,))
    dedup.gate("app.charge", policy, first, "id-1")
    dedup.gate("app.charge", policy, first, "id-2")
    dedup.start("app.charge", policy, first.key, "id-1")
    dedup.finish("app.charge", policy, first.key, "id-1", success=False)
    rec.flush()
    rec.close(flush=False)

    got = fields(redis_client, "app.charge")
    assert {k: got[k] for k in ("reserved", "duplicate", "claimed", "released")} == {
        "reserved": 1, "duplicate": 1, "claimed": 1, "released": 1,
    }
    assert got["released:failed"] == 1
    assert got["gate:count"] == 2
    stats = read_stats(redis_client, task="app.charge")["app.charge"]
    assert (stats.accepted, stats.duplicates, stats.released_on_failure) == (1, 1, 1)
    for key in redis_client.scan_iter(match="taskdedup:stats:*"):
        assert secret.encode() not in key
        assert all(secret.encode() not in f for f in redis_client.hkeys(key))


def test_flush_all_flushes_every_recorder_of_the_process(redis_client: redis.Redis) -> None:
    first = StatsRecorder(redis_client, interval=NEVER, prefix="one")
    second = StatsRecorder(redis_client, interval=NEVER, prefix="two")
    first(ev(Event.RESERVED))
    second(ev(Event.SKIPPED))
    flush_all()  # (its result also covers recorders of other tests: not asserted here)
    assert fields(redis_client, "app.a", prefix="one") == {"reserved": 1}
    assert fields(redis_client, "app.a", prefix="two") == {"skipped": 1}
    first.close(flush=False)
    second.close(flush=False)


def test_attach_to_a_memory_store_without_client_records_nothing() -> None:
    assert attach(Deduplicator(MemoryStore())) is None


def test_interval_must_be_positive(redis_client: redis.Redis) -> None:
    with pytest.raises(ConfigurationError, match="positive number of seconds"):
        StatsRecorder(redis_client, interval=0)


def test_read_stats_skips_non_hash_keys_and_derives_the_operator_figures(
    redis_client: redis.Redis, recorder: StatsRecorder
) -> None:
    redis_client.set("taskdedup:stats:" + "a" * 32, "Q||x")  # a lock of a task named "stats"
    for _ in range(3):
        recorder(ev(Event.RESERVED))
    recorder(ev(Event.DUPLICATE))
    recorder(ev(Event.RELEASED, detail="rejected"))
    recorder(ev(Event.RELEASED, detail="revoked"))  # not a failure
    recorder(ev(Event.LEASE_LOST, detail="heartbeat"))
    recorder.flush()

    stats = read_stats(redis_client)
    assert list(stats) == ["app.a"]
    item = stats["app.a"]
    assert (item.accepted, item.duplicates, item.released_on_failure, item.lease_lost) == (
        3, 1, 1, 1,
    )
    assert item.duplicate_rate == pytest.approx(0.25)
    assert TaskStats("none").duplicate_rate is None


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_starts_from_zero_and_flushes_only_its_own_counts(
    redis_client: redis.Redis,
) -> None:
    rec = StatsRecorder(redis_client, interval=NEVER)
    for _ in range(3):
        rec(ev(Event.RESERVED))  # pending in the parent when it forks
    parent_thread = rec._thread
    pid = os.fork()
    if pid == 0:  # the child: report through the exit code, never return into pytest
        code = 1
        try:
            fresh = rec.pending() == {}
            rec(ev(Event.RESERVED))
            own_thread = rec._thread is not None and rec._thread is not parent_thread
            code = 0 if fresh and own_thread and rec.flush() else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert fields(redis_client, "app.a") == {"reserved": 1}  # the child's one, not 1 + 3
    assert rec.flush() is True
    assert fields(redis_client, "app.a") == {"reserved": 4}  # the parent's 3: counted once
    rec.close(flush=False)


def test_a_forked_child_hands_its_counts_to_the_parent_without_writing_to_redis(
    redis_client: redis.Redis,
) -> None:
    """What an RQ work-horse does: its deltas go over a pipe and out with the parent's flush."""
    rec = StatsRecorder(redis_client, interval=NEVER)
    rec(ev(Event.RESERVED))  # the parent's own
    read_end, write_end = os.pipe()
    before = redis_client.info("commandstats").get("cmdstat_hincrby", {}).get("calls", 0)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            rec(ev(Event.CLAIMED, task="app.child"))
            rec(ev(Event.COMPLETED, task="app.child"))
            payload = hand_over()
            code = 0 if payload and rec.pending() == {} and os.write(write_end, payload) else 3
        finally:
            os._exit(code)
    os.close(write_end)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    after = redis_client.info("commandstats").get("cmdstat_hincrby", {}).get("calls", 0)
    assert after == before  # the child wrote nothing
    with os.fdopen(read_end, "rb") as pipe:
        assert take_over(pipe.read()) is True
    assert rec.pending() == {"app.a": {"reserved": 1}, "app.child": {"claimed": 1, "completed": 1}}
    assert rec.flush() is True
    assert fields(redis_client, "app.child") == {"claimed": 1, "completed": 1}
    rec.close(flush=False)


def test_held_recorders_start_their_thread_when_released_and_flush_if_due(
    redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An RQ work-horse holds the threads: none starts per job; a long job releases them from
    its heartbeat thread after held_interval(), flushing what its thread would have by then."""
    import taskdedup.stats as stats_module

    monkeypatch.setattr(stats_module, "_RECORDERS", type(stats_module._RECORDERS)())
    short = StatsRecorder(redis_client, interval=NEVER / 2)
    long = StatsRecorder(redis_client, interval=NEVER)
    hold_threads()
    try:
        short(ev(Event.CLAIMED, task="app.short"))
        long(ev(Event.CLAIMED, task="app.long"))
        assert short._thread is None and long._thread is None  # no thread while held
        assert held_interval() == NEVER / 2
        payload = hand_over()  # a horse that ends first: its counts go to its parent
        assert payload is not None and b"app.short" in payload
        assert take_over(payload) is True
        assert short._thread is None  # still held
    finally:
        release_threads(flush=True)
    try:
        assert short._thread is not None and long._thread is not None
        assert fields(redis_client, "app.short") == {"claimed": 1}  # its first flush was due
        assert fields(redis_client, "app.long") == {}  # not yet: its thread writes it later
        assert long.pending() == {"app.long": {"claimed": 1}}
        release_threads(flush=True)  # not held any more: nothing happens
        long(ev(Event.COMPLETED, task="app.long"))
        assert long.pending() == {"app.long": {"claimed": 1, "completed": 1}}
    finally:
        short.close(flush=False)
        long.close(flush=False)


def test_hand_over_keeps_what_does_not_fit_and_take_over_drops_garbage(
    recorder: StatsRecorder, caplog: pytest.LogCaptureFixture
) -> None:
    for n in range(50):
        recorder(ev(Event.RESERVED, task=f"app.t{n}"))
    assert hand_over(limit=100) is None
    assert len(recorder.pending()) == 50  # nothing was taken
    with caplog.at_level(logging.WARNING, logger="taskdedup"):
        assert take_over(b"not json") is False
    assert "unreadable stats" in caplog.text
    assert take_over(b'[[1, "app.x", "reserved", 1]]') is False  # no such recorder here


def test_pending_deltas_are_flushed_at_interpreter_exit(redis_url: str,
                                                        redis_client: redis.Redis) -> None:
    script = (
        "import sys\n"
        "from taskdedup import Deduplicator, Policy, RedisStore\n"
        "from taskdedup.stats import attach\n"
        "dedup = Deduplicator(RedisStore.from_url(sys.argv[1]))\n"
        "attach(dedup, interval=3600)\n"
        "p = Policy()\n"
        "dedup.gate('app.exit', p, dedup.identity('app.exit', p, (1,)), 'id-1')\n"
    )
    done = subprocess.run([sys.executable, "-c", script, redis_url], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert fields(redis_client, "app.exit")["reserved"] == 1


def test_read_stats_skips_what_someone_else_wrote_and_keeps_the_counters(
    redis_client: redis.Redis, recorder: StatsRecorder
) -> None:
    """A non-integer field, an undecodable name, a non-UTF-8 stats key or slice key: the other
    counters are still read (SPEC §8: odd fields never break stats)."""
    recorder(ev(Event.RESERVED))
    recorder(ev(Event.DUPLICATE))
    recorder.flush()
    redis_client.hset(stats_key("taskdedup", "app.a"), mapping={"skipped": "1.5", b"\xff": 2})
    redis_client.hset(b"taskdedup:stats:app.\xfe", "reserved", 4)
    redis_client.set(b"taskdedup:bloom:app.\xfe:{0bad.0}:1", b"\x00" * 20)
    stats = read_stats(redis_client)
    assert (stats["app.a"].accepted, stats["app.a"].duplicates) == (1, 1)
    assert stats["app.a"].ignored == ("skipped",) and stats["app.a"].skipped == 0
    assert stats["app.a"].get("\udcff") == 2
    assert stats["app.\udcfe"].accepted == 4
    assert stats["app.a"].as_dict()["ignored_fields"] == ["skipped"]
    from taskdedup.stats import read_windows

    assert "app.\udcfe" in read_windows(redis_client)


def test_a_malformed_event_is_left_out_and_the_others_of_its_batch_are_counted(
    redis_client: redis.Redis, recorder: StatsRecorder
) -> None:
    """Events are counted in batches: one that is not what the core emits (an unhashable
    detail, a latency that is not a number) must not take its batch down with it."""
    recorder(ev(Event.CLAIMED))
    recorder(DedupEvent(Event.SKIPPED, "app.a", "k", "id-2", None,
                        ["not", "a", "word"]))  # type: ignore[arg-type]
    recorder(ev(Event.RESERVED, seconds="soon"))  # type: ignore[arg-type]
    recorder(ev(Event.COMPLETED))
    assert recorder.flush()
    got = fields(redis_client, "app.a")
    assert got["claimed"] == got["completed"] == 1
    assert "skipped" not in got and got["reserved"] == 1 and "gate:count" not in got
