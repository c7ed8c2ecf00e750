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
    "key_bytes",
    "key_name",
    "key_text",
    "lock_key_error",
    "lock_pattern",
    "one_line",
    "raise_errors",
    "read_locks",
    "redis_error_text",
    "scan_keys",
    "shown",
    "split_key",
    "to_lock",
    "ttl_text",
]

_SCAN_COUNT: Final = 1000
_BATCH: Final = 500
_STATE_NAMES: Final = {"Q": "queued", "R": "running", "D": "done", "F": "finished"}
# The last segment of a lock key: a digest, or an approximate window's hash tag and digest.
_LOCK_DIGEST: Final = re.compile(r"(?:\{[^{}:]*\})?[0-9a-f]{32}")
# What a terminal must never receive raw: C0/C1 controls and DEL, undecodable bytes (lone
# surrogates from surrogateescape), line/paragraph separators and bidirectional overrides.
_UNSAFE: Final = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff\u2028\u2029"
                            "\u202a-\u202e\u2066-\u2069]")


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


def split_key(prefix: str, key: str, task: str | None = None,
              scope: str | None = None) -> tuple[str, str, str] | None:
    """``(scope, task, digest)`` of a lock key ``{prefix}[:{scope}]:{task}:{digest}``, else None.

    The digest is 32 lowercase hex digits, after an approximate window's hash tag
    (``{tag.partition}``) when there is one. With ``task``, only a lock of exactly that task
    (in ``scope``, or unscoped without one) matches: ``{prefix}:billing:charge:…`` is not a
    lock of task ``charge`` (it is scope ``billing``'s, or a task named ``billing:charge``;
    the key cannot tell, so neither is ever taken for the other). Without ``task`` the name
    is read for display: the first of two or more segments as the scope.
    """
    head = prefix + ":"
    if not key.startswith(head):
        return None
    middle, sep, digest = key[len(head):].rpartition(":")
    if not sep or not middle or not _LOCK_DIGEST.fullmatch(digest):
        return None
    if task is not None:
        if middle != key_name(task, scope):
            return None
        return scope or "", task, digest
    first, sep, name = middle.partition(":")
    return (first, name, digest) if sep and first and name else ("", middle, digest)


def key_name(task: str, scope: str | None = None) -> str:
    """The name part of a lock key between the prefix and the digest: ``scope:task``."""
    return f"{scope}:{task}" if scope else task


def lock_key_error(prefix: str, key: str) -> str | None:
    """Why ``key`` is not a lock key under ``prefix`` (None when it is one): the CLI's
    ``inspect`` and ``clear --key`` and the dashboard never touch a key outside the prefix."""
    if split_key(prefix, key) is not None:
        return None
    return (f"{shown(key)!r} is not a lock key (lock keys are {prefix}:[SCOPE:]TASK:DIGEST, "
            f"under {prefix + ':'!r})")


def _wrong_type(reply: Any) -> bool:
    """Whether ``reply`` is Redis's WRONGTYPE error: the key holds something else (a hash)."""
    return isinstance(reply, redis.ResponseError) and str(reply).startswith("WRONGTYPE")


def raise_errors(replies: Iterable[Any]) -> None:
    """Raise the first error among pipeline ``replies``, WRONGTYPE excepted."""
    for reply in replies:
        if isinstance(reply, Exception) and not _wrong_type(reply):
            raise reply


def to_lock(prefix: str, key: str, value: Any, pttl: Any, task: str | None,
            scope: str | None = None) -> Lock | None:
    """A :class:`Lock` from a GET reply and a PTTL reply; None when it is not a lock (of
    ``task`` in ``scope``)."""
    if _wrong_type(value):
        return None  # another type (a stats hash): not a lock
    parsed = parse_value(value)
    if parsed is None:
        return None
    parts = split_key(prefix, key, task, scope)
    if parts is None:
        return None  # not a lock key under the prefix (of that task)
    state, check, owner = parsed
    return Lock(key, parts[1], parts[0], parts[2], _STATE_NAMES[state.value], owner, check,
                 int(pttl))


def key_text(value: bytes | str) -> str:
    """A key or value as text; undecodable bytes survive a round trip (surrogateescape)."""
    return value.decode("utf-8", "surrogateescape") if isinstance(value, bytes) else value


def key_bytes(key: str) -> bytes:
    """``key`` as Redis has it: the bytes :func:`key_text` decoded, undecodable ones too (a
    str with lone surrogates cannot be sent as text)."""
    return key.encode("utf-8", "surrogateescape")


def shown(text: object) -> str:
    """``text`` safe for a terminal: control characters, undecodable bytes and bidirectional
    overrides written as escapes (``\\x1b``, ``\\xff``, ``\\u202e``). A value read from Redis
    may hold anything; printed raw it could drive the operator's terminal."""
    return _UNSAFE.sub(_escape, str(text))


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    if 0xDC80 <= code <= 0xDCFF:  # an undecodable byte kept by surrogateescape
        return f"\\x{code - 0xDC00:02x}"
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


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
    client: redis.Redis, prefix: str, keys: Sequence[str], task: str | None = None,
    scope: str | None = None,
) -> list[Lock]:
    """GET and PTTL every key in one pipelined round trip; the locks (of ``task`` in
    ``scope``) among them."""
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.get(key_bytes(key))
        pipe.pttl(key_bytes(key))
    replies = pipe.execute(raise_on_error=False)
    raise_errors(replies)
    locks = []
    for index, key in enumerate(keys):
        lock = to_lock(prefix, key, replies[2 * index], replies[2 * index + 1], task, scope)
        if lock is not None:
            locks.append(lock)
    return locks


def lock_pattern(prefix: str, task: str | None, scope: str | None = None) -> str:
    """SCAN pattern for the locks of ``task`` in ``scope`` (every glob character escaped; a
    superset — ``{task}:sub`` too — filtered exactly by :func:`split_key` after reading)."""
    if task is None:
        return glob_escape(prefix) + ":*"
    return f"{glob_escape(prefix)}:{glob_escape(key_name(task, scope))}:*"


def iter_locks(
    client: redis.Redis, prefix: str, task: str | None, scope: str | None = None
) -> Iterator[Lock]:
    """Every lock under ``prefix`` (of ``task`` in ``scope``), by SCAN and pipelined reads."""
    for batch in batches(scan_keys(client, lock_pattern(prefix, task, scope))):
        yield from read_locks(client, prefix, batch, task, scope)


def delete_locks(client: redis.Redis, prefix: str, keys: Sequence[str], task: str | None,
                 scope: str | None = None) -> int:
    """DEL those of ``keys`` that are locks under ``prefix`` (of ``task`` in ``scope``); how
    many were deleted. A key outside the prefix, or holding anything but a lock, is kept."""
    locks = read_locks(client, prefix, keys, task, scope)
    if not locks:
        return 0
    pipe = client.pipeline(transaction=False)
    for lock in locks:
        pipe.delete(key_bytes(lock.key))
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
