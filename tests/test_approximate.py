"""Approximate windows (SPEC §12): rotating Bloom filters behind ``until_expired``.

The store-level tests run over MemoryStore and a real Redis server; slice rotation is driven
by a fake clock (MemoryStore's clock; on Redis, the server's clock the scripts read, frozen
and moved by :class:`ServerClock`), and once in real time on Redis with a short ttl
(tests/test_approximate_clock.py runs on the real server clock with skewed client clocks).
"""

from __future__ import annotations

import hashlib
import logging
import math
import random
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

import taskdedup
from taskdedup import (
    Approximate,
    ConfigurationError,
    Deduplicator,
    DuplicateTaskError,
    MemoryStore,
    Policy,
    RedisStore,
)
from taskdedup import approximate as approx
from taskdedup.core import Verdict, resolve_duplicate
from taskdedup.stores import redis as redis_store
from taskdedup.stores.base import LockState, Outcome
from taskdedup.testing import FakeClock, wait_for
from tests.counting import CommandCounter

NAME = "tests.approx"


# -- the public names -----------------------------------------------------------------------------


def test_approximate_is_exported_and_sized_by_the_standard_formulas() -> None:
    assert "Approximate" in taskdedup.__all__ and taskdedup.Approximate is Approximate
    window = Approximate(capacity=10_000_000, error_rate=0.001)
    assert (window.slices, window.partitions) == (4, 16)
    live = window.slices + 1
    mean = 10_000_000 / (live * window.partitions)
    n = mean + math.sqrt(mean * (1 - 1 / window.partitions))  # one standard deviation more
    p = 0.001 / live
    assert window.bits == math.ceil(math.ceil(-n * math.log(p) / math.log(2) ** 2) / 8) * 8
    assert window.hashes == round(window.bits / n * math.log(2))
    assert window.share == math.ceil(mean)
    # the union of the live slices, each at its share, stays within error_rate
    per_slice = (1 - math.exp(-window.hashes * mean / window.bits)) ** window.hashes
    assert 1 - (1 - per_slice) ** live <= 0.001 * 1.01
    with pytest.raises(AttributeError):
        window.capacity = 5  # type: ignore[misc]  # frozen


@pytest.mark.parametrize("kwargs, words", [
    ({"capacity": 0, "error_rate": 0.01}, "capacity must be a positive int"),
    ({"capacity": -5, "error_rate": 0.01}, "capacity must be a positive int"),
    ({"capacity": 1.5, "error_rate": 0.01}, "capacity must be a positive int"),
    ({"capacity": 100, "error_rate": 0}, "error_rate must be a number between 0 and 1"),
    ({"capacity": 100, "error_rate": 1}, "error_rate must be a number between 0 and 1"),
    ({"capacity": 100, "error_rate": "0.1"}, "error_rate must be a number between 0 and 1"),
    ({"capacity": 100, "error_rate": 0.01, "slices": 0}, "slices must be an int from 1"),
    ({"capacity": 100, "error_rate": 0.01, "partitions": 0}, "partitions must be an int"),
])
def test_approximate_refuses_bad_values_when_built(kwargs: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigurationError, match=words):
        Approximate(**kwargs)


@pytest.mark.parametrize("mode", ["until_executing", "until_executed", "while_executing"])
def test_a_window_is_only_accepted_with_until_expired(mode: str) -> None:
    with pytest.raises(ConfigurationError, match="use mode='until_expired' or drop window="):
        Policy(mode=mode, window=Approximate(1000, 0.01))
    policy = Policy(mode="until_expired", ttl=86400,
                    window=Approximate(capacity=10_000_000, error_rate=0.001))
    assert policy.window == Approximate(10_000_000, 0.001)
    as_dict = Policy.coerce({"ttl": 60, "window": {"capacity": 100, "error_rate": 0.1}})
    assert as_dict is not None and as_dict.window == Approximate(100, 0.1)
    with pytest.raises(ConfigurationError, match="window must be"):
        Policy(window=0.01)  # type: ignore[arg-type]


def test_the_lock_and_its_slices_share_a_hash_tag_and_the_key_stays_readable() -> None:
    dedup = Deduplicator(MemoryStore())
    policy = Policy(ttl=60, scope="eu", window=Approximate(1000, 0.01))
    key = dedup.identity("billing.charge", policy, (42,)).key
    assert key.startswith("taskdedup:eu:billing.charge:{")  # readable, then the hash tag
    assert key.rpartition(":")[0] == "taskdedup:eu:billing.charge"  # no ':' in the tag
    probe = approx.probe(key, policy.window, policy.ttl_ms)  # type: ignore[arg-type]
    assert probe is not None
    tag = key[key.index("{"): key.index("}") + 1]
    assert all(tag in slice_key and slice_key.startswith("taskdedup:bloom:eu:billing.charge:{")
               for slice_key in probe.keys(10**12))
    assert len(probe.keys(10**12)) == 5  # slices + 1 live
    with pytest.raises(ConfigurationError, match="without braces"):
        dedup.identity("odd{name}", policy, (1,))


# -- the stores -----------------------------------------------------------------------------------


class ServerClock:
    """The server's clock as the approximate-window scripts read it, frozen and moved by the
    test: RedisStores made after it run scripts whose ``TIME`` reading is replaced by a value
    kept in a key (not a product hook: the shipped scripts always read ``TIME``)."""

    KEY = "taskdedup-test:server-clock-ms"
    TIME = "local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)"

    def __init__(self, client: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
        fake = f"local now = tonumber(redis.call('GET', '{self.KEY}'))"
        scripts = {}
        for name, source in redis_store.SCRIPTS.items():
            # a script carries the window's functions only when it calls them
            windowed = "local function window(" in source
            assert windowed <= (self.TIME in source), "the window's clock reading moved"
            scripts[name] = source.replace(self.TIME, fake)
        assert all("local function window(" in redis_store.SCRIPTS[name]
                   for name in ("reserve", "replace", "claim", "complete", "enqueue"))
        monkeypatch.setattr(redis_store, "SCRIPTS", scripts)
        sha = hashlib.sha1(scripts["enqueue"].encode()).hexdigest()
        monkeypatch.setattr(redis_store, "_ENQUEUE_SHA", sha)
        monkeypatch.setattr(redis_store, "_ENQUEUE_SHA_BYTES", sha.encode())
        monkeypatch.setattr(redis_store, "_offset_ms", 0)
        self.client = client
        seconds, micros = client.time()
        client.set(self.KEY, int(seconds) * 1000 + int(micros) // 1000)

    def now_ms(self) -> int:
        return int(self.client.get(self.KEY))  # type: ignore[arg-type]

    def advance(self, seconds: float) -> None:
        self.client.incrby(self.KEY, int(seconds * 1000))


class Env:
    """A store, a Deduplicator over it and a clock that moves the slices (fake time)."""

    def __init__(self, store: Any, advance: Callable[[float], None]) -> None:
        self.store = store
        self.dedup = Deduplicator(store)
        self.advance = advance


@pytest.fixture(params=["memory", "redis"])
def env(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Env]:
    if request.param == "memory":
        clock = FakeClock(start=1_000_000.0)
        yield Env(MemoryStore(clock=clock), clock.advance)
        return
    client = request.getfixturevalue("redis_client")
    clock = ServerClock(client, monkeypatch)
    store = RedisStore(client)
    yield Env(store, clock.advance)


POLICY = Policy(ttl=40, lease=30, window=Approximate(capacity=1000, error_rate=0.01))


def run(env: Env, policy: Policy, arg: Any, owner: str) -> str:
    """Gate, start and finish one call successfully; its lock key."""
    identity = env.dedup.identity(NAME, policy, (arg,))
    assert env.dedup.gate(NAME, policy, identity, owner).verdict is Verdict.ACCEPTED
    assert env.dedup.start(NAME, policy, identity.key, owner).verdict is Verdict.ACCEPTED
    env.dedup.finish(NAME, policy, identity.key, owner, success=True)
    return identity.key


def test_success_moves_the_identity_from_its_lock_into_the_filter(env: Env) -> None:
    key = run(env, POLICY, 1, "t1")
    tombstone = env.store.get(key)  # no done lock kept for ttl: a tombstone for one lease
    assert tombstone is not None and (tombstone.state, tombstone.owner) == (
        LockState.FINISHED, "t1") and tombstone.ttl_ms <= POLICY.lease_ms
    identity = env.dedup.identity(NAME, POLICY, (1,))
    again = env.dedup.gate(NAME, POLICY, identity, "t2")
    assert (again.verdict, again.existing_id, again.state) == (
        Verdict.DUPLICATE, None, LockState.DONE)
    after = env.store.get(key)  # the duplicate wrote nothing
    assert after is not None and (after.state, after.owner) == (LockState.FINISHED, "t1")
    other = env.dedup.identity(NAME, POLICY, (2,))
    assert env.dedup.gate(NAME, POLICY, other, "t3").verdict is Verdict.ACCEPTED


def test_queued_and_running_stay_exact_locks(env: Env) -> None:
    identity = env.dedup.identity(NAME, POLICY, ("q",))
    assert env.dedup.gate(NAME, POLICY, identity, "t1").verdict is Verdict.ACCEPTED
    queued = env.dedup.gate(NAME, POLICY, identity, "t2")
    assert (queued.verdict, queued.existing_id, queued.state) == (
        Verdict.DUPLICATE, "t1", LockState.QUEUED)
    assert env.dedup.start(NAME, POLICY, identity.key, "t1").verdict is Verdict.ACCEPTED
    running = env.dedup.gate(NAME, POLICY, identity, "t2")
    assert (running.existing_id, running.state) == ("t1", LockState.RUNNING)
    lock = env.store.get(identity.key)
    assert lock is not None and lock.owner == "t1" and lock.state is LockState.RUNNING
    env.dedup.finish(NAME, POLICY, identity.key, "t1", success=True)


def test_a_retry_keeps_its_lock_and_runs_and_a_third_party_stays_suppressed(env: Env) -> None:
    identity = env.dedup.identity(NAME, POLICY, ("retry",))
    assert env.dedup.gate(NAME, POLICY, identity, "t1").verdict is Verdict.ACCEPTED
    assert env.dedup.start(NAME, POLICY, identity.key, "t1").verdict is Verdict.ACCEPTED
    # the body asks for a retry: the same id re-reserves for its countdown
    assert env.dedup.gate(NAME, POLICY, identity, "t1").verdict is Verdict.ACCEPTED
    assert env.dedup.gate(NAME, POLICY, identity, "t9").existing_id == "t1"
    env.dedup.finish(NAME, POLICY, identity.key, "t1", success=True)  # retry pending: kept
    lock = env.store.get(identity.key)
    assert lock is not None and lock.state is LockState.QUEUED
    # the retry runs, then succeeds into the filter
    assert env.dedup.start(NAME, POLICY, identity.key, "t1").verdict is Verdict.ACCEPTED
    env.dedup.finish(NAME, POLICY, identity.key, "t1", success=True)
    assert env.dedup.gate(NAME, POLICY, identity, "t9").state is LockState.DONE


def test_a_final_failure_releases_and_remembers_nothing(env: Env) -> None:
    identity = env.dedup.identity(NAME, POLICY, ("fail",))
    assert env.dedup.gate(NAME, POLICY, identity, "t1").verdict is Verdict.ACCEPTED
    assert env.dedup.start(NAME, POLICY, identity.key, "t1").verdict is Verdict.ACCEPTED
    env.dedup.finish(NAME, POLICY, identity.key, "t1", success=False)
    assert env.store.get(identity.key) is None
    assert env.dedup.gate(NAME, POLICY, identity, "t2").verdict is Verdict.ACCEPTED


def test_a_lost_lease_frees_the_identity_and_the_former_owner_adds_nothing(
    env: Env,
) -> None:
    policy = Policy(ttl=40, lease=0.2, window=POLICY.window)
    identity = env.dedup.identity(NAME, policy, ("lease",))
    assert env.dedup.gate(NAME, policy, identity, "t1").verdict is Verdict.ACCEPTED
    assert env.dedup.start(NAME, policy, identity.key, "t1").verdict is Verdict.ACCEPTED
    env.dedup.stop_heartbeat(identity.key, "t1")  # a dead worker: nobody renews the lease
    if isinstance(env.store, MemoryStore):
        env.store._clock.advance(0.25)  # type: ignore[attr-defined]
    else:
        wait_for(lambda: env.store.get(identity.key) is None, timeout=10, what="lease expiry")
    assert env.dedup.start(NAME, policy, identity.key, "t2").verdict is Verdict.ACCEPTED
    assert env.store.remember(identity.key, "t1", approx.probe(
        identity.key, policy.window, policy.ttl_ms)).outcome is Outcome.NOT_OWNER
    lock = env.store.get(identity.key)
    assert lock is not None and lock.owner == "t2"


def test_the_claim_skips_an_identity_the_filter_remembers(env: Env) -> None:
    """A redelivery after success (within a lease: the tombstone; later: the filter), or a
    message that bypassed the gate: the body does not run again."""
    key = run(env, POLICY, "claim", "t1")
    redelivered = env.dedup.start(NAME, POLICY, key, "t1")
    assert (redelivered.verdict, redelivered.existing_id, redelivered.state) == (
        Verdict.FINISHED, "t1", LockState.FINISHED)
    skipped = env.dedup.start(NAME, POLICY, key, "t2")
    assert (skipped.verdict, skipped.existing_id, skipped.state) == (
        Verdict.DUPLICATE, None, LockState.DONE)
    if isinstance(env.store, MemoryStore):  # the tombstone lapses after one lease
        env.advance(POLICY.lease + 0.001)
    else:
        env.store.client.delete(key)
    late = env.dedup.start(NAME, POLICY, key, "t1")
    assert (late.verdict, late.existing_id, late.state) == (
        Verdict.DUPLICATE, None, LockState.DONE)
    assert env.store.get(key) is None


def test_replace_mode_treats_a_remembered_identity_as_a_started_original(env: Env) -> None:
    policy = Policy(ttl=40, on_duplicate="replace", window=POLICY.window)
    key = run(env, policy, "replace", "t1")
    identity = env.dedup.identity(NAME, policy, ("replace",))
    assert identity.key == key
    result = env.dedup.gate(NAME, policy, identity, "t2")
    assert (result.verdict, result.existing_id) == (Verdict.DUPLICATE, None)


def test_the_window_lasts_ttl_and_ends_with_its_last_slice(env: Env) -> None:
    """Remembered at least ttl and at most ttl + ttl/slices after its success."""
    policy = Policy(ttl=40, window=Approximate(1000, 0.01, slices=4))  # slices of 10 s
    key = run(env, policy, "rotate", "t1")
    identity = env.dedup.identity(NAME, policy, ("rotate",))
    for _ in range(4):
        env.advance(10.0)  # 40 s in all: still within the window
        assert env.dedup.gate(NAME, policy, identity, "t2").verdict is Verdict.DUPLICATE
    env.advance(10.0)  # 50 s: past ttl + ttl/slices, the slice is no longer live
    assert env.dedup.gate(NAME, policy, identity, "t2").verdict is Verdict.ACCEPTED
    assert env.store.get(key) is not None and env.store.get(key).owner == "t2"


def test_a_duplicate_remembered_by_the_window_has_no_original_to_return() -> None:
    """on_duplicate: "return" and "drop" give None (a filter keeps no id: none is made up),
    "raise" raises with existing_id None, "replace" raises as for a started original."""
    key = "taskdedup:t:{t.1}" + "0" * 32
    for mode, handed in (("return", False), ("drop", False)):
        policy = Policy(on_duplicate=mode, window=Approximate(100, 0.01))
        assert resolve_duplicate(NAME, policy, key, None) is handed
    for mode in ("raise", "replace"):
        policy = Policy(on_duplicate=mode, window=Approximate(100, 0.01))
        with pytest.raises(DuplicateTaskError, match="approximate window") as caught:
            resolve_duplicate(NAME, policy, key, None)
        assert caught.value.existing_id is None and caught.value.key == key
    # a call that carries a workflow is never dropped silently
    with pytest.raises(DuplicateTaskError, match="link"):
        resolve_duplicate(NAME, Policy(window=Approximate(100, 0.01)), key, None, ["link"])


def test_a_slice_past_its_capacity_share_warns_once(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    policy = Policy(ttl=40, window=Approximate(capacity=100, error_rate=0.01, slices=1,
                                               partitions=1))
    assert policy.window is not None and policy.window.share == 50
    remembered = 0
    warned_at = None
    with caplog.at_level(logging.WARNING, logger="taskdedup"):
        for i in range(120):
            key = env.dedup.identity(NAME, policy, (f"w{i}",)).key
            if env.dedup.start(NAME, policy, key, f"t{i}").verdict is not Verdict.ACCEPTED:
                continue  # a false positive (the filter is driven past its capacity)
            env.dedup.finish(NAME, policy, key, f"t{i}", success=True)
            remembered += 1
            if warned_at is None and any(
                "passed its capacity" in r.getMessage() for r in caplog.records
            ):
                warned_at = remembered
    warned = [r for r in caplog.records if "passed its capacity" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING
    assert warned_at == 51  # the first identity past the share of 50
    assert remembered > 60
    assert "w51" not in warned[0].getMessage()  # no argument values in logs


def test_the_false_positive_rate_at_capacity_is_within_the_configured_rate(env: Env) -> None:
    """Seeded: capacity 20,000 identities spread over the 5 live slices (4,000 each, as a
    steady rate fills them), then 20,000 new identities checked at the reservation."""
    window = Approximate(capacity=20_000, error_rate=0.01, slices=4)
    policy = Policy(ttl=400, window=window)
    rng = random.Random(1313)
    per_slice = window.capacity // (window.slices + 1)
    store = env.store
    for index in range(window.slices + 1):
        if index:
            env.advance(100.0)  # the next slice
        for _ in range(per_slice):
            key = approx.lock_key("taskdedup", None, NAME, f"{rng.getrandbits(128):032x}",
                                  window)
            probe = approx.probe(key, window, policy.ttl_ms)
            assert store.claim(key, "t", 30_000).outcome is Outcome.ACQUIRED  # no check: fill
            assert store.remember(key, "t", probe).outcome is Outcome.OK
    fresh_rng = random.Random(2626)
    duplicates = 0
    checks = 20_000
    for _ in range(checks):
        key = approx.lock_key("taskdedup", None, NAME, f"{fresh_rng.getrandbits(128):032x}",
                              window)
        probe = approx.probe(key, window, policy.ttl_ms)
        # the newest slice is current: all five filled slices are live
        result = store.claim(key, "n", 30_000, window=probe)
        duplicates += result.outcome is Outcome.DUPLICATE
    measured = duplicates / checks
    print(f"measured false-positive rate at capacity: {measured:.4%} (configured 1%)")
    assert 0.004 <= measured <= 0.012  # within 1.2x, and the filter does fill


def test_slice_keys_expire_after_their_life_on_redis_in_real_time(
    redis_client: redis.Redis,
) -> None:
    """Real time, short ttl: an identity is a duplicate right after its success, and a new
    call is accepted once its slice has left the window; the slice key expires by itself."""
    store = RedisStore(redis_client)
    dedup = Deduplicator(store)
    policy = Policy(ttl=1.2, window=Approximate(1000, 0.01, slices=3))  # slices of 0.4 s
    identity = dedup.identity(NAME, policy, ("real",))
    assert dedup.gate(NAME, policy, identity, "t1").verdict is Verdict.ACCEPTED
    assert dedup.start(NAME, policy, identity.key, "t1").verdict is Verdict.ACCEPTED
    dedup.finish(NAME, policy, identity.key, "t1", success=True)
    slices = list(redis_client.scan_iter(match="taskdedup:bloom:*"))
    assert len(slices) == 1
    assert 0 < redis_client.pttl(slices[0]) <= 1600  # ttl + ttl/slices at most
    assert dedup.gate(NAME, policy, identity, "t2").verdict is Verdict.DUPLICATE
    accepted = wait_for(
        lambda: dedup.gate(NAME, policy, identity, "t3").verdict is Verdict.ACCEPTED,
        timeout=10, interval=0.05, what="the window to forget the identity")
    assert accepted
    wait_for(lambda: not redis_client.exists(slices[0]), timeout=10,
             what="the slice key to expire")


# -- one round trip -------------------------------------------------------------------------------


def test_each_step_under_a_window_is_one_round_trip(
    redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    dedup = Deduplicator(RedisStore(redis_client))
    run(Env(dedup.store, lambda s: None), POLICY, "warm", "w")  # scripts loaded
    dedup.check_store()
    identity = dedup.identity(NAME, POLICY, ("rt",))
    counter = CommandCounter(monkeypatch)
    assert dedup.gate(NAME, POLICY, identity, "t1").verdict is Verdict.ACCEPTED
    assert counter.commands == ["EVALSHA"]
    assert dedup.start(NAME, POLICY, identity.key, "t1").verdict is Verdict.ACCEPTED
    assert counter.commands == ["EVALSHA"] * 2
    dedup.finish(NAME, POLICY, identity.key, "t1", success=True)
    assert counter.commands == ["EVALSHA"] * 3
    assert dedup.gate(NAME, POLICY, identity, "t2").verdict is Verdict.DUPLICATE
    assert counter.commands == ["EVALSHA"] * 4
    # the fused push (Celery's transport, RQ's enqueue): filters, lock and push, one script
    key2 = dedup.identity(NAME, POLICY, ("fused",)).key
    probe = approx.probe(key2, POLICY.window, POLICY.ttl_ms)  # type: ignore[arg-type]
    redis_store.reserve_and_run(redis_client, "taskdedup:warm", "w", 1000, "", False, [])
    counter.commands.clear()
    lock, _ = redis_store.reserve_and_run(redis_client, key2, "f1", 40_000, "", False,
                                          [("LPUSH", "approx-q", "m1")], window=probe)
    assert lock.outcome is Outcome.ACQUIRED and counter.commands == ["EVALSHA"]
    assert redis_client.lrange("approx-q", 0, -1) == [b"m1"]
    assert dedup.start(NAME, POLICY, key2, "f1").verdict is Verdict.ACCEPTED
    dedup.finish(NAME, POLICY, key2, "f1", success=True)
    counter.commands.clear()
    lock, _ = redis_store.reserve_and_run(redis_client, key2, "f2", 40_000, "", False,
                                          [("LPUSH", "approx-q", "m2")], window=probe)
    assert (lock.outcome, lock.owner, lock.state) == (Outcome.DUPLICATE, None, LockState.DONE)
    assert counter.commands == ["EVALSHA"]
    assert redis_client.lrange("approx-q", 0, -1) == [b"m1"]  # the duplicate pushed nothing


def test_gate_many_gates_approximate_calls_in_one_round_trip_with_the_window(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch (a Celery group, RQ's enqueue_many) of windowed calls: every reservation,
    window probe included, in one reserve_many; a remembered identity is a duplicate with no
    original id, a fresh one and an exact-window call beside them are accepted."""
    from taskdedup.core import GateCall

    dedup = env.dedup
    key = run(env, POLICY, "many", "t1")
    exact = Policy(ttl=40)
    calls = [
        GateCall(NAME, POLICY, dedup.identity(NAME, POLICY, ("many",)), "t2", POLICY.ttl_ms),
        GateCall(NAME, POLICY, dedup.identity(NAME, POLICY, ("other",)), "t3", POLICY.ttl_ms),
        GateCall(NAME, exact, dedup.identity(NAME, exact, ("many",)), "t4", exact.ttl_ms),
    ]
    bulk: list[Any] = []
    single: list[Any] = []
    one, many = type(env.store).reserve, type(env.store).reserve_many

    def reserve(store: Any, *args: Any, **kwargs: Any) -> Any:
        single.append(args)
        return one(store, *args, **kwargs)

    def reserve_many(store: Any, *args: Any, **kwargs: Any) -> Any:
        bulk.append(kwargs.get("windows"))
        return many(store, *args, **kwargs)

    monkeypatch.setattr(type(env.store), "reserve", reserve)
    monkeypatch.setattr(type(env.store), "reserve_many", reserve_many)
    answers = dedup.gate_many(calls)
    assert [(a.verdict, a.existing_id) for a in answers] == [  # type: ignore[union-attr]
        (Verdict.DUPLICATE, None), (Verdict.ACCEPTED, None), (Verdict.ACCEPTED, None)]
    assert calls[0].identity.key == key
    assert single == [] and len(bulk) == 1  # one reserve_many, nothing one by one
    windows = bulk[0]
    assert windows is not None and [w is None for w in windows] == [False, False, True]
    single.clear()
    again = dedup.gate(NAME, POLICY, calls[1].identity, "t5")  # t3's reservation holds
    assert (again.verdict, again.existing_id) == (Verdict.DUPLICATE, "t3") and single


def test_celery_eager_mode_runs_once_and_a_remembered_duplicate_returns_none() -> None:
    from celery import Celery

    from taskdedup.celery import DedupTask

    app = Celery("approx-eager", set_as_current=False)
    app.conf.update(task_always_eager=True, taskdedup_store=MemoryStore(),
                    taskdedup_stats=False)
    runs: list[int] = []

    def body(x: int) -> int:
        runs.append(x)
        return x

    task = app.task(base=DedupTask, shared=False, name="tests.approx.eager",
                    dedup=Policy(ttl=60, window=Approximate(1000, 0.01)))(body)
    assert task.delay(1).get() == 1
    assert task.delay(1) is None
    with pytest.raises(DuplicateTaskError) as caught:
        task.apply_async((1,), dedup={"on_duplicate": "raise"})
    assert caught.value.existing_id is None
    assert task.delay(2).get() == 2
    assert runs == [1, 2]
