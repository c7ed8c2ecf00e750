"""Side effects and gates shared by the task bodies of every test app (Celery and RQ).

Bodies run in worker subprocesses; they record what they did in Redis (``RPUSH
effects:<label>``) so the test process can count executions across processes, and
``wait_gate`` holds a body until the test sets ``go:<label>`` (always with a deadline).
The server is ``TASKDEDUP_TEST_REDIS_URL``, which the test fixtures set for themselves and
pass to the workers.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import redis

_client: redis.Redis | None = None
_client_for: tuple[int, str] = (0, "")


def r() -> redis.Redis:
    """A client for this process and ``TASKDEDUP_TEST_REDIS_URL`` (a new one after a fork, or
    when a test module points the variable at a server of its own, e.g. tests/test_acl.py)."""
    global _client, _client_for
    url = os.environ.get("TASKDEDUP_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
    if _client is None or _client_for != (os.getpid(), url):
        _client, _client_for = redis.Redis.from_url(url), (os.getpid(), url)
    return _client


def effect(label: str, value: object = 1) -> None:
    r().rpush(f"effects:{label}", str(value))


def wait_gate(label: str, timeout: float = 120.0) -> None:
    """Block the body until the test sets ``go:<label>``; TimeoutError at the deadline."""
    deadline = time.monotonic() + timeout
    while not r().exists(f"go:{label}"):
        if time.monotonic() > deadline:
            raise TimeoutError(f"gate {label} never opened")
        time.sleep(0.01)


def recorded(client: redis.Redis, label: str) -> list[str]:
    """What the bodies of ``label`` recorded (``effect``), in order."""
    return [x.decode() for x in client.lrange(f"effects:{label}", 0, -1)]


def released(client: redis.Redis, key: str) -> bool:
    """Whether lock ``key`` no longer holds its identity: absent, or the tombstone a success
    leaves for the owner's own copies (``F|...``, free to every other call: SPEC §5)."""
    value = client.get(key)
    return value is None or value.startswith(b"F|")


def enqueue_figures(client: redis.Redis, task: str) -> tuple[int, int, int]:
    """``taskdedup stats``' accepted, duplicates and retries of ``task`` (zeros before any)."""
    from taskdedup.stats import read_stats

    found = read_stats(client, "taskdedup", task).get(task)
    return (0, 0, 0) if found is None else (found.accepted, found.duplicates, found.retries)


def flush_counts(dedup: object) -> bool:
    """Flush ``dedup``'s stats counters now. Not ``flush_all``: that also tries the recorders
    an earlier test module of this process left pointed at a server it has stopped."""
    from taskdedup.stats import attach

    recorder = attach(dedup)  # type: ignore[arg-type]
    return recorder is not None and recorder.flush()


def holds_for(seconds: float, check: Callable[[], None]) -> None:
    """``check()`` (which asserts) passes every 20 ms for ``seconds``: a state that must
    last (a lease renewed past its length), not one to wait for."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        check()
        time.sleep(0.02)
