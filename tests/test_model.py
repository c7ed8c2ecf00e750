"""A stateful model test of the lock state machine (SPEC §5) on both stores.

Hypothesis drives tasks through their life — enqueue, a duplicate enqueue, a message sent
without reservation, claim, heartbeat, complete, fail, retry (re-reserve by the same
owner), revoke (release while queued), crash (the owner stops heartbeating), redelivery of
a crashed task's message, and the clock moving on — and checks every answer of the store
against :class:`Model`, a reference of SPEC §5 written here from the spec (it never calls
the library), plus the invariants that matter to a user:

* the store holds exactly what the model holds (state, owner, argument check, expiry);
* at most one task runs per identity, and a task that keeps heartbeating never loses its
  lock;
* no lock outlives its bound: a crashed owner's lock expires within ``lease``, every lock
  within the longest ``ttl`` it was given.

Time. MemoryStore gets a fake clock that the model moves. RedisStore runs against the real
server, where time cannot be stopped: every duration is a multiple of a 5 s quantum and the
clock moves in whole quanta, and "the clock advances by dt" is applied to Redis by
``PEXPIRE``-ing every key to the remaining time the model computes (a non-positive time
deletes the key, which is what expiry does). Real time elapsed during an example (well under
one quantum) only makes Redis's TTLs slightly smaller than the model's, which the comparison
allows; no key ever expires on its own during an example.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from taskdedup.stores import LockResult, MemoryStore, Outcome, RedisStore
from tests.fault_jobs import report

Q = 5_000  # ms: the quantum of every duration and of every clock step
TTL = 2 * Q  # reservation
LEASE = 3 * Q  # running lock; heartbeats every lease/3 = one quantum
COUNTDOWN = Q  # a retry's delay (re-reserved for ttl + countdown)
DONE_TTL = 4 * Q  # until_expired window after success
LONGEST = max(TTL + COUNTDOWN, LEASE, DONE_TTL)
KEYS = ("k0", "k1", "k2")
CHECKS = ("", "1" * 32, "2" * 32)


# -- the reference model (SPEC §5), independent of the library ---------------------------------


@dataclass
class Held:
    state: str  # "Q" queued, "R" running, "D" done, "F" finished (a tombstone for its copies)
    owner: str
    check: str
    expires: int  # model clock, ms


class Model:
    """One lock per identity: reserve → claim → complete/release, fenced by the owner id."""

    def __init__(self) -> None:
        self.now = 0
        self.locks: dict[str, Held] = {}

    def live(self, key: str) -> Held | None:
        held = self.locks.get(key)
        if held is not None and held.expires <= self.now:
            del self.locks[key]
            return None
        return held

    def free(self, key: str, owner: str) -> Held | None:
        """The lock as a gate or claim of ``owner`` sees it: another owner's tombstone is
        no lock at all."""
        held = self.live(key)
        return None if held is not None and held.state == "F" and held.owner != owner else held

    def reserve(self, key: str, owner: str, ttl: int, check: str) -> tuple[str, str | None,
                                                                              str | None]:
        """Enqueue: absent → Q; same owner (not done) → accepted, expiry never shortened;
        else a duplicate (a mismatch when both carry different argument checks)."""
        held = self.free(key, owner)
        if held is None:
            self.locks[key] = Held("Q", owner, check, self.now + ttl)
            return ("ACQUIRED", None, None)
        if held.owner == owner and held.state not in "DF":
            self.locks[key] = Held("Q", owner, held.check,
                                   max(held.expires, self.now + ttl))
            return ("ACQUIRED", None, None)
        if held.owner != owner and check and held.check and check != held.check:
            return ("MISMATCH", held.owner, held.state)
        return ("DUPLICATE", held.owner, held.state)

    def claim(self, key: str, owner: str, lease: int) -> tuple[str, str | None, str | None]:
        """Worker start: absent → R; own Q → R for the lease; else not run: another
        owner's (skip), its own R (another copy runs now: deferred), its own D/F (ended)."""
        held = self.free(key, owner)
        if held is None:
            self.locks[key] = Held("R", owner, "", self.now + lease)
            return ("ACQUIRED", None, None)
        if held.owner == owner and held.state == "Q":
            self.locks[key] = Held("R", owner, held.check, self.now + lease)
            return ("ACQUIRED", None, None)
        return ("DUPLICATE", held.owner, held.state)

    def heartbeat(self, key: str, owner: str, lease: int) -> str:
        held = self.live(key)
        if held is None or held.owner != owner:
            return "NOT_OWNER"
        if held.state == "R":
            held.expires = self.now + lease
        return "OK"

    def complete(self, key: str, owner: str, ttl: int, finished: int = 0) -> str:
        held = self.live(key)
        if held is None or held.owner != owner:
            return "NOT_OWNER"
        if held.state != "R":
            return "OK"
        if ttl > 0:
            self.locks[key] = Held("D", owner, held.check, self.now + ttl)
        elif finished > 0:
            self.locks[key] = Held("F", owner, held.check, self.now + finished)
        else:
            del self.locks[key]
        return "OK"

    def release(self, key: str, owner: str) -> str:
        held = self.live(key)
        if held is None or held.owner != owner:
            return "NOT_OWNER"
        del self.locks[key]
        return "OK"


def as_model(result: LockResult) -> tuple[str, str | None, str | None]:
    return (result.outcome.name, result.owner, result.state.value if result.state else None)


# -- the stores under test ---------------------------------------------------------------------


class Harness:
    """A store plus the means to move its clock in step with the model."""

    store: Any
    tolerance_ms = 0

    def key(self, name: str) -> str:
        raise NotImplementedError

    def advance(self, model: Model) -> None:
        """The model's clock moved: make the store's time agree."""
        raise NotImplementedError

    def close(self) -> None:
        """Nothing to release by default."""


class MemoryHarness(Harness):
    def __init__(self) -> None:
        self.now_ms = 0
        self.store = MemoryStore(clock=lambda: 1000.0 + self.now_ms / 1000)
        self.tolerance_ms = 1  # get() rounds the remaining time up to whole milliseconds

    def key(self, name: str) -> str:
        return f"taskdedup:model:{name}"

    def advance(self, model: Model) -> None:
        self.now_ms = model.now


class RedisHarness(Harness):
    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.store = RedisStore(client)
        self.prefix = f"taskdedup:model:{uuid.uuid4().hex[:12]}"
        self.tolerance_ms = Q // 2  # real time elapsed since the last sync

    def key(self, name: str) -> str:
        return f"{self.prefix}:{name}"

    def advance(self, model: Model) -> None:
        for name, held in list(model.locks.items()):
            # PEXPIRE with a non-positive time deletes the key, as expiry would
            self.client.pexpire(self.key(name), held.expires - model.now)

    def close(self) -> None:
        self.client.delete(*(self.key(name) for name in KEYS))


# -- the machine -------------------------------------------------------------------------------


@dataclass
class Task:
    id: str
    key: str
    status: str  # queued (a message waits), running, crashed, done (succeeded), over


RUN: Counter[str] = Counter()
"""What the machines did, for the figures: examples, and each rule's and outcome's count."""


class LockMachine(RuleBasedStateMachine):
    make_harness: Callable[[], Harness] = MemoryHarness

    def __init__(self) -> None:
        super().__init__()
        RUN["examples"] += 1
        self.h = type(self).make_harness()
        self.model = Model()
        self.tasks: list[Task] = []
        self.counter = 0

    def teardown(self) -> None:
        self.h.close()

    # helpers
    def new_id(self) -> str:
        self.counter += 1
        return f"task-{self.counter}"

    def with_status(self, status: str) -> list[Task]:
        return [t for t in self.tasks if t.status == status]

    def pick(self, status: str, index: int) -> Task:
        candidates = self.with_status(status)
        return candidates[index % len(candidates)]

    def reserve(self, key: str, owner: str, ttl: int, check: str) -> tuple[str, str | None,
                                                                              str | None]:
        got = as_model(self.h.store.reserve(self.h.key(key), owner, ttl, check))
        expected = self.model.reserve(key, owner, ttl, check)
        assert got == expected, ("reserve", key, owner, got, expected)
        RUN[f"reserve {got[0]}"] += 1
        return got

    def claim(self, task: Task) -> None:
        got = as_model(self.h.store.claim(self.h.key(task.key), task.id, LEASE))
        expected = self.model.claim(task.key, task.id, LEASE)
        assert got == expected, ("claim", task, got, expected)
        RUN[f"claim {got[0]}"] += 1
        if got[0] == "ACQUIRED":
            task.status = "running"
        elif (got[1], got[2]) != (task.id, "R"):
            task.status = "over"  # a duplicate is skipped; a copy of a finished id ends
        # else another copy of this very id runs now: this one is deferred (stays queued)

    def owner_call(self, name: str, task: Task, *args: int, **kwargs: int) -> str:
        got = getattr(self.h.store, name)(self.h.key(task.key), task.id, *args, **kwargs)
        assert isinstance(got, Outcome)
        expected = getattr(self.model, name)(task.key, task.id, *args, *kwargs.values())
        assert got.name == expected, (name, task, got, expected)
        RUN[f"{name} {expected}"] += 1
        return expected

    # rules: the caller
    @initialize(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=3))
    def first_enqueues(self, keys: list[str]) -> None:
        """Start with some work queued, so every example exercises the worker side."""
        for key in keys:
            self.enqueue(key, "")

    @rule(key=st.sampled_from(KEYS), check=st.sampled_from(CHECKS))
    def enqueue(self, key: str, check: str) -> None:
        owner = self.new_id()
        if self.reserve(key, owner, TTL, check)[0] == "ACQUIRED":
            self.tasks.append(Task(owner, key, "queued"))

    @precondition(lambda self: self.model.locks)
    @rule(index=st.integers(0, 10), check=st.sampled_from(CHECKS))
    def duplicate_enqueue(self, index: int, check: str) -> None:
        """Another call of an identity that is held: never accepted while the lock lives
        (a tombstone F holds it only for its own id's copies)."""
        key = sorted(self.model.locks)[index % len(self.model.locks)]
        owner = self.new_id()
        live = self.model.free(key, owner) is not None
        outcome = self.reserve(key, owner, TTL, check)[0]
        if live:
            assert outcome in ("DUPLICATE", "MISMATCH")
        elif outcome == "ACQUIRED":
            self.tasks.append(Task(f"task-{self.counter}", key, "queued"))

    @precondition(lambda self: self.with_status("queued"))
    @rule(index=st.integers(0, 10))
    def republish(self, index: int) -> None:
        """The same call published again with its id (a producer retry, a retry's publish):
        accepted while it holds the identity, and the expiry is never shortened."""
        task = self.pick("queued", index)
        self.reserve(task.key, task.id, TTL, "")

    @rule(key=st.sampled_from(KEYS))
    def send_without_reservation(self, key: str) -> None:
        """A message that bypassed the gate (sent by name): only the claim guards it."""
        self.tasks.append(Task(self.new_id(), key, "queued"))

    @precondition(lambda self: self.with_status("queued"))
    @rule(index=st.integers(0, 10))
    def revoke(self, index: int) -> None:
        task = self.pick("queued", index)
        self.owner_call("release", task)
        task.status = "over"

    # rules: the worker
    @precondition(lambda self: self.with_status("queued"))
    @rule(index=st.integers(0, 10))
    def claim_one(self, index: int) -> None:
        self.claim(self.pick("queued", index))

    @precondition(lambda self: self.with_status("running"))
    @rule(index=st.integers(0, 10))
    def heartbeat(self, index: int) -> None:
        assert self.owner_call("heartbeat", self.pick("running", index), LEASE) == "OK"

    @precondition(lambda self: any(t.status != "running" for t in self.tasks))
    @rule(index=st.integers(0, 10))
    def late_heartbeat(self, index: int) -> None:
        """A heartbeat that fires after the body ended or re-reserved for a retry: it never
        renews or takes a lock that is not running for it."""
        others = [t for t in self.tasks if t.status != "running"]
        self.owner_call("heartbeat", others[index % len(others)], LEASE)

    @precondition(lambda self: self.with_status("running"))
    @rule(index=st.integers(0, 10), how=st.sampled_from(["keep", "tombstone", "delete"]))
    def complete(self, index: int, how: str) -> None:
        """until_expired keeps D; until_executed/while_executing leave an F tombstone."""
        task = self.pick("running", index)
        if how == "tombstone":
            outcome = self.owner_call("complete", task, 0, finished_ms=LEASE)
        else:
            outcome = self.owner_call("complete", task, DONE_TTL if how == "keep" else 0)
        assert outcome == "OK"
        task.status = "done"

    @precondition(lambda self: self.with_status("running"))
    @rule(index=st.integers(0, 10))
    def copy_claims_while_running(self, index: int) -> None:
        """kombu restored the running message's copy (an ETA beyond visibility_timeout): the
        copy's claim must not run it beside the original (SPEC §5)."""
        task = self.pick("running", index)
        got = as_model(self.h.store.claim(self.h.key(task.key), task.id, LEASE))
        expected = self.model.claim(task.key, task.id, LEASE)
        assert got == expected == ("DUPLICATE", task.id, "R"), ("copy", task, got, expected)
        RUN["copy deferred"] += 1

    @precondition(lambda self: self.with_status("running"))
    @rule(index=st.integers(0, 10))
    def fail(self, index: int) -> None:
        task = self.pick("running", index)
        assert self.owner_call("release", task) == "OK"
        task.status = "over"

    @precondition(lambda self: self.with_status("running"))
    @rule(index=st.integers(0, 10))
    def retry(self, index: int) -> None:
        """self.retry / RQ Retry: the same owner re-reserves for ttl + countdown."""
        task = self.pick("running", index)
        assert self.reserve(task.key, task.id, TTL + COUNTDOWN, "")[0] == "ACQUIRED"
        task.status = "queued"

    @precondition(lambda self: self.with_status("running"))
    @rule(index=st.integers(0, 10))
    def crash(self, index: int) -> None:
        """SIGKILL: the body stops, nobody heartbeats or releases any more."""
        self.pick("running", index).status = "crashed"
        RUN["crash"] += 1

    @precondition(lambda self: self.with_status("crashed"))
    @rule(index=st.integers(0, 10))
    def redeliver(self, index: int) -> None:
        """acks_late: the crashed task's message comes back with the same id."""
        self.pick("crashed", index).status = "queued"

    @precondition(lambda self: self.with_status("done") or self.with_status("over"))
    @rule(index=st.integers(0, 10), done=st.booleans())
    def redeliver_after_the_end(self, index: int, done: bool) -> None:
        """The same message again after it ended (an ack lost after success, a republish):
        after success it must be skipped while the done window lasts."""
        status = "done" if done and self.with_status("done") else "over"
        if not self.with_status(status):
            status = "done"
        task = self.pick(status, index)
        held = self.model.live(task.key)
        self.claim(task)
        if status == "done" and held is not None and (held.state, held.owner) in (
            ("D", task.id), ("F", task.id)
        ):
            assert task.status == "over"  # ended: the body does not run twice

    # rules: time
    @precondition(lambda self: self.model.locks)
    @rule(quanta=st.sampled_from([1, 1, 2, 3, 5, 12]))
    def advance(self, quanta: int) -> None:
        """Time passes one quantum (lease/3) at a time; running tasks heartbeat each step."""
        RUN["clock advances"] += 1
        for _ in range(quanta):
            self.model.now += Q
            self.h.advance(self.model)
            for name in list(self.model.locks):
                self.model.live(name)
            for task in self.with_status("running"):
                assert self.owner_call("heartbeat", task, LEASE) == "OK"

    # invariants
    @invariant()
    def store_holds_what_the_model_holds(self) -> None:
        for name in KEYS:
            held = self.model.live(name)
            info = self.h.store.get(self.h.key(name))
            if held is None:
                assert info is None, (name, info)
                continue
            assert info is not None, (name, held)
            assert (info.state.value, info.owner, info.check) == (
                held.state, held.owner, held.check)
            remaining = held.expires - self.model.now
            assert remaining - self.h.tolerance_ms <= info.ttl_ms <= remaining + 1, (
                name, info.ttl_ms, remaining)

    @invariant()
    def one_running_task_per_identity_and_it_holds_the_lock(self) -> None:
        for name in KEYS:
            running = [t for t in self.with_status("running") if t.key == name]
            assert len(running) <= 1, running
            for task in running:
                held = self.model.live(name)
                assert held is not None and (held.state, held.owner) == ("R", task.id)

    @invariant()
    def no_lock_outlives_its_bound(self) -> None:
        crashed = {t.id for t in self.with_status("crashed")}
        for held in self.model.locks.values():
            remaining = held.expires - self.model.now
            assert 0 < remaining <= LONGEST
            if held.state == "R" and held.owner in crashed:
                assert remaining <= LEASE


def figures() -> dict[str, int]:
    return {"examples": RUN["examples"],
            "store_calls_checked": sum(n for k, n in RUN.items() if " " in k
                                       and k != "clock advances"),
            "crashes": RUN["crash"], "clock_advances": RUN["clock advances"],
            **{k.replace(" ", "_"): n for k, n in sorted(RUN.items()) if " " in k
               and k != "clock advances"}}


def test_model_memory_store() -> None:
    class OnMemory(LockMachine):
        make_harness = MemoryHarness

    RUN.clear()
    run_state_machine_as_test(
        OnMemory, settings=settings(max_examples=200, stateful_step_count=50, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow]))
    report("model_memory_store", **figures())


@pytest.mark.slow
def test_model_redis_store(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)

    class OnRedis(LockMachine):
        make_harness = staticmethod(lambda: RedisHarness(client))  # type: ignore[assignment]

    RUN.clear()
    try:
        run_state_machine_as_test(
            OnRedis, settings=settings(max_examples=60, stateful_step_count=50, deadline=None,
                                       suppress_health_check=[HealthCheck.too_slow]))
    finally:
        client.close()
    report("model_redis_store", **figures())


def test_the_reference_model_answers_as_the_spec_sentences_say() -> None:
    """The reference itself, on the spec's own sentences (so a wrong model fails loudly)."""
    m = Model()
    assert m.reserve("k", "a", TTL, "")[0] == "ACQUIRED"
    assert m.reserve("k", "b", TTL, "") == ("DUPLICATE", "a", "Q")  # held by another id
    assert m.reserve("k", "a", TTL, "")[0] == "ACQUIRED"  # a retry / republish by the same id
    assert m.claim("k", "b", LEASE) == ("DUPLICATE", "a", "Q")  # only one body runs
    assert m.claim("k", "a", LEASE)[0] == "ACQUIRED"
    assert m.complete("k", "a", DONE_TTL) == "OK"
    assert m.claim("k", "a", LEASE) == ("DUPLICATE", "a", "D")  # redelivery after success
    m.now += DONE_TTL
    assert m.live("k") is None
    assert m.release("k", "a") == "NOT_OWNER"  # a lock lost to expiry is never deleted
