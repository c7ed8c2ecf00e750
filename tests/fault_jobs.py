"""Jobs and helpers for the fault tests (``tests/test_faults_*.py``).

Imported by the test process, by ``rq worker`` subprocesses and by the race processes
(spawned), so everything here is importable and light. Every body records what happened in
Redis, on the server named by ``TASKDEDUP_TEST_REDIS_URL``::

    RPUSH fx:<label> "start:<job id>:<pid>"   when the body starts
    RPUSH fx:<label> "end:<job id>"           when it ends

so a test counts, per identity, how many bodies started and how many completed — across
processes that may be killed at any moment. ``go:<label>`` opens the gate a gated body waits
at (with a deadline).

:func:`report` prints one line of figures per fault test (``[taskdedup figures] {...}``) and,
when ``TASKDEDUP_FIGURES`` names a file, appends it there as JSON (docs/reliability.md is
written from those lines). ``TASKDEDUP_SOAK=N`` multiplies the number of faults the tests
inject (default 1: the short version that runs in the default suite).
"""

from __future__ import annotations

import json
import os
from typing import Any

import redis

from taskdedup import Policy
from taskdedup.core import Deduplicator, Identity
from taskdedup.stores import RedisStore
from tests.effects import effect, r, wait_gate  # noqa: F401 (re-exported)

SCALE = max(1, int(os.environ.get("TASKDEDUP_SOAK", "1") or "1"))
"""How many times the default number of faults to inject (``TASKDEDUP_SOAK``)."""

def _job_id() -> str:
    from rq import get_current_job

    job = get_current_job()
    return job.id if job is not None else "?"


def work(label: str, gated: bool = False) -> str:
    """An RQ body: records its start, waits at its gate if ``gated``, records its end."""
    job_id = _job_id()
    r().rpush(f"fx:{label}", f"start:{job_id}:{os.getpid()}")
    if gated:
        wait_gate(label)
    r().rpush(f"fx:{label}", f"end:{job_id}")
    return label


# -- accounting --------------------------------------------------------------------------------


def effects(client: redis.Redis, label: str) -> list[str]:
    return [x.decode() for x in client.lrange(f"fx:{label}", 0, -1)]


def starts(client: redis.Redis, label: str) -> list[str]:
    """``[job id, ...]`` of the bodies of ``label`` that started."""
    return [e.split(":")[1] for e in effects(client, label) if e.startswith("start:")]


def ends(client: redis.Redis, label: str) -> list[str]:
    """``[job id, ...]`` of the bodies of ``label`` that completed."""
    return [e.split(":")[1] for e in effects(client, label) if e.startswith("end:")]


def start_pids(client: redis.Redis, label: str) -> list[int]:
    return [int(e.rsplit(":", 1)[1]) for e in effects(client, label) if e.startswith("start:")]


def report(fault: str, **figures: Any) -> dict[str, Any]:
    """Print (and append to ``$TASKDEDUP_FIGURES``) one line of figures for ``fault``."""
    line = {"fault": fault, **figures}
    text = json.dumps(line, sort_keys=False)
    print(f"\n[taskdedup figures] {text}")
    path = os.environ.get("TASKDEDUP_FIGURES")
    if path:
        with open(path, "a", encoding="utf-8") as out:
            out.write(text + "\n")
    return line


# -- races (run in spawned processes) -------------------------------------------------------


def race(
    url: str, index: int, rounds: int, prefix: str, transition: str, barrier: Any, results: Any
) -> None:
    """One racer: for each round, wait at ``barrier`` then reserve (``gate``) or ``claim``
    the round's identity as owner ``p<index>-r<round>``; put ``(index, outcomes)`` on
    ``results``, outcomes being ``(round, accepted, existing owner)``."""
    store = RedisStore.from_url(url)
    dedup = Deduplicator(store)
    policy = Policy(ttl=60, lease=60)
    outcomes: list[tuple[int, bool, str | None]] = []
    try:
        for round_ in range(rounds):
            key = f"taskdedup:race:{prefix}:{round_}"
            owner = f"p{index}-r{round_}"
            barrier.wait(timeout=60)
            if transition == "reserve":
                gated = dedup.gate("race", policy, Identity(key), owner)
                outcomes.append((round_, gated.verdict.value == "accepted", gated.existing_id))
            else:
                claimed = store.claim(key, owner, policy.lease_ms)
                outcomes.append((round_, claimed.outcome.name == "ACQUIRED", claimed.owner))
    finally:
        results.put((index, outcomes))
        store.close()
