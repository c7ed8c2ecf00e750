"""Per-key concurrency and rate limits across real Celery prefork workers (SPEC §16, issue
#23): two workers of two processes each on one queue, a real Redis.

- Concurrency: per key value, never more than ``limit`` bodies at once, every call runs, two
  key values run side by side; with ``dedup=`` and with ``dedup=False``.
- A SIGKILLed slot holder: the calls waiting for its slot run within the lease, one at a
  time, never beside it.
- Rate: no window of ``per`` seconds holds more than ``limit`` starts; the first ``limit``
  are not held back; ``on_excess="drop"`` ends FAILURE with RateLimitedError, counted.
- Operators: ``read_limits`` shows the slots in use and the calls waiting, per task.
"""

from __future__ import annotations

import itertools
import time
import uuid
from typing import Any

import pytest
import redis

from taskdedup import RateLimitedError
from taskdedup.limits import read_limits
from taskdedup.stats import read_stats
from taskdedup.testing import wait_for
from tests.limits_jobs import done, peak, rate_held, runs, started
from tests.pairs import celery_pair
from tests.workers import CeleryWorker

pytestmark = pytest.mark.slow

QUEUE = "it-limits"


class LimitsWorker(CeleryWorker):
    app_module = "tests.limits_app"


workers, capp = celery_pair(LimitsWorker, QUEUE)


def label() -> str:
    return uuid.uuid4().hex[:12]


@pytest.mark.parametrize("task_name", ["by_tenant", "by_tenant_nodedup"])
def test_concurrency_per_key_and_keys_side_by_side(
    capp: Any, rc: redis.Redis, task_name: str
) -> None:
    task = getattr(capp, task_name)
    limit = 2 if task_name == "by_tenant" else 1
    name = label()
    calls = [task.delay(name, tenant, n) for n in range(8) for tenant in ("acme", "globex")]
    assert all(c is not None for c in calls)
    wait_for(lambda: done(rc, name, 16), timeout=60, what="every call ran")
    finished = runs(rc, name)
    assert sorted((n, t) for n, t, _, _ in finished) == sorted(
        (n, t) for n in range(8) for t in ("acme", "globex"))  # each once, nothing lost
    assert peak(rc, name, "acme") == limit
    assert peak(rc, name, "globex") == limit
    assert peak(rc, name) > limit  # the two tenants ran side by side
    for c in calls:
        assert c.get(timeout=10) in range(8)
    for tenant in ("acme", "globex"):  # overlapping intervals, measured on Redis's clock
        spans = sorted((s, e) for _, t, s, e in finished if t == tenant)
        for i, (start, _) in enumerate(spans):
            overlapping = sum(1 for s, e in spans[:i] if e > start)
            assert overlapping < limit


def test_killed_holder_frees_its_slot_within_the_lease(
    capp: Any, rc: redis.Redis, redis_url: str, workers: list[CeleryWorker]
) -> None:
    """The holder runs on a worker of its own queue and is SIGKILLed there; the waiting calls
    (on the shared workers) run after the kill, within the lease (3 s), one at a time."""
    from tests import limits_app

    queue = f"{QUEUE}-kill-{label()}"
    victim = LimitsWorker(redis_url, queue=queue, concurrency=1).start()
    try:
        name = label()
        holder = limits_app.kill_one.apply_async((name, "acme", 0, 0.0, True), queue=queue)
        wait_for(lambda: len(started(rc, name)) == 1, timeout=30, what="the holder started")
        waiting = [limits_app.kill_one.apply_async((name, "acme", n, 0.2)) for n in (1, 2, 3)]
        other = limits_app.kill_one.apply_async((name, "globex", 9, 0.2))
        wait_for(lambda: 9 in {n for n, _, _, _ in runs(rc, name)}, timeout=30,
                 what="another key ran beside the held slot")
        wait_for(lambda: read_limits(rc, "taskdedup", limits_app.kill_one.name).get(
            limits_app.kill_one.name) is not None and read_limits(
            rc, "taskdedup", limits_app.kill_one.name)[limits_app.kill_one.name].waiting >= 1,
            timeout=10, what="the operators see waiting calls")
        time.sleep(1.0)
        assert {n for n, _ in started(rc, name)} == {0, 9}  # the others wait for the slot
        seconds, micros = rc.time()
        killed_ms = int(seconds) * 1000 + int(micros) // 1000
        victim.kill()
        killed_at = time.monotonic()
        wait_for(lambda: {n for n, _, _, _ in runs(rc, name)} >= {1, 2, 3}, timeout=30,
                 what="the waiting calls ran")
        # within the lease (3 s) and a put-off or two after it
        assert time.monotonic() - killed_at < 3 + 6
        spans = sorted((s, e) for n, _, s, e in runs(rc, name) if n in (1, 2, 3))
        assert all(s >= killed_ms for s, _ in spans)  # never beside the killed holder
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert start >= end  # one at a time
        for c in [*waiting, other]:
            assert c.get(timeout=10) in (1, 2, 3, 9)
        assert holder.id
    finally:
        victim.kill()


def test_rate_window_holds_no_more_than_limit_starts(capp: Any, rc: redis.Redis) -> None:
    name = label()
    sent = time.monotonic()
    calls = [capp.rate.delay(name, "acme", n) for n in range(9)]
    rate_held(rc, name, 9, limit=3, per_ms=2000, sent=sent)
    assert sorted(c.get(timeout=10) for c in calls) == list(range(9))


def test_excess_dropped_says_so_and_is_counted(capp: Any, rc: redis.Redis) -> None:
    name = label()
    first = capp.drop_rate.delay(name, "acme", 0)
    assert first.get(timeout=30) == 0
    dropped = [capp.drop_rate.delay(name, "acme", n) for n in (1, 2)]
    for result in dropped:
        with pytest.raises(RateLimitedError, match="dropped by its limit Rate"):
            result.get(timeout=30)
        assert result.state == "FAILURE"
    assert [n for n, _ in started(rc, name)] == [0]  # the dropped bodies never ran
    assert RateLimitedError in capp.drop_rate.throws  # an expected error: no traceback logged
    other = capp.drop_rate.delay(name, "globex", 5)  # another key has its own window
    assert other.get(timeout=30) == 5

    def counted() -> bool:
        stats = read_stats(rc, "taskdedup", capp.drop_rate.name).get(capp.drop_rate.name)
        return stats is not None and stats.get("dropped") >= 2

    wait_for(counted, timeout=20, what="the drops counted in taskdedup stats")


def test_a_call_put_off_never_shows_started(capp: Any, rc: redis.Redis) -> None:
    """``track_started``: the holder is STARTED; the call waiting for its slot stays PENDING
    (put off before STARTED is written), then runs once the slot is free."""
    name = label()
    holder = capp.tracked.delay(name, "acme", 0, 0.0, True)
    wait_for(lambda: holder.state == "STARTED", timeout=30, what="the holder STARTED")
    waiting = capp.tracked.delay(name, "acme", 1)

    def put_off() -> bool:
        figures = read_limits(rc, "taskdedup", capp.tracked.name).get(capp.tracked.name)
        return figures is not None and figures.waiting >= 1

    wait_for(put_off, timeout=20, what="the second call put off")
    assert waiting.state == "PENDING"
    rc.set(f"go:{name}:0", 1)
    assert holder.get(timeout=30) == 0 and waiting.get(timeout=30) == 1
    assert waiting.state == "SUCCESS"


def test_declaration_is_checked(capp: Any) -> None:
    from taskdedup import ConfigurationError, Rate
    from taskdedup.celery import DedupTask

    with pytest.raises(ConfigurationError, match="per must be"):
        Rate(1, per=0)
    with pytest.raises(ConfigurationError, match="limits= takes"):
        @capp.app.task(base=DedupTask, limits=["x"], name=f"bad.{label()}", lazy=False,
                       shared=False)  # a shared task would be declared again by every app
        def bad() -> None:
            pass
