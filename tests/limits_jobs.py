"""Bodies of the limits tests (SPEC §16), shared by the Celery app (tests.limits_app) and
the RQ jobs: each records its run in Redis so the test process can measure, across
processes, how many bodies of one key ran at once and when each started (Redis's clock).

- ``lim:peak:{label}:{tenant}`` / ``lim:peak:{label}``: the running count each body saw as it
  entered (INCR, so the largest value is the most bodies that ever ran at once);
- ``lim:runs:{label}``: ``n tenant start_ms end_ms`` per finished body;
- ``lim:started:{label}``: ``n start_ms`` per started body (a killed one included);
- ``lim:admitted:{label}``: ``n ms`` per body under a rate limit: when the rate script
  admitted it (its entry's score in the window, on Redis's clock: exact, unlike the body's
  own start, which comes a moment later).
"""

from __future__ import annotations

import os
import time

from taskdedup.testing import wait_for
from tests.effects import r, wait_gate

__all__ = ["admitted", "done", "hold", "peak", "rate_held", "runs", "started", "tenant_of"]


def tenant_of(label: str, tenant: str, n: int, seconds: float = 0.3, gate: bool = False) -> str:
    """The limits' key function: the tenant argument."""
    return tenant


def _now_ms() -> int:
    seconds, micros = r().time()
    return int(seconds) * 1000 + int(micros) // 1000


def hold(label: str, tenant: str, n: int, seconds: float = 0.3, gate: bool = False) -> int:
    client = r()
    start = _now_ms()
    client.rpush(f"lim:started:{label}", f"{n} {start}")
    client.set(f"lim:pid:{label}:{n}", os.getpid(), ex=600)
    admitted = _admitted_ms()
    if admitted is not None:
        client.rpush(f"lim:admitted:{label}", f"{n} {admitted}")
    client.rpush(f"lim:peak:{label}:{tenant}", client.incr(f"lim:active:{label}:{tenant}"))
    client.rpush(f"lim:peak:{label}", client.incr(f"lim:active:{label}"))
    try:
        if gate:
            wait_gate(f"{label}:{n}")
        time.sleep(seconds)
    finally:
        client.decr(f"lim:active:{label}:{tenant}")
        client.decr(f"lim:active:{label}")
    client.rpush(f"lim:runs:{label}", f"{n} {tenant} {start} {_now_ms()}")
    return n


def _current_id() -> str | None:
    """The running Celery task's id or RQ job's id (None outside both)."""
    from rq import get_current_job

    job = get_current_job()
    if job is not None:
        return str(job.id)
    from celery._state import get_current_task

    task = get_current_task()
    return None if task is None or not task.request.id else str(task.request.id)


def _admitted_ms() -> int | None:
    """The score of this execution's start in a rate limit's window (None: no rate limit)."""
    call_id = _current_id()
    if call_id is None:
        return None
    client = r()
    for key in client.scan_iter(match="taskdedup:limit:*", count=1000):
        if b"r:{" not in key:
            continue
        for _member, score in client.zscan_iter(key, match=f"{call_id}~*"):
            return int(score)
    return None


def admitted(client, label: str) -> list[int]:  # type: ignore[no-untyped-def]
    return sorted(int(raw.split()[1]) for raw in client.lrange(f"lim:admitted:{label}", 0, -1))


def peak(client, label: str, tenant: str | None = None) -> int:  # type: ignore[no-untyped-def]
    key = f"lim:peak:{label}" + (f":{tenant}" if tenant is not None else "")
    return max((int(x) for x in client.lrange(key, 0, -1)), default=0)


def runs(client, label: str) -> list[tuple[int, str, int, int]]:  # type: ignore[no-untyped-def]
    out = []
    for raw in client.lrange(f"lim:runs:{label}", 0, -1):
        n, tenant, start, end = raw.decode().split()
        out.append((int(n), tenant, int(start), int(end)))
    return out


def started(client, label: str) -> list[tuple[int, int]]:  # type: ignore[no-untyped-def]
    out = []
    for raw in client.lrange(f"lim:started:{label}", 0, -1):
        n, start = raw.decode().split()
        out.append((int(n), int(start)))
    return out


def done(client, label: str, count: int) -> bool:  # type: ignore[no-untyped-def]
    """At least ``count`` bodies of ``label`` finished."""
    return bool(client.llen(f"lim:runs:{label}") >= count)


def rate_held(  # type: ignore[no-untyped-def]
    client, label: str, count: int, limit: int, per_ms: int, sent: float
) -> None:
    """The test side of a rate limit of ``limit`` starts per ``per_ms``: the first ``limit``
    of ``count`` calls sent at ``sent`` (monotonic) start at once (within 5 s), all of them
    run, and no window of ``per_ms`` holds more than ``limit`` starts (Redis's clock)."""
    wait_for(lambda: len(started(client, label)) >= limit, timeout=30, what="the first starts")
    assert time.monotonic() - sent < 5  # the first `limit` are not held back
    wait_for(lambda: done(client, label, count), timeout=60, what="every call ran")
    starts = admitted(client, label)  # each start's time in the window, on Redis's clock
    assert len(starts) == count
    for i in range(len(starts) - limit):  # a window never holds a (limit + 1)th start
        assert starts[i + limit] - starts[i] >= per_ms, starts
