"""taskdedup.limits without a framework: declaration, keys, and the slot/rate contract over
RedisStore (a real server) and MemoryStore (an injected clock)."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import redis

import taskdedup
from taskdedup import limits
from taskdedup.core import Deduplicator
from taskdedup.events import Event
from taskdedup.exceptions import ConfigurationError
from taskdedup.limits import Concurrency, Rate
from taskdedup.stores import MemoryStore, RedisStore
from taskdedup.stores.base import Outcome
from taskdedup.testing import wait_for


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture(params=["memory", "redis"])
def store(request: pytest.FixtureRequest, redis_client: redis.Redis) -> Iterator[Any]:
    if request.param == "memory":
        yield MemoryStore(clock=Clock())
    else:
        yield RedisStore(redis_client)


def later(store: Any, seconds: float) -> None:
    """Let ``seconds`` pass: on the MemoryStore's clock, or really (Redis's clock)."""
    if isinstance(store, MemoryStore):
        store._clock.advance(seconds)
    else:
        time.sleep(seconds)


# -- declaration ---------------------------------------------------------------------------


@pytest.mark.parametrize("make, words", [
    (lambda: Concurrency(0), "limit must be an int >= 1"),
    (lambda: Concurrency(1.5), "limit must be an int >= 1"),
    (lambda: Concurrency(True), "limit must be an int >= 1"),
    (lambda: Concurrency(1, key="tenant"), "key must be a callable"),
    (lambda: Concurrency(1, on_busy="skip"), "on_busy must be one of"),
    (lambda: Rate(0, per=1), "limit must be an int >= 1"),
    (lambda: Rate(1, per=0), "per must be"),
    (lambda: Rate(1, per=-1), "per must be"),
    (lambda: Rate(1, per=float("nan")), "per must be"),
    (lambda: Rate(1, per=1, key=3), "key must be a callable"),
    (lambda: Rate(1, per=1, on_excess="later"), "on_excess must be one of"),
])
def test_bad_declarations_are_refused(make: Any, words: str) -> None:
    with pytest.raises(ConfigurationError, match=words):
        make()


def test_public_names_and_declaration() -> None:
    assert taskdedup.Concurrency is Concurrency and taskdedup.Rate is Rate
    rate = Rate(5, per=timedelta(minutes=1), on_excess="drop")
    assert rate.per == 60.0 and rate.per_ms == 60_000 and rate.drops
    assert not Concurrency(2).drops
    # concurrency first, so a rate start is never spent on a call that then waits for a slot
    declared = limits.coerce_limits([rate, Concurrency(1)], "t")
    assert [type(x) for x in declared] == [Concurrency, Rate]
    assert limits.coerce_limits(None, "t") == ()
    with pytest.raises(ConfigurationError, match="limits= takes"):
        limits.coerce_limits([object()], "t")
    with pytest.raises(ConfigurationError, match="limits= takes a list"):
        limits.coerce_limits("Rate", "t")


def test_keys_hash_the_value_and_carry_a_hash_tag() -> None:
    by_tenant = Concurrency(1, key=lambda tenant, n=0: tenant)
    a = limits.limit_key("td", "app.work", 0, by_tenant, ("acme-secret",), {"n": 1})
    b = limits.limit_key("td", "app.work", 0, by_tenant, ("acme-secret",), {"n": 2})
    c = limits.limit_key("td", "app.work", 0, by_tenant, ("globex",), {})
    assert a == b != c
    assert "acme" not in a and a.startswith("td:limit:app.work:0c:{") and a.endswith("}")
    assert limits.limit_key("td", "app.work", 1, Rate(1, 1), (), {}).startswith(
        "td:limit:app.work:1r:{")
    with pytest.raises(TypeError, match="key function"):
        limits.limit_key("td", "app.work", 0, by_tenant, (), {})


# -- the store contract --------------------------------------------------------------------


def test_slots_up_to_the_limit_then_refused_with_a_hint(store: Any) -> None:
    assert store.slot_acquire("td:limit:t:0c:{a}", "h1", 2, 5000) == (True, 1)
    assert store.slot_acquire("td:limit:t:0c:{a}", "h2", 2, 5000) == (True, 2)
    ok, wait_ms = store.slot_acquire("td:limit:t:0c:{a}", "h3", 2, 5000)
    assert not ok and 0 < wait_ms <= 5000
    assert store.slot_acquire("td:limit:t:0c:{b}", "h3", 2, 5000)[0]  # another key value
    assert store.slot_release("td:limit:t:0c:{a}", "h1") is Outcome.OK
    assert store.slot_release("td:limit:t:0c:{a}", "h1") is Outcome.NOT_OWNER  # fenced
    assert store.slot_acquire("td:limit:t:0c:{a}", "h3", 2, 5000)[0]


def test_a_slot_lapses_without_heartbeat_and_lives_with_one(store: Any) -> None:
    key = "td:limit:t:0c:{a}"
    assert store.slot_acquire(key, "beaten", 2, 300)[0]
    assert store.slot_acquire(key, "silent", 2, 300)[0]
    later(store, 0.2)
    assert store.slot_heartbeat(key, "beaten", 300) is Outcome.OK
    later(store, 0.2)
    assert store.slot_heartbeat(key, "silent", 300) is Outcome.NOT_OWNER  # lapsed
    assert store.slot_acquire(key, "next", 2, 300)[0]  # the lapsed one's slot
    assert not store.slot_acquire(key, "more", 2, 300)[0]


def test_rate_window_allows_the_first_limit_then_says_when(store: Any) -> None:
    key = "td:limit:t:0r:{a}"
    assert [store.rate_acquire(key, f"s{i}", 3, 400)[0] for i in range(3)] == [True] * 3
    ok, wait_ms = store.rate_acquire(key, "s3", 3, 400)
    assert not ok and 0 < wait_ms <= 400
    later(store, wait_ms / 1000 + 0.02)
    assert store.rate_acquire(key, "s3", 3, 400)[0]
    assert store.slot_release(key, "s3") is Outcome.OK  # a refused call's start taken back
    assert store.rate_acquire(key, "s4", 3, 400)[0]


def test_concurrent_acquires_never_pass_the_limit(redis_client: redis.Redis) -> None:
    store = RedisStore(redis_client)
    got: list[bool] = []

    def take(i: int) -> None:
        got.append(store.slot_acquire("td:limit:t:0c:{x}", f"h{i}", 3, 5000)[0])

    threads = [threading.Thread(target=take, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got.count(True) == 3


# -- admit / release -----------------------------------------------------------------------


def test_admit_takes_all_or_gives_back_and_reports(redis_client: redis.Redis) -> None:
    dedup = Deduplicator(RedisStore(redis_client), prefix="lu")
    seen: list[tuple[Event, str | None]] = []
    dedup.events.add(lambda e: seen.append((e.event, e.detail)))
    declared = limits.coerce_limits([Concurrency(2), Rate(1, per=30)], "t")
    first = limits.admit(dedup, "t", declared, (), {}, "id1", 5000)
    assert first.ok and len(first.slots) == 2
    second = limits.admit(dedup, "t", declared, (), {}, "id2", 5000)
    assert not second.ok and isinstance(second.limit, Rate) and not second.dropped
    assert second.wait_ms > 20_000
    # the slot it took before the rate refused was given back: one holder, not two
    stats = limits.read_limits(redis_client, "lu")
    assert stats["t"].slots_in_use == 1
    assert (Event.LIMITED, "rate") in seen
    limits.release(dedup, first.slots)  # sent at once, its reply read later
    wait_for(lambda: limits.read_limits(redis_client, "lu") == {}, timeout=5,
             what="the slot given back")
    assert redis_client.zcard(first.slots[1][0]) == 1  # its start still counts


def test_drop_is_reported_as_dropped() -> None:
    dedup = Deduplicator(MemoryStore(), prefix="lu")
    seen: list[Event] = []
    dedup.events.add(lambda e: seen.append(e.event))
    declared = limits.coerce_limits([Rate(1, per=60, on_excess="drop")], "t")
    assert limits.admit(dedup, "t", declared, (), {}, "a", 1000).ok
    refused = limits.admit(dedup, "t", declared, (), {}, "b", 1000)
    assert refused.dropped and seen[-1] is Event.DROPPED
    error = limits.RateLimitedError("t", repr(refused.limit))
    assert "dropped by its limit Rate(1, per=60" in str(error)
    import pickle

    assert str(pickle.loads(pickle.dumps(error))) == str(error)


def test_a_full_concurrency_limit_drops_when_declared_so() -> None:
    dedup = Deduplicator(MemoryStore(), prefix="lu")
    declared = limits.coerce_limits([Concurrency(1, on_busy="drop")], "t")
    held = limits.admit(dedup, "t", declared, (), {}, "a", 1000)
    refused = limits.admit(dedup, "t", declared, (), {}, "b", 1000)
    assert held.ok and refused.dropped and isinstance(refused.limit, Concurrency)
    limits.release(dedup, held.slots)
    assert limits.admit(dedup, "t", declared, (), {}, "c", 1000).ok


def _held_slot(dedup: Deduplicator, call: str) -> tuple[str, str]:
    declared = limits.coerce_limits([Concurrency(1)], "t")
    held = limits.admit(dedup, "t", declared, (), {}, call, 5000)
    assert held.ok
    return held.slots[0]


def test_a_slot_is_given_back_without_waiting_for_the_reply(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """Like a worker's completion, the release goes out at once and its reply is read later:
    a server that answers late (here: paused for writes and scripts) holds up no task."""
    store = RedisStore.from_url(redis_url)
    dedup = Deduplicator(store, prefix="lu-later")
    limits.release(dedup, [_held_slot(dedup, "warm")])  # its script loaded
    key, holder = _held_slot(dedup, "one")
    redis_client.execute_command("CLIENT", "PAUSE", 3000, "WRITE")
    try:
        started = time.monotonic()
        limits.release(dedup, [(key, holder)])
        took = time.monotonic() - started
    finally:
        redis_client.execute_command("CLIENT", "UNPAUSE")
    assert took < 1.5, f"the release waited {took:.2f} s for a paused server"
    wait_for(lambda: redis_client.zscore(key, holder) is None, timeout=5,
             what="the slot given back once the server reads the command")
    wait_for(lambda: not store.settle(older_than=60.0), timeout=5,
             what="its reply read by the heartbeat thread")


def test_a_flushed_script_cache_still_gives_the_slot_back(
    redis_url: str, redis_client: redis.Redis
) -> None:
    store = RedisStore.from_url(redis_url)
    dedup = Deduplicator(store, prefix="lu-later")
    limits.release(dedup, [_held_slot(dedup, "warm")])  # limit_release.lua loaded
    key, holder = _held_slot(dedup, "one")
    redis_client.script_flush()
    limits.release(dedup, [(key, holder)])  # NOSCRIPT: made again with EVAL when read
    wait_for(lambda: redis_client.zscore(key, holder) is None, timeout=5,
             what="the slot given back by the release made again")


def test_a_slot_taken_behind_a_release_on_a_broken_connection_is_taken_once(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """A slot is taken on the connection its thread's releases went out on, behind them (so
    a slot just given back is free for it); a connection that broke before the replies were
    read has both made again: the release frees, the acquire takes one slot."""
    store = RedisStore.from_url(redis_url)
    dedup = Deduplicator(store, prefix="lu-behind")
    warm_key, warm_holder = _held_slot(dedup, "warm")
    limits.release(dedup, [(warm_key, warm_holder)])  # its reply owed on this thread's trail
    redis_client.client_kill_filter(_type="normal", skipme=True)
    key, holder = _held_slot(dedup, "one")  # Concurrency(1): the slot given back is free
    assert key == warm_key
    assert redis_client.zrange(key, 0, -1) == [holder.encode()]


def test_heartbeat_keeps_a_slot_past_its_lease(redis_client: redis.Redis) -> None:
    dedup = Deduplicator(RedisStore(redis_client), prefix="lu")
    declared = limits.coerce_limits([Concurrency(1)], "t")
    held = limits.admit(dedup, "t", declared, (), {}, "long", 600)
    assert held.ok
    time.sleep(1.5)  # more than two leases: only the heartbeat keeps it
    assert not limits.admit(dedup, "t", declared, (), {}, "other", 600).ok
    limits.release(dedup, held.slots)
    other = limits.admit(dedup, "t", declared, (), {}, "other", 600)
    assert other.ok
    limits.release(dedup, other.slots)


def test_delay_follows_the_hint_or_backs_off() -> None:
    rate = Rate(1, per=10)
    assert 1.5 <= limits.limit_delay(rate, 1500, 0, 60) <= 1.75
    conc = Concurrency(1)
    assert 0.16 <= limits.limit_delay(conc, 0, 0, 60) <= 0.24
    assert limits.limit_delay(conc, 0, 1000, 60) <= limits.MAX_WAIT * 1.2
    assert limits.limit_delay(conc, 0, 1000, 60, redelivery=2) <= 1.0
    assert limits.limited_since("x") is None and limits.limited_since(time.time()) is not None


# -- operators -----------------------------------------------------------------------------


def test_operators_see_slots_waiting_and_drops_per_task(
    redis_client: redis.Redis, redis_url: str
) -> None:
    import json

    from click.testing import CliRunner
    from prometheus_client import CollectorRegistry

    from taskdedup.cli import main
    from taskdedup.metrics import attach_limits
    from taskdedup.stats import attach

    dedup = Deduplicator(RedisStore(redis_client), prefix="ops")
    recorder = attach(dedup, interval=3600)
    assert recorder is not None
    declared = limits.coerce_limits(
        [Concurrency(2, key=lambda tenant: tenant), Rate(1, per=60, on_excess="drop")], "t")
    held = [limits.admit(dedup, "app.sync", declared[:1], (tenant,), {}, f"id-{n}", 60_000)
            for n, tenant in enumerate(("secret-tenant-a", "secret-tenant-b"))]
    assert all(a.ok for a in held)
    assert limits.admit(dedup, "app.sync", declared[1:], ("x",), {}, "r1", 60_000).ok
    assert limits.admit(dedup, "app.sync", declared[1:], ("x",), {}, "r2", 60_000).dropped
    limits.note_waiting(dedup, "app.sync", "w1", 5.0)
    recorder.flush()

    result = CliRunner().invoke(main, ["--url", redis_url, "--prefix", "ops", "stats",
                                       "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["app.sync"]["limits"] == {"slots_in_use": 2, "waiting": 1, "limited": 0,
                                          "dropped": 1}
    table = CliRunner().invoke(main, ["--url", redis_url, "--prefix", "ops", "stats"],
                               catch_exceptions=False)
    assert "taskdedup limits" in table.output and "secret-tenant" not in table.output

    import warnings

    from taskdedup.web import create_app

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from starlette.testclient import TestClient
    web = create_app(redis.Redis.from_url(redis_url), prefix="ops")
    try:
        page = TestClient(web, base_url="http://127.0.0.1").get("/")
        assert page.status_code == 200 and 'id="limits"' in page.text
        assert "secret-tenant" not in page.text
        api = TestClient(web, base_url="http://127.0.0.1").get("/api/stats").json()
        assert api["app.sync"]["limits"]["slots_in_use"] == 2
    finally:
        web.state.dashboard.history.stop()

    registry = CollectorRegistry()
    attach_limits(redis_client, "ops", registry)
    assert registry.get_sample_value("taskdedup_limit_slots_in_use", {"task": "app.sync"}) == 2
    assert registry.get_sample_value("taskdedup_limit_waiting", {"task": "app.sync"}) == 1

    limits.release(dedup, held[0].slots)
    limits.note_waiting(dedup, "app.sync", "w1", None)
    assert limits.read_limits(redis_client, "ops")["app.sync"] == limits.LimitStats(
        "app.sync", 1, 0)
    # a key value is never stored: only its digest
    assert not [k for k in redis_client.scan_iter("ops:*") if b"secret" in k]
    zsets = [k for k in redis_client.scan_iter("ops:limit:*") if redis_client.type(k) == b"zset"]
    assert len(zsets) == 2  # tenant b's slots, the rate's window
    assert not [k for k in zsets if any(b"secret" in m for m in redis_client.zrange(k, 0, -1))]
    limits.release(dedup, held[1].slots)


def test_a_user_without_sorted_set_commands_is_refused_not_retried(
    redis_client: redis.Redis, redis_url: str
) -> None:
    """Redis refuses the limit scripts for what they are (NOPERM): the store error says so
    (``refused``), and the error a worker fails the call with names the commands."""
    from taskdedup.exceptions import StoreUnavailableError
    from taskdedup.stores.redis import refused

    user = f"nozset-{uuid.uuid4().hex[:8]}"
    redis_client.execute_command(
        "ACL", "SETUSER", user, "on", ">pw", "resetkeys", "~lu:*", "-@all", "+evalsha",
        "+eval", "+get", "+set", "+time", "+pttl", "+pexpire", "+ping")
    try:
        limited = redis.Redis.from_url(redis_url, username=user, password="pw")
        dedup = Deduplicator(RedisStore(limited), prefix="lu")
        declared = limits.coerce_limits([Concurrency(1)], "t")
        with pytest.raises(StoreUnavailableError) as caught:
            limits.admit(dedup, "t", declared, (), {}, "id", 1000)
        assert refused(caught.value)
        error = limits.refusal("t", "id", caught.value)
        assert isinstance(error, ConfigurationError) and "+zadd" in str(error)
        limited.close()
    finally:
        redis_client.execute_command("ACL", "DELUSER", user)
