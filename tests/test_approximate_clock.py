"""Approximate windows on the server's clock, and the idempotency-key mismatch (SPEC §12, §3).

The server's clock (``TIME`` in the scripts) decides which slice a success is written to,
which slices a call checks and when a slice expires: a producer or a worker whose clock runs
ahead or behind opens no gap. The client clock is injected (``_now_ms`` of the Redis store);
the server's is real, so these tests place themselves in its slices by waiting for it.

An explicit ``dedup_key`` reused with other arguments after success raises
``IdempotencyKeyMismatch`` under an approximate window, as under an exact one.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from taskdedup import (
    Approximate,
    Deduplicator,
    IdempotencyKeyMismatch,
    MemoryStore,
    Policy,
    RedisStore,
)
from taskdedup import approximate as approx
from taskdedup.core import Verdict
from taskdedup.stores import redis as redis_store
from taskdedup.stores.base import LockState, Outcome
from taskdedup.testing import FakeClock, wait_for
from tests.counting import CommandCounter

NAME = "tests.approx.clock"
SLICE_MS = 1000
POLICY = Policy(ttl=4, lease=30, window=Approximate(capacity=1000, error_rate=0.01, slices=4))


def server_ms(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


class Clocks:
    """The client clock of the Redis store, as the server's plus a skew (milliseconds)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.skew = 0
        monkeypatch.setattr(redis_store, "_offset_ms", 0)  # nothing learnt yet
        monkeypatch.setattr(redis_store, "_now_ms",
                            lambda: int(time.time() * 1000) + self.skew)


@pytest.fixture
def clocks(monkeypatch: pytest.MonkeyPatch) -> Clocks:
    return Clocks(monkeypatch)


def handed_over(client: redis.Redis, key: str) -> bool:
    """Whether ``key`` holds no exact lock any more: the success went to the filter (the lock
    is gone, or only a finished tombstone of its owner is left, which other calls ignore)."""
    value = client.get(key)
    return value is None or value.startswith(b"F|")


def before_an_edge(client: redis.Redis, low: int = 700, high: int = 800) -> int:
    """Wait until the server's clock is ``low``..``high`` ms into a slice; its time then."""
    return wait_for(lambda: (lambda now: now if low <= now % SLICE_MS <= high else 0)(
        server_ms(client)), timeout=5, interval=0.005, what="the server clock near an edge")


@pytest.mark.parametrize("worker_skew, producer_skew", [
    (300, 0),        # the worker's clock crosses the slice edge first
    (0, -300),       # the producer's clock lags behind the edge
    (-300, 300),
    (2500, 0),       # more than a slice ahead
    (-5500, 0),      # behind by more than the whole window: its slice would expire at once
    (0, 2500),
    (0, -5500),
])
def test_a_skewed_worker_or_producer_opens_no_gap(
    redis_client: redis.Redis, clocks: Clocks, worker_skew: int, producer_skew: int
) -> None:
    """Just before a slice edge on the server: the worker remembers a success with its
    skewed clock, and the producer, with its own, finds it at once."""
    dedup = Deduplicator(RedisStore(redis_client))
    label = uuid.uuid4().hex
    identity = dedup.identity(NAME, POLICY, (label,))
    assert dedup.gate(NAME, POLICY, identity, "t1").verdict is Verdict.ACCEPTED
    before_an_edge(redis_client)
    clocks.skew = worker_skew
    assert dedup.start(NAME, POLICY, identity.key, "t1").verdict is Verdict.ACCEPTED
    dedup.finish(NAME, POLICY, identity.key, "t1", success=True)
    assert handed_over(redis_client, identity.key)
    clocks.skew = producer_skew
    again = dedup.gate(NAME, POLICY, identity, "t2")
    assert (again.verdict, again.existing_id, again.state) == (
        Verdict.DUPLICATE, None, LockState.DONE)
    clocks.skew = worker_skew
    assert dedup.start(NAME, POLICY, identity.key, "t3").verdict is Verdict.DUPLICATE


def test_the_server_clock_names_the_slice_and_its_expiry(
    redis_client: redis.Redis, clocks: Clocks
) -> None:
    """A worker 300 ms ahead just before an edge writes the server's current slice, which
    lives until its last identity is ttl old on the server's clock."""
    store = RedisStore(redis_client)
    key = approx.lock_key("taskdedup", None, NAME, uuid.uuid4().hex, POLICY.window)  # type: ignore[arg-type]
    probe = approx.probe(key, POLICY.window, POLICY.ttl_ms)  # type: ignore[arg-type]
    assert probe is not None
    before_an_edge(redis_client)
    clocks.skew = 300
    assert store.claim(key, "t1", 30_000, window=probe).outcome is Outcome.ACQUIRED
    start = server_ms(redis_client)
    remembered = store.remember(key, "t1", probe)
    end = server_ms(redis_client)
    assert remembered.outcome is Outcome.OK
    assert start // SLICE_MS <= remembered.slice_index <= end // SLICE_MS
    (slice_key,) = [k.decode() for k in redis_client.scan_iter(match="taskdedup:bloom:*")]
    assert slice_key == f"{probe.slice_prefix}{remembered.slice_index}"
    expires = (remembered.slice_index + 1) * SLICE_MS + POLICY.ttl_ms
    pttl = redis_client.pttl(slice_key)
    assert expires - server_ms(redis_client) - 50 <= pttl <= expires - start


def test_within_a_slice_of_skew_each_step_stays_one_round_trip(
    redis_client: redis.Redis, clocks: Clocks, monkeypatch: pytest.MonkeyPatch
) -> None:
    dedup = Deduplicator(RedisStore(redis_client))
    dedup.check_store()
    warm = dedup.identity(NAME, POLICY, ("warm",))
    dedup.gate(NAME, POLICY, warm, "w")
    dedup.start(NAME, POLICY, warm.key, "w")
    dedup.finish(NAME, POLICY, warm.key, "w", success=True)  # scripts loaded
    identity = dedup.identity(NAME, POLICY, ("one-trip",))
    counter = CommandCounter(monkeypatch)
    clocks.skew = -900
    assert dedup.gate(NAME, POLICY, identity, "t1").verdict is Verdict.ACCEPTED
    clocks.skew = 900
    assert dedup.start(NAME, POLICY, identity.key, "t1").verdict is Verdict.ACCEPTED
    dedup.finish(NAME, POLICY, identity.key, "t1", success=True)
    clocks.skew = -900
    assert dedup.gate(NAME, POLICY, identity, "t2").verdict is Verdict.DUPLICATE
    assert counter.commands == ["EVALSHA"] * 4


def test_a_clock_off_by_more_than_a_slice_costs_one_more_round_trip_once(
    redis_client: redis.Redis, clocks: Clocks, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The script tells a caller whose keys miss the server's live slices the server's
    time; the call is made again with the right keys, and later calls start from it."""
    dedup = Deduplicator(RedisStore(redis_client))
    dedup.check_store()
    dedup.gate(NAME, POLICY, dedup.identity(NAME, POLICY, ("warm",)), "w")  # loaded
    clocks.skew = 60_000
    counter = CommandCounter(monkeypatch)
    first = dedup.identity(NAME, POLICY, ("far-1",))
    assert dedup.gate(NAME, POLICY, first, "t1").verdict is Verdict.ACCEPTED
    assert counter.commands == ["EVALSHA"] * 2  # told the server's time, made again
    assert dedup.start(NAME, POLICY, first.key, "t1").verdict is Verdict.ACCEPTED
    dedup.finish(NAME, POLICY, first.key, "t1", success=True)
    assert counter.commands == ["EVALSHA"] * 4
    counter.commands.clear()
    assert dedup.gate(NAME, POLICY, first, "t2").verdict is Verdict.DUPLICATE
    second = dedup.identity(NAME, POLICY, ("far-2",))
    assert dedup.gate(NAME, POLICY, second, "t3").verdict is Verdict.ACCEPTED
    assert counter.commands == ["EVALSHA"] * 2  # the server's time is known now


def test_gate_many_and_the_fused_push_answer_on_the_server_clock(
    redis_client: redis.Redis, clocks: Clocks
) -> None:
    from taskdedup.core import GateCall

    dedup = Deduplicator(RedisStore(redis_client))
    identity = dedup.identity(NAME, POLICY, ("batch",))
    dedup.gate(NAME, POLICY, identity, "t1")
    before_an_edge(redis_client)
    clocks.skew = 300
    dedup.start(NAME, POLICY, identity.key, "t1")
    dedup.finish(NAME, POLICY, identity.key, "t1", success=True)
    for skew in (0, -300, -7000, 7000):
        clocks.skew = skew
        answers = dedup.gate_many([GateCall(NAME, POLICY, identity, "t2", POLICY.ttl_ms)])
        assert [(a.verdict, a.existing_id) for a in answers] == [  # type: ignore[union-attr]
            (Verdict.DUPLICATE, None)]
        probe = approx.probe(identity.key, POLICY.window, POLICY.ttl_ms)  # type: ignore[arg-type]
        lock, _ = redis_store.reserve_and_run(
            redis_client, identity.key, "f1", POLICY.ttl_ms, "", False,
            [("LPUSH", "clock-q", "m")], window=probe)
        assert (lock.outcome, lock.owner, lock.state) == (Outcome.DUPLICATE, None, LockState.DONE)
    assert redis_client.llen("clock-q") == 0


# -- the idempotency-key mismatch -----------------------------------------------------------------


@pytest.fixture(params=["memory", "redis"])
def dedup(request: pytest.FixtureRequest) -> Iterator[Deduplicator]:
    if request.param == "memory":
        yield Deduplicator(MemoryStore(clock=FakeClock(start=1_000_000.0)))
    else:
        yield Deduplicator(RedisStore(request.getfixturevalue("redis_client")))


def succeed(dedup: Deduplicator, policy: Policy, args: tuple[Any, ...], key: str | None,
            owner: str) -> None:
    identity = dedup.identity(NAME, policy, args, dedup_key=key)
    assert dedup.gate(NAME, policy, identity, owner).verdict is Verdict.ACCEPTED
    assert dedup.start(NAME, policy, identity.key, owner).verdict is Verdict.ACCEPTED
    dedup.finish(NAME, policy, identity.key, owner, success=True)


@pytest.mark.parametrize("window", [None, POLICY.window], ids=["exact", "approximate"])
def test_a_dedup_key_reused_with_other_arguments_after_success_raises_on_every_tier(
    dedup: Deduplicator, window: Approximate | None
) -> None:
    policy = Policy(ttl=60, lease=30, window=window)
    succeed(dedup, policy, (1, "eur"), "ORD-1", "t1")
    with pytest.raises(IdempotencyKeyMismatch) as caught:
        dedup.gate(NAME, policy, dedup.identity(NAME, policy, (2, "eur"), dedup_key="ORD-1"),
                   "t2")
    assert caught.value.existing_id == (None if window else "t1")
    assert ("approximate window" in str(caught.value)) is (window is not None)
    same = dedup.gate(NAME, policy, dedup.identity(NAME, policy, (1, "eur"),
                                                   dedup_key="ORD-1"), "t3")
    assert (same.verdict, same.state) == (Verdict.DUPLICATE, LockState.DONE)
    # the same key with replace mode, and a key never used, as on the exact tier
    replace = Policy(ttl=60, lease=30, window=window, on_duplicate="replace")
    with pytest.raises(IdempotencyKeyMismatch):
        dedup.gate(NAME, replace, dedup.identity(NAME, replace, (3, "eur"),
                                                 dedup_key="ORD-1"), "t4")
    fresh = dedup.identity(NAME, policy, (2, "eur"), dedup_key="ORD-2")
    assert dedup.gate(NAME, policy, fresh, "t5").verdict is Verdict.ACCEPTED
    # calls without an explicit key are not checked for arguments
    succeed(dedup, policy, (7,), None, "t6")
    plain = dedup.gate(NAME, policy, dedup.identity(NAME, policy, (7,)), "t7")
    assert plain.verdict is Verdict.DUPLICATE


def test_the_fused_push_raises_the_mismatch_and_pushes_nothing(
    redis_client: redis.Redis,
) -> None:
    dedup = Deduplicator(RedisStore(redis_client))
    policy = POLICY
    succeed(dedup, policy, ("a",), "K-1", "t1")
    other = dedup.identity(NAME, policy, ("b",), dedup_key="K-1")
    probe = approx.probe(other.key, policy.window, policy.ttl_ms)  # type: ignore[arg-type]
    lock, _ = redis_store.reserve_and_run(redis_client, other.key, "f1", policy.ttl_ms,
                                          other.check, False, [("LPUSH", "mm-q", "m")],
                                          window=probe)
    assert (lock.outcome, lock.owner, lock.state) == (Outcome.MISMATCH, None, LockState.DONE)
    with pytest.raises(IdempotencyKeyMismatch):
        dedup.verdict(NAME, other, "f1", lock)
    assert redis_client.llen("mm-q") == 0 and handed_over(redis_client, other.key)


def test_the_mismatch_costs_no_argument_values_in_redis(redis_client: redis.Redis) -> None:
    dedup = Deduplicator(RedisStore(redis_client))
    secret = "card-4242-4242"
    succeed(dedup, POLICY, (secret,), "K-secret", "t1")
    for key in redis_client.scan_iter():
        assert secret.encode() not in key
        if redis_client.type(key) == b"string":
            assert secret.encode() not in redis_client.get(key)  # type: ignore[operator]


def test_the_pair_has_the_same_bits_in_lua_and_in_memory_store(
    redis_client: redis.Redis,
) -> None:
    """``check_bits`` in ``_lib.lua`` and ``Probe.check_positions`` place the pair of an
    identity and its argument check on the same bits (a MemoryStore test means Redis)."""
    memory = Deduplicator(MemoryStore(clock=FakeClock(start=1_000_000.0)))
    real = Deduplicator(RedisStore(redis_client))
    for dedup in (memory, real):
        for number in range(5):
            succeed(dedup, POLICY, (number, "eur"), f"ORD-pair-{number}", f"t{number}")
    window = POLICY.window
    assert window is not None
    on_memory = {key.rpartition(":")[0]: bits for key, (bits, _, _) in
                 memory.store.slices().items()}  # type: ignore[attr-defined]
    on_redis = {key.decode().rpartition(":")[0]: redis_client.get(key)[: window.bits // 8]  # type: ignore[index]
                for key in redis_client.scan_iter(match="taskdedup:bloom:*")}
    assert on_memory == on_redis and len(on_redis) >= 1
    added = sum(bin(byte).count("1") for bits in on_redis.values() for byte in bits)
    assert added > 5 * window.hashes  # the identities and their pairs
