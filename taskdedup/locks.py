"""Locks as operators see them: found by SCAN (never KEYS), read and deleted in pipelined
batches, parsed into :class:`Lock`; and a Redis failure told in one line. Shared by the
``taskdedup`` command and the ``taskdedup web`` dashboard; argument values are never read
(a lock holds its state, owner id and a digest only).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final

import redis
from redis.exceptions import AuthenticationError, NoPermissionError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .stores.memory import parse_value

__all__ = [
    "Lock",
    "batches",
    "delete_locks",
    "glob_escape",
    "iter_locks",
    "key_text",
    "lock_pattern",
    "one_line",
    "raise_errors",
    "read_locks",
    "redis_error_text",
    "scan_keys",
    "split_key",
    "to_lock",
    "ttl_text",
]

_SCAN_COUNT: Final = 1000
_BATCH: Final = 500
_STATE_NAMES: Final = {"Q": "queued", "R": "running", "D": "done"}


@dataclass(frozen=True, slots=True)
class Lock:
    """One lock as read from Redis."""

    key: str
    task: str
    scope: str
    digest: str
    state: str
    owner: str
    check: str
    ttl_ms: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "task": self.task,
            "scope": self.scope or None,
            "digest": self.digest,
            "state": self.state,
            "owner": self.owner,
            "ttl_ms": self.ttl_ms,
            "idempotency_check": bool(self.check),
        }


def split_key(prefix: str, key: str, task: str | None = None) -> tuple[str, str, str] | None:
    """``(scope, task, digest)`` of ``{prefix}[:{scope}]:{task}:{digest}``, else None.

    A scope never contains ``:``, a task name may; without a known ``task`` the first of
    two or more middle segments is read as the scope.
    """
    head = prefix + ":"
    if not key.startswith(head):
        return None
    middle, sep, digest = key[len(head):].rpartition(":")
    if not sep or not middle:
        return None
    if task is not None:
        if middle == task:
            return "", task, digest
        scope = middle[: -len(task) - 1]
        if middle.endswith(":" + task) and scope and ":" not in scope:
            return scope, task, digest
        return None
    scope, sep, name = middle.partition(":")
    return (scope, name, digest) if sep else ("", middle, digest)


def _wrong_type(reply: Any) -> bool:
    """Whether ``reply`` is Redis's WRONGTYPE error: the key holds something else (a hash)."""
    return isinstance(reply, redis.ResponseError) and str(reply).startswith("WRONGTYPE")


def raise_errors(replies: Iterable[Any]) -> None:
    """Raise the first error among pipeline ``replies``, WRONGTYPE excepted."""
    for reply in replies:
        if isinstance(reply, Exception) and not _wrong_type(reply):
            raise reply


def to_lock(prefix: str, key: str, value: Any, pttl: Any, task: str | None) -> Lock | None:
    """A :class:`Lock` from a GET reply and a PTTL reply; None when it is not a lock (of
    ``task``)."""
    if _wrong_type(value):
        return None  # another type (a stats hash): not a lock
    parsed = parse_value(value)
    if parsed is None:
        return None
    parts = split_key(prefix, key, task)
    if parts is None:
        if task is not None:
            return None
        parts = ("", "", "")
    state, check, owner = parsed
    return Lock(key, parts[1], parts[0], parts[2], _STATE_NAMES[state.value], owner, check,
                 int(pttl))


def key_text(value: bytes | str) -> str:
    """A key or value as text; undecodable bytes survive a round trip (surrogateescape)."""
    return value.decode("utf-8", "surrogateescape") if isinstance(value, bytes) else value


def glob_escape(text: str) -> str:
    """``text`` matched literally in a SCAN pattern."""
    return re.sub(r"([\\*?\[\]])", r"\\\1", text)


def scan_keys(client: redis.Redis, pattern: str) -> Iterator[str]:
    """Keys matching ``pattern`` by SCAN (never KEYS)."""
    for key in client.scan_iter(match=pattern, count=_SCAN_COUNT):
        yield key_text(key)


def batches(keys: Iterable[str], size: int = _BATCH) -> Iterator[list[str]]:
    """``keys`` in lists of at most ``size``: one pipelined round trip each."""
    batch: list[str] = []
    for key in keys:
        batch.append(key)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


def read_locks(
    client: redis.Redis, prefix: str, keys: Sequence[str], task: str | None = None
) -> list[Lock]:
    """GET and PTTL every key in one pipelined round trip; the locks (of ``task``) among them."""
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.get(key)
        pipe.pttl(key)
    replies = pipe.execute(raise_on_error=False)
    raise_errors(replies)
    locks = []
    for index, key in enumerate(keys):
        lock = to_lock(prefix, key, replies[2 * index], replies[2 * index + 1], task)
        if lock is not None:
            locks.append(lock)
    return locks


def lock_pattern(prefix: str, task: str | None) -> str:
    """SCAN pattern for the locks of ``task`` (a superset, filtered after reading)."""
    if task is None:
        return glob_escape(prefix) + ":*"
    return f"{glob_escape(prefix)}:*{glob_escape(task)}:*"


def iter_locks(client: redis.Redis, prefix: str, task: str | None) -> Iterator[Lock]:
    """Every lock under ``prefix`` (of ``task``), by SCAN and pipelined reads."""
    for batch in batches(scan_keys(client, lock_pattern(prefix, task))):
        yield from read_locks(client, prefix, batch, task)


# -- key ---------------------------------------------------------------------------------------



def delete_locks(client: redis.Redis, prefix: str, keys: Sequence[str], task: str | None) -> int:
    """DEL those of ``keys`` that are locks (of ``task``); how many were deleted."""
    locks = read_locks(client, prefix, keys, task)
    if not locks:
        return 0
    pipe = client.pipeline(transaction=False)
    for lock in locks:
        pipe.delete(lock.key)
    return sum(int(n) for n in pipe.execute())



def ttl_text(ttl_ms: int) -> str:
    """A PTTL reply for people: ``12.3s``, ``no expiry``, or ``-`` (no such key)."""
    if ttl_ms == -1:
        return "no expiry"
    if ttl_ms < 0:
        return "-"
    return f"{ttl_ms / 1000:.1f}s"




# -- Redis errors in one line ------------------------------------------------------------------


def redis_error_text(where: str, exc: redis.RedisError) -> str:
    """One line for an operator: what went wrong with Redis at ``where`` (no traceback)."""
    if isinstance(exc, AuthenticationError):
        return f"Redis at {where} refused the credentials: {one_line(exc)}"
    if isinstance(exc, (RedisConnectionError, RedisTimeoutError)):
        return f"cannot reach Redis at {where}: {_reason(exc)}"
    if isinstance(exc, NoPermissionError):
        return f"the Redis user at {where} lacks a permission: {one_line(exc)}"
    return f"Redis at {where} answered with an error: {one_line(exc)}"


def _reason(exc: BaseException) -> str:
    """The operating system's words for a connection failure, e.g. ``Connection refused``."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, TimeoutError):
            return "timed out"
        if isinstance(current, OSError) and current.strerror:
            return current.strerror
        current = current.__cause__ or current.__context__
    return one_line(exc)


def one_line(exc: BaseException) -> str:
    """An exception's message on one line (its type when it has none)."""
    text = " ".join(str(exc).split())
    return text or type(exc).__name__
