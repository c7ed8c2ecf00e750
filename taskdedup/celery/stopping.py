"""A stopping worker takes out the held messages whose gated body already ran.

Celery's prefork pool, closing (``AsynPool.flush``: a warm shutdown, a consumer restart),
drops from its record a job it wrote to a pool process before it read that the process had
started it, expecting the broker to hand the message out again. The process runs the body
anyway, and nobody acks the message: the worker puts it back when it has finished stopping,
30 s later or more (billiard waits for the result nobody reads; the stop also waits for every
task still running). By then the lock's ``F`` tombstone, which tells this very message's copies
from a new call, may have lapsed (it lives one lease): the body would run a second time.

So, on the reliable fetch (SPEC §17), from the consumer's stop until its channel closes, and
once more as it closes, the worker looks every :data:`~taskdedup.celery.fetch.SWEEP_EVERY`
seconds at the messages it still holds: one whose lock is ``F`` or ``D`` by the message's own
task id has run, and leaves the processing list as its ack would have. That is what its claim
does with such a message on redelivery, done while the tombstone still says so. Only messages
that carry their lock key (every call made through taskdedup) and are due (not a countdown
still held) are read; one lock read each.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from celery import bootsteps
from kombu.utils.json import loads as kombu_loads

from ..core import Deduplicator
from ..stores.base import LockState
from . import fetch
from ._message import HEADER, carried_key
from .config import get_deduplicator

__all__ = ["SweepWhileStopping", "finished_among"]

_RAN = (LockState.FINISHED, LockState.DONE)


def finished_among(app: Any, raws: Sequence[bytes]) -> list[bytes]:
    """The messages among ``raws`` (as kombu's Redis transport stores them) whose gated body
    already finished: their lock is ``F`` or ``D`` by their own task id."""
    dedup = get_deduplicator(app)
    now = datetime.now(UTC)
    done = []
    for raw in raws:
        found = _gated(app, dedup, raw, now)
        if found is None:
            continue
        task_id, key = found
        info = dedup.store.get(key)
        if info is not None and info.owner == task_id and info.state in _RAN:
            done.append(raw)
    return done


def _gated(app: Any, dedup: Deduplicator, raw: bytes, now: datetime) -> tuple[str, str] | None:
    """``(task id, lock key)`` of a due message of an execution-gated task of ``app`` that
    carries a key this task could have made; else None (nothing to read)."""
    try:
        headers = kombu_loads(raw)["headers"]  # type: ignore[no-untyped-call]
    except Exception:
        return None
    if not isinstance(headers, Mapping):
        return None
    name, task_id = headers.get("task"), headers.get("id")
    if not isinstance(name, str) or not isinstance(task_id, str) or _later(headers.get("eta"),
                                                                           now):
        return None
    policy = getattr(app.tasks.get(name), "_dedup_policy", None)
    if policy is None or not policy.mode.gates_execution:
        return None
    carried = carried_key(headers.get(HEADER), name)
    key = None if carried is None else dedup.trusted_key(name, policy, carried)
    return None if key is None else (task_id, key)


def _later(eta: Any, now: datetime) -> bool:
    """Whether a message's ``eta`` header is still ahead (a countdown the worker holds: its
    body has not run)."""
    if not isinstance(eta, str):
        return False
    try:
        when = datetime.fromisoformat(eta)
    except ValueError:
        return False
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when > now


class SweepWhileStopping(bootsteps.StartStopStep):  # type: ignore[misc]
    """Consumer bootstep: as the consumer stops, the reliable fetch's owners of this process
    start taking out the held messages whose gated body already ran (see the module)."""

    requires = ("celery.worker.consumer.tasks:Tasks",)

    def stop(self, c: Any) -> None:
        app = c.app

        def finished(raws: Sequence[bytes]) -> list[bytes]:
            return finished_among(app, raws)

        fetch.sweep_while_stopping(finished)
