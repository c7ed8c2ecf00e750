"""Coalesce with real Celery prefork workers (two workers of two processes each; SPEC §15,
issue #22 part 2): a duplicate of a queued call gets the original's handle; duplicates of a
running call become one follow-up (one handle, a new id) that runs once after it, with the
latest call's arguments, and reaches SUCCESS with its own result — also through a success
window (``until_expired``); at most one running and one waiting per identity."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import redis

from taskdedup import stats
from taskdedup.stats import read_stats
from taskdedup.testing import wait_for
from tests.effects import recorded
from tests.pairs import celery_pair
from tests.workers import CeleryWorker

pytestmark = pytest.mark.slow

QUEUE = "it-coalesce"


class FlowWorker(CeleryWorker):
    app_module = "tests.flow_app"


workers, capp = celery_pair(FlowWorker, QUEUE)


@pytest.fixture(scope="module")
def fused(redis_url: str, capp: Any) -> Any:
    """A producer app whose broker is the lock Redis (no taskdedup_url): its gated publishes
    reserve inside the push (one round trip), the coalesce gate included; the same task
    names and policies as tests.flow_app, run by the module's workers."""
    from celery import Celery

    from taskdedup.celery import DedupTask
    from taskdedup.celery.config import fuses
    from tests.flow_jobs import run

    app = Celery("flow-producer", broker=redis_url, backend=redis_url, set_as_current=False)
    app.conf.update(task_default_queue=QUEUE, result_expires=600)
    tasks = {name: app.task(base=DedupTask, dedup=getattr(capp, name)._dedup_policy,
                            name=getattr(capp, name).name, shared=False)(run)
             for name in ("coalesced", "coalesced_window")}
    assert fuses(app)
    return tasks


def label() -> str:
    return uuid.uuid4().hex[:12]


def started(rc: redis.Redis, name: str, n: int) -> Any:
    return lambda: f"start{n}" in recorded(rc, name)


def coalesced_count(rc: redis.Redis, task: str) -> int:
    """``duplicate:coalesced`` of ``task``, as this process (the producer) flushed it."""
    stats.flush_all()
    found = read_stats(rc, task=f"tests.flow_app.{task}")
    return sum(s.get("duplicate:coalesced") for s in found.values())


@pytest.mark.parametrize("producer", ["separate", "fused"])
@pytest.mark.parametrize("task", ["coalesced", "coalesced_window"])
def test_duplicates_of_a_running_call_become_one_follow_up_with_the_latest_arguments(
    capp: Any, fused: Any, rc: redis.Redis, workers: list[CeleryWorker], task: str,
    producer: str,
) -> None:
    """The first call runs (held by its gate); five duplicates get one follow-up handle, not
    the running id; the follow-up runs once, after the first, with the last call's argument,
    and its handle reaches SUCCESS with that run's result. Nothing runs beside anything; the
    five are counted as coalesced. Published with the gate in a round trip of its own
    (the test app names a lock URL) and inside the push (a producer on the lock Redis)."""
    name = label()
    t = getattr(capp, task) if producer == "separate" else fused[task]
    before = coalesced_count(rc, task)
    first = t.delay(name, 0, name)
    wait_for(started(rc, name, 0), timeout=30, what="the first call runs")
    handles = [t.delay(name, n) for n in range(1, 6)]
    ids = {h.id for h in handles}
    assert len(ids) == 1 and first.id not in ids  # one follow-up, a new id
    rc.set(f"go:{name}", 1)
    assert first.get(timeout=30) == 0
    assert handles[0].get(timeout=60) == 5  # the latest call's arguments
    assert handles[0].state == "SUCCESS"
    runs = recorded(rc, name)
    assert runs == ["start0", "end0", "start5", "end5"], runs
    assert coalesced_count(rc, task) == before + 5


def test_a_duplicate_of_a_queued_call_gets_the_original(
    capp: Any, rc: redis.Redis, workers: list[CeleryWorker]
) -> None:
    """Queued (not yet running: a countdown holds it) → the original's handle, nothing sent."""
    name = label()
    first = capp.coalesced.apply_async((name, 0), countdown=2)
    again = capp.coalesced.delay(name, 1)
    assert again.id == first.id
    assert first.get(timeout=30) == 0
    assert recorded(rc, name) == ["start0", "end0"]


def test_at_most_one_running_and_one_waiting_then_the_next_follow_up(
    capp: Any, rc: redis.Redis, workers: list[CeleryWorker]
) -> None:
    """While the follow-up runs (held by a gate of its own), new duplicates make the *next*
    follow-up (another id), which runs after it with its own latest argument."""
    name = label()
    first = capp.coalesced.delay(name, 0, f"{name}-a")
    wait_for(started(rc, name, 0), timeout=30, what="the first call runs")
    follow = capp.coalesced.delay(name, 1, f"{name}-b")
    rc.set(f"go:{name}-a", 1)
    assert first.get(timeout=30) == 0
    wait_for(started(rc, name, 1), timeout=30, what="the follow-up runs")
    later = [capp.coalesced.delay(name, n) for n in (2, 3, 4)]
    assert len({h.id for h in later}) == 1
    assert later[0].id not in (first.id, follow.id)
    rc.set(f"go:{name}-b", 1)
    assert follow.get(timeout=30) == 1
    assert later[0].get(timeout=60) == 4
    runs = recorded(rc, name)
    assert runs == ["start0", "end0", "start1", "end1", "start4", "end4"], runs
