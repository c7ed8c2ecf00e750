"""Per-key concurrency and rate limits with real RQ ``DedupWorker``s (SPEC §16, issue #23):
``DedupQueue(..., limits=[...])``, enforced by the work-horse, a refused job put back
through RQ's scheduler (same id, not a retry, no horse held while it waits).

- Concurrency: per key value, never more than ``limit`` bodies at once, every job runs, two
  key values side by side; with ``dedup=`` and with ``dedup=False``.
- A SIGKILLed slot holder (its horse and its worker): the jobs waiting for its slot run
  within the lease, one at a time, never beside it.
- Rate: no window of ``per`` seconds holds more than ``limit`` starts; ``on_excess="drop"``
  fails the job with RateLimitedError, without running it.
"""

from __future__ import annotations

import itertools
import os
import signal
import time
import uuid
from collections.abc import Iterator

import pytest
import redis
from rq.job import Job

from taskdedup import Concurrency, ConfigurationError, Policy, Rate
from taskdedup.rq import DedupQueue
from taskdedup.stats import read_stats
from taskdedup.testing import wait_for
from tests.limits_jobs import done, hold, peak, rate_held, runs, started, tenant_of
from tests.workers import RqWorker

pytestmark = pytest.mark.slow

QUEUE = f"rq-limits-{os.getpid()}"


@pytest.fixture(scope="module")
def workers(redis_url: str, rc: redis.Redis) -> Iterator[list[RqWorker]]:
    """Three workers on one queue (all may hold its scheduler lock)."""
    started_: list[RqWorker] = []
    try:
        for _ in range(3):
            started_.append(RqWorker(redis_url, [QUEUE]).start())
        yield started_
    finally:
        for w in started_:
            w.stop()


def label() -> str:
    return uuid.uuid4().hex[:12]


def ended(job: Job, timeout: float = 30) -> str:
    def terminal() -> bool:
        return job.get_status(refresh=True) in ("finished", "failed")

    wait_for(terminal, timeout=timeout, what=f"job {job.id} ended")
    return str(getattr(job.get_status(), "value", job.get_status()))


@pytest.mark.parametrize("dedup", [Policy(ttl=60, lease=8), False], ids=["dedup", "no-dedup"])
def test_concurrency_per_key_and_keys_side_by_side(
    rc: redis.Redis, workers: list[RqWorker], dedup: Policy | bool
) -> None:
    q = DedupQueue(QUEUE, connection=rc, dedup=dedup,
                   limits=[Concurrency(1, key=tenant_of)])
    name = label()
    jobs = [q.enqueue(hold, name, tenant, n, 0.3) for n in range(4)
            for tenant in ("acme", "globex")]
    wait_for(lambda: done(rc, name, 8), timeout=60, what="every job ran")
    finished = runs(rc, name)
    assert sorted((n, t) for n, t, _, _ in finished) == sorted(
        (n, t) for n in range(4) for t in ("acme", "globex"))
    assert peak(rc, name, "acme") == 1 and peak(rc, name, "globex") == 1
    assert peak(rc, name) >= 2  # the tenants ran side by side
    for tenant in ("acme", "globex"):
        spans = sorted((s, e) for _, t, s, e in finished if t == tenant)
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert start >= end
    for job in jobs:
        assert job is not None and ended(job) == "finished"
        assert job.return_value() in range(4)


def test_killed_holder_frees_its_slot_within_the_lease(
    rc: redis.Redis, redis_url: str, workers: list[RqWorker]
) -> None:
    own = f"{QUEUE}-kill-{label()}"
    victim = RqWorker(redis_url, [own], scheduler=False).start()
    policy = Policy(mode="while_executing", lease=3)
    declared = [Concurrency(1, key=tenant_of)]
    try:
        name = label()
        held = DedupQueue(own, connection=rc, dedup=policy, limits=declared)
        q = DedupQueue(QUEUE, connection=rc, dedup=policy, limits=declared)
        held.enqueue(hold, name, "acme", 0, 0.0, True)
        wait_for(lambda: len(started(rc, name)) == 1, timeout=30, what="the holder started")
        waiting = [q.enqueue(hold, name, "acme", n, 0.2) for n in (1, 2, 3)]
        time.sleep(1.5)
        assert {n for n, _ in started(rc, name)} == {0}  # the others wait for the slot
        seconds, micros = rc.time()
        killed_ms = int(seconds) * 1000 + int(micros) // 1000
        horse = int(rc.get(f"lim:pid:{name}:0") or 0)
        os.kill(horse, signal.SIGKILL)
        victim.kill()
        killed_at = time.monotonic()
        wait_for(lambda: {n for n, _, _, _ in runs(rc, name)} >= {1, 2, 3}, timeout=30,
                 what="the waiting jobs ran")
        assert time.monotonic() - killed_at < 3 + 6  # within the lease and a put-off or two
        spans = sorted((s, e) for n, _, s, e in runs(rc, name) if n in (1, 2, 3))
        assert all(s >= killed_ms for s, _ in spans)  # never beside the killed holder
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert start >= end  # one at a time
        for job in waiting:
            assert job is not None and ended(job) == "finished"
    finally:
        victim.kill()


def test_rate_window_holds_no_more_than_limit_starts(
    rc: redis.Redis, workers: list[RqWorker]
) -> None:
    q = DedupQueue(QUEUE, connection=rc, dedup=False,  # several limits on one queue
                   limits=[Rate(2, per=1.5, key=tenant_of), Concurrency(3, key=tenant_of)])
    name = label()
    sent = time.monotonic()
    jobs = [q.enqueue(hold, name, "acme", n, 0.05) for n in range(6)]
    rate_held(rc, name, 6, limit=2, per_ms=1500, sent=sent)
    for job in jobs:
        assert job is not None and ended(job) == "finished"


def test_excess_dropped_fails_saying_so(rc: redis.Redis, workers: list[RqWorker]) -> None:
    q = DedupQueue(QUEUE, connection=rc, dedup=Policy(ttl=60),
                   limits=[Rate(1, per=30, key=tenant_of, on_excess="drop")])
    name = label()
    tenant = label()  # the limit's key is per task and key value: a window of this test's own
    before = _dropped(rc)
    first = q.enqueue(hold, name, tenant, 0, 0.05)
    assert first is not None and ended(first) == "finished"
    dropped = q.enqueue(hold, name, tenant, 1, 0.05)
    assert dropped is not None and ended(dropped) == "failed"
    assert "dropped by its limit Rate(1, per=30" in (dropped.latest_result().exc_string or "")
    assert [n for n, _ in started(rc, name)] == [0]
    # its lock was released (a final failure): the same call is a new job, not a duplicate
    again = q.enqueue(hold, name, tenant, 1, 0.05)
    assert again is not None and again.id != dropped.id and ended(again) == "failed"
    wait_for(lambda: _dropped(rc) >= before + 2, timeout=20, interval=0.5,
             what="the two drops counted in taskdedup stats (the workers flush every ~5 s)")


def _dropped(rc: redis.Redis) -> int:
    """``dropped`` of the jobs' task in ``taskdedup stats``, as the workers flushed it."""
    task = f"{hold.__module__}.{hold.__qualname__}"
    found = read_stats(rc, "taskdedup", task).get(task)
    return 0 if found is None else found.get("dropped")


def test_declaration_is_checked(rc: redis.Redis) -> None:
    with pytest.raises(ConfigurationError, match="limits= takes"):
        DedupQueue("x", connection=rc, limits=["nope"])  # type: ignore[list-item]
    with pytest.raises(ConfigurationError, match="key must be a callable"):
        DedupQueue("x", connection=rc, limits=[Rate(1, per=1, key="tenant")])
    idle = DedupQueue(f"idle-{label()}", connection=rc, dedup=False,
                      limits=[Concurrency(1, key=tenant_of)])
    with pytest.raises(TypeError, match=r"key function .* failed"):
        idle.enqueue(hold, "too", "few")  # tenant_of needs n: nothing is enqueued
    assert idle.count == 0
