"""A worker's claim and completion as one ``SET … IFEQ`` where the server has it
(``taskdedup/stores/cas.py``), and the scripts everywhere else.

The suite's server decides which: Valkey 9.1 (the main session) swaps; Redis 6.2 and 7.0
(the compat sessions) refuse ``IFEQ`` and run the scripts. Both stores answer every sequence
of calls alike (``tests/test_store_contract.py`` runs its contract and its property test on
both); here: the probe, the commands each step sends, the cases a swap hands to the script,
and a server that stops taking swaps.
"""

from __future__ import annotations

import logging
import uuid
from collections import Counter
from typing import Any

import pytest
import redis

from benchmarks.harness import RoundTripCounter, command_calls
from taskdedup import Deduplicator, Policy, RedisStore
from taskdedup.stores import cas
from taskdedup.stores._compat import as_sent, raw_exchange
from taskdedup.stores.base import LockResult, LockState, Outcome
from taskdedup.stores.server import read_facts

LONG = 600_000
ACQUIRED = LockResult(Outcome.ACQUIRED)
CHECK = "c" * 32


def swapping_server(client: redis.Redis) -> bool:
    """What the probe should find: Valkey 8.1 or later (SET IFEQ and GET, the value found
    answered whether or not it swapped)."""
    facts = read_facts(client)
    return facts.name == "valkey" and facts.version_tuple[:2] >= (8, 1)


def warm(client: redis.Redis, connections: int = 4) -> None:
    """Connect a few of the pool's connections up front: a count of round trips must not
    include a new connection's handshake, made when a background thread (the stats flush)
    holds the one connection there was."""
    pool, take = client.connection_pool, raw_exchange(client)  # redis-py 5 needs a name
    assert take is not None
    taken = [take() for _ in range(connections)]
    for conn in taken:
        conn.connect()
        pool.release(conn)


def _delta(before: Counter[str], after: Counter[str]) -> Counter[str]:
    delta = after - before
    delta.pop("info", None)
    return delta


def test_the_server_is_asked_once_and_the_probe_leaves_nothing(
    redis_client: redis.Redis,
) -> None:
    store = RedisStore(redis_client)
    warm(redis_client)
    with RoundTripCounter() as sent:
        answer = store.compare_and_set
        assert store.compare_and_set is answer  # asked once
    assert sent.round_trips == 1  # the probe: five commands, one pipeline
    assert answer is swapping_server(redis_client)
    assert list(redis_client.scan_iter("taskdedup:probe:*")) == []
    assert RedisStore(redis_client, compare_and_set=False).compare_and_set is False
    single = RedisStore(redis.Redis(connection_pool=redis_client.connection_pool,
                                    single_connection_client=True))
    assert single.compare_and_set is False  # no pooled connection to send it on


@pytest.mark.parametrize(("mode", "left"), [("until_expired", "D"), ("until_executed", "F")])
def test_a_guarded_execution_is_two_sets_and_no_script_where_the_server_swaps(
    redis_client: redis.Redis, mode: str, left: str,
) -> None:
    """Claim and completion through the deduplicator, as a worker makes them (the DONE
    marker, or the FINISHED tombstone); the server's own command counts."""
    dedup = Deduplicator(RedisStore(redis_client))
    policy = Policy(mode=mode, ttl=60)
    warm = dedup.lock_key("cas.task", "0" * 32)
    dedup.start("cas.task", policy, warm, "warm-owner")
    dedup.finish("cas.task", policy, warm, "warm-owner", success=True)
    owner = str(uuid.uuid4())
    key = dedup.lock_key("cas.task", uuid.uuid4().hex)
    dedup.store.reserve(key, owner, 60_000)
    before = command_calls(redis_client)
    assert dedup.start("cas.task", policy, key, owner).verdict.value == "accepted"
    dedup.finish("cas.task", policy, key, owner, success=True)
    server = _delta(before, command_calls(redis_client))
    if swapping_server(redis_client):
        assert server["set"] == 2 and server["evalsha"] == 0 and server["get"] == 0, server
    else:
        assert server["evalsha"] == 2 and server["set"] == 2 and server["get"] == 2, server
    assert redis_client.get(key) == f"{left}||{owner}".encode()


def test_a_while_executing_claim_takes_the_absent_lock_in_one_command(
    redis_client: redis.Redis,
) -> None:
    """``while_executing`` reserves nothing: its claim is ``SET NX`` (not a swap that is
    bound to miss, then the script)."""
    dedup = Deduplicator(RedisStore(redis_client))
    policy = Policy(mode="while_executing", ttl=60)
    dedup.start("cas.w", policy, dedup.lock_key("cas.w", "0" * 32), "warm-owner")
    key, owner = dedup.lock_key("cas.w", uuid.uuid4().hex), str(uuid.uuid4())
    warm(redis_client)
    with RoundTripCounter() as sent:
        assert dedup.start("cas.w", policy, key, owner).verdict.value == "accepted"
    assert sent.round_trips == 1
    assert redis_client.get(key) == f"R||{owner}".encode()
    other = str(uuid.uuid4())
    assert dedup.start("cas.w", policy, key, other).verdict.value == "duplicate"
    assert redis_client.get(key) == f"R||{owner}".encode()  # never touched


@pytest.mark.parametrize("swaps", [True, False], ids=["shipped", "scripts"])
def test_an_explicit_keys_check_is_kept_through_claim_and_completion(
    redis_client: redis.Redis, swaps: bool,
) -> None:
    """A lock holding an argument check (``dedup_key=``) is no swap's expected value: the
    script makes each step (one more round trip) and keeps the check."""
    store = RedisStore(redis_client, compare_and_set=swaps)
    owner = str(uuid.uuid4())
    assert store.reserve("k", owner, LONG, CHECK) == ACQUIRED
    assert store.claim("k", owner, LONG) == ACQUIRED
    assert redis_client.get("k") == f"R|{CHECK}|{owner}".encode()
    assert store.complete("k", owner, LONG) is Outcome.OK
    assert redis_client.get("k") == f"D|{CHECK}|{owner}".encode()
    assert store.claim("k", owner, LONG) == LockResult(Outcome.DUPLICATE, owner, LockState.DONE)


def test_a_server_that_stops_taking_swaps_turns_the_store_to_its_scripts(
    redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A swap answered with an error other than a foreign key's type (a failover to an
    older server: ``ERR syntax error``) is made by the script, and the store says so once
    and runs the scripts from then on."""
    store = RedisStore(redis_client)
    if not store.compare_and_set:
        pytest.skip("this server does not swap (Redis < 8.4): the scripts run already")
    owner = str(uuid.uuid4())
    store.reserve("k", owner, LONG)
    real = cas.claim_command

    def refused(key: str, owner: str, lease_ms: int, **hints: Any) -> tuple:
        command, expect = real(key, owner, lease_ms, **hints)
        return (*command, "NOT-AN-OPTION"), expect

    monkeypatch.setattr(cas, "claim_command", refused)
    with caplog.at_level(logging.WARNING, logger="taskdedup"):
        assert store.claim("k", owner, LONG) == ACQUIRED
    assert redis_client.get("k") == f"R||{owner}".encode()
    assert store.compare_and_set is False
    assert "refused SET IFEQ" in caplog.text
    warm(redis_client)
    with RoundTripCounter() as sent:
        assert store.complete("k", owner, LONG) is Outcome.OK
    assert sent.commands == Counter({"EVALSHA": 1})


def test_a_foreign_value_of_another_type_is_the_scripts_to_judge(
    redis_client: redis.Redis,
) -> None:
    """A key of another type under the lock's name (WRONGTYPE to a SET with GET): someone
    else's lock, as the script says; the store keeps swapping."""
    store = RedisStore(redis_client)
    redis_client.lpush("k", "x")
    assert store.claim("k", str(uuid.uuid4()), LONG) == LockResult(Outcome.DUPLICATE)
    assert redis_client.type("k") == b"list"
    assert store.compare_and_set is swapping_server(redis_client)


def test_the_probe_writes_under_the_locks_prefix_where_the_users_acl_reaches(
    redis_client: redis.Redis,
) -> None:
    """A least-privilege user (``~myapp:*``): the deduplicator's first check asks with its
    prefix, so the probe's key is one the user may write, and its workers swap. Asked
    outside the ACL, the probe fails and the store runs its scripts: slower, never wrong."""
    if not swapping_server(redis_client):
        pytest.skip("this server does not swap (Redis < 8.4)")
    user = f"cas-{uuid.uuid4().hex[:8]}"
    redis_client.acl_setuser(user, enabled=True, passwords=["+pw"], keys=["myapp:*"],
                             commands=["+@all"])
    kwargs = redis_client.connection_pool.connection_kwargs
    try:
        def client() -> redis.Redis:
            return redis.Redis(host=kwargs["host"], port=kwargs["port"], username=user,
                               password="pw")

        dedup = Deduplicator(RedisStore(client()), prefix="myapp")
        dedup.check_store()
        assert dedup.store.compare_and_set is True
        assert list(redis_client.scan_iter("myapp:probe:*")) == []
        assert RedisStore(client()).compare_and_set is False  # "taskdedup:probe:…": refused
    finally:
        redis_client.acl_deluser(user)


def test_an_error_that_is_not_about_the_swap_is_reported_and_changes_nothing() -> None:
    """A server out of memory (``noeviction`` at its limit) refuses the swap and the script
    alike: the claim raises StoreUnavailableError, as with the scripts, and the store keeps
    swapping once the server has room again (only a syntax error turns it to the scripts)."""
    from taskdedup.exceptions import StoreUnavailableError
    from taskdedup.testing import RedisServer

    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        store = RedisStore(client)
        if not store.compare_and_set:
            pytest.skip("this server does not swap (Redis < 8.4)")
        owner = str(uuid.uuid4())
        store.reserve("k", owner, LONG)
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", 1)  # every write refused: OOM
        with pytest.raises(StoreUnavailableError):
            store.claim("k", owner, LONG)
        client.config_set("maxmemory", 0)
        assert store.compare_and_set is True
        assert store.claim("k", owner, LONG) == ACQUIRED
        client.close()


@pytest.mark.parametrize(("hint", "claim_trips"), [("right", 1), ("none", 2), ("forged", 2)])
def test_an_explicit_keys_claim_swaps_at_once_with_its_check_and_its_completion_always(
    redis_client: redis.Redis, hint: str, claim_trips: int,
) -> None:
    """A reservation holding an argument check (``dedup_key=``): with the check the message
    carries, the claim is one swap; without it, or with a forged one, the swap misses and the
    script claims (one more round trip) — the outcome and the value are the same. The
    completion swaps at once either way: the claim remembers the check (from its hint, or
    from the value the missed swap found)."""
    store = RedisStore(redis_client)
    if not store.compare_and_set:
        pytest.skip("this server does not swap (Redis < 8.4): a script each, one round trip")
    owner = str(uuid.uuid4())
    assert store.reserve("k", owner, LONG, CHECK) == ACQUIRED
    given = {"right": CHECK, "none": "", "forged": "d" * 32}[hint]
    warm(redis_client)
    with RoundTripCounter() as sent:
        assert store.claim("k", owner, LONG, check=given) == ACQUIRED
    assert sent.round_trips == claim_trips
    assert redis_client.get("k") == f"R|{CHECK}|{owner}".encode()
    warm(redis_client)
    with RoundTripCounter() as sent:
        assert store.complete("k", owner, 0, finished_ms=LONG) is Outcome.OK
    assert sent.round_trips == 1 and sent.commands == Counter({"SET": 1})
    assert redis_client.get("k") == f"F|{CHECK}|{owner}".encode()
    assert store._checks == {}  # remembered until the completion, no longer


def test_a_malformed_check_hint_is_dropped(redis_client: redis.Redis) -> None:
    """A check from a message is only ever 32 hex digits: anything else is no hint (the
    swap then expects none), never a value written into the lock."""
    store = RedisStore(redis_client)
    owner = str(uuid.uuid4())
    assert store.reserve("k", owner, LONG) == ACQUIRED
    assert store.claim("k", owner, LONG, check="x|y") == ACQUIRED
    assert redis_client.get("k") == f"R||{owner}".encode()


def test_an_rq_job_with_an_explicit_key_carries_its_check_to_the_worker(
    redis_client: redis.Redis,
) -> None:
    from taskdedup.rq import DedupQueue
    from taskdedup.rq.meta import trusted_guard
    from tests import rq_jobs

    queue = DedupQueue(f"cas-{uuid.uuid4().hex[:8]}", connection=redis_client,
                       dedup=Policy(ttl=60))
    job = queue.enqueue(rq_jobs.record, "cas", 1, dedup_key="ORD-1")
    plain = queue.enqueue(rq_jobs.record, "cas", 2)
    assert job is not None and plain is not None
    guard = trusted_guard(job, queue.dedup)
    assert guard is not None
    info = queue.dedup.store.get(guard.key)
    assert info is not None and len(info.check) == 32
    assert guard.check == info.check
    assert trusted_guard(plain, queue.dedup).check == ""  # type: ignore[union-attr]
    queue.empty()


def test_a_call_published_without_taskdedup_claims_its_absent_lock_in_one_command(
    redis_client: redis.Redis,
) -> None:
    """A message sent by name (``send_task``, a client without taskdedup): nothing was
    reserved, the worker says so (``reserved=False``), and the claim is ``SET NX``, not a
    swap bound to miss; another call's reservation still makes it a duplicate."""
    dedup = Deduplicator(RedisStore(redis_client))
    policy = Policy(mode="until_executed", ttl=60)
    dedup.start("cas.n", policy, dedup.lock_key("cas.n", "0" * 32), "warm-owner",
                reserved=False)
    key, owner = dedup.lock_key("cas.n", uuid.uuid4().hex), str(uuid.uuid4())
    warm(redis_client)
    with RoundTripCounter() as sent:
        assert dedup.start("cas.n", policy, key, owner, reserved=False).verdict.value == \
            "accepted"
    assert sent.round_trips == 1
    other_key = dedup.lock_key("cas.n", uuid.uuid4().hex)
    dedup.store.reserve(other_key, "someone-else", 60_000)
    assert dedup.start("cas.n", policy, other_key, owner, reserved=False).verdict.value == \
        "duplicate"


def test_only_ascii_text_is_encoded_before_redis_py_sees_it() -> None:
    """ASCII goes as bytes (what any client would send); other text is left to the client's
    own encoding, so a key or an owner is the same bytes on every path."""
    assert as_sent("taskdedup:app.charge:ab") == b"taskdedup:app.charge:ab"
    assert as_sent("Q||id", b"Q||id") == b"Q||id"
    assert as_sent("taskdedup:app.zahlung:ü") == "taskdedup:app.zahlung:ü"
    command, expect = cas.claim_command("taskdedup:t:ü", "id-1", 1000)
    assert command[1] == "taskdedup:t:ü" and command[2] == b"R||id-1" and expect == b"Q||id-1"
