"""SIGKILLs aimed at the moment after the pop (SPEC §17; issue #21).

kombu's fetch takes a message with ``BRPOP`` and records it unacked in a second round trip; a
worker killed in between loses it (about a millisecond: 32 of 197 kills aimed at it lost a
message on Celery/kombu 5.7). Here the kill is aimed, not hoped for: victims run with
``TASKDEDUP_TEST_PAUSE_AFTER_FETCH`` (tests/fetch_app.py), so their consumer stops right after a
message left its queue and before the QoS records it, and says so in ``fetch:popped``; the test
then SIGKILLs the whole worker (main process and pool). Victims come in batches started side by
side, each takes one message, half of them solo and half prefork. A survivor started after the
kills must run every message once:

* on the reliable fetch the popped message is in the victim's processing list: once the
  victim's lease (3 s) lapses, the survivor puts it back; **0 lost, 0 run twice**;
* on kombu's fetch the popped message is in no queue and no unacked hash: it is lost. That test
  is ``xfail(strict=False)``: it documents the window (and would pass on a kombu that closed it).

The default run aims 24 kills at the reliable fetch and 4 at kombu's (about 40 s on 2 cores).
The soak (``TASKDEDUP_SOAK_FETCH=<kills>``, e.g. 300) aims that many at the reliable fetch and a
quarter as many at kombu's; ``TASKDEDUP_SOAK_SEED`` replays a run's choice of pools.
"""

from __future__ import annotations

import os
import random
import time
import uuid
from typing import Any

import pytest
import redis

from taskdedup import processing
from taskdedup.testing import wait_for
from tests.fault_jobs import report
from tests.fetch_workers import (
    PREFIX,
    FetchWorker,
    clear_processing,
    held,
    ran,
    start_all,
    unacked,
)

SOAK = int(os.environ.get("TASKDEDUP_SOAK_FETCH", "0") or "0")
KILLS = SOAK or 24
KOMBU_KILLS = max(4, SOAK // 4)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300 + 4 * KILLS)]
BATCH = 6  # victims started side by side
PAUSE = {"TASKDEDUP_TEST_PAUSE_AFTER_FETCH": "60"}
VISIBILITY = {"TASKDEDUP_TEST_VISIBILITY": "2"}  # kombu's restore, were anything to restore


@pytest.fixture(scope="module")
def fapp(redis_url: str, rc: redis.Redis) -> Any:
    from tests import fetch_app

    fetch_app.configure(redis_url, "fetch")
    clear_processing(rc)
    return fetch_app


def aim(fapp: Any, rc: redis.Redis, redis_url: str, fetch: str, kills: int,
        rng: random.Random) -> dict[str, Any]:
    """``kills`` SIGKILLs, each at a worker paused right after it popped one message; then a
    survivor on the same fetch. Returns what became of the messages."""
    queue = f"aim-{fetch}-{uuid.uuid4().hex[:6]}"
    labels: list[str] = []
    ids: set[str] = set()
    pools: list[str] = []
    started = time.monotonic()
    while len(labels) < kills:
        count = min(BATCH, kills - len(labels))
        pools_now = [rng.choice(("solo", "prefork")) for _ in range(count)]
        victims = [FetchWorker(redis_url, queue=queue, fetch=fetch, pool=pool,
                               env={**PAUSE, **VISIBILITY}) for pool in pools_now]
        seen = rc.llen("fetch:popped")
        try:
            start_all(victims)
            batch = [f"a-{uuid.uuid4().hex[:10]}" for _ in range(count)]
            ids.update(fapp.work.apply_async((label,), queue=queue).id for label in batch)
            labels += batch

            def all_popped(expected: int = seen + count) -> bool:
                return int(rc.llen("fetch:popped")) >= expected

            try:
                wait_for(all_popped, timeout=30, what="every victim popped one message")
            except TimeoutError:
                raise AssertionError(
                    f"popped {rc.lrange('fetch:popped', seen, -1)} by {[v.pid for v in victims]}"
                    f"; queued {rc.llen(queue)}; {processing.holders(rc, PREFIX)}") from None
            popped = [x.decode().split() for x in rc.lrange("fetch:popped", seen, -1)]
            # one each; on the reliable fetch a victim may take a message an earlier victim
            # held (its heartbeat put back the dead ones' messages as it started)
            assert sorted(int(pid) for pid, _ in popped) == sorted(v.pid for v in victims)
            assert {task_id for _, task_id in popped} <= ids
        finally:
            for victim in victims:  # each paused right after its pop, before the QoS records it
                victim.kill()
        pools += pools_now
    killed_for = time.monotonic() - started
    survivor = FetchWorker(redis_url, queue=queue, fetch=fetch, pool="prefork", concurrency=2,
                           env=VISIBILITY).start()
    try:
        def settled() -> bool:
            return all(ran(rc, label) for label in labels)

        try:  # the reliable fetch: the victims' leases lapse (3 s), the survivor puts back
            wait_for(settled, timeout=30 if fetch == "reliable" else 8, interval=0.2,
                     what="every aimed message ran")
        except TimeoutError:
            pass  # counted as lost below
        wait_for(lambda: rc.llen(queue) == 0 and held(rc) == 0 and unacked(rc) == 0,
                 timeout=30, what="nothing left queued or held")
        time.sleep(1.0)  # one more heartbeat and restore: a late copy would show now
        counts = {label: ran(rc, label) for label in labels}
    finally:
        survivor.stop()
    figures = report(
        f"fetch_aimed_kills_{fetch}", kills=len(labels),
        solo=pools.count("solo"), prefork=pools.count("prefork"),
        lost=sum(1 for n in counts.values() if n == 0),
        run_twice=sum(1 for n in counts.values() if n > 1),
        ran_once=sum(1 for n in counts.values() if n == 1),
        seconds=round(time.monotonic() - started, 1), killing_seconds=round(killed_for, 1))
    assert not [h for h in processing.holders(rc, PREFIX) if h.held]
    return figures


def test_sigkills_aimed_after_the_pop_lose_nothing_on_the_reliable_fetch(
    fapp: Any, rc: redis.Redis, redis_url: str
) -> None:
    seed = int(os.environ.get("TASKDEDUP_SOAK_SEED") or random.randrange(1 << 30))
    print(f"\naimed kills, reliable fetch: seed {seed}")
    figures = aim(fapp, rc, redis_url, "reliable", KILLS, random.Random(seed))
    assert figures["lost"] == 0 and figures["run_twice"] == 0, (seed, figures)
    assert figures["ran_once"] == KILLS


@pytest.mark.xfail(strict=False, reason="kombu's fetch loses a message popped by a worker "
                   "killed before its unacked write (SPEC §17): what the reliable fetch closes")
def test_the_same_kills_on_kombus_fetch_lose_the_messages(
    fapp: Any, rc: redis.Redis, redis_url: str
) -> None:
    seed = int(os.environ.get("TASKDEDUP_SOAK_SEED") or random.randrange(1 << 30))
    print(f"\naimed kills, kombu's fetch: seed {seed}")
    figures = aim(fapp, rc, redis_url, "kombu", KOMBU_KILLS, random.Random(seed))
    assert figures["run_twice"] == 0
    assert figures["lost"] == 0, figures  # fails on kombu 5.3 to 5.7: every aimed kill loses
